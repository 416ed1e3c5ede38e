"""docs/configuration.md is generated from conf/, and every option and key in conf/ says what it does."""

import re
from pathlib import Path

from ddpm.config.doc import DOC, load, render, undocumented


def test_every_option_and_key_is_documented() -> None:
    missing = undocumented()
    assert not missing, (
        "add a header comment to each option file and a comment to each key (end of line or the line above):\n  "
        + "\n  ".join(missing)
    )


def test_configuration_md_is_up_to_date() -> None:
    assert DOC.is_file() and DOC.read_text() == render(), "docs/configuration.md is stale: python -m ddpm.config.doc"


def test_a_new_undocumented_option_or_key_is_caught(tmp_path: Path) -> None:
    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "sgd.yaml").write_text("_target_: torch.optim.SGD\nlr: 0.1   # step size\nmomentum: 0.9\n")
    (tmp_path / "optim" / "adam.yaml").write_text(
        "# Adam, documented.\n_target_: ddpm.optim.AdamW\nbetas: [0.9, 0.999]\nsecret: 3\n"
    )
    (tmp_path / "train.yaml").write_text("# Entry.\ndefaults:\n  - optim: adam\n# the seed\nseed: 1\n")
    (tmp_path / "experiment").mkdir()  # a _global_ file: its keys of other groups are documented there
    (tmp_path / "experiment" / "quick.yaml").write_text("# @package _global_\n# Quick.\noptim:\n  lr: 0.2\nnote: 1\n")
    files = load(tmp_path)
    assert sorted(undocumented(files)) == [
        "conf/experiment/quick.yaml: note",  # a key of no group, not commented: as in any other file
        "conf/optim/adam.yaml: secret",  # no comment, and AdamW has no argument `secret`
        "conf/optim/sgd.yaml",  # no header comment
    ]  # momentum: from torch.optim.SGD's docstring; betas: from AdamW's source comment; seed: the line above
    text = render(files)
    assert "| `seed` | `1` | the seed |" in text and "`optim=sgd`" in text
    assert "Adam's beta1, beta2" in text  # ddpm.optim.AdamW's field comment


def test_readme_group_table_lists_every_option_in_conf() -> None:
    """README.md's table of config groups names each option file of each group it lists (a new recipe, model or data
    config otherwise goes unmentioned where a newcomer looks first)."""
    repo = Path(__file__).resolve().parents[1]
    rows = re.findall(r"^\| `([\w/]+)`(?: \([\w.]+\))? \| (.*?) \|", (repo / "README.md").read_text(), flags=re.M)
    assert len(rows) >= 10, "README.md's group table not found"
    stale = {}
    for group, options in rows:
        listed = set(re.findall(r"`(\w+)`", options))
        present = {path.stem for path in (repo / "conf" / group).glob("*.yaml")}
        if listed != present:
            stale[group] = {"missing": sorted(present - listed), "not in conf": sorted(listed - present)}
    assert not stale, f"README.md's group table differs from conf/: {stale}"


def test_an_experiments_note_does_not_stand_beside_the_other_experiments_values() -> None:
    """A key several experiments set is described in its own group's words unless every experiment says the same:
    mnist_latent's "3,400 steps of 32 images" and the digits' EMA warm-up note stood beside cifar10's values."""
    lines = render().splitlines()
    row = lambda start: next(line for line in lines if line.startswith(start))  # noqa: E731
    assert row("| `data.batch_size` | `128` |").endswith("| per device |")
    assert row("| `ema.decay` | `0.9999` |").endswith("| target EMA decay |")


def test_a_search_space_key_the_studies_explain_differently_shows_each_studys_words() -> None:
    """hparams_search's table showed mnist_quality's "inert" note on ema.decay beside optuna's values, which differ."""
    row = next(line for line in render().splitlines() if line.startswith("| `hydra.sweeper.params.ema.decay` |"))
    assert "mnist_quality: inert" in row and "optuna: EMA of the weights" in row
