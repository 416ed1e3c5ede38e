"""Noise schedules, alpha_bar, respacing and GaussianDiffusion's buffers against numpy float64 truth."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ddpm.config.build import build
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.schedule import (
    alpha_bar_from_betas,
    betas_from_alpha_bar,
    cosine_betas,
    linear_betas,
    make_betas,
    respaced_timesteps,
)

FLOAT32_RTOL = 2.0**-23  # one float32 rounding is at most 2**-24 relative


def numpy_linear_betas(T: int) -> np.ndarray:
    """improved-diffusion's get_named_beta_schedule('linear', T)."""
    scale = 1000 / T
    return np.linspace(scale * 0.0001, scale * 0.02, T, dtype=np.float64)


def numpy_cosine_betas(T: int, s: float = 0.008) -> np.ndarray:
    """1 - alpha_bar(t+1)/alpha_bar(t), alpha_bar(t) = f(t)/f(0), f = cos^2(((t/T)+s)/(1+s) pi/2), clip 0.999."""

    def f(t: float) -> float:
        return math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2

    alpha_bar = [f(t) / f(0) for t in range(T + 1)]
    return np.array([min(1 - alpha_bar[t + 1] / alpha_bar[t], 0.999) for t in range(T)])


def improved_diffusion_space_timesteps(T: int, steps: int) -> list[int]:
    """improved-diffusion's space_timesteps(T, [steps]) for one section (accumulated float stride)."""
    stride = (T - 1) / (steps - 1)
    taken, cur = [], 0.0
    for _ in range(steps):
        taken.append(round(cur))
        cur += stride
    return taken


def test_linear_betas_at_1000():
    """Linear betas at T=1000 run from 1e-4 to 0.02 in equal float64 steps (Ho et al. 2020)."""
    betas = linear_betas(1000)
    assert betas.dtype == torch.float64 and betas.shape == (1000,)
    assert betas[0].item() == pytest.approx(1e-4, rel=1e-12)
    assert betas[-1].item() == pytest.approx(0.02, rel=1e-12)
    np.testing.assert_allclose(np.diff(betas.numpy()), (0.02 - 1e-4) / 999, rtol=1e-9)


@pytest.mark.parametrize("T", [1, 10, 250, 1000, 4000])
def test_linear_betas_scaled_by_1000_over_T(T):
    """For other T the endpoints are scaled by 1000/T (improved-diffusion's linear schedule)."""
    np.testing.assert_allclose(linear_betas(T).numpy(), numpy_linear_betas(T), rtol=1e-13, atol=0)


@pytest.mark.parametrize("T", [1, 50, 1000, 4000])
def test_cosine_betas_match_numpy(T):
    """Cosine betas equal a float64 recomputation of Nichol & Dhariwal eq. 17, clipped at 0.999."""
    betas = cosine_betas(T)
    assert betas.dtype == torch.float64
    np.testing.assert_allclose(betas.numpy(), numpy_cosine_betas(T), rtol=1e-10, atol=1e-15)
    assert betas.max().item() <= 0.999


def test_cosine_betas_clip_at_the_end():
    """The last cosine beta is exactly the clip value 0.999 (1 - alpha_bar(T)/alpha_bar(T-1) is ~1)."""
    assert cosine_betas(1000)[-1].item() == 0.999


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_alpha_bar_is_cumulative_product(schedule):
    """alpha_bar_t = prod_{s<=t} (1 - beta_s), written out as a loop over python floats."""
    betas = make_betas(schedule, 1000)
    expected, running = [], 1.0
    for beta in betas.tolist():
        running *= 1 - beta
        expected.append(running)
    np.testing.assert_allclose(alpha_bar_from_betas(betas).numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_betas_from_alpha_bar_inverts(schedule):
    """betas_from_alpha_bar(alpha_bar_from_betas(b)) == b in float64."""
    betas = make_betas(schedule, 1000)
    np.testing.assert_allclose(betas_from_alpha_bar(alpha_bar_from_betas(betas)).numpy(), betas.numpy(), rtol=1e-9)


def test_respaced_timesteps_match_improved_diffusion_for_usual_counts():
    """For the usual step counts the kept timesteps are exactly improved-diffusion's space_timesteps."""
    for steps in (2, 10, 25, 50, 100, 250, 500, 1000):
        got = respaced_timesteps(1000, steps).tolist()
        assert got == improved_diffusion_space_timesteps(1000, steps), steps


@pytest.mark.parametrize("T", [7, 50, 1000])
def test_respaced_timesteps_evenly_spaced(T):
    """Every S in 2..T: S distinct ascending timesteps, 0 and T-1 kept, each within 1 of improved-diffusion's."""
    for steps in range(2, T + 1):
        got = respaced_timesteps(T, steps)
        assert got.dtype == torch.int64 and len(got) == steps
        assert got[0] == 0 and got[-1] == T - 1
        assert bool((got.diff() > 0).all())
        reference = torch.tensor(improved_diffusion_space_timesteps(T, steps))
        # Only exact .5 ties can round the other way (i * stride vs an accumulated stride).
        assert int((got - reference).abs().max()) <= 1


def test_respaced_single_step_is_last_timestep():
    """One step must start at the noise level of x_T, i.e. timestep T-1."""
    assert respaced_timesteps(1000, 1).tolist() == [999]


@pytest.mark.parametrize("steps", [0, 1001])
def test_respaced_timesteps_out_of_range(steps):
    """S outside 1..T raises a ValueError naming steps and the model's T."""
    with pytest.raises(ValueError, match=rf"^steps={steps} must be between 1 and the model's T=1000"):
        respaced_timesteps(1000, steps)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [10, 50, 333])
