"""The denoiser: a network wrapped once by its diffusion family, in the style of EDM's `EDMPrecond` and k-diffusion's
`external.py`. Plain torch.

Every sampler talks to a model through one interface, `denoiser(x, sigma, y) -> Denoised(eps, x0)`:

- `sigma`: (B,) float64, noise levels from the denoiser's own grid `denoiser.sigmas` ((T,) float64, ascending: the
  T levels the network was trained on; EDM's sigma_t, or sqrt((1 - alpha_bar_t) / alpha_bar_t) for a DDPM schedule);
- `x`: (B, C, H, W) float32, the variance-preserving image at that level, x = (x0 + sigma eps) / sqrt(1 + sigma^2)
  (so alpha_bar = 1 / (1 + sigma^2), `alpha_bar_of`); EDM's x_hat = x0 + sigma eps is x sqrt(1 + sigma^2);
- `y`: (B,) int64 labels, or None.

A denoiser is `output` (the network's raw prediction: eps, v or EDM's F, float32) followed by `denoised` (that
prediction as eps and x0). Each diffusion family defines its own: `GaussianDiffusion.denoiser(net)` (eps or v on a
DDPM schedule, ddpm.diffusion.gaussian.VPDenoiser), `EDMDiffusion.denoiser(net)` (EDM's preconditioning,
ddpm.diffusion.edm.EDMDenoiser). Guidance (`Guided`) wraps a denoiser and mixes the outputs of its conditional and
unconditional calls, eps = (1 + w) eps_cond - w eps_uncond (Ho & Salimans 2022, eq. 6), in one batched call of
[cond; uncond]; with a guidance interval (sigma_lo, sigma_hi] only the rows whose sigma lies in it are guided
(Kynkaanniemi et al. 2024, eq. 7) and a step with none of them calls the conditional network alone. Guidance is
linear in the output, so mixing v or F equals mixing eps or x0.

The network runs at the level's index t (its time input), found from sigma (`level`): the nearest level, exact for
the grid's own values, which is what samplers pass.
"""

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

Net = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # net(x, t, y): (B, C, H, W), (B,) int64, (B,) or None


@dataclass(frozen=True)
class Denoised:
    """Predictions at one step: eps and x0, both (B, C, H, W) float32."""

    eps: Tensor
    x0: Tensor


