"""What the docs-commands test runs: the documented commands, which of them cannot run here, and each one shrunk.

Collected (a command added to the docs is picked up without touching the tests):
- every line of a fenced shell block (```bash, ```sh, ```) in README.md and docs/*.md that starts with
  `python train.py`, `python sample.py`, `python -m ddpm.`, `python benchmarks/`, `make `, `torchrun ` or
  `srun ` (trailing `# comments` dropped, `\\` continuations joined);
- every comment line of conf/**/*.yaml of the form `#   python train.py ...` (also after a `then:`), e.g. the
  `data.urls=...` example of conf/data/webdataset.yaml.
Commands in backticks inside prose are not collected.

`shrunk()` is the command line that runs: as written, with only size-shrinking arguments appended (2 training
steps on 64 images, grids of 4 samples x 2 steps, FID of 50 samples x 2 steps, sample.py at 4 samples x 2 steps,
2 Optuna trials; every benchmark script `--smoke --out <tmp>/<name>.json`) and its outputs (run folders, caches)
sent to temp folders.
A benchmark command that differs from an earlier one only in options its script's --smoke sets (SMOKE_TWINS: e.g.
the `--device cuda` commands of three presets) is not run again: its test takes the earlier one's run.
Placeholders (`outputs/<date>/<time>/`, `outputs/.../`, `<run>`, `<mnist run>`, a dated run folder, a classifier
file) are filled from runs made first (`FIXTURES`: themselves documented commands). A command that cannot run here
is in NOT_RUN with the reason; a documented command that fails because of a bug in code goes to XFAIL (strict)
with the bug.
"""

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PREFIXES = ("python train.py", "python sample.py", "python -m ddpm.", "python benchmarks/", "make ", "torchrun ",
            "srun ")  # fmt: skip
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
        text = text[2:] if text.startswith("$ ") else text
        start = start if pending else number
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        out.append((start, strip_comment(pending + text)))
        pending = ""
    if pending:
        out.append((start, strip_comment(pending)))
    return [(n, " ".join(t.split())) for n, t in out]


def markdown_commands(path: Path) -> list[Command]:
    found, block, language, fence_line = [], None, "", 0
    rel = path.relative_to(REPO)
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if block is None and match:
            block, language, fence_line = [], match.group(2).lower(), number
        elif block is not None and line.strip().startswith(("```", "~~~")):
            if language in SHELL_LANGUAGES:
                found += [Command(text, f"{rel}:{start}", f"{rel}:{fence_line}")
                          for start, text in logical_lines(block) if text.startswith(PREFIXES)]  # fmt: skip
            block = None
        elif block is not None:
            block.append((number, line))
    return found


def yaml_commands(path: Path) -> list[Command]:
    rel = path.relative_to(REPO)
    lines = [(n, m.group("command")) for n, line in enumerate(path.read_text().splitlines(), start=1)
             if (m := YAML_COMMAND.match(line))]  # fmt: skip
    return [Command(text, f"{rel}:{n}", str(rel)) for n, text in logical_lines(lines) if text.startswith(PREFIXES)]


def collect() -> list[Command]:
    """Every documented command once (the first place it is written), in reading order."""
    found: dict[str, Command] = {}
    for command in [c for path in DOCS for c in markdown_commands(path)]:
        found.setdefault(command.text, command)
    for command in [c for path in sorted((REPO / "conf").rglob("*.yaml")) for c in yaml_commands(path)]:
        found.setdefault(command.text, command)
    return list(found.values())


COMMANDS = collect()

# A command that starts with (or equals) a key is not run; its config is composed and built instead.
MULTINODE = "runs on CPU as 2 nodes x 1 process over gloo in tests/test_multinode.py; composed here"
NOT_RUN = {
    "python train.py experiment=cifar10 trainer.devices=8": "needs 8 GPUs (DDP)",
    "python train.py experiment=cifar10 data.source.download=true": "downloads CIFAR-10 (network) and needs 8 GPUs",
    "python train.py experiment=imagenet64 data.root=/data/imagenet64/": "dataset not on disk (/data/imagenet64)",
    "python train.py -m hydra/launcher=slurm": "submits SLURM jobs (hydra/launcher=slurm), 2 nodes x 8 GPUs",
    "python train.py trainer=ddp trainer.devices=8": "needs 8 GPUs (trainer.accelerator=gpu)",
    "torchrun ": f"torchrun over 2 nodes x 8 GPUs: {MULTINODE}",
    "srun ": f"a SLURM batch script (srun), 2 nodes x 8 GPUs: {MULTINODE}",
    "python -m ddpm.data.make_shards folder:data/faces": "dataset not on disk (data/faces: a folder of your images)",
    "python train.py data=webdataset 'data.urls=\"shards/faces/": "needs the data/faces shards (dataset not on disk)",
    "make test": "runs this suite (recursion)",
    "make test-fast": "runs this suite (recursion)",
    "make install": "pip install (network)",
    "make format": "rewrites files of the repository",
    "make clean": "deletes caches of the repository",
}

