"""Ancestral DDPM sampling with an oracle network, seeding, NFE counting and classifier-free guidance."""

import itertools

import numpy as np
import pytest
import torch
from helpers import CONF, denoiser
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpm.config.build import build
from ddpm.diffusion.denoiser import Denoised, Guided, Levels
from ddpm.diffusion.generate import generate
from ddpm.diffusion.samplers.base import decoded
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.schedule import alpha_bar_from_betas, linear_betas, make_betas

T = 1000


def oracle(x0: torch.Tensor, betas: torch.Tensor, inputs: list | None = None):
    """The exact eps for data that is always x0: eps(x_t, t) = (x_t - sqrt(ab_t) x0) / sqrt(1 - ab_t)."""
    alpha_bar = np.cumprod(1 - betas.double().numpy())  # float64, computed here

    def net(x_t, t, y):
        if inputs is not None:
            inputs.append((int(t[0]), x_t.clone()))
        a = torch.from_numpy(alpha_bar)[t].view(-1, 1, 1, 1)
        return ((x_t.double() - a.sqrt() * x0.double()) / (1 - a).sqrt()).float()

    return net


def fixed_image(batch: int = 2, size: int = 4) -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.rand(1, 1, size, size) * 1.8 - 0.9).expand(batch, 1, size, size)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [None, 100, 10, 2])
def test_oracle_sampling_returns_x0(schedule, steps):
    """With the exact eps of a point-mass data set, sampling on all T or respaced steps returns x0."""
    betas = make_betas(schedule, T)
    x0 = fixed_image()
    d = denoiser(oracle(x0, betas), betas)
    generator = torch.Generator().manual_seed(1)
    x_T = torch.randn(x0.shape, generator=generator)
    out = DDPMSampler(steps=steps).sample(d, x_T, d.sigmas, None, generator=generator)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-4)
    assert d.calls == (steps or T)


