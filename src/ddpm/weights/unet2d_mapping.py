"""Our UNet's weights <-> diffusers' UNet2DModel's, tensor by tensor, and a UNet2DModel config back to our arguments.

No diffusers needed: the tables are written here from the two architectures (ddpm.models.unet and diffusers 0.42's
unet_2d.py / unet_2d_blocks.py), per module of our UNet (`module_table`), then per tensor (`tensor_table`):

    ours                                   UNet2DModel                                     how
    conv_in, norm_out, conv_out            conv_in, conv_norm_out, conv_out                copy
    time_embed.mlp.0 / .2                  time_embedding.linear_1 / linear_2              copy
    class_embed                            class_embedding                                 copy
    down.<i> = [ResBlock, Attention?]      down_blocks.<level>.resnets.<r>, .attentions.<r>
    down.<i> = [Downsample]                down_blocks.<level>.downsamplers.0
    mid.0, mid.1, mid.2                    mid_block.resnets.0, attentions.0, resnets.1
    up.<i> = [ResBlock, Attention?, Up?]   up_blocks.<j>.resnets.<r>, .attentions.<r>, .upsamplers.0 (j = 0 deepest)
    ResBlock norm1 conv1 emb norm2 conv2 skip    norm1 conv1 time_emb_proj norm2 conv2 conv_shortcut   copy
    Attention norm                         group_norm                                      copy
    Attention qkv (3C, C, 1, 1)            to_q, to_k, to_v (C, C) each: rows [0:C], [C:2C], [2C:3C]    split
    Attention proj (C, C, 1, 1)            to_out.0 (C, C)                                 squeeze

(our qkv output channel s * C + head * d + j is q/k/v s, head `head`, as diffusers' to_q output head * d + j).
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ddpm.models.diffusers_unet import UNET_DEFAULTS, NotUNet2D, unet2d_config

RESBLOCK = {"norm1": "norm1", "conv1": "conv1", "emb": "time_emb_proj", "norm2": "norm2", "conv2": "conv2"}
Row = tuple[str, tuple[str, ...], str]  # (our tensor, UNet2DModel tensors, how: copy | split | squeeze)


def module_table(arguments: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(our module, UNet2DModel module, kind) for the UNet of `arguments`; kind: layer | resblock[+skip] | attention."""
    a = {**UNET_DEFAULTS, **arguments}
    mult, base, nrb = list(a["channel_mult"]), a["base_channels"], a["num_res_blocks"]
    attention = [a["image_size"] // 2**level in a["attention_resolutions"] for level in range(len(mult))]
    rows = [("conv_in", "conv_in", "layer"), ("time_embed.mlp.0", "time_embedding.linear_1", "layer"),
            ("time_embed.mlp.2", "time_embedding.linear_2", "layer")]  # fmt: skip
    if a["num_classes"] is not None:
        rows.append(("class_embed", "class_embedding", "embedding"))

    def res(ours: str, theirs: str, cin: int, cout: int) -> None:
        rows.append((ours, theirs, "resblock+skip" if cin != cout else "resblock"))

    i, ch, skips = 0, base, [base]
    for level, m in enumerate(mult):
        for r in range(nrb):
            res(f"down.{i}.0", f"down_blocks.{level}.resnets.{r}", ch, base * m)
            ch = base * m
            if attention[level]:
                rows.append((f"down.{i}.1", f"down_blocks.{level}.attentions.{r}", "attention"))
            i, skips = i + 1, [*skips, ch]
        if level != len(mult) - 1:
            rows.append((f"down.{i}.0.conv", f"down_blocks.{level}.downsamplers.0.conv", "layer"))
            i, skips = i + 1, [*skips, ch]
    res("mid.0", "mid_block.resnets.0", ch, ch)
    rows.append(("mid.1", "mid_block.attentions.0", "attention"))
    res("mid.2", "mid_block.resnets.1", ch, ch)
    i = 0
    for j, level in enumerate(reversed(range(len(mult)))):
        for r in range(nrb + 1):
            res(f"up.{i}.0", f"up_blocks.{j}.resnets.{r}", ch + skips.pop(), base * mult[level])
            ch = base * mult[level]
            if attention[level]:
                rows.append((f"up.{i}.1", f"up_blocks.{j}.attentions.{r}", "attention"))
            if level != 0 and r == nrb:
                rows.append((f"up.{i}.{1 + attention[level]}.conv", f"up_blocks.{j}.upsamplers.0.conv", "layer"))
            i += 1
    return [*rows, ("norm_out", "conv_norm_out", "layer"), ("conv_out", "conv_out", "layer")]


def tensor_table(arguments: Mapping[str, Any]) -> list[Row]:
    """Every tensor of our UNet with the UNet2DModel tensors it becomes, and how."""
    rows: list[Row] = []
    for ours, theirs, kind in module_table(arguments):
        if kind == "embedding":
            rows.append((f"{ours}.weight", (f"{theirs}.weight",), "copy"))
            continue
        for p in ("weight", "bias"):
            if kind == "layer":
                rows.append((f"{ours}.{p}", (f"{theirs}.{p}",), "copy"))
            elif kind == "attention":
                rows += [
                    (f"{ours}.norm.{p}", (f"{theirs}.group_norm.{p}",), "copy"),
                    (f"{ours}.qkv.{p}", tuple(f"{theirs}.to_{s}.{p}" for s in "qkv"), "split"),
                    (f"{ours}.proj.{p}", (f"{theirs}.to_out.0.{p}",), "squeeze"),
                ]
            else:
                names = RESBLOCK | ({"skip": "conv_shortcut"} if kind == "resblock+skip" else {})
                rows += [(f"{ours}.{a}.{p}", (f"{theirs}.{b}.{p}",), "copy") for a, b in names.items()]
    return rows


def _check_keys(state: Mapping[str, Tensor], expected: set[str], what: str) -> None:
    if set(state) != expected:
        raise ValueError(
            f"{what} do not fit the architecture of their config (missing {sorted(expected - set(state))[:5]}, "
            f"unexpected {sorted(set(state) - expected)[:5]})"
        )


def to_unet2d_state(state: Mapping[str, Tensor], arguments: Mapping[str, Any]) -> dict[str, Tensor]:
    """Our UNet's state dict -> UNet2DModel's (every tensor mapped; a missing or extra key is an error)."""
    table = tensor_table(arguments)
    _check_keys(state, {ours for ours, _, _ in table}, "our UNet's weights")
    out: dict[str, Tensor] = {}
    for ours, theirs, how in table:
        value = state[ours].flatten(1) if state[ours].ndim == 4 and how != "copy" else state[ours]
        out |= dict(zip(theirs, value.chunk(3) if how == "split" else (value,), strict=True))
    return {k: v.contiguous() for k, v in out.items()}


def from_unet2d_state(state: Mapping[str, Tensor], arguments: Mapping[str, Any]) -> dict[str, Tensor]:
    """UNet2DModel's state dict -> our UNet's (the inverse of to_unet2d_state)."""
    table = tensor_table(arguments)
    _check_keys(state, {t for _, theirs, _ in table for t in theirs}, "the UNet2DModel weights")
    out = {}
    for ours, theirs, how in table:
        value = torch.cat([state[t] for t in theirs]) if how == "split" else state[theirs[0]]
        out[ours] = value[:, :, None, None] if how != "copy" and value.ndim == 2 else value
    return {k: v.contiguous() for k, v in out.items()}


FIXED = {  # UNet2DModel config values our UNet has (and nothing else)
    "center_input_sample": False, "time_embedding_type": "positional", "flip_sin_to_cos": True, "freq_shift": 0,
    "mid_block_type": "UNetMidBlock2D", "mid_block_scale_factor": 1, "downsample_padding": 1,
    "downsample_type": "conv", "upsample_type": "conv", "norm_eps": 1e-5, "add_attention": True,
    "class_embed_type": None,
}  # fmt: skip
FREE = {  # the other keys, with UNet2DModel's defaults (diffusers 0.42) for a config.json that leaves one out
    "sample_size": None, "in_channels": 3, "out_channels": 3, "layers_per_block": 2, "dropout": 0.0,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [224, 448, 672, 896], "act_fn": "silu", "attention_head_dim": 8, "norm_num_groups": 32,
    "attn_norm_num_groups": None, "resnet_time_scale_shift": "default", "num_class_embeds": None,
    "num_train_timesteps": None, "time_embedding_dim": None,
}  # fmt: skip


def arguments_from_unet2d(config: Mapping[str, Any]) -> dict[str, Any]:
    """Our UNet's arguments for a UNet2DModel config (its config.json); NotUNet2D naming every key outside the
    family our UNet expresses (module docstring of ddpm.models.diffusers_unet)."""
    c = {**FIXED, **FREE, **{k: v for k, v in config.items() if not k.startswith("_")}}
    bad = [f"{k}={c[k]!r} (ours: {v!r})" for k, v in FIXED.items() if c[k] != v]
    bad += [f"{k} (unknown to lightning-ddpm)" for k in sorted(set(c) - set(FIXED) - set(FREE))]
    down, up, widths = list(c["down_block_types"]), list(c["up_block_types"]), list(c["block_out_channels"])
    size, shift, groups = c["sample_size"], c["resnet_time_scale_shift"], c["norm_num_groups"]
    if c["act_fn"] not in ("silu", "swish"):
        bad.append(f"act_fn={c['act_fn']!r} (ours: silu)")
    if c["out_channels"] != c["in_channels"]:
        bad.append(f"out_channels={c['out_channels']} != in_channels={c['in_channels']}")
    if set(down) - {"DownBlock2D", "AttnDownBlock2D"} or set(up) - {"UpBlock2D", "AttnUpBlock2D"}:
        bad.append(f"down_block_types={down}, up_block_types={up} (ours: [Attn]DownBlock2D, [Attn]UpBlock2D)")
    attention = [t == "AttnDownBlock2D" for t in down]
    if not widths or len(down) != len(widths) or [t == "AttnUpBlock2D" for t in reversed(up)] != attention:
        bad.append(f"up_block_types={up} do not mirror down_block_types={down} over block_out_channels={widths}")
    if not isinstance(size, int):
        bad.append(f"sample_size={size!r} (ours: one int, H = W)")
    if widths and any(w % widths[0] for w in widths):
        bad.append(f"block_out_channels={widths} (ours: multiples of the first)")
    if shift not in ("default", "scale_shift"):
        bad.append(f"resnet_time_scale_shift={shift!r} (ours: default or scale_shift)")
    attn_groups = c["attn_norm_num_groups"]
    if attn_groups not in (groups, None) or (attn_groups is None and shift != "default"):
        bad.append(f"attn_norm_num_groups={attn_groups!r} with {shift} (ours: norm_num_groups={groups})")
    if c["num_class_embeds"] is not None and c["num_class_embeds"] < 2:
        bad.append(f"num_class_embeds={c['num_class_embeds']} (ours: classes + 1 null class, >= 2)")
    attended = sorted({w for w, on in zip(widths, attention, strict=False) if on} | set(widths[-1:]))
    head_dim = c["attention_head_dim"]
    heads = {w // head_dim for w in attended} if head_dim else {1}
    if head_dim and (len(heads) > 1 or any(w % head_dim for w in attended)):
        bad.append(f"attention_head_dim={head_dim} at the attention widths {attended} (ours: one number of heads)")
    if bad:
        raise NotUNet2D(f"a UNet2DModel outside what lightning-ddpm's UNet expresses: {'; '.join(bad)}")
    arguments = dict(
        in_channels=c["in_channels"], image_size=size, base_channels=widths[0],
        channel_mult=[w // widths[0] for w in widths], num_res_blocks=c["layers_per_block"],
        attention_resolutions=[size // 2**level for level, on in enumerate(attention) if on],
        num_heads=heads.pop(), dropout=c["dropout"],
        num_classes=None if c["num_class_embeds"] is None else c["num_class_embeds"] - 1,
        norm_groups=groups, scale_shift=shift == "scale_shift", emb_dim=c["time_embedding_dim"],
    )  # fmt: skip
    expected = unet2d_config(arguments)
    differ = [k for k in ("block_out_channels", "down_block_types", "up_block_types") if list(c[k]) != expected[k]]
    if differ:  # a round trip that does not come back: a bug here, not the folder's
        raise NotUNet2D(f"a UNet2DModel config that does not round-trip through our arguments ({differ})")
    return arguments