# A documented command that fails because of a bug in code outside the docs: {command: "the bug"} (strict).
XFAIL: dict[str, str] = {}


def not_run_reason(text: str) -> str | None:
    return next((reason for key, reason in NOT_RUN.items() if text.startswith(key)), None)


def smoke_values(script: str) -> dict[str, object]:
    """A benchmark's module-level SMOKE dict ({} if it has none, or none written as a literal), keyed by flag."""
    try:
        body = ast.parse((REPO / script).read_text()).body
        for node in body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SMOKE" for t in node.targets):
                return {"--" + key.replace("_", "-"): value for key, value in ast.literal_eval(node.value).items()}
    except (OSError, SyntaxError, ValueError):
        pass
    return {}


def number(text: str) -> int | float | None:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None


def smoke_key(text: str) -> str | None:
    """A benchmark command as its --smoke runs it (benchmarks/common.py's shrink: a number becomes at most the SMOKE
    value, anything else becomes it): commands with the same key run the same smoke (docs/benchmarks.md's `--device
    cuda` commands differ only in --model and sizes above the caps). A numeric option left out keeps its default, so
    it is not the same as one given at or above the cap."""
    tokens = shlex.split(text)
    if tokens[:1] != ["python"] or len(tokens) < 2 or not tokens[1].startswith("benchmarks/"):
        return None
    smoke, kept, i = smoke_values(tokens[1]), [], 2
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if name not in smoke:
            kept.append(tokens[i])
            i += 1
            continue
        if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value, i = tokens[i + 1], i + 1
        cap, given = smoke[name], number(value)
        if isinstance(cap, int | float) and not isinstance(cap, bool):
            kept.append(f"{name}={cap if given is None or given >= cap else given}")
        i += 1
    return " ".join(tokens[:2] + kept)


def smoke_twins(commands: list[Command]) -> dict[str, str]:
    """{command: the earlier command whose smoke it would repeat}: run once, not once per place it is written."""
    first: dict[str, str] = {}
    twins = {}
    for command in commands:
        key = None if not_run_reason(command.text) else smoke_key(command.text)
        if key is not None:
            twins[command.text] = first.setdefault(key, command.text)
    return {text: earlier for text, earlier in twins.items() if text != earlier}


SMOKE_TWINS = smoke_twins(COMMANDS)


def command_id(command: Command) -> str:
    return command.text if len(command.text) <= 72 else command.text[:69] + "..."


# ------------------------------------------------------------------------------------------ shrinking, placeholders

TRAIN_SHRINK = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "data.batch_size=16",
    "callbacks.checkpoint.every_n_train_steps=2",
    # compile (experiment=mnist: auto, on for CUDA and AMX CPUs) traced by dynamo, not code-generated by inductor
    # (minutes per run on 2 cores)
    "module.compile_backend=aot_eager",
]
GRID_SHRINK = ["callbacks.sample_grid.every_n_steps=2", "callbacks.sample_grid.num_samples=4",
               "callbacks.sample_grid.sampler.steps=2"]  # fmt: skip
NO_GRID = ("hparams_search=mnist_quality",)  # presets that set callbacks.sample_grid: null
# callbacks.fid: at the last step, K = 50 images of 2 sampler steps (hparams_search=mnist_quality's objective,
# val/cfid@${callbacks.fid.num_samples}, follows K)
FID_SHRINK = ["callbacks.fid.every_n_steps=2", "callbacks.fid.sampler.steps=2", "callbacks.fid.num_samples=50"]
FID = ("callbacks.fid", "callbacks/fid", "hparams_search=mnist_quality")  # commands with the FID callback
RAM_DATA_SHRINK = ["data.limit=64"]  # the preloaded sources (digits, mnist, cifar10, image_folder)
STREAM_DATA_SHRINK = ["data.epoch_length=64", "data.shuffle_buffer=16"]  # data=webdataset (no data.limit)
RESUME_SHRINK = ["trainer.max_steps=4"]  # the checkpoint is at step 2: two more steps
OPTUNA_SHRINK = ["hydra.sweeper.n_trials=2"]  # hparams_search=*: a fixed data.batch_size is left out of a search
LR_FIND_SHRINK = ["tune.lr_find.num_steps=8"]
SAMPLE_SHRINK = ["num_samples=4", "sampler.steps=2", "batch_size=4"]
BENCHMARK_SHRINK = ["--smoke"]  # benchmarks/common.py: the script's own seconds-long sizes; JSON only to --out
BENCHMARK_CACHES = {"benchmarks/samplers.py": "--cache-dir"}  # reference statistics: in the temp folder, not ~/.cache

