"""Run-time policy of sampling: what `auto` means on this device, and guidance checks that name config keys.

sample.py, the training-time sample grid and FID callbacks, and the benchmarks decide here, then call the
plain-torch `ddpm.diffusion.generate.generate` with concrete values:

- `resolve_device("auto")`: this rank's GPU under torchrun, else cuda if available, else cpu;
- `resolve_sampling_precision("auto", device)`: bf16 network calls where bf16 was measured faster than float32
  (ddpm.precision.fast_bf16: CUDA with bf16, AMX CPUs), else float32;
- `default_batch_size(device, guided=...)`: 256 images on a GPU; 64 network rows per call on a CPU;
- `check_guidance(w, ...)`: refuses a guidance weight the model cannot honour, naming the key to change;
- `guidance_interval(value)`: a config's [sigma_lo, sigma_hi] as a tuple, or a refusal naming the key.
"""

import math
import warnings
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

from ddpm import precision as device_policy  # its functions looked up at each call (tests stand in CPUs)
from ddpm.config.build import keyed
from ddpm.diffusion.denoiser import check_interval, guidance_refusal
from ddpm.diffusion.network import PRECISIONS, Precision
from ddpm.models.vae import VAE
from ddpm.ranks import world

CPU_BATCH = 64  # network rows per call on CPU (unet_mnist: 64 ~1.7x faster per image than 256)
GPU_BATCH = 256  # images per sampler batch on a GPU


def resolve_device(name: str) -> torch.device:
    """`auto`: this rank's GPU under torchrun, cuda if available, else cpu; an explicit name is checked."""
    if name == "auto" and world()[1] > 1 and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # torchrun: this rank's GPU
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here; use device=cpu or device=auto")
    try:
        return torch.device(name)
    except RuntimeError as error:  # device=gpu: torch lists its 20 device types
        raise ValueError(f"device={name!r} is not a device; use auto, cpu, cuda or cuda:<index>") from error


def check_guidance(guidance: float, *, num_classes: int | None, p_uncond: float | None, key: str = "guidance") -> None:
    """Refuse a guidance weight the model cannot honour (ddpm.diffusion.denoiser.guidance_refusal), naming `key`,
    the setting to change, before anything is drawn or trained. sample.py and train() (for the callbacks) call it."""
    refusal = guidance_refusal(guidance, num_classes=num_classes, p_uncond=p_uncond)
    if refusal is None:
        return
    if not 0 <= guidance < math.inf:
        raise ValueError(f"{key}={guidance}: {refusal}; set {key}=0 or a positive weight")
    raise ValueError(
        f"{key}={guidance}: {keyed(refusal, 'diffusion', ['p_uncond'])}; set {key}=0, or train a class-conditional "
        "model (model.num_classes) with diffusion.p_uncond > 0 (0.1 is usual)"
    )


def resolve_sampling_precision(
    precision: str | int, device: torch.device | str, *, key: str = "precision"
) -> Precision:
    """ "auto" -> "bf16" where bf16 is faster than float32 on `device` (fast_bf16: CUDA bf16, AMX CPUs), else
    "32"; "32" / "bf16" pass through (bf16 warns where it is not native: slow reference kernels)."""
    name = str(precision)
    device_type = torch.device(device).type
    if name == "auto":
        return "bf16" if device_policy.fast_bf16(device_type) else "32"
    if name not in PRECISIONS:
        raise ValueError(f"{key}={precision!r} must be auto, 32 or bf16")
    if name == "bf16" and not device_policy.native_bf16(device_type):
        warnings.warn(
            f"{key}=bf16 on a {device_type} without native bfloat16: the network will run slower than in float32; "
            f"use {key}=auto or {key}=32",
            UserWarning,
            stacklevel=2,
        )
    return name  # type: ignore[return-value]


def default_batch_size(device: torch.device | str, *, guided: bool) -> int:
    """Images per sampler batch for `batch_size: auto`: 256 on a GPU; on a CPU, 64 network rows per call
    (64 images, or 32 with guidance, whose [cond; uncond] call doubles the batch)."""
    if torch.device(device).type == "cuda":
        return GPU_BATCH
    return CPU_BATCH // 2 if guided else CPU_BATCH


def guidance_interval(value: Sequence[float] | None, key: str = "guidance_interval") -> tuple[float, float] | None:
    """A config's guidance interval [sigma_lo, sigma_hi] (null: none) as the tuple ddpm.diffusion.denoiser.Guided
    takes; a bad value is refused naming `key`."""
    if value is None:
        return None
    try:
        return check_interval(tuple(value))
    except (TypeError, ValueError) as error:
        shown = list(value) if isinstance(value, Sequence) else value
        raise ValueError(f"{key}={shown}: {error}, or {key}=null to guide every step") from error


def load_decoder(
    latent: dict[str, Any] | None, device: torch.device | str, folder: str | None = None, *, key: str = "vae"
) -> VAE | None:
    """The VAE that decodes a latent model's samples, or None for a pixel model. `latent` is the run config's latent
    record (ddpm.data.latents.latent_record); the VAE is the folder it names, or `folder`, refused (naming `key`)
    when it is missing or holds other weights than the latents were encoded with. Loaded once per folder and device."""
    if not latent:
        return None
    path = folder or latent["vae"]
    try:
        vae = _load_vae(str(path), str(device))
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"the model samples latents of the VAE in {latent['vae']}, and {path} holds none ({error}); pass "
            f"{key}=<the folder of that VAE> (identity {latent['vae_identity']})"
        ) from error
    if vae.identity != latent["vae_identity"]:
        raise ValueError(
            f"{key}={path} holds the VAE {vae.identity}, but the model was trained on latents of the VAE "
            f"{latent['vae_identity']} (encoded from {latent['vae']}); its decoder would draw other images: pass "
            f"{key}=<the folder of that VAE>"
        )
    return vae


@cache
def _load_vae(folder: str, device: str) -> VAE:
    return VAE.load(folder, device)
