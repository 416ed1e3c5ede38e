"""The docs are the tests: every command the docs show runs, shrunk, as a real subprocess through bash.

What is collected and how it is shrunk: tests/docs_collect.py; the sandbox and the parallel runner:
tests/docs_runner.py. A command that cannot run here (NOT_RUN) has its config composed and its objects built
instead; the multi-node commands (torchrun, srun) run on CPU in tests/test_multinode.py.
"""

import argparse
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from docs_collect import COMMANDS, NOT_RUN, SMOKE_TWINS, XFAIL, Command, command_id, not_run_reason, number, shrunk
from docs_runner import Runner, compose_and_build, run_list
from helpers import REPO, run

pytestmark = pytest.mark.slow

RESULTS: dict[str, str] = {}  # command -> what happened, for test_print_run_list
PEERS = {"dd_pytorch": ("denoising-diffusion-pytorch", "denoising_diffusion_pytorch"), "diffusers": ("diffusers",)}


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """The sandbox and the runner; every selected runnable command is started at once (WORKERS at a time)."""
    runner = Runner(tmp_path_factory.mktemp("docs_commands"))
    for item in request.session.items:
        command = getattr(item, "callspec", None) and item.callspec.params.get("command")
        if item.path == Path(__file__) and isinstance(command, Command) and not not_run_reason(command.text):
            runner.start(runs(command))
    yield runner
    runner.close()


def params() -> list:
    marks = {text: [pytest.mark.xfail(strict=True, reason=bug)] for text, bug in XFAIL.items()}
    return [pytest.param(c, id=command_id(c), marks=marks.get(c.text, [])) for c in COMMANDS]


def says_skipped(row: str, output: str) -> bool:
    """Whether a line of `output` says that peers.py's row `row` (named as a row, a tool or a module) is skipped."""
    names = "|".join(re.escape(name) for name in {row, *PEERS[row]})
    return re.search(rf"(?im)^.*(skip.*\b({names})\b|\b({names})\b.*skip)", output) is not None


def runs(command: Command) -> Command:
    """The command whose shrunk run stands for `command`: itself, or the earlier one whose --smoke it repeats."""
    earlier = SMOKE_TWINS.get(command.text)
    return command if earlier is None else next(c for c in COMMANDS if c.text == earlier)


@pytest.mark.parametrize("command", params())
def test_documented_command(command: Command, runner: Runner, tmp_path: Path) -> None:
    """The command runs (shrunk) and exits 0, or it is in NOT_RUN and its config composes and builds."""
    reason = not_run_reason(command.text)
    if reason is not None:
        RESULTS[command.text] = f"composed only ({reason}): {compose_and_build(command, tmp_path)}"
        return
    outcome = runner.outcome(runs(command))
    RESULTS[command.text] = f"{'ran' if outcome.ok else 'FAILED'} in {outcome.seconds:.0f} s"
    if command.text in SMOKE_TWINS:  # the same smoke as an earlier command (its --smoke overrides what differs)
        RESULTS[command.text] += f" (as {command_id(runs(command))}: the same --smoke)"
    assert outcome.ok, f"{command.source}: `{command.text}` failed:\n{outcome.report()}"
    if "ckpt_path=" in command.text:  # it resumed the run made first (not a fresh start)
        assert "Resuming " in outcome.output, outcome.report()
    if command.text.startswith("make train"):  # the Makefile passed ARGS on to train.py (make echoes the recipe)
        assert re.search(r"train\.py .*trainer\.max_steps=2", outcome.output), outcome.report()
    if command.text.startswith("python benchmarks/"):  # --smoke wrote its JSON where --out said, nowhere else
        tokens = shlex.split(outcome.line)
        out = Path(tokens[len(tokens) - tokens[::-1].index("--out")])  # the last --out: the one appended
        assert json.loads(out.read_text()), outcome.report()
        written = [*(runner.sandbox / "benchmarks" / "results").glob("*.json"), *runner.sandbox.glob("docs/*")]
        assert not written, f"--smoke wrote {written}:\n{outcome.report()}"
    if command.text.startswith("python benchmarks/peers.py"):  # a peer that is not installed is skipped, saying so
        for row, names in PEERS.items():
            if importlib.util.find_spec(names[-1]) is None:
                assert says_skipped(row, outcome.output), f"no message that {row} is skipped:\n{outcome.report()}"


def test_no_command_writes_the_user_cache(runner: Runner) -> None:
    """No documented command, shrunk, leaves files in ~/.cache/lightning-ddpm (the commands run with a $HOME of
    their own): --smoke's reference statistics belong to a throwaway classifier (49 MB each, one per suite run,
    before sampling.py kept them in its temp folder)."""
    if not runner.futures:
        pytest.skip("no documented command ran in this session (select test_documented_command too)")
    runner.wait()
    left = sorted(p.relative_to(runner.home) for p in (runner.home / ".cache" / "lightning-ddpm").rglob("*"))
    assert not left, left


