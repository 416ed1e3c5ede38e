"""Preemption and Ctrl-C: on SIGTERM, SIGUSR1 or SIGINT, save a checkpoint at the next optimizer-step boundary and
exit; a second Ctrl-C exits at once.

Schedulers warn before they kill: SLURM sends SIGUSR1 (`--signal=USR1@90`) or SIGTERM, Kubernetes
and most clouds SIGTERM; a person at a terminal presses Ctrl-C (SIGINT). The handler only sets a flag; the
checkpoint is written by the training loop after the next optimizer step (never between accumulated
micro-batches, whose gradients a checkpoint does not hold), to `<checkpoint dir>/last.ckpt`, through the
trainer's CheckpointIO. The process then exits with 128 + the signal (EXIT_INTERRUPTED = 130 for Ctrl-C,
EXIT_PREEMPTED = 143 for SIGTERM and SIGUSR1); `python train.py ckpt_path=<that last.ckpt>` continues the run.
A signal during the fit's last step (max_steps, or the last batch of max_epochs) lets the run finish normally
(ema.pt is written, exit 0).

Ctrl-C says at once that it will save, and that a second Ctrl-C exits without saving: the second raises
`Interrupted` (exit 130) wherever the process is (a save in progress is atomic: it leaves the previous file).
Every signal is handled from `on_fit_start`, before the sanity check and before any DataLoader worker is forked;
workers inherit the handler and ignore the signal (the terminal sends Ctrl-C to the whole process group, and a
worker that died of it would crash the main process with "DataLoader worker exited unexpectedly"). Lightning then
installs its own SIGTERM handler (which would stop the sanity check or the current micro-batch with exit status 0
and no checkpoint); this callback takes SIGTERM back at the sanity check's and the training's start, so a signal
at any point of the fit is saved after the next optimizer step (step 1 at the earliest). Under SLURM, SLURM's
warning signal (`requeue_on`: USR1, or submitit's USR2; ddpm.distributed turns Lightning's own requeue off, which
saved inside the signal handler and hung the ranks) is saved the same way, then rank 0 requeues the job (`scontrol
requeue`), which resumes in place (ddpm.resume.requeued_from). Every handler is given back when fit ends. Under DDP
the ranks agree on the signal at the steps Lightning logs (every `SIGNAL_EVERY` optimizer steps with
log_every_n_steps=0).
"""

import contextlib
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info

from ddpm.callbacks.monitor import logs_this_step
from ddpm.distributed import requeue_job

