"""UNet building blocks (Ho et al. 2020, appendix B; Nichol & Dhariwal 2021). Plain torch.

Feature maps are (B, C, H, W); the time embedding `emb` is (B, E).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10_000.0) -> Tensor:
    """Sinusoidal embedding of (B,) timesteps -> (B, dim), [cos | sin] (Vaswani et al. 2017)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(embedding, (0, dim % 2))


class TimeEmbedding(nn.Module):
    """Sinusoidal features -> Linear -> SiLU -> Linear: (B,) timesteps to (B, emb_dim)."""

    def __init__(self, *, base_dim: int, emb_dim: int) -> None:
        super().__init__()
        self.base_dim = base_dim
        self.mlp = nn.Sequential(nn.Linear(base_dim, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(timestep_embedding(t, self.base_dim))


class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> Conv3x3, + time embedding (added, or FiLM scale-shift), GroupNorm -> SiLU ->
    dropout -> Conv3x3, plus a 1x1 skip when widths differ."""

    def __init__(
        self,
        *,
        in_channels: int,
        out_channels: int,
        emb_dim: int,  # width of the time(+class) embedding
        dropout: float = 0.0,
        groups: int = 32,  # GroupNorm groups
        scale_shift: bool = False,  # FiLM: h = norm(h) * (1 + scale) + shift (Nichol & Dhariwal 2021)
    ) -> None:
        super().__init__()
        self.scale_shift = scale_shift
        self.norm1 = nn.GroupNorm(groups, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.emb = nn.Linear(emb_dim, out_channels * (2 if scale_shift else 1))
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        e = self.emb(F.silu(emb))[:, :, None, None]
        if self.scale_shift:
            scale, shift = e.chunk(2, dim=1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h + e)
        h = self.conv2(self.dropout(F.silu(h)))
        return self.skip(x) + h


class Attention(nn.Module):
    """Multi-head self-attention over the H*W positions, residual; softmax(q k^T / sqrt(d)) v through
    `scaled_dot_product_attention` (flash / memory-efficient kernels where available)."""

    def __init__(self, *, channels: int, num_heads: int = 1, groups: int = 32) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        heads, d = self.num_heads, c // self.num_heads
        qkv = self.qkv(self.norm(x))  # (B, 3C, H, W); channel (i, head, j) = i C + head d + j
        # Fused SDPA kernels need stride 1 on d, else SDPA falls back to the math path, which materialises the
        # (HW x HW) attention map.
        if channels_last(x):  # NHWC: q, k, v are views with stride 1 on d, and the output stays NHWC for proj
            q, k, v = qkv.permute(0, 2, 3, 1).reshape(b, h * w, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
            out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, HW, d)
            return x + self.proj(out.transpose(1, 2).reshape(b, h, w, c).permute(0, 3, 1, 2))
        qkv = qkv.reshape(b, 3, heads, d, h * w)
        q, k, v = qkv.transpose(-1, -2).contiguous().unbind(dim=1)  # each (B, heads, HW, d)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, HW, d)
        return x + self.proj(out.transpose(-1, -2).reshape(b, c, h, w))


def channels_last(x: Tensor) -> bool:
    """Whether (B, C, H, W) `x` is laid out NHWC (and not also NCHW, as when C or H * W is 1)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


class Downsample(nn.Module):
    """Strided 3x3 convolution: (B, C, H, W) -> (B, C, H/2, W/2)."""

    def __init__(self, *, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour x2 then 3x3 convolution: (B, C, H, W) -> (B, C, 2H, 2W)."""

    def __init__(self, *, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
