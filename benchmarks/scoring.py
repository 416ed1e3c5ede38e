"""The MNIST classifier's view of generated images (samplers.py, mnist_recipe.py, sampling.py --classifier).

`cfid`: the classifier FID (its penultimate features) against every image of --data-root; `ckid`: the classifier
KID (unbiased MMD^2); `accuracy`: how often the classifier reads the label asked for. Each with a 95% bootstrap
interval over the images (ddpm.metrics.bootstrap, centred on the value); `ratio`: one set's cfid over another's
whose image i has the same label and initial noise, both resampled together. The classifier is --classifier (default
benchmarks/results/mnist_classifier.pt), trained there by ddpm.metrics.classifier if missing; under --smoke a missing
one is trained for one epoch in a temp folder on the first 1,000 images, and scikit-learn's digits stand in for a
missing MNIST.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import RESULTS

from ddpm.data.sources import DigitsSource, ImageSet, MNISTSource
from ddpm.metrics.bootstrap import (
    Reference,
    SetStatistics,
    bootstrap,
    draws,
    mean_paired_ratio,
    paired_ratio,
    resample_weights,
)
from ddpm.metrics.classifier import classifier_file, held_out_split
from ddpm.metrics.features import classifier_extractor
from ddpm.metrics.fid import DEFAULT_CACHE_DIR, reference_stats

SMOKE_IMAGES = 1000  # --smoke: the reference statistics and quick classifiers see this many real images


@dataclass(frozen=True, kw_only=True)
class FirstImages:
    """A data source cut to its first `limit` images (--smoke: the same code path, a tenth of MNIST's cost)."""

    base: Any  # the source cut (a field named `source` would shadow the cache key's source name)
    limit: int

    def prepare(self) -> None:
        self.base.prepare()

    def count(self) -> int:
        return min(self.limit, self.base.count())

    def load(self, *, image_size: int, channels: int | None) -> ImageSet:
        data = self.base.load(image_size=image_size, channels=channels)
        return ImageSet(images=data.images[: self.limit], labels=data.labels[: self.limit],
                        num_classes=data.num_classes)  # fmt: skip


def mnist_or_digits(root: str, *, allow_digits: bool, limit: int | None = None) -> tuple[Any, str]:
    """The MNIST IDX files under `root` as a data source, or scikit-learn's digits where allowed (--smoke); with
    `limit`, only their first `limit` images."""
    if Path(root).is_dir():
        source, name = MNISTSource(root=root), f"MNIST ({root})"
    elif not allow_digits:
        raise SystemExit(f"no MNIST under {root}: pass --data-root (a folder of MNIST IDX files), or --smoke")
    else:
        print(f"no MNIST under {root}: scikit-learn's digits instead (the same tensor shapes and cost)")
        source, name = DigitsSource(), "digits (MNIST missing)"
    if limit is None:
        return source, name
    return FirstImages(base=source, limit=limit), f"the first {limit} images of {name}"


@dataclass
class Scored:
    """One set of images as the classifier sees it: its statistics, their resampled draws, the intervals, and what
    its features file holds besides the features (nfe, seconds ...)."""

    stats: SetStatistics
    drawn: dict[str, torch.Tensor]
    intervals: dict[str, dict[str, float]]
    saved: dict[str, Any]


class Scorer:
    """The classifier, the reference statistics of --data-root and the resample weights of `num` images."""

    def __init__(self, *, classifier: str | Path | None, data_root: str, smoke: bool, folder: Path,
                 device: torch.device, num: int, resamples: int, seed: int = 0, epochs: int = 4,
                 cache_dir: str = DEFAULT_CACHE_DIR, image_size: int = 32, channels: int = 1) -> None:  # fmt: skip
        self.source, data = mnist_or_digits(data_root, allow_digits=smoke, limit=SMOKE_IMAGES if smoke else None)
        path = Path(classifier or RESULTS / "mnist_classifier.pt")
        path = folder / "classifier.pt" if smoke and not path.is_file() else path  # never where a real run looks
        path = classifier_file(path, source=self.source, image_size=image_size, channels=channels,
                               epochs=1 if smoke else epochs)  # fmt: skip
        self.extractor = classifier_extractor(path).to(device)
        self.name, self.size = self.extractor.name, (image_size, channels)
        cache = folder if smoke and cache_dir == DEFAULT_CACHE_DIR else cache_dir  # smoke statistics: thrown away
        self.reference = reference_stats(self.source, image_size=image_size, channels=channels,
                                         extractor=self.extractor, cache_dir=cache)  # fmt: skip
        self.data = f"{self.reference.num} images of {data}"
        self.terms, self.weights = Reference.of(self.reference), resample_weights(num, resamples, seed=seed)

    def score(self, images: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
              file: Path | None = None, **extra: Any) -> Scored:  # fmt: skip
        """`images` (uint8 (N, C, H, W)) scored; with `file`, their features are kept there, and read from there
        instead when it exists (a resumed row: `images` may then be None)."""
        if file is not None and file.is_file():
            saved = torch.load(file, weights_only=True)
        else:
            features, logits = self.extractor(images)
            saved = {"features": features.cpu(), "logits": None if logits is None else logits.cpu(),
                     "labels": labels, **extra}  # fmt: skip
            if file is not None:
                torch.save(saved, file)
        stats = SetStatistics(self.terms, saved["features"], logits=saved["logits"], labels=saved["labels"])
        drawn = draws(stats, self.weights)  # once per set: its intervals and every ratio it takes part in
        intervals = {k: v.as_dict() for k, v in bootstrap(stats, self.weights, drawn=drawn).items()}
        extra = {k: v for k, v in saved.items() if k not in ("features", "logits", "labels")}
        return Scored(stats, drawn, intervals, extra)

    def ratio(self, a: Scored, b: Scored) -> dict[str, float]:
        """cfid(a) / cfid(b), paired: both resampled with the same counts."""
        return paired_ratio(a.stats, b.stats, self.weights, drawn=(a.drawn, b.drawn)).as_dict()

    def mean_ratio(self, pairs: list[tuple[Scored, Scored]]) -> dict[str, float]:
        """The mean of the pairs' cfid ratios, its interval over the images with the models held fixed."""
        sets, drawn = [(a.stats, b.stats) for a, b in pairs], [(a.drawn, b.drawn) for a, b in pairs]
        return mean_paired_ratio(sets, self.weights, drawn=drawn).as_dict()

    def floor(self, num: int, file: Path) -> Scored:
        """`num` real digits the classifier never saw (its held-out split): what a perfect generator scores."""
        data = self.source.load(image_size=self.size[0], channels=self.size[1])
        held = held_out_split(len(data.images))[0][:num]
        return self.score(data.images[held], data.labels[held], file=file)
