"""Faults and bad inputs: torn checkpoint writes under kill -9, NaN steps, preemption signals, OOM, config errors.

The table in docs/reliability.md points at these tests (and at the older ones in tests/ that cover
the rest of the bad inputs).
"""

import functools
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import helpers
import lightning.pytorch as pl
import pytest
import torch
import yaml
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpm.atomic import atomic_save
from ddpm.callbacks.nan_guard import NaNGuard, NonFiniteLossError
from ddpm.callbacks.preemption import EXIT_PREEMPTED, Preempted, Preemption
from ddpm.config import validate_config
from ddpm.data.ram import RAMDataModule
from ddpm.data.webdataset import WebDataModule
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.distributed import requeue_signal, slurm_plugins
from ddpm.memory import explain_oom
from ddpm.models.unet import UNet
from ddpm.module import DiffusionModule
from ddpm.resume import check_resume, resolve_ckpt_path
from ddpm.training import train
from ddpm.weights import CheckpointError
from ddpm.weights.lightning_io import AtomicCheckpointIO, NonFiniteCheckpointError
from ddpm.weights.model import CHECKPOINT_KEY
from ddpm.weights.torch_file import export_ema, load_checkpoint

# --- atomic checkpoints: kill -9 while writing ------------------------------------------------------------


def write_forever(folder: Path, started: int) -> None:
    """Child process: say so on the pipe `started`, then write checkpoints as fast as it can (each holds its own
    stamp in every tensor)."""
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (libgomp hangs after fork)
    io = AtomicCheckpointIO()
    os.write(started, b"1")
    for i in range(10**9):
        stamp = float(i)
        weights = {"w": torch.full((256, 1024), stamp)}
        checkpoint = {"global_step": i, "state_dict": weights, CHECKPOINT_KEY: {"w": torch.full((4,), stamp)}}
        io.save_checkpoint(checkpoint, folder / "last.ckpt")
        io.save_checkpoint(checkpoint, folder / f"step_{i % 3}.ckpt")


def test_kill_9_while_saving_never_leaves_a_torn_checkpoint(tmp_path: Path) -> None:
    """60 writer processes SIGKILLed at random instants; every *.ckpt left behind loads and is self-consistent."""
    rng, kills = random.Random(0), 0
    seed = {"global_step": -1, "state_dict": {"w": torch.full((256, 1024), -1.0)}, CHECKPOINT_KEY: {}}
    AtomicCheckpointIO().save_checkpoint(seed, tmp_path / "last.ckpt")
    for _ in range(60):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns to pytest
            try:
                write_forever(tmp_path, write_end)
            finally:
                os._exit(1)
        os.close(write_end)
        assert os.read(read_end, 1) == b"1"  # the child is running: kill it at a random instant of its writes
        os.close(read_end)
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        kills += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        for path in tmp_path.glob("*.ckpt"):
            checkpoint = load_checkpoint(path)  # raises CheckpointError on a torn file
            stamp = float(checkpoint["global_step"])
            assert torch.equal(checkpoint["state_dict"]["w"], torch.full((256, 1024), stamp)), path
    assert kills == 60
    assert (tmp_path / "last.ckpt").is_file()  # replaced 60 times, never missing
    assert list(tmp_path.glob(".*.tmp-*")), "no kill landed during a write: the test proved nothing"


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    def full(obj, f) -> None:
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    named = r"could not write .*last.ckpt.*No space left.*needs about .* MB.* free on its disk.*previous file there is "
    with pytest.raises(OSError, match=named + r"intact.*Free disk space.*callbacks\.checkpoint\.dirpath.*ckpt_path="):
        io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(3)}}, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    with pytest.raises(OSError, match=r"ema.pt.*No file of that name.*ckpt_path=<run dir>; a run that took its last "
                       r"step needs no resume: sample.py and python -m ddpm.export read the EMA weights from its "
                       r"checkpoints/last.ckpt"):  # fmt: skip  # written after the fit: a resume is refused there
        atomic_save({"w": torch.zeros(3)}, tmp_path / "ema.pt")