EXIT_PREEMPTED = 143  # 128 + SIGTERM: "stopped on request, checkpoint saved, resume with ckpt_path=last"
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C (the shell's convention), with or without the checkpoint
SIGNAL_EVERY = 50  # optimizer steps between the ranks' agreements on a signal when Lightning never logs


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is on disk; exits the process with `code` (143, or 130 for Ctrl-C)."""

    def __init__(self, path: Path, code: int = EXIT_PREEMPTED) -> None:
        super().__init__(code)
        self.path = path


class Interrupted(SystemExit):
    """A second Ctrl-C: exits at once with EXIT_INTERRUPTED, without a checkpoint."""

    def __init__(self) -> None:
        super().__init__(EXIT_INTERRUPTED)


def exit_code(signum: int) -> int:
    """The exit status after a signal's checkpoint: 130 for SIGINT, 143 (EXIT_PREEMPTED) for the others."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


class Preemption(Callback):
    """Turns SIGTERM / SIGUSR1 / SIGINT into 'checkpoint at the next step boundary, then exit'; a second SIGINT
    exits at once."""

    def __init__(self, *, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")) -> None:  # signals to handle
        unknown = [s for s in signals if not hasattr(signal, s)]
        if unknown:
            raise ValueError(f"callbacks.preemption.signals: unknown signal names {unknown}; use e.g. SIGTERM, SIGINT")
        self.signals = tuple(signals)
        self.received: int | None = None  # the first signal number received, if any
        self._previous: dict[int, Any] = {}
        self._pid: int | None = None  # the process that installed the handlers (forked workers inherit them)
        self._announce = False  # rank 0 says what a Ctrl-C does
        self._last: Path | None = None
        self.requeue_on: int | None = None  # SLURM's warning signal: after its checkpoint, requeue the job (train())

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            return  # a DataLoader worker forked from this process: the main process decides
        if signum == signal.SIGINT and self.received is not None:
            self._say(
                f"Second Ctrl-C: exiting at once ({EXIT_INTERRUPTED}) without a checkpoint; "
                + (f"the last one is {self._last}" if self._last and self._last.is_file() else "no last.ckpt was saved")
            )
            raise Interrupted()
        if self.received is None:
            self.received = signum
        if signum == signal.SIGINT:
            self._say(
                f"Ctrl-C: saving {self._last} after the current optimizer step, then exiting ({EXIT_INTERRUPTED}); "
                "press Ctrl-C again to exit at once without saving"
            )

    def _say(self, message: str) -> None:
        """Straight to stderr's file descriptor: a signal handler must not re-enter a buffered stream."""
        if self._announce:
            with contextlib.suppress(OSError):
                os.write(2, f"\n{message}\n".encode())

    def _install(self, trainer: pl.Trainer, names: list[str]) -> None:
        environment = trainer._accelerator_connector.cluster_environment
        slurm_requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        for name in names:
            signum = getattr(signal, name)
            if slurm_requeue and signum == environment.requeue_signal:
                continue  # Lightning checkpoints and requeues on this one
            try:
                previous = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals to Lightning
                return
            self._previous.setdefault(signum, previous)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received, self._pid = None, os.getpid()
        self._announce, self._last = trainer.is_global_zero, last_checkpoint_path(trainer)
        self._install(trainer, list(self.signals) + self._requeue_names())

    def _requeue_names(self) -> list[str]:
        """The requeue signal where the configured ones leave it out (submitit's USR2)."""
        name = signal.Signals(self.requeue_on).name if self.requeue_on is not None else None
        return [name] if name and name not in self.signals else []

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back(trainer)

    def _take_back(self, trainer: pl.Trainer) -> None:
        """Replace the SIGTERM handler Lightning installed after on_fit_start (it calls ours too, so a signal that
        came in between is already ours; its own flag would stop the loop without a checkpoint)."""
        self._install(trainer, [name for name in self.signals if name != "SIGINT"] + self._requeue_names())
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and "SIGTERM" in self.signals:  # ours now; left to Lightning, its flag stands
            connector.received_sigterm = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        received = self._broadcast(trainer)
        if received is None or trainer.fit_loop.epoch_loop._should_accumulate():
            return
        name = signal.Signals(received).name
        if fit_ends_after_this_step(trainer):
            rank_zero_info(f"Received {name} at the fit's last step ({trainer.global_step}): finishing")
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)  # by every rank, at the step they agreed on
        requeued = requeue_job() if received == self.requeue_on and trainer.is_global_zero else None
        rank_zero_info(
            f"Received {name}: saved {path} at step {trainer.global_step}; exiting with {exit_code(received)}. "
            + (f"{requeued}: it resumes from there" if requeued else f"Resume with: python train.py ckpt_path={path}")
        )
        raise Preempted(path, exit_code(received))

    def _broadcast(self, trainer: pl.Trainer) -> int | None:
        """Rank 0's view wins, so every rank stops at the same step (and saves the same checkpoint). Several
        processes agree at the steps Lightning logs only: a broadcast is a host-device sync, which every step would
        pay; a signal is then acted on within trainer.log_every_n_steps (or SIGNAL_EVERY) optimizer steps."""
        if trainer.world_size == 1:
            return self.received
        every = trainer.log_every_n_steps
        if not (logs_this_step(trainer) if every else trainer.global_step % SIGNAL_EVERY == 0):
            return None
        return trainer.strategy.broadcast(self.received, src=0)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning's teardown, which follows, puts back the handlers it found when fit began (SIGINT: ours)
        original = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", {})
        for signum, handler in self._previous.items():
            if original.get(signum) == self._handle:
                original[signum] = handler
        self._restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()


def fit_ends_after_this_step(trainer: pl.Trainer) -> bool:
    """Whether this optimizer step is the fit's last: trainer.max_steps reached, or the last batch of the last epoch
    of trainer.max_epochs (a checkpoint saved there would hold a finished run, which nothing can resume)."""
    if 0 <= trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    last_epoch = max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1
    return last_epoch and trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def last_checkpoint_path(trainer: pl.Trainer) -> Path:
    """`last.ckpt` in the ModelCheckpoint's folder (else `<default_root_dir>/checkpoints`)."""
    folder = next(
        (c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None
    )
    return Path(folder or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"
