"""Every command of a ```bash block in README.md and docs/*.md runs here, shrunk: the docs are tested as written.

RUNS is the one table: each documented command (its exact text, or a prefix ending in " ...") maps to what is
appended to run it here in seconds (Hydra overrides, or a benchmark script's own --smoke), or to the reason it
cannot run here (then its config is composed instead; `make -n` for a make target). A new command fails
test_every_command_has_one_entry_and_no_entry_is_stale until it has an entry, as does an entry no command matches.

The commands run in a sandbox (copies of the entry points, links to conf/ and src/, its own $HOME), WORKERS at a
time, each once per module: a plain `python train.py ...` (sample.py, -m ddpm....) as a fork of a warm server
(tests/warm.py), the rest through bash. A train.py / sample.py run that names no folder writes to runs/<n>, a
benchmark its JSON to runs/<n>.json (--out). PLACEHOLDERS are the runs the docs' `outputs/...` stand for; a command
that names a folder of RUN_DIRS runs after the command that writes it.
"""

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import warm
from helpers import REPO, compose, env, run
from omegaconf import OmegaConf
from PIL import Image

pytestmark = pytest.mark.slow

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # `python`: this venv
WORKERS = int(os.environ.get("DOCS_COMMANDS_WORKERS", "3"))  # commands at a time (each is mostly start-up)

# 2 steps of batch 16 on 64 images, validation, checkpoint, a 4-image grid at step 2; compile: aot_eager, not inductor
TRAIN = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
         "trainer.log_every_n_steps=1", "data.batch_size=16", "data.limit=64",
         "callbacks.checkpoint.every_n_train_steps=2", "callbacks.sample_grid.every_n_steps=2",
         "callbacks.sample_grid.num_samples=4", "callbacks.sample_grid.sampler.steps=2",
         "module.compile_backend=aot_eager"]  # fmt: skip
VAE_TRAIN = [*TRAIN[:7], "callbacks.vae_grid.every_n_steps=2", "callbacks.vae_grid.num_images=4"]  # its grid
RESUME = [*TRAIN, "trainer.max_steps=4"]  # the checkpoint is at step 2: two more steps
SAMPLE = ["num_samples=4", "sampler.steps=2", "batch_size=4"]
SMOKE = ["--smoke"]  # benchmarks/common.py: the script's own seconds-long sizes, CPU when CUDA is absent
MNIST_RUN = "outputs/mnist_f_s42"
DEFAULT_RUN = "outputs/2026-11-23/10-00-00"  # `python train.py`'s run: where `ckpt_path=last` finds it
MNIST = "python train.py experiment=mnist data.root=../shared/data/mnist seed=42 hydra.run.dir=outputs/mnist_f_s42"
DDPM = ("python train.py experiment=mnist data.root=../shared/data/mnist diffusion=linear diffusion.p_uncond=0.1 "
        "model.scale_shift=false optim.decay=none seed=42 hydra.run.dir=outputs/mnist_ddpm_s42")  # fmt: skip
SAMPLES = f"python sample.py ckpt={MNIST_RUN}/ema.pt num_samples=500 guidance=0.5 hydra.run.dir=outputs/mnist_samples"
VAE = "python train.py experiment=mnist_vae data.root=../shared/data/mnist hydra.run.dir=outputs/mnist_vae"
ENCODE = (
    "python -m ddpm.data.encode vae=outputs/mnist_vae/vae data=mnist data.root=../shared/data/mnist out=latents/mnist"
)
LATENT = "python train.py experiment=mnist_latent data.root=latents/mnist hydra.run.dir=outputs/mnist_latent"
PLACEHOLDERS = {"outputs/<date>/<time>": DEFAULT_RUN, "outputs/...": MNIST_RUN, "outputs/<mnist run>": MNIST_RUN}
RUN_DIRS = {DEFAULT_RUN: "python train.py", "outputs/mnist_f_s42": MNIST, "outputs/mnist_ddpm_s42": DDPM,
            "outputs/mnist_samples": SAMPLES, "outputs/mnist_vae": VAE, "latents/mnist": ENCODE,
            "outputs/mnist_latent": LATENT}  # fmt: skip  # a folder other commands read: the command writing it
GPUS = "needs 8 GPUs (DDP); a 2-process DDP run on CPU is tests/test_ddp.py"
MULTINODE = "2 nodes x 8 GPUs; tests/test_multinode.py runs it on CPU as 2 nodes x 1 process over gloo"

