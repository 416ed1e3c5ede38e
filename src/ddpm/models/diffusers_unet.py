"""diffusers' UNet2DModel as our network: `unet2d_config` says which UNet2DModel is our UNet, `DiffusersUNet2D`
wraps one behind our UNet's interface (`forward(x, t, y)`, in_channels, image_size, num_classes).

Our UNet (Ho et al. 2020 with FiLM, attention and a null class) is the family diffusers' UNet2DModel holds:

    our UNet argument              UNet2DModel config
    image_size, in_channels        sample_size, in_channels = out_channels
    base_channels x channel_mult   block_out_channels
    num_res_blocks                 layers_per_block (the up path has one more: both)
    attention_resolutions          AttnDownBlock2D / AttnUpBlock2D at those levels, else DownBlock2D / UpBlock2D;
                                   mid block UNetMidBlock2D (ResBlock, attention, ResBlock), add_attention=True
    num_heads                      attention_head_dim: None for 1 head (heads = 1 at every width), else
                                   width // num_heads, which must be the same at every attention width
    norm_groups                    norm_num_groups and attn_norm_num_groups (the mid attention's GroupNorm;
                                   diffusers drops it under scale_shift unless set); norm_eps = 1e-5 (GroupNorm's)
    scale_shift                    resnet_time_scale_shift "scale_shift" (FiLM), else "default" (added)
    emb_dim                        time_embedding_dim (None: 4 x base_channels in both)
    num_classes                    num_class_embeds = num_classes + 1 (the last label is the null class)
    dropout                        dropout
    [cos | sin] embedding          time_embedding_type "positional", flip_sin_to_cos=True, freq_shift=0: diffusers
                                   divides the frequency exponent by (half - freq_shift), ours by half
    strided conv / nearest + conv  downsample_type "conv" (padding 1), upsample_type "conv"

Not expressible (`NotUNet2D` names which): a level that does not halve (`downsample` with a false entry:
UNet2DModel halves after every level but the last; seed_mnist), num_heads > 1 where the attention widths differ
(UNet2DModel has one head width, ours one head count; unet64, seed_mnist), and channel_mult[0] != 1 (UNet2DModel's
conv_in and time features are as wide as its first level; ours base_channels).
"""

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ddpm.models.unet import UNet, _validate

DIFFUSERS_EXTRA = "pip install -e '.[diffusers]'"  # what to run where diffusers is missing
UNET_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(UNet).parameters.items()
    if p.default is not inspect.Parameter.empty
}


class NotUNet2D(ValueError):
    """A configuration of our UNet that diffusers' UNet2DModel cannot express."""


