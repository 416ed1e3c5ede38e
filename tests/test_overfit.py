"""A tiny UNet overfits a tiny real dataset: the fixed-noise loss falls by a stated factor."""

import pytest
import torch
from helpers import tiny_unet

from ddpm.data.sources import DigitsSource
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.models.unet import UNet

FACTOR = 5.0  # the fixed-noise loss must fall at least this many times (measured: ~20x)


def fixed_loss(net: UNet, diffusion: GaussianDiffusion, x0: torch.Tensor) -> float:
    """Mean eps-MSE over 8 fixed timesteps with fixed noise (what validation measures)."""
    generator = torch.Generator().manual_seed(123)
    losses = []
    with torch.no_grad():
        for t_value in torch.linspace(50, 999, 8).long():
            t = torch.full((len(x0),), int(t_value))
            noise = torch.randn(x0.shape, generator=generator)
            losses.append(diffusion.loss(net, x0, t, noise, None).item())
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_tiny_unet_overfits_16_real_digits() -> None:
    torch.manual_seed(0)
    data = DigitsSource().load(image_size=16, channels=1)
    x0 = data.images[:16].float() / 127.5 - 1.0  # (16, 1, 16, 16) real scikit-learn digits
    net = tiny_unet(image_size=16, base_channels=32, attention_resolutions=(8,), num_heads=1, norm_groups=8)
    diffusion = GaussianDiffusion(num_timesteps=1000)
    before = fixed_loss(net, diffusion, x0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for _ in range(100):
        t = diffusion.sample_timesteps(len(x0), x0.device)
        loss = diffusion.loss(net, x0, t, torch.randn_like(x0), None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = fixed_loss(net, diffusion, x0)
    assert after * FACTOR < before, f"loss {before:.3f} -> {after:.3f}, not {FACTOR}x lower"
