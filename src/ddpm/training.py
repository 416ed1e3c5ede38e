"""train(cfg): compose objects from the Hydra config, fit, export the EMA weights, return val/loss."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ddpm.callbacks.ema import EMA
from ddpm.checkpoint import export_ema


def build_callbacks(cfg: DictConfig) -> tuple[EMA, list[pl.Callback]]:
    """The EMA callback first (grids and checkpoints then see this step's average), then the others."""
    ema = instantiate(cfg.ema)
    others = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
    return ema, [ema, *others]


def build_loggers(cfg: DictConfig) -> list[Any] | bool:
    loggers = [instantiate(node) for node in (cfg.get("logger") or {}).values() if node is not None]
    return loggers or False


def train(cfg: DictConfig) -> float | None:
    """Fit the configured model; returns the final val/loss (the objective of sweeps), or None."""
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    resolved: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(resolved), output_dir / "config.yaml")

    datamodule = instantiate(cfg.data)
    net, diffusion, optim = instantiate(cfg.model), instantiate(cfg.diffusion), instantiate(cfg.optim)
    # A partial, called here: run_config's `_target_` nodes must stay plain data (a dict in the checkpoint).
    module = instantiate(cfg.module, _partial_=True)(net=net, diffusion=diffusion, optim=optim, run_config=resolved)
    ema, callbacks = build_callbacks(cfg)
    trainer: pl.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=build_loggers(cfg), default_root_dir=str(output_dir)
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    if trainer.is_global_zero and ema.shadow is not None:
        path = export_ema(output_dir / "ema.pt", ema.shadow, resolved)
        print(f"EMA weights: {path}")
    value = trainer.callback_metrics.get("val/loss")
    return None if value is None else float(value)
