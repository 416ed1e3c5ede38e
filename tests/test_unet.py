"""The UNet presets (shape, parameter count), config validation and the sinusoidal timestep embedding."""

import math

import numpy as np
import pytest
import torch
from helpers import CONF, TINY_UNET, tiny_unet
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpm.config.build import build
from ddpm.models.layers import timestep_embedding

MODELS = CONF / "model"
PRESETS = sorted(p.stem for p in MODELS.glob("*.yaml") if not p.stem.startswith("vae_"))  # vae_*: autoencoders
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
    ("overrides", "refusal"),
    [
        ({"norm_groups": 32}, r"GroupNorm with norm_groups=32 does not divide the widths \[16\]"),  # divides 32 only
        ({"base_channels": 12, "norm_groups": 8}, r"GroupNorm with norm_groups=8 does not divide the widths \[12\]"),
        ({"image_size": 17}, r"image_size=17 is not divisible by 2 \(2\*\*1 downsamplings\)"),
        ({"image_size": 18, "channel_mult": (1, 2, 2)}, r"image_size=18 is not divisible by 4 \(2\*\*2 "),
        ({"attention_resolutions": (4,)}, r"attention_resolutions=\[4\] has \[4\], which never occur; .* at \[16, 8\]"),
        ({"attention_resolutions": (8, 32)}, r"attention_resolutions=\[8, 32\] has \[32\], which never occur"),
        ({"num_heads": 3}, r"num_heads=3 does not divide the widths with attention \[32\]"),
        (
            {"num_heads": 32, "attention_resolutions": (16,)},
            r"num_heads=32 does not divide the widths with attention \[16\]",
        ),
        ({"num_res_blocks": 0}, r"num_res_blocks=0 must be an integer >= 1"),  # built a network without the deepest
        ({"channel_mult": ()}, r"channel_mult=\[\] needs at least one entry"),
        ({"num_classes": 0}, r"num_classes=0 must be >= 1, or null"),
        ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
    ],
)
def test_invalid_arguments_are_refused_in_the_unets_own_words(overrides, refusal):
    """UNet(...) refuses each invalid configuration naming its argument and what is wrong (no Hydra key: the UNet
    does not know it is `model`)."""
    with pytest.raises(ValueError, match=f"^{refusal}"):
        tiny_unet(**(SIZE_16 | overrides))


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        ({"image_size": 18, "channel_mult": [1, 2, 2]}, r"model\.image_size=18 is not divisible by 4"),
        ({"num_heads": 3}, r"model\.num_heads=3 does not divide the widths with attention \[32\]"),
        (
            {"attention_resolutions": [4]},
            r"model\.attention_resolutions=\[4\] has \[4\], which never occur; .* "
            r"for model\.image_size=16",
        ),
        (
            {"norm_groups": 32},
            r"GroupNorm with model\.norm_groups=32 does not divide the widths \[16\] "
            r"\(model\.base_channels=16 x model\.channel_mult=\[1, 2\]\)",
        ),
    ],
)
def test_invalid_config_names_key(overrides, refusal):
    """Built from a run config's `model:` node (as train.py builds it), the refusal names the model.* keys to change."""
    cfg = OmegaConf.create({"model": {"_target_": "ddpm.models.unet.UNet", **TINY_UNET, **SIZE_16, **overrides}})
    with pytest.raises(ValueError, match=f"^{refusal}"):
        build(cfg.model)


def test_num_heads_need_divide_only_the_widths_with_attention():
    """Heads split the attention layers' widths only: 32 heads with attention at 8x8 (width 32) and none at 16x16
    (width 16) build; they were refused, and with them a folder diffusers saved (widths [16, 48], 3 heads)."""
    net = tiny_unet(**(SIZE_16 | {"num_heads": 32}))
    assert all(m.num_heads == 32 for m in net.modules() if type(m).__name__ == "Attention")


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
