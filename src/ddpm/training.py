"""train(cfg): compose objects from the Hydra config, fit, export the EMA weights, return val/loss."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from ddpm.callbacks.ema import EMA
from ddpm.callbacks.rng import RNGState
from ddpm.config import validate_config
from ddpm.memory import explain_oom
from ddpm.precision import configure_precision, resolve_compile, resolve_precision
from ddpm.resume import check_resume, resolve_ckpt_path
from ddpm.sampling.runtime import check_guidance
from ddpm.sweep import finish_wandb, name_wandb_run
from ddpm.tuning import run_tuning
from ddpm.weights.lightning_io import AtomicCheckpointIO
from ddpm.weights.safetensors_file import save_ema_safetensors
from ddpm.weights.torch_file import export_ema


def build_callbacks(cfg: DictConfig) -> tuple[EMA, list[pl.Callback]]:
    """The EMA callback first (grids and checkpoints then see this step's average), the RNG states, then the others."""
    ema = instantiate(cfg.ema)
    others = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
    return ema, [ema, RNGState(seed=cfg.get("seed")), *others]  # RNGState snapshots before preemption/checkpoint saves


def build_loggers(cfg: DictConfig) -> list[Any] | bool:
    loggers = [instantiate(node) for node in (cfg.get("logger") or {}).values() if node is not None]
    return loggers or False


def slurm_plugins(cfg: DictConfig) -> list[Any]:
    """Under SLURM, requeue the job on its pre-timeout signal (Lightning checkpoints, then scontrol requeue)."""
    if not cfg.get("slurm_requeue", True) or not SLURMEnvironment.detect():
        return []
    return [SLURMEnvironment(auto_requeue=True)]


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's config as plain data, with every `auto` the project decides already decided
    (trainer.precision: bf16-mixed or 32-true; compile: true or false, for this device), every key checked
    (ddpm.config.validate: types, unknown keys; whole-number floats become ints in `cfg` too)."""
    resolved = validate_config(cfg, entry="train", decided=auto_decisions(cfg))
    check_callback_guidance(resolved)
    return resolved


def auto_decisions(cfg: DictConfig) -> dict[str, Any]:
    """{key: decided value} for the `auto` settings: trainer.precision and compile (a wrong word fails here,
    naming its key)."""
    accelerator = OmegaConf.select(cfg, "trainer.accelerator")
    decided: dict[str, Any] = {}
    precision = OmegaConf.select(cfg, "trainer.precision")
    if precision is not None:
        decided["trainer.precision"] = resolve_precision(precision, accelerator)
    for key in ("compile", "module.compile"):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str):
            decided[key] = resolve_compile(value, accelerator)
    return decided


def check_callback_guidance(resolved: dict[str, Any]) -> None:
    """The sample grid's and FID callback's guidance weights, refused before any data is read (the callbacks
    check them again at setup, for use without train())."""
    model, diffusion = resolved.get("model") or {}, resolved.get("diffusion") or {}
    for name, node in (resolved.get("callbacks") or {}).items():
        if isinstance(node, dict) and node.get("guidance"):
            check_guidance(node["guidance"], num_classes=model.get("num_classes"), p_uncond=diffusion.get("p_uncond"),
                           key=f"callbacks.{name}.guidance")  # fmt: skip


def train(cfg: DictConfig) -> float | None:
    """Fit the configured model; returns the final value of `cfg.objective` (val/loss by default), or None."""
    name_wandb_run(cfg)  # logger.wandb name and group from the Hydra overrides and sweep dir, where null
    resolved = resolve_config(cfg)  # fail fast, before the LR range test too
    if cfg.get("tune") is not None:
        if not run_tuning(cfg):
            return None  # tune=lr_find without tune.apply=true: the plot and the suggestion are the result
        resolved = resolve_config(cfg)  # again: tune.apply set optim.lr
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    precision = resolved.get("trainer", {}).get("precision")
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(resolved), output_dir / "config.yaml")
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), resume_dir=cfg.get("resume_dir"), output_dir=output_dir)
    if ckpt_path is not None:
        check_resume(ckpt_path, resolved, output_dir)  # safe load, refuses breaking config changes

    datamodule = instantiate(cfg.data)
    net, diffusion, optim = instantiate(cfg.model), instantiate(cfg.diffusion), instantiate(cfg.optim)
    # A partial, called here: run_config's `_target_` nodes must stay plain data (a dict in the checkpoint).
    # A partial, called with module.compile as decided (auto resolved above)
    module = instantiate(cfg.module, _partial_=True)(net=net, diffusion=diffusion, optim=optim, run_config=resolved,
                                                     compile=resolved["module"]["compile"])  # fmt: skip
    ema, callbacks = build_callbacks(cfg)
    configure_precision(precision)  # fp16 warning; TF32 on Ampere+ for float32
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        precision=precision,
        callbacks=callbacks,
        logger=build_loggers(cfg),
        default_root_dir=str(output_dir),
        plugins=[AtomicCheckpointIO(), *slurm_plugins(cfg)],
    )
    with explain_oom(batch_size=cfg.data.get("batch_size"), precision=precision):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    finish_wandb(trainer.loggers)  # the next job of an in-process multirun gets its own W&B run

    if trainer.is_global_zero and ema.shadow is not None:
        path = export_ema(output_dir / "ema.pt", ema.shadow, resolved)
        safe = save_ema_safetensors(output_dir / "ema.safetensors", ema.shadow, resolved)  # the same, unpickle-free
        print(f"EMA weights: {path} (and {safe.name})")
    return objective_value(trainer, cfg.get("objective") or "val/loss")


def objective_value(trainer: pl.Trainer, key: str) -> float | None:
    """The logged metric `key` after fit (the sweep objective); an error naming the logged keys if it is unknown."""
    value = trainer.callback_metrics.get(key)
    if value is None:
        logged = sorted(k for k in trainer.callback_metrics if k.startswith("val/"))
        if not logged:
            return None  # no validation ran (e.g. max_steps below val_check_interval)
        raise ValueError(
            f"objective={key!r} was never logged; this run logged {logged}. Set objective to one of them "
            "(val/fid@K needs the FID callback: +callbacks/fid=inception or +callbacks/fid=classifier)"
        )
    return float(value)
