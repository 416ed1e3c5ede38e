"""The VAE of latent diffusion (Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models"):
diffusers' `AutoencoderKL`, a local folder or a config, behind a small interface. Plain torch; diffusers is imported
when a VAE is built (the `diffusers` extra).

Latents: the encoder gives a diagonal Gaussian posterior q(z | x) = N(mean, exp(logvar)) per image (B, c, h, w).
The diffusion model works on z_d = (z - shift) * scale (LDM's scale_factor, diffusers' `scaling_factor` and
`shift_factor`: the data of the diffusion roughly unit variance); decoding goes back z = z_d / scale + shift, then
the decoder gives pixels in [-1, 1]. `identity` names a VAE by the sha256 of its config and weights, so latents
encoded with one VAE are never decoded with another.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ddpm.models.diffusers_unet import DIFFUSERS_EXTRA

WEIGHTS = "diffusion_pytorch_model.safetensors"  # diffusers' file name for a model's weights


def is_autoencoder(net: nn.Module) -> bool:
    """Whether `net` is an autoencoder (diffusers' AutoencoderKL or anything with its encode, decode and config)."""
    return all(hasattr(net, name) for name in ("encode", "decode", "config"))


def autoencoder_class() -> type:
    try:
        from diffusers import AutoencoderKL
    except ImportError as error:
        raise ImportError(
            f"latent diffusion needs diffusers' AutoencoderKL, which is not installed; {DIFFUSERS_EXTRA}"
        ) from error
    return AutoencoderKL


class VAE(nn.Module):
    """An AutoencoderKL with the latent scaling of the diffusion model that uses it."""

    def __init__(self, autoencoder: nn.Module, *, identity: str, folder: str | None = None) -> None:
        super().__init__()
        self.autoencoder, self.identity, self.folder = autoencoder, identity, folder
        config = autoencoder.config
        self.scale = float(config.scaling_factor)
        self.shift = float(config.shift_factor or 0.0)
        self.latent_channels = int(config.latent_channels)
        self.factor = 2 ** (len(config.block_out_channels) - 1)  # pixels per latent, each side
        self.in_channels = int(config.in_channels)

    @classmethod
    def load(cls, folder: str | Path, device: torch.device | str = "cpu") -> "VAE":
        """The VAE saved in `folder` (diffusers' save_pretrained: config.json and the weights), in eval mode."""
        folder, fix = (
            Path(folder),
            "pass the folder a VAE was saved in (a downloaded pretrained one, or <run>/vae of a VAE trained here)",
        )
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not a diffusers AutoencoderKL folder (no config.json): {fix}")
        kind = json.loads((folder / "config.json").read_text()).get("_class_name", "AutoencoderKL")
        if kind != "AutoencoderKL":
            raise ValueError(f"{folder} holds a diffusers {kind}, not an AutoencoderKL: {fix}")
        try:  # low_cpu_mem_usage off: no `accelerate`
            autoencoder, info = autoencoder_class().from_pretrained(
                str(folder), low_cpu_mem_usage=False, output_loading_info=True
            )
        except OSError as error:  # no weights file (diffusers names the one it looked for)
            raise FileNotFoundError(f"{folder} holds no AutoencoderKL weights ({error}): {fix}") from error
        wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if wrong:  # diffusers would leave those weights at their random initialisation
            listed = "; ".join(f"{k.replace('_', ' ')}: {', '.join(map(str, v[:3]))}" for k, v in wrong.items())
            raise ValueError(f"{folder}: its weights do not fit its config.json ({listed}): {fix}")
        return cls(autoencoder.to(device).eval(), identity=folder_identity(folder), folder=str(folder))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "VAE":
        """A new, randomly initialised AutoencoderKL of this config (training a VAE, tests)."""
        autoencoder = autoencoder_class()(**config)
        return cls(autoencoder, identity="untrained")

    def latent_shape(self, image_size: int) -> tuple[int, int, int]:
        """(c, h, w) of the latents of `image_size` images."""
        if image_size % self.factor:
            raise ValueError(
                f"image_size={image_size} is not a multiple of the VAE's downsampling factor {self.factor}"
            )
        return self.latent_channels, image_size // self.factor, image_size // self.factor

    @torch.no_grad()
    def encode(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """uint8 images (B, C, H, W) -> the posterior's (mean, logvar), each (B, c, h, w) float32."""
        x = images.to(self._device()).float() / 127.5 - 1
        posterior = self.autoencoder.encode(x.to(self._dtype())).latent_dist  # a bf16 VAE (bf16-true) takes bf16
        return posterior.mean.float(), posterior.logvar.float()

    def to_diffusion(self, mean: Tensor, logvar: Tensor, noise: Tensor | None = None) -> Tensor:
        """z_d = (z - shift) * scale, z = mean + exp(logvar / 2) noise (a posterior sample; noise None: the mean)."""
        z = mean if noise is None else mean + (0.5 * logvar).exp() * noise
        return (z - self.shift) * self.scale

    def decode(self, latents: Tensor) -> Tensor:
        """Diffusion latents z_d (B, c, h, w) -> images (B, C, H, W) float32 in [-1, 1] (clamped)."""
        z = latents.to(self._device()) / self.scale + self.shift
        with torch.no_grad():
            return self.autoencoder.decode(z.to(self._dtype())).sample.float().clamp(-1, 1)

    def _device(self) -> torch.device:
        return next(self.autoencoder.parameters()).device

    def _dtype(self) -> torch.dtype:
        return next(self.autoencoder.parameters()).dtype


def weight_files(folder: Path) -> list[Path]:
    """Every weights file of `folder` (*.safetensors, then *.bin): what the identity hashes and an export copies
    (diffusers loads one of them; hashing them all keeps the identities of folders encoded before)."""
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))


def folder_identity(folder: Path) -> str:
    """sha256 (hex, 16 digits) of a VAE folder's config.json (as data: key order and spacing ignored) and its
    weights files (weight_files)."""
    digest = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text())
    config.pop("_name_or_path", None)  # where it was loaded from, not what it is
    digest.update(json.dumps(config, sort_keys=True).encode())
    for weights in weight_files(folder):
        with weights.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]
