"""The DDPM UNet (Ho et al. 2020, appendix B), with class conditioning for classifier-free guidance.

forward(x: (B, C, H, W) float, t: (B,) int64 in 0..T-1, y: (B,) int64 or None) -> (B, C, H, W).
Knows nothing of diffusion: it maps (x_t, t, y) to an output of the shape of x.
"""

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ddpm.models.layers import Attention, Downsample, ResBlock, TimeEmbedding, Upsample


def _validate(
    *,
    image_size: int,
    base_channels: int,
    channel_mult: Sequence[int],
    attention_resolutions: Sequence[int],
    num_heads: int,
    groups: int,
    num_classes: int | None,
    dropout: float,
    downsample: Sequence[bool],
    num_res_blocks: int,
) -> None:
    """Reject configurations that cannot build or cannot run, naming the value to change."""
    if not isinstance(num_res_blocks, int) or num_res_blocks < 1:  # 0 never reached the deeper widths
        raise ValueError(f"num_res_blocks={num_res_blocks} must be an integer >= 1 (ResBlocks per level)")
    if not channel_mult or min(channel_mult) < 1:
        raise ValueError(f"channel_mult={list(channel_mult)} needs at least one entry, all >= 1")
    if len(downsample) != len(channel_mult) - 1:
        raise ValueError(
            f"downsample={list(downsample)} needs one entry per level transition "
            f"({len(channel_mult) - 1} for channel_mult={list(channel_mult)}), or null for all true"
        )
    factor = 2 ** sum(downsample)
    if image_size % factor:
        raise ValueError(
            f"image_size={image_size} is not divisible by {factor} (2**{sum(downsample)} "
            f"downsamplings); use a multiple of {factor} or fewer entries in channel_mult"
        )
    widths = sorted({base_channels * m for m in channel_mult})
    bad = [w for w in widths if w % groups]
    if bad:
        raise ValueError(
            f"GroupNorm with norm_groups={groups} does not divide the widths {bad} "
            f"(base_channels={base_channels} x channel_mult={list(channel_mult)}); "
            f"use a base_channels that is a multiple of {groups} or change norm_groups"
        )
    resolutions = [image_size // 2 ** sum(downsample[:i]) for i in range(len(channel_mult))]
    missing = sorted(set(attention_resolutions) - set(resolutions))
    if missing:
        raise ValueError(
            f"attention_resolutions={list(attention_resolutions)} has {missing}, which never occur; the UNet runs at "
            f"{resolutions} for image_size={image_size}; pick attention resolutions among those"
        )
    attended = {base_channels * m for m, r in zip(channel_mult, resolutions, strict=True) if r in attention_resolutions}
    bad_heads = sorted(w for w in attended | {base_channels * channel_mult[-1]} if w % num_heads)  # + the middle's
    if bad_heads:
        raise ValueError(f"num_heads={num_heads} does not divide the widths with attention {bad_heads}; use a divisor")
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"num_classes={num_classes} must be >= 1, or null for an unconditional model")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be in [0, 1)")