# The run a documented placeholder stands for (FIXTURES below make them; each is itself a command).
DEFAULT_RUN = "outputs/2026-11-23/10-00-00"  # `python train.py`'s run, where `ckpt_path=last` finds it
PLACEHOLDERS = [  # (pattern, fixture, replacement: {sandbox} / {tmp} filled in)
    (r"outputs/<date>/<time>", "default", DEFAULT_RUN),
    (r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", "default", DEFAULT_RUN),
    (r"outputs/<mnist run>", "conditional", "{tmp}/fixture_conditional_run"),
    (r"outputs/\.\.\.", "conditional", "{tmp}/fixture_conditional_run"),
    (r"<run>", "conditional", "{tmp}/fixture_conditional_run"),
    (r"features=mnist_classifier\.pt", "classifier", "features=mnist_classifier.pt"),  # a file made in the sandbox
]
# The runs placeholders are filled from, made once per module (only when a selected command needs them):
# - default: the README's `python train.py` (digits, unconditional), in the sandbox at DEFAULT_RUN, so that
#   `ckpt_path=last` (the newest outputs/*/*/checkpoints/last.ckpt under the launch directory) finds it;
# - conditional: class-conditional MNIST with label dropout (experiment=mnist), for guidance, labels and the
#   benchmarks' --ckpt (a 2-step run: its ema.pt is the tiny checkpoint they read);
# - classifier: mnist_classifier.pt in the sandbox, as benchmarks/mnist_quality.py's docstring makes it (--smoke).
FIXTURES = {
    "default": Command("python train.py", "fixture", "fixture"),
    "conditional": Command("python train.py experiment=mnist data.root=../shared/data/mnist", "fixture", "fixture"),
    "classifier": Command(
        "python benchmarks/mnist_quality.py --save-classifier mnist_classifier.pt", "fixture", "fixture"
    ),
}
FIXTURE_RUN_DIRS = {  # hydra.run.dir of each fixture
    FIXTURES["default"].text: "{sandbox}/" + DEFAULT_RUN,
    FIXTURES["conditional"].text: "{tmp}/fixture_conditional_run",
    FIXTURES["classifier"].text: "{tmp}/fixture_classifier",
}


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


def train_shrink(text: str, run_dir: str) -> list[str]:
    shrink = TRAIN_SHRINK + ([] if any(k in text for k in NO_GRID) else GRID_SHRINK)
    shrink += STREAM_DATA_SHRINK if "data=webdataset" in text else RAM_DATA_SHRINK
    if any(k in text for k in FID):  # the reference statistics cached in the run's temp folder, not in ~/.cache
        shrink += [*FID_SHRINK, f"callbacks.fid.cache_dir={run_dir}_fid_cache"]
    options = {"ckpt_path=": RESUME_SHRINK, "hparams_search=": OPTUNA_SHRINK, "tune=lr_find": LR_FIND_SHRINK}
    return shrink + [o for key, more in options.items() if key in text for o in more]


def output_dirs(text: str, run_dir: str, sweep: bool = True) -> list[str]:
    dirs = [] if "hydra.run.dir=" in text else [f"hydra.run.dir={run_dir}"]
    return dirs + ([f"hydra.sweep.dir={run_dir}_sweep"] if sweep and "hydra.sweep.dir=" not in text else [])


def shrunk(command: Command, sandbox: Path | str, tmp: Path | str, name: str) -> str:
    """The command line that runs: as written, placeholders filled, shrinking arguments and temp outputs appended."""
    text, _ = fill(command.text, sandbox, tmp)
    run_dir = FIXTURE_RUN_DIRS.get(command.text, "{tmp}/" + name).format(sandbox=sandbox, tmp=tmp)
    tokens = shlex.split(text)
    script, _ = script_of(tokens)
    if tokens[:2] == ["make", "train"]:  # the Makefile passes ARGS to train.py
        args = [t for t in tokens if t.startswith("ARGS=")]
        given = args[0][len("ARGS=") :].split() if args else []
        merged = [*given, *train_shrink(text, run_dir), *output_dirs(text, run_dir)]
        kept = [shlex.quote(t) for t in tokens if not t.startswith("ARGS=")]
        return " ".join([*kept, "ARGS=" + shlex.quote(" ".join(merged))])
    extra: list[str] = []
    if script == "train.py":
        extra = [*train_shrink(text, run_dir), *output_dirs(text, run_dir)]
    elif script == "sample.py":
        extra = [*SAMPLE_SHRINK, *output_dirs(text, run_dir, sweep=False)]
    elif script.startswith("benchmarks/"):
        extra = [*BENCHMARK_SHRINK, "--out", f"{run_dir}/{Path(script).stem}.json"]
        extra += [BENCHMARK_CACHES[script], f"{run_dir}/cache"] if script in BENCHMARK_CACHES else []
    return " ".join([text, *(shlex.quote(e) for e in extra)])


def sandbox_paths(text: str) -> list[str]:
    """The sandbox-relative paths a command names (outputs it writes or reads), for ordering within a group."""
    try:
        tokens = shlex.split(text)
    except ValueError:
        return []
    paths = []
    for token in tokens:
        value = (token.split("=", 1)[1] if re.match(r"^\+*[\w./-]+=", token) else token).strip("'\"")
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
