"""How a sampling network is called: precision, memory layout and compilation, chosen when the denoiser is built
(`prepare_network`); the samplers and `generate` never see them. Plain torch.

- precision "32" | "bf16": the network under bf16 autocast, its output cast back to float32 at once
  (`network_call`); x, the schedule and every sampler update stay float32 either way.
- channels_last: an NHWC copy of the network, oneDNN's and cuDNN's fast convolution layout (unet_mnist on an
  AVX512-BF16 CPU, float32: ~1.3x more images/s, benchmarks/sampling.py); the caller's module keeps its layout.
- compile: torch.compile(dynamic=False) once, always called on one batch shape: `StaticBatch` pads a partial batch
  (and the doubled [cond; uncond] batch of guidance) to `rows`, so a compiled run draws the same noise as an eager one.
"""

import copy
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from ddpm.diffusion.denoiser import Net

Precision = Literal["32", "bf16"]
PRECISIONS = ("32", "bf16")
SamplingPrecision = Literal["auto", "32", "bf16", 32]  # a config's: `auto` is decided per device (ddpm.sampling)


def network_call(net: Net, precision: Precision = "32") -> Net:
    """net(x, t, y) under the sampling precision: "32" is the network itself; "bf16" runs it under
    torch.autocast(dtype=bfloat16) on x's device type and returns its output as float32."""
    if precision == "32":
        return net
    if precision != "bf16":
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")

    def bf16(x: Tensor, t: Tensor, y: Tensor | None) -> Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = net(x, t, y)
        return out.float()

    return bf16


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


def prepare_network(
    net: Net,
    *,
    precision: Precision = "32",  # "bf16": the network under bf16 autocast
    channels_last: bool = False,  # sample with an NHWC copy of `net`
    compile: bool = False,  # torch.compile it (an already compiled `net` is reused), called on `rows` rows
    rows: int | None = None,  # rows per network call when compiled: the batch size (twice it with guidance)
    compile_backend: str | Callable = "inductor",
) -> Net:
    """`net` as the denoiser should call it (module docstring)."""
    if channels_last:
        net = to_channels_last(net)
    if compile:
        if rows is None:
            raise ValueError("compile=True needs rows: the number of rows of every network call")
        compiled = net if hasattr(net, "_orig_mod") else compile_network(net, compile_backend)
        net = StaticBatch(compiled, rows=rows)
    return network_call(net, precision)
