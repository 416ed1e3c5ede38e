"""A training job's records: `result.json` saying RUNNING once the run holds its folder, PREEMPTED or INTERRUPTED
when a signal stopped it; the W&B run closed with the job's outcome (failed when it failed, after the exports);
the W&B run's id kept in every checkpoint, for a requeue to continue it (`KeepWandbRun`).

A signal's stop is a SystemExit or KeyboardInterrupt, which Hydra's run_job does not catch: the summary callback's
on_job_end never runs (it writes COMPLETED or FAILED), and result.json kept what the folder held before.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from ddpm.atomic import atomic_write_text
from ddpm.callbacks.preemption import Interrupted, Preempted
from ddpm.ranks import first_process

RESULT_FILE = "result.json"
_STARTED: set[Path] = set()  # folders whose job got past its refusals (recorded), in this process
WANDB_RUN_KEY = "wandb_run_id"  # a checkpoint's W&B run (KeepWandbRun; ddpm.sweep.continue_wandb_run continues it)


def finish_wandb(loggers: list[Any], exit_code: int | None = None) -> None:
    """Close the W&B run (`exit_code` 1: marked failed), so the next job of an in-process multirun starts its own
    (WandbLogger does not)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger.experiment.finish(exit_code=exit_code)


@contextmanager
def finished(loggers: list[Any]) -> Iterator[None]:
    """The fit, the exports and the objective's read: W&B finishes with the job's outcome, after all of them (a job
    that fails after fit is a failed run there too)."""
    try:
        yield
    except BaseException:
        finish_wandb(loggers, exit_code=1)  # a failed job's W&B run too: the next job would log into it
        raise
    finish_wandb(loggers)  # the next job of an in-process multirun gets its own W&B run


@contextmanager
def recorded(folder: Path, objective: str) -> Iterator[None]:
    """The job from its accepted resume to its end: result.json says RUNNING (write_running), then PREEMPTED or
    INTERRUPTED where a signal stopped it, from the network's build on (Ctrl-C while the data loads too)."""
    write_running(folder, objective)
    _STARTED.add(folder.resolve())
    try:
        yield
    except BaseException as error:
        if not isinstance(error, Exception) and first_process():  # Hydra's on_job_end sees Exceptions only
            write_stopped(folder, error, objective)
        raise


def write_running(folder: Path, objective: str) -> Path | None:
    """result.json saying RUNNING, once the run holds its folder and its resume was accepted: a resumed run's
    folder held its COMPLETED result.json while it ran again, and kept it when the new job was killed. Only where
    the summary callback writes the final one (a Hydra job with hydra.callbacks.summary), by the first process."""
    from hydra.core.hydra_config import HydraConfig

    if not first_process() or not HydraConfig.initialized():
        return None
    callbacks = HydraConfig.get().callbacks or {}
    if not any((node or {}).get("_target_") == "ddpm.sweep.SweepSummary" for node in callbacks.values()):
        return None
    return write_status(folder, _overrides(), "RUNNING", objective)


def write_status(folder: Path, overrides: list[str], status: str, objective: str, value: float | None = None,
                 error: str | None = None, trace: str | None = None) -> Path:  # fmt: skip
    """`folder/result.json`: the job's overrides, status, the objective's value, an error on one line and its
    traceback; written whole (atomically: a summary reading it never sees half a file)."""
    result = {"overrides": overrides, "status": status, objective: value, "error": error, "traceback": trace}
    return atomic_write_text(folder / RESULT_FILE, json.dumps(result, indent=2) + "\n")


def keeps_finished_record(folder: Path, status: str) -> bool:
    """Whether a job's result.json is left as it is: the job was refused at start-up (a resume in place past its
    max_steps, a breaking change) in a folder whose result.json records a finished run and its objective's value;
    the refusal is on stderr and in the log. Asked once at each job's end."""
    started = folder.resolve() in _STARTED
    _STARTED.discard(folder.resolve())
    if status != "FAILED" or started:
        return False
    try:
        return json.loads((folder / RESULT_FILE).read_text())["status"] == "COMPLETED"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def write_stopped(folder: Path, stop: BaseException, objective: str) -> Path:
    """result.json of a job a signal stopped (a SystemExit or KeyboardInterrupt, which Hydra's on_job_end never
    sees): PREEMPTED (the preemption checkpoint to resume from), else INTERRUPTED."""
    path = getattr(stop, "path", None) if isinstance(stop, Preempted) else None
    said = "a second Ctrl-C" if isinstance(stop, Interrupted) else f"{type(stop).__name__} {getattr(stop, 'code', '')}"
    status = "PREEMPTED" if path is not None else "INTERRUPTED"
    error = f"stopped by a signal; resume with ckpt_path={path}" if path else f"stopped: {said.strip()}"
    return write_status(folder, _overrides(), status, objective, error=error)


class KeepWandbRun(pl.Callback):
    """Writes the W&B run's id into every checkpoint (`WANDB_RUN_KEY`), for a resume to continue that run."""

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and logger._experiment is not None:  # rank 0's, once it logged
                checkpoint[WANDB_RUN_KEY] = logger.experiment.id
