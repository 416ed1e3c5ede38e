"""What every sampler shares: the call `sample(denoiser, x_T, sigmas, y, generator=...)` and the noise level of a
step as a batch.

A sampler gets the model's noise levels `sigmas` ((T,) float64, ascending; ddpm.diffusion.denoiser) and chooses
which to visit; alpha_bar = 1 / (1 + sigma^2) where its update is written in alpha_bar (DDPM, DDIM, DPM-Solver), or
it works in EDM's x_hat = x sqrt(1 + sigma^2) (Heun, restart). It calls `denoiser(x, sigma, y).x0` and nothing else
of the model. Coefficients in float64, the loop in float32.
"""

import copy
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser


class Sampler(Protocol):
    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor: ...  # fmt: skip


def sigma_batch(sigmas: Tensor, t: int, x: Tensor) -> Tensor:
    """The level sigma_t for every row of x: (B,) float64 on x's device."""
    return torch.full((x.shape[0],), float(sigmas[t]), dtype=torch.float64, device=x.device)


class Decoded:
    """A sampler of latents whose images are decoded: `decode(sampler.sample(...))` (latent diffusion: the VAE's
    decoder, pixels in [-1, 1]). The inner sampler must not clip its x0 predictions or its result to [-1, 1], the
    range of pixels, not of latents (`decoded` turns clip_denoised and clip_output off)."""

    def __init__(self, sampler: Sampler, decode: Callable[[Tensor], Tensor]) -> None:
        self.sampler, self.decode = sampler, decode

    def sample(
        self, denoiser: Denoiser, x_T: Tensor, sigmas: Tensor, y: Tensor | None, *,
        generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        return self.decode(self.sampler.sample(denoiser, x_T, sigmas, y, generator=generator))


def decoded(sampler: Sampler, decode: Callable[[Tensor], Tensor] | None) -> Sampler:
    """`sampler` as is (decode None: pixel diffusion), or drawing latents decoded to pixels, x0 clipping off."""
    if decode is None:
        return sampler
    sampler = copy.copy(sampler)  # the caller's sampler (a callback's, kept across grids) stays a pixel sampler
    if getattr(sampler, "clip_denoised", False):
        sampler.clip_denoised = False  # [-1, 1] is the pixels' range: latents have their own
    if getattr(sampler, "clip_output", False):
        sampler.clip_output = False  # and the result is the decoder's input, not an image
    return Decoded(sampler, decode)
