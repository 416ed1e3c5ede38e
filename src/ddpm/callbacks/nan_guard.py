"""NaNGuard: skips optimizer steps whose gradients are non-finite, and stops a run that has diverged.

Two signs of divergence, both checked without a host sync in the step (see the end of this docstring):

- Non-finite: the global gradient 2-norm (the norm clipping uses) is NaN/inf: a NaN/inf loss or gradient, or
  gradients so large that their norm overflows float32 (clipping would then scale them to zero and Adam would keep
  moving the weights on its moments alone). The step is skipped: the gradients are dropped, so the optimizer leaves
  the weights and its moments untouched (the LR schedule still advances). After `max_consecutive` such steps in a
  row the run stops (`NonFiniteLossError`, "NaN/inf").
- Loss level: the loss, finite, climbs far above where it has been. The run stops (`DivergenceError`, "the loss
  has diverged").

The loss-level rule compares two debiased exponential moving averages of the log-loss (the mean loss of the
micro-batches of one optimizer step, averaged over the ranks):

- the current loss: a fast average, beta 0.9 (a time constant of 10 optimizer steps): it averages out single
  batches and still crosses the threshold within about 10 steps of a jump;
- the running level: a slow average, beta 0.998 (a time constant of 500 steps): a divergence, which takes tens of
  steps, barely moves it, yet it follows a loss that changes for good reasons (a resume with another LR or warm-up,
  a noisier phase, a slow drift) within a few hundred steps, a small part of a run of 10^4-10^5 steps. The rule
  before it, the all-time minimum of the smoothed loss, never came back up: after one lucky stretch every later
  batch looked diverged.

Log-loss, because "`divergence_factor` times the level" is a difference of logs, and the average of logs (a
geometric mean) is barely moved by the heavy tails of diffusion losses: one batch at 100x the level moves the fast
average by a tenth of log(100), where it would move an average of the losses by ten levels. Both averages are
debiased as Adam's moments are, so the first steps average what was seen instead of being pulled towards 0.

A step counts as diverging when the fast average is above `divergence_factor` x the level; `divergence_patience`
diverging steps stop the run. Each step back under the threshold takes one off the count instead of zeroing it:
a good batch or two cannot reset a diverged run (the smooth fast average seldom even comes back under for one),
and a loss flickering about the threshold still adds up. A diverging step is kept out of the level; a loss above the
threshold enters it clipped at the threshold (a single spike of a noisy loss), unless the fast average is already
half-way up to the threshold (the log of sqrt(factor) above the level): then it stays out, so neither a divergence
nor the fast average's lag drags the level up after it (entered clipped, a jump's losses lifted a level of few
losses, early in a run, faster than the fast average crossed: 50x from step 12 and 23x the level after a falling
start never stopped, nor an 11x step-up at step 2,000). Steps count from the 11th loss on. In its first few dozen
steps the level is the plain mean of the few losses seen, so a loss that creeps up from the very start takes its
level along; a loss that jumps is caught (a real run at optim.lr=0.7 stops at step 16), and the non-finite path
remains. The rule needs a positive loss (every
loss of this package is a weighted mean square); a loss <= 0 is not tracked.

What the defaults let pass (tests/test_divergence.py): a loss that steps up 3x and stays, climbs 10x every 3,000
steps, or is lognormal noise (sigma 1) around a level never counts as diverging; a loss 50x up stops
`divergence_patience` + 8 steps after the jump (the fast average crosses on the 9th). A loss that steps up more
than 10x for good is, by this rule, a divergence: raise `divergence_factor` where that is expected.

The check runs after the gradients of the step are complete (after all accumulated micro-batches, the DDP
all-reduce and the fp16 unscale) and before clipping and the update. The loss check reads the losses of the
micro-batches since the previous check, so it lags one optimizer step.

No host sync in the step. The skip is decided on the device: the guard hands the step's non-finite flag to the
fused AdamW kernel as its `found_inf` (the same flag a GradScaler gives it under fp16), which then leaves the weights,
the moments and Adam's step count as they were. Each step's gradient norm and mean loss stay on the device, in a
short history; the rules above run over that history on the host only where the step syncs anyway: at the steps
Lightning logs (`trainer.log_every_n_steps`), before every checkpoint is written (a checkpoint never holds a run that
should have stopped) and when training ends. A run therefore stops up to `log_every_n_steps` optimizer steps after
its stopping step, naming that step; the steps in between were skipped (non-finite) or diverging, and no checkpoint
was written after it. An optimizer without `found_inf` (not fused) gets the old path: one sync per step, and a
skipped step drops its gradients. Under 16-mixed the GradScaler sets `found_inf` itself: it skips NaN/inf gradients;
a finite gradient whose norm overflows is then not skipped, only counted. Its own skips (a finite loss whose fp16
gradients overflow a loss scale above 1, which it then halves: at the start of fp16 training and after each growth)
count in `train/skipped_steps` but not towards `max_consecutive`.
"""

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from ddpm.callbacks.monitor import global_norm, logs_this_step