RUNS: dict[str, list[str] | str] = {
    # README.md
    "make train": ["ARGS=" + " ".join([*TRAIN, "hydra.run.dir=runs/make_train"])],  # the Makefile's ARGS to train.py
    "make test": "runs this suite (recursion)",
    "python train.py": [*TRAIN, f"hydra.run.dir={DEFAULT_RUN}"],
    "python sample.py ckpt=outputs/<date>/<time>/ema.pt num_samples=64 sampler.steps=100": SAMPLE,
    "python train.py -m optim.lr=1e-4,2e-4 model.dropout=0,0.1": TRAIN,
    "python train.py hparams_search=optuna": [*TRAIN, "hydra.sweeper.n_trials=2"],
    "python train.py logger=wandb logger.wandb.project=ddpm": TRAIN,  # WANDB_MODE=offline (tests/helpers.py)
    "python train.py tune=lr_find": [*TRAIN, "tune.lr_find.num_steps=8"],
    "python train.py experiment=cifar10 trainer.devices=8": GPUS,
    "python train.py -m hydra/launcher=slurm ...": "submits SLURM jobs (hydra/launcher=slurm), 2 nodes x 8 GPUs",
    "python train.py experiment=mnist data.root=../shared/data/mnist": TRAIN,
    "python train.py experiment=cifar10 data.source.download=true trainer.devices=8": "downloads CIFAR-10; " + GPUS,
    "python train.py experiment=imagenet64 data.root=/data/imagenet64/train": "ImageNet 64x64 is not on disk",
    "python train.py trainer.max_steps=2000 optim.lr=1e-3 diffusion.prediction=v ...": TRAIN,
    f"python train.py ckpt_path={DEFAULT_RUN}/checkpoints/last.ckpt": RESUME,
    "python train.py ckpt_path=last": [*RESUME, "trainer.max_steps=6"],  # after the line above, if it ran first
    "python sample.py ckpt=outputs/.../ema.pt num_samples=500 guidance=0.5": SAMPLE,
    "python sample.py ckpt=outputs/.../checkpoints/last.ckpt labels=[3,7] seed=1 device=cpu": SAMPLE,
    "python -m ddpm.export ckpt=outputs/.../ema.pt out=exports/digits": [],
    # docs/benchmarks.md and docs/mnist.md: every benchmark script with its own --smoke
    "python benchmarks/mnist_quality.py ...": SMOKE,
    "python benchmarks/mnist_recipe.py ...": SMOKE,
    "python benchmarks/peers.py ...": SMOKE,
    "python benchmarks/recipe_cost.py ...": SMOKE,
    "python benchmarks/sampling.py ...": SMOKE,
    "python benchmarks/throughput.py ...": SMOKE,
    "NVIDIA_TF32_OVERRIDE=0 python benchmarks/mnist_recipe.py ...": SMOKE,
    "pip install -e '.[peers]'": "pip install (network): the extra is checked in pyproject.toml",
    "bash benchmarks/gpu.sh ...": "a lent GPU machine; tests/test_gpu_command.py runs it and gpu.py --smoke on CPU",
    # docs/mnist.md
    MNIST: TRAIN,
    SAMPLES: SAMPLE,
    DDPM: TRAIN,
    "python sample.py ckpt=outputs/mnist_f_s42/ema.pt num_samples=100 guidance=0.5": SAMPLE,
    "python sample.py ckpt=outputs/mnist_f_s42/ema.pt num_samples=100 guidance=0": SAMPLE,
    # README.md and docs/latent.md: a VAE, the digits encoded, a latent model, its samples and export
    VAE: VAE_TRAIN,
    ENCODE: ["data.limit=64"],
    LATENT: TRAIN,
    "python sample.py ckpt=outputs/mnist_latent/ema.pt num_samples=100 guidance=0.5": SAMPLE,
    "python -m ddpm.export ckpt=outputs/mnist_latent/ema.pt out=exports/mnist_latent": [],
    "python -m ddpm.data.encode vae=vaes/sd-vae-ft-ema ...": "ImageNet and a downloaded VAE are not on disk",
    "python train.py experiment=imagenet256_latent data.root=latents/imagenet256 trainer.devices=8": (
        "ImageNet's latents are not on disk; " + GPUS
    ),
    # docs/scaling.md (data/faces: the sandbox's four images)
    "python -m ddpm.data.make_shards folder:data/faces shards/faces ...": [],
    "python train.py data=webdataset 'data.urls=\"shards/faces/shard-{000000..000099}.tar\"' model=unet64": (
        "reads 100 shards of your images (the sandbox has one); tests/test_webdataset.py trains on shards"
    ),
    "python train.py trainer=ddp trainer.devices=8 trainer.accelerator=gpu trainer.precision=bf16-mixed": GPUS,
    "torchrun ...": MULTINODE,
    "srun python train.py ...": MULTINODE,
}


