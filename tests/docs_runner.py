"""How the docs-commands test runs what docs_collect.py collects: a sandbox, commands side by side, and for the
commands that cannot run here (NOT_RUN) their config composed and their objects built.

Commands run side by side (DOCS_COMMANDS_WORKERS, default 3, subprocesses at a time; each is mostly start-up),
through bash, in one sandbox: a temp copy of the repository's entry points (see `make_sandbox`). A command first
waits for the fixtures its placeholders name and for the earlier commands of its block whose outputs it reads.
`python -c "import sys; sys.path.insert(0, 'tests'); import docs_runner as r; print(r.run_list())"` prints what
runs (with the shrunk command line) and what is only composed, and why.
"""

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from docs_collect import COMMANDS, FIXTURES, XFAIL, Command, fill, not_run_reason, predecessors, script_of, shrunk
from helpers import REPO, compose, run

IN_REPO = ("make help", "make lint")  # read-only commands that act on the repository itself
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # `python`: this venv
WORKERS = int(os.environ.get("DOCS_COMMANDS_WORKERS", "3"))
TIMEOUT_S = 300


@dataclass
class Outcome:
    line: str
    cwd: Path
    returncode: int | None  # None: not started (a command it needs failed)
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def report(self) -> str:
        status = "not run" if self.returncode is None else f"exit {self.returncode}"
        return f"{self.line}\n(cwd {self.cwd}; {status} after {self.seconds:.0f} s)\n{self.output[-6000:]}"


def make_sandbox(root: Path) -> Path:
    """<root>/<repo name>: copies of train.py, sample.py and benchmarks/*.py; links to conf/, src/, .venv,
    the Makefile and pyproject.toml; <root>/shared -> the repository's ../shared (data.root=../shared/...).

    Why: commands run as written from a launch directory, and write where they say (outputs/, multirun/,
    shards/, `ckpt_path=last` reads the newest outputs/*/*/): here that directory is the sandbox, so nothing
    lands in the repository and `ckpt_path=last` sees exactly the runs this module made. The scripts are
    copies, not links, because the benchmarks resolve their paths from Path(__file__).resolve().parents[1]."""
    sandbox = root / REPO.name
    (sandbox / "benchmarks" / "results").mkdir(parents=True)
    for name in ("train.py", "sample.py"):
        shutil.copy2(REPO / name, sandbox / name)
    for script in (REPO / "benchmarks").glob("*.py"):
        shutil.copy2(script, sandbox / "benchmarks" / script.name)
    for name in ("conf", "src", "Makefile", "pyproject.toml"):
        (sandbox / name).symlink_to(REPO / name)
    # .venv: the repository's venv (its bin/, lib/, pyvenv.cfg linked) with an install stamp of its own, newer
    # than pyproject.toml: `make train` then trains with the venv these tests run in and never pip-installs
    # into the shared one (an edited pyproject.toml would make it; `make install` is NOT_RUN: network).
    (sandbox / ".venv").mkdir()
    for entry in (REPO / ".venv").iterdir():
        if entry.name != ".installed":
            (sandbox / ".venv" / entry.name).symlink_to(entry)
    (sandbox / ".venv" / ".installed").touch()
    if (REPO.parent / "shared").exists():
        (root / "shared").symlink_to(REPO.parent / "shared")
    return sandbox


class Runner:
    """Runs each command at most once (WORKERS at a time), after the commands it needs; outcome() waits for it."""

    def __init__(self, root: Path, workers: int = WORKERS) -> None:
        (root / "tmp").mkdir(parents=True)
        (root / "home").mkdir()  # every command's $HOME: what one leaves in ~/.cache is seen (and not left in yours)
        self.sandbox, self.tmp, self.home = make_sandbox(root / "launch"), root / "tmp", root / "home"
        self.slots = threading.Semaphore(workers)
        self.pool = ThreadPoolExecutor(max_workers=4 * len(COMMANDS) + 8)  # threads mostly wait
        self.futures: dict[str, Future[Outcome]] = {}
        self.lock = threading.Lock()
        self.names: dict[str, str] = {}

    def start(self, command: Command) -> "Future[Outcome]":
        with self.lock:
            if command.text not in self.futures:
                self.names[command.text] = f"cmd{len(self.names):02d}"
                self.futures[command.text] = self.pool.submit(self._execute, command)
            return self.futures[command.text]

    def outcome(self, command: Command) -> Outcome:
        return self.start(command).result()

    def wait(self) -> None:
        """Until every command started so far has ended."""
        for future in list(self.futures.values()):
            future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _execute(self, command: Command) -> Outcome:
        _, fixtures = fill(command.text, self.sandbox, self.tmp)
        needs = [FIXTURES[f] for f in sorted(fixtures) if FIXTURES[f].text != command.text]
        needs += predecessors(command)
        line = shrunk(command, self.sandbox, self.tmp, self.names[command.text])
        cwd = REPO if command.text.startswith(IN_REPO) else self.sandbox
        for need in needs:
            before = self.outcome(need)
            if not before.ok:
                return Outcome(line, cwd, None, 0.0, f"needs `{need.text}`, which failed:\n{before.report()}")
        with self.slots:
            start = time.perf_counter()
            try:
                env = {"PATH": PATH, "HOME": str(self.home)}
                result = run(line, shell=True, cwd=cwd, check=False, timeout=TIMEOUT_S, extra_env=env)
                code, output = result.returncode, f"{clip(result.stdout, 4000)}\n{clip(result.stderr, 6000)}"
            except subprocess.TimeoutExpired as error:
                code, output = -9, f"timed out after {error.timeout} s"
            return Outcome(line, cwd, code, time.perf_counter() - start, output)