FAST = 0.9  # beta of the fast average of the log-loss: a time constant of 1 / (1 - beta) = 10 optimizer steps
SLOW = 0.998  # beta of the slow average, the running level: a time constant of 500 optimizer steps
WARMUP = 10  # losses tracked before a step can count as diverging (from the 11th on)
STATE = ("skipped", "consecutive", "fast", "fast_updates", "slow", "slow_updates", "above", "pending")
LEGACY = ("skipped", "consecutive", "average", "updates", "level", "above")  # the state written before the slow level
LEGACY_SMOOTHING = 0.98  # beta of the legacy state's average: it summarises about 50 steps


def skips_on_device(optimizer: Optimizer) -> bool:
    """Whether `optimizer` skips its update when given `found_inf` (torch's fused Adam/AdamW/SGD kernels, the ones a
    GradScaler drives), so a non-finite step is skipped without the host reading the flag."""
    fused = any(group.get("fused") for group in optimizer.param_groups)
    return fused and getattr(optimizer, "_step_supports_amp_scaling", False)


def ema_update(mean: float, count: int, value: float, beta: float) -> tuple[float, int]:
    """Add `value` to a debiased exponential moving average kept as (mean, count): after n values x_1..x_n, mean is
    sum_i beta^(n-i) x_i / sum_i beta^(n-i), i.e. Adam's m_n / (1 - beta^n) (Kingma & Ba 2015, sec. 3)."""
    count += 1
    return mean + (1 - beta) / (1 - beta**count) * (value - mean), count


class DivergenceError(RuntimeError):
    """The run diverged: its loss stayed far above its running level."""


class NonFiniteLossError(DivergenceError):
    """Too many optimizer steps in a row had NaN/inf gradients (or a gradient norm that overflowed)."""


