"""NaNGuard: an optimizer step whose gradients hold NaN/inf is skipped and counted; too many in a row stop the run.

A NaN loss gives NaN gradients, so one check covers both. The check runs after the gradients of
the step are complete (after all accumulated micro-batches, after the DDP all-reduce and the fp16
unscale) and before clipping and the update: the gradients are dropped, so the optimizer leaves
the weights and its moments untouched (the LR schedule still advances with the step count).
"""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer

from ddpm.callbacks.monitor import logs_this_step


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when no element is NaN/inf: each max-abs norm is finite exactly then (and, unlike the 2-norm, cannot
    overflow). One fused kernel per dtype/device group instead of one check per tensor; one host sync."""
    norms = torch._foreach_norm(tensors, ord=float("inf"))
    return bool(torch.stack([n.float() for n in norms]).isfinite().all())


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had NaN/inf gradients."""


class NaNGuard(Callback):
    """Skips optimizer steps with non-finite gradients; logs `train/skipped_steps`; stops after `max_consecutive`."""

    def __init__(self, *, max_consecutive: int = 10) -> None:  # skipped steps in a row before the run stops
        if max_consecutive < 1:
            raise ValueError(f"nan_guard.max_consecutive={max_consecutive} must be >= 1")
        self.max_consecutive = max_consecutive
        self.skipped = 0  # skipped steps in this run so far
        self.consecutive = 0  # skipped steps since the last good one

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads or all_finite(grads):
            self.consecutive = 0
            return
        optimizer.zero_grad(set_to_none=True)  # parameters without gradients are left alone by the step
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(self._message(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if logs_this_step(trainer) or self.consecutive:  # a skip shows at once (callback_metrics, progress bar)
            pl_module.log("train/skipped_steps", float(self.skipped), on_step=True, on_epoch=False)

    def _message(self, trainer: pl.Trainer) -> str:
        callback = trainer.checkpoint_callback
        last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") or "none yet"
        return (
            f"the loss or gradients were NaN/inf for {self.consecutive} optimizer steps in a row, up to step "
            f"{trainer.global_step + 1} ({self.skipped} skipped in all); stopping. Likely causes: a learning rate too "
            "high for this batch size (lower optim.lr or raise optim.warmup_steps), fp16 overflow "
            "(trainer.precision=bf16-mixed or 32-true), or bad input data. Last good checkpoint: "
            f"{last} (resume with ckpt_path=<it> after the change)"
        )

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.skipped, self.consecutive = state_dict["skipped"], state_dict["consecutive"]
