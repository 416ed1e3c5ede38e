"""Sample on every rank and measure: the pieces sample.py and the training-time FID callback share."""

import time
from typing import Any

import torch
from torch import Tensor

from ddpm.diffusion.generate import Generated, generate
from ddpm.metrics.features import FeatureExtractor
from ddpm.metrics.sharding import all_gather_rows, shard, world


def generate_shard(*, num_samples: int, batch_size: int, labels: Tensor | None, **kwargs: Any) -> Generated:
    """This rank's share of `num_samples` images (indices first..first+count, see sharding.shard).

    kwargs go to `generate` (net, betas, prediction, sampler, image_shape, seed, device, ...);
    labels are the (N,) labels of all N images. A rank with nothing to draw returns 0 images.
    """
    rank, size = world()
    first, count = shard(num_samples, batch_size, size, rank)
    if count == 0:
        empty = torch.zeros((0, *kwargs["image_shape"]), dtype=torch.uint8)
        return Generated(images=empty, labels=None, nfe=0, seconds=0.0)
    mine = None if labels is None else labels[first : first + count]
    return generate(num_samples=count, batch_size=batch_size, labels=mine, first_index=first, **kwargs)


def generate_sharded(*, num_samples: int, batch_size: int, labels: Tensor | None, **kwargs: Any) -> Generated:
    """All `num_samples` images on every rank, each rank having drawn its own disjoint share."""
    began = time.perf_counter()
    mine = generate_shard(num_samples=num_samples, batch_size=batch_size, labels=labels, **kwargs)
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
