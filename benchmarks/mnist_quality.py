"""The MNIST classifier's view of generated images: the library the quality scripts score with (`Scorer`: classifier
FID and KID against --data-root, accuracy as asked, 95% bootstrap intervals, paired ratios), and a command that
trains the classifier and reads a samples.npz (docs/benchmarks.md).

    python benchmarks/mnist_quality.py --samples outputs/samples/.../samples.npz
    python benchmarks/mnist_quality.py --save-classifier mnist_classifier.pt   # the classifier FID's features
"""

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch

from ddpm.data.sources import DigitsSource, MNISTSource
from ddpm.metrics import bootstrap as boot
from ddpm.metrics.classifier import accuracy, classifier_file, held_out_split, save_torchscript, train_classifier
from ddpm.metrics.features import classifier_extractor
from ddpm.metrics.fid import DEFAULT_CACHE_DIR, reference_stats

SMOKE = {"epochs": 1, "limit": 1000, "min_accuracy": 0.0}


def mnist_or_digits(root: str, *, allow_digits: bool) -> tuple[Any, str]:
    """The MNIST IDX files under `root` as a data source, or scikit-learn's digits where allowed (--smoke)."""
    if Path(root).is_dir():
        return MNISTSource(root=root), f"MNIST ({root})"
    if not allow_digits:
        raise SystemExit(f"no MNIST under {root}: pass --data-root (a folder of MNIST IDX files), or --smoke")
    print(f"no MNIST under {root}: scikit-learn's digits instead (the same tensor shapes and cost)")
    return DigitsSource(), "digits (MNIST missing)"


@dataclass
class Scored:
    """One set of images as the classifier sees it: statistics, resampled draws, intervals, what its file saved."""

    stats: boot.SetStatistics
    drawn: dict[str, torch.Tensor]
    intervals: dict[str, dict[str, float]]
    saved: dict[str, Any]


