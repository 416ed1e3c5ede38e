"""VAEModule: the LightningModule that trains a VAE for latent diffusion (`module=vae`, `experiment=mnist_vae`).

`net` is diffusers' `AutoencoderKL` (ddpm.models.autoencoder.autoencoder_kl), so the project's callbacks work on it as
on a UNet: the EMA averages `net` (validation, the grid and the export use the average), checkpoints and resume,
loggers, precision, the NaN guard and the monitor. The optimizer, its LR rule after a resume at another scale and the
gradient clipping are the diffusion module's own (ddpm.module.DiffusionModule), shared, not copied. `compile`
compiles the loss (encoder, posterior sample, decoder, error and KL) as one graph, the posterior noise drawn outside.

The objective: ddpm.models.autoencoder.vae_loss (reconstruction L1 or L2 + kl_weight x KL, per pixel value; LDM's
without its perceptual and adversarial terms). val/loss is the same objective on the held-out images with fixed
noise; val/rec its reconstruction part, val/kl the KL per image in nats.

At the end of fit `write_exports` saves the EMA weights as a diffusers folder `<run>/vae/` (AutoencoderKL's
save_pretrained: diffusers alone loads it) with `scaling_factor` and `shift_factor` measured on the training images:
the diffusion model then trains on z_d = (z - shift) * scale with mean 0 and variance 1 (ddpm.models.vae.VAE).
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ddpm.atomic import atomic_folder
from ddpm.callbacks.ema import EMA
from ddpm.callbacks.monitor import logs_this_step
from ddpm.distributed import keep_buffers_local
from ddpm.epoch_mean import EpochMeans
from ddpm.logs import say
from ddpm.models.autoencoder import Reconstruction, latent_statistics, vae_loss
from ddpm.models.vae import is_autoencoder
from ddpm.module import DiffusionModule
from ddpm.optim import AdamW
from ddpm.precision import CompileMode, compile_mode, resolve_compile, uses_cudagraphs

EXPORT = "vae"  # <run>/vae/: the trained VAE, a diffusers AutoencoderKL folder
DIFFUSION_ONLY = ("SampleGrid", "FID")  # callbacks that sample a diffusion model: refused in a VAE run


class VAEModule(pl.LightningModule):
    """Trains the autoencoder `net` with `vae_loss`; validation loss on held-out images (EMA weights)."""

    LOGGED_METRICS = (
        "val/loss",
        "val/rec",
        "val/kl",
        "train/loss",
        "train/rec",
        "train/kl",
    )  # what an objective may name (ddpm.objective)

    def __init__(
        self,
        *,
        net: nn.Module,  # diffusers' AutoencoderKL (model=vae_*)
        optim: AdamW,  # optimizer and LR schedule settings
        kl_weight: float = 1e-2,  # weight of KL(q(z|x) || N(0, I)) against the reconstruction error (LDM's scale)
        reconstruction: Reconstruction = "l1",  # the reconstruction error: l1 (LDM's) or l2
        compile: bool | CompileMode | Literal["auto"] = False,  # torch.compile the loss: false, true, auto or a mode
        compile_backend: str = "inductor",  # torch.compile backend (tests use "eager" / "aot_eager")
        val_seed: int = 1234,  # seed of the fixed posterior noise of val/loss
        scaling_images: int | None = None,  # training images the exported scaling is measured on; null: all of them
        run_config: dict[str, Any] | None = None,  # resolved run config, stored for resume
        diffusion: None = None,  # a VAE run has no diffusion node: refused with its fix
    ) -> None:
        super().__init__()
        if diffusion is not None:
            raise ValueError(
                f"module=vae trains an autoencoder, but the config also has a diffusion node "
                f"({type(diffusion).__name__}); drop it with diffusion=null (experiment=mnist_vae does), or train a "
                "diffusion model with module=diffusion"
            )
        if not is_autoencoder(net):
            raise ValueError(
                f"module=vae trains diffusers' AutoencoderKL, but model builds {type(net).__name__}; use a VAE model "
                "config (model=vae_mnist), or module=diffusion for a diffusion model"
            )
        if not kl_weight >= 0 or reconstruction not in ("l1", "l2"):
            raise ValueError(f"kl_weight={kl_weight} must be >= 0 and reconstruction={reconstruction!r} l1 or l2")
        if scaling_images is not None and scaling_images < 1:
            raise ValueError(f"scaling_images={scaling_images} must be >= 1, or null for all the training images")
        self.net, self.optim, self.kl_weight, self.reconstruction = net, optim, kl_weight, reconstruction
        self.compile_mode, self.compile_backend = compile_mode(resolve_compile(compile)), compile_backend
        self.val_seed, self.scaling_images = val_seed, scaling_images
        self.factor = 2 ** (len(net.config.block_out_channels) - 1)  # pixels per latent, each side
        self.save_hyperparameters({"config": run_config or {}})
        self._checked = False
        self.val_means = EpochMeans(("val/loss", "val/rec", "val/kl"))
        keep_buffers_local(self)
        self._loss_fn = self._loss  # the compiled loss after configure_model, when compile is set

    # The diffusion module's optimizer (its fp16 unscale), LR rule after a resume, data position and gradient clipping.
    global_batch_size = DiffusionModule.global_batch_size
    configure_optimizers = DiffusionModule.configure_optimizers
    configure_gradient_clipping = DiffusionModule.configure_gradient_clipping
    optimizer_step = DiffusionModule.optimizer_step
    on_train_start = DiffusionModule.on_train_start
    on_validation_epoch_start = DiffusionModule.on_validation_epoch_start
    _follow_lr_rule = DiffusionModule._follow_lr_rule
    _follow_data_position = DiffusionModule._follow_data_position

    def configure_model(self) -> None:
        if self.compile_mode is not None and self._loss_fn == self._loss:
            inductor = self.compile_backend == "inductor"  # modes are inductor's
            self._loss_fn = torch.compile(self._loss, backend=self.compile_backend, dynamic=False,
                                          mode=self.compile_mode if inductor else None)  # fmt: skip

    def _loss(self, x: Tensor, noise: Tensor) -> Tensor:
        """(loss, reconstruction error, KL per image) of one batch (the function `compile` compiles)."""
        return vae_loss(self.net, x, noise, kl_weight=self.kl_weight, reconstruction=self.reconstruction)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x = self._checked_images(batch[0])
        noise = torch.randn(self.latent_shape(x), device=x.device)
        if uses_cudagraphs(self.compile_mode):
            torch.compiler.cudagraph_mark_step_begin()
        loss = self._loss_fn(x, noise)
        if logs_this_step(self._trainer):  # the other steps skip self.log's cost
            self.log_dict({"train/loss": loss[0], "train/rec": loss[1], "train/kl": loss[2]})
        return loss[0]

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x = self._checked_images(batch[0])
        generator = torch.Generator().manual_seed(self.val_seed + batch_idx)
        noise = torch.randn(self.latent_shape(x), generator=generator).to(x.device)
        loss = self._loss(x, noise)
        self.val_means.add(tuple(loss), x.shape[0])  # val/loss, val/rec, val/kl at the epoch's end (ddpm.epoch_mean)
        return loss[0]

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_means.reduce(self), sync_dist=True)  # equal on every rank (Lightning warns without)

    def latent_shape(self, x: Tensor) -> tuple[int, int, int, int]:
        """(B, c, h, w) of the latents of images x (B, C, H, W)."""
        return x.shape[0], self.net.config.latent_channels, x.shape[2] // self.factor, x.shape[3] // self.factor

    def _checked_images(self, x: Tensor) -> Tensor:
        if not self._checked:
            check_images(x, self.net.config.in_channels, self.factor)
            self._checked = True
        return x

    def setup(self, stage: str) -> None:
        """Refuse the callbacks that sample a diffusion model before the first step (their first grid would fail)."""
        names = {type(c).__name__ for c in self.trainer.callbacks} if self._trainer is not None else set()
        if names & set(DIFFUSION_ONLY):
            raise ValueError(
                f"callbacks {sorted(names & set(DIFFUSION_ONLY))} sample a diffusion model, and module=vae trains an "
                "autoencoder: use callbacks=vae (its grid: originals, reconstructions, decoded N(0, I) latents), or "
                "drop them (callbacks.sample_grid=null)"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # What a resume at another scale compares with (ddpm.resume.checkpoint_world), as DiffusionModule writes it.
        checkpoint["world"] = {"world_size": self.trainer.world_size, "global_batch": self.global_batch_size(),
                               "lr": self.scaled_lr}  # fmt: skip

    def write_exports(self, output_dir: Path, ema: EMA) -> Path:
        """`<output_dir>/vae/`: the EMA weights as a diffusers AutoencoderKL folder, with scaling_factor = 1 / std and
        shift_factor = mean of the posterior means over the training images (measured with those weights)."""
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        net = self.net.to(device).eval()
        with ema.averaged(net):
            mean, std = latent_statistics(net, training_images(self.trainer.datamodule, self.scaling_images))
            net.register_to_config(scaling_factor=1.0 / std, shift_factor=mean)
            size = sum(t.numel() * t.element_size() for t in net.state_dict().values())
            fix = "free space in the run folder; the run's checkpoints hold the EMA weights"
            path = atomic_folder(output_dir / EXPORT, lambda folder: net.save_pretrained(folder), size=size, fix=fix,
                                 files=("config.json",))  # fmt: skip
        say(f"VAE: {path} (scaling_factor {1.0 / std:.6g}, shift_factor {mean:.6g}: the latents' 1 / std and mean)")
        return path


def check_images(x: Tensor, channels: int, factor: int) -> None:
    """Reject a batch the autoencoder cannot learn from, naming the config value to change."""
    if x.ndim != 4 or x.shape[1] != channels:
        raise ValueError(
            f"the data gives images of shape {tuple(x.shape[1:])} (C, H, W) but model.in_channels={channels}; "
            f"set model.in_channels={x.shape[1] if x.ndim == 4 else '?'} or convert the data (data.channels)"
        )
    if x.shape[2] % factor or x.shape[3] % factor:
        raise ValueError(
            f"the data gives {x.shape[2]}x{x.shape[3]} images, not a multiple of the VAE's downsampling factor "
            f"{factor}; set data.image_size (and model.image_size) to a multiple of {factor}"
        )
    low, high = torch.aminmax(x.float())
    if low < -1.001 or high > 1.001 or not torch.isfinite(low + high):
        raise ValueError(
            f"a batch after scaling spans [{low.item():.3g}, {high.item():.3g}], not [-1, 1]; the datamodule must "
            "yield uint8 images in [0, 255] (scaled on the device as x / 127.5 - 1)"
        )


def training_images(datamodule: Any, limit: int | None, batch_size: int = 256) -> Iterator[Tensor]:
    """The training images as uint8 batches (B, C, H, W): a RAM datamodule's training split in order, else one pass
    of its training loader; at most `limit` images."""
    dataset = getattr(datamodule, "train_set", None)
    if dataset is not None and hasattr(dataset, "index"):  # ddpm.data.ram.ImageTensorDataset
        rows = dataset.index[:limit]
        batches: Any = (dataset.images[rows[i : i + batch_size]] for i in range(0, len(rows), batch_size))
    else:
        batches = (batch[0] for batch in datamodule.train_dataloader())
    seen = 0
    for images in batches:
        if images.dtype != torch.uint8:
            raise TypeError(f"the training data gives {images.dtype} images; the VAE's scaling is measured on uint8")
        images = images if limit is None else images[: limit - seen]
        seen += len(images)
        yield images
        if limit is not None and seen >= limit:
            return
