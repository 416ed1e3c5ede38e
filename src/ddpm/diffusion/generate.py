"""Batched image generation shared by sample.py, the training-time grids and evaluation. Plain torch.

Which settings suit a device (`auto` precision, batch sizes, guidance checks that name config keys) is decided
by the caller (ddpm.sampling.runtime); here each option is applied as given. Speed options (`precision="32"`,
`compile=False`, `channels_last=False` is the float32 eager path):
- precision: "32" | "bf16" -- the network under bf16 autocast (samplers.base.network_call).
- channels_last: a copy of the network with NHWC (channels_last) weights, oneDNN's and cuDNN's fast convolution
  layout; the convolutions then run (and return) NHWC. unet_mnist on an AVX512-BF16 CPU, float32: ~1.3x more
  images/s (benchmarks/sampling.py).
- compile: the network compiled once (torch.compile, dynamic=False) and always called on one batch shape:
  `StaticBatch` pads a partial batch (and the doubled [cond; uncond] batch of guidance) to the full network batch.
"""

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from ddpm.diffusion.samplers.base import GuidedModel, Net, Output, Precision


class Sampler(Protocol):
    def sample(
        self, model: GuidedModel, x_T: Tensor, y: Tensor | None, *, generator: torch.Generator | None = None
    ) -> Tensor: ...


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


def to_uint8(x: Tensor) -> Tensor:
    """[-1, 1] float -> [0, 255] uint8, rounding to nearest (as the images would be saved)."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).contiguous()


class StaticBatch:
    """net(x, t, y) always called on exactly `rows` rows, so a compiled network sees one shape: fewer rows are
    padded with copies of the last row, more run in chunks of `rows`; the output is cut back to the rows given."""

    def __init__(self, net: Net, rows: int) -> None:
        self.net, self.rows = net, rows

    def __call__(self, x: Tensor, t: Tensor, y: Tensor | None) -> Tensor:
        n = x.shape[0]
        if n > self.rows:
            chunks = range(0, n, self.rows)
            return torch.cat([self(x[i : i + self.rows], t[i : i + self.rows], _rows(y, i, self.rows)) for i in chunks])
        pad = self.rows - n
        if pad:
            x, t, y = _pad(x, pad), _pad(t, pad), (None if y is None else _pad(y, pad))
        return self.net(x, t, y)[:n]


def _rows(y: Tensor | None, start: int, count: int) -> Tensor | None:
    return None if y is None else y[start : start + count]


def _pad(v: Tensor, pad: int) -> Tensor:
    return torch.cat([v, v[-1:].expand(pad, *v.shape[1:])])


def to_channels_last(net: Net) -> Net:
    """A copy of `net` with NHWC (channels_last) weights; the caller's module keeps its layout (e.g. the EMA network
    of a training run). Convert before compiling: a compiled network is refused, since its graph holds the layout."""
    if hasattr(net, "_orig_mod"):
        raise ValueError("channels_last: convert the network before torch.compile, not after")
    if not isinstance(net, nn.Module):
        raise TypeError(f"channels_last needs an nn.Module, got {type(net).__name__}")
    return copy.deepcopy(net).to(memory_format=torch.channels_last)


def compile_network(net: Net, backend: str | Callable = "inductor") -> Net:
    """torch.compile(net, dynamic=False): one graph per input shape (StaticBatch keeps it to one)."""
    return torch.compile(net, dynamic=False, backend=backend)


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
    prediction: Output,
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
    precision: Precision = "32",
    channels_last: bool = False,
    compile: bool = False,
    compile_backend: str | Callable = "inductor",
    sigma_data: float | None = None,
    guidance_interval: tuple[float, float] | None = None,
) -> Generated:
    """Draw `num_samples` images (indices first_index.. for seeding) in batches of `batch_size`.

    labels: (N,) int64 for a conditional model (None: unconditional, or the null class); the same seed, batch size
    and first_index give the same images. prediction and sigma_data: the run's diffusion.prediction and
    diffusion.sigma_data (an EDM model's "edm" and its data scale; None otherwise). guidance_interval: (sigma_lo,
    sigma_hi], guidance only at steps whose sigma_t lies in it (samplers.base.GuidedModel); None: at every step.
    precision: 32 or bf16 (the network only, see samplers.base.network_call; `auto` is decided by the caller,
    ddpm.sampling.runtime).
    channels_last: sample with an NHWC copy of `net` (to_channels_last). compile: torch.compile the network (already
    compiled `net`s are reused, e.g. by several calls), always called on batch_size rows (or num_samples if fewer;
    twice that with guidance): a partial last batch is padded, so the sampler draws the same noise as the uncompiled
    run.
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples={num_samples} must be > 0")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be > 0")
    if channels_last:
        net = to_channels_last(net)
    if compile:
        guided = guidance != 0 and labels is not None
        compiled = net if hasattr(net, "_orig_mod") else compile_network(net, compile_backend)
        rows = min(batch_size, num_samples)  # fewer images than a batch: no padding up to batch_size
        net = StaticBatch(compiled, rows=rows * (2 if guided else 1))
    model = GuidedModel(
        net=net, betas=betas, prediction=prediction, guidance=guidance, null_class=null_class, precision=precision,
        sigma_data=sigma_data, guidance_interval=guidance_interval,
    )  # fmt: skip
    images, began = [], time.perf_counter()
    float32 = torch.autocast(torch.device(device).type, enabled=False)  # float32 even inside a bf16 run
    for start, stop in _batches(num_samples, batch_size, first_index):
        generator = torch.Generator(device).manual_seed(batch_seed(seed, start))
        x_T = torch.randn((stop - start, *image_shape), generator=generator, device=device)
        y = None if labels is None else labels[start - first_index : stop - first_index].to(device)
        with float32:
            x0 = sampler.sample(model, x_T, y, generator=generator)
        if not bool(torch.isfinite(x0).all()):  # to_uint8 would write NaN as 0: black images
            raise NonFiniteSamplesError(
                f"the sampler produced NaN/inf images (batch of samples {start}..{stop - 1}): the network's outputs "
                f"are not finite ({model.nfe} network calls so far); its weights may hold NaN/inf, or its "
                f"{precision} arithmetic overflows"
            )
        images.append(to_uint8(x0).cpu())
        if on_batch is not None:
            on_batch(stop - start)
    batches = max(1, -(-num_samples // batch_size))
    return Generated(
        images=torch.cat(images), labels=labels, nfe=model.nfe // batches, seconds=time.perf_counter() - began
    )
