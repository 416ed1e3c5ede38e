"""Batched image generation shared by sample.py, the training-time grids and evaluation. Plain torch.

`generate(denoiser, sampler, shape, ...)` draws images with any sampler from any denoiser (ddpm.diffusion.denoiser:
the network wrapped by its diffusion family, guided or not, prepared by ddpm.diffusion.network). Seeding is by
image index, so the same seed and batch size give the same images whichever rank or process draws them.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoised, Denoiser, Guided, Levels, Net
from ddpm.diffusion.network import Precision, prepare_network
from ddpm.diffusion.samplers.base import Sampler


class NonFiniteSamplesError(FloatingPointError):
    """A sampler returned NaN or inf: nothing is written, instead of black images."""


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


class Counted:
    """A denoiser that counts its calls (network evaluations: a batched [cond; uncond] call counts once)."""

    def __init__(self, denoiser: Denoiser) -> None:
        self.denoiser, self.sigmas, self.calls = denoiser, denoiser.sigmas, 0

    def __call__(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Denoised:
        self.calls += 1
        return self.denoiser(x, sigma, y)


class Family(Protocol):
    def denoiser(self, net: Net) -> Denoiser: ...  # GaussianDiffusion, EDMDiffusion


def denoiser_for(
    net: Net,
    diffusion: Family,
    *,
    guidance: float = 0.0,  # classifier-free guidance weight w (needs net.num_classes, the null class's index)
    interval: tuple[float, float] | None = None,  # (sigma_lo, sigma_hi]: guide only there; None: every step
    precision: Precision = "32",  # the network's (ddpm.diffusion.network)
    channels_last: bool = False,  # an NHWC copy of the network
    compile: bool = False,  # torch.compile the network, called on `rows` rows
    rows: int | None = None,  # images per sampler batch (doubled here when guided)
    compile_backend: str = "inductor",  # torch.compile's backend (tests and smoke runs: eager, aot_eager)
) -> Denoiser:
    """The denoiser sample.py, the training callbacks and the benchmarks sample with: `net` prepared
    (ddpm.diffusion.network), wrapped by its diffusion family, guided when guidance != 0."""
    null_class = getattr(net, "num_classes", None)  # Guided refuses a weight this network cannot take
    guided = guidance != 0
    rows = rows * (2 if guided else 1) if rows is not None else None
    prepared = prepare_network(net, precision=precision, channels_last=channels_last, compile=compile, rows=rows,
                               compile_backend=compile_backend)  # fmt: skip
    denoiser = diffusion.denoiser(prepared)
    return Guided(denoiser, guidance=guidance, null_class=null_class, interval=interval) if guided else denoiser


class _FirstCall(Exception):
    """Raised by check_sampler's denoiser at the sampler's first network call."""


class _Probe(Levels):
    """A denoiser on the levels of `diffusion` whose network is never called: its first call ends check_sampler."""

    def __init__(self, diffusion: Family) -> None:
        self.inner = diffusion.denoiser(lambda x, t, y: x)  # never called: output() raises first
        super().__init__(self.inner.sigmas)

    def output(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Tensor:
        raise _FirstCall

    def denoised(self, x: Tensor, sigma: Tensor, output: Tensor) -> Denoised:
        return self.inner.denoised(x, sigma, output)


def check_sampler(sampler: Sampler, diffusion: Family) -> None:
    """Run `sampler` on `diffusion`'s levels up to its first network call: its grid is made, and refused where the
    model cannot take it (steps beyond T, a spacing T repeats), before anything is drawn or trained."""
    probe = _Probe(diffusion)
    try:
        sampler.sample(probe, torch.zeros(1, 1, 1, 1), probe.sigmas, None)
    except _FirstCall:
        return


def to_uint8(x: Tensor) -> Tensor:
    """[-1, 1] float -> [0, 255] uint8, rounding to nearest (as the images would be saved)."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).contiguous()


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
    denoiser: Denoiser,
    sampler: Sampler,
    shape: tuple[int, int, int, int],
    *,
    labels: Tensor | None = None,
    seed: int = 0,
    batch_size: int = 64,
    first_index: int = 0,
    device: torch.device | str = "cpu",
) -> Generated:
    """Draw shape[0] images of shape (C, H, W) = shape[1:] in batches of `batch_size` on `device` (the network's).

    labels: (N,) int64 for a conditional model (None: unconditional, or the null class). Image i (first_index + i)
    is drawn from the noise of its batch's seed (`batch_seed`), so the same seed, batch size and first_index give the
    same images. The sampler runs in float32, even inside an autocast.
    """
    num_samples, *image_shape = shape
    if num_samples <= 0 or batch_size <= 0:
        raise ValueError(f"the number of samples ({num_samples}) and batch_size ({batch_size}) must be > 0")
    device = torch.device(device)
    counted = Counted(denoiser)
    images, began = [], time.perf_counter()
    float32 = torch.autocast(device.type, enabled=False)
    for start, stop in _batches(num_samples, batch_size, first_index):
        generator = torch.Generator(device).manual_seed(batch_seed(seed, start))
        x_T = torch.randn((stop - start, *image_shape), generator=generator, device=device)
        y = None if labels is None else labels[start - first_index : stop - first_index].to(device)
        with float32:
            x0 = sampler.sample(counted, x_T, counted.sigmas, y, generator=generator)
        if not bool(torch.isfinite(x0).all()):  # to_uint8 would write NaN as 0: black images
            raise NonFiniteSamplesError(
                f"the sampler produced NaN/inf images (batch of samples {start}..{stop - 1}): the network's outputs "
                f"are not finite ({counted.calls} network calls so far); its weights may hold NaN/inf, or its "
                "arithmetic overflows (bf16: sample with precision=32)"
            )
        images.append(to_uint8(x0).cpu())
    batches = max(1, -(-num_samples // batch_size))
    return Generated(
        images=torch.cat(images), labels=labels, nfe=counted.calls // batches, seconds=time.perf_counter() - began
    )
