"""lightning-ddpm: denoising diffusion models trained with Lightning and configured with Hydra."""

__version__ = "0.1.0"