def test_respaced_betas_keep_alpha_bar(schedule, steps):
    """improved-diffusion respacing: new betas from alpha_bar at the kept timesteps preserve alpha_bar there."""
    betas = make_betas(schedule, 1000).numpy()
    alpha_bar = np.cumprod(1 - betas)
    kept = respaced_timesteps(1000, steps).numpy()
    # improved-diffusion's SpacedDiffusion loop, written out.
    new_betas, last, use = [], 1.0, set(kept.tolist())
    for i, ab in enumerate(alpha_bar):
        if i in use:
            new_betas.append(1 - ab / last)
            last = ab
    respaced = betas_from_alpha_bar(torch.from_numpy(alpha_bar[kept]))
    np.testing.assert_allclose(respaced.numpy(), new_betas, rtol=1e-12)
    # The last cosine beta is ~1 - 1e-7, so 1 - beta keeps only ~9 digits: rtol 1e-8.
    np.testing.assert_allclose(alpha_bar_from_betas(respaced).numpy(), alpha_bar[kept], rtol=1e-8)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_gaussian_diffusion_buffers_float32_exact(schedule):
    """betas and alpha_bar buffers are float32, equal to the float64 truth up to one float32 rounding."""
    diffusion = GaussianDiffusion(num_timesteps=1000, schedule=schedule)
    betas64 = numpy_linear_betas(1000) if schedule == "linear" else numpy_cosine_betas(1000)
    alpha_bar64 = np.cumprod(1 - betas64)
    assert diffusion.betas.dtype == torch.float32 and diffusion.alpha_bar.dtype == torch.float32
    np.testing.assert_allclose(diffusion.betas.double().numpy(), betas64, rtol=FLOAT32_RTOL, atol=0)
    np.testing.assert_allclose(diffusion.alpha_bar.double().numpy(), alpha_bar64, rtol=FLOAT32_RTOL, atol=0)
    # A float32 cumulative product drifts much further than one rounding: the buffer is not that.
    drift = torch.cumprod(1 - torch.from_numpy(betas64).float(), 0).double().numpy() / alpha_bar64 - 1
    assert np.abs(drift).max() > FLOAT32_RTOL
    np.testing.assert_allclose(diffusion.betas64().numpy(), betas64, rtol=1e-10)


def test_unknown_schedule_raises():
    """An unknown schedule name raises a ValueError naming schedule and the known ones; built from a config node at
    `diffusion`, it names diffusion.schedule."""
    refusal = r"schedule='quadratic' is unknown; use one of \['cosine', 'linear'\]$"
    with pytest.raises(ValueError, match="^" + refusal):
        make_betas("quadratic", 1000)
    with pytest.raises(ValueError, match="^" + refusal):
        GaussianDiffusion(schedule="quadratic")
    with pytest.raises(ValueError, match=r"^diffusion\." + refusal):
        build(diffusion_node(schedule="quadratic"))


@pytest.mark.parametrize("T", [0, -5])
def test_nonpositive_T_raises(T):
    """T < 1 raises a ValueError naming num_timesteps; built from a config node at `diffusion`, it names
    diffusion.num_timesteps."""
    refusal = rf"num_timesteps={T} must be >= 1 \(1000 is the usual value\)$"
    with pytest.raises(ValueError, match="^" + refusal):
        make_betas("linear", T)
    with pytest.raises(ValueError, match="^" + refusal):
        GaussianDiffusion(num_timesteps=T)
    with pytest.raises(ValueError, match=r"^diffusion\." + refusal):
        build(diffusion_node(num_timesteps=T))


def diffusion_node(**arguments):
    """A `diffusion:` config node of GaussianDiffusion with `arguments`, as a run config holds it."""
    return OmegaConf.create(
        {"diffusion": {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", **arguments}}
    ).diffusion