class NaNGuard(Callback):
    """Skips steps with non-finite gradients (`train/skipped_steps`); stops after `max_consecutive` in a row, or when
    the loss's 10-step average stays above `divergence_factor` x its 500-step average for `divergence_patience`
    steps (see the module docstring)."""

    def __init__(
        self,
        *,
        max_consecutive: int = 10,  # skipped steps in a row before the run stops
        divergence_factor: float = 10.0,  # a fast loss average above this multiple of the slow one is diverging
        divergence_patience: int = 20,  # diverging optimizer steps (net of steps back under) before the run stops
    ) -> None:
        if max_consecutive < 1 or divergence_patience < 1:
            raise ValueError(
                f"callbacks.nan_guard.max_consecutive={max_consecutive} and "
                f"callbacks.nan_guard.divergence_patience={divergence_patience} "
                "must be >= 1"
            )
        if not divergence_factor > 1:
            raise ValueError(
                f"callbacks.nan_guard.divergence_factor={divergence_factor} must be > 1 (10 is the default)"
            )
        self.max_consecutive, self.factor, self.patience = max_consecutive, divergence_factor, divergence_patience
        self.skipped = 0  # skipped steps in this run so far (as of the last check)
        self.consecutive = 0  # skipped steps since the last good one (as of the last check)
        self.fast, self.fast_updates = 0.0, 0  # fast debiased average of the log-loss, and its number of values
        self.slow, self.slow_updates = 0.0, 0  # slow debiased average of the log-loss (the running level), the same
        self.above = 0  # diverging steps, less one per step back under the threshold (never below 0)
        self._losses: list[Tensor] = []  # this process's micro-batch losses since the last optimizer step (device)
        self._history: list[tuple[int, Tensor]] = []  # (step, [grad norm, mean loss, loss scale]) not yet checked
        self._trainer: pl.Trainer | None = None

    @property
    def level(self) -> float:
        """The running level of the loss (the slow average, as a loss); inf before the first loss."""
        return math.exp(self.slow) if self.slow_updates else math.inf

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict() checks the history before a checkpoint is written

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):  # Lightning hands on the loss divided by accumulate_grad_batches: undone here
            self._losses.append(loss.detach().float().reshape(()) * getattr(trainer, "accumulate_grad_batches", 1))
        if logs_this_step(trainer):  # this step syncs anyway (Lightning writes its metrics)
            self.check(trainer)
            pl_module.log("train/skipped_steps", float(self.skipped), on_step=True, on_epoch=False)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        norm = global_norm(grads)
        loss = torch.full((), math.nan, device=norm.device)
        if self._losses:  # averaged over the ranks, so every rank takes the same decision
            mean = torch.stack([loss.to(norm.device) for loss in self._losses]).mean()
            loss = trainer.strategy.reduce(mean, reduce_op="mean").float()
        self._losses = []
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)  # 16-mixed: this step's scale
        scale = getattr(scaler, "_scale", None)  # on the device, halved in place by the scaler's update: copied
        scale = torch.ones((), device=norm.device) if scale is None else scale.detach().float().reshape(()).clone()
        self._history.append((trainer.global_step, torch.stack([norm, loss, scale.to(norm.device)])))
        optimizer.grad_norm = norm  # gradient clipping, next, reuses it (DiffusionModule.configure_gradient_clipping)
        if skips_on_device(optimizer):
            optimizer.found_inf = (~norm.isfinite()).float()  # the fused kernel leaves weights, moments, step
            return
        self.check(trainer)  # an optimizer without found_inf: decide now (one sync), drop the gradients
        if self.consecutive:
            optimizer.zero_grad(set_to_none=True)  # parameters without gradients are left alone by the step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer)

    def check(self, trainer: pl.Trainer | None = None) -> None:
        """Run the rules over the steps since the last check (one host sync); raise if the run must stop."""
        if not self._history:
            return
        steps = [step for step, _ in self._history]
        values = torch.stack([v for _, v in self._history]).tolist()  # the one host sync of the guard
        self._history = []
        for step, (norm, loss, scale) in zip(steps, values, strict=True):
            if math.isfinite(loss) and loss > 0:
                self._track(math.log(loss), trainer, step)
            if math.isfinite(norm):
                self.consecutive = 0
                continue
            self.skipped += 1
            if math.isfinite(loss) and scale > 1:  # fp16 gradients overflowing a loss scale the GradScaler now halves
                continue
            self.consecutive += 1
            if self.consecutive >= self.max_consecutive:
                raise NonFiniteLossError(self._message(trainer, self._nonfinite_cause(), step))

    def _track(self, log_loss: float, trainer: pl.Trainer | None, step: int) -> None:
        """Add one step's log-loss to both averages; stop once `patience` steps (net) had the fast one diverging."""
        self.fast, self.fast_updates = ema_update(self.fast, self.fast_updates, log_loss, FAST)
        threshold = self.slow + math.log(self.factor) if self.slow_updates else math.inf
        if self.fast > threshold:  # diverging: kept out of the level, so the level does not follow it
            if self.fast_updates > WARMUP:
                self.above += 1
            if self.above >= self.patience:
                raise DivergenceError(self._message(trainer, self._divergence_cause(), step))
            return
        self.above = max(self.above - 1, 0)
        rising = self.fast > threshold - math.log(self.factor) / 2  # the fast average half-way up to the threshold
        if log_loss <= threshold or not rising:  # a jump's losses wait outside the level for the fast one's verdict
            self.slow, self.slow_updates = ema_update(self.slow, self.slow_updates, min(log_loss, threshold), SLOW)

    def _nonfinite_cause(self) -> str:
        return (
            f"the loss or gradients were NaN/inf (or the gradient norm overflowed: gradients beyond float range) for "
            f"{self.consecutive} optimizer steps in a row"
        )

    def _divergence_cause(self) -> str:
        return (
            f"the loss has diverged: its recent average {math.exp(self.fast):.3g} (10-step moving average) stayed "
            f"above {self.factor:g}x its running level {self.level:.3g} (500-step moving average) for {self.above} "
            "optimizer steps"
        )

    def _message(self, trainer: pl.Trainer | None, cause: str, step: int) -> str:
        callback = getattr(trainer, "checkpoint_callback", None)
        last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") or "none yet"
        return (
            f"{cause}, up to step {step + 1} ({self.skipped} skipped in all); stopping. Likely causes: "
            "a learning rate too high for this batch size (lower optim.lr or raise optim.warmup_steps), fp16 overflow "
            "(trainer.precision=bf16-mixed or 32-true), or bad input data. Last good checkpoint: "
            f"{last} (resume with ckpt_path=<it> after the change)"
        )

    def state_dict(self) -> dict[str, Any]:
        self.check(self._trainer)  # before a checkpoint is written: never save a run that must stop
        state = {key: getattr(self, key) for key in STATE if key != "pending"}
        return state | {"pending": [float(loss) for loss in self._losses]}  # losses of a step not yet checked

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from `state_dict`, or convert one written before the slow level (keys `LEGACY`)."""
        keys = set(state_dict)
        if keys == set(LEGACY):
            return self._load_legacy(state_dict)
        if keys != set(STATE):
            raise ValueError(
                f"the checkpoint's NaNGuard state has keys {sorted(keys)}, not {list(STATE)} (nor the older "
                f"{list(LEGACY)}); it was written by another version of ddpm.callbacks.nan_guard. Resume from "
                "another checkpoint, or remove checkpoint['callbacks']['NaNGuard'] to start the guard afresh"
            )
        for key in STATE[:-1]:
            setattr(self, key, state_dict[key])
        self._losses = [torch.tensor(float(loss)) for loss in state_dict["pending"]]

    def _load_legacy(self, state: dict[str, Any]) -> None:
        """The legacy state kept a biased moving average of the loss (beta 0.98) and its all-time minimum: its
        debiased average seeds both averages, weighing as its ~50 steps in the slow one; the minimum is dropped."""
        self.skipped, self.consecutive = int(state["skipped"]), int(state["consecutive"])
        self.above, self._losses = 0, []
        updates, average = int(state["updates"]), float(state["average"])
        mean = average / (1 - LEGACY_SMOOTHING**updates) if updates > 0 else math.nan
        if not (math.isfinite(mean) and mean > 0):
            self.fast, self.fast_updates, self.slow, self.slow_updates = 0.0, 0, 0.0, 0
            return
        window = round(1 / (1 - LEGACY_SMOOTHING))
        self.fast, self.fast_updates = math.log(mean), updates
        self.slow, self.slow_updates = math.log(mean), min(updates, window)
