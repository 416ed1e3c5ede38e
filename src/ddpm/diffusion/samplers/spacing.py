"""Which of the T training timesteps a few-step sampler visits.

The three spacings of Lin et al. 2024 ("Common Diffusion Noise Schedules and Sample Steps are Flawed",
table 2), as diffusers' schedulers define them, for T training timesteps and S sampling steps:

  linspace  round(i * (T - 1) / (S - 1))      from T - 1 down to 0
  leading   i * (T // S) + steps_offset         from (S - 1) * (T // S) + steps_offset down to steps_offset
  trailing  round(T - i * T / S) - 1            from T - 1 down to round(T / S) - 1

Two more follow the schedule rather than the timestep index (they need alpha_bar), for the interval family:

  logsnr    lambda = log(alpha / sigma) uniform from lambda_{T-1} to lambda_0 (Lu et al. 2022, DPM-Solver,
            sec. 3.3: "logSNR" steps, recommended for low-resolution pixel models), each to the nearest t
  karras    sigma = sqrt((1 - alpha_bar) / alpha_bar) on Karras et al. 2022's eq. 5 grid (rho = 7) from
            sigma_{T-1} to sigma_0, each to the nearest t (diffusers' use_karras_sigmas rounds the same way)

Both end at t = 0, so the last network call of a DPM-Solver sees almost clean data (sigma_0 = 0.01 for the
linear schedule), where trailing ends at round(T / S) - 1 (t = 49 at S = 20: sigma = 0.17).

Two families of samplers use them differently:

* `step_timesteps` (diffusers' DDIMScheduler and DDPMScheduler): the model is evaluated at all S
  timesteps, and the last step goes from the smallest of them to alpha_bar = 1.
* `interval_timesteps` (diffusers' DPMSolverMultistepScheduler): the grid has S + 1 points whose last
  is the clean end (sigma = 0); linspace and leading lay S + 1 points and drop the final 0, trailing
  is unchanged. The model is evaluated at the first S.

diffusers builds trailing with np.arange(T, 0, -T / S), which for some S (61, 103, 121, ... at T = 1000)
returns S + 1 entries, the last of them -1. Here trailing is the first S values of that arange (computed
the same way, bit for bit), so it always has S entries. Settings under which diffusers would repeat
timesteps or leave 0..T-1 raise a ValueError here.
"""

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

Spacing = Literal["trailing", "leading", "linspace", "logsnr", "karras"]
SCHEDULE_SPACINGS = ("logsnr", "karras")  # need alpha_bar; interval family only


def _linspace(num_timesteps: int, steps: int, steps_offset: int) -> Tensor:
    stride = (num_timesteps - 1) / (steps - 1) if steps > 1 else 0.0
    return (torch.arange(steps, dtype=torch.float64) * stride).round().flip(0)  # i * stride, as np.linspace


