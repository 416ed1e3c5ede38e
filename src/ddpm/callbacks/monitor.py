"""Training health for every logger: gradient norm, images/s, GPU memory; and a Rich progress bar with an ETA.

`Monitor` logs `train/grad_norm` (global L2 norm of the gradients before clipping), `train/images_per_sec`
(across all devices, averaged over the last `window` batches, data loading included) and, on CUDA,
`train/gpu_mem_gb` (peak allocated memory of this device). Values are logged as tensors or floats through
`pl_module.log`, so they reach csv, tensorboard and W&B under the same keys at the Trainer's
`log_every_n_steps`; on the other steps nothing is computed or logged (`logs_this_step`).
"""

import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar
from torch import Tensor
from torch.optim import Optimizer


def global_norm(tensors: list[Tensor]) -> Tensor:
    """The 2-norm of all `tensors` together, in float32, as gradient clipping computes it: NaN/inf exactly when an
    element is NaN/inf or the norm overflows. One fused kernel per dtype/device group; no host sync."""
    norms = torch._foreach_norm(tensors, ord=2)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), ord=2)


def logs_this_step(trainer: pl.Trainer | None) -> bool:
    """Whether Lightning writes this training batch's step metrics (every `trainer.log_every_n_steps`
    batches, when stopping, and under fast_dev_run); True outside a Trainer.

    Per-step values logged only then reach the loggers exactly as if logged every step, and the other
    steps skip `self.log`, which costs ~1 ms of Python per call on a 2-core CPU (Lightning moves the
    metric's state to the value's device on every call; benchmarks/throughput.py --rows paired_fp32).
    """
    connector = getattr(trainer, "_logger_connector", None)
    if connector is None:
        return True
    return bool(connector.should_update_logs or trainer.fast_dev_run)


@contextmanager
def off_the_clock(trainer: pl.Trainer) -> Iterator[None]:
    """The block's time (a sample grid, an FID evaluation in a training batch's end) is left out of
    train/images_per_sec: Monitor's clock runs without it (a grid step read ~10x slower)."""
    began = time.perf_counter()
    try:
        yield
    finally:
        trainer._ddpm_off_clock_s = paused_seconds(trainer) + time.perf_counter() - began  # type: ignore[attr-defined]


def paused_seconds(trainer: pl.Trainer) -> float:
    return getattr(trainer, "_ddpm_off_clock_s", 0.0)


class Monitor(Callback):
    """Logs train/grad_norm, train/images_per_sec and (on CUDA) train/gpu_mem_gb."""

    def __init__(
        self,
        *,
        grad_norm: bool = True,  # log the global L2 norm of the gradients (before clipping)
        throughput: bool = True,  # log images per second across devices
        gpu_memory: bool = True,  # log peak CUDA memory allocated on this device, in GiB
        window: int = 20,  # batches averaged by images/s
    ) -> None:
        if window < 1:
            raise ValueError(f"callbacks.monitor.window={window} must be >= 1")
        self.grad_norm, self.throughput, self.gpu_memory, self.window = grad_norm, throughput, gpu_memory, window
        self._ends: deque[tuple[float, int]] = deque(maxlen=window + 1)  # (time, images) at batch ends

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self.grad_norm or not logs_this_step(trainer):
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:  # the tensor is only read on logging steps
            pl_module.log("train/grad_norm", global_norm(grads), on_step=True, on_epoch=False)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        logs = logs_this_step(trainer)
        if self.throughput:
            images = _batch_size(batch) * trainer.world_size
            self._ends.append((time.perf_counter() - paused_seconds(trainer), images))  # the training clock
            if logs and len(self._ends) >= 2:
                seconds = self._ends[-1][0] - self._ends[0][0]
                count = sum(n for _, n in list(self._ends)[1:])
                pl_module.log("train/images_per_sec", count / max(seconds, 1e-9), on_step=True)
        if logs and self.gpu_memory and pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
            pl_module.log("train/gpu_mem_gb", peak, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ends.clear()  # validation and its sample grid are not training throughput

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ends.clear()
        self._ends.append((time.perf_counter() - paused_seconds(trainer), 0))


def _batch_size(batch: Any) -> int:
    images = batch[0] if isinstance(batch, list | tuple) else batch
    return int(images.shape[0])


SHOWN = ("train/loss", "train/images_per_sec", "train/skipped_steps", "val/loss")  # the bar's metrics


class ProgressBar(RichProgressBar):
    """Lightning's RichProgressBar, plus the ETA to `trainer.max_steps`; silent when stdout is not a terminal.

    The metrics it shows (`SHOWN`) are logged without `prog_bar=True`: Lightning converts every progress-bar metric
    to a Python number on every batch, a host-device sync per step. The bar reads them from `callback_metrics`
    instead, at each step Lightning logs (those steps sync anyway), and shows those numbers until the next one.
    """

    def __init__(
        self,
        *,
        refresh_rate: int = 1,  # batches between redraws
        leave: bool = False,  # keep each epoch's bar on screen
        only_on_terminal: bool = True,  # no bar when stdout is a file or a pipe (SLURM logs, CI, pytest)
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._start: tuple[float, int] | None = None  # (time, global_step) when training started
        self._shown: dict[str, float] = {}  # SHOWN metrics as of the last logged step
        if only_on_terminal and not sys.stdout.isatty():
            self.disable()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if logs_this_step(trainer) and not self.is_disabled:  # a logged step syncs anyway
            self._read(trainer)
        super().on_train_batch_end(trainer, pl_module, *args)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self.is_disabled and not trainer.sanity_checking:  # the sanity check's val/loss is no validation's
            self._read(trainer)

    def _read(self, trainer: pl.Trainer) -> None:
        metrics = trainer.callback_metrics
        self._shown.update({key: float(metrics[key]) for key in SHOWN if key in metrics})

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module) | self._shown
        items.pop("v_num", None)
        eta = eta_seconds(self._start, time.perf_counter(), trainer.global_step, trainer.max_steps)
        if eta is not None:
            items["eta"] = str(timedelta(seconds=round(eta)))
        return items


def eta_seconds(start: tuple[float, int] | None, now: float, step: int, max_steps: int) -> float | None:
    """Seconds left to `max_steps` at the mean rate since `start` (time, step); None when unknown."""
    if start is None or max_steps is None or max_steps < 0 or step <= start[1]:
        return None
    return (now - start[0]) / (step - start[1]) * max(max_steps - step, 0)
