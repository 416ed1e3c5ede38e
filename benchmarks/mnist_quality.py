"""How often a small MNIST classifier recognises generated digits as the label they were asked for.

    python sample.py ckpt=outputs/.../ema.pt num_samples=500 guidance=3
    python benchmarks/mnist_quality.py --samples outputs/samples/.../samples.npz
    python benchmarks/mnist_quality.py --save-classifier mnist_classifier.pt   # the classifier FID's features

The classifier (ddpm.metrics.classifier: a small CNN) trains on the MNIST files at 32x32 with a seeded held-out split
whose accuracy is reported beside the samples' (a weak classifier cannot pass weak samples); saved as TorchScript
(penultimate features + logits) it is `metrics.features=` of sample.py and the classifier of scoring.py. --smoke: 1
epoch on 1,000 images, no accuracy gate, scikit-learn's digits if MNIST is absent.
"""

import argparse
import time
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch
from scoring import mnist_or_digits
from torch import Tensor

from ddpm.metrics.classifier import accuracy, save_torchscript, train_classifier

SMOKE = {"epochs": 1, "limit": 1000, "min_accuracy": 0.0}


def load_samples(path: Path) -> tuple[Tensor, Tensor]:
    """samples.npz from sample.py: images (N, H, W, C) uint8, labels (N,) int."""
    with np.load(path) as npz:
        images, labels = npz["images"], npz["labels"]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 1):
        raise ValueError(f"{path}: images {images.shape} {images.dtype}; expected (N, 32, 32, 1) uint8 from sample.py")
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels).long()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=Path, help="samples.npz written by sample.py")
    p.add_argument("--save-classifier", type=Path, help="write the trained classifier here as TorchScript")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this sample accuracy")
    common.add_arguments(p, repeats=None)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = parser()
    run = common.start(__file__, p, argv, smoke=SMOKE)
    args = run.args
    if args.samples is None and args.save_classifier is None:
        p.error("nothing to do: pass --samples samples.npz and/or --save-classifier PATH")
    began = time.perf_counter()
    source, data_name = mnist_or_digits(args.data_root, allow_digits=args.smoke)
    data = source.load(image_size=32, channels=1)
    images, labels = data.images[: args.limit], data.labels[: args.limit]
    model, held_out = train_classifier(images, labels, epochs=args.epochs, seed=args.seed)
    if args.save_classifier is not None:
        path = save_torchscript(model, args.save_classifier, image_size=32)
        print(f"classifier (held-out accuracy {held_out:.3f}) -> {path}")
    if args.samples is None:
        return None
    samples, asked = load_samples(args.samples)
    sample_accuracy, predicted = accuracy(model, samples, asked)
    per_class = {int(c): (predicted[asked == c] == c).float().mean().item() for c in asked.unique()}
    rows = [
        ["classifier, held out", f"{held_out:.3f}", len(images) // 10],
        ["generated samples", f"{sample_accuracy:.3f}", len(samples)],
    ]
    rows += [[f"label {c}", f"{v:.3f}", int((asked == c).sum())] for c, v in per_class.items()]
    print(common.table(["", "accuracy", "images"], rows))
    report = {
        "samples": str(args.samples),
        "data": data_name,
        "sample_accuracy": sample_accuracy,
        "classifier_held_out_accuracy": held_out,
        "per_class_accuracy": per_class,
        "num_samples": len(samples),
        "args": {k: str(v) for k, v in vars(args).items()},
        "seconds": round(time.perf_counter() - began, 1),
    }
    run.write(report, "mnist_quality.json")
    if sample_accuracy < args.min_accuracy:
        raise SystemExit(f"sample accuracy {sample_accuracy:.3f} < --min-accuracy {args.min_accuracy}")
    return report


if __name__ == "__main__":
    main()
