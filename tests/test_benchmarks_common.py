"""benchmarks/common.py against independent truth: the interleaving order written out by hand, medians from
statistics.median, paired ratios computed by hand, the dirty-tree refusal in a real temporary git repository,
and the script hashes from hashlib."""

import argparse
import hashlib
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

COMMON = REPO / "benchmarks" / "common.py"


def load_common():
    if "common" in sys.modules:  # the same file, already imported by a benchmark under test
        return sys.modules["common"]
    spec = importlib.util.spec_from_file_location("common", COMMON)
    module = importlib.util.module_from_spec(spec)
    sys.modules["common"] = module
    spec.loader.exec_module(module)
    return module


common = load_common()


def test_rows_interleave_abc_cba_abc() -> None:
    expected = [(0, "A"), (0, "B"), (0, "C"), (1, "C"), (1, "B"), (1, "A"), (2, "A"), (2, "B"), (2, "C")]
    assert common.interleaved(["A", "B", "C"], 3) == expected
    calls = []
    runs = common.run_interleaved(["A", "B", "C"], 3, lambda name, repeat: calls.append((repeat, name)) or repeat)
    assert calls == expected
    assert runs == {"A": [0, 1, 2], "B": [0, 1, 2], "C": [0, 1, 2]}


@pytest.mark.parametrize(
    "values", [[3.0, 1.0, 2.0], [4.0, 1.0, 3.0, 2.0], [5.0, 9.0], [7.0], [2.0, 2.0, 8.0, 1.0, 6.0, 3.0]]
)
def test_true_median_min_max(values: list[float]) -> None:
    s = common.stats(values)
    assert s["median"] == statistics.median(values)
    assert (s["min"], s["max"], s["runs"]) == (min(values), max(values), values)


def test_even_count_median_is_the_mean_of_the_middle_two_not_the_upper_one() -> None:
    assert common.stats([10.0, 30.0])["median"] == 20.0  # the upper median would say 30
    assert common.stats([1.0, 2.0, 4.0, 100.0])["median"] == 3.0


def test_paired_ratios_per_repeat_against_the_baseline() -> None:
    runs = {"base": [10.0, 20.0, 40.0, 50.0], "fast": [25.0, 40.0, 60.0, 100.0], "slow": [5.0, 10.0, 30.0, 20.0]}
    ratios = common.paired_ratios(runs, "base")
    assert ratios["fast"]["runs"] == pytest.approx([2.5, 2.0, 1.5, 2.0])
    assert ratios["fast"]["median"] == pytest.approx(2.0)  # sorted 1.5, 2.0, 2.0, 2.5: mean of 2.0 and 2.0
    assert (ratios["fast"]["min"], ratios["fast"]["max"]) == pytest.approx((1.5, 2.5))
    assert ratios["slow"]["runs"] == pytest.approx([0.5, 0.5, 0.75, 0.4])
    assert ratios["slow"]["median"] == pytest.approx(0.5)
    assert ratios["base"]["runs"] == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError):  # a row with a missing repeat cannot be paired
        common.paired_ratios({"base": [1.0, 2.0], "short": [1.0]}, "base")


def test_rows_parser_names_the_unknown_and_the_choices() -> None:
    assert common.parse_rows(" a, c ", ["a", "b", "c"]) == ["a", "c"]
    with pytest.raises(ValueError, match=r"unknown \['x'\].*a, b"):
        common.parse_rows("a,x", ["a", "b"])


