"""How often a small MNIST classifier recognises generated digits as the label they were asked for.

    python train.py experiment=mnist data.root=../shared/data/mnist
    python sample.py ckpt=outputs/.../ema.pt num_samples=500 guidance=3 sampler.steps=100
    python benchmarks/mnist_quality.py --samples outputs/samples/.../samples.npz

    # keep the trained classifier as a TorchScript feature extractor (penultimate features + logits)
    # for an offline "classifier FID": sample.py metrics=[fid] metrics.features=mnist_classifier.pt
    python benchmarks/mnist_quality.py --save-classifier mnist_classifier.pt [--samples ...]

The classifier (a small CNN) trains on the same MNIST files at the same 32x32 size, with a seeded
held-out split whose accuracy is reported beside the samples' (so a weak classifier cannot pass
weak samples). Prints a table and writes JSON under benchmarks/results/.
"""

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ddpm.data.sources import MNISTSource
from ddpm.metrics.classifier import SmallClassifier, save_torchscript

REPO = Path(__file__).resolve().parents[1]


def classifier() -> SmallClassifier:
    """Three conv blocks and a linear head on (B, 1, 32, 32) images in [-1, 1] -> (B, 10) logits."""
    return SmallClassifier(in_channels=1, num_classes=10)


def to_unit(images: Tensor) -> Tensor:
    return images.float() / 127.5 - 1.0


def train_classifier(images: Tensor, labels: Tensor, *, epochs: int, seed: int) -> tuple[nn.Module, float]:
    """Train on a seeded 90% split; return the model and its accuracy on the other 10%."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order = torch.randperm(len(images), generator=generator)
    held, train = order[: len(order) // 10], order[len(order) // 10 :]
    model = classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(epochs):
        model.train()
        for batch in train[torch.randperm(len(train), generator=generator)].split(128):
            x = to_unit(images[batch])
            shift = torch.randint(-2, 3, (2,), generator=generator).tolist()  # small translations
            x = torch.roll(x, shifts=shift, dims=(2, 3))
            loss = F.cross_entropy(model(x), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model, accuracy(model, images[held], labels[held])[0]


@torch.no_grad()
def classifier_file(path: Path, *, data_root: str, epochs: int = 4) -> Path:
    """`path` if it exists, else a classifier trained here on MNIST in `data_root` (32x32), saved there as
    TorchScript (the feature extractor of the benchmarks' classifier FID)."""
    if Path(path).is_file():
        return Path(path)
    data = MNISTSource(root=data_root).load(image_size=32, channels=1)
    with torch.enable_grad():  # callers may sit inside torch.no_grad (sampling.py's scoring)
        model, held_out = train_classifier(data.images, data.labels, epochs=epochs, seed=0)
    saved = save_torchscript(model, path, image_size=32)
    print(f"classifier trained (held-out accuracy {held_out:.3f}) -> {saved}")
    return saved


def predict(model: nn.Module, images: Tensor) -> Tensor:
    model.eval()
    return torch.cat([model(to_unit(chunk)).argmax(1) for chunk in images.split(512)])


def accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> tuple[float, Tensor]:
    predicted = predict(model, images)
    return (predicted == labels).float().mean().item(), predicted


def load_samples(path: Path) -> tuple[Tensor, Tensor]:
    """samples.npz from sample.py: images (N, H, W, C) uint8, labels (N,) int."""
    with np.load(path) as npz:
        images, labels = npz["images"], npz["labels"]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 1):
        raise ValueError(f"{path}: images {images.shape} {images.dtype}; expected (N, 32, 32, 1) uint8 from sample.py")
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels).long()


def git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=Path, help="samples.npz written by sample.py")
    parser.add_argument("--save-classifier", type=Path, help="write the trained classifier here as TorchScript")
    parser.add_argument("--data-root", default=str(REPO.parent / "shared/data/mnist"), help="MNIST IDX folder")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this sample accuracy")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/mnist_quality.json")
    args = parser.parse_args()
    if args.samples is None and args.save_classifier is None:
        parser.error("nothing to do: pass --samples samples.npz and/or --save-classifier PATH")

    start = time.perf_counter()
    data = MNISTSource(root=args.data_root).load(image_size=32, channels=1)
    model, held_out = train_classifier(data.images, data.labels, epochs=args.epochs, seed=args.seed)
    if args.save_classifier is not None:
        path = save_torchscript(model, args.save_classifier, image_size=32)
        print(f"classifier (held-out accuracy {held_out:.3f}) -> {path}")
    if args.samples is None:
        return
    images, labels = load_samples(args.samples)
    sample_accuracy, predicted = accuracy(model, images, labels)
    per_class = {int(c): (predicted[labels == c] == c).float().mean().item() for c in labels.unique()}

    print(f"{'':24}{'accuracy':>10}{'images':>8}")
    print(f"{'classifier, held out':24}{held_out:>10.3f}{len(data.images) // 10:>8}")
    print(f"{'generated samples':24}{sample_accuracy:>10.3f}{len(images):>8}")
    for label, value in per_class.items():
        print(f"{'  label ' + str(label):24}{value:>10.3f}{int((labels == label).sum()):>8}")
    result = {
        "samples": str(args.samples),
        "sample_accuracy": sample_accuracy,
        "classifier_held_out_accuracy": held_out,
        "per_class_accuracy": per_class,
        "num_samples": len(images),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out}")
    if sample_accuracy < args.min_accuracy:
        raise SystemExit(f"sample accuracy {sample_accuracy:.3f} < --min-accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()
