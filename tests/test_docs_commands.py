"""The docs are the tests: every command the docs show runs, shrunk, as a real subprocess through bash.

Collected (a command added to the docs is picked up without touching this file):
- every line of a fenced shell block (```bash, ```sh, ```) in README.md and docs/*.md that starts with
  `python train.py`, `python sample.py`, `python -m ddpm.`, `python benchmarks/`, `make `, `torchrun ` or
  `srun ` (trailing `# comments` dropped, `\\` continuations joined);
- every comment line of conf/**/*.yaml of the form `#   python train.py ...` (also after a `then:`), e.g. the
  `data.urls=...` example of conf/data/webdataset.yaml.
Commands in backticks inside prose are not collected.

Each command runs as written, with only size-shrinking overrides appended (`shrunk()`: 2 training steps on
64 images, grids of 4 samples x 2 steps, sample.py at 4 samples x 2 steps, 2 Optuna trials, 1 classifier
epoch ...) and its outputs sent to temp folders. Placeholders (`outputs/<date>/<time>/`, `outputs/.../`,
`<run>`, `<samples.npz>`, a dated run folder) are filled from runs this module makes first (`FIXTURES`).
A command that cannot run here is listed in NOT_RUN with the reason; its config is composed and its model,
diffusion, optimizer, LightningModule, callbacks and data module built instead (no Trainer, no data read).
A documented command that fails because of a bug in code goes to XFAIL (strict) with the bug.

Commands run side by side (DOCS_COMMANDS_WORKERS, default 3, subprocesses at a time; each is mostly
start-up), in one sandbox: a temp copy of the repository's entry points (see `sandbox`).
`python -c "import sys; sys.path.insert(0, 'tests'); import test_docs_commands as t; print(t.run_list())"`
prints what runs (with the shrunk command line) and what is only composed, and why.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, compose, run

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------------------------------------------------
# Collection
# ---------------------------------------------------------------------------------------------------------

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PREFIXES = (
    "python train.py",
    "python sample.py",
    "python -m ddpm.",
    "python benchmarks/",
    "make ",
    "torchrun ",
    "srun ",
)
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
YAML_COMMAND = re.compile(r"^\s*#\s*(?:\w+:\s+)?(?P<command>(?:python|make|torchrun|srun) .*)$")


@dataclass(frozen=True)
class Command:
    text: str  # as written: continuations joined, trailing comment dropped
    source: str  # where it is written first, e.g. README.md:27
    group: str  # its fenced block (or yaml file): later commands of a group may use earlier ones' outputs

    def __str__(self) -> str:
        return self.text


def strip_comment(line: str) -> str:
    """'cmd arg  # comment' -> 'cmd arg', as bash reads it (a # starting a word, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, text) pairs with `\\` continuations joined and comments dropped."""
    out, pending, start = [], "", 0
    for number, raw in lines:
        text = raw.strip()
        if text.startswith("$ "):
            text = text[2:]
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        out.append((start, strip_comment(pending + text)))
        pending = ""
    if pending:
        out.append((start, strip_comment(pending)))
    return [(n, " ".join(t.split())) for n, t in out]


def is_command(text: str) -> bool:
    return text.startswith(PREFIXES)


def markdown_commands(path: Path) -> list[Command]:
    found, block, language, fence_line = [], None, "", 0
    rel = path.relative_to(REPO)
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if block is None and match:
            block, language, fence_line = [], match.group(2).lower(), number
        elif block is not None and line.strip().startswith(("```", "~~~")):
            if language in SHELL_LANGUAGES:
                for start, text in logical_lines(block):
                    if is_command(text):
                        found.append(Command(text, f"{rel}:{start}", f"{rel}:{fence_line}"))
            block = None
        elif block is not None:
            block.append((number, line))
    return found


def yaml_commands(path: Path) -> list[Command]:
    rel = path.relative_to(REPO)
    lines = [(n, m.group("command")) for n, line in enumerate(path.read_text().splitlines(), start=1)
             if (m := YAML_COMMAND.match(line))]  # fmt: skip
    return [Command(text, f"{rel}:{n}", str(rel)) for n, text in logical_lines(lines) if is_command(text)]


def collect() -> list[Command]:
    """Every documented command once (the first place it is written), in reading order."""
    found: dict[str, Command] = {}
    for path in DOCS:
        for command in markdown_commands(path):
            found.setdefault(command.text, command)
    for path in sorted((REPO / "conf").rglob("*.yaml")):
        for command in yaml_commands(path):
            found.setdefault(command.text, command)
    return list(found.values())


COMMANDS = collect()

# ---------------------------------------------------------------------------------------------------------
# What does not run here, and what fails because of a bug in code
# ---------------------------------------------------------------------------------------------------------

# A command that starts with (or equals) a key is not run; its config is composed and built instead.
NOT_RUN = {
    "python train.py experiment=cifar10 trainer.devices=8": "needs 8 GPUs (DDP)",
    "python train.py experiment=cifar10 data.source.download=true": "downloads CIFAR-10 (network) and needs 8 GPUs",
    "python train.py experiment=imagenet64 data.root=/data/imagenet64/": "dataset not on disk (/data/imagenet64)",
    "python train.py -m hydra/launcher=slurm": "submits SLURM jobs (hydra/launcher=slurm), 2 nodes x 8 GPUs",
    "python train.py trainer=ddp trainer.devices=8": "needs 8 GPUs (trainer.accelerator=gpu)",
    "torchrun ": "torchrun over 2 nodes x 8 GPUs",
    "srun ": "a SLURM batch script (srun), 2 nodes x 8 GPUs",
    "python -m ddpm.data.make_shards folder:data/faces": "dataset not on disk (data/faces: a folder of your images)",
    "python train.py data=webdataset 'data.urls=\"shards/faces/": "needs the data/faces shards (dataset not on disk)",
    "python benchmarks/throughput.py --model seed_mnist --batch-size 64 --steps 50 --device cuda": "needs a GPU",
    "python benchmarks/throughput.py --model ddpm_cifar10 --batch-size 128 --steps 30 --device cuda": "needs a GPU",
    "python benchmarks/throughput.py --model unet64 --batch-size 64 --steps 30 --device cuda": "needs a GPU",
    "python benchmarks/samplers.py --ckpt outputs/<mnist run>/ema.pt --num-samples 10000 --device cuda": (
        "needs a GPU (and rewrites docs/benchmarks.md)"
    ),
    "python benchmarks/samplers.py --ckpt outputs/<mnist run>/ema.pt --num-samples 500": (
        "the sampler table: about two CPU-hours (resumable; rewrites docs/benchmarks.md)"
    ),
    "python benchmarks/peers.py": "needs the optional extra .[peers] (denoising-diffusion-pytorch)",
    "python benchmarks/throughput.py --model unet_mnist --batch-size 64 --steps 10 --warmup 2 --compile-warmup 2": (
        "the CPU recipe benchmark: compiles and traces unet_mnist for minutes (run by hand; JSON committed)"
    ),
    "python benchmarks/throughput.py --model seed_mnist --batch-size 32": (
        "seed_mnist's 7-10 s steps: minutes (run by hand; JSON committed)"
    ),
    "make test": "runs this suite (recursion)",
    "make test-fast": "runs this suite (recursion)",
    "make install": "pip install (network)",
    "make format": "rewrites files of the repository",
    "make clean": "deletes caches of the repository",
}

# A documented command that fails because of a bug in code outside the docs: {command: "the bug"} (strict).
XFAIL: dict[str, str] = {}


def not_run_reason(text: str) -> str | None:
    for key, reason in NOT_RUN.items():
        if text.startswith(key):
            return reason
    return None


# ---------------------------------------------------------------------------------------------------------
# Shrinking and placeholders
# ---------------------------------------------------------------------------------------------------------

TRAIN_SHRINK = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "data.batch_size=16",
    "callbacks.checkpoint.every_n_train_steps=2",
    "callbacks.sample_grid.every_n_steps=2",
    "callbacks.sample_grid.num_samples=4",
    "callbacks.sample_grid.sampler.steps=2",
    # compile (experiment=mnist: auto, on where bf16 is native) traced by dynamo, not code-generated by inductor
    # (minutes per run on 2 cores): tests/test_compile.py runs inductor through train.py once
    "module.compile_backend=aot_eager",
]
RAM_DATA_SHRINK = ["data.limit=64"]  # the preloaded sources (digits, mnist, cifar10, image_folder)
STREAM_DATA_SHRINK = ["data.epoch_length=64", "data.shuffle_buffer=16"]  # data=webdataset (no data.limit)
RESUME_SHRINK = ["trainer.max_steps=4"]  # the checkpoint is at step 2: two more steps
OPTUNA_SHRINK = ["hydra.sweeper.n_trials=2"]  # (a fixed data.batch_size is left out of the search)
LR_FIND_SHRINK = ["tune.lr_find.num_steps=8"]
SAMPLE_SHRINK = ["num_samples=4", "sampler.steps=2", "batch_size=4"]
# compile rows traced by dynamo (aot_eager), not built by inductor (minutes on 2 cores)
THROUGHPUT_SHRINK = ["--steps", "2", "--warmup", "1", "--repeats", "1", "--images", "64", "--batch-size", "8",
                     "--compile-warmup", "1", "--compile-backend", "aot_eager"]  # fmt: skip