def _leading(num_timesteps: int, steps: int, steps_offset: int) -> Tensor:
    return (torch.arange(steps, dtype=torch.float64) * (num_timesteps // steps) + steps_offset).flip(0)


def _trailing(num_timesteps: int, steps: int, steps_offset: int) -> Tensor:
    # T + i * delta with delta = (T - T / S) - T: the values np.arange(T, 0, -T / S) fills in, bit for bit,
    # so that ties at .5 round as in diffusers.
    delta = (num_timesteps - num_timesteps / steps) - num_timesteps
    return (num_timesteps + torch.arange(steps, dtype=torch.float64) * delta).round() - 1


SPACINGS: dict[str, Callable[[int, int, int], Tensor]] = {
    "linspace": _linspace,
    "leading": _leading,
    "trailing": _trailing,
}


def _checked(timesteps: Tensor, num_timesteps: int, spacing: str, steps: int) -> Tensor:
    """Refuse repeated or out-of-range timesteps; (S,) int64, strictly descending."""
    timesteps = timesteps.to(torch.int64)
    if timesteps.max() > num_timesteps - 1 or timesteps.min() < 0:
        raise ValueError(
            f"spacing={spacing!r} with steps={steps} gives timesteps {timesteps.tolist()[:3]}..., "
            f"outside the model's 0..{num_timesteps - 1}; lower steps_offset or steps"
        )
    if len(timesteps) > 1 and not bool((timesteps[:-1] > timesteps[1:]).all()):
        raise ValueError(
            f"spacing={spacing!r} repeats timesteps with steps={steps} and T={num_timesteps}; use fewer steps"
        )
    return timesteps


def _validate(spacing: str, num_timesteps: int, steps: int) -> None:
    validate_spacing(spacing, steps, 0)
    if not 1 <= steps <= num_timesteps:
        raise ValueError(
            f"steps={steps} must be between 1 and the model's T={num_timesteps}; set steps to at most {num_timesteps}"
        )


def step_timesteps(spacing: Spacing, num_timesteps: int, steps: int, *, steps_offset: int = 0) -> Tensor:
    """S timesteps at which the model is evaluated, descending: (S,) int64 (DDIMScheduler's definition).

    steps_offset shifts `leading` only (Stable Diffusion uses 1); the other spacings ignore it, as in diffusers.
    """
    if spacing in SCHEDULE_SPACINGS:
        raise ValueError(f"spacing={spacing} is for sampler=dpm_solver / dpm_solver_sde; use trailing here")
    _validate(spacing, num_timesteps, steps)
    return _checked(SPACINGS[spacing](num_timesteps, steps, steps_offset), num_timesteps, spacing, steps)


def interval_timesteps(
    spacing: Spacing, num_timesteps: int, steps: int, *, steps_offset: int = 0, alpha_bar: Tensor | None = None
) -> Tensor:
    """S model timesteps of a grid whose final point is sigma = 0, descending: (S,) int64
    (DPMSolverMultistepScheduler's definition: linspace and leading place S + 1 points, the last dropped;
    logsnr and karras place S points from t = T - 1 to t = 0 by the schedule `alpha_bar` (T,))."""
    _validate(spacing, num_timesteps, steps)
    if spacing in SCHEDULE_SPACINGS:
        if alpha_bar is None or len(alpha_bar) != num_timesteps:
            raise ValueError(f"spacing={spacing} follows the schedule: pass the model's alpha_bar (T,)")
        return _checked(schedule_grid(spacing, alpha_bar.double(), steps), num_timesteps, spacing, steps)
    if spacing == "trailing":
        grid = _trailing(num_timesteps, steps, steps_offset)
    else:
        grid = SPACINGS[spacing](num_timesteps, steps + 1, steps_offset)[:-1]
    return _checked(grid, num_timesteps, spacing, steps)


SIGMA_MAX = 80.0  # the grids' top sigma / alpha when the schedule's is larger (EDM's; cosine's sigma_{T-1} is 2e4)


def schedule_grid(spacing: str, alpha_bar: Tensor, steps: int) -> Tensor:
    """The S timesteps nearest a grid uniform in lambda (logsnr) or on Karras' rho = 7 sigmas (karras), from
    min(sigma_{T-1}, SIGMA_MAX) down to sigma_0, with t = T - 1 first (where x_T is pure noise): (S,) int64."""
    lam = 0.5 * (alpha_bar.log() - (1 - alpha_bar).log())  # (T,), descending in t; sigma / alpha = e^{-lambda}
    top = max(float(lam[-1]), -math.log(SIGMA_MAX))
    if spacing == "logsnr":
        target = torch.linspace(top, float(lam[0]), steps, dtype=torch.float64)
    else:
        rho, i = 7.0, torch.linspace(0, 1, steps, dtype=torch.float64)
        hi, lo = math.exp(-top) ** (1 / rho), math.exp(-float(lam[0])) ** (1 / rho)
        target = -((hi + i * (lo - hi)) ** rho).log()
    grid = (target.reshape(-1, 1) - lam.reshape(1, -1)).abs().argmin(1)
    grid[0] = len(alpha_bar) - 1
    return grid


def validate_spacing(spacing: str, steps: int, steps_offset: int) -> None:
    """Constructor-time checks that need no T: the spacing name, steps >= 1 and steps_offset >= 0."""
    if spacing not in SPACINGS and spacing not in SCHEDULE_SPACINGS:
        raise ValueError(f"spacing={spacing!r} is unknown; use one of {[*sorted(SPACINGS), *SCHEDULE_SPACINGS]}")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if steps_offset < 0:
        raise ValueError(f"steps_offset={steps_offset} must be >= 0 (1 for Stable Diffusion's leading)")