def test_checkpoint_with_non_finite_weights_is_never_written(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    nan, inf = torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])
    for bad in ({"state_dict": {"w": nan}}, {CHECKPOINT_KEY: {"w": inf}}):
        with pytest.raises(NonFiniteCheckpointError, match=r"NaN/inf at step 7.*last good one"):
            AtomicCheckpointIO().save_checkpoint({"global_step": 7, **bad}, path)
    assert not path.exists()


def test_checkpoint_io_loads_safely(tmp_path: Path) -> None:
    """Lightning's resume path goes through this CheckpointIO: pickled code is refused, not run."""

    class Payload:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    torch.save({CHECKPOINT_KEY: {}, "config": Payload()}, tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError, match="safe loading refuses"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "evil.ckpt")
    assert not (tmp_path / "pwned").exists()


# --- a toy training run for the callbacks -------------------------------------------------------------------


class Toy(pl.LightningModule):
    """Linear regression on 16 batches of 2; rows listed in `nan_batches` have NaN inputs."""

    def __init__(self, nan_batches: tuple[int, ...] = (), hook=None) -> None:
        super().__init__()
        self.net, self.nan_batches, self.hook = nn.Linear(2, 1), nan_batches, hook

    def training_step(self, batch, batch_idx):
        if self.hook is not None:
            self.hook(self, batch_idx)
        x, y = batch
        x = x * float("nan") if batch_idx in self.nan_batches else x
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


def fit(tmp_path: Path, module: Toy, callbacks: list, max_steps: int = 8, **kwargs) -> pl.Trainer:
    x = torch.randn(32, 2, generator=torch.Generator().manual_seed(0))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[*callbacks, checkpoint],
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()], **kwargs)  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2))
    return trainer