def documented() -> dict[str, str]:
    """{command: where its block starts} for each line of a ```bash block: `\\` continuations joined, comment lines
    and trailing ` # comments` dropped, spaces collapsed."""
    found: dict[str, str] = {}
    for path in DOCS:
        text = path.read_text()
        for block in re.finditer(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, flags=re.M | re.S):
            first, pending, start = text.count("\n", 0, block.start(1)) + 1, "", 0
            for i, line in enumerate(block.group(1).splitlines()):
                start = start if pending else first + i
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                command = " ".join(re.split(r"\s#\s|^\s*#", pending + line)[0].split())
                pending = ""
                if command:
                    found.setdefault(command, f"{path.relative_to(REPO)}:{start}")
    return found


DOCUMENTED = documented()


def entries(command: str) -> list[str]:
    return [k for k in RUNS if k == command or (k.endswith(" ...") and command.startswith(k.removesuffix("...")))]


def fill(command: str) -> str:
    return functools.reduce(lambda line, pair: line.replace(*pair), PLACEHOLDERS.items(), command)


def needs(command: str) -> list[str]:
    """The commands whose folders `command` reads (RUN_DIRS); `ckpt_path=last` reads the newest run, the default."""
    found = [writer for folder, writer in RUN_DIRS.items() if folder in fill(command) and writer != command]
    return found + (["python train.py"] if "ckpt_path=last" in command else [])


def without_mnist(command: str) -> bool:
    """It, or a run it reads, trains on ../shared/data/mnist, and the repository has no MNIST files beside it."""
    uses = "../shared/data/mnist" in command or any(without_mnist(need) for need in needs(command))
    return uses and not (REPO.parent / "shared" / "data" / "mnist").is_dir()


def shrunk(command: str, n: int) -> str:
    """The line that runs: placeholders filled, the entry's arguments and the two rules' outputs appended."""
    (key,) = entries(command)
    line = " ".join([fill(command), *(shlex.quote(a) for a in RUNS[key])])
    if re.search(r"\b(train|sample)\.py\b", line) and "hydra.run.dir=" not in line:
        line += f" hydra.run.dir=runs/{n} hydra.sweep.dir=runs/{n}_sweep"
    return line + (f" --out runs/{n}.json" if " benchmarks/" in line else "")


def make_sandbox(root: Path) -> Path:
    """<root>/repo: copies of train.py, sample.py, benchmarks/*.py (they find folders from their path); links to conf/,
    src/, Makefile, pyproject.toml; .venv: links into this venv, its own install stamp (`make train` never installs);
    data/faces/a/*.png: docs/scaling.md's images; <root>/shared: ../shared (data.root=../shared/data/mnist)."""
    sandbox = root / "repo"
    (sandbox / "benchmarks" / "results").mkdir(parents=True)
    (sandbox / "runs").mkdir()
    for script in ["train.py", "sample.py", *(f"benchmarks/{p.name}" for p in (REPO / "benchmarks").glob("*.py"))]:
        shutil.copy2(REPO / script, sandbox / script)
    for name in ("conf", "src", "Makefile", "pyproject.toml"):
        (sandbox / name).symlink_to(REPO / name)
    (sandbox / ".venv").mkdir()
    for entry in (REPO / ".venv").iterdir():
        if entry.name != ".installed":
            (sandbox / ".venv" / entry.name).symlink_to(entry)
    (sandbox / ".venv" / ".installed").touch()
    (sandbox / "data" / "faces" / "a").mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (48, 40), (60 * i, 120, 200)).save(sandbox / "data" / "faces" / "a" / f"{i}.png")
    if (REPO.parent / "shared").exists():
        (root / "shared").symlink_to(REPO.parent / "shared")
    return sandbox


