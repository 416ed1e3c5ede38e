"""Self-attention: equal to softmax(q k^T / sqrt(d)) v written out by hand, and no (HW x HW) map kept for backward."""

import math

import pytest
import torch
from torch.nn import functional as F

from ddpm.models.layers import Attention


def reference_attention(layer: Attention, x: torch.Tensor) -> torch.Tensor:
    """x + proj(concat_h softmax(q_h k_h^T / sqrt(d)) v_h), from the layer's weights, position by position."""
    b, c, h, w = x.shape
    heads, d = layer.num_heads, c // layer.num_heads
    normed = F.group_norm(x, layer.norm.num_groups, layer.norm.weight, layer.norm.bias, layer.norm.eps)
    tokens = normed.flatten(2).transpose(1, 2)  # (B, HW, C)
    qkv = tokens @ layer.qkv.weight[:, :, 0, 0].T + layer.qkv.bias  # (B, HW, 3C): [q | k | v]
    q, k, v = qkv.split(c, dim=-1)
    outs = []
    for head in range(heads):
        part = slice(head * d, (head + 1) * d)
        scores = q[..., part] @ k[..., part].transpose(1, 2) / math.sqrt(d)  # (B, HW, HW)
        outs.append(scores.softmax(dim=-1) @ v[..., part])  # (B, HW, d)
    out = torch.cat(outs, dim=-1) @ layer.proj.weight[:, :, 0, 0].T + layer.proj.bias  # (B, HW, C)
    return x + out.transpose(1, 2).reshape(b, c, h, w)


@pytest.mark.parametrize("num_heads", [1, 4])
def test_attention_matches_the_softmax_formula(num_heads: int):
    """Attention (SDPA) equals the hand-written formula in float64, for one and for four heads."""
    torch.manual_seed(0)
    layer = Attention(channels=32, num_heads=num_heads, groups=8).double()
    for p in layer.parameters():  # non-trivial weights everywhere (the UNet zero-inits proj)
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 32, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(x), reference_attention(layer, x))


def test_attention_keeps_no_attention_map_for_backward():
    """The tensors saved for backward are O(HW): none has the (HW, HW) shape of an attention matrix."""
    torch.manual_seed(0)
    layer = Attention(channels=16, num_heads=2, groups=4)
    x = torch.randn(2, 16, 12, 12, requires_grad=True)
    hw = 12 * 12
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    assert shapes, "nothing was saved for backward"
    assert not [s for s in shapes if len(s) >= 2 and s[-2:] == (hw, hw)], shapes