def clip(text: str, tail: int) -> str:
    """The first 1,500 characters (make's echo, resume and config messages) and the last `tail`."""
    return text if len(text) <= 1500 + tail else f"{text[:1500]}\n[...]\n{text[-tail:]}"


def compose_and_build(command: Command, tmp: Path) -> str:
    """Compose the command's config and build what needs no device and no data; returns what was built."""
    text, _ = fill(command.text, tmp / "sandbox", tmp)
    tokens = shlex.split(text)
    script, first = script_of(tokens)
    if tokens[0] == "make":  # the target exists and what it runs (a dry run)
        target = tokens[1]
        result = run("make", "-n", target, cwd=REPO, check=True, timeout=60)
        if target.startswith("test"):
            assert "pytest" in result.stdout, f"make {target} does not run pytest:\n{result.stdout}"
        return f"make -n {target}: {result.stdout.strip().splitlines()[-1]}"
    if script in ("train.py", "sample.py"):
        return compose_entry_point(script.removesuffix(".py"), tokens[first:], tmp)
    if script.startswith("ddpm."):  # its options are those its --help lists
        usage = run("python", "-m", script, "--help", cwd=REPO, timeout=120).stdout
        for flag in (t.split("=", 1)[0] for t in tokens[first:] if t.startswith("--")):
            assert flag in usage.split(), f"{flag} is not an option of python -m {script}:\n{usage}"
        return "options exist (--help)"
    raise AssertionError(f"no way to compose {command.text!r}: add it here")


def compose_entry_point(name: str, overrides: list[str], tmp: Path) -> str:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf, open_dict

    overrides = [o for o in overrides if o not in ("-m", "--multirun")]
    overrides = [o for o in overrides if not o.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    overrides += [f"hydra.run.dir={tmp}/run", f"hydra.sweep.dir={tmp}/sweep"]
    overrides.append(f"paths.output_dir={tmp}/run" if name == "train" else f"output_dir={tmp}/run")
    cfg = compose(name, overrides, return_hydra_config=True)
    for node in ("launcher", "sweeper"):  # hydra/launcher=slurm, hparams_search=optuna: they resolve
        OmegaConf.to_container(cfg.hydra[node], resolve=True)
    with open_dict(cfg):
        del cfg["hydra"]
    if name == "sample":
        OmegaConf.to_container(cfg, resolve=True)
        return "sample config composed"
    from ddpm.training import build_callbacks, resolve_config

    resolved = resolve_config(cfg)  # the types of every value under a _target_, precision decided
    net, diffusion, optim = instantiate(cfg.model), instantiate(cfg.diffusion), instantiate(cfg.optim)
    instantiate(cfg.module, _partial_=True)(net=net, diffusion=diffusion, optim=optim, run_config=resolved)
    build_callbacks(cfg)
    datamodule = instantiate(cfg.data)  # the class and its arguments; no data are read before setup()
    params = sum(p.numel() for p in net.parameters())
    return f"composed; built {type(net).__name__} ({params / 1e6:.1f}M), {type(datamodule).__name__}"


def run_list(results: dict[str, str] | None = None) -> str:
    """The collected commands: those that run (with the command line that runs), those only composed
    (with the reason), those expected to fail (with the bug); with `results`, what happened to each."""
    results = results or {}
    sections: dict[str, list[str]] = {"run": [], "composed only": [], "xfail": []}
    for command in COMMANDS:
        reason = not_run_reason(command.text)
        head = f"  {command.text}   [{command.source}]"
        if command.text in results:
            head += f"\n      => {results[command.text]}"
        if reason is not None:
            sections["composed only"].append(f"{head}\n      reason: {reason}")
            continue
        entry = f"{head}\n      runs: {shrunk(command, '$SANDBOX', '$TMP', 'cmd')}"
        if command.text in XFAIL:
            sections["xfail"].append(f"{entry}\n      bug: {XFAIL[command.text]}")
        else:
            sections["run"].append(entry)
    counts = ", ".join(f"{len(v)} {k}" for k, v in sections.items())
    out = [f"Documented commands: {len(COMMANDS)} ({counts})"]
    for title, entries in sections.items():
        out += [f"{title}:", *entries] if entries else []
    return "\n".join(out)
