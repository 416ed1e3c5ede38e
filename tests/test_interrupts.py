"""Interrupted work keeps what was done: Ctrl-C during training, a killed or failed export, sample.py's outputs.

- Ctrl-C (SIGINT) saves a resumable checkpoint at the next optimizer step exactly as SIGTERM does and exits 130;
  a second Ctrl-C exits at once (130) without one; DataLoader workers survive the terminal's Ctrl-C.
- `python -m ddpm.export` writes into a hidden folder beside the target and swaps it in: a previous export stays
  byte for byte until the new one is complete, leftovers never block a retry, a folder that is not one of our
  exports is refused untouched, and a full disk names the file, the bytes needed and free.
- `sample.py` refuses an output_dir it cannot write before drawing anything.
"""

import csv
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpm.callbacks.preemption import EXIT_INTERRUPTED, Interrupted, Preempted, Preemption
from ddpm.weights.lightning_io import AtomicCheckpointIO

# --- Ctrl-C during training: in-process, a toy module -------------------------------------------------------


class Toy(pl.LightningModule):
    """Linear regression on batches of 2; `on_batch(module, batch_idx)` runs in every training step,
    `on_validation(module)` in every validation step."""

    def __init__(self, on_batch=None, on_validation=None) -> None:
        super().__init__()
        self.net, self.on_batch, self.on_validation = nn.Linear(2, 1), on_batch, on_validation
        self.batches: list[int] = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch_idx)
        if self.on_batch is not None:
            self.on_batch(self, batch_idx)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        if self.on_validation is not None:
            self.on_validation(self)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path: Path, module: Toy, max_steps: int = 100, **kwargs) -> pl.Trainer:
    """Fit with Preemption's defaults, a ModelCheckpoint saving last.ckpt every 2 steps, no sanity check unless
    asked."""
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_last=True)
    kwargs = {"num_sanity_val_steps": 0, "limit_val_batches": 0, **kwargs}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[Preemption(), checkpoint],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()], **kwargs)  # fmt: skip
    trainer.fit(module, data, data if kwargs["limit_val_batches"] else None)
    return trainer


def send_at(batch: int, *signums: int):
    """A training-step hook sending `signums` to this process, in turn, at batch `batch`."""

    def send(module: Toy, batch_idx: int) -> None:
        if batch_idx == batch:
            for signum in signums:
                os.kill(os.getpid(), signum)  # the handler runs before os.kill returns to this frame's next line

    return send


def saved_step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_ctrl_c_saves_at_the_next_step_boundary_and_exits_130(
    tmp_path: Path, accumulate: int, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during micro-batch 4 (0-based): saved after that step (under accumulation after batches 4-5), exit 130,
    said at once on stderr; Python's own SIGINT handler is back afterwards."""
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Preempted) as info:
        fit(tmp_path, Toy(on_batch=send_at(4, signal.SIGINT)), accumulate_grad_batches=accumulate)
    assert info.value.code == EXIT_INTERRUPTED == 130
    assert info.value.path == tmp_path / "checkpoints" / "last.ckpt"
    assert saved_step(info.value.path) == (5 if accumulate == 1 else 3)  # periodic saves: steps 2, 4 (or 2)
    err = capfd.readouterr().err
    assert "Ctrl-C: saving" in err and "press Ctrl-C again to exit at once without saving" in err
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_ctrl_c_exits_at_once_without_a_checkpoint(tmp_path: Path, first: int) -> None:
    """A Ctrl-C while a save is pending (after Ctrl-C or SIGTERM) raises Interrupted (130) at once: batch 4 never
    ends, last.ckpt stays the periodic one of step 4 (the pending save would have been step 5)."""
    before = signal.getsignal(signal.SIGINT)
    module = Toy(on_batch=send_at(4, first, signal.SIGINT))
    with pytest.raises(Interrupted) as info:
        fit(tmp_path, module)
    assert info.value.code == EXIT_INTERRUPTED
    assert module.batches == [0, 1, 2, 3, 4] and saved_step(tmp_path / "checkpoints" / "last.ckpt") == 4
    assert signal.getsignal(signal.SIGINT) is before  # also through Lightning's teardown after the exception


