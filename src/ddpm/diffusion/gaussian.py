"""Gaussian diffusion: forward process, prediction targets, training loss, posterior.

Notation of Ho et al. 2020 (DDPM): x0, x_t: (B, C, H, W); t: (B,) int64 in 0..T-1;
alpha_bar: (T,) schedule. v-prediction from Salimans & Ho 2022, min-SNR weighting from
Hang et al. 2023. Plain torch: no Lightning here.
"""

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from ddpm.diffusion.denoiser import Denoised, Levels, Net
from ddpm.diffusion.schedule import alpha_bar_from_betas, make_betas

Prediction = Literal["eps", "v"]
LossWeighting = Literal["uniform", "min_snr"]


def _at(values: Tensor, t: Tensor) -> Tensor:
    """Gather values[t] and shape it (B, 1, 1, 1) for broadcasting over images."""
    return values[t].view(-1, 1, 1, 1)


def q_sample(x0: Tensor, t: Tensor, noise: Tensor, alpha_bar: Tensor) -> Tensor:
    """Draw x_t ~ q(x_t | x_0) = N(sqrt(alpha_bar_t) x0, (1 - alpha_bar_t) I) (Ho et al. 2020, eq. 4)."""
    a = _at(alpha_bar, t)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def v_target(x0: Tensor, noise: Tensor, alpha_bar_t: Tensor) -> Tensor:
    """v = sqrt(alpha_bar) eps - sqrt(1 - alpha_bar) x0 (Salimans & Ho 2022, sec. 4); alpha_bar_t: (B, 1, 1, 1)."""
    return alpha_bar_t.sqrt() * noise - (1 - alpha_bar_t).sqrt() * x0


def eps_and_x0(output: Tensor, x_t: Tensor, alpha_bar_t: Tensor, prediction: Prediction) -> tuple[Tensor, Tensor]:
    """Convert a network output (eps or v) at x_t into (eps, x0); alpha_bar_t: (B, 1, 1, 1)."""
    a, s = alpha_bar_t.sqrt(), (1 - alpha_bar_t).sqrt()
    if prediction == "eps":
        return output, (x_t - s * output) / a
    return s * x_t + a * output, a * x_t - s * output


def snr(alpha_bar: Tensor) -> Tensor:
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar)."""
    return alpha_bar / (1 - alpha_bar)


def min_snr_weight(alpha_bar_t: Tensor, prediction: Prediction, gamma: float) -> Tensor:
    """Min-SNR-gamma loss weight (Hang et al. 2023): min(SNR, gamma) / SNR for eps, / (SNR + 1) for v."""
    ratio = snr(alpha_bar_t)
    clipped = ratio.clamp(max=gamma)
    return clipped / ratio if prediction == "eps" else clipped / (ratio + 1)


def weighted_mse(output: Tensor, target: Tensor, weights: Tensor) -> Tensor:
    """mean_i weights_i mean((output_i - target_i)^2) in float32; output, target (B, C, H, W), weights (B,)."""
    per_sample = (output.float() - target.float()).pow(2).mean(dim=(1, 2, 3))
    return (weights * per_sample).mean()


def drop_labels(y: Tensor, null_class: int, p_uncond: float) -> Tensor:
    """Replace each label by `null_class` with probability p_uncond (Ho & Salimans 2022)."""
    drop = torch.rand(y.shape, device=y.device) < p_uncond
    return torch.where(drop, torch.full_like(y, null_class), y)


def posterior_coefficients(betas: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Coefficients of q(x_{t-1} | x_t, x_0) = N(c0_t x0 + ct_t x_t, beta_tilde_t I) (Ho et al. 2020, eq. 7).

    betas: (T,), float64 recommended. Returns (c0, ct, beta_tilde), each (T,); beta_tilde_0 = 0.
    """
    alpha_bar = alpha_bar_from_betas(betas).to(betas.dtype)
    alpha_bar_prev = torch.cat([alpha_bar.new_ones(1), alpha_bar[:-1]])
    c0 = betas * alpha_bar_prev.sqrt() / (1 - alpha_bar)
    ct = (1 - alpha_bar_prev) * (1 - betas).sqrt() / (1 - alpha_bar)
    return c0, ct, betas * (1 - alpha_bar_prev) / (1 - alpha_bar)


def q_posterior(x0: Tensor, x_t: Tensor, t: Tensor, betas: Tensor) -> tuple[Tensor, Tensor]:
    """Mean (B, C, H, W) and variance (B, 1, 1, 1) of q(x_{t-1} | x_t, x_0) for the schedule `betas`."""
    c0, ct, variance = (c.to(x0) for c in posterior_coefficients(betas))
    return _at(c0, t) * x0 + _at(ct, t) * x_t, _at(variance, t)


