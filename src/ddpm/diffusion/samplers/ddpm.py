"""Ancestral DDPM sampling (Ho et al. 2020, algorithm 2), optionally on a respaced subset of timesteps.

Respacing follows improved-diffusion (Nichol & Dhariwal 2021, sec. 4): keep S of the T timesteps,
recompute betas from alpha_bar at the kept timesteps, and call the network with the original
timestep indices. Coefficients are computed in float64, the loop runs in float32.
"""

from typing import Literal

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser, alpha_bar_of
from ddpm.diffusion.gaussian import posterior_coefficients
from ddpm.diffusion.samplers.base import sigma_batch
from ddpm.diffusion.schedule import betas_from_alpha_bar, respaced_timesteps

Variance = Literal["fixed_small", "fixed_large"]


class DDPMSampler:
    """x_{t-1} ~ N(mu_tilde(x_t, x0_hat), sigma_t^2 I) with sigma_t^2 = beta_tilde_t (fixed_small) or beta_t."""

    clip_output = True  # the result clamped to [-1, 1], the pixels' range; decoded() turns it off for latents

    def __init__(
        self,
        *,
        steps: int | None = None,  # S timesteps to use (respacing); None: all T
        variance: Variance = "fixed_small",  # posterior variance: beta_tilde (small) or beta (large)
        clip_denoised: bool = True,  # clip the predicted x0 to [-1, 1] before the posterior mean
    ) -> None:
        if variance not in ("fixed_small", "fixed_large"):
            raise ValueError(f"variance={variance!r} is unknown; use 'fixed_small' or 'fixed_large'")
        if steps is not None and steps < 1:
            raise ValueError(f"steps={steps} must be >= 1, or null for all T timesteps")
        self.steps, self.variance, self.clip_denoised = steps, variance, clip_denoised

    def timesteps(self, num_timesteps: int) -> Tensor:
        """The kept timesteps, ascending: (S,) int64."""
        return respaced_timesteps(num_timesteps, self.steps or num_timesteps)

    @torch.no_grad()
    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Run the reverse chain from x_T (B, C, H, W) ~ N(0, I); returns x0 (B, C, H, W) in [-1, 1]."""
        kept = self.timesteps(len(sigmas))
        betas = betas_from_alpha_bar(alpha_bar_of(sigmas.double())[kept])  # (S,) float64, respaced
        c0, ct, variance = posterior_coefficients(betas)
        if self.variance == "fixed_large":
            variance = betas
        sigma = variance.sqrt().tolist()
        c0, ct = c0.tolist(), ct.tolist()
        x = x_T.float()
        for i in reversed(range(len(kept))):
            x0 = denoiser(x, sigma_batch(sigmas, int(kept[i]), x), y).x0
            x0 = x0.clamp(-1, 1) if self.clip_denoised else x0
            x = c0[i] * x0 + ct[i] * x  # posterior mean, Ho et al. 2020, eq. 7
            if i > 0:
                x = x + sigma[i] * torch.randn(x.shape, generator=generator, device=x.device)
        return x.clamp(-1, 1) if self.clip_output else x