def git(repo: Path, *argv: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=repo, check=True,
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A committed repository: a script, an ignored folder, a results folder."""
    (tmp_path / "bench.py").write_text("print('measured')\n")
    (tmp_path / ".gitignore").write_text("outputs/\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "old.json").write_text("{}\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def start(repo: Path, *argv: str):
    parser = argparse.ArgumentParser()
    common.add_arguments(parser, rows=["a", "b"])
    return common.start(repo / "bench.py", parser, list(argv), rows=["a", "b"], repo=repo)


def test_clean_tree_is_measured_and_named_by_its_commit(repo: Path) -> None:
    (repo / "outputs").mkdir()
    (repo / "outputs" / "scratch.txt").write_text("ignored\n")  # untracked inside an ignored path: still clean
    (repo / "benchmarks" / "results" / "old.json").write_text('{"new": 1}\n')  # results: outputs, not code
    run = start(repo, "--out", str(repo / "outputs" / "r.json"))
    path = run.write({"rows": []}, "unused.json")
    provenance = json.loads(path.read_text())["provenance"]
    assert provenance["commit"] == git(repo, "rev-parse", "HEAD")
    assert provenance["dirty"] is False and provenance["allow_dirty"] is False and provenance["changes"] == []
    assert provenance["results_changed"] == [" M benchmarks/results/old.json"]
    assert provenance["script"] == "bench.py"


@pytest.mark.parametrize("change", ["modify", "untracked"])
def test_dirty_tree_is_refused_unless_allow_dirty_which_is_recorded(repo: Path, change: str) -> None:
    if change == "modify":
        (repo / "bench.py").write_text("print('changed')\n")
        listed = " M bench.py"
    else:
        (repo / "helper.py").write_text("x = 1\n")
        listed = "?? helper.py"
    with pytest.raises(SystemExit, match="uncommitted changes") as refused:
        start(repo)
    assert listed in str(refused.value) and "--allow-dirty" in str(refused.value)
    run = start(repo, "--allow-dirty", "--out", str(repo / "outputs" / "r.json"))
    provenance = json.loads(run.write({"rows": []}, "unused.json").read_text())["provenance"]
    assert provenance["dirty"] is True and provenance["allow_dirty"] is True
    assert provenance["changes"] == [listed]


def test_a_tree_changed_during_the_run_is_refused(repo: Path) -> None:
    run = start(repo, "--out", str(repo / "outputs" / "r.json"))
    (repo / "bench.py").write_text("print('edited while measuring')\n")
    with pytest.raises(SystemExit, match="changed during the run"):
        run.write({"rows": []}, "unused.json")
    assert not (repo / "outputs" / "r.json").exists()


def test_no_git_repository_is_dirty(tmp_path: Path) -> None:
    (tmp_path / "bench.py").write_text("\n")
    with pytest.raises(SystemExit, match="no git commit"):
        start(tmp_path)


def test_smoke_allows_one_repeat_implies_allow_dirty_and_writes_only_to_out(repo: Path) -> None:
    (repo / "bench.py").write_text("print('changed')\n")
    with pytest.raises(SystemExit):  # one repeat measures no noise: refused outside --smoke (parser.error)
        start(repo, "--repeats", "1", "--allow-dirty")
    run = start(repo, "--smoke")
    assert run.args.repeats == 1 and run.args.allow_dirty and "repeats=1" in run.smoke_changes
    assert run.write({"rows": []}, "smoke.json") is None
    assert not (repo / "benchmarks" / "results" / "smoke.json").exists()
    run = start(repo, "--smoke", "--out", str(repo / "outputs" / "s.json"))
    provenance = json.loads(run.write({"rows": []}, "smoke.json").read_text())["provenance"]
    assert provenance["smoke"] is True and provenance["allow_dirty"] is True


def test_provenance_hashes_the_script_and_common(repo: Path) -> None:
    run = start(repo)
    provenance = run.provenance()
    assert provenance["script_sha256"] == hashlib.sha256((repo / "bench.py").read_bytes()).hexdigest()
    assert provenance["common_sha256"] == hashlib.sha256(COMMON.read_bytes()).hexdigest()
    assert set(provenance["cpu_flags"]) == {"avx2", "avx512", "avx512_bf16", "amx"}
    assert provenance["torch"] and provenance["threads"] >= 1 and provenance["device"] == "cpu"


def test_classifier_file_trains_once_and_is_a_feature_extractor(tmp_path: Path) -> None:
    """The scripts' scoring classifier (ddpm.metrics.classifier): trained and saved when missing, reused after."""
    from ddpm.data.sources import DigitsSource
    from ddpm.metrics.classifier import classifier_file
    from ddpm.metrics.features import classifier_extractor

    path = classifier_file(tmp_path / "c.pt", source=DigitsSource(), image_size=16, epochs=1, limit=300)
    stamp = path.stat().st_mtime_ns
    assert classifier_file(path, source=DigitsSource(), image_size=16, epochs=1).stat().st_mtime_ns == stamp
    images = DigitsSource().load(image_size=16, channels=1).images[:5]
    features, logits = classifier_extractor(path)(images)
    assert features.shape == (5, 1024) and logits.shape == (5, 10)


def test_the_table_printer_writes_markdown_with_na_and_three_digits() -> None:
    text = common.table(["row", "a", "b"], [["x", 1.23456, None], ["y", 12345.6, "s"], ["z", 0.000123, 7]])
    assert text.splitlines() == ["| row | a | b |", "|---|---|---|", "| x | 1.23 | n/a |", "| y | 12,346 | s |",
                                 "| z | 0.000123 | 7 |"]  # fmt: skip


def test_timed_returns_the_result_and_the_seconds_between_the_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    clock = iter([10.0, 12.5])
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    assert common.timed(lambda: "done", torch.device("cpu")) == ("done", 2.5)
