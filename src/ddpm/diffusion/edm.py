"""EDM's formulation of diffusion training (Karras et al. 2022), on T discrete noise levels: `EDMDiffusion`.

- Noise levels: sigma_t for t = 0..T-1, ascending, on EDM's sampling grid (eq. 5) from sigma_min to sigma_max
  with exponent rho; as a VP schedule alpha_bar_t = 1 / (1 + sigma_t^2) (betas from it), so every sampler here
  (DDPM, DDIM, DPM-Solver++ and its SDE variant, EDM's Heun, restart) runs on these levels unchanged, in sigma.
  The network's time input is the level's index t, as in EDM's own discrete models (iDDPMPrecond).
- Training noise: ln sigma ~ N(P_mean, P_std^2) (sec. 5, "training"), clipped to [sigma_min, sigma_max] and rounded
  to the nearest level in ln sigma.
- Preconditioning and loss weighting: ddpm.diffusion.precond (table 1): the loss is
  lambda(sigma) c_out(sigma)^2 ||F - (x0 - c_skip x) / c_out||^2 with x = x0 + sigma n, lambda c_out^2 = 1.

Shapes: x0, noise (B, C, H, W); t (B,) int64 in 0..T-1. Plain torch.
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ddpm.diffusion import precond
from ddpm.diffusion.denoiser import Denoised, Levels, Net
from ddpm.diffusion.gaussian import drop_labels, weighted_mse
from ddpm.diffusion.samplers.edm import karras_sigmas
from ddpm.diffusion.schedule import betas_from_alpha_bar


def edm_sigmas(num_timesteps: int, sigma_min: float, sigma_max: float, rho: float) -> Tensor:
    """T noise levels, ascending: Karras et al. 2022, eq. 5, read from sigma_min up. (T,) float64."""
    return karras_sigmas(sigma_min, sigma_max, num_timesteps, rho).flip(0)


class EDMDenoiser(Levels):
    """An EDM network F with its preconditioning (Karras et al. 2022, table 1; ddpm.diffusion.precond): called on
    c_in x_hat, its output turned into x0 = c_skip x_hat + c_out F; the coefficients in float64 (1 - alpha_bar near
    sigma_min needs it)."""

    def __init__(self, *, net: Net, sigmas: Tensor, sigma_data: float) -> None:
        super().__init__(sigmas)
        self.net, self.sigma_data = net, sigma_data

    def output(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Tensor:
        s = sigma.double().view(-1, 1, 1, 1)
        return self.net(x * precond.vp_input_scale(s, self.sigma_data).to(x.dtype), self.level(sigma), y)

    def denoised(self, x: Tensor, sigma: Tensor, output: Tensor) -> Denoised:
        s = sigma.double().view(-1, 1, 1, 1)
        eps, x0 = precond.eps_and_x0_from_f(output.to(s.dtype), x.to(s.dtype), s, self.sigma_data)
        return Denoised(eps=eps.to(x.dtype), x0=x0.to(x.dtype))


class EDMDiffusion(nn.Module):
    """EDM's noise levels, preconditioning and loss on T levels; `loss(net, x0, t, noise, y)` is a training step's."""

    prediction = "edm"  # the network outputs EDM's F (EDMDenoiser turns it into x0)
    schedule = "edm"  # the noise levels are EDM's grid (exports and resumes name it)

    def __init__(
        self,
        *,
        num_timesteps: int = 1000,  # T noise levels; the network's time input is the level index 0..T-1
        sigma_min: float = 0.002,  # smallest noise level (EDM's)
        sigma_max: float = 80.0,  # largest noise level (EDM's)
        rho: float = 7.0,  # exponent of the level grid (eq. 5)
        sigma_data: float = 0.5,  # standard deviation of the data (EDM's, for images in [-1, 1])
        p_mean: float = -1.2,  # mean of ln sigma during training (EDM's CIFAR-10 value)
        p_std: float = 1.2,  # standard deviation of ln sigma during training
        p_uncond: float = 0.1,  # probability of dropping a label to the null class (classifier-free guidance)
    ) -> None:
        super().__init__()
        _check("num_timesteps", num_timesteps, num_timesteps >= 2, ">= 2 (1000 is the usual value)")
        _check("sigma_min", sigma_min, sigma_min > 0, "> 0 (EDM: 0.002)")
        _check("sigma_max", sigma_max, sigma_max > sigma_min, f"> sigma_min={sigma_min} (EDM: 80)")
        _check("rho", rho, rho > 0, "> 0 (EDM: 7)")
        _check("sigma_data", sigma_data, sigma_data > 0, "> 0: the data's standard deviation (EDM: 0.5)")
        _check("p_std", p_std, p_std > 0, "> 0 (EDM: 1.2)")
        _check("p_uncond", p_uncond, 0.0 <= p_uncond < 1.0, "in [0, 1); 0.1 is the usual value")
        self.num_timesteps, self.sigma_min, self.sigma_max, self.rho = num_timesteps, sigma_min, sigma_max, rho
        self.sigma_data, self.p_mean, self.p_std, self.p_uncond = sigma_data, p_mean, p_std, p_uncond
        sigmas = self.sigmas64()
        self.register_buffer("sigmas", sigmas.float(), persistent=False)
        self.register_buffer("log_sigmas", sigmas.log().float(), persistent=False)

    def sigmas64(self) -> Tensor:
        """The T noise levels sigma_t, ascending in t: (T,) float64 on CPU."""
        return edm_sigmas(self.num_timesteps, self.sigma_min, self.sigma_max, self.rho)

    def betas64(self) -> Tensor:
        """The levels as a VP schedule, alpha_bar_t = 1 / (1 + sigma_t^2), for exports (a diffusers scheduler's
        trained_betas). (T,) float64, CPU."""
        return betas_from_alpha_bar(1 / (1 + self.sigmas64() ** 2))

    def denoiser(self, net: Net) -> "EDMDenoiser":
        """`net` as the samplers' denoiser: EDM's preconditioning on these levels (no round trip through betas)."""
        return EDMDenoiser(net=net, sigmas=self.sigmas64(), sigma_data=self.sigma_data)

    def sample_timesteps(self, batch_size: int, device: torch.device) -> Tensor:
        """ln sigma ~ N(P_mean, P_std^2), clipped to the grid, rounded to the nearest level in ln sigma: (B,) int64."""
        log_sigma = self.p_mean + self.p_std * torch.randn(batch_size, device=device)
        return self.nearest_level(log_sigma)

    def nearest_level(self, log_sigma: Tensor) -> Tensor:
        """The index of the level nearest each ln sigma (any shape, clipped to the grid): int64, same shape."""
        grid = self.log_sigmas.to(log_sigma.device)
        upper = torch.searchsorted(grid, log_sigma.contiguous()).clamp(1, len(grid) - 1)
        nearer_lower = (log_sigma - grid[upper - 1]) < (grid[upper] - log_sigma)
        return torch.where(nearer_lower, upper - 1, upper)

    def drop_labels(self, y: Tensor, null_class: int) -> Tensor:
        """Replace each label by `null_class` with probability p_uncond (Ho & Salimans 2022)."""
        return drop_labels(y, null_class, self.p_uncond)

    def weights(self, t: Tensor) -> Tensor:
        """Per-sample weight of the squared error in F: lambda(sigma_t) c_out(sigma_t)^2 (= 1). (B,) float32."""
        sigma = self.sigmas[t].double()
        return (precond.loss_weight(sigma, self.sigma_data) * precond.c_out(sigma, self.sigma_data) ** 2).float()

    def loss(
        self,
        net: Callable[[Tensor, Tensor, Tensor | None], Tensor],
        x0: Tensor,
        t: Tensor,
        noise: Tensor,
        y: Tensor | None = None,
    ) -> Tensor:
        """EDM's loss (eq. 8): weighted MSE between F(c_in x; t) and (x0 - c_skip x) / c_out, reduced in float32."""
        sigma = self.sigmas[t].view(-1, 1, 1, 1)
        x = x0 + sigma * noise
        output = net(precond.c_in(sigma, self.sigma_data) * x, t, y)
        return weighted_mse(output, precond.f_target(x0, x, sigma, self.sigma_data), self.weights(t))


def _check(key: str, value: object, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{key}={value} must be {rule}")
