"""A VAE run's grid every N optimizer steps (callbacks=vae): held-out originals, their reconstructions and images
decoded from N(0, I) latents, one row each, with the EMA weights (PNG in the run directory, and to the loggers)."""

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from ddpm.callbacks.sample_grid import StepGrid, find_ema, log_grid
from ddpm.diffusion.generate import to_uint8
from ddpm.sampling.outputs import write_grid

CAPTION = "rows: held-out originals, reconstructions (posterior means decoded), decoded N(0, I) latents"


class VAEGrid(StepGrid):
    """Every `every_n_steps` optimizer steps and at the end of training: originals | reconstructions | samples."""

    def __init__(
        self,
        *,
        every_n_steps: int = 1000,  # optimizer steps between grids; 0 = only at the end
        num_images: int = 8,  # images per row: the first held-out images, and as many decoded N(0, I) latents
        seed: int = 0,  # seed of the N(0, I) latents: the same every time, so grids are comparable across steps
        at_end: bool = True,  # also save a grid when training ends
    ) -> None:
        if every_n_steps < 0 or num_images < 1:
            raise ValueError(
                f"callbacks.vae_grid: every_n_steps={every_n_steps} must be >= 0 and num_images={num_images} >= 1"
            )
        self.every_n_steps, self.num_images, self.seed, self.at_end = every_n_steps, num_images, seed, at_end
        self.last_step = -1

    @rank_zero_only
    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path:
        """Write samples/step_XXXXXXX.png under the run directory, and log the grid."""
        originals = held_out(trainer.datamodule, self.num_images)
        net, ema = pl_module.net, find_ema(trainer)
        was_training = net.training
        net.eval()
        try:
            with torch.no_grad(), ema.averaged(net) if ema is not None else nullcontext():
                x = originals.to(pl_module.device).float() / 127.5 - 1
                latents = net.encode(x).latent_dist.mean
                noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(self.seed))
                decoded = net.decode(torch.cat([latents, noise.to(latents)])).sample
        finally:
            net.train(was_training)
        images = torch.cat([originals.cpu(), to_uint8(decoded.cpu())])
        path = Path(trainer.default_root_dir) / "samples" / f"step_{trainer.global_step:07d}.png"
        grid = write_grid(images, path, nrow=len(originals))  # sample.py's grid writer: grey or RGB as the images
        log_grid(trainer, grid, CAPTION)
        return path


def held_out(datamodule: Any, count: int) -> Tensor:
    """The first `count` validation images (uint8, (N, C, H, W)), in the loader's fixed order."""
    batches, seen = [], 0
    for images, _ in datamodule.val_dataloader():
        batches.append(images[: count - seen])
        seen += len(batches[-1])
        if seen >= count:
            break
    if not batches:
        raise ValueError("callbacks.vae_grid needs held-out images, and the data has none (data.val_size)")
    return torch.cat(batches)
