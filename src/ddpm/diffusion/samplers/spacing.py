"""Which of the T training timesteps a few-step sampler visits.

The three spacings of Lin et al. 2024 ("Common Diffusion Noise Schedules and Sample Steps are Flawed",
table 2), as diffusers' schedulers define them, for T training timesteps and S sampling steps:

  linspace  round(i * (T - 1) / (S - 1))      from T - 1 down to 0
  leading   i * (T // S) + steps_offset         from (S - 1) * (T // S) + steps_offset down to steps_offset
  trailing  round(T - i * T / S) - 1            from T - 1 down to round(T / S) - 1

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

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

Spacing = Literal["trailing", "leading", "linspace"]


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
            f"sampler.spacing={spacing!r} with sampler.steps={steps} gives timesteps {timesteps.tolist()[:3]}..., "
            f"outside the model's 0..{num_timesteps - 1}; lower sampler.steps_offset or sampler.steps"
        )
    if len(timesteps) > 1 and not bool((timesteps[:-1] > timesteps[1:]).all()):
        raise ValueError(
            f"sampler.spacing={spacing!r} repeats timesteps with sampler.steps={steps} and T={num_timesteps}; "
            "use fewer sampler.steps"
        )
    return timesteps


def _validate(spacing: str, num_timesteps: int, steps: int) -> None:
    validate_spacing(spacing, steps, 0)
    if not 1 <= steps <= num_timesteps:
        raise ValueError(
            f"sampler.steps={steps} must be between 1 and the model's T={num_timesteps}; "
            f"set sampler.steps to at most {num_timesteps}"
        )


def step_timesteps(spacing: Spacing, num_timesteps: int, steps: int, *, steps_offset: int = 0) -> Tensor:
    """S timesteps at which the model is evaluated, descending: (S,) int64 (DDIMScheduler's definition).

    steps_offset shifts `leading` only (Stable Diffusion uses 1); the other spacings ignore it, as in diffusers.
    """
    _validate(spacing, num_timesteps, steps)
    return _checked(SPACINGS[spacing](num_timesteps, steps, steps_offset), num_timesteps, spacing, steps)


def interval_timesteps(spacing: Spacing, num_timesteps: int, steps: int, *, steps_offset: int = 0) -> Tensor:
    """S model timesteps of a grid whose final point is sigma = 0, descending: (S,) int64
    (DPMSolverMultistepScheduler's definition: linspace and leading place S + 1 points, the last dropped)."""
    _validate(spacing, num_timesteps, steps)
    if spacing == "trailing":
        grid = _trailing(num_timesteps, steps, steps_offset)
    else:
        grid = SPACINGS[spacing](num_timesteps, steps + 1, steps_offset)[:-1]
    return _checked(grid, num_timesteps, spacing, steps)


def validate_spacing(spacing: str, steps: int, steps_offset: int) -> None:
    """Constructor-time checks that need no T: the spacing name, steps >= 1 and steps_offset >= 0."""
    if spacing not in SPACINGS:
        raise ValueError(f"sampler.spacing={spacing!r} is unknown; use one of {sorted(SPACINGS)}")
    if steps < 1:
        raise ValueError(f"sampler.steps={steps} must be >= 1")
    if steps_offset < 0:
        raise ValueError(f"sampler.steps_offset={steps_offset} must be >= 0 (1 for Stable Diffusion's leading)")
