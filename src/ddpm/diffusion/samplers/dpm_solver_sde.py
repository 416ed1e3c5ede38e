"""SDE-DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
Probabilistic Models", appendix: the SDE variant of algorithm 2; diffusers' DPMSolverMultistepScheduler with
algorithm_type="sde-dpmsolver++", solver_order=2, solver_type="midpoint").

It solves the reverse diffusion SDE in the data prediction x0_hat, stepped in lambda = log(alpha / sigma),
alpha = sqrt(alpha_bar), sigma = sqrt(1 - alpha_bar). From t_{i-1} to t_i, with h_i = lambda_{t_i} - lambda_{t_{i-1}}:

  x_{t_i} = (sigma_{t_i} / sigma_{t_{i-1}}) e^{-h_i} x_{t_{i-1}} + alpha_{t_i} (1 - e^{-2 h_i}) D_i
            + sigma_{t_i} sqrt(1 - e^{-2 h_i}) z,                                              z ~ N(0, I)

with D_i = x0_{i-1} (first order) or D_i = (1 + 1 / (2 r_i)) x0_{i-1} - 1 / (2 r_i) x0_{i-2}, r_i = h_{i-1} / h_i
(second order, "midpoint"). As in DPMSolverSampler, the grid ends at sigma = 0, the first step (no history) and the
last (into sigma = 0, where e^{-h} = 0: it returns x0_hat, and no noise is drawn) are first order. One noise draw
per step but the last, in order, from `generator`. Coefficients in float64, loop in float32.
"""

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser, alpha_bar_of
from ddpm.diffusion.samplers.base import sigma_batch
from ddpm.diffusion.samplers.dpm_solver import half_log_snr
from ddpm.diffusion.samplers.spacing import Spacing, interval_timesteps, validate_spacing


def sde_dpm_solver_coefficients(alpha_bar: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ratio, phi, noise, r), each (S,) float64, for the visited alpha_bar (S,), descending in t; ends at sigma=0.

    Step i: x <- ratio_i x + phi_i D_i + noise_i z with ratio = (sigma_next / sigma) e^{-h},
    phi = alpha_next (1 - e^{-2h}), noise = sigma_next sqrt(1 - e^{-2h}); r_i = h_{i-1} / h_i (r_0 unused, 1).
    """
    a = alpha_bar.double()
    a_next = torch.cat([a[1:], a.new_ones(1)])
    h = half_log_snr(a_next) - half_log_snr(a)  # h[-1] = +inf
    one_minus_e2h = -torch.expm1(-2 * h)  # 1 - e^{-2h}
    ratio = ((1 - a_next) / (1 - a)).sqrt() * torch.exp(-h)
    phi = a_next.sqrt() * one_minus_e2h
    noise = (1 - a_next).sqrt() * one_minus_e2h.sqrt()
    r = torch.cat([h.new_ones(1), h[:-1] / h[1:]])
    return ratio, phi, noise, r


class DPMSolverSDESampler:
    """SDE-DPM-Solver++(2M) on S timesteps, ending at sigma = 0; S network evaluations, S - 1 noise draws."""

    clip_output = True  # the result clamped to [-1, 1], the pixels' range; decoded() turns it off for latents

    def __init__(
        self,
        *,
        steps: int = 20,  # S timesteps visited (S network evaluations)
        spacing: Spacing = "trailing",  # which S of the T timesteps: trailing, leading, linspace, logsnr, karras
        steps_offset: int = 0,  # added to `leading` timesteps (Stable Diffusion: 1); ignored by the others
        clip_denoised: bool = True,  # clip the predicted x0 to [-1, 1] before each update
    ) -> None:
        validate_spacing(spacing, steps, steps_offset)
        self.steps, self.spacing = steps, spacing
        self.steps_offset, self.clip_denoised = steps_offset, clip_denoised

    def timesteps(self, num_timesteps: int, alpha_bar: Tensor | None = None) -> Tensor:
        """The visited timesteps, descending: (S,) int64 (DPMSolverSampler's grid)."""
        return interval_timesteps(
            self.spacing, num_timesteps, self.steps, steps_offset=self.steps_offset, alpha_bar=alpha_bar
        )

    def network_evaluations(self) -> int:
        """Network calls per batch: one per visited timestep."""
        return self.steps

    def step_order(self, i: int) -> int:
        """1 on the first step (no history) and the last (into sigma = 0), else 2."""
        return 1 if i == 0 or i == self.steps - 1 else 2

    @torch.no_grad()
    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Solve from x_T (B, C, H, W) ~ N(0, I) to sigma = 0; returns x0 (B, C, H, W) in [-1, 1]."""
        alpha_bar = alpha_bar_of(sigmas.double())
        visited = self.timesteps(len(sigmas), alpha_bar)
        ratio, phi, noise, r = (c.tolist() for c in sde_dpm_solver_coefficients(alpha_bar[visited]))
        x, previous = x_T.float(), None
        for i, step in enumerate(visited.tolist()):
            x0 = denoiser(x, sigma_batch(sigmas, step, x), y).x0
            x0 = x0.clamp(-1, 1) if self.clip_denoised else x0
            d = x0
            if self.step_order(i) == 2:
                d = (1 + 0.5 / r[i]) * x0 - (0.5 / r[i]) * previous  # midpoint 2M, Lu et al. 2022
            x = ratio[i] * x + phi[i] * d  # last step: ratio = 0, phi = 1, noise = 0, so x = x0_hat
            if noise[i] > 0:
                x = x + noise[i] * torch.randn(x.shape, generator=generator, device=x.device)
            previous = x0
        return x.clamp(-1, 1) if self.clip_output else x