class VPDenoiser(Levels):
    """A DDPM-family network (eps or v prediction) on its schedule alpha_bar (Ho et al. 2020; Salimans & Ho 2022)."""

    def __init__(self, *, net: Net, alpha_bar: Tensor, prediction: Prediction) -> None:
        a = alpha_bar.double().cpu()  # (T,) the training schedule's alpha_bar_t
        super().__init__(((1 - a) / a).sqrt())
        self.net, self.alpha_bar, self.prediction = net, a, prediction

    def output(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Tensor:
        return self.net(x, self.level(sigma), y).float()

    def denoised(self, x: Tensor, sigma: Tensor, output: Tensor) -> Denoised:
        a = self.alpha_bar.to(x.device)[self.level(sigma)].float().view(-1, 1, 1, 1)
        eps, x0 = eps_and_x0(output.float(), x, a, self.prediction)
        return Denoised(eps=eps, x0=x0)


class GaussianDiffusion(nn.Module):
    """Schedule buffers plus the training objective; `loss(net, x0, y)` is what a training step calls."""

    sigma_data: float | None = None  # EDM's data scale (ddpm.diffusion.edm); None: the network outputs eps or v

    def __init__(
        self,
        *,
        num_timesteps: int = 1000,  # T; timesteps are 0..T-1
        schedule: Literal["linear", "cosine"] = "linear",  # key of SCHEDULES
        prediction: Prediction = "eps",  # network target: eps (Ho et al.) or v (Salimans & Ho)
        loss_weighting: LossWeighting = "uniform",  # uniform MSE or min-SNR-gamma
        min_snr_gamma: float = 5.0,  # gamma of min-SNR weighting
        p_uncond: float = 0.1,  # probability of dropping a label to the null class (classifier-free guidance)
    ) -> None:
        super().__init__()
        if prediction not in ("eps", "v"):
            raise ValueError(f"prediction={prediction!r} is unknown; use 'eps' or 'v'")
        if loss_weighting not in ("uniform", "min_snr"):
            raise ValueError(f"loss_weighting={loss_weighting!r} is unknown; use 'uniform' or 'min_snr'")
        if not 0.0 <= p_uncond < 1.0:
            raise ValueError(f"p_uncond={p_uncond} must be in [0, 1); 0.1 is the usual value")
        if min_snr_gamma <= 0:
            raise ValueError(f"min_snr_gamma={min_snr_gamma} must be > 0; 5 is the usual value")
        self.num_timesteps, self.schedule = num_timesteps, schedule
        self.prediction, self.loss_weighting = prediction, loss_weighting
        self.min_snr_gamma, self.p_uncond = min_snr_gamma, p_uncond
        betas = make_betas(schedule, num_timesteps)  # float64, registered as float32 below
        self.register_buffer("betas", betas.float(), persistent=False)
        self.register_buffer("alpha_bar", alpha_bar_from_betas(betas).float(), persistent=False)

    def betas64(self) -> Tensor:
        """The schedule's betas recomputed in float64 (for exports), on CPU."""
        return make_betas(self.schedule, self.num_timesteps)

    def denoiser(self, net: Net) -> VPDenoiser:
        """`net` as the samplers' denoiser, on this schedule (alpha_bar in float64)."""
        return VPDenoiser(net=net, alpha_bar=alpha_bar_from_betas(self.betas64()), prediction=self.prediction)

    def sample_timesteps(self, batch_size: int, device: torch.device) -> Tensor:
        """t ~ U{0, ..., T-1}: (B,) int64."""
        return torch.randint(0, self.num_timesteps, (batch_size,), device=device)

    def drop_labels(self, y: Tensor, null_class: int) -> Tensor:
        """Replace each label by `null_class` with probability p_uncond (Ho & Salimans 2022)."""
        return drop_labels(y, null_class, self.p_uncond)

    def target(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """What the network should output at (x_t, t): eps, or v."""
        return noise if self.prediction == "eps" else v_target(x0, noise, _at(self.alpha_bar, t))

    def weights(self, t: Tensor) -> Tensor:
        """Per-sample loss weights (B,), float32."""
        if self.loss_weighting == "uniform":
            return torch.ones(t.shape, device=t.device)
        return min_snr_weight(self.alpha_bar[t].float(), self.prediction, self.min_snr_gamma)

    def loss(
        self,
        net: Callable[[Tensor, Tensor, Tensor | None], Tensor],
        x0: Tensor,
        t: Tensor,
        noise: Tensor,
        y: Tensor | None = None,
    ) -> Tensor:
        """Weighted MSE between net(x_t, t, y) and the target, reduced in float32 to a scalar."""
        x_t = q_sample(x0, t, noise, self.alpha_bar)
        return weighted_mse(net(x_t, t, y), self.target(x0, noise, t), self.weights(t))
