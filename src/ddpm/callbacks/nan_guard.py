"""NaNGuard: skips optimizer steps whose gradients are non-finite, and stops a run that has diverged.

Two signs of divergence, both checked with one host sync per optimizer step:

- The global gradient 2-norm (the norm clipping uses) is NaN/inf: a NaN/inf loss or gradient, or
  gradients so large that their norm overflows float32 (clipping would then scale them to zero and
  Adam would keep moving the weights on its moments alone). The step is skipped: the gradients
  are dropped, so the optimizer leaves the weights and its moments untouched (the LR schedule
  still advances). After `max_consecutive` such steps in a row the run stops.
- The loss stays far above its running level: more than `divergence_factor` times the lowest
  debiased moving average of the loss (smoothing 0.98, as the LR range test), for
  `divergence_patience` optimizer steps in a row. The run stops.

The check runs after the gradients of the step are complete (after all accumulated micro-batches,
the DDP all-reduce and the fp16 unscale) and before clipping and the update. The loss check reads
the losses of the micro-batches since the previous check, so it lags one optimizer step.
"""

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from ddpm.callbacks.monitor import logs_this_step

SMOOTHING = 0.98  # beta of the loss's moving average (Lightning's lr_find uses the same)
WARMUP = 10  # updates of the moving average before its minimum counts as the running level


def global_norm(tensors: list[Tensor]) -> Tensor:
    """The 2-norm of all `tensors` together, in float32, as gradient clipping computes it: NaN/inf exactly when an
    element is NaN/inf or the norm overflows. One fused kernel per dtype/device group; no host sync."""
    norms = torch._foreach_norm(tensors, ord=2)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), ord=2)


def all_finite(tensors: list[Tensor]) -> bool:
    """True when no element of `tensors` is NaN/inf and their global 2-norm does not overflow."""
    return bool(global_norm(tensors).isfinite())


class DivergenceError(RuntimeError):
    """The run diverged: its loss stayed far above its running level."""


class NonFiniteLossError(DivergenceError):
    """Too many optimizer steps in a row had NaN/inf gradients (or a gradient norm that overflowed)."""


class NaNGuard(Callback):
    """Skips steps with non-finite gradients (`train/skipped_steps`); stops after `max_consecutive` in a row, or when
    the loss stays above `divergence_factor` x its running level for `divergence_patience` steps."""

    def __init__(
        self,
        *,
        max_consecutive: int = 10,  # skipped steps in a row before the run stops
        divergence_factor: float = 10.0,  # a loss above this multiple of its running level counts as diverging
        divergence_patience: int = 20,  # optimizer steps in a row above it before the run stops
    ) -> None:
        if max_consecutive < 1 or divergence_patience < 1:
            raise ValueError(
                f"nan_guard.max_consecutive={max_consecutive} and nan_guard.divergence_patience={divergence_patience} "
                "must be >= 1"
            )
        if not divergence_factor > 1:
            raise ValueError(f"nan_guard.divergence_factor={divergence_factor} must be > 1 (10 is the default)")
        self.max_consecutive, self.factor, self.patience = max_consecutive, divergence_factor, divergence_patience
        self.skipped = 0  # skipped steps in this run so far
        self.consecutive = 0  # skipped steps since the last good one
        self.average, self.updates = 0.0, 0  # moving average of the loss (biased) and its number of updates
        self.level = math.inf  # lowest debiased average so far: the running level
        self.above = 0  # checks in a row with the loss above factor x level
        self._losses: list[Tensor] = []  # this process's micro-batch losses since the last check (on the device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self._losses.append(loss.detach().float().reshape(()))
        if logs_this_step(trainer) or self.consecutive:  # a skip shows at once (callback_metrics, progress bar)
            pl_module.log("train/skipped_steps", float(self.skipped), on_step=True, on_epoch=False)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        values = [global_norm(grads)]
        if self._losses:  # averaged over the ranks, so every rank takes the same decision
            mean = torch.stack(self._losses).mean().to(values[0].device)
            values.append(trainer.strategy.reduce(mean, reduce_op="mean"))
        norm, *loss = torch.stack(values).tolist()  # the one host sync of the guard
        self._losses = []
        if loss and math.isfinite(loss[0]):
            self._track(loss[0], trainer)
        if math.isfinite(norm):
            self.consecutive = 0
            return
        optimizer.zero_grad(set_to_none=True)  # parameters without gradients are left alone by the step
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(self._message(trainer, self._nonfinite_cause()))

    def _track(self, loss: float, trainer: pl.Trainer) -> None:
        """Update the running level with `loss`; stop when the loss has stayed far above it for `patience` checks."""
        if self.updates >= WARMUP and loss > self.factor * self.level:
            self.above += 1  # a diverging loss is kept out of the average, so the level does not follow it
            if self.above >= self.patience:
                raise DivergenceError(self._message(trainer, self._divergence_cause(loss)))
            return
        self.above = 0
        self.updates += 1
        self.average = SMOOTHING * self.average + (1 - SMOOTHING) * loss
        if self.updates >= WARMUP:
            self.level = min(self.level, self.average / (1 - SMOOTHING**self.updates))

    def _nonfinite_cause(self) -> str:
        return (
            f"the loss or gradients were NaN/inf (or the gradient norm overflowed: gradients beyond float range) for "
            f"{self.consecutive} optimizer steps in a row"
        )

    def _divergence_cause(self, loss: float) -> str:
        return (
            f"the loss has diverged: {loss:.3g}, above {self.factor:g}x its running level {self.level:.3g} for "
            f"{self.above} optimizer steps in a row"
        )

    def _message(self, trainer: pl.Trainer, cause: str) -> str:
        callback = trainer.checkpoint_callback
        last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") or "none yet"
        return (
            f"{cause}, up to step {trainer.global_step + 1} ({self.skipped} skipped in all); stopping. Likely causes: "
            "a learning rate too high for this batch size (lower optim.lr or raise optim.warmup_steps), fp16 overflow "
            "(trainer.precision=bf16-mixed or 32-true), or bad input data. Last good checkpoint: "
            f"{last} (resume with ckpt_path=<it> after the change)"
        )

    def state_dict(self) -> dict[str, Any]:
        keys = ("skipped", "consecutive", "average", "updates", "level", "above")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            setattr(self, key, value)