class Scorer:
    """The classifier (--classifier, default benchmarks/results/mnist_classifier.pt, trained there if missing), the
    reference statistics of --data-root, the resample weights of `num` images; under --smoke scikit-learn's digits
    for MNIST and, where the classifier is missing, one trained for an epoch in `folder`."""

    def __init__(self, *, classifier: str | Path | None, data_root: str, smoke: bool, folder: Path,
                 device: torch.device, num: int, resamples: int, seed: int = 0, epochs: int = 4,
                 cache_dir: str = DEFAULT_CACHE_DIR, image_size: int = 32, channels: int = 1) -> None:  # fmt: skip
        digits = (DigitsSource(), "digits (--smoke)")
        self.source, data = digits if smoke else mnist_or_digits(data_root, allow_digits=False)
        path = Path(classifier or common.RESULTS / "mnist_classifier.pt")
        path = folder / "classifier.pt" if smoke and not path.is_file() else path  # never where a real run looks
        path = classifier_file(path, source=self.source, image_size=image_size, channels=channels,
                               epochs=1 if smoke else epochs)  # fmt: skip
        self.extractor = classifier_extractor(path).to(device)
        self.name, self.size = self.extractor.name, (image_size, channels)
        cache = folder if smoke and cache_dir == DEFAULT_CACHE_DIR else cache_dir  # smoke statistics: thrown away
        self.reference = reference_stats(self.source, image_size=image_size, channels=channels,
                                         extractor=self.extractor, cache_dir=cache)  # fmt: skip
        self.data = f"{self.reference.num} images of {data}"
        self.terms, self.weights = boot.Reference.of(self.reference), boot.resample_weights(num, resamples, seed=seed)

    def score(self, images: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
              file: Path | None = None, **extra: Any) -> Scored:  # fmt: skip
        """uint8 (N, C, H, W) `images` scored: cfid, ckid, accuracy; with `file`, their features are kept there, or
        read from there when it exists (a resumed row: `images` may then be None)."""
        if file is not None and file.is_file():
            saved = torch.load(file, weights_only=True)
        else:
            features, logits = self.extractor(images)
            saved = {"features": features.cpu(), "logits": None if logits is None else logits.cpu(), "labels": labels,
                     **extra}  # fmt: skip
            if file is not None:
                torch.save(saved, file)
        stats = boot.SetStatistics(self.terms, saved["features"], logits=saved["logits"], labels=saved["labels"])
        drawn = boot.draws(stats, self.weights)  # once per set: its intervals and every ratio it takes part in
        intervals = {k: v.as_dict() for k, v in boot.bootstrap(stats, self.weights, drawn=drawn).items()}
        return Scored(stats, drawn, intervals, {k: v for k, v in saved.items() if k not in ("features", "logits",
                                                                                             "labels")})  # fmt: skip

    def ratio(self, a: Scored, b: Scored) -> dict[str, float]:
        """cfid(a) / cfid(b), paired: both resampled with the same counts (image i: same label and initial noise)."""
        return boot.paired_ratio(a.stats, b.stats, self.weights, drawn=(a.drawn, b.drawn)).as_dict()

    def mean_ratio(self, pairs: list[tuple[Scored, Scored]]) -> dict[str, float]:
        """The mean of the pairs' cfid ratios, its interval over the images with the models held fixed."""
        sets, drawn = [(a.stats, b.stats) for a, b in pairs], [(a.drawn, b.drawn) for a, b in pairs]
        return boot.mean_paired_ratio(sets, self.weights, drawn=drawn).as_dict()

    def held_out(self, num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`num` real digits the classifier never saw (its held-out split) and their labels."""
        data = self.source.load(image_size=self.size[0], channels=self.size[1])
        held = held_out_split(len(data.images))[0][:num]
        return data.images[held], data.labels[held]

    def floor(self, num: int, file: Path) -> Scored:
        """The held-out digits scored: what a perfect generator scores."""
        return self.score(*self.held_out(num), file=file)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Train the classifier (its held-out accuracy beside the samples': a weak one cannot pass weak samples), save
    it as TorchScript (sample.py's metrics.features=, Scorer's classifier), read --samples as asked."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=Path, help="samples.npz written by sample.py")
    p.add_argument("--save-classifier", type=Path, help="write the trained classifier here as TorchScript")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this sample accuracy")
    common.add_arguments(p, repeats=None)
    run = common.start(__file__, p, argv, smoke=SMOKE)
    args, began = run.args, time.perf_counter()
    if args.samples is None and args.save_classifier is None:
        p.error("nothing to do: pass --samples samples.npz and/or --save-classifier PATH")
    source, data_name = mnist_or_digits(args.data_root, allow_digits=args.smoke)
    data = source.load(image_size=32, channels=1)
    images, labels = data.images[: args.limit], data.labels[: args.limit]
    model, held_out = train_classifier(images, labels, epochs=args.epochs, seed=args.seed)
    if args.save_classifier is not None:
        path = save_torchscript(model, args.save_classifier, image_size=32)
        print(f"classifier (held-out accuracy {held_out:.3f}) -> {path}")
    if args.samples is None:
        return None
    with np.load(args.samples) as npz:  # sample.py's: images (N, H, W, C) uint8, labels (N,)
        samples, asked = npz["images"], torch.from_numpy(npz["labels"]).long()
    if samples.dtype != np.uint8 or samples.ndim != 4 or samples.shape[1:] != (32, 32, 1):
        raise ValueError(f"{args.samples}: images {samples.shape} {samples.dtype}; expected (N, 32, 32, 1) uint8")
    sample_accuracy, predicted = accuracy(model, torch.from_numpy(samples).permute(0, 3, 1, 2).contiguous(), asked)
    per_class = {int(c): (predicted[asked == c] == c).float().mean().item() for c in asked.unique()}
    print(common.table(["", "accuracy", "images"], [["classifier, held out", f"{held_out:.3f}", len(images) // 10],
                                                    ["generated samples", f"{sample_accuracy:.3f}", len(samples)],
                                                    *([f"label {c}", f"{v:.3f}", int((asked == c).sum())]
                                                      for c, v in per_class.items())]))  # fmt: skip
    report = {"samples": str(args.samples), "data": data_name, "sample_accuracy": sample_accuracy,
              "classifier_held_out_accuracy": held_out, "per_class_accuracy": per_class, "num_samples": len(samples),
              "args": {k: str(v) for k, v in vars(args).items()},
              "seconds": round(time.perf_counter() - began, 1)}  # fmt: skip
    run.write(report, "mnist_quality.json")
    if sample_accuracy < args.min_accuracy:
        raise SystemExit(f"sample accuracy {sample_accuracy:.3f} < --min-accuracy {args.min_accuracy}")
    return report


if __name__ == "__main__":
    main()
