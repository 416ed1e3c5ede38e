"""Batched image generation shared by sample.py, the training-time grids and evaluation. Plain torch."""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ddpm.diffusion.gaussian import Prediction
from ddpm.diffusion.samplers.base import GuidedModel, Net


class Sampler(Protocol):
    def sample(
        self, model: GuidedModel, x_T: Tensor, y: Tensor | None, *, generator: torch.Generator | None = None
    ) -> Tensor: ...


@dataclass(frozen=True)
class Generated:
    """images: (N, C, H, W) uint8 on CPU; labels: (N,) int64 or None; nfe: network calls per batch."""

    images: Tensor
    labels: Tensor | None
    nfe: int
    seconds: float

    @property
    def images_per_second(self) -> float:
        return len(self.images) / max(self.seconds, 1e-9)


def to_uint8(x: Tensor) -> Tensor:
    """[-1, 1] float -> [0, 255] uint8, rounding to nearest (as the images would be saved)."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


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


def class_cycle(num_samples: int, num_classes: int) -> Tensor:
    """Labels 0, 1, ..., K-1, 0, 1, ...: every class in turn. (N,) int64."""
    return torch.arange(num_samples) % num_classes


def batch_seed(seed: int, start: int) -> int:
    """Seed of the batch that starts at sample index `start`: disjoint streams per batch (and per rank)."""
    return (seed * 1_000_003 + start) % (2**63 - 1)


def _batches(num_samples: int, batch_size: int, first: int = 0) -> Iterator[tuple[int, int]]:
    for start in range(first, first + num_samples, batch_size):
        yield start, min(start + batch_size, first + num_samples)


@torch.no_grad()
def generate(
    *,
    net: Net,
    betas: Tensor,
    prediction: Prediction,
    sampler: Sampler,
    image_shape: tuple[int, int, int],
    num_samples: int,
    labels: Tensor | None = None,
    null_class: int | None = None,
    guidance: float = 0.0,
    seed: int = 0,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    first_index: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> Generated:
    """Draw `num_samples` images (indices first_index.. for seeding) in batches of `batch_size`.

    labels: (N,) int64 for a conditional model (None: unconditional, or the null class); the same
    seed, batch size and first_index give the same images.
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples={num_samples} must be > 0")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be > 0")
    model = GuidedModel(net=net, betas=betas, prediction=prediction, guidance=guidance, null_class=null_class)
    images, began = [], time.perf_counter()
    float32 = torch.autocast(torch.device(device).type, enabled=False)  # float32 even inside a bf16 run
    for start, stop in _batches(num_samples, batch_size, first_index):
        generator = torch.Generator(device).manual_seed(batch_seed(seed, start))
        x_T = torch.randn((stop - start, *image_shape), generator=generator, device=device)
        y = None if labels is None else labels[start - first_index : stop - first_index].to(device)
        with float32:
            images.append(to_uint8(sampler.sample(model, x_T, y, generator=generator)).cpu())
        if on_batch is not None:
            on_batch(stop - start)
    batches = max(1, -(-num_samples // batch_size))
    return Generated(
        images=torch.cat(images), labels=labels, nfe=model.nfe // batches, seconds=time.perf_counter() - began
    )