def test_peers_smoke_skips_a_missing_peer(tmp_path: Path) -> None:
    """peers.py --smoke with diffusers made unimportable (a shadowing package that raises ImportError): it says
    that it skips diffusers, exits 0, and its JSON has this project's (bare-loop: the cheapest) row and no diffusers
    row."""
    hidden = tmp_path / "hide" / "diffusers"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("diffusers hidden by tests/test_docs_commands.py")\n')
    out = tmp_path / "peers.json"
    result = run("python", "benchmarks/peers.py", "--smoke", "--rows", "ours_bare,diffusers", "--out", out, timeout=300,
                 extra_env={"PYTHONPATH": f"{hidden.parent}:{REPO / 'tests'}"})  # fmt: skip
    assert says_skipped("diffusers", result.stdout + result.stderr), result.stdout + result.stderr
    tools = [row["tool"] for row in json.loads(out.read_text())["rows"]]
    assert any(t.startswith("lightning-ddpm") for t in tools) and "diffusers" not in tools, tools


def test_collection_finds_the_documented_commands() -> None:
    """Guards the collector: the README's tour, the MNIST recipe, the fixed webdataset comment and the multi-node
    commands are found; every benchmark command runs (none is in NOT_RUN); the XFAIL keys name collected commands."""
    texts = [c.text for c in COMMANDS]
    assert "python train.py" in texts and "make train" in texts
    assert "python train.py experiment=mnist data.root=../shared/data/mnist" in texts
    assert any(t.startswith("python train.py data=webdataset 'data.urls=\"shards/digits/") for t in texts), texts
    assert any(t.startswith("torchrun ") for t in texts) and any(t.startswith("srun ") for t in texts), texts
    assert all(not t.endswith("\\") and " # " not in t for t in texts), texts
    benchmarks = {t.split()[1] for t in texts if t.startswith("python benchmarks/")}
    assert benchmarks >= {"benchmarks/samplers.py", "benchmarks/peers.py", "benchmarks/throughput.py"}, benchmarks
    assert not [t for t in texts if t.startswith("python benchmarks/") and not_run_reason(t)], NOT_RUN
    for key in XFAIL:
        assert key in texts, f"XFAIL names a command no doc shows: {key}"


def options(text: str) -> dict[str, str]:
    """`--name value` / `--name=value` pairs of a command line (flags with no value map to "")."""
    tokens, found = shlex.split(text)[2:], {}
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            name, _, value = token.partition("=")
            following = tokens[i + 1] if i + 1 < len(tokens) else "--"
            found[name] = value or ("" if following.startswith("--") else following)
    return found


def as_typed(text: str) -> object:
    """A command-line value as argparse's type=int/float would give it (docs_collect.number), else the text."""
    value = number(text)
    return text if value is None else value


def test_a_smoke_twin_runs_what_the_command_that_runs_for_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command run as an earlier one (SMOKE_TWINS) gives, after benchmarks/common.py's own shrink with its
    script's SMOKE dict (both imported here from the files themselves), the same values as that earlier command,
    and differs from it in nothing else: the one run is the run each would make."""
    assert SMOKE_TWINS, "docs/benchmarks.md's --device cuda commands are twins"
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import common

    for text, earlier in SMOKE_TWINS.items():
        script = shlex.split(text)[1]
        spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        flags = {"--" + key.replace("_", "-"): key for key in module.SMOKE}
        ran = []
        for line in (text, earlier):
            given = options(line)
            args = argparse.Namespace(**{key: as_typed(given[f]) for f, key in flags.items() if f in given})
            common.shrink(args, module.SMOKE)
            ran.append((vars(args), {f: v for f, v in given.items() if f not in flags}))
        assert ran[0] == ran[1], (text, earlier, ran)
        assert options(text) != options(earlier), "a twin is written differently (else collect() keeps one)"


def test_print_run_list() -> None:
    """Every collected command is in the printout once, with the line that runs or the reason it does not,
    under the right heading, and (for the commands this session ran) what happened; the counts add up."""
    printout = run_list(RESULTS)
    print("\n" + printout)
    head = re.match(r"Documented commands: (\d+) \((\d+) run, (\d+) composed only, (\d+) xfail\)\n", printout)
    assert head, printout[:300]
    total, ran, composed, xfail = map(int, head.groups())
    skipped = [c for c in COMMANDS if not_run_reason(c.text)]
    assert (total, composed, xfail) == (len(COMMANDS), len(skipped), len(XFAIL))
    assert ran + composed + xfail == total
    sections = entries_by_section(printout)
    assert {k: len(v) for k, v in sections.items()} == {"run": ran, "composed only": composed, "xfail": xfail}
    for command in COMMANDS:
        reason = not_run_reason(command.text)
        section = "composed only" if reason else "xfail" if command.text in XFAIL else "run"
        found = [e for e in sections[section] if e.startswith(f"  {command.text}   [{command.source}]\n")]
        assert len(found) == 1, f"{command.text!r} is under {section!r} {len(found)} times:\n{printout}"
        expected = f"reason: {reason}" if reason else f"runs: {shrunk(command, '$SANDBOX', '$TMP', 'cmd')}"
        assert expected in found[0], found[0]
        if command.text in RESULTS:
            assert f"=> {RESULTS[command.text]}" in found[0], found[0]


def entries_by_section(printout: str) -> dict[str, list[str]]:
    """{heading: [entry: its '  command   [source]' line and the indented lines under it]} of run_list()."""
    sections: dict[str, list[str]] = {"run": [], "composed only": [], "xfail": []}
    current: list[str] = []
    for line in printout.splitlines()[1:]:
        if not line.startswith(" "):
            current = sections.setdefault(line.removesuffix(":"), [])
        elif not line.startswith("   "):
            current.append(line)
        else:
            current[-1] += "\n" + line
    return sections
