"""Saves a grid of EMA samples every N optimizer steps (PNG in the run directory, and to the loggers)."""

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from ddpm.callbacks.ema import EMA
from ddpm.callbacks.monitor import off_the_clock
from ddpm.diffusion.generate import Generated, class_cycle, denoiser_for, generate
from ddpm.diffusion.network import SamplingPrecision
from ddpm.diffusion.samplers.base import Sampler, decoded
from ddpm.sampling.outputs import grid_columns, write_grid
from ddpm.sampling.runtime import guidance_interval as guidance_interval_of
from ddpm.sampling.runtime import load_decoder, resolve_sampling_precision


def find_ema(trainer: pl.Trainer) -> EMA | None:
    """The trainer's EMA callback, if it has one."""
    return next((c for c in trainer.callbacks if isinstance(c, EMA)), None)


def sample_with_ema(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    *,
    sampler: Sampler,
    num_samples: int,
    guidance: float,
    seed: int,
    guidance_interval: tuple[float, float] | None = None,
    batch_size: int = 256,
    precision: str | int = "32",
    draw: Callable[..., Generated] = generate,
) -> Generated:
    """Sample from the EMA weights (the live weights if there is no EMA callback), in eval mode, with the network
    called eagerly (a compiled training step compiles the loss function, not the network).

    `draw` takes `generate`'s arguments: `generate` (all images here), or `ddpm.metrics.evaluate.generate_shard`
    (this DDP rank's share). precision: auto, 32 or bf16, the network's only (ddpm.diffusion.network).
    guidance_interval: (sigma_lo, sigma_hi], or None."""
    net, diffusion = pl_module.net, pl_module.diffusion
    labels = class_cycle(num_samples, net.num_classes) if net.num_classes is not None else None
    ema = find_ema(trainer)
    was_training = net.training
    net.eval()
    try:
        with ema.averaged(net) if ema is not None else nullcontext():
            denoiser = denoiser_for(net, diffusion, guidance=guidance if labels is not None else 0.0,
                                    interval=guidance_interval,
                                    precision=resolve_sampling_precision(precision, pl_module.device))  # fmt: skip
            shape = (num_samples, net.in_channels, net.image_size, net.image_size)
            vae = load_decoder((pl_module.hparams.get("config") or {}).get("latent"), pl_module.device)
            sampler = decoded(sampler, vae.decode if vae else None)  # a latent model's images are decoded
            return draw(denoiser, sampler, shape, labels=labels, seed=seed, batch_size=batch_size,
                        device=pl_module.device)  # fmt: skip
    finally:
        net.train(was_training)


class StepGrid(Callback):
    """A grid saved every `every_n_steps` optimizer steps (0: never) and, with `at_end`, when training ends (unless
    that step already has one): `save(trainer, pl_module)` is the subclass's."""

    every_n_steps: int
    at_end: bool
    last_step: int = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_step = trainer.global_step  # no grid of the step a fit starts at (0, or a resume's: it has one)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # under gradient accumulation, the batches before a step end at the last step
        if self.every_n_steps and step != self.last_step and step % self.every_n_steps == 0:
            self.last_step = step
            with off_the_clock(trainer):
                self.save(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end and trainer.global_step != self.last_step:
            self.save(trainer, pl_module)

    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path:
        raise NotImplementedError


class SampleGrid(StepGrid):
    """Every `every_n_steps` optimizer steps and at the end of training: a grid of EMA samples."""

    def __init__(
        self,
        *,
        sampler: Sampler,  # a fast sampler, e.g. DDPM respaced to 100 steps
        every_n_steps: int = 1000,  # optimizer steps between grids; 0 = only at the end
        num_samples: int = 64,  # images per grid (all classes in turn for a conditional model)
        guidance: float = 0.0,  # classifier-free guidance weight for conditional models
        guidance_interval: tuple[float, float] | None = None,  # [sigma_lo, sigma_hi]: guide only there; None: always
        seed: int = 0,  # same seed every time, so grids are comparable across steps
        at_end: bool = True,  # also save a grid when training ends
        precision: SamplingPrecision = "auto",  # the network's: auto (bf16 on CUDA, AMX CPUs), 32 or bf16; x_t float32
    ) -> None:
        if every_n_steps < 0 or num_samples < 1:
            raise ValueError(
                f"callbacks.sample_grid: every_n_steps={every_n_steps} must be >= 0 and num_samples={num_samples} >= 1"
            )
        self.sampler, self.every_n_steps, self.num_samples = sampler, every_n_steps, num_samples
        self.guidance, self.seed, self.at_end = guidance, seed, at_end
        self.guidance_interval = guidance_interval_of(guidance_interval, key="callbacks.sample_grid.guidance_interval")
        self.precision = precision
        self.last_step = -1

    @rank_zero_only
    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path:
        """Sample, write samples/step_XXXXXXX.png under the run directory, and log the grid."""
        out = sample_with_ema(
            trainer,
            pl_module,
            sampler=self.sampler,
            num_samples=self.num_samples,
            guidance=self.guidance,
            guidance_interval=self.guidance_interval,
            seed=self.seed,
            precision=self.precision,
        )
        path = Path(trainer.default_root_dir) / "samples" / f"step_{trainer.global_step:07d}.png"
        columns = grid_columns(self.num_samples, pl_module.net.num_classes)
        grid = write_grid(out.images, path, nrow=columns)  # sample.py's grid writer: grey or RGB as the model
        caption = "labels: " + " ".join(map(str, out.labels.tolist())) if out.labels is not None else "unconditional"
        log_grid(trainer, grid, caption)
        return path


def log_grid(trainer: pl.Trainer, grid: torch.Tensor, caption: str) -> None:
    """Send a (C, H, W) uint8 grid to the image-capable loggers, as RGB: W&B takes values in [0, 255] (wandb.Image
    casts a tensor to uint8 unscaled: floats in [0, 1] came out black), TensorBoard floats in [0, 1]."""
    rgb = grid.expand(3, -1, -1)
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key="samples/grid", images=[rgb], caption=[caption], step=trainer.global_step)
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image("samples/grid", rgb.float() / 255, global_step=trainer.global_step)
