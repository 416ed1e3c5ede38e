"""DDIM sampling (Song et al. 2021, "Denoising Diffusion Implicit Models", eq. 12 and 16).

From timestep t to the next visited timestep s < t (alpha_bar written a):

  x_s = sqrt(a_s) x0_hat + sqrt(1 - a_s - sigma_t^2) eps_hat + sigma_t z,    z ~ N(0, I)        (eq. 12)
  sigma_t = eta sqrt((1 - a_s) / (1 - a_t)) sqrt(1 - a_t / a_s)                                  (eq. 16)

eta = 0 is the deterministic DDIM; eta = 1 gives the DDPM posterior variance beta_tilde, so DDIM on all
T timesteps with eta = 1 is ancestral DDPM sampling. The last step goes from the smallest visited
timestep to a_s = 1 (diffusers' set_alpha_to_one=True), so it returns x0_hat itself.

eps_hat is re-derived from the (clipped) x0_hat, eps_hat = (x_t - sqrt(a_t) x0_hat) / sqrt(1 - a_t), as
guided-diffusion does (diffusers' use_clipped_model_output=True); without clipping this is the network's
eps. The step is then linear in (x0_hat, x_t), with coefficients computed once in float64:

  x_s = c0 x0_hat + ct x_t + sigma_t z,  ct = sqrt(1 - a_s - sigma_t^2) / sqrt(1 - a_t),  c0 = sqrt(a_s) - ct sqrt(a_t)
"""

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser, alpha_bar_of
from ddpm.diffusion.samplers.base import sigma_batch
from ddpm.diffusion.samplers.spacing import SCHEDULE_SPACINGS, Spacing, step_timesteps, validate_spacing


def ddim_coefficients(alpha_bar: Tensor, eta: float) -> tuple[Tensor, Tensor, Tensor]:
    """(c0, ct, sigma), each (S,) float64, for the visited alpha_bar (S,), descending in t; the last step goes to 1."""
    a_t = alpha_bar.double()
    a_s = torch.cat([a_t[1:], a_t.new_ones(1)])  # alpha_bar at the next visited timestep
    sigma = eta * ((1 - a_s) / (1 - a_t) * (1 - a_t / a_s)).sqrt()  # Song et al. 2021, eq. 16
    ct = (1 - a_s - sigma**2).clamp(min=0).sqrt() / (1 - a_t).sqrt()
    c0 = a_s.sqrt() - ct * a_t.sqrt()
    return c0, ct, sigma


class DDIMSampler:
    """x_s = sqrt(a_s) x0_hat + sqrt(1 - a_s - sigma^2) eps_hat + sigma z on S timesteps; S network evaluations."""

    clip_output = True  # the result clamped to [-1, 1], the pixels' range; decoded() turns it off for latents

    def __init__(
        self,
        *,
        steps: int = 50,  # S timesteps visited (S network evaluations)
        eta: float = 0.0,  # noise scale of eq. 16: 0 = deterministic DDIM, 1 = DDPM posterior variance
        spacing: Spacing = "trailing",  # which S of the T timesteps: trailing, leading or linspace
        steps_offset: int = 0,  # added to `leading` timesteps (Stable Diffusion: 1); ignored by the others
        clip_denoised: bool = True,  # clip the predicted x0 to [-1, 1] (and re-derive eps from it)
    ) -> None:
        validate_spacing(spacing, steps, steps_offset)
        if spacing in SCHEDULE_SPACINGS:
            raise ValueError(f"spacing={spacing} is for sampler=dpm_solver / dpm_solver_sde; use trailing here")
        if eta < 0:
            raise ValueError(f"eta={eta} must be >= 0 (0 = deterministic DDIM, 1 = DDPM-like noise)")
        if steps == 1 and spacing != "trailing":  # linspace's one timestep is 0, leading's steps_offset
            t = steps_offset if spacing == "leading" else 0
            raise ValueError(f"spacing={spacing!r} with steps=1 evaluates the network only at t={t}, where x_T is "
                             "still pure noise: the noise comes back as the sample; use spacing=trailing (its one "
                             "step is t = T - 1)")  # fmt: skip
        self.steps, self.eta, self.spacing = steps, eta, spacing
        self.steps_offset, self.clip_denoised = steps_offset, clip_denoised

    def timesteps(self, num_timesteps: int) -> Tensor:
        """The visited timesteps, descending: (S,) int64."""
        return step_timesteps(self.spacing, num_timesteps, self.steps, steps_offset=self.steps_offset)

    @torch.no_grad()
    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Run DDIM from x_T (B, C, H, W) ~ N(0, I); returns x0 (B, C, H, W) in [-1, 1]."""
        visited = self.timesteps(len(sigmas))
        c0, ct, sigma = (c.tolist() for c in ddim_coefficients(alpha_bar_of(sigmas.double())[visited], self.eta))
        x = x_T.float()
        for i, step in enumerate(visited.tolist()):
            x0 = denoiser(x, sigma_batch(sigmas, step, x), y).x0
            x0 = x0.clamp(-1, 1) if self.clip_denoised else x0
            x = c0[i] * x0 + ct[i] * x  # Song et al. 2021, eq. 12, without the noise
            if sigma[i] > 0:
                x = x + sigma[i] * torch.randn(x.shape, generator=generator, device=x.device)
        return x.clamp(-1, 1) if self.clip_output else x
