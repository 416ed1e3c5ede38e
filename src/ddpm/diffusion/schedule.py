"""Noise schedules as pure float64 functions of the number of timesteps T.

Each schedule returns betas of shape (T,), float64; alpha_bar_t = prod_{s<=t} (1 - beta_s)
(Ho et al. 2020, eq. 4 notation). Timesteps are integers 0..T-1.
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

Schedule = Callable[[int], Tensor]


def linear_betas(num_timesteps: int) -> Tensor:
    """Linear betas from 1e-4 to 0.02 at T=1000, scaled by 1000/T (Nichol & Dhariwal 2021)."""
    scale = 1000.0 / num_timesteps
    return torch.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=torch.float64)


def cosine_betas(num_timesteps: int, s: float = 0.008, max_beta: float = 0.999) -> Tensor:
    """Cosine schedule: alpha_bar(t) = f(t) / f(0), f(t) = cos^2(((t/T + s) / (1 + s)) * pi/2).

    Betas are 1 - alpha_bar(t+1) / alpha_bar(t), clipped at `max_beta` (Nichol & Dhariwal 2021, eq. 17).
    """
    t = torch.arange(num_timesteps + 1, dtype=torch.float64)
    f = torch.cos(((t / num_timesteps + s) / (1 + s)) * math.pi / 2) ** 2
    alpha_bar = f / f[0]
    return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=max_beta)


SCHEDULES: dict[str, Schedule] = {"linear": linear_betas, "cosine": cosine_betas}


def alpha_bar_from_betas(betas: Tensor) -> Tensor:
    """alpha_bar_t = prod_{s=0..t} (1 - beta_s); (T,) float64."""
    return torch.cumprod(1 - betas.double(), dim=0)


def betas_from_alpha_bar(alpha_bar: Tensor) -> Tensor:
    """Inverse of `alpha_bar_from_betas`: beta_i = 1 - alpha_bar_i / alpha_bar_{i-1}, alpha_bar_{-1} = 1."""
    previous = torch.cat([alpha_bar.new_ones(1), alpha_bar[:-1]])
    return 1 - alpha_bar / previous


def respaced_timesteps(num_timesteps: int, steps: int) -> Tensor:
    """`steps` timesteps evenly spaced over 0..T-1, first and last included (improved-diffusion's
    `space_timesteps` for one section): round(i * (T - 1) / (steps - 1)). (steps,) int64, ascending."""
    if not 1 <= steps <= num_timesteps:
        raise ValueError(
            f"steps={steps} must be between 1 and the model's T={num_timesteps}; "
            f"set steps to at most {num_timesteps} (steps=null: all of them)"
        )
    if steps == 1:
        return torch.tensor([num_timesteps - 1])
    stride = (num_timesteps - 1) / (steps - 1)
    return torch.tensor(sorted({round(i * stride) for i in range(steps)}), dtype=torch.int64)


def make_betas(schedule: str, num_timesteps: int) -> Tensor:
    """Look up `schedule` in SCHEDULES and build its (T,) float64 betas."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {sorted(SCHEDULES)}")
    if num_timesteps < 1:
        raise ValueError(f"num_timesteps={num_timesteps} must be >= 1 (1000 is the usual value)")
    betas = SCHEDULES[schedule](num_timesteps)
    if not valid_betas(betas):
        smallest = next((t for t in range(num_timesteps + 1, 100_001) if valid_betas(SCHEDULES[schedule](t))), None)
        raise ValueError(
            f"schedule={schedule} with num_timesteps={num_timesteps} gives betas in "
            f"[{betas.min().item():.3g}, {betas.max().item():.3g}], not inside (0, 1): alpha_bar would reach 0 or go "
            f"negative and the loss NaN. Use num_timesteps>={smallest} (the smallest T that works) or "
            "schedule=cosine"
        )
    return betas


def valid_betas(betas: Tensor) -> bool:
    """Every beta in (0, 1), so that alpha_bar_t stays in (0, 1] and decreases."""
    return bool(((betas > 0) & (betas < 1)).all())