class UNet(nn.Module):
    """Noise-prediction UNet: ResBlocks with time (and class) embedding, attention at chosen resolutions,
    skip connections from the down path to the up path."""

    def __init__(
        self,
        *,
        in_channels: int = 3,  # image channels (1 grey, 3 RGB); the output has as many
        image_size: int = 32,  # H = W of the images the model sees
        base_channels: int = 128,  # width of the first level
        channel_mult: Sequence[int] = (1, 2, 2, 2),  # width multiplier per level; len - 1 downsamplings
        num_res_blocks: int = 2,  # ResBlocks per level on the down path (the up path has one more)
        attention_resolutions: Sequence[int] = (16,),  # feature-map sizes that get self-attention
        num_heads: int = 1,  # attention heads
        dropout: float = 0.1,  # dropout inside ResBlocks
        num_classes: int | None = None,  # classes for conditioning (+1 learned null class); None: unconditional
        norm_groups: int = 32,  # GroupNorm groups
        scale_shift: bool = False,  # FiLM scale-shift conditioning instead of addition
        emb_dim: int | None = None,  # width of the time(+class) embedding; None: 4 * base_channels
        downsample: Sequence[bool] | None = None,  # per level transition: halve the size? None: all true
        checkpoint_activations: bool = False,  # recompute ResBlocks in backward (less memory, ~30% slower)
    ) -> None:
        super().__init__()
        _validate(
            image_size=image_size,
            base_channels=base_channels,
            channel_mult=channel_mult,
            attention_resolutions=attention_resolutions,
            num_heads=num_heads,
            groups=norm_groups,
            num_classes=num_classes,
            dropout=dropout,
            downsample=[True] * (len(channel_mult) - 1) if downsample is None else list(downsample),
            num_res_blocks=num_res_blocks,
        )
        halve = [True] * (len(channel_mult) - 1) if downsample is None else [bool(d) for d in downsample]
        self.checkpoint_activations = checkpoint_activations
        self.in_channels, self.image_size, self.num_classes = in_channels, image_size, num_classes
        emb_dim = emb_dim or 4 * base_channels
        self.time_embed = TimeEmbedding(base_dim=base_channels, emb_dim=emb_dim)
        self.class_embed = nn.Embedding(num_classes + 1, emb_dim) if num_classes is not None else None

        def res(cin: int, cout: int) -> ResBlock:
            return ResBlock(
                in_channels=cin, out_channels=cout, emb_dim=emb_dim, dropout=dropout,
                groups=norm_groups, scale_shift=scale_shift,
            )  # fmt: skip

        def attn(channels: int) -> Attention:
            return Attention(channels=channels, num_heads=num_heads, groups=norm_groups)

        self.conv_in = nn.Conv2d(in_channels, base_channels, 3, padding=1)
        self.down = nn.ModuleList()
        skips, ch, size = [base_channels], base_channels, image_size
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                block = nn.ModuleList([res(ch, base_channels * mult)])
                ch = base_channels * mult
                if size in attention_resolutions:
                    block.append(attn(ch))
                self.down.append(block)
                skips.append(ch)
            if level != len(channel_mult) - 1 and halve[level]:
                self.down.append(nn.ModuleList([Downsample(channels=ch)]))
                skips.append(ch)
                size //= 2
        self.mid = nn.ModuleList([res(ch, ch), attn(ch), res(ch, ch)])
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(channel_mult))):
            # One more block than the down path where that level began with a Downsample (or conv_in).
            for i in range(num_res_blocks + int(level == 0 or halve[level - 1])):
                block = nn.ModuleList([res(ch + skips.pop(), base_channels * mult)])
                ch = base_channels * mult
                if size in attention_resolutions:
                    block.append(attn(ch))
                if level != 0 and i == num_res_blocks and halve[level - 1]:
                    block.append(Upsample(channels=ch))
                    size *= 2
                self.up.append(block)
        self.norm_out = nn.GroupNorm(norm_groups, ch)
        self.conv_out = nn.Conv2d(ch, in_channels, 3, padding=1)
        self._zero_init_outputs()

    def _zero_init_outputs(self) -> None:
        """Zero the last conv of every residual branch and of the output (Ho et al. 2020 init the
        same layers at ~1e-10 scale), so every block starts as the identity."""
        for module in self.modules():
            if isinstance(module, ResBlock):
                last = module.conv2
            elif isinstance(module, Attention):
                last = module.proj
            else:
                continue
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def embed(self, t: Tensor, y: Tensor | None) -> Tensor:
        """Time embedding plus class embedding (null class when y is None): (B, emb_dim)."""
        emb = self.time_embed(t)
        if self.class_embed is not None:
            if y is None:
                y = torch.full_like(t, self.num_classes, dtype=torch.long)
            emb = emb + self.class_embed(y)
        return emb

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        emb = self.embed(t, y)
        remat = self.checkpoint_activations and self.training and torch.is_grad_enabled()
        h = self.conv_in(x)
        skips = [h]
        for block in self.down:
            h = _run(block, h, emb, remat)
            skips.append(h)
        h = _run(self.mid, h, emb, remat)
        for block in self.up:
            h = _run(block, torch.cat([h, skips.pop()], dim=1), emb, remat)
        return self.conv_out(F.silu(self.norm_out(h)))


def _run(layers: nn.ModuleList, h: Tensor, emb: Tensor, remat: bool = False) -> Tensor:
    """Apply a block's layers in order; ResBlocks also take the embedding (recomputed in backward if remat)."""
    for layer in layers:
        if isinstance(layer, ResBlock):
            h = checkpoint(layer, h, emb, use_reentrant=False) if remat else layer(h, emb)
        else:
            h = layer(h)
    return h
