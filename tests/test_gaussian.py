"""Forward process, posterior, v-parameterisation, min-SNR weights, label dropout and the loss."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ddpm.config.build import build
from ddpm.diffusion.gaussian import (
    GaussianDiffusion,
    eps_and_x0,
    min_snr_weight,
    q_posterior,
    q_sample,
    v_target,
)
from ddpm.diffusion.schedule import make_betas

T = 1000


def numpy_alpha_bar(schedule: str = "linear") -> np.ndarray:
    """alpha_bar in float64, from betas written out here (linear) or the library's float64 cosine betas."""
    betas = np.linspace(1e-4, 0.02, T) if schedule == "linear" else make_betas("cosine", T).numpy()
    return np.cumprod(1 - betas)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("t", [0, 100, 500, 999])
def test_q_sample_mean_and_variance(t):
    """x_t ~ N(sqrt(ab_t) x0, (1 - ab_t) I): sample mean and variance within 5 standard errors."""
    ab = numpy_alpha_bar()[t]
    diffusion = GaussianDiffusion(num_timesteps=T, schedule="linear")
    x0 = torch.tensor([-1.0, -0.3, 0.5, 0.9]).view(1, 1, 2, 2).expand(50_000, 1, 2, 2)  # 200k values
    generator = torch.Generator().manual_seed(t)
    noise = torch.randn(x0.shape, generator=generator)
    x_t = q_sample(x0, torch.full((50_000,), t), noise, diffusion.alpha_bar).double().numpy()
    n, var = x_t.shape[0], 1 - ab
    mean_expected = np.sqrt(ab) * np.array([-1.0, -0.3, 0.5, 0.9]).reshape(1, 2, 2)
    assert np.all(np.abs(x_t.mean(0) - mean_expected) < 5 * np.sqrt(var / n))
    assert np.all(np.abs(x_t.var(0, ddof=1) - var) < 5 * var * np.sqrt(2 / (n - 1)))


def test_q_sample_per_sample_timesteps():
    """Each sample of a batch uses its own t: x_t = sqrt(ab_t) x0 + sqrt(1 - ab_t) eps, float64 by hand."""
    ab = numpy_alpha_bar()
    diffusion = GaussianDiffusion(num_timesteps=T)
    t = torch.tensor([0, 7, 400, 999])
    x0, noise = torch.rand(4, 3, 2, 2) * 2 - 1, torch.randn(4, 3, 2, 2)
    expected = np.sqrt(ab[t.numpy()])[:, None, None, None] * x0.double().numpy()
    expected += np.sqrt(1 - ab[t.numpy()])[:, None, None, None] * noise.double().numpy()
    # float32 alpha_bar near t=0: 1 - alpha_bar = 1e-4 carries ~3e-4 relative error, hence atol 1e-5.
    np.testing.assert_allclose(q_sample(x0, t, noise, diffusion.alpha_bar).numpy(), expected, atol=1e-5)


