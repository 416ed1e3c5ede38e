"""The one guided model call that every sampler shares.

`GuidedModel` turns a network net(x_t, t, y) into (eps, x0) predictions in float32, with
classifier-free guidance eps = (1 + w) eps_cond - w eps_uncond (Ho & Salimans 2022, eq. 6)
computed in one batched forward of [cond; uncond]. With a guidance interval (sigma_lo, sigma_hi], guidance is applied
only at steps whose noise level sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t) lies in it, and the other steps run
the conditional network alone (one call of B rows, not 2B): Kynkaanniemi et al. 2024, "Applying Guidance in a
Limited Interval Improves Sample and Distribution Quality in Diffusion Models", eq. 7.

An EDM model (ddpm.diffusion.edm, prediction "edm") is called on its preconditioned input c_in x and its output F
turned into x0 = c_skip x + c_out F (ddpm.diffusion.precond), with sigma_t in float64 from the schedule.

`network_call(net, precision)` is the one place the network runs: under bf16 autocast when precision is
"bf16" (the output cast back to float32 right after the call), untouched when it is "32". x_t, the schedule
and every sampler update stay float32 either way.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ddpm.diffusion import precond
from ddpm.diffusion.gaussian import Prediction, eps_and_x0
from ddpm.diffusion.schedule import alpha_bar_from_betas

Net = Callable[[Tensor, Tensor, Tensor | None], Tensor]
Output = Prediction | Literal["edm"]  # what a network outputs: eps, v, or EDM's F
Precision = Literal["32", "bf16"]
PRECISIONS = ("32", "bf16")


def network_call(net: Net, precision: Precision = "32") -> Net:
    """net(x, t, y) as the samplers call it: "32" is the network itself (float32, as before); "bf16" runs it
    under torch.autocast(dtype=bfloat16) on x's device type and returns its output as float32."""
    if precision == "32":
        return net
    if precision != "bf16":
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")

    def bf16(x: Tensor, t: Tensor, y: Tensor | None) -> Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = net(x, t, y)
        return out.float()

    return bf16


@dataclass(frozen=True)
class Denoised:
    """Predictions at one step: eps and x0, both (B, C, H, W) float32."""

    eps: Tensor
    x0: Tensor


class GuidedModel:
    """Wraps a network as (x_t, t, y) -> Denoised with guidance; counts network evaluations."""

    def __init__(
        self,
        *,
        net: Net,  # the (EMA) network, net(x_t, t, y) -> eps or v
        betas: Tensor,  # (T,) the training schedule, float64
        prediction: Output = "eps",  # what the network outputs: eps, v or EDM's F ("edm")
        guidance: float = 0.0,  # w of classifier-free guidance; 0 = plain conditional sampling
        null_class: int | None = None,  # index of the null label; None for an unconditional network
        precision: Precision = "32",  # "bf16": the network (only) under bf16 autocast, see network_call
        sigma_data: float | None = None,  # the run's diffusion.sigma_data: EDM's (prediction "edm") only
        guidance_interval: tuple[float, float] | None = None,  # (sigma_lo, sigma_hi]: guide only there; None: always
    ) -> None:
        if (prediction == "edm") != (sigma_data is not None):
            raise ValueError(f"prediction={prediction!r} with sigma_data={sigma_data}: an EDM model (prediction 'edm') "
                             "needs its diffusion.sigma_data, and only an EDM model takes one")  # fmt: skip
        if guidance != 0 and null_class is None:
            raise ValueError(
                f"guidance={guidance} needs a class-conditional model, but this one is unconditional "
                "(model.num_classes: null); set guidance=0 or train with model.num_classes set"
            )
        if guidance < 0:
            raise ValueError(f"guidance={guidance} must be >= 0 (0 = no guidance; 1-5 are usual)")
        self.net, self.prediction, self.guidance, self.null_class = net, prediction, guidance, null_class
        self.interval = check_interval(guidance_interval)
        self.precision = precision
        self.call = network_call(net, precision)
        self.betas = betas.double()
        self.alpha_bar = alpha_bar_from_betas(self.betas)  # (T,) float64
        self.sigma_data = sigma_data
        self.sigmas = ((1 - self.alpha_bar) / self.alpha_bar).sqrt()  # (T,) float64, EDM's sigma_t
        self.num_timesteps = len(betas)
        self.nfe = 0  # network forward calls so far (a batched cond+uncond call counts once)

    def __call__(self, x_t: Tensor, t: Tensor, y: Tensor | None) -> Denoised:
        """x_t: (B, C, H, W) float32; t: (B,) int64 timesteps of the training schedule; y: (B,) or None."""
        self.nfe += 1
        if self.sigma_data is not None:  # EDM: sigma in float64 (1 - alpha_bar loses it in float32 near sigma_min)
            sigma = self.sigmas.to(x_t.device)[t].view(-1, 1, 1, 1)
            eps, x0 = precond.denoise(lambda x: self._guided_output(x, t, y), x_t.float(), sigma, self.sigma_data)
            return Denoised(eps=eps, x0=x0)
        output = self._guided_output(x_t, t, y).float()
        a = self.alpha_bar.to(x_t.device)[t].float().view(-1, 1, 1, 1)
        eps, x0 = eps_and_x0(output, x_t, a, self.prediction)
        return Denoised(eps=eps, x0=x0)

    def guided_rows(self, t: Tensor) -> Tensor | None:
        """(B,) bool: the rows whose sigma_t lies in the guidance interval; None: no interval (every row guided)."""
        if self.interval is None:
            return None
        sigma = self.sigmas.to(t.device)[t]
        return (sigma > self.interval[0]) & (sigma <= self.interval[1])

    def _guided_output(self, x_t: Tensor, t: Tensor, y: Tensor | None) -> Tensor:
        if self.guidance == 0 or y is None:
            return self.call(x_t, t, y)
        inside = self.guided_rows(t)
        if inside is not None and not bool(inside.any()):  # outside the interval: the conditional prediction alone
            return self.call(x_t, t, y)
        uncond = torch.full_like(y, self.null_class)
        both = self.call(torch.cat([x_t, x_t]), torch.cat([t, t]), torch.cat([y, uncond])).float()
        cond, free = both.chunk(2)
        # Guidance is linear in the output, so mixing v (or eps) equals mixing eps.
        guided = (1 + self.guidance) * cond - self.guidance * free
        if inside is None or bool(inside.all()):
            return guided
        return torch.where(inside.view(-1, *[1] * (guided.dim() - 1)), guided, cond)


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
