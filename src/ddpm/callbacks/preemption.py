"""Preemption: on SIGTERM or SIGUSR1, save a checkpoint at the next optimizer-step boundary and exit.

Schedulers warn before they kill: SLURM sends SIGUSR1 (`--signal=USR1@90`) or SIGTERM, Kubernetes
and most clouds SIGTERM. The handler only sets a flag; the checkpoint is written by the training
loop after the next optimizer step (never between accumulated micro-batches, whose gradients a
checkpoint does not hold), to `<checkpoint dir>/last.ckpt`, through the trainer's CheckpointIO.
The process then exits with EXIT_PREEMPTED; `python train.py ckpt_path=last` continues the run.

Lightning's own SIGTERM handler would stop after the current micro-batch with exit status 0;
this callback replaces it for the duration of `fit`. Under SLURM with
`SLURMEnvironment(auto_requeue=True)` Lightning handles SIGUSR1 itself (checkpoint and
`scontrol requeue`), so this callback leaves that signal to it.
"""

import signal
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info

EXIT_PREEMPTED = 143  # 128 + SIGTERM: "stopped on request, checkpoint saved, resume with ckpt_path=last"


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is on disk; exits the process with EXIT_PREEMPTED."""

    def __init__(self, path: Path) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.path = path


class Preemption(Callback):
    """Turns SIGTERM / SIGUSR1 into 'checkpoint at the next step boundary, then exit EXIT_PREEMPTED'."""

    def __init__(self, *, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")) -> None:  # signal names to handle
        unknown = [s for s in signals if not hasattr(signal, s)]
        if unknown:
            raise ValueError(f"callbacks.preemption.signals: unknown signal names {unknown}; use e.g. SIGTERM, SIGUSR1")
        self.signals = tuple(signals)
        self.received: int | None = None  # the signal number received, if any
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        environment = trainer._accelerator_connector.cluster_environment
        slurm_requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        for name in self.signals:
            signum = getattr(signal, name)
            if slurm_requeue and signum == environment.requeue_signal:
                continue  # Lightning checkpoints and requeues on this one
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals to Lightning
                return

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        received = self._broadcast(trainer)
        if received is None or trainer.fit_loop.epoch_loop._should_accumulate():
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(
            f"Received {signal.Signals(received).name}: saved {path} at step {trainer.global_step}; exiting with "
            f"{EXIT_PREEMPTED}. Resume with: python train.py ckpt_path={path}"
        )
        raise Preempted(path)

    def _broadcast(self, trainer: pl.Trainer) -> int | None:
        """Rank 0's view wins, so every rank stops at the same step (and saves the same checkpoint)."""
        if trainer.world_size == 1:
            return self.received
        return trainer.strategy.broadcast(self.received, src=0)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}


def last_checkpoint_path(trainer: pl.Trainer) -> Path:
    """`last.ckpt` in the ModelCheckpoint's folder (else `<default_root_dir>/checkpoints`)."""
    folder = next(
        (c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None
    )
    return Path(folder or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"
