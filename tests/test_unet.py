"""The UNet presets (shape, parameter count), config validation and the sinusoidal timestep embedding."""

import math

import numpy as np
import pytest
import torch
from helpers import CONF, tiny_unet
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpm.models.layers import timestep_embedding

MODELS = CONF / "model"
PRESETS = sorted(p.stem for p in MODELS.glob("*.yaml"))
LARGE = {"ddpm_cifar10", "unet64"}

SIZE_16 = dict(image_size=16, attention_resolutions=(8,))  # the tiny UNet at 16x16: levels at 16 and 8, widths 16, 32


def load_preset(name: str, **overrides):
    cfg = OmegaConf.load(MODELS / f"{name}.yaml")
    for key, value in overrides.items():
        cfg[key] = value
    return instantiate(cfg)


def test_presets_found():
    """All four model presets are present (the parametrized tests below run on each)."""
    assert {"ddpm_cifar10", "unet64", "unet_mnist", "unet_tiny"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("num_classes", [None, 10])
def test_preset_output_shape(name, num_classes, request):
    """Every preset maps (B, C, H, W) to (B, C, H, W), unconditional and class-conditional."""
    torch.manual_seed(0)
    if name == "ddpm_cifar10" and num_classes is None:
        net = request.getfixturevalue("ddpm_cifar10").eval()  # built once for this module
    else:
        net = load_preset(name, num_classes=num_classes).eval()
    batch = 1 if name in LARGE else 2
    x = torch.randn(batch, net.in_channels, net.image_size, net.image_size)
    t = torch.randint(0, 1000, (batch,))
    y = None if num_classes is None else torch.randint(0, num_classes, (batch,))
    with torch.no_grad():
        out = net(x, t, y)
    assert out.shape == x.shape and out.dtype == torch.float32


def test_ddpm_cifar10_parameter_count(ddpm_cifar10):
    """The DDPM CIFAR-10 preset has 35.7M parameters within 1% (Ho et al. 2020, appendix B)."""
    count = sum(p.numel() for p in ddpm_cifar10.parameters())
    assert abs(count - 35.7e6) / 35.7e6 < 0.01, count


def test_conditional_null_class_and_labels_matter():
    """y=None means the null class (index num_classes); different labels give different outputs."""
    torch.manual_seed(0)
    net = tiny_unet(**SIZE_16, num_classes=3).eval()
    with torch.no_grad():
        for p in net.parameters():  # undo the zero init of output layers so the output depends on y
            p.add_(0.05 * torch.randn_like(p))
        x, t = torch.randn(2, 1, 16, 16), torch.tensor([10, 500])
        null = net(x, t, torch.full((2,), 3))
        assert torch.equal(net(x, t, None), null)
        assert not torch.allclose(net(x, t, torch.tensor([0, 0])), net(x, t, torch.tensor([1, 1])))


def test_zero_init_outputs_zero():
    """Output layers start at zero, so the fresh UNet outputs exactly 0 (every block starts as the identity)."""
    net = tiny_unet(**SIZE_16).eval()
    with torch.no_grad():
        assert bool((net(torch.randn(2, 1, 16, 16), torch.tensor([0, 999])) == 0).all())


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"norm_groups": 32}, "model.norm_groups"),  # 32 does not divide 16
        ({"base_channels": 12, "norm_groups": 8}, "model.norm_groups"),
        ({"image_size": 18}, "model.image_size"),  # 18 not divisible by 2
        ({"image_size": 20, "channel_mult": (1, 2, 2)}, "model.image_size"),  # 20 not divisible by 4
        ({"attention_resolutions": (4,)}, "model.attention_resolutions"),  # runs at 16 and 8 only
        ({"attention_resolutions": (8, 32)}, "model.attention_resolutions"),
        ({"num_heads": 3}, "model.num_heads"),  # 3 does not divide 16 or 32
        ({"num_heads": 32}, "model.num_heads"),  # divides 32 but not 16
        ({"channel_mult": ()}, "model.channel_mult"),
        ({"num_classes": 0}, "model.num_classes"),
        ({"dropout": 1.0}, "model.dropout"),
    ],
)
def test_invalid_config_names_key(overrides, key):
    """Each invalid UNet config raises ValueError whose message names the model.* key to change."""
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        tiny_unet(**(SIZE_16 | overrides))


def test_validation_accepts_boundary_config():
    """A config that just fits (heads = smallest width, attention at the lowest resolution) builds and runs."""
    net = tiny_unet(**(SIZE_16 | {"num_heads": 16, "attention_resolutions": (16, 8)}))
    with torch.no_grad():
        assert net(torch.randn(1, 1, 16, 16), torch.tensor([3])).shape == (1, 1, 16, 16)


@pytest.mark.parametrize("dim", [8, 7, 128])
def test_timestep_embedding_formula(dim):
    """emb[:, i] = cos(t 10000^(-i/h)), emb[:, h+i] = sin(t 10000^(-i/h)), h = dim//2; odd dim padded with 0."""
    t = torch.tensor([0, 1, 10, 500, 999])
    half = dim // 2
    expected = np.zeros((len(t), dim))
    for row, step in enumerate(t.tolist()):
        for i in range(half):
            freq = 10_000.0 ** (-i / half)
            expected[row, i] = math.cos(step * freq)
            expected[row, half + i] = math.sin(step * freq)
    emb = timestep_embedding(t, dim)
    assert emb.shape == (len(t), dim) and emb.dtype == torch.float32
    # float32 arguments up to 999 rad carry ~6e-5 absolute error.
    np.testing.assert_allclose(emb.double().numpy(), expected, atol=2e-4)