class Runner:
    """Runs each command once, WORKERS at a time, in the order started; a command's needs start before it."""

    def __init__(self, root: Path) -> None:
        self.sandbox, self.home = make_sandbox(root), root / "home"
        self.home.mkdir()  # every command's $HOME: what one leaves in ~/.cache is seen here, not in yours
        self.pool, self.lock = ThreadPoolExecutor(max_workers=WORKERS), threading.RLock()
        self.futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
        self.warm, self.env = warm.Pool(env()), {"PATH": PATH, "HOME": str(self.home)}

    def start(self, command: str) -> "Future[subprocess.CompletedProcess[str]]":
        with self.lock:
            if command not in self.futures:
                before = [self.start(need) for need in needs(command)]
                self.futures[command] = self.pool.submit(self._run, shrunk(command, len(self.futures)), before)
            return self.futures[command]

    def _run(self, line: str, before: list[Future]) -> subprocess.CompletedProcess[str]:
        for need in (future.result() for future in before):
            if need.returncode != 0:
                return subprocess.CompletedProcess(line, -1, "", f"needs `{need.args}`, which failed")
        try:
            if warm.eligible(words := warm.plain(line), self.env):
                return self.warm.run(words, cwd=self.sandbox, env=env(**self.env), timeout=300)
            return run(line, shell=True, cwd=self.sandbox, check=False, timeout=300, extra_env=self.env)
        except subprocess.TimeoutExpired as error:
            return subprocess.CompletedProcess(line, -9, "", f"timed out after {error.timeout} s")


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """Starts the selected runnable commands: the runs others read first, then in the docs' order."""
    runner = Runner(tmp_path_factory.mktemp("docs_commands"))
    selected = {item.callspec.params.get("command") for item in request.session.items
                if item.path == Path(__file__) and hasattr(item, "callspec")}  # fmt: skip
    for command in [*RUN_DIRS.values(), *DOCUMENTED]:
        runs = len(entries(command)) == 1 and isinstance(RUNS[entries(command)[0]], list) and not without_mnist(command)
        if command in selected and runs:
            runner.start(command)
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)
    runner.warm.close()


def check_without_running(command: str) -> None:
    """A make target exists (`make -n`), a bash script parses (`bash -n`), a pip extra is declared; a train.py
    or encode config composes with every override."""
    tokens = shlex.split(command)
    if tokens[0] in ("make", "bash"):
        run(*(["make", "-n", tokens[1]] if tokens[0] == "make" else ["bash", "-n", tokens[1]]), cwd=REPO, timeout=60)
    elif tokens[:2] == ["pip", "install"]:
        extras = {e for group in re.findall(r"\[([\w,-]+)\]", command) for e in group.split(",")}
        declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert extras and extras <= declared.keys(), f"`{command}`: pyproject.toml declares {sorted(declared)}"
    elif tokens[1:3] == ["-m", "ddpm.data.encode"]:
        compose("encode", tokens[3:])
    else:
        script = next(i for i, t in enumerate(tokens) if t.endswith("train.py"))
        overrides = [t for t in tokens[script + 1 :] if t not in ("-m", "--multirun")]
        cfg = compose("train", overrides, return_hydra_config=True)
        OmegaConf.to_container(cfg.hydra.launcher, resolve=True)  # hydra/launcher=slurm: its keys resolve


@pytest.mark.parametrize("command", DOCUMENTED, ids=lambda c: c if len(c) <= 72 else c[:69] + "...")
def test_documented_command(command: str, runner: Runner) -> None:
    """It runs, shrunk, and exits 0; or it cannot run here (RUNS says why) and its config composes."""
    (key,) = entries(command)
    if isinstance(RUNS[key], str):
        check_without_running(command)
        return
    if without_mnist(command):
        pytest.skip("needs the MNIST files in ../shared/data/mnist beside the repository")
    result = runner.start(command).result()
    out = f"{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    report = f"{DOCUMENTED[command]}: {result.args}\nexit {result.returncode}\n{out}"
    assert result.returncode == 0, report
    if "ckpt_path=" in command:  # it resumed the run made first, not a fresh start
        assert "Resuming " in result.stdout + result.stderr, report
    if " benchmarks/" in command:  # --smoke wrote its JSON where --out said, and nothing under benchmarks/results
        assert json.loads((runner.sandbox / result.args.rsplit(" --out ", 1)[1]).read_text()), report
        assert not list((runner.sandbox / "benchmarks" / "results").iterdir()), report


def test_every_command_has_one_entry_and_no_entry_is_stale() -> None:
    """Every documented command matches exactly one entry of RUNS (add one for a new command), and every entry a
    documented command (remove those of commands the docs no longer show)."""
    assert {c: entries(c) for c in DOCUMENTED if len(entries(c)) != 1} == {}
    assert [k for k in RUNS if not any(k in entries(c) for c in DOCUMENTED)] == []


def test_no_command_writes_the_user_cache(runner: Runner) -> None:
    """No documented command leaves files in ~/.cache/lightning-ddpm (a $HOME of their own): --smoke's reference
    statistics belong to a throwaway classifier and stay in the script's temp folder."""
    if not runner.futures:
        pytest.skip("no documented command ran in this session (select test_documented_command too)")
    for future in list(runner.futures.values()):
        future.result()
    assert sorted((runner.home / ".cache" / "lightning-ddpm").rglob("*")) == []
