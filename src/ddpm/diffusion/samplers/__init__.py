"""Samplers: each turns a denoiser (ddpm.diffusion.denoiser), x_T ~ N(0, I) and the model's noise levels into
images in [-1, 1]."""