SIGNALS = {
    "SIGINT": (signal.SIGINT, EXIT_INTERRUPTED),
    "SIGTERM": (signal.SIGTERM, 143),
    "SIGUSR1": (signal.SIGUSR1, 143),
}


@pytest.mark.parametrize("name", SIGNALS)
@pytest.mark.parametrize(("where", "step"), [("sanity check", 1), ("validation", 5)])
def test_a_signal_during_validation_or_the_sanity_check_saves_after_the_next_step(
    tmp_path: Path, where: str, step: int, name: str
) -> None:
    """Before the first step (the sanity check) the save follows step 1; during the validation after step 4, step 5.
    A SIGTERM in the sanity check went to Lightning's handler (exit 0 after step 1, no checkpoint: a scheduler saw
    success) and a SIGUSR1 killed the process: both were handled only from the training's start."""
    signum, code = SIGNALS[name]

    def send(module: Toy) -> None:
        if module.trainer.sanity_checking == (where == "sanity check"):
            os.kill(os.getpid(), signum)

    with pytest.raises(Preempted) as info:
        fit(tmp_path, Toy(on_validation=send), num_sanity_val_steps=1, limit_val_batches=1, val_check_interval=4)
    assert saved_step(info.value.path) == step and info.value.code == code


@pytest.mark.parametrize("limit", ["max_steps", "max_epochs"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_last_step_lets_the_run_finish(tmp_path: Path, signum: int, limit: str) -> None:
    """The last step (trainer.max_steps, or the last batch of trainer.max_epochs) ends the run anyway: it finishes
    normally (train.py then writes ema.pt) instead of exiting with a checkpoint that a resume could not continue
    (nothing left to train: a max_epochs run saved one and exited 143). Afterwards the handlers are the ones before
    the fit (SIGTERM was left with Lightning's, which ignored the signal: the process went on)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    bounds = {"max_steps": 6} if limit == "max_steps" else {"max_steps": -1, "max_epochs": 1}  # 32 batches
    trainer = fit(tmp_path, Toy(on_batch=send_at(bounds.get("max_steps", 32) - 1, signum)), **bounds)
    assert trainer.global_step == (6 if limit == "max_steps" else 32) and trainer.state.finished
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize(("log_every", "step", "agree"), [(0, 50, True), (0, 49, False), (1, 49, True)])
def test_ranks_agree_on_a_signal_even_where_lightning_never_logs(log_every: int, step: int, agree: bool) -> None:
    """Under DDP the ranks share rank 0's signal at the steps Lightning logs; with trainer.log_every_n_steps=0 it
    never logs, so a signal was never acted on (the run trained to its end, then the scheduler's SIGKILL)."""
    from types import SimpleNamespace

    preemption, broadcasts = Preemption(), []
    preemption.received = signal.SIGTERM
    strategy = SimpleNamespace(broadcast=lambda x, src: broadcasts.append(x) or x)
    logs = SimpleNamespace(should_update_logs=log_every == 1)
    trainer = SimpleNamespace(world_size=2, log_every_n_steps=log_every, global_step=step, strategy=strategy,
                              _logger_connector=logs, fast_dev_run=False)  # fmt: skip
    assert preemption._broadcast(trainer) == (signal.SIGTERM if agree else None) and len(broadcasts) == agree


# --- Ctrl-C during training: a real train.py -----------------------------------------------------------------


def start_train(run_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """`python train.py` (a long tiny run) in its own process group, as a terminal runs a foreground job."""
    argv = [helpers.PYTHON, "train.py", *helpers.TINY_RUN, "trainer.max_steps=100000", *overrides,
            f"hydra.run.dir={run_dir}"]  # fmt: skip
    with log.open("w") as out:
        return subprocess.Popen(argv, cwd=helpers.REPO, env=helpers.env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait_for(path: Path, process: subprocess.Popen, log: Path, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path.name} never appeared:\n{log.read_text()[-3000:]}"


def finish(process: subprocess.Popen, seconds: float = 120) -> int:
    try:
        return process.wait(timeout=seconds)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
def test_ctrl_c_stops_a_real_run_with_workers_and_the_run_resumes(tmp_path: Path) -> None:
    """Ctrl-C sent to train.py's whole process group (the main process and its 2 DataLoader workers, as a terminal
    does): exit 130, last.ckpt saved at the step it reports, no worker crash; `ckpt_path=<it>` then continues from
    that step to trainer.max_steps."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    process = start_train(run_dir, log, "data.num_workers=2")
    try:
        wait_for(run_dir / "checkpoints" / "step_0000003.ckpt", process, log)
        running = json.loads((run_dir / "result.json").read_text())["status"]
        os.killpg(process.pid, signal.SIGINT)
    finally:
        code = finish(process)
    output = log.read_text()
    assert code == EXIT_INTERRUPTED, output[-3000:]
    stopped = json.loads((run_dir / "result.json").read_text())  # a SystemExit: Hydra's on_job_end never ran
    assert running == "RUNNING" and stopped["status"] == "PREEMPTED" and "ckpt_path=" in stopped["error"]
    assert "exited unexpectedly" not in output and "KeyboardInterrupt" not in output
    assert output.count("Ctrl-C: saving") == 1  # said by the main process only, not by the workers it forked
    last = run_dir / "checkpoints" / "last.ckpt"
    report = re.search(r"Received SIGINT: saved (\S+) at step (\d+); exiting with 130\. Resume with: "
                       r"python train.py ckpt_path=(\S+)", output)  # fmt: skip
    assert report, output[-3000:]
    step = saved_step(last)
    assert Path(report[1]) == last == Path(report[3]) and int(report[2]) == step >= 3
    resumed = tmp_path / "resumed"
    helpers.train(*helpers.TINY_RUN, f"ckpt_path={last}", f"trainer.max_steps={step + 3}", f"hydra.run.dir={resumed}")
    with (resumed / "csv" / "metrics.csv").open() as f:
        trained = [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]
    assert trained == [step, step + 1, step + 2] and (resumed / "ema.pt").is_file()  # steps step+1..step+3, not 1..


# --- python -m ddpm.export: whole or not at all --------------------------------------------------------------


def write_ema(folder: Path, seed: int) -> Path:
    """An ema.pt as train.py writes it, of the tests' tiny UNet with weights drawn from `seed`."""
    from ddpm.weights.torch_file import export_ema

    torch.manual_seed(seed)
    net = helpers.tiny_unet()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.1)
    config = {"model": helpers.tiny_unet_config(), "diffusion": {
        "_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": 1000, "schedule": "linear",
        "prediction": "eps", "p_uncond": 0.1}}  # fmt: skip
    return export_ema(folder / f"ema_{seed}.pt", net.state_dict(), config)


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path: the byte-for-byte state of a folder."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs' ema.pt (different weights) and a reference export of each."""
    pytest.importorskip("diffusers")
    from ddpm.weights import load_model
    from ddpm.weights.diffusers_folder import export_diffusers

    root = tmp_path_factory.mktemp("exports")
    found: dict[str, Path] = {}
    for name, seed in (("a", 1), ("b", 2)):
        found[f"ema_{name}"] = write_ema(root, seed)
        found[name] = export_diffusers(load_model(found[f"ema_{name}"]), root / name)
    assert contents(found["a"]) != contents(found["b"])
    return found


class FailingWrite:
    """Makes the `fail_at`-th file write of an export (0-based, in the order diffusers and we write them) write a
    torn file and fail with a full disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
        import safetensors.torch
        from diffusers.configuration_utils import ConfigMixin

        self.count, self.fail_at, self.failed = 0, fail_at, ""
        save_file, to_json_file, write_text = safetensors.torch.save_file, ConfigMixin.to_json_file, Path.write_text

        def fail(path) -> bool:
            self.count += 1
            if self.count - 1 != self.fail_at:
                return False
            self.failed = "/".join(Path(path).parts[-2:]) if Path(path).parent.name in ("unet", "scheduler") else (
                Path(path).name)  # fmt: skip
            Path(path).write_bytes(b'{"torn')
            return True

        def failing_save_file(tensors, filename, *args, **kwargs):
            if fail(filename):
                from safetensors import SafetensorError

                Path(filename).unlink()  # safetensors removes its partial file
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return save_file(tensors, filename, *args, **kwargs)

        def failing_to_json_file(config, path):
            if fail(path):
                raise OSError(28, "No space left on device")
            return to_json_file(config, path)

        def failing_write_text(path, *args, **kwargs):
            if fail(path):
                raise OSError(28, "No space left on device")
            return write_text(path, *args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
        monkeypatch.setattr(ConfigMixin, "to_json_file", failing_to_json_file)
        monkeypatch.setattr(Path, "write_text", failing_write_text)


@pytest.mark.parametrize("fail_at", range(5))
def test_a_failed_write_at_each_file_keeps_the_previous_export_and_names_the_file(
    exports: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """Export b over export a, the disk full at each of the 5 file writes in turn: a stays byte for byte, nothing
    is left beside it, the error names the file and the bytes; then a retry writes b whole."""
    from ddpm.atomic import WriteError
    from ddpm.weights import load_model
    from ddpm.weights.diffusers_folder import EXPORT_FILES, export_diffusers

    out = shutil.copytree(exports["a"], tmp_path / "out")
    loaded = load_model(exports["ema_b"])
    with monkeypatch.context() as patch:
        failing = FailingWrite(patch, fail_at)
        with pytest.raises(WriteError) as info:
            export_diffusers(loaded, out)
    assert failing.failed == EXPORT_FILES[fail_at]
    message = str(info.value)
    assert f"could not write {out}: writing {EXPORT_FILES[fail_at]} failed (No space left on device" in message
    assert re.search(r"needs about [\d,]+ bytes; [\d,]+ bytes were written .* [\d,]+ bytes .*are free", message)
    assert f"The previous {out} is intact" in message and "out=<folder>" in message
    assert contents(out) == contents(exports["a"]) and hidden(tmp_path) == []
    export_diffusers(loaded, out)
    assert contents(out) == contents(exports["b"]) and hidden(tmp_path) == []


def export_forever(ema_a: Path, ema_b: Path, out: Path, started: int) -> None:
    """Child process: say so on the pipe `started`, then export a and b over each other into `out` for ever."""
    from ddpm.weights import load_model
    from ddpm.weights.diffusers_folder import export_diffusers

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    loaded = [load_model(ema_a), load_model(ema_b)]
    os.write(started, b"1")
    for i in range(10**9):
        export_diffusers(loaded[i % 2], out)


@pytest.mark.slow
def test_an_export_killed_at_random_instants_leaves_a_whole_export_and_a_retry_works(
    exports: dict[str, Path], tmp_path: Path
) -> None:
    """SIGKILL an exporting process 12 times at random instants: the folder is always export a or export b byte for
    byte; the hidden folders the killed processes left never block the next export, which removes them."""
    from ddpm.weights import load_model
    from ddpm.weights.diffusers_folder import export_diffusers

    out, whole = shutil.copytree(exports["a"], tmp_path / "out"), [contents(exports[k]) for k in ("a", "b")]
    rng = random.Random(0)
    for _ in range(12):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                export_forever(exports["ema_a"], exports["ema_b"], out, write)
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.close(read)
        time.sleep(rng.uniform(0.0, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert contents(out) in whole
    export_diffusers(load_model(exports["ema_b"]), out)
    assert contents(out) == whole[1] and hidden(tmp_path) == []


def test_another_projects_pipeline_or_other_files_are_refused_untouched(
    exports: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Folders that are not our exports are never written into: another project's pipeline (its own unet class; our
    UNet2DModel saved by diffusers, without ddpm_config.json), a folder with other files, a file; the CLI exits 1
    naming the folder and why."""
    from ddpm.export import main

    foreign = tmp_path / "foreign"
    (foreign / "unet").mkdir(parents=True)
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
    (foreign / "model_index.json").write_text(json.dumps(index))
    (foreign / "unet" / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    resaved = shutil.copytree(exports["a"], tmp_path / "resaved")
    (resaved / "ddpm_config.json").unlink()  # what diffusers' own save_pretrained of our export leaves
    notes = shutil.copytree(exports["a"], tmp_path / "notes")
    (notes / "unet" / "README.md").write_text("mine")
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    cases = {foreign: "did not write (model_index.json's unet ['diffusers', 'UNet2DConditionModel'], no "
             "ddpm_config.json)", resaved: "did not write (model_index.json's unet ['diffusers', 'UNet2DModel'], no "
             "ddpm_config.json)", notes: "is not an export folder: it holds unet/README.md",
             a_file: "is not an export folder (a file or link)"}  # fmt: skip
    before = {path: contents(path) if path.is_dir() else path.read_bytes() for path in cases}
    for path, why in cases.items():
        with pytest.raises(SystemExit) as info:
            main([f"ckpt={exports['ema_b']}", f"out={path}"])
        err = capsys.readouterr().err
        assert info.value.code == 1 and f"out={path} " in err and why in err and "nothing was written" in err, err
        assert (contents(path) if path.is_dir() else path.read_bytes()) == before[path]
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("left", ["unet/config.json only", "a torn weights file", "a killed export's hidden folders"])
def test_what_a_killed_export_left_never_blocks_a_retry(exports: dict[str, Path], tmp_path: Path, left: str) -> None:
    """An old non-atomic export killed early left unet/config.json alone (or with torn weights): refused before
    ("exists and is not an export folder"); now replaced. A killed atomic export's hidden folders beside the target
    (a dead process's: one killed mid-write, one killed between the fallback's two renames) are removed."""
    from ddpm.weights import load_model
    from ddpm.weights.diffusers_folder import export_diffusers

    out = tmp_path / "out"
    if left == "a killed export's hidden folders":
        dead = f"{socket.gethostname()}-{dead_pid()}"
        shutil.copytree(exports["b"], tmp_path / f".out.tmp-{dead}")
        (tmp_path / f".out.tmp-{dead}" / "model_index.json").unlink()  # killed mid-write
        shutil.copytree(exports["a"], tmp_path / f".out.old-{dead}")
        shutil.copytree(exports["a"], out)
    else:
        (out / "unet").mkdir(parents=True)
        (out / "unet" / "config.json").write_bytes((exports["a"] / "unet" / "config.json").read_bytes()[:100])
    if left == "a torn weights file":
        weights = (exports["a"] / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
        (out / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(weights[: len(weights) // 2])
    export_diffusers(load_model(exports["ema_b"]), out)
    assert contents(out) == contents(exports["b"]) and hidden(tmp_path) == []
    assert load_model(out).net is not None


def test_without_renameat2_the_old_export_is_renamed_aside_and_put_back_after_a_crash(
    exports: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the filesystem cannot swap two folders in one step: rename the old one aside, the new one in, delete the
    old. A process killed between the renames leaves no `out` and the old export hidden beside it: the next export
    first puts it back (so a failing retry still leaves the old export), then replaces it."""
    from ddpm import atomic
    from ddpm.weights import load_model
    from ddpm.weights.diffusers_folder import export_diffusers

    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = shutil.copytree(exports["a"], tmp_path / "out")
    export_diffusers(load_model(exports["ema_b"]), out)
    assert contents(out) == contents(exports["b"]) and hidden(tmp_path) == []
    shutil.move(out, tmp_path / f".out.old-{socket.gethostname()}-{dead_pid()}")  # killed between the renames
    atomic.clear_leftovers(out)
    assert contents(out) == contents(exports["b"]) and hidden(tmp_path) == []


def dead_pid() -> int:
    """The id of a process that has ended."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_file_size_limit_during_export_names_the_file_the_bytes_needed_and_free(
    exports: dict[str, Path], tmp_path: Path
) -> None:
    """A real limit (RLIMIT_FSIZE of 100 KB, as `ulimit -f 100`; in a forked child) under the export: safetensors' raw
    "Error while serializing: I/O error: File too large (os error 27)" becomes a message naming the weights file,
    the bytes the folder needs and the bytes free; the previous export stays byte for byte, nothing is left."""
    import resource

    out, limit = shutil.copytree(exports["a"], tmp_path / "out"), 100_000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            from ddpm.weights import load_model
            from ddpm.weights.diffusers_folder import export_diffusers

            torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
            loaded = load_model(exports["ema_b"])
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            export_diffusers(loaded, out)
            os.write(write, b"no error")
        except BaseException as error:
            os.write(write, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        err = pipe.read()
    os.waitpid(pid, 0)
    weights = (exports["b"] / "unet" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert weights > limit and err.startswith("WriteError: [Errno 27] "), err
    assert f"could not write {out}: writing unet/diffusion_pytorch_model.safetensors failed (File too large)" in err
    assert "ulimit -f" in err and "out=<folder>" in err
    needed = int(re.search(r"needs about ([\d,]+) bytes", err)[1].replace(",", ""))
    free = int(re.search(r"([\d,]+) bytes(?: \([\d.,]+ [MG]B\))? are free", err)[1].replace(",", ""))
    assert weights <= needed < 2 * weights and free == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)
    assert contents(out) == contents(exports["a"]) and hidden(tmp_path) == []


# --- sample.py: an output_dir it cannot write is refused before drawing ---------------------------------------


@pytest.fixture
def no_drawing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing fails the test: a refusal must come before it."""
    from ddpm.sampling import run

    def draw(*args, **kwargs):
        raise AssertionError("images were drawn before the output folder was checked")

    monkeypatch.setattr(run, "generate_sharded", draw)


def sample_in_process(ckpt: Path, output_dir: Path, *overrides: str):
    from ddpm.sampling import sample

    cfg = helpers.compose("sample", [f"ckpt={ckpt}", f"output_dir={output_dir}", "num_samples=4", "device=cpu",
                                     "sampler=ddim", "sampler.steps=2", *overrides])  # fmt: skip
    return sample(cfg)


def test_sample_refuses_an_output_dir_under_a_file_before_drawing(
    exports: dict[str, Path], tmp_path: Path, no_drawing: None
) -> None:
    """A path under a regular file (cannot be created, also as root): a WriteError naming output_dir; nothing drawn."""
    from ddpm.atomic import WriteError

    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "samples"
    with pytest.raises(WriteError, match=rf"output_dir={re.escape(str(out))} cannot be written .* nothing was drawn"):
        sample_in_process(exports["ema_a"], out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the file case covers root")
def test_sample_refuses_a_read_only_output_dir_before_drawing(
    exports: dict[str, Path], tmp_path: Path, no_drawing: None
) -> None:
    from ddpm.atomic import WriteError

    out = tmp_path / "read-only"
    out.mkdir(mode=0o555)
    with pytest.raises(WriteError, match=r"output_dir=.*read-only cannot be written \(Permission denied\)"):
        sample_in_process(exports["ema_a"], out)


def test_sample_refuses_an_output_dir_without_room_before_drawing(
    exports: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_drawing: None
) -> None:
    """100 bytes free for 4 images of 1x8x8 (256 bytes in samples.npz, and the grid): refused naming output_dir,
    num_samples and the bytes."""
    from ddpm.atomic import WriteError

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100))
    with pytest.raises(WriteError, match=r"output_dir=.* has 100 bytes free, but num_samples=4 images of \(1, 8, 8\) "
                                         r"need about 656 bytes"):  # fmt: skip
        sample_in_process(exports["ema_a"], tmp_path / "samples")


def test_sample_creates_a_missing_output_dir_and_writes_its_outputs_atomically(
    exports: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing nested output_dir is created and written; then a samples.npz write that fails halfway (disk full)
    over those outputs leaves the previous samples.npz byte for byte and no temporary file."""
    import numpy as np

    from ddpm.atomic import WriteError
    from ddpm.sampling import outputs

    out = tmp_path / "new" / "nested"
    drawn = sample_in_process(exports["ema_a"], out)
    before = contents(out)
    assert set(before) == {"grid.png", "samples.npz"} and np.load(out / "samples.npz")["images"].shape == (4, 8, 8, 1)

    def savez(file, **arrays):
        file.write(b"PK\x03\x04 half an archive")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.np, "savez", savez)
    with pytest.raises(WriteError, match=re.escape(f"could not write {out / 'samples.npz'} (No space left")):
        outputs.write_samples(drawn.images, drawn.labels, out, nrow=2)
    assert contents(out)["samples.npz"] == before["samples.npz"] and hidden(out) == []