# A 2-step model draws noise: --min-accuracy 0 turns off the quality gate of a real run (docs/mnist.md),
# the rest of the script (MNIST classifier, held-out and sample accuracy, JSON) runs.
QUALITY_SHRINK = ["--epochs", "1", "--min-accuracy", "0"]
SAMPLING_SHRINK = ["--num-samples", "4", "--steps", "2", "--repeats", "1", "--rows", "fp32_eager,bf16,defaults",
                   "--classifier-epochs", "1", "--resamples", "20"]  # fmt: skip
SAMPLE_DEFAULTS_SHRINK = ["--num-samples", "2", "--repeats", "1", "--set", "sampler.steps=2"]  # both rows: 2 steps

# The run a documented placeholder stands for (FIXTURES below make them; each is itself a command).
DEFAULT_RUN = "outputs/2026-11-23/10-00-00"  # `python train.py`'s run, where `ckpt_path=last` finds it
PLACEHOLDERS = [  # (pattern, fixture, replacement: {sandbox} / {tmp} filled in)
    (r"outputs/<date>/<time>", "default", DEFAULT_RUN),
    (r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", "default", DEFAULT_RUN),
    (r"outputs/<mnist run>", "conditional", "{tmp}/fixture_conditional_run"),
    (r"outputs/\.\.\.", "conditional", "{tmp}/fixture_conditional_run"),
    (r"<run>", "conditional", "{tmp}/fixture_conditional_run"),
    (r"<samples\.npz>", "samples", "{tmp}/fixture_conditional_samples/samples.npz"),
]
# The runs placeholders are filled from, made once per module (only when a selected command needs them):
# - default: the README's `python train.py` (digits, unconditional), in the sandbox at DEFAULT_RUN, so that
#   `ckpt_path=last` (the newest outputs/*/*/checkpoints/last.ckpt under the launch directory) finds it;
# - conditional: class-conditional MNIST with p_uncond=0.1 (experiment=mnist), for guidance and labels;
# - samples: the README's guided sample.py call on it (samples.npz for benchmarks/mnist_quality.py).
FIXTURES = {
    "default": Command("python train.py", "fixture", "fixture"),
    "conditional": Command("python train.py experiment=mnist data.root=../shared/data/mnist", "fixture", "fixture"),
    "samples": Command(
        "python sample.py ckpt=<run>/ema.pt num_samples=500 guidance=3 sampler.steps=100", "fixture", "fixture"
    ),
}
FIXTURE_RUN_DIRS = {  # hydra.run.dir of each fixture
    FIXTURES["default"].text: "{sandbox}/" + DEFAULT_RUN,
    FIXTURES["conditional"].text: "{tmp}/fixture_conditional_run",
    FIXTURES["samples"].text: "{tmp}/fixture_conditional_samples",
}

# Read-only commands that act on the repository itself (everything else runs in the sandbox).
IN_REPO = ("make help", "make lint")


def fill(text: str, sandbox: Path | str, tmp: Path | str) -> tuple[str, set[str]]:
    """The command with its placeholders filled, and the fixtures they come from."""
    used = set()
    for pattern, fixture, replacement in PLACEHOLDERS:
        if re.search(pattern, text):
            used.add(fixture)
            text = re.sub(pattern, replacement.format(sandbox=sandbox, tmp=tmp), text)
    if "ckpt_path=" in text:
        used.add("default")  # ckpt_path=last resumes the newest run in the sandbox's outputs/
    return text, used


def script_of(tokens: list[str]) -> tuple[str, int]:
    """('train.py' | 'sample.py' | 'benchmarks/x.py' | 'ddpm.x' | 'make', index of its first argument)."""
    for i, token in enumerate(tokens):
        if token in ("train.py", "sample.py") or token.startswith("benchmarks/"):
            return token, i + 1
        if token == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("ddpm."):
            return tokens[i + 1], i + 2
    return tokens[0], 1


def train_shrink(text: str) -> list[str]:
    shrink = list(TRAIN_SHRINK)
    shrink += STREAM_DATA_SHRINK if "data=webdataset" in text else RAM_DATA_SHRINK
    if "ckpt_path=" in text:
        shrink += RESUME_SHRINK
    if "hparams_search=optuna" in text:
        shrink += OPTUNA_SHRINK
    if "tune=lr_find" in text:
        shrink += LR_FIND_SHRINK
    return shrink


def output_dirs(text: str, run_dir: str, sweep: bool = True) -> list[str]:
    dirs = [] if "hydra.run.dir=" in text else [f"hydra.run.dir={run_dir}"]
    if sweep and "hydra.sweep.dir=" not in text:
        dirs.append(f"hydra.sweep.dir={run_dir}_sweep")
    return dirs


def shrunk(command: Command, sandbox: Path | str, tmp: Path | str, name: str) -> str:
    """The command line that runs: as written, placeholders filled, shrinking overrides and temp outputs appended."""
    text, _ = fill(command.text, sandbox, tmp)
    run_dir = FIXTURE_RUN_DIRS.get(command.text, "{tmp}/" + name).format(sandbox=sandbox, tmp=tmp)
    tokens = shlex.split(text)
    script, _ = script_of(tokens)
    extra: list[str] = []
    if tokens[:2] == ["make", "train"]:  # the Makefile passes ARGS to train.py
        args = [t for t in tokens if t.startswith("ARGS=")]
        given = args[0][len("ARGS=") :].split() if args else []
        merged = [*given, *train_shrink(text), *output_dirs(text, run_dir)]
        return " ".join(
            [*(shlex.quote(t) for t in tokens if not t.startswith("ARGS=")), "ARGS=" + shlex.quote(" ".join(merged))]
        )
    if script == "train.py":
        extra = [*train_shrink(text), *output_dirs(text, run_dir)]
    elif script == "sample.py":
        extra = [*SAMPLE_SHRINK, *output_dirs(text, run_dir, sweep=False)]
    elif script == "benchmarks/throughput.py":
        extra = [*THROUGHPUT_SHRINK, "--out", f"{run_dir}/throughput.json"]
    elif script == "benchmarks/mnist_quality.py":
        extra = [*QUALITY_SHRINK, "--out", f"{run_dir}/mnist_quality.json"]
    elif script == "benchmarks/sampling.py":
        extra = [*SAMPLING_SHRINK, "--out", f"{run_dir}/sampling.json"]
    elif script == "benchmarks/sample_defaults.py":
        extra = [*SAMPLE_DEFAULTS_SHRINK, "--out", f"{run_dir}/sample_defaults.json"]
    return " ".join([text, *(shlex.quote(e) for e in extra)])


def sandbox_paths(text: str) -> list[str]:
    """The sandbox-relative paths a command names (outputs it writes or reads), for ordering within a group."""
    try:
        tokens = shlex.split(text)
    except ValueError:
        return []
    paths = []
    for token in tokens:
        value = token.split("=", 1)[1] if re.match(r"^\+*[\w./-]+=", token) else token
        value = value.strip("'\"")
        outside = value.startswith(("/", "../", "-", "{")) or ":" in value  # inputs, flags, URLs
        if "/" in value and not outside and not value.endswith(".py"):  # scripts are not outputs
            paths.append(value)
    return paths


def predecessors(command: Command) -> list[Command]:
    """Earlier runnable commands of the same group whose outputs this one reads (a path it names starts
    with a path they name): e.g. docs/mnist.md's sample.py reads outputs/mnist_run2 from the train.py above."""
    group = [c for c in COMMANDS if c.group == command.group and not not_run_reason(c.text)]
    if command not in group:
        return []
    mine = sandbox_paths(fill(command.text, "S", "T")[0])
    found = []
    for earlier in group[: group.index(command)]:
        theirs = sandbox_paths(fill(earlier.text, "S", "T")[0])
        if any(p == q or p.startswith(q.rstrip("/") + "/") for p in mine for q in theirs):
            found.append(earlier)
    return found


def command_id(command: Command) -> str:
    text = command.text
    return text if len(text) <= 72 else text[:69] + "..."


# ---------------------------------------------------------------------------------------------------------
# Running: a sandbox, and commands run side by side (each at most once per module)
# ---------------------------------------------------------------------------------------------------------


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
    copies, not links, because the benchmarks write under Path(__file__).resolve().parents[1]."""
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
    def __init__(self, sandbox: Path, tmp: Path, workers: int) -> None:
        self.sandbox, self.tmp = sandbox, tmp
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
                result = run(line, shell=True, cwd=cwd, check=False, timeout=300, extra_env={"PATH": PATH})
                code, output = result.returncode, f"{clip(result.stdout, 4000)}\n{clip(result.stderr, 6000)}"
            except subprocess.TimeoutExpired as error:
                code, output = -9, f"timed out after {error.timeout} s"
            return Outcome(line, cwd, code, time.perf_counter() - start, output)


def clip(text: str, tail: int) -> str:
    """The first 1,500 characters (make's echo, resume and config messages) and the last `tail`."""
    return text if len(text) <= 1500 + tail else f"{text[:1500]}\n[...]\n{text[-tail:]}"


PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # `python`: this venv
WORKERS = int(os.environ.get("DOCS_COMMANDS_WORKERS", "3"))
RESULTS: dict[str, str] = {}  # command -> what happened, for run_list()


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """The sandbox and the runner; every selected runnable command is started at once (WORKERS at a time)."""
    root = tmp_path_factory.mktemp("docs_commands")
    (root / "tmp").mkdir()
    runner = Runner(make_sandbox(root / "launch"), root / "tmp", WORKERS)
    selected = [item.callspec.params["command"] for item in request.session.items
                if item.path == Path(__file__) and hasattr(item, "callspec")]  # fmt: skip
    for command in selected:
        if isinstance(command, Command) and not not_run_reason(command.text):
            runner.start(command)
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------------------
# Composing what does not run
# ---------------------------------------------------------------------------------------------------------


def check_flags_exist(script: Path, tokens: list[str]) -> None:
    source = script.read_text()
    for flag in (t.split("=", 1)[0] for t in tokens if t.startswith("--")):
        assert f'"{flag}"' in source, f"{flag} is not an option of {script.relative_to(REPO)}"


def compose_and_build(command: Command, tmp: Path) -> str:
    """Compose the command's config and build what needs no device and no data; returns what was built."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf, open_dict

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
        name = script.removesuffix(".py")
        overrides = [t for t in tokens[first:] if t not in ("-m", "--multirun")]
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
    if script.startswith("benchmarks/"):
        check_flags_exist(REPO / script, tokens[first:])
        if "--model" in tokens:  # throughput.py builds conf/model/<name>.yaml
            model = tokens[tokens.index("--model") + 1]
            net = instantiate(compose("train", [f"model={model}", f"paths.output_dir={tmp}"]).model)
            return f"options exist; built model={model} ({sum(p.numel() for p in net.parameters()) / 1e6:.1f}M)"
        return "options exist"
    if script.startswith("ddpm."):
        check_flags_exist(REPO / "src" / (script.replace(".", "/") + ".py"), tokens[first:])
        return "options exist"
    raise AssertionError(f"no way to compose {command.text!r}: add it here")


# ---------------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------------


def params() -> list:
    out = []
    for command in COMMANDS:
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[command.text])] if command.text in XFAIL else []
        out.append(pytest.param(command, id=command_id(command), marks=marks))
    return out


@pytest.mark.parametrize("command", params())
def test_documented_command(command: Command, runner: Runner, tmp_path: Path) -> None:
    """The command runs (shrunk) and exits 0, or it is in NOT_RUN and its config composes and builds."""
    reason = not_run_reason(command.text)
    if reason is not None:
        built = compose_and_build(command, tmp_path)
        RESULTS[command.text] = f"composed only ({reason}): {built}"
        return
    outcome = runner.outcome(command)
    RESULTS[command.text] = f"{'ran' if outcome.ok else 'FAILED'} in {outcome.seconds:.0f} s"
    assert outcome.ok, f"{command.source}: `{command.text}` failed:\n{outcome.report()}"
    if "ckpt_path=" in command.text:  # it resumed the run made first (not a fresh start)
        assert "Resuming " in outcome.output, outcome.report()
    if command.text.startswith("make train"):  # the Makefile passed ARGS on to train.py (make echoes the recipe)
        assert re.search(r"train\.py .*trainer\.max_steps=2", outcome.output), outcome.report()


def test_collection_finds_the_documented_commands() -> None:
    """Guards the collector: the README's tour, the MNIST recipe and the fixed webdataset comment are found,
    the NOT_RUN and XFAIL keys name collected commands (or commands the Makefile has)."""
    texts = [c.text for c in COMMANDS]
    assert "python train.py" in texts and "make train" in texts
    assert "python train.py experiment=mnist data.root=../shared/data/mnist" in texts
    assert any(t.startswith("python train.py data=webdataset 'data.urls=\"shards/digits/") for t in texts), texts
    assert all(not t.endswith("\\") and " # " not in t for t in texts), texts
    for key in XFAIL:
        assert key in texts, f"XFAIL names a command no doc shows: {key}"


def test_print_run_list() -> None:
    """Prints what ran and what was only composed, and why (pytest -s shows it)."""
    print("\n" + run_list(RESULTS))


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
        line = shrunk(command, "$SANDBOX", "$TMP", "cmd")
        entry = f"{head}\n      runs: {line}"
        if command.text in XFAIL:
            sections["xfail"].append(f"{entry}\n      bug: {XFAIL[command.text]}")
        else:
            sections["run"].append(entry)
    counts = ", ".join(f"{len(v)} {k}" for k, v in sections.items())
    out = [f"Documented commands: {len(COMMANDS)} ({counts})"]
    for title, entries in sections.items():
        if entries:
            out += [f"{title}:", *entries]
    return "\n".join(out)
