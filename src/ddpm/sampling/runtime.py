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

import warnings
from collections.abc import Sequence

import torch

from ddpm.diffusion.samplers.base import PRECISIONS, Precision, check_interval
from ddpm.metrics.sharding import world
from ddpm.precision import fast_bf16, native_bf16

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
    return torch.device(name)


def check_guidance(guidance: float, *, num_classes: int | None, p_uncond: float | None, key: str = "guidance") -> None:
    """Refuse a classifier-free guidance weight the model cannot honour, naming `key` (the setting to change).

    Guidance mixes the conditional prediction with the null class's (unconditional) one, so it needs a
    class-conditional model (model.num_classes set) whose null class was trained: labels dropped to it with
    probability diffusion.p_uncond > 0. sample.py and the training-time grid (SampleGrid) both call this.
    """
    if guidance < 0:
        raise ValueError(f"{key}={guidance} must be >= 0 (0 = no guidance; 1-5 are usual)")
    if guidance == 0:
        return
    if num_classes is None:
        raise ValueError(
            f"{key}={guidance} needs a class-conditional model, but this one is unconditional "
            f"(model.num_classes: null); set {key}=0 or train with model.num_classes set"
        )
    if p_uncond is not None and p_uncond <= 0:
        raise ValueError(
            f"{key}={guidance} needs the model's unconditional (null-class) prediction, but its run has "
            f"diffusion.p_uncond={p_uncond}: no label is ever dropped to the null class, so that prediction is "
            f"untrained and guided samples would be noise; set {key}=0, or train with diffusion.p_uncond > 0 "
            "(0.1 is usual)"
        )


def resolve_sampling_precision(
    precision: str | int, device: torch.device | str, *, key: str = "precision"
) -> Precision:
    """ "auto" -> "bf16" where bf16 is faster than float32 on `device` (fast_bf16: CUDA bf16, AMX CPUs), else
    "32"; "32" / "bf16" pass through (bf16 warns where it is not native: slow reference kernels)."""
    name = str(precision)
    device_type = torch.device(device).type
    if name == "auto":
        return "bf16" if fast_bf16(device_type) else "32"
    if name not in PRECISIONS:
        raise ValueError(f"{key}={precision!r} must be auto, 32 or bf16")
    if name == "bf16" and not native_bf16(device_type):
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
    """A config's guidance interval [sigma_lo, sigma_hi] (null: none) as the tuple GuidedModel takes; a bad value is
    refused naming `key`."""
    if value is None:
        return None
    try:
        return check_interval(tuple(value))
    except (TypeError, ValueError) as error:
        shown = list(value) if isinstance(value, Sequence) else value
        raise ValueError(f"{key}={shown}: {error}, or {key}=null to guide every step") from error
