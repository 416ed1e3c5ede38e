"""AdamW with linear warm-up, an optional decay to the last step, and an optional batch-size scaling rule.
Plain torch.

The LR after `step` optimizer steps of a run of `total` steps is lr x warm-up x decay (Loshchilov & Hutter 2017
for cosine): warm-up = min(1, (step + 1) / warmup_steps); decay = 1 (none), or with p = (step - warmup_steps) /
(total - warmup_steps) clipped to [0, 1], min_lr_ratio + (1 - min_lr_ratio) (1 + cos(pi p)) / 2 (cosine) or
min_lr_ratio + (1 - min_lr_ratio) (1 - p) (linear).
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

ScalingRule = Literal["none", "linear", "sqrt"]
Decay = Literal["none", "cosine", "linear"]
SCALING: dict[str, float] = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}  # exponent of global / base batch


@dataclass(frozen=True, kw_only=True)
class AdamW:
    """Optimizer settings; `build` makes the optimizer and its per-step LR schedule."""

    lr: float = 2e-4  # learning rate at the base batch size
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's beta1, beta2
    weight_decay: float = 0.0  # decoupled weight decay
    eps: float = 1e-8  # Adam's epsilon
    warmup_steps: int = 5000  # linear warm-up from 0 over this many optimizer steps; 0 = none
    scaling: ScalingRule = "none"  # LR scaling rule from base_batch_size to the global batch
    base_batch_size: int = 64  # the batch size `lr` was tuned at
    decay: Decay = "none"  # after warm-up: none (constant LR), cosine or linear down to min_lr_ratio x lr at max_steps
    min_lr_ratio: float = 0.0  # the LR the decay ends at, as a fraction of lr

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr={self.lr} must be a positive finite number (2e-4 is the usual value)")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas={list(self.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.weight_decay < 0 or self.eps <= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0 and eps={self.eps} > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0 (0 turns warm-up off)")
        if self.scaling not in SCALING:
            raise ValueError(f"scaling={self.scaling!r} is unknown; use one of {sorted(SCALING)}")
        if self.base_batch_size < 1:
            raise ValueError(f"base_batch_size={self.base_batch_size} must be >= 1")
        if self.decay not in ("none", "cosine", "linear"):
            raise ValueError(f"decay={self.decay!r} is unknown; use none, cosine or linear")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")

    def scaled_lr(self, global_batch_size: int) -> float:
        """lr * (global / base) ** p, p = 0 (none), 1 (linear, Goyal et al. 2017) or 1/2 (sqrt)."""
        return self.lr * (global_batch_size / self.base_batch_size) ** SCALING[self.scaling]

    def warmup_factor(self, step: int) -> float:
        """LR multiplier after `step` optimizer steps: linear from 1/warmup to 1, then constant."""
        return 1.0 if self.warmup_steps == 0 else min(1.0, (step + 1) / self.warmup_steps)

    def lr_factor(self, step: int, total_steps: int | None = None) -> float:
        """LR multiplier after `step` optimizer steps of a run of `total_steps`: warm-up x decay (module docstring)."""
        factor = self.warmup_factor(step)
        if self.decay == "none":
            return factor
        if total_steps is None or total_steps <= 0:
            raise ValueError(
                f"decay={self.decay} decays the LR to the last step, so it needs the run's length, total_steps "
                f"(now {total_steps}: the Trainer's max_steps); give it, or decay=none"
            )
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps)))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1 - progress
        return factor * (self.min_lr_ratio + (1 - self.min_lr_ratio) * shape)

    def build(
        self, params: list[nn.Parameter], *, global_batch_size: int, total_steps: int | None = None
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW (fused on CUDA) at the scaled LR, and a LambdaLR to step once per optimizer step (`total_steps`:
        the run's length, for a decay)."""
        fused = True
        optimizer = torch.optim.AdamW(
            params,
            lr=self.scaled_lr(global_batch_size),
            betas=tuple(self.betas),
            weight_decay=self.weight_decay,
            eps=self.eps,
            fused=fused,
        )
        self.lr_factor(0, total_steps)  # a decay without a known length fails here, naming the keys
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_factor(step, total_steps))