class Denoiser(Protocol):
    sigmas: Tensor  # (T,) float64, ascending: the model's noise levels

    def output(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Tensor: ...

    def denoised(self, x: Tensor, sigma: Tensor, output: Tensor) -> Denoised: ...

    def __call__(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Denoised: ...


def alpha_bar_of(sigmas: Tensor) -> Tensor:
    """alpha_bar = 1 / (1 + sigma^2): the VP schedule of noise levels sigma (any shape, float64 recommended)."""
    return 1 / (1 + sigmas**2)


class Levels(ABC):
    """A grid of T noise levels and the nearest-level lookup the denoisers share; `__call__` = denoised(output)."""

    def __init__(self, sigmas: Tensor) -> None:
        self.sigmas = sigmas.double().cpu()  # (T,) ascending
        self._on: dict[torch.device, Tensor] = {}

    def grid(self, device: torch.device) -> Tensor:
        """The levels on `device` (float64), cached."""
        if device not in self._on:
            self._on[device] = self.sigmas.to(device)
        return self._on[device]

    def level(self, sigma: Tensor) -> Tensor:
        """The index t of the level nearest each sigma: (B,) int64 (exact for the grid's own values)."""
        grid = self.grid(sigma.device)
        upper = torch.searchsorted(grid, sigma.double().contiguous()).clamp(1, len(grid) - 1)
        lower_nearer = (sigma - grid[upper - 1]) <= (grid[upper] - sigma)
        return torch.where(lower_nearer, upper - 1, upper)

    @abstractmethod
    def output(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Tensor:
        """The network's raw prediction at (x, sigma, y), float32."""

    @abstractmethod
    def denoised(self, x: Tensor, sigma: Tensor, output: Tensor) -> Denoised:
        """`output` as eps and x0 at (x, sigma)."""

    def __call__(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Denoised:
        return self.denoised(x, sigma, self.output(x, sigma, y))


def guidance_refusal(guidance: float, *, num_classes: int | None, p_uncond: float | None = None) -> str | None:
    """Why a model cannot be guided with weight `guidance` (None: it can). Guidance mixes the conditional
    prediction with the null class's (unconditional) one, so it needs a class-conditional model (num_classes)
    whose null class was trained: labels dropped to it with probability p_uncond > 0."""
    if not guidance >= 0 or guidance == math.inf:  # NaN too: it fails every comparison
        return "a guidance weight must be finite and >= 0 (0 = no guidance; 1-5 are usual)"
    if guidance == 0:
        return None
    if num_classes is None:
        return "guidance needs a class-conditional model (num_classes), and this one is unconditional"
    if p_uncond is not None and p_uncond <= 0:
        return (
            f"guidance needs the model's unconditional (null-class) prediction, but it was trained with p_uncond="
            f"{p_uncond}: no label was ever dropped to the null class, so that prediction is untrained and guided "
            "samples would be noise"
        )
    return None


class Guided:
    """Classifier-free guidance around a denoiser (module docstring); the same interface as the denoiser it wraps."""

    def __init__(
        self,
        denoiser: Denoiser,
        *,
        guidance: float,  # w; 0 = plain conditional sampling
        null_class: int,  # the label of the unconditional prediction
        interval: tuple[float, float] | None = None,  # (sigma_lo, sigma_hi]: guide only there; None: every step
    ) -> None:
        if (refusal := guidance_refusal(guidance, num_classes=null_class)) is not None:
            raise ValueError(f"guidance={guidance}: {refusal}")
        self.denoiser, self.guidance, self.null_class = denoiser, guidance, null_class
        self.interval = check_interval(interval)
        self.sigmas = denoiser.sigmas

    def guided_rows(self, sigma: Tensor) -> Tensor | None:
        """(B,) bool: the rows whose sigma lies in the interval; None: no interval (every row guided)."""
        if self.interval is None:
            return None
        return (sigma > self.interval[0]) & (sigma <= self.interval[1])

    def output(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Tensor:
        inside = self.guided_rows(sigma)
        if self.guidance == 0 or y is None or (inside is not None and not bool(inside.any())):
            return self.denoiser.output(x, sigma, y)  # the conditional prediction alone
        uncond = torch.full_like(y, self.null_class)
        both = self.denoiser.output(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([y, uncond])).float()
        cond, free = both.chunk(2)
        guided = (1 + self.guidance) * cond - self.guidance * free
        if inside is None or bool(inside.all()):
            return guided
        return torch.where(inside.view(-1, *[1] * (guided.dim() - 1)), guided, cond)

    def denoised(self, x: Tensor, sigma: Tensor, output: Tensor) -> Denoised:
        return self.denoiser.denoised(x, sigma, output)

    def __call__(self, x: Tensor, sigma: Tensor, y: Tensor | None) -> Denoised:
        return self.denoised(x, sigma, self.output(x, sigma, y))


def check_interval(interval: tuple[float, float] | None) -> tuple[float, float] | None:
    """A guidance interval as (sigma_lo, sigma_hi) floats, refused unless 0 <= sigma_lo < sigma_hi."""
    if interval is None:
        return None
    if len(interval) != 2:
        raise ValueError(
            f"guidance interval {list(interval)}: give two noise levels [sigma_lo,sigma_hi] (e.g. [0.3,5])"
        )
    lo, hi = float(interval[0]), float(interval[1])
    if not 0 <= lo < hi:
        raise ValueError(f"guidance interval [{lo:g}, {hi:g}]: needs 0 <= sigma_lo < sigma_hi (e.g. [0.3,5])")
    return lo, hi
