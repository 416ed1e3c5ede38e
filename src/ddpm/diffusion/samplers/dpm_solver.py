"""DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
Probabilistic Models", algorithm 2): a multistep solver of the diffusion ODE in the data prediction
x0_hat, stepped in lambda = log(alpha / sigma), alpha = sqrt(alpha_bar), sigma = sqrt(1 - alpha_bar).

From t_{i-1} to t_i, with h_i = lambda_{t_i} - lambda_{t_{i-1}}:

  first order   x_{t_i} = (sigma_{t_i} / sigma_{t_{i-1}}) x_{t_{i-1}} + alpha_{t_i} (1 - e^{-h_i}) x0_{i-1}
  second order  the same with x0_{i-1} replaced by D_i = (1 + 1 / (2 r_i)) x0_{i-1} - 1 / (2 r_i) x0_{i-2},
                r_i = h_{i-1} / h_i

The first step has no history and is first order. The last step goes to sigma = 0 (lambda = +inf; diffusers'
final_sigmas_type="zero"), where r = 0 and only the first-order step is defined: it returns x0_hat itself.
diffusers forces that same first-order final step whenever the final sigma is zero, so for 2M its
`lower_order_final` switch changes nothing, and there is no such switch here. With order=1 every step is
first order, which is DDIM with eta = 0 (Lu et al. 2022, sec. 4.1). Coefficients in float64, loop in float32.
"""

from typing import Literal

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser, alpha_bar_of
from ddpm.diffusion.samplers.base import sigma_batch
from ddpm.diffusion.samplers.spacing import Spacing, interval_timesteps, validate_spacing


def half_log_snr(alpha_bar: Tensor) -> Tensor:
    """lambda = log(alpha / sigma) = 0.5 log(alpha_bar / (1 - alpha_bar)); +inf at alpha_bar = 1."""
    return 0.5 * (alpha_bar.log() - (1 - alpha_bar).log())


def dpm_solver_coefficients(alpha_bar: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(ratio, phi, r), each (S,) float64, for the visited alpha_bar (S,), descending in t; the grid ends at sigma=0.

    Step i: x <- ratio_i x + phi_i D_i with ratio = sigma_next / sigma, phi = alpha_next (1 - e^{-h});
    r_i = h_{i-1} / h_i (r_0 is unused and set to 1).
    """
    a = alpha_bar.double()
    a_next = torch.cat([a[1:], a.new_ones(1)])
    lam, lam_next = half_log_snr(a), half_log_snr(a_next)  # lam_next[-1] = +inf
    h = lam_next - lam
    ratio = ((1 - a_next) / (1 - a)).sqrt()
    phi = a_next.sqrt() * -torch.expm1(-h)  # alpha_next (1 - e^{-h})
    r = torch.cat([h.new_ones(1), h[:-1] / h[1:]])
    return ratio, phi, r


class DPMSolverSampler:
    """DPM-Solver++ multistep (order 1 or 2) on S timesteps, ending at sigma = 0; S network evaluations."""

    clip_output = True  # the result clamped to [-1, 1], the pixels' range; decoded() turns it off for latents

    def __init__(
        self,
        *,
        steps: int = 20,  # S timesteps visited (S network evaluations)
        order: Literal[1, 2] = 2,  # 2: DPM-Solver++(2M); 1: first order (= DDIM, eta = 0)
        spacing: Spacing = "trailing",  # which S of the T timesteps: trailing, leading, linspace, logsnr, karras
        steps_offset: int = 0,  # added to `leading` timesteps (Stable Diffusion: 1); ignored by the others
        clip_denoised: bool = True,  # clip the predicted x0 to [-1, 1] before each update
    ) -> None:
        validate_spacing(spacing, steps, steps_offset)
        if order not in (1, 2):
            raise ValueError(f"order={order} is unsupported; use 2 (DPM-Solver++ 2M) or 1 (DDIM-like)")
        self.steps, self.order, self.spacing = steps, order, spacing
        self.steps_offset, self.clip_denoised = steps_offset, clip_denoised

    def timesteps(self, num_timesteps: int, alpha_bar: Tensor | None = None) -> Tensor:
        """The visited timesteps, descending: (S,) int64."""
        return interval_timesteps(
            self.spacing, num_timesteps, self.steps, steps_offset=self.steps_offset, alpha_bar=alpha_bar
        )

    def step_order(self, i: int) -> int:
        """1 on the first step (no history) and the last (into sigma = 0), else `order`."""
        return 1 if i == 0 or i == self.steps - 1 else self.order

    @torch.no_grad()
    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Solve from x_T (B, C, H, W) ~ N(0, I) to sigma = 0; returns x0 (B, C, H, W) in [-1, 1]. Deterministic."""
        alpha_bar = alpha_bar_of(sigmas.double())
        visited = self.timesteps(len(sigmas), alpha_bar)
        ratio, phi, r = (c.tolist() for c in dpm_solver_coefficients(alpha_bar[visited]))
        x, previous = x_T.float(), None
        for i, step in enumerate(visited.tolist()):
            x0 = denoiser(x, sigma_batch(sigmas, step, x), y).x0
            x0 = x0.clamp(-1, 1) if self.clip_denoised else x0
            d = x0
            if self.step_order(i) == 2:
                d = (1 + 0.5 / r[i]) * x0 - (0.5 / r[i]) * previous  # Lu et al. 2022, algorithm 2
            x = ratio[i] * x + phi[i] * d  # last step: ratio = 0, phi = 1, so x = x0_hat
            previous = x0
        return x.clamp(-1, 1) if self.clip_output else x
