"""EDM's preconditioning (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models",
table 1 and section 5), written for the variance-preserving images our samplers hold.

EDM writes a noisy image as x = x0 + sigma n and trains the denoiser

  D(x; sigma) = c_skip(sigma) x + c_out(sigma) F(c_in(sigma) x; c_noise(sigma))
  c_skip = sigma_data^2 / (sigma^2 + sigma_data^2)      c_out = sigma sigma_data / sqrt(sigma^2 + sigma_data^2)
  c_in   = 1 / sqrt(sigma^2 + sigma_data^2)             lambda = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2

with loss lambda(sigma) ||D(x; sigma) - x0||^2 = lambda c_out^2 ||F - (x0 - c_skip x) / c_out||^2, and
lambda c_out^2 = 1: the network's target (x0 - c_skip x) / c_out and its input c_in x both have unit variance
when the data has standard deviation sigma_data (sec. 5, appendix B.6).

The samplers hold x_t = sqrt(alpha_bar) (x0 + sigma eps) with sigma^2 = (1 - alpha_bar) / alpha_bar (a VP image;
EDM's x = x_t / sqrt(alpha_bar) = x_t sqrt(1 + sigma^2)), so the network is called on
c_in x = x_t sqrt(1 + sigma^2) / sqrt(sigma^2 + sigma_data^2). c_noise is the noise level's index t, as for EDM's
own discrete models (iDDPMPrecond, c_noise = M - 1 - j) and every model here. Shapes: sigma broadcasts against the
images, e.g. (B, 1, 1, 1); sigma > 0.
"""

from collections.abc import Callable

from torch import Tensor


def c_skip(sigma: Tensor, sigma_data: float) -> Tensor:
    """sigma_data^2 / (sigma^2 + sigma_data^2) (Karras et al. 2022, table 1)."""
    return sigma_data**2 / (sigma**2 + sigma_data**2)


def c_out(sigma: Tensor, sigma_data: float) -> Tensor:
    """sigma sigma_data / sqrt(sigma^2 + sigma_data^2) (table 1)."""
    return sigma * sigma_data / (sigma**2 + sigma_data**2).sqrt()


def c_in(sigma: Tensor, sigma_data: float) -> Tensor:
    """1 / sqrt(sigma^2 + sigma_data^2) (table 1)."""
    return (sigma**2 + sigma_data**2).rsqrt()


def loss_weight(sigma: Tensor, sigma_data: float) -> Tensor:
    """lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2 = 1 / c_out^2 (table 1)."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def f_target(x0: Tensor, x: Tensor, sigma: Tensor, sigma_data: float) -> Tensor:
    """The network's training target (x0 - c_skip x) / c_out for x = x0 + sigma n (eq. 8)."""
    return (x0 - c_skip(sigma, sigma_data) * x) / c_out(sigma, sigma_data)


def vp_input_scale(sigma: Tensor, sigma_data: float) -> Tensor:
    """The factor from a VP image x_t to the network input c_in x: sqrt(1 + sigma^2) c_in(sigma)."""
    return (1 + sigma**2).sqrt() * c_in(sigma, sigma_data)


def eps_and_x0_from_f(output: Tensor, x_t: Tensor, sigma: Tensor, sigma_data: float) -> tuple[Tensor, Tensor]:
    """(eps, x0) of the VP image x_t from the network output F: x0 = D(x; sigma) = c_skip x + c_out F with
    x = x_t sqrt(1 + sigma^2), and eps = (x - x0) / sigma (x = x0 + sigma eps)."""
    x = x_t * (1 + sigma**2).sqrt()
    x0 = c_skip(sigma, sigma_data) * x + c_out(sigma, sigma_data) * output
    return (x - x0) / sigma, x0


def denoise(
    network: Callable[[Tensor], Tensor], x_t: Tensor, sigma: Tensor, sigma_data: float
) -> tuple[Tensor, Tensor]:
    """(eps, x0) at the VP image x_t, in x_t's dtype: `network` (F of its input, e.g. a guided call) run on c_in x,
    the coefficients in sigma's dtype (float64 keeps sigma_min's 1 - alpha_bar)."""
    output = network(x_t * vp_input_scale(sigma, sigma_data).to(x_t.dtype))
    eps, x0 = eps_and_x0_from_f(output.to(sigma.dtype), x_t.to(sigma.dtype), sigma, sigma_data)
    return eps.to(x_t.dtype), x0.to(x_t.dtype)