@pytest.mark.parametrize("steps", [None, 50])
def test_oracle_chain_marginals(steps):
    """Started at x_T ~ q(x_T | x0), the fixed_small chain with the oracle has marginals N(sqrt(ab_t) x0, 1 - ab_t)."""
    betas = make_betas("linear", T)
    alpha_bar = np.cumprod(1 - betas.numpy())
    x0 = torch.full((4, 1, 64, 64), 0.5)  # 16384 independent pixels
    inputs = []
    d = denoiser(oracle(x0, betas, inputs), betas)
    generator = torch.Generator().manual_seed(2)
    x_T = np.sqrt(alpha_bar[-1]) * x0 + np.sqrt(1 - alpha_bar[-1]) * torch.randn(x0.shape, generator=generator)
    DDPMSampler(steps=steps).sample(d, x_T.float(), d.sigmas, None, generator=generator)
    n = x0.numel()
    for t, x_t in inputs[:: max(1, len(inputs) // 12)]:
        values = x_t.double().numpy().ravel()
        mean, var = np.sqrt(alpha_bar[t]) * 0.5, 1 - alpha_bar[t]
        assert abs(values.mean() - mean) < 5 * np.sqrt(var / n), t
        assert abs(values.var(ddof=1) - var) < 5 * var * np.sqrt(2 / (n - 1)), t


@pytest.mark.parametrize("variance", ["fixed_small", "fixed_large"])
def test_step_variance_closed_form(variance):
    """Each step adds variance beta_tilde_t = beta_t (1 - ab_{t-1})/(1 - ab_t) (fixed_small) or beta_t (fixed_large)."""
    betas = torch.linspace(0.1, 0.5, 5, dtype=torch.float64)  # short chain, clearly distinct variances
    b = betas.numpy()
    ab = np.cumprod(1 - b)
    x0 = torch.full((4, 1, 100, 100), -0.25)
    inputs = []
    d = denoiser(oracle(x0, betas, inputs), betas)
    generator = torch.Generator().manual_seed(3)
    x_T = torch.randn(x0.shape, generator=generator)
    DDPMSampler(variance=variance).sample(d, x_T, d.sigmas, None, generator=generator)
    assert [t for t, _ in inputs] == [4, 3, 2, 1, 0]
    n = x0.numel()
    for (t, x_t), (_, x_prev) in itertools.pairwise(inputs):
        # Posterior mean of q(x_{t-1} | x_t, x0), Ho et al. 2020 eq. 7, written out here.
        c0 = np.sqrt(ab[t - 1]) * b[t] / (1 - ab[t])
        ct = np.sqrt(1 - b[t]) * (1 - ab[t - 1]) / (1 - ab[t])
        mean = c0 * -0.25 + ct * x_t.double().numpy()
        residual = x_prev.double().numpy() - mean
        expected = b[t] * (1 - ab[t - 1]) / (1 - ab[t]) if variance == "fixed_small" else b[t]
        assert abs(residual.mean()) < 5 * np.sqrt(expected / n)
        assert abs(residual.var(ddof=1) - expected) < 5 * expected * np.sqrt(2 / (n - 1)), (t, expected)


def test_bad_sampler_settings_raise():
    """Unknown variance or steps < 1 raise ValueError naming the argument; built from a config node at `sampler`,
    the refusal names the key the user sets."""
    with pytest.raises(ValueError, match=r"^variance='learned' is unknown; use 'fixed_small' or 'fixed_large'$"):
        DDPMSampler(variance="learned")
    with pytest.raises(ValueError, match=r"^steps=0 must be >= 1, or null for all T timesteps$"):
        DDPMSampler(steps=0)
    for key, value, refusal in [
        ("variance", "learned", r"^sampler\.variance='learned' is unknown; use 'fixed_small' or 'fixed_large'$"),
        ("steps", 0, r"^sampler\.steps=0 must be >= 1, or null for all T timesteps$"),
    ]:
        cfg = OmegaConf.create({"sampler": {"_target_": "ddpm.diffusion.samplers.ddpm.DDPMSampler", key: value}})
        with pytest.raises(ValueError, match=refusal):
            build(cfg.sampler)


def noisy_net(x, t, y):
    """A deterministic stand-in network whose output depends on x, t and y."""
    shift = 0.0 if y is None else 0.1 * y.view(-1, 1, 1, 1).float()
    return 0.5 * x + 1e-3 * t.view(-1, 1, 1, 1).float() + shift


def run_generate(seed: int, *, net=noisy_net, num_samples: int = 6, guidance: float = 0.0, null_class=None, **kwargs):
    """DDPM-20 through `generate` on 1x4x4 images in batches of 4; kwargs go to generate (labels, first_index)."""
    d = denoiser(net, make_betas("linear", T), guidance=guidance, null_class=null_class)
    return generate(d, DDPMSampler(steps=20), (num_samples, 1, 4, 4), batch_size=4, seed=seed, **kwargs)


def test_same_seed_same_images():
    """The same seed gives identical images; another seed gives different ones."""
    first, again, other = run_generate(7), run_generate(7), run_generate(8)
    assert first.images.dtype == torch.uint8 and first.images.shape == (6, 1, 4, 4)
    assert torch.equal(first.images, again.images)
    assert not torch.equal(first.images, other.images)
    assert first.nfe == 20


def test_first_index_continues_the_stream():
    """Images from first_index=4 equal the second batch of a run from 0 (same seed and batch size)."""
    whole = run_generate(7, num_samples=8)
    tail = run_generate(7, num_samples=4, first_index=4)
    assert torch.equal(whole.images[4:], tail.images)


class CountingNet:
    """Counts forward calls and records their batch sizes."""

    def __init__(self, net):
        self.net, self.calls, self.batch_sizes = net, 0, []

    def __call__(self, x, t, y):
        self.calls += 1
        self.batch_sizes.append(x.shape[0])
        return self.net(x, t, y)


def test_guidance_is_one_batched_forward():
    """Guidance w: eps = (1 + w) eps(y) - w eps(null), from ONE forward on a doubled batch."""
    betas = make_betas("linear", T)
    counting = CountingNet(noisy_net)
    d = denoiser(counting, betas, guidance=2.5, null_class=10)
    x_t, t, y = torch.randn(3, 1, 4, 4), torch.tensor([5, 500, 999]), torch.tensor([0, 4, 9])
    eps = d(x_t, d.sigmas[t], y).eps
    assert counting.calls == 1 and counting.batch_sizes == [6] and d.calls == 1
    expected = 3.5 * noisy_net(x_t, t, y) - 2.5 * noisy_net(x_t, t, torch.full((3,), 10))
    torch.testing.assert_close(eps, expected, rtol=1e-5, atol=1e-5)


def test_guidance_with_v_prediction_mixes_eps():
    """For a v network, guided eps equals (1 + w) eps_cond - w eps_uncond, each converted from v by hand."""
    betas = make_betas("cosine", T)
    ab = torch.from_numpy(np.cumprod(1 - betas.numpy()))
    d = denoiser(noisy_net, betas, prediction="v", guidance=1.5, null_class=10)
    x_t, t, y = torch.randn(2, 1, 4, 4), torch.tensor([100, 800]), torch.tensor([1, 2])
    a = ab[t].view(-1, 1, 1, 1)

    def eps_from_v(v):  # eps = sqrt(1 - ab) x_t + sqrt(ab) v
        return (1 - a).sqrt() * x_t.double() + a.sqrt() * v.double()

    expected = 2.5 * eps_from_v(noisy_net(x_t, t, y)) - 1.5 * eps_from_v(noisy_net(x_t, t, torch.full((2,), 10)))
    torch.testing.assert_close(d(x_t, d.sigmas[t], y).eps.double(), expected, rtol=1e-5, atol=1e-5)


def test_nfe_counts_guided_steps_once():
    """Sampling S steps with guidance costs S network calls (each on 2B images) and reports nfe = S."""
    counting = CountingNet(noisy_net)
    labels = torch.arange(6) % 3
    result = run_generate(0, net=counting, labels=labels, null_class=3, guidance=1.0)
    assert result.nfe == 20
    assert counting.calls == 2 * 20  # two batches (4 + 2 images)
    assert counting.batch_sizes == [8] * 20 + [4] * 20


def test_no_guidance_single_forward():
    """guidance=0 calls the network once per step on the plain batch, with the given labels."""
    counting = CountingNet(noisy_net)
    d = denoiser(counting, make_betas("linear", T), guidance=0.0, null_class=10)
    x_t, t, y = torch.randn(2, 1, 4, 4), torch.tensor([1, 2]), torch.tensor([3, 4])
    torch.testing.assert_close(d(x_t, d.sigmas[t], y).eps, noisy_net(x_t, t, y))
    assert counting.batch_sizes == [2]


def test_guidance_on_unconditional_model_raises():
    """Guidance without a null class (an unconditional model) raises a ValueError that says so."""
    plain = denoiser(noisy_net, make_betas("linear", T))
    with pytest.raises(ValueError, match=r"guidance=1\.0: .*unconditional"):
        Guided(plain, guidance=1.0, null_class=None)


def test_negative_guidance_raises():
    """A negative guidance weight is refused by the guidance wrapper itself."""
    plain = denoiser(noisy_net, make_betas("linear", T))
    with pytest.raises(ValueError, match=r"guidance=-1\.0: .*must be finite and >= 0"):
        Guided(plain, guidance=-1.0, null_class=10)


class ConstantX0(Levels):
    """A denoiser that predicts x0 = 3 everywhere: a latent's value, outside the pixels' [-1, 1]."""

    def output(self, x: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        return torch.full_like(x, 3.0)

    def denoised(self, x: torch.Tensor, sigma: torch.Tensor, output: torch.Tensor) -> Denoised:
        s = sigma.view(-1, 1, 1, 1).to(x.dtype)
        return Denoised(eps=(x * (1 + s**2).sqrt() - output) / s, x0=output)  # x = (x0 + sigma eps) / sqrt(1 + s^2)


@pytest.mark.parametrize("group", sorted(p.stem for p in (CONF / "sampler").glob("*.yaml")))
def test_decoded_samplers_keep_the_latents_range_and_pixel_samplers_clip(group: str) -> None:
    """Latents are not pixels: a sampler whose output is decoded (`decoded`) neither clips its x0 predictions nor its
    result to [-1, 1]; the same sampler drawing pixels does both."""
    config = OmegaConf.load(CONF / "sampler" / f"{group}.yaml")
    alpha_bar = alpha_bar_from_betas(linear_betas(1000))
    denoiser = ConstantX0(((1 - alpha_bar) / alpha_bar).sqrt())
    x_T = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    given = instantiate(config)
    latents = decoded(given, lambda z: z).sample(denoiser, x_T, denoiser.sigmas, None)
    assert given.clip_output and given.clip_denoised  # a copy is switched off, the caller's sampler is not
    torch.testing.assert_close(latents, torch.full_like(latents, 3.0), atol=0.05, rtol=0)
    pixels = instantiate(config).sample(denoiser, x_T, denoiser.sigmas, None)
    assert pixels.max() <= 1.0
