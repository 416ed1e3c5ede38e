"""Sample on every rank and measure: the pieces sample.py and the training-time FID callback share."""

import time

import torch
from torch import Tensor

from ddpm.diffusion.denoiser import Denoiser
from ddpm.diffusion.generate import Generated, generate
from ddpm.diffusion.samplers.base import Sampler
from ddpm.metrics.features import FeatureExtractor
from ddpm.ranks import all_gather_rows, world


def shard(num_samples: int, batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first index, count) of `rank`: batches 0..ceil(N/B)-1 dealt out in contiguous, balanced runs. Rank r draws
    the images [first, first + count) of the N requested, in whole batches, so each image's noise (seeded by its
    batch's start) and label are those one process would draw: the gathered set is the same for any world size."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
    batches = -(-num_samples // batch_size)
    begin, end = rank * batches // world_size, (rank + 1) * batches // world_size
    first, stop = begin * batch_size, min(end * batch_size, num_samples)
    return first, max(0, stop - first)


def generate_shard(
    denoiser: Denoiser, sampler: Sampler, shape: tuple[int, int, int, int], *, labels: Tensor | None = None,
    seed: int = 0, batch_size: int = 64, device: torch.device | str = "cpu",
) -> Generated:  # fmt: skip
    """This rank's share of the shape[0] images `generate` would draw (indices first..first+count, see
    `shard`); labels are the (N,) labels of all N images. A rank with nothing to draw returns 0 images."""
    rank, size = world()
    first, count = shard(shape[0], batch_size, size, rank)
    if count == 0:
        return Generated(images=torch.zeros((0, *shape[1:]), dtype=torch.uint8), labels=None, nfe=0, seconds=0.0)
    mine = None if labels is None else labels[first : first + count]
    return generate(denoiser, sampler, (count, *shape[1:]), labels=mine, seed=seed, batch_size=batch_size,
                    first_index=first, device=device)  # fmt: skip


def generate_sharded(
    denoiser: Denoiser, sampler: Sampler, shape: tuple[int, int, int, int], *, labels: Tensor | None = None,
    seed: int = 0, batch_size: int = 64, device: torch.device | str = "cpu",
) -> Generated:  # fmt: skip
    """All shape[0] images on every rank, each rank having drawn its own disjoint share."""
    began = time.perf_counter()
    mine = generate_shard(denoiser, sampler, shape, labels=labels, seed=seed, batch_size=batch_size, device=device)
    images = all_gather_rows(mine.images)
    return Generated(images=images, labels=labels, nfe=mine.nfe, seconds=time.perf_counter() - began)


def sharded_features(
    extractor: FeatureExtractor, images: Tensor, batch_size: int = 250
) -> tuple[Tensor, Tensor | None]:
    """Features (and logits) of each rank's own images, gathered in rank order on every rank."""
    features, logits = extractor(images, batch_size=batch_size) if len(images) else _empty(extractor)
    gathered = all_gather_rows(features)
    return gathered, (all_gather_rows(logits) if logits is not None else None)


def _empty(extractor: FeatureExtractor) -> tuple[Tensor, Tensor | None]:
    """Zero rows of the right widths (a rank that drew no images still joins the gathers)."""
    probe = torch.zeros((1, extractor.channels or 3, extractor.image_size or 32, extractor.image_size or 32))
    features, logits = extractor(probe.to(torch.uint8))
    return features[:0], (logits[:0] if logits is not None else None)
