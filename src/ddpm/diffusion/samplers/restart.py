"""Restart sampling (Xu et al. 2023, "Restart Sampling for Improving Generative Processes", algorithm 1) on the
deterministic Heun sampler of Karras et al. 2022, for a discrete-time VP model as in edm.py (x_hat space, every
sigma rounded to the nearest discrete sigma_t of the training schedule).

The main backward pass is EDM's Heun ODE solver on N rounded Karras sigmas, then sigma = 0. On reaching the grid
sigma nearest t_min, K restart cycles each (Xu et al. 2023, eq. 3-4 and their EDM code):

  forward   x <- x + sqrt(t_max^2 - t_min^2) S_noise z,   z ~ N(0, I)         (jump from t_min up to t_max)
  backward  restart_steps Heun steps on the Karras grid (rho) from t_max down to t_min

and the main pass then continues to sigma = 0. The backward grid is built from t_max and then rounded, as the main
grid is (so the jump uses the rounded t_max); t_min is the main grid's sigma itself. Network evaluations: 2N - 1
(main pass) + 2 K restart_steps. One noise draw per restart cycle, in order, from `generator`; the main pass is
deterministic. Coefficients in float64, loop in float32.

Defaults (25 NFE): N = 9 (17 NFE) and K = 2 cycles of 2 Heun steps (8 NFE) in [0.06, 0.30], the paper's
small-NFE interval for CIFAR-10 (EDM VP, table 3: [t_min, t_max] = [0.06, 0.30], K = 2, 3 sigmas per backward
pass). The interval sits at low noise, where the data scale (pixels in [-1, 1]) sets it, not sigma_max.
"""

import itertools
import math

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser
from ddpm.diffusion.samplers.edm import HatDenoiser, check, karras_sigmas, round_sigma


class RestartSampler:
    """Heun ODE steps plus K restart cycles in [t_min, t_max]; network_evaluations() = 2N - 1 + 2 K restart_steps."""

    clip_output = True  # the result clamped to [-1, 1], the pixels' range; decoded() turns it off for latents

    def __init__(
        self,
        *,
        steps: int = 9,  # N sigmas of the main pass before sigma = 0 (2N - 1 network evaluations)
        restart_steps: int = 2,  # Heun steps of each restart's backward pass (2 network evaluations each)
        restarts: int = 2,  # K restart cycles; 0 = plain Heun (EDMSampler with churn = 0)
        t_min: float = 0.06,  # sigma where restarts begin (rounded to the nearest sigma of the main grid)
        t_max: float = 0.30,  # sigma each restart jumps up to (rounded to a discrete sigma)
        s_noise: float = 1.0,  # scale of the restart noise
        rho: float = 7.0,  # rho of the Karras grids (main and restart passes)
        sigma_max: float | None = None,  # largest sigma of the main grid; None: the model's largest (as EDMSampler)
        clip_denoised: bool = True,  # clip the denoised x0 to [-1, 1] before each update
    ) -> None:
        check("steps", steps, steps >= 2, ">= 2 (restarts need a grid sigma between sigma_max and 0)")
        check("restart_steps", restart_steps, restart_steps >= 1, ">= 1")
        check("restarts", restarts, restarts >= 0, ">= 0 (0 = plain Heun)")
        check("t_min", t_min, 0 < t_min < t_max, f"> 0 and < t_max={t_max}")
        check("s_noise", s_noise, s_noise >= 0, ">= 0")
        check("rho", rho, rho > 0, "> 0")
        check("sigma_max", sigma_max, sigma_max is None or sigma_max > t_max, f"> t_max={t_max}, or null")
        self.steps, self.restart_steps, self.restarts = steps, restart_steps, restarts
        self.t_min, self.t_max = t_min, t_max
        self.s_noise, self.rho, self.sigma_max, self.clip_denoised = s_noise, rho, sigma_max, clip_denoised

    def network_evaluations(self) -> int:
        """Network calls per batch: the main pass (2N - 1) and 2 per Heun step of each restart."""
        return 2 * self.steps - 1 + 2 * self.restarts * self.restart_steps

    def timesteps(self, sigmas: Tensor) -> tuple[Tensor, int, Tensor]:
        """(main grid (N,) int64, index i of the grid sigma nearest t_min, restart grid (restart_steps + 1,) int64).

        The restart grid is the Karras grid from t_max down to the main grid's sigma at index i, rounded; its
        first sigma must lie above that one.
        """
        sigmas = sigmas.double()  # the model's (T,) levels
        high = float(sigmas[-1]) if self.sigma_max is None else self.sigma_max
        grid = round_sigma(karras_sigmas(float(sigmas[0]), high, self.steps, self.rho), sigmas)
        i = 1 + int((sigmas[grid[1:]] - self.t_min).abs().argmin())  # the grid sigma nearest t_min, after sigma_0
        low = float(sigmas[grid[i]])
        restart = round_sigma(karras_sigmas(low, self.t_max, self.restart_steps + 1, self.rho), sigmas)
        if restart[0] <= grid[i]:
            raise ValueError(
                f"t_max={self.t_max} rounds to a sigma not above the restart start {low:.4g} (the grid "
                f"sigma nearest t_min={self.t_min}): no interval to restart in; raise t_max"
            )
        return grid, i, restart

    @torch.no_grad()
    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Run the main Heun pass with K restarts from x_T (B, C, H, W) ~ N(0, I); returns x0 in [-1, 1]."""
        denoiser = HatDenoiser(denoiser, sigmas, y, clip=self.clip_denoised)
        grid, restart_at, restart = self.timesteps(sigmas)
        grid, restart = grid.tolist(), restart.tolist()
        x = x_T.float() * math.sqrt(1 + denoiser.sigma(grid[0]) ** 2)  # x_hat = x_t / sqrt(alpha_bar_t)
        jump = math.sqrt(denoiser.sigma(restart[0]) ** 2 - denoiser.sigma(restart[-1]) ** 2) * self.s_noise
        for i, t in enumerate(grid):
            x = denoiser.heun(x, t, grid[i + 1] if i + 1 < len(grid) else None)
            if i + 1 == restart_at:  # at t_min: K cycles of Xu et al. 2023, algorithm 1
                for _ in range(self.restarts):
                    x = x + jump * torch.randn(x.shape, generator=generator, device=x.device)  # forward to t_max
                    for t_cur, t_next in itertools.pairwise(restart):  # backward to t_min
                        x = denoiser.heun(x, t_cur, t_next)
        return x.clamp(-1, 1) if self.clip_output else x