def bayes_posterior(x0: np.ndarray, x_t: np.ndarray, t: int, betas: np.ndarray) -> tuple[np.ndarray, float]:
    """q(x_{t-1} | x_t, x0) ∝ N(x_t; sqrt(1-b_t) x_{t-1}, b_t) N(x_{t-1}; sqrt(ab_{t-1}) x0, 1 - ab_{t-1})."""
    alpha_bar = np.cumprod(1 - betas)
    if t == 0:  # alpha_bar_{-1} = 1: the prior on x_{-1} is a point mass at x0.
        return x0, 0.0
    prior_mean, prior_var = np.sqrt(alpha_bar[t - 1]) * x0, 1 - alpha_bar[t - 1]
    # As a function of x_{t-1}, the likelihood is N(x_t / sqrt(a_t), b_t / a_t).
    a_t = 1 - betas[t]
    like_mean, like_var = x_t / np.sqrt(a_t), betas[t] / a_t
    var = 1 / (1 / prior_var + 1 / like_var)
    return var * (prior_mean / prior_var + like_mean / like_var), var


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("t", [0, 1, 2, 50, 500, 998, 999])
def test_posterior_matches_bayes(schedule, t):
    """q_posterior mean/variance equal the product of the two Gaussians, computed in float64 here."""
    betas = make_betas(schedule, T).numpy() if schedule == "cosine" else np.linspace(1e-4, 0.02, T)
    x0, x_t = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    mean, var = q_posterior(x0, x_t, torch.full((2,), t), torch.from_numpy(betas))
    mean_expected, var_expected = bayes_posterior(x0.numpy(), x_t.numpy(), t, betas)
    assert var.shape == (2, 1, 1, 1)
    np.testing.assert_allclose(mean.numpy(), mean_expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(var.numpy().ravel(), var_expected, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("t", [0, 300, 999])
def test_v_target_and_recovery(t):
    """v = sqrt(ab) eps - sqrt(1-ab) x0; from (v, x_t) recover eps = sqrt(1-ab) x_t + sqrt(ab) v, x0 likewise."""
    ab = numpy_alpha_bar()[t]
    x0, eps = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    a = torch.full((2, 1, 1, 1), ab, dtype=torch.float64)
    v = v_target(x0, eps, a)
    np.testing.assert_allclose(v.numpy(), np.sqrt(ab) * eps.numpy() - np.sqrt(1 - ab) * x0.numpy(), rtol=1e-12)
    x_t = np.sqrt(ab) * x0 + np.sqrt(1 - ab) * eps
    # A second closed form: v = (sqrt(ab) x_t - x0) / sqrt(1 - ab).
    np.testing.assert_allclose(v.numpy(), ((np.sqrt(ab) * x_t - x0) / np.sqrt(1 - ab)).numpy(), atol=1e-8)
    for prediction, output in (("v", v), ("eps", eps)):
        eps_hat, x0_hat = eps_and_x0(output, x_t, a, prediction)
        np.testing.assert_allclose(eps_hat.numpy(), eps.numpy(), atol=1e-8)
        np.testing.assert_allclose(x0_hat.numpy(), x0.numpy(), atol=1e-6)


def test_diffusion_target_for_v():
    """GaussianDiffusion(prediction='v').target is v at each sample's own t, in closed form."""
    ab = numpy_alpha_bar()
    diffusion = GaussianDiffusion(num_timesteps=T, prediction="v")
    t = torch.tensor([3, 600])
    x0, eps = torch.randn(2, 1, 2, 2), torch.randn(2, 1, 2, 2)
    a = ab[t.numpy()][:, None, None, None]
    expected = np.sqrt(a) * eps.double().numpy() - np.sqrt(1 - a) * x0.double().numpy()
    np.testing.assert_allclose(diffusion.target(x0, eps, t).numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_min_snr_weights_closed_form(schedule, prediction, gamma):
    """Hang et al. 2023: weight = min(SNR, gamma)/SNR for eps, min(SNR, gamma)/(SNR + 1) for v."""
    ab = numpy_alpha_bar(schedule)
    snr = ab / (1 - ab)
    expected = np.minimum(snr, gamma) / (snr if prediction == "eps" else snr + 1)
    diffusion = GaussianDiffusion(
        num_timesteps=T, schedule=schedule, prediction=prediction, loss_weighting="min_snr", min_snr_gamma=gamma
    )
    weights = diffusion.weights(torch.arange(T))
    assert weights.dtype == torch.float32
    # alpha_bar is a float32 buffer: 1 - alpha_bar near t=0 keeps ~3-4 digits, hence rtol 1e-3.
    np.testing.assert_allclose(weights.double().numpy(), expected, rtol=1e-3)
    # In float64 the function itself is exact.
    exact = min_snr_weight(torch.from_numpy(ab), prediction, gamma).numpy()
    np.testing.assert_allclose(exact, expected, rtol=1e-12)


def test_min_snr_weight_limits():
    """Low-noise steps (SNR > gamma) are down-weighted; eps weight is 1 and v weight is SNR/(SNR+1) below gamma."""
    ab = torch.tensor([0.99, 0.5, 0.01], dtype=torch.float64)  # SNR 99, 1, 1/99
    np.testing.assert_allclose(min_snr_weight(ab, "eps", 5.0).numpy(), [5 / 99, 1.0, 1.0], rtol=1e-12)
    np.testing.assert_allclose(min_snr_weight(ab, "v", 5.0).numpy(), [5 / 100, 1 / 2, (1 / 99) / (100 / 99)])


def test_uniform_weights_are_ones():
    """Uniform weighting gives weight 1 at every t (plain MSE, Ho et al. 2020 L_simple)."""
    weights = GaussianDiffusion(num_timesteps=T).weights(torch.arange(T))
    assert weights.dtype == torch.float32 and bool((weights == 1).all())


def test_drop_labels_rate():
    """With p_uncond=0.1 the null class appears at rate 0.1 within 4 standard errors; other labels unchanged."""
    diffusion = GaussianDiffusion(num_timesteps=T, p_uncond=0.1)
    y = torch.randint(0, 10, (100_000,))
    dropped = diffusion.drop_labels(y, null_class=10)
    is_null = dropped == 10
    assert abs(is_null.double().mean().item() - 0.1) < 4 * np.sqrt(0.1 * 0.9 / 100_000)
    assert torch.equal(dropped[~is_null], y[~is_null])


def test_drop_labels_never_at_p0():
    """p_uncond=0 never drops a label."""
    diffusion = GaussianDiffusion(num_timesteps=T, p_uncond=0.0)
    y = torch.randint(0, 10, (100_000,))
    assert torch.equal(diffusion.drop_labels(y, null_class=10), y)


@pytest.mark.parametrize(
    ("kwargs", "refusal"),
    [
        ({"prediction": "x0"}, r"prediction='x0' is unknown; use 'eps' or 'v'"),
        ({"loss_weighting": "snr"}, r"loss_weighting='snr' is unknown; use 'uniform' or 'min_snr'"),
        ({"p_uncond": 1.0}, r"p_uncond=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_diffusion_settings_raise(kwargs, refusal):
    """An invalid prediction, weighting or p_uncond is refused naming the argument and the choices (plain torch: no
    Hydra key)."""
    with pytest.raises(ValueError, match=f"^{refusal}"):
        GaussianDiffusion(**kwargs)


def test_a_bad_setting_built_from_the_config_names_the_key():
    """Built from a run config's `diffusion:` node (as train.py builds it), the refusal names diffusion.prediction."""
    cfg = OmegaConf.create({"diffusion": {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "prediction": "x0"}})
    with pytest.raises(ValueError, match=r"^diffusion\.prediction='x0' is unknown; use 'eps' or 'v'"):
        build(cfg.diffusion)


@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("loss_weighting", ["uniform", "min_snr"])
def test_loss_of_zero_network(prediction, loss_weighting):
    """Loss of a network that outputs 0 = mean_b w_b mean(target_b^2), recomputed in float64 here."""
    ab = numpy_alpha_bar()
    diffusion = GaussianDiffusion(num_timesteps=T, prediction=prediction, loss_weighting=loss_weighting)
    x0, noise, t = torch.rand(8, 1, 4, 4) * 2 - 1, torch.randn(8, 1, 4, 4), torch.randint(0, T, (8,))
    loss = diffusion.loss(lambda x, t, y: torch.zeros_like(x), x0, t, noise)
    a = ab[t.numpy()][:, None, None, None]
    eps64, x064 = noise.double().numpy(), x0.double().numpy()
    target = eps64 if prediction == "eps" else np.sqrt(a) * eps64 - np.sqrt(1 - a) * x064
    snr = ab[t.numpy()] / (1 - ab[t.numpy()])
    weight = np.ones(8)
    if loss_weighting == "min_snr":
        weight = np.minimum(snr, 5.0) / (snr if prediction == "eps" else snr + 1)
    expected = (weight * (target**2).mean(axis=(1, 2, 3))).mean()
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-3)


def test_loss_float32_and_finite_with_bf16_network():
    """A bfloat16 network output still gives a finite float32 scalar loss."""
    diffusion = GaussianDiffusion(num_timesteps=T, loss_weighting="min_snr")
    x0, noise, t = torch.rand(4, 1, 4, 4) * 2 - 1, torch.randn(4, 1, 4, 4), torch.tensor([0, 1, 500, 999])
    loss = diffusion.loss(lambda x, t, y: (0.5 * x).bfloat16(), x0, t, noise)
    assert loss.dtype == torch.float32 and loss.shape == () and torch.isfinite(loss)


@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_loss_of_oracle_is_zero(prediction, schedule):
    """A network that knows x0 returns eps = (x_t - sqrt(ab) x0)/sqrt(1-ab) (or v): the loss is ~0."""
    ab = torch.from_numpy(numpy_alpha_bar(schedule))
    diffusion = GaussianDiffusion(num_timesteps=T, schedule=schedule, prediction=prediction)
    x0 = torch.rand(16, 3, 4, 4) * 2 - 1
    t = torch.cat([torch.tensor([0, 1, T - 2, T - 1]), torch.randint(0, T, (12,))])

    def oracle(x_t, t, y):
        a = ab[t].view(-1, 1, 1, 1)
        x = x_t.double()
        if prediction == "eps":
            return ((x - a.sqrt() * x0) / (1 - a).sqrt()).float()
        return ((a.sqrt() * x - x0) / (1 - a).sqrt()).float()

    loss = diffusion.loss(oracle, x0, t, torch.randn(16, 3, 4, 4))
    assert loss.dtype == torch.float32
    assert 0 <= loss.item() < 1e-6


def test_loss_passes_labels():
    """The labels given to loss reach the network unchanged."""
    seen = []

    def net(x, t, y):
        seen.append(y)
        return torch.zeros_like(x)

    y = torch.tensor([3, 10])
    GaussianDiffusion(num_timesteps=T).loss(
        net, torch.zeros(2, 1, 2, 2), torch.tensor([1, 2]), torch.randn(2, 1, 2, 2), y
    )
    assert torch.equal(seen[0], y)