def adam_state(module: Toy) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of the optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq, step), by parameter name."""
    optimizer = module.trainer.optimizers[0]
    return {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in module.named_parameters()
            if p in optimizer.state}  # fmt: skip


def test_nan_steps_are_skipped_and_counted(tmp_path: Path) -> None:
    """NaN loss at batches 3 and 4: those two updates are skipped (weights and Adam moments untouched), the weights
    stay finite, the count is logged."""
    weights: list[torch.Tensor] = []
    moments: list[dict[str, dict[str, torch.Tensor]]] = []

    def record(module: Toy, batch_idx: int) -> None:  # before each batch: the state the previous steps left
        weights.append(module.net.weight.detach().clone())
        moments.append(adam_state(module))

    module = Toy(nan_batches=(3, 4), hook=record)
    guard = NaNGuard(max_consecutive=3)
    trainer = fit(tmp_path, module, [guard], log_every_n_steps=1)  # the count is read and logged at logged steps
    assert guard.skipped == 2 and guard.consecutive == 0
    assert trainer.callback_metrics["train/skipped_steps"] == 2
    # Adam's moments and step count: as batch 2's update left them, through the skipped batches 3 and 4.
    assert set(moments[3]) == {"net.weight", "net.bias"}
    for name, state in moments[3].items():
        assert set(state) == {"exp_avg", "exp_avg_sq", "step"} and float(state["step"]) == 3  # batches 0, 1, 2
        for later in (moments[4], moments[5]):
            for key, value in state.items():
                assert torch.equal(later[name][key], value), f"{name}.{key} changed on a skipped step"
        assert not torch.equal(moments[2][name]["exp_avg"], state["exp_avg"])  # a normal step does move them
    assert float(moments[6]["net.weight"]["step"]) == 4  # batch 5 updated again
    assert torch.equal(weights[3], weights[4]) and torch.equal(weights[4], weights[5])  # no update from 3 or 4
    assert not torch.equal(weights[2], weights[3])  # the others did update
    assert all(p.isfinite().all() for p in module.parameters())


def test_nan_steps_in_a_row_stop_with_the_step_causes_and_last_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLossError) as info:
        fit(tmp_path, Toy(nan_batches=(4, 5, 6)), [NaNGuard(max_consecutive=3)])
    message = str(info.value)
    assert "3 optimizer steps in a row, up to step 7" in message
    assert "optim.lr" in message and "fp16" in message
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"Last good checkpoint: {last}" in message
    assert torch.load(last, weights_only=True)["global_step"] == 6  # the last save: steps 5-6 were skipped, finite
    for path in (tmp_path / "checkpoints").glob("*.ckpt"):  # nothing non-finite reached the disk
        assert all(v.isfinite().all() for v in torch.load(path, weights_only=True)["state_dict"].values())


@pytest.mark.parametrize(("signum", "accumulate"), [(signal.SIGTERM, 1), (signal.SIGUSR1, 1), (signal.SIGTERM, 2)])
def test_signal_saves_at_the_next_step_boundary_and_exits_143(tmp_path: Path, signum: int, accumulate: int) -> None:
    """The signal arrives during micro-batch 4 (0-based): under accumulation the save waits for the step to end."""

    def send(module: Toy, batch_idx: int) -> None:
        if batch_idx == 4:
            os.kill(os.getpid(), signum)

    with pytest.raises(Preempted) as info:
        fit(tmp_path, Toy(hook=send), [Preemption()], max_steps=100, accumulate_grad_batches=accumulate)
    assert info.value.code == EXIT_PREEMPTED == 143
    checkpoint = torch.load(info.value.path, weights_only=True)
    assert info.value.path == tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint["global_step"] == (5 if accumulate == 1 else 3)  # after batch 4; after batches 4-5
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)  # handlers are given back


def signal_a_running_run(run_dir: Path, log: Path, signum: int, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`python train.py` (a long tiny run) sent `signum` once training is under way (its step-3 checkpoint written):
    its exit status and output."""
    argv = [helpers.PYTHON, "train.py", *helpers.TINY_RUN, "trainer.max_steps=100000", f"hydra.run.dir={run_dir}"]
    started = run_dir / "checkpoints" / "step_0000003.ckpt"
    with log.open("w") as out:
        process = subprocess.Popen(argv, cwd=helpers.REPO, env=helpers.env(**(env or {})), stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while not started.exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert started.exists(), f"training did not start:\n{log.read_text()[-3000:]}"
            process.send_signal(signum)
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return code, log.read_text()


@pytest.mark.slow
def test_sigterm_stops_a_real_train_py_run_with_143_and_a_loadable_last_ckpt(tmp_path: Path) -> None:
    """`python train.py` (a long tiny run) gets SIGTERM once training is under way: it exits 143 (EXIT_PREEMPTED),
    leaving checkpoints/last.ckpt, written by the preemption callback at the step it reports, loadable safely."""
    run_dir = tmp_path / "run"
    code, output = signal_a_running_run(run_dir, tmp_path / "train.log", signal.SIGTERM)
    assert code == EXIT_PREEMPTED == 143, output[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] >= 3 and checkpoint["state_dict"] and "ema_state_dict" in checkpoint
    report = re.search(r"Received SIGTERM: saved (\S+) at step (\d+); exiting with 143", output)
    assert report, output[-3000:]
    assert Path(report[1]) == last and int(report[2]) == checkpoint["global_step"]  # the preemption's save
    steps = [int(p.stem.split("_")[1]) for p in last.parent.glob("step_*.ckpt")]
    assert checkpoint["global_step"] >= max(steps)


def test_slurm_requeue_plugin_only_under_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under SLURM, Lightning's requeue handler is off (it saved inside the signal handler: ranks hung) and
    Preemption takes USR1; torchrun inside an allocation keeps TorchElastic's ranks (every process was rank 0)."""
    for name in (
        "SLURM_NTASKS",
        "SLURM_JOB_NAME",
        "SUBMITIT_EXECUTOR",
        "SUBMITIT_PREEMPT_SIGNAL",
        "TORCHELASTIC_RUN_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    assert slurm_plugins() == [] and requeue_signal() is None
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "ddpm")
    (plugin,) = slurm_plugins()
    assert isinstance(plugin, SLURMEnvironment) and not plugin.auto_requeue
    assert requeue_signal() == signal.SIGUSR1 and requeue_signal(requeue=False) is None
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                        "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert slurm_plugins() == [] and requeue_signal() is None


def test_a_submitit_job_is_saved_and_requeued_on_submitits_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra/launcher=slurm: submitit's sbatch says --signal=USR2@<signal_delay_s> and submitit's handler of USR2
    (installed before train() runs) ended the job without a checkpoint (max_num_timeout=0): Preemption takes it."""
    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "ddpm", "SUBMITIT_EXECUTOR": "slurm"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    submitits = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGUSR2, submitits)
    try:
        preemption = Preemption()
        preemption.requeue_on = requeue_signal()
        assert preemption.requeue_on == signal.SIGUSR2 and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        (plugin,) = slurm_plugins()
        trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False)
        preemption.on_fit_start(trainer, None)
        assert signal.getsignal(signal.SIGUSR2) == preemption._handle
        preemption.teardown(trainer, None, "fit")
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_slurm_requeue_without_the_preemption_callback_is_refused(
    monkeypatch: pytest.MonkeyPatch, compose_cfg, tmp_path: Path
) -> None:
    """callbacks.preemption=null under SLURM: with Lightning's requeue off, nothing took the warning signal and it
    killed the job without a checkpoint. Refused by train() before any work (the LR range test too)."""
    from ddpm.training import build_callbacks

    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "ddpm"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    with pytest.raises(ValueError, match=r"needs callbacks.preemption .* or set slurm_requeue=false"):
        train(composed(tmp_path / "run", "callbacks.preemption=null", "tune=lr_find"))
    assert not (tmp_path / "run").exists()  # nothing written: no LR range test
    (preemption,) = [c for c in build_callbacks(compose_cfg("train"))[1] if isinstance(c, Preemption)]
    assert preemption.requeue_on == signal.SIGUSR1


def test_a_requeued_sweep_is_its_own_by_its_job_folders_mark(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A requeued `train.py -m` with a fixed hydra.sweep.dir: the job id is in each job folder's .slurm_job, and the
    sweep folder was refused as another run's; a folder marked by another job is not this one's."""
    from ddpm.distributed import SLURM_JOB_FILE, restarted

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    (tmp_path / "sweep" / "0").mkdir(parents=True)
    (tmp_path / "sweep" / "0" / SLURM_JOB_FILE).write_text("4242\n")
    assert not restarted(tmp_path / "sweep")  # the first run: SLURM_RESTART_COUNT unset
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert restarted(tmp_path / "sweep") and restarted(tmp_path / "sweep" / "0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert not restarted(tmp_path / "sweep")


@pytest.mark.slow
def test_a_slurm_job_warned_before_its_limit_is_saved_requeued_and_resumes_in_place(tmp_path: Path) -> None:
    """SLURM's USR1 (sbatch --signal=USR1@<s>): Lightning's own handler saved an hpc checkpoint inside the signal
    handler (the ranks' collectives crossed: a hang); now the checkpoint is written at a step boundary, rank 0 calls
    `scontrol requeue <job>` (a stand-in on PATH records it), and the job SLURM runs again (SLURM_RESTART_COUNT=1,
    the same folder, no ckpt_path) resumes from that last.ckpt."""
    bin_dir, calls, run_dir, log = tmp_path / "bin", tmp_path / "scontrol.txt", tmp_path / "run", tmp_path / "out.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "ddpm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost",
             "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # fmt: skip
    code, output = signal_a_running_run(run_dir, log, signal.SIGUSR1, env=slurm)
    assert code == EXIT_PREEMPTED and calls.read_text() == "requeue 4242\n", output[-3000:]
    saved = re.search(r"Received SIGUSR1: saved (\S+) at step (\d+); exiting with 143. requeued SLURM job 4242", output)
    assert saved and Path(saved[1]) == run_dir / "checkpoints" / "last.ckpt", output[-3000:]
    assert not list(run_dir.glob("hpc_ckpt_*.ckpt"))
    step = int(saved[2])
    again = helpers.train(*helpers.TINY_RUN, f"trainer.max_steps={step + 2}", f"hydra.run.dir={run_dir}",
                          extra_env={**slurm, "SLURM_RESTART_COUNT": "1"})  # fmt: skip
    assert f"Resuming {run_dir}/checkpoints/last.ckpt at step {step}" in again.stdout + again.stderr
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step + 2
    other = helpers.train(*helpers.TINY_RUN, "trainer.max_steps=99", f"hydra.run.dir={run_dir}", check=False,
                          extra_env={**slurm, "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"})  # fmt: skip
    assert other.returncode != 0 and "already holds" in other.stderr  # another job's requeue: not its run


def test_out_of_memory_on_the_first_step_says_what_to_lower(tmp_path: Path) -> None:
    def oom(module: Toy, batch_idx: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(torch.OutOfMemoryError) as info, explain_oom(batch_size=512, precision="32-true"):
        fit(tmp_path, Toy(hook=oom), [])
    message = str(info.value)
    assert "Tried to allocate 20.00 GiB" in message and "data.batch_size=512" in message
    assert "trainer.precision=bf16-mixed (now 32-true)" in message and "activation checkpointing" in message


# --- config: wrong types and values fail before any work; resume refuses breaking changes ---------------------


def composed(tmp_path: Path, *overrides: str):
    return helpers.compose("train", [*overrides, f"paths.output_dir={tmp_path}"])


@pytest.fixture
def constructed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every construction of a datamodule, the UNet, the diffusion or the Lightning module (by class name)."""
    calls: list[str] = []

    def recording(cls: type):
        original = cls.__init__

        @functools.wraps(original)  # keeps the annotations the config type check reads
        def init(self, *args, **kwargs) -> None:
            calls.append(cls.__name__)
            original(self, *args, **kwargs)

        return init

    for cls in (RAMDataModule, WebDataModule, UNet, GaussianDiffusion, DiffusionModule):
        monkeypatch.setattr(cls, "__init__", recording(cls))
    yield calls


def assert_recorder_works(tmp_path: Path, constructed: list[str]) -> None:
    """The recorder sees what train() would build (hydra's instantiate goes through the patched __init__)."""
    before = len(constructed)
    cfg = composed(tmp_path)
    instantiate(cfg.data), instantiate(cfg.model)
    assert constructed[before:] == ["RAMDataModule", "UNet"]


@pytest.mark.parametrize(
    ("override", "named"),
    [("data.batch_size=abc", "data.batch_size='abc' is not int"), ("ema.decay=[1]", "ema.decay=[1] is not float"),
     ("model.num_classes=ten", "model.num_classes='ten' is not"), ("trainer.max_steps=1.5", "trainer.max_steps=1.5")],
)  # fmt: skip
def test_wrong_config_type_fails_fast_naming_the_key(
    tmp_path: Path, override: str, named: str, constructed: list[str]
) -> None:
    cfg = composed(tmp_path, override)
    with pytest.raises(TypeError, match=re.escape(named)):
        validate_config(OmegaConf.to_container(cfg, resolve=True), entry="train")
    with pytest.raises(TypeError, match="config values of the wrong type") as info:
        train(cfg)  # train() checks before it reads data or builds the model
    assert named in str(info.value)
    assert constructed == [], f"built before the type check: {constructed}"
    assert not (tmp_path / "checkpoints").exists()
    assert_recorder_works(tmp_path, constructed)


def test_wrong_config_types_are_all_listed_at_once(tmp_path: Path, constructed: list[str]) -> None:
    cfg = composed(tmp_path, "data.batch_size=abc", "ema.decay=[1]", "optim.lr=fast")
    with pytest.raises(TypeError, match="config values of the wrong type") as info:
        train(cfg)
    for named in ("data.batch_size='abc' is not int", "ema.decay=[1] is not float", "optim.lr='fast' is not"):
        assert named in str(info.value)
    assert constructed == []


def test_out_of_range_config_value_fails_naming_the_key(tmp_path: Path) -> None:
    validate_config(OmegaConf.to_container(composed(tmp_path), resolve=True), entry="train")  # the defaults pass
    with pytest.raises(Exception, match=r"optim.lr=-1 must be a positive finite number"):
        train(composed(tmp_path, "optim.lr=-1"))


def fake_training_checkpoint(path: Path, config: dict) -> Path:
    torch.save({"state_dict": {}, "optimizer_states": [], "loops": {}, "global_step": 40, CHECKPOINT_KEY: {},
                "hyper_parameters": {"config": config}}, path)  # fmt: skip
    return path


def test_resume_refuses_breaking_config_changes_listing_them(tmp_path: Path) -> None:
    config = OmegaConf.to_container(composed(tmp_path), resolve=True)
    path = fake_training_checkpoint(tmp_path / "last.ckpt", config)
    changed = OmegaConf.to_container(
        composed(tmp_path, "model.base_channels=64", "model.num_classes=10", "diffusion.num_timesteps=500"),
        resolve=True,
    )
    with pytest.raises(CheckpointError) as info:
        check_resume(path, changed, tmp_path / "new")
    message = str(info.value)
    lines = ("model.base_channels: checkpoint 32, now 64", "model.num_classes: checkpoint None, now 10",
             "diffusion.num_timesteps: checkpoint 1000, now 500")  # fmt: skip
    for line in lines:
        assert line in message
    assert not (tmp_path / "new" / "resume_diff.yaml").exists()


def test_resume_on_latents_of_another_vae_is_refused_and_a_moved_vae_folder_is_not(tmp_path: Path) -> None:
    """The run config's `latent` record (train() reads it from data.root's meta.json): another VAE's latents, or
    another scaling, would train the weights on a different target; the same VAE in another folder is safe."""
    latent = {"vae": "/a/vae", "vae_identity": "2335f978c15f702e", "scaling_factor": 0.9, "shift_factor": 0.1,
              "latent_shape": [4, 8, 8], "image_shape": [1, 32, 32]}  # fmt: skip
    config = {**OmegaConf.to_container(composed(tmp_path), resolve=True), "latent": latent}
    path = fake_training_checkpoint(tmp_path / "last.ckpt", config)
    other = {**latent, "vae_identity": "f9dcc2f1d3d8685c", "scaling_factor": 1.1, "latent_shape": [4, 16, 16]}
    with pytest.raises(CheckpointError, match="cannot resume") as info:
        check_resume(path, {**config, "latent": other}, tmp_path / "new")
    for line in ("latent.vae_identity: checkpoint '2335f978c15f702e', now 'f9dcc2f1d3d8685c'",
                 "latent.scaling_factor: checkpoint 0.9, now 1.1", "latent.latent_shape"):  # fmt: skip
        assert line in str(info.value)
    moved = check_resume(path, {**config, "latent": {**latent, "vae": "/b/vae"}}, tmp_path / "moved")
    assert moved["latent.vae"] == ("/a/vae", "/b/vae")


def test_resume_with_breaking_changes_is_refused_before_data_or_model(tmp_path: Path, constructed: list[str]) -> None:
    """Through train(): the refusal comes before any datamodule or model is built, listing every difference."""
    path = fake_training_checkpoint(tmp_path / "last.ckpt", OmegaConf.to_container(composed(tmp_path), resolve=True))
    changed = ("model.base_channels=64", "model.num_classes=10", "diffusion.num_timesteps=500")
    with pytest.raises(CheckpointError, match="cannot resume") as info:
        train(composed(tmp_path / "new", *changed, f"ckpt_path={path}"))
    for key in ("model.base_channels", "model.num_classes", "diffusion.num_timesteps"):
        assert key in str(info.value)
    assert constructed == ["GaussianDiffusion"]  # the schedule the grid's sampler is checked on; no data, no network


def test_resume_allows_and_records_safe_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = OmegaConf.to_container(composed(tmp_path), resolve=True)
    path = fake_training_checkpoint(tmp_path / "last.ckpt", config)
    overrides = ("trainer.max_steps=7", "logger=[csv,wandb]", "callbacks.sample_grid=null")
    safe = OmegaConf.to_container(composed(tmp_path, *overrides), resolve=True)
    diff = check_resume(path, safe, tmp_path / "new")
    assert diff["trainer.max_steps"] == (config["trainer"]["max_steps"], 7)
    record = yaml.safe_load((tmp_path / "new" / "resume_diff.yaml").read_text())
    assert record["resumed_from"] == str(path) and record["global_step"] == 40
    assert record["changed"]["trainer.max_steps"] == {"checkpoint": config["trainer"]["max_steps"], "now": 7}
    assert "logger.wandb._target_" in record["changed"]  # a logger added (the default: csv, tensorboard)
    assert "trainer.max_steps" in capsys.readouterr().out
    # model keys that change no weight: activation checkpointing (explain_oom's advice), dropout, a default written out
    model = {**config["model"], "checkpoint_activations": True, "dropout": 0.2, "emb_dim": None}
    assert {"model.checkpoint_activations", "model.dropout"} <= set(check_resume(path, {**config, "model": model},
                                                                                 tmp_path / "new"))  # fmt: skip


def test_resume_from_damaged_or_wrong_files_is_a_clear_error(tmp_path: Path) -> None:
    config = OmegaConf.to_container(composed(tmp_path), resolve=True)
    good = fake_training_checkpoint(tmp_path / "good.ckpt", config).read_bytes()
    (tmp_path / "torn.ckpt").write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"torn\.ckpt.*truncated or corrupt.*use another checkpoint"):
        check_resume(tmp_path / "torn.ckpt", config, tmp_path)
    torch.save({CHECKPOINT_KEY: {}, "config": config}, tmp_path / "ema.pt")
    with pytest.raises(CheckpointError, match=r"ema\.pt.*not a training checkpoint.*resume from .*last\.ckpt"):
        check_resume(tmp_path / "ema.pt", config, tmp_path)
    with pytest.raises(CheckpointError, match=r"nope\.ckpt.*does not exist.*resume with ckpt_path="):
        check_resume(tmp_path / "nope.ckpt", config, tmp_path)


def test_ckpt_path_last_finds_the_newest_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    own = tmp_path / "outputs/2026-11-23/12-00-02"
    with pytest.raises(CheckpointError, match="found no outputs"):
        resolve_ckpt_path("last", resume_dir=None, output_dir=own)
    for i, run in enumerate(["2026-11-22/09-00-00", "2026-11-23/08-00-00", "2026-11-23/12-00-02"]):
        path = tmp_path / "outputs" / run / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))
    newest_other = tmp_path / "outputs/2026-11-23/08-00-00/checkpoints/last.ckpt"
    assert resolve_ckpt_path("last", resume_dir=None, output_dir=own).resolve() == newest_other  # not its own dir
    assert resolve_ckpt_path("last", resume_dir="runs/a", output_dir=own) == Path("runs/a/checkpoints/last.ckpt")
    assert resolve_ckpt_path(str(newest_other.parents[1]), resume_dir=None, output_dir=own) == newest_other
    assert resolve_ckpt_path(None, resume_dir=None, output_dir=own) is None


# --- sampling inputs ---------------------------------------------------------------------------------------


def test_guidance_on_an_unconditional_model_is_refused() -> None:
    from ddpm.diffusion.denoiser import Guided
    from ddpm.diffusion.gaussian import VPDenoiser

    plain = VPDenoiser(
        net=nn.Identity(), alpha_bar=torch.linspace(0.99, 0.5, 10, dtype=torch.float64), prediction="eps"
    )
    with pytest.raises(ValueError, match=r"guidance=2\.0: guidance needs a class-conditional model"):
        Guided(plain, guidance=2.0, null_class=None)


@pytest.mark.parametrize("num_samples", [0, -3])
def test_num_samples_not_positive_is_refused_before_loading(num_samples: int) -> None:
    from ddpm.sampling import sample

    with pytest.raises(ValueError, match=f"num_samples={num_samples} is not int > 0"):
        sample(OmegaConf.create({"ckpt": "/nonexistent.ckpt", "num_samples": num_samples}))


def test_sampler_steps_beyond_the_models_t_name_the_key(tmp_path: Path) -> None:
    """The sampler's steps are checked against the model's T when it is used: sample.py names sampler.steps."""
    from ddpm.sampling import sample

    diffusion = {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": 50}
    config = {"model": helpers.tiny_unet_config(), "diffusion": diffusion}
    ckpt = export_ema(tmp_path / "ema.pt", helpers.tiny_unet().state_dict(), config)
    overrides = [f"ckpt={ckpt}", "num_samples=2", "sampler=ddim", "sampler.steps=80", f"output_dir={tmp_path / 's'}"]
    cfg = helpers.compose("sample", overrides)
    with pytest.raises(ValueError, match=r"^sampler\.steps=80 must be between 1 and the model's T=50"):
        sample(cfg)
    assert not (tmp_path / "s" / "samples.npz").exists()