def unet2d_config(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The UNet2DModel config of the UNet with constructor `arguments` (missing ones: UNet's defaults).

    Raises NotUNet2D naming what UNet2DModel cannot express."""
    a = {**UNET_DEFAULTS, **arguments}
    mult, base, size = list(a["channel_mult"]), a["base_channels"], a["image_size"]
    if a.get("downsample") is not None and not all(a["downsample"]):
        raise NotUNet2D(
            f"downsample={list(a['downsample'])}: UNet2DModel halves the size after every level but the last"
        )
    if mult[0] != 1:
        raise NotUNet2D(
            f"channel_mult={mult} starts at {mult[0]}, not 1: UNet2DModel's conv_in and time features are as "
            "wide as its first level"
        )
    widths = [base * m for m in mult]
    attention = [size // 2**level in a["attention_resolutions"] for level in range(len(mult))]
    head_dim = None  # diffusers: one head of the block's width
    if a["num_heads"] > 1:
        attended = sorted({w for w, on in zip(widths, attention, strict=True) if on} | {widths[-1]})  # + the middle
        if len(attended) > 1:
            raise NotUNet2D(
                f"num_heads={a['num_heads']} at the attention widths {attended} (the middle included) gives "
                f"head widths {[w // a['num_heads'] for w in attended]}; UNet2DModel has one attention_head_dim"
            )
        head_dim = attended[0] // a["num_heads"]
    num_classes = a["num_classes"]
    return dict(
        sample_size=size, in_channels=a["in_channels"], out_channels=a["in_channels"],
        center_input_sample=False, time_embedding_type="positional", time_embedding_dim=a["emb_dim"],
        flip_sin_to_cos=True, freq_shift=0,
        down_block_types=["AttnDownBlock2D" if on else "DownBlock2D" for on in attention],
        mid_block_type="UNetMidBlock2D",
        up_block_types=["AttnUpBlock2D" if on else "UpBlock2D" for on in reversed(attention)],
        block_out_channels=widths, layers_per_block=a["num_res_blocks"], mid_block_scale_factor=1,
        downsample_padding=1, downsample_type="conv", upsample_type="conv", dropout=a["dropout"], act_fn="silu",
        attention_head_dim=head_dim, norm_num_groups=a["norm_groups"], attn_norm_num_groups=a["norm_groups"],
        norm_eps=1e-5, resnet_time_scale_shift="scale_shift" if a["scale_shift"] else "default", add_attention=True,
        class_embed_type=None, num_class_embeds=None if num_classes is None else num_classes + 1,
    )  # fmt: skip


def import_unet2d() -> type:
    """diffusers' UNet2DModel, or an ImportError that says which extra to install."""
    try:
        from diffusers import UNet2DModel
    except ImportError as error:
        raise ImportError(f"diffusers is not installed; {DIFFUSERS_EXTRA}") from error
    return UNet2DModel


def zero_init_residual_outputs(unet: nn.Module) -> None:
    """Zero the last layer of every residual branch and the output conv, as our UNet does (every block starts
    as the identity and the output at 0)."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    for module in unet.modules():
        last = module.conv2 if isinstance(module, ResnetBlock2D) else None
        last = module.to_out[0] if isinstance(module, Attention) else last
        if last is not None:
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
    nn.init.zeros_(unet.conv_out.weight)
    nn.init.zeros_(unet.conv_out.bias)


class DiffusersUNet2D(nn.Module):
    """diffusers' UNet2DModel (`self.unet`; weights `unet.<UNet2DModel key>`) with our UNet's interface and
    arguments, initialised as our UNet (zeroed residual outputs). Needs diffusers (imported when built)."""

    def __init__(
        self,
        *,
        in_channels: int = 3,  # image channels (1 grey, 3 RGB); the output has as many
        image_size: int = 32,  # H = W of the images the model sees
        base_channels: int = 128,  # width of the first level
        channel_mult: Sequence[int] = (1, 2, 2, 2),  # width multiplier per level; len - 1 downsamplings
        num_res_blocks: int = 2,  # ResBlocks per level on the down path (the up path has one more)
        attention_resolutions: Sequence[int] = (16,),  # feature-map sizes that get self-attention
        num_heads: int = 1,  # attention heads (> 1: the same head width at every attention width and the middle)
        dropout: float = 0.1,  # dropout inside ResBlocks
        num_classes: int | None = None,  # classes for conditioning (+1 learned null class); None: unconditional
        norm_groups: int = 32,  # GroupNorm groups
        scale_shift: bool = False,  # FiLM scale-shift conditioning instead of addition
        emb_dim: int | None = None,  # width of the time(+class) embedding; None: 4 * base_channels
        checkpoint_activations: bool = False,  # diffusers' gradient checkpointing (less memory, slower)
    ) -> None:
        super().__init__()
        arguments = dict(
            in_channels=in_channels, image_size=image_size, base_channels=base_channels, channel_mult=channel_mult,
            num_res_blocks=num_res_blocks, attention_resolutions=attention_resolutions, num_heads=num_heads,
            dropout=dropout, num_classes=num_classes, norm_groups=norm_groups, scale_shift=scale_shift,
            emb_dim=emb_dim,
        )  # fmt: skip
        _validate(
            image_size=image_size, base_channels=base_channels, channel_mult=channel_mult, num_heads=num_heads,
            attention_resolutions=attention_resolutions, groups=norm_groups, num_classes=num_classes,
            dropout=dropout, downsample=[True] * (len(channel_mult) - 1), num_res_blocks=num_res_blocks,
        )  # fmt: skip
        self.unet = import_unet2d()(**unet2d_config(arguments))
        zero_init_residual_outputs(self.unet)
        if checkpoint_activations:
            self.unet.enable_gradient_checkpointing()
        self.in_channels, self.image_size, self.num_classes = in_channels, image_size, num_classes

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        """x (B, C, H, W); t (B,) int64; y (B,) int64 or None (the null class num_classes) -> (B, C, H, W)."""
        if self.num_classes is None:
            y = None  # as our UNet: an unconditional model ignores labels
        elif y is None:
            y = torch.full_like(t, self.num_classes, dtype=torch.long)
        return self.unet(x, t, class_labels=y, return_dict=False)[0]
