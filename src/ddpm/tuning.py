"""LR range test (Smith 2017) before training: `python train.py tune=lr_find [tune.apply=true]`.

Runs Lightning's `Tuner.lr_find` on a separate Trainer (no callbacks, no logger): it swaps our warm-up
LambdaLR for an exponential schedule from `min_lr` to `max_lr`, records the smoothed training loss at
each step, stops when that loss exceeds `early_stop_threshold` times its minimum, and restores the
initial weights. We suggest the LR at the loss minimum divided by `divisor` (about a tenth), a more
conservative choice than Lightning's steepest-descent point for a noisy diffusion loss.

The suggestion holds only when the minimum lies inside the tested range, with the loss falling before it and
rising (or turning NaN) after it. `LRRangeWarning` says when the minimum is at an edge of the range instead:
- the first step considered: the first `skip` steps (a tenth, at most 10) are left out, because their running
  average rests on a few noisy losses, so the lower edge is step `skip` (the first finite loss from there). A
  minimum there means the loss never fell: the range starts too high; lower `tune.lr_find.min_lr`.
- the last step recorded: the loss was still falling when the test ended, at `max_lr`; raise
  `tune.lr_find.max_lr`. A test stopped early by `early_stop_threshold` ends on a loss above that multiple of
  its minimum, and a loss that turned NaN ends on NaNs after its last finite value: in both the loss turned
  after its minimum, which is then inside the range (the divergence is the range's useful top), not an edge.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig

from ddpm.atomic import atomic_write, atomic_write_text
from ddpm.config import build
from ddpm.logs import say
from ddpm.precision import resolve_precision


class LRRangeWarning(UserWarning):
    """The loss minimum of the LR range test is at an edge of the tested range: the suggestion is unreliable."""


@dataclass(frozen=True)
class LRFindResult:
    lrs: list[float]  # LR of each step
    losses: list[float]  # smoothed training loss of each step
    lr_at_min: float  # LR where the smoothed loss is lowest
    suggestion: float  # lr_at_min / divisor: the LR the optimizer should see
    first: int = 0  # the first step considered (earlier ones are too noisy)
    best: int = 0  # the step of the minimum
    warning: str | None = None  # the minimum is at an edge of the range (LRRangeWarning's text)


@dataclass(frozen=True, kw_only=True)
class LRRangeTest:
    """Exponential LR range test settings; `run` returns the curve and the suggested (optimizer) LR."""

    min_lr: float = 1e-7  # first LR of the range
    max_lr: float = 1e-2  # last LR of the range
    num_steps: int = 200  # optimizer steps, one LR each
    early_stop_threshold: float | None = 4.0  # stop when smoothed loss > threshold * its minimum
    divisor: float = 10.0  # suggestion = LR at the loss minimum / divisor

    def __post_init__(self) -> None:
        if not 0 < self.min_lr < self.max_lr:
            raise ValueError(f"tune.lr_find: need 0 < min_lr ({self.min_lr}) < max_lr ({self.max_lr})")
        if self.num_steps < 2 or self.divisor <= 0:
            raise ValueError(f"tune.lr_find: num_steps={self.num_steps} must be >= 2 and divisor={self.divisor} > 0")

    def run(self, module: pl.LightningModule, datamodule: pl.LightningDataModule, trainer: pl.Trainer) -> LRFindResult:
        finder = Tuner(trainer).lr_find(
            module,
            datamodule=datamodule,
            min_lr=self.min_lr,
            max_lr=self.max_lr,
            num_training=self.num_steps,
            mode="exponential",
            early_stop_threshold=self.early_stop_threshold,
            update_attr=False,
        )
        if finder is None:
            raise RuntimeError("tune=lr_find did not run (trainer.fast_dev_run is set); unset it")
        result = self.summarize(list(finder.results["lr"]), unbias([float(x) for x in finder.results["loss"]]))
        if result.warning:
            rank_zero_warn(result.warning, category=LRRangeWarning)
        return result

    def summarize(self, lrs: list[float], losses: list[float]) -> LRFindResult:
        """The minimum of the smoothed `losses` (one per LR of `lrs`) after the first noisy steps, the suggestion,
        and a warning when the minimum is at an edge of the range (module docstring)."""
        skip = min(10, len(losses) // 10)  # the first steps' average rests on a few noisy losses
        finite = [i for i, loss in enumerate(losses) if math.isfinite(loss) and i >= skip]
        if not finite:
            raise RuntimeError("tune=lr_find: every recorded loss is NaN/inf; lower tune.lr_find.min_lr")
        best = min(finite, key=losses.__getitem__)
        result = LRFindResult(lrs, losses, lrs[best], lrs[best] / self.divisor, first=finite[0], best=best)
        return replace(result, warning=self.edge_warning(result))

    def edge_warning(self, result: LRFindResult) -> str | None:
        """The warning for a minimum at the first step considered or the last step recorded, else None."""
        steps = len(result.losses)
        where = f"{result.lr_at_min:.3g}, step {result.best + 1} of {steps} recorded"
        if result.best == result.first:
            return (
                f"tune=lr_find: the smoothed loss is lowest at the first LR considered ({where}; the first "
                f"{result.first} steps are left out as too noisy): it never fell over the range, so the suggested "
                f"LR is unreliable. Lower tune.lr_find.min_lr (now {self.min_lr:g}; e.g. "
                f"tune.lr_find.min_lr={self.min_lr / 100:g}) and run the test again"
            )
        if result.best == steps - 1:
            return (
                f"tune=lr_find: the smoothed loss was still falling at the last LR tested ({where}, of "
                f"tune.lr_find.num_steps={self.num_steps}): the minimum is the range's edge, not the loss's, so the "
                f"suggested LR is unreliable. Raise tune.lr_find.max_lr (now {self.max_lr:g}; e.g. "
                f"tune.lr_find.max_lr={self.max_lr * 10:g}) and run the test again"
            )
        return None


def unbias(smoothed: list[float], beta: float = 0.98) -> list[float]:
    """Lightning 2.6's _LRCallback debiases the running mean of step i (0-based) by 1 - beta**(i + 2), as it
    counts steps from 1: its first values are about half the loss, so the minimum lands on the first step.
    Redo the debiasing with 1 - beta**(i + 1) (Adam's bias correction)."""
    return [x * (1 - beta ** (i + 2)) / (1 - beta ** (i + 1)) for i, x in enumerate(smoothed)]


def save_plot(result: LRFindResult, path: Path, scale: float = 1.0) -> Path:
    """Loss vs the optimizer's LR (log x), the minimum and the suggestion marked; a PNG at `path`. With an LR
    scaling rule (`scale` = the optimizer's LR / optim.lr) the suggestion's label gives optim.lr, the value to set."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(result.lrs, result.losses, color="tab:blue", label="smoothed training loss")
    ax.axvline(result.lr_at_min, color="tab:red", linestyle=":", label=f"minimum: {result.lr_at_min:.2e}")
    named = f"suggested: optim.lr={result.suggestion / scale:.2e}"
    named += f" ({result.suggestion:.2e} after the batch-size rule)" if scale != 1.0 else ""
    ax.axvline(result.suggestion, color="tab:green", linestyle="--", label=named)
    ax.set(xscale="log", xlabel="learning rate (the optimizer's)", ylabel="loss", title="LR range test")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)
    return path


def tune_lr(cfg: DictConfig, output_dir: Path, run_config: dict[str, Any]) -> float:
    """Run cfg.tune.lr_find on the configured model and data; write the plot; return the suggested optim.lr."""
    test: LRRangeTest = build(cfg.tune.lr_find)
    datamodule = build(cfg.data)
    net, optim = build(cfg.model), build(cfg.optim)
    parts = {"diffusion": build(cfg.diffusion)} if cfg.get("diffusion") is not None else {}  # none: module=vae
    module = build(cfg.module, _partial_=True)(
        net=net, **parts, optim=optim, run_config=run_config, compile=run_config["module"]["compile"]
    )  # as train() decided it
    trainer: pl.Trainer = build(
        cfg.trainer,
        precision=resolve_precision(cfg.trainer.get("precision"), cfg.trainer.get("accelerator")),
        callbacks=[],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(output_dir),
    )
    result = test.run(module, datamodule, trainer)
    # The optimizer saw optim.lr scaled by the batch-size rule; optim.lr is the unscaled value.
    global_batch = datamodule.batch_size * trainer.world_size * trainer.accumulate_grad_batches
    scale = optim.scaled_lr(global_batch) / optim.lr
    suggested = result.suggestion / scale
    if trainer.is_global_zero:
        plot = save_plot(result, output_dir / "lr_find.png", scale)
        record = {"lr": result.lrs, "loss": result.losses, "lr_at_min": result.lr_at_min, "suggested_lr": suggested,
                  "optimizer_lr_per_optim_lr": scale, "warning": result.warning}  # fmt: skip  # lr: the optimizer's
        atomic_write_text(output_dir / "lr_find.json", json.dumps(record) + "\n")
        say(
            f"lr_find: {len(result.lrs)} steps, loss minimum at lr={result.lr_at_min:.3g} (the optimizer's); "
            f"suggested optim.lr={suggested:.3g} (plot: {plot})"
        )
    return suggested


def run_tuning(cfg: DictConfig, run_config: dict[str, Any]) -> bool:
    """train()'s hook for `tune=...`: runs the LR range test; with tune.apply, sets optim.lr. True: go on training.
    `run_config`: the resolved config train() built (a latent run's `latent` record included)."""
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    lr = tune_lr(cfg, output_dir, run_config)
    if cfg.tune.get("apply", False):
        cfg.optim.lr = float(f"{lr:.3g}")  # the saved config.yaml and checkpoints record the LR used
        say(f"tune.apply=true: training with optim.lr={cfg.optim.lr:.3g}")
        return True
    return False
