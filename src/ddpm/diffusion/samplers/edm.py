"""EDM's stochastic Heun sampler (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative
Models", algorithm 2; churn = 0 is its deterministic algorithm 1) for a discrete-time VP model.

As EDM's own code runs its discrete iDDPM models (generate.py, networks.py: iDDPMPrecond, round_sigma), the
sampler works in x_hat = x_t / sqrt(alpha_bar_t) = x0 + sigma eps with sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t),
and every sigma at which the network runs is rounded to the nearest of the T discrete sigma_t, the network then
called at that integer t with x_t = x_hat sqrt(alpha_bar_t). The denoiser D(x_hat; sigma_t) is the x0 prediction.
A model trained with diffusion=edm (ddpm.diffusion.edm) has EDM's own grid as its levels (0.002 to 80, rho = 7), so
with sigma_min/sigma_max null this is EDM's sampler on its own noise levels.

  grid        sigma_i = (sigma_max^(1/rho) + i / (N - 1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho, rounded;
              sigma_N = 0                                                                     (Karras eq. 5)
  churn       gamma_i = min(S_churn / N, sqrt(2) - 1) if S_tmin <= sigma_i <= S_tmax else 0;
              sigma_hat = round(sigma_i (1 + gamma_i)), x_hat <- x_i + sqrt(sigma_hat^2 - sigma_i^2) S_noise z
  Heun        d = (x_hat - D(x_hat; sigma_hat)) / sigma_hat, x_{i+1} = x_hat + (sigma_{i+1} - sigma_hat) d,
              then the trapezoidal correction with d' at (x_{i+1}, sigma_{i+1}) unless sigma_{i+1} = 0

So N steps cost 2N - 1 network evaluations. x_T ~ N(0, I) is taken as the VP sample at sigma_0's timestep:
x_hat_0 = x_T sqrt(1 + sigma_0^2). A noise tensor is drawn (from `generator`, in order) on every step whose
gamma_i > 0. Coefficients in float64, loop in float32. The helpers here are shared with restart.py.
"""

import math

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser, alpha_bar_of
from ddpm.diffusion.samplers.base import sigma_batch


def round_sigma(sigma: Tensor, sigmas: Tensor) -> Tensor:
    """The timesteps t whose discrete sigma_t (sigmas: (T,)) is nearest each sigma (any shape): int64, same shape."""
    return (sigma.double().reshape(-1, 1) - sigmas.reshape(1, -1)).abs().argmin(1).reshape(sigma.shape)


