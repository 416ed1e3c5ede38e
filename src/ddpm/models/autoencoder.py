"""The autoencoder of latent diffusion, trained here: diffusers' `AutoencoderKL` built from typed arguments, and its
objective (Rombach et al. 2022, appendix G; Kingma & Welling 2014). Plain torch; diffusers is imported when a network
is built (the `diffusers` extra).

The objective is LDM's without its perceptual (LPIPS) and adversarial terms, both of which need networks trained
elsewhere (LPIPS: ImageNet VGG weights; a discriminator: a second training loop): per image, the reconstruction error
summed over the pixel values plus `kl_weight` x KL(q(z | x) || N(0, I)) summed over the latent values, both divided
by the number of pixel values C x H x W (so `kl_weight` means what LDM's does, and the loss reads as an error per pixel
value), averaged over the batch.
"""

from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor, nn

from ddpm.models.vae import VAE, autoencoder_class

Reconstruction = Literal["l1", "l2"]


def autoencoder_kl(
    *,
    in_channels: int = 3,  # image channels (1: grey, 3: RGB); the decoder gives as many
    image_size: int = 32,  # H = W of the training images (diffusers' sample_size); a multiple of the factor
    latent_channels: int = 4,  # c of the (c, h, w) latents
    block_out_channels: list[int] | tuple[int, ...] = (64, 128, 128),  # widths per level; n levels: factor 2**(n-1)
    layers_per_block: int = 1,  # ResNet blocks per encoder level (the decoder has one more, as diffusers builds it)
    norm_num_groups: int = 32,  # GroupNorm groups; must divide every width
    mid_block_attention: bool = True,  # self-attention in the middle blocks of encoder and decoder
) -> nn.Module:
    """A new, randomly initialised `diffusers.AutoencoderKL`: images (B, C, S, S) in [-1, 1] -> latents
    (B, latent_channels, S / f, S / f), f = 2 ** (len(block_out_channels) - 1)."""
    widths = tuple(block_out_channels)
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"block_out_channels={list(widths)} must be one or more positive widths")
    bad = [w for w in widths if w % norm_num_groups]
    if norm_num_groups < 1 or bad:
        raise ValueError(f"norm_num_groups={norm_num_groups} must divide every width; {bad} are not multiples of it")
    factor = 2 ** (len(widths) - 1)
    if image_size < 1 or image_size % factor:
        raise ValueError(
            f"image_size={image_size} is not divisible by {factor} (2**{len(widths) - 1} downsamplings for "
            f"{len(widths)} block_out_channels); use a multiple of {factor} or fewer entries in block_out_channels"
        )
    for name, value in (("in_channels", in_channels), ("latent_channels", latent_channels),
                        ("layers_per_block", layers_per_block)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    return autoencoder_class()(
        in_channels=in_channels,
        out_channels=in_channels,
        down_block_types=("DownEncoderBlock2D",) * len(widths),
        up_block_types=("UpDecoderBlock2D",) * len(widths),
        block_out_channels=widths,
        layers_per_block=layers_per_block,
        latent_channels=latent_channels,
        norm_num_groups=norm_num_groups,
        sample_size=image_size,
        mid_block_add_attention=mid_block_attention,
        scaling_factor=1.0,  # set from the data when the trained VAE is saved (ddpm.vae_module)
    )


def kl_to_standard_normal(mean: Tensor, logvar: Tensor) -> Tensor:
    """KL(N(mean, exp(logvar)) || N(0, I)) per image, summed over (c, h, w): (B,) float32."""
    return 0.5 * (mean.float().square() + logvar.float().exp() - 1.0 - logvar.float()).flatten(1).sum(1)


def vae_loss(
    autoencoder: nn.Module, x: Tensor, noise: Tensor, *, kl_weight: float, reconstruction: Reconstruction = "l1"
) -> Tensor:
    """The training objective of one batch and its parts: (loss, reconstruction error, KL per image), float32 scalars
    stacked as (3,). x: images (B, C, H, W) in [-1, 1]; noise: N(0, I) of the latents' shape (B, c, h, w), the
    posterior sample z = mean + exp(logvar / 2) noise (the reparameterisation, drawn outside for compile)."""
    posterior = autoencoder.encode(x).latent_dist  # diffusers clamps logvar to [-30, 20]
    z = posterior.mean + posterior.std * noise
    x_hat = autoencoder.decode(z).sample
    error = (x_hat.float() - x.float()).abs() if reconstruction == "l1" else (x_hat.float() - x.float()).square()
    pixels = x[0].numel()  # C x H x W
    rec = error.mean()
    kl = kl_to_standard_normal(posterior.mean, posterior.logvar).mean()
    return torch.stack([rec + kl_weight * kl / pixels, rec.detach(), kl.detach()])


@torch.no_grad()
def latent_statistics(autoencoder: nn.Module, batches: Iterable[Tensor]) -> tuple[float, float]:
    """(mean, std) of all the values of the posterior means of uint8 image batches (B, C, H, W), encoded as
    ddpm.models.vae.VAE encodes (float64 sums): LDM's rescaling, z_d = (z - mean) / std, gives the diffusion model
    latents of mean 0 and variance 1."""
    vae = VAE(autoencoder, identity="measuring")
    total, squares, count = 0.0, 0.0, 0
    for images in batches:
        mean = vae.encode(images)[0].double()
        total, squares, count = total + mean.sum().item(), squares + mean.square().sum().item(), count + mean.numel()
    if count == 0:
        raise ValueError("no training images to measure the latents' scale on (module.scaling_images, data.limit)")
    mean = total / count
    std = max(squares / count - mean**2, 0.0) ** 0.5
    if not std > 0:
        raise ValueError(f"the posterior means of {count} latent values are all {mean:.6g}: the VAE has collapsed")
    return mean, std
