"""Exponential moving average of the UNet's weights, as a Lightning callback.

theta_ema <- d * theta_ema + (1 - d) * theta after every optimizer step, with
d = min(decay, (1 + n) / (10 + n)) when warm-up is on (n = updates so far; the schedule of
tf.train.ExponentialMovingAverage's num_updates. DDPM's reference code applies its decay from the first
update: ema.warmup=false).
The warm-up reaches a decay d only at update n = (10 d - 1) / (1 - d): 8,990 for 0.999, 89,990 for 0.9999.
A shorter run never uses d, and every d above its last warm-up decay trains the same average; at the start
of training the callback logs which case a run is in (`schedule_note`).

Why not Lightning's `EMAWeightAveraging`: it has no warm-up decay (short runs sample from
almost-initial weights), averages a deep copy of the whole LightningModule (schedule buffers
included; a deep copy of a module compiled in place would keep calling the original), and at
`on_train_end` overwrites the trained weights with the average. This callback keeps float32
copies of `pl_module.net` only, updates them with one fused `lerp_` per optimizer step, writes
them under the checkpoint key `ema_state_dict` with the network's own parameter names, and
swaps them in with in-place `copy_` so a compiled network sees them without recompiling.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from ddpm.weights.model import CHECKPOINT_KEY


def ema_decay(decay: float, num_updates: int, warmup: bool) -> float:
    """The decay used for update number `num_updates` (0-based)."""
    return min(decay, (1 + num_updates) / (10 + num_updates)) if warmup else decay


def warmup_reaches(decay: float) -> int:
    """The first update n (0-based) whose warm-up decay (1 + n) / (10 + n) reaches `decay`:
    n >= (10 d - 1) / (1 - d), so 8,990 for 0.999 and 89,990 for 0.9999 (float round-off settled by the test)."""
    n = max(0, math.ceil((10 * decay - 1) / (1 - decay)))
    while n > 0 and ema_decay(decay, n - 1, warmup=True) == decay:
        n -= 1
    while ema_decay(decay, n, warmup=True) < decay:
        n += 1
    return n


def schedule_note(decay: float, updates: float) -> str:
    """One line on what the warm-up does to `decay` over a run of `updates` EMA updates (inf: length unknown)."""
    reached = warmup_reaches(decay)
    if reached < updates:
        of = "" if math.isinf(updates) else f" of {updates:,.0f}"
        return f"EMA: decay min({decay}, (1 + n) / (10 + n)): {decay} from update {reached:,}{of}"
    n = int(updates)  # the last update is n - 1: decay n / (n + 9)
    return (
        f"EMA: the warm-up decay (1 + n) / (10 + n) stays below ema.decay={decay} for all {n:,} updates of this "
        f"run ({decay} from update {reached:,}): any ema.decay >= {n}/{n + 9} ({n / (n + 9):.5f}) trains the "
        "same average here; ema.warmup=false applies ema.decay from the first update"
    )


def _tensors(net: nn.Module) -> dict[str, Tensor]:
    """Parameters and buffers of `net` by name (buffers included: averaged if float, else copied)."""
    return dict(net.named_parameters()) | dict(net.named_buffers())


class EMA(Callback):
    """Keeps `ema_state_dict` of `pl_module.net`; validation and sample grids run with it swapped in."""

    def __init__(
        self,
        *,
        decay: float = 0.9999,  # target decay d
        warmup: bool = True,  # d_n = min(decay, (1 + n) / (10 + n))
        update_every_n_steps: int = 1,  # optimizer steps between updates
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema.decay={decay} must be in [0, 1); 0.9999 is the usual value, 0.999 for short runs")
        if update_every_n_steps < 1:
            raise ValueError(f"ema.update_every_n_steps={update_every_n_steps} must be >= 1")
        self.decay, self.warmup, self.update_every_n_steps = decay, warmup, update_every_n_steps
        self.num_updates = 0  # updates applied so far
        self.last_step = 0  # trainer.global_step at the last update check
        self.shadow: dict[str, Tensor] | None = None  # float32 averages, keyed as net.state_dict()
        self._trained: list[tuple[nn.Module, dict[str, Tensor]]] = []  # (net, its own weights) while swapped
        self._loaded = False  # the shadow came from a checkpoint

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.shadow is None:
            self.shadow = {
                k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
                for k, v in _tensors(pl_module.net).items()
            }

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.shadow = {k: v.to(pl_module.device) for k, v in self._require_shadow().items()}
        if not self._loaded and self.num_updates == 0:  # a new average starts from the weights the fit starts
            self._copy_from(pl_module.net)  # with: DDP gives every rank rank 0's after setup() (seed=null differs)

    def _copy_from(self, net: nn.Module) -> None:
        with torch.no_grad():
            for k, v in _tensors(net).items():
                self._require_shadow()[k].copy_(v)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.estimated_stepping_batches  # inf without max_steps and max_epochs (max_time, a signal)
        updates = total // self.update_every_n_steps if math.isfinite(total) else math.inf
        if (
            self.num_updates == 0
            and trainer.global_step < total
            and updates == trainer.global_step // self.update_every_n_steps
        ):
            raise ValueError(
                f"ema.update_every_n_steps={self.update_every_n_steps} exceeds the run's {int(total)} steps: the "
                "average would never be updated, and validation, grids and ema.pt would use the initial weights; "
                f"set ema.update_every_n_steps <= {int(total)} (1: every step)"
            )
        if self.warmup:  # a short run may never reach the decay it asks for (experiment=mnist: 0.999 in 2,000)
            rank_zero_info(schedule_note(self.decay, updates))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.num_updates == 0 and trainer.global_step > 0:  # stopped (max_time, a signal) before update 1
            rank_zero_warn(
                f"The EMA took no update in {trainer.global_step} steps (ema.update_every_n_steps="
                f"{self.update_every_n_steps}): it holds the trained weights, not an average"
            )
            self._copy_from(pl_module.net)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # global_step counts optimizer steps: under gradient accumulation it moves once per k batches.
        if trainer.global_step == self.last_step:
            return
        self.last_step = trainer.global_step
        if trainer.global_step % self.update_every_n_steps == 0:
            self.update(pl_module.net)

    @torch.no_grad()
    def update(self, net: nn.Module) -> None:
        """One EMA step towards the current weights of `net`: one multi-tensor lerp over the float tensors (no per-
        tensor op, no host sync), a copy for integer buffers (the UNet has none)."""
        shadow, live, others = self._pairs(net)
        d = ema_decay(self.decay, self.num_updates, self.warmup)
        torch._foreach_lerp_(shadow, live, 1.0 - d)
        for average, tensor in others:
            average.copy_(tensor)
        self.num_updates += 1

    def _pairs(self, net: nn.Module) -> tuple[list[Tensor], list[Tensor], list[tuple[Tensor, Tensor]]]:
        """(float averages, their live tensors, (other average, live) pairs), kept until `net` or the shadow change.
        Live tensors of another dtype than float32 are converted on each call (a copy): mixed precision keeps them
        float32, so it never happens in training."""
        shadow = self._require_shadow()
        key = (id(net), id(shadow))
        if getattr(self, "_cached", (None,))[0] != key:
            live = _tensors(net)
            floats = [k for k, v in shadow.items() if v.is_floating_point()]
            others = [(shadow[k], live[k]) for k in shadow if k not in floats]
            self._cached = (key, [shadow[k] for k in floats], [live[k] for k in floats], others)
        _, averages, tensors, others = self._cached
        if any(t.dtype != a.dtype for t, a in zip(tensors, averages, strict=True)):
            tensors = [t.to(a.dtype) for t, a in zip(tensors, averages, strict=True)]
        return averages, tensors, others

    @contextmanager
    def averaged(self, net: nn.Module) -> Iterator[None]:
        """Within the block, `net` holds the EMA weights (copied in place); its own weights come back after."""
        live = _tensors(net)
        backup = {k: v.detach().clone() for k, v in live.items()}
        with torch.no_grad():
            for k, v in self._require_shadow().items():
                live[k].copy_(v)
        self._trained.append((net, backup))  # what a checkpoint written meanwhile saves as the net's weights
        try:
            yield
        finally:
            self._trained.pop()
            with torch.no_grad():
                for k, v in backup.items():
                    live[k].copy_(v)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.shadow is not None:
            self._validation_swap = self.averaged(pl_module.net)
            self._validation_swap.__enter__()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        swap = getattr(self, "_validation_swap", None)
        if swap is not None:
            self._validation_swap = None
            swap.__exit__(None, None, None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_validation_epoch_end(trainer, pl_module)  # a validation that raised: the net gets its weights back

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "num_updates": self.num_updates, "last_step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_updates, self.last_step = state_dict["num_updates"], state_dict["last_step"]

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.shadow is not None:
            checkpoint[CHECKPOINT_KEY] = {k: v.detach().clone() for k, v in self.shadow.items()}
        if self._trained:  # written while the EMA weights are swapped in (validation, a grid): SLURM's requeue
            net, trained = self._trained[0]  # handler saves from a signal, whenever it comes; the outermost swap
            prefix = next(name for name, module in pl_module.named_modules() if module is net)
            checkpoint["state_dict"].update({f"{prefix}.{k}": v.clone() for k, v in trained.items()})

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        shadow = self._require_shadow()
        self._loaded = True
        if CHECKPOINT_KEY not in checkpoint:  # the net holds the checkpoint's weights now; the shadow, setup's
            rank_zero_warn("The checkpoint holds no EMA weights; the EMA starts again from the model's weights.")
            self._copy_from(pl_module.net)
            return
        saved = checkpoint[CHECKPOINT_KEY]
        if saved.keys() != shadow.keys():
            raise ValueError(
                "The checkpoint's EMA weights do not match this model "
                f"(missing {sorted(shadow.keys() - saved.keys())[:5]}, "
                f"unexpected {sorted(saved.keys() - shadow.keys())[:5]}); "
                "resume with the model config the checkpoint was trained with"
            )
        for k, v in saved.items():
            shadow[k].copy_(v)

    def _require_shadow(self) -> dict[str, Tensor]:
        if self.shadow is None:
            raise RuntimeError("The EMA callback has not been set up; it is only used inside Trainer.fit")
        return self.shadow