def karras_sigmas(sigma_min: float, sigma_max: float, steps: int, rho: float) -> Tensor:
    """The N = steps sigmas of Karras et al. 2022, eq. 5, from sigma_max down to sigma_min: (N,) float64."""
    if steps == 1:
        return torch.tensor([sigma_max], dtype=torch.float64)
    i = torch.arange(steps, dtype=torch.float64)
    return (sigma_max ** (1 / rho) + i / (steps - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


def check(key: str, value: object, ok: bool, rule: str) -> None:
    """Raise a ValueError naming the argument `key` unless ok; rule says what the value must be."""
    if not ok:
        raise ValueError(f"{key}={value} must be {rule}")


class HatDenoiser:
    """A denoiser as EDM's D(x_hat; sigma_t) at the grid's levels t (sigmas: (T,) float64), for one batch's labels y."""

    def __init__(self, denoiser: Denoiser, sigmas: Tensor, y: Tensor | None, *, clip: bool) -> None:
        self.denoiser, self.y, self.clip = denoiser, y, clip
        self.sigmas = sigmas.double()  # (T,)
        self.scales = alpha_bar_of(self.sigmas).sqrt().tolist()  # x = x_hat sqrt(alpha_bar_t)

    def sigma(self, t: int | None) -> float:
        """sigma_t; None stands for the clean end, sigma = 0."""
        return 0.0 if t is None else float(self.sigmas[t])

    def round(self, sigma: float) -> int:
        """The timestep whose discrete sigma is nearest sigma (EDM's round_sigma)."""
        return int(round_sigma(torch.tensor(sigma), self.sigmas))

    def __call__(self, x_hat: Tensor, t: int) -> Tensor:
        """D(x_hat; sigma_t): the x0 prediction at timestep t; x_hat (B, C, H, W) float32."""
        x0 = self.denoiser(x_hat * self.scales[t], sigma_batch(self.sigmas, t, x_hat), self.y).x0
        return x0.clamp(-1, 1) if self.clip else x0

    def heun(self, x_hat: Tensor, t: int, t_next: int | None) -> Tensor:
        """x_hat at sigma_t -> at sigma_{t_next}: Heun, or Euler into sigma = 0 (t_next None); Karras alg. 1."""
        sigma, sigma_next = self.sigma(t), self.sigma(t_next)
        d = (x_hat - self(x_hat, t)) / sigma  # dx/dsigma = (x - D(x; sigma)) / sigma, alg. 1 line 4
        x_next = x_hat + (sigma_next - sigma) * d
        if t_next is None:
            return x_next
        d_next = (x_next - self(x_next, t_next)) / sigma_next
        return x_hat + (sigma_next - sigma) * (0.5 * d + 0.5 * d_next)


class EDMSampler:
    """Stochastic Heun (Karras et al. 2022, alg. 2) on N rounded Karras sigmas; network_evaluations() = 2N - 1."""

    clip_output = True  # the result clamped to [-1, 1], the pixels' range; decoded() turns it off for latents

    def __init__(
        self,
        *,
        steps: int = 13,  # N sigmas before sigma = 0 (2N - 1 network evaluations)
        churn: float = 0.0,  # S_churn: gamma = min(S_churn / N, sqrt(2) - 1); 0 = deterministic Heun (alg. 1)
        s_tmin: float = 0.0,  # S_tmin: churn only where sigma_i >= s_tmin
        s_tmax: float = math.inf,  # S_tmax: churn only where sigma_i <= s_tmax
        s_noise: float = 1.0,  # S_noise: scale of the churn noise (EDM uses 1.003-1.007)
        rho: float = 7.0,  # rho of the sigma grid (eq. 5)
        sigma_min: float | None = None,  # smallest sigma of the grid; None: the model's smallest discrete sigma
        sigma_max: float | None = None,  # largest sigma of the grid; None: the model's largest discrete sigma
        clip_denoised: bool = True,  # clip the denoised x0 to [-1, 1] before each update
    ) -> None:
        check("steps", steps, steps >= 1, ">= 1")
        check("churn", churn, churn >= 0, ">= 0 (0 = deterministic Heun)")
        check("s_noise", s_noise, s_noise >= 0, ">= 0")
        check("rho", rho, rho > 0, "> 0")
        check("s_tmin", s_tmin, s_tmin <= s_tmax, f"<= s_tmax={s_tmax}")
        check("sigma_min", sigma_min, sigma_min is None or sigma_min > 0, "> 0, or null for the model's")
        check("sigma_max", sigma_max, sigma_max is None or sigma_max > (sigma_min or 0), "> sigma_min")
        self.steps, self.churn, self.s_tmin, self.s_tmax, self.s_noise = steps, churn, s_tmin, s_tmax, s_noise
        self.rho, self.sigma_min, self.sigma_max, self.clip_denoised = rho, sigma_min, sigma_max, clip_denoised

    def timesteps(self, sigmas: Tensor) -> Tensor:
        """The levels t of the rounded grid sigma_0 > ... > sigma_{N-1} of the model's (T,) sigmas: (N,) int64
        (sigma_N = 0 is implied)."""
        sigmas = sigmas.double()
        low = float(sigmas[0]) if self.sigma_min is None else self.sigma_min
        high = float(sigmas[-1]) if self.sigma_max is None else self.sigma_max
        bottom, top = float(sigmas[0]), float(sigmas[-1])
        if low >= high or low >= top or high <= bottom:  # every level would round to one end of the model's
            raise ValueError(
                f"sigma_min={low:.4g} and sigma_max={high:.4g} leave no grid inside the model's sigmas ({bottom:.4g} "
                f"to {top:.4g}): set sigma_min below {top:.4g} and sigma_max above {max(low, bottom):.4g} (null: the "
                "model's own ends)"
            )
        return round_sigma(karras_sigmas(low, high, self.steps, self.rho), sigmas)

    def network_evaluations(self) -> int:
        """Network calls per batch: two per Heun step, one for the last (Euler) step into sigma = 0."""
        return 2 * self.steps - 1

    @torch.no_grad()
    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Run algorithm 2 from x_T (B, C, H, W) ~ N(0, I); returns x0 (B, C, H, W) in [-1, 1]."""
        denoiser = HatDenoiser(denoiser, sigmas, y, clip=self.clip_denoised)
        grid = self.timesteps(sigmas).tolist()
        x = x_T.float() * math.sqrt(1 + denoiser.sigma(grid[0]) ** 2)  # x_hat = x_t / sqrt(alpha_bar_t)
        gamma = min(self.churn / self.steps, math.sqrt(2) - 1)
        for i, t in enumerate(grid):
            sigma = denoiser.sigma(t)
            if gamma > 0 and self.s_tmin <= sigma <= self.s_tmax:
                t = denoiser.round(sigma * (1 + gamma))  # sigma_hat, rounded before x_hat is built with it
                z = torch.randn(x.shape, generator=generator, device=x.device)
                x = x + math.sqrt(denoiser.sigma(t) ** 2 - sigma**2) * self.s_noise * z
            x = denoiser.heun(x, t, grid[i + 1] if i + 1 < len(grid) else None)
        return x.clamp(-1, 1) if self.clip_output else x
