"""benchmarks/mnist_recipe.py's ceiling of a latent run: the held-out digits through its VAE, reconstructed as
diffusers alone reconstructs them (posterior mean + std x the seeded noise, decoded, rounded to uint8)."""

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import mnist_recipe

from ddpm.models.vae import VAE

pytest.importorskip("diffusers")

TINY_VAE = dict(in_channels=1, out_channels=1, down_block_types=["DownEncoderBlock2D"] * 2,
                up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                latent_channels=2, norm_num_groups=4, sample_size=16)  # fmt: skip


class Recorder:
    """A Scorer's two calls the ceiling makes: the held-out digits it is given, and the images it is asked to score."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels, self.scored = images, labels, None

    def held_out(self, num: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[:num], self.labels[:num]

    def score(self, images: torch.Tensor, labels: torch.Tensor) -> Namespace:
        self.scored = images, labels
        return Namespace(intervals={"cfid": {"value": 1.0}})


def test_the_ceiling_scores_the_vae_reconstructions_diffusers_makes() -> None:
    torch.manual_seed(0)
    vae = VAE.from_config(TINY_VAE)
    vae.scale, vae.shift = 1.7, 0.2  # a scaled latent space: the ceiling must undo it as decoding does
    images, labels = torch.randint(0, 256, (6, 1, 16, 16), dtype=torch.uint8), torch.arange(6)
    scorer = Recorder(images, labels)
    rows = mnist_recipe.Rows(Namespace(num_samples=5, seed=3), torch.device("cpu"), scorer, Path("unused"))
    rows.models[Path("run/ema.pt")] = (None, None, {}, vae)  # what Rows.model loads for a latent run

    assert rows.ceiling(Path("run/ema.pt")) == {"cfid": {"value": 1.0}}
    reconstructed, scored_labels = scorer.scored
    with torch.no_grad():  # diffusers alone, from the same uint8 digits and the same seeded noise
        posterior = vae.autoencoder.encode(images[:5].float() / 127.5 - 1).latent_dist
        noise = torch.randn(posterior.mean.shape, generator=torch.Generator().manual_seed(3))
        decoded = vae.autoencoder.decode(posterior.mean + posterior.std * noise).sample
    expected = ((decoded.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    assert reconstructed.dtype == torch.uint8 and torch.equal(scored_labels, labels[:5])
    assert (reconstructed.int() - expected.int()).abs().max() <= 1  # the scale's round trip: float rounding only


def test_a_pixel_run_has_no_ceiling() -> None:
    rows = mnist_recipe.Rows(Namespace(num_samples=5, seed=0), torch.device("cpu"), None, Path("unused"))
    rows.models[Path("run/ema.pt")] = (None, None, {}, None)
    assert rows.ceiling(Path("run/ema.pt")) is None
