"""A small CNN digit classifier whose penultimate layer serves as an offline feature extractor.

`SmallClassifier` takes (B, C, S, S) images in [-1, 1] and returns (B, K) logits; `features` gives the
(B, 1024) penultimate activations. `ClassifierFeatures` wraps a trained one for evaluation: uint8
images in, features (`forward`) or logits (`logits`) out; saved as TorchScript it is what
`metrics.features=<path>` loads (see ddpm.metrics.features for the contract).
"""

import os
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn


class SmallClassifier(nn.Module):
    """Three conv blocks and a linear head (the classifier of benchmarks/mnist_quality.py)."""

    def __init__(self, *, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Dropout(0.25), nn.Linear(64 * 16, num_classes))
        self.in_channels, self.num_classes, self.num_features = in_channels, num_classes, 64 * 16

    def features(self, x: Tensor) -> Tensor:
        """(B, C, S, S) in [-1, 1] -> (B, 1024) penultimate activations."""
        return self.body(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class ClassifierFeatures(nn.Module):
    """uint8 (B, C, S, S) images -> penultimate features (`forward`) or class logits (`logits`)."""

    def __init__(self, classifier: SmallClassifier, *, image_size: int) -> None:
        super().__init__()
        self.classifier = classifier.eval()
        self.image_size, self.in_channels = image_size, classifier.in_channels
        self.num_features, self.num_classes = classifier.num_features, classifier.num_classes

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier.features(images.float() / 127.5 - 1.0)

    @torch.jit.export
    def logits(self, images: Tensor) -> Tensor:
        return self.classifier(images.float() / 127.5 - 1.0)


def save_torchscript(classifier: SmallClassifier, path: str | os.PathLike, *, image_size: int) -> Path:
    """Script the trained classifier as a feature extractor and save it (loads without this package)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # torch >= 2.10 marks TorchScript deprecated; it still works
        warnings.simplefilter("ignore", FutureWarning)
        scripted = torch.jit.script(ClassifierFeatures(classifier.cpu().eval(), image_size=image_size))
    scripted.save(str(path))
    return path


STATE_FORMAT = "lightning-ddpm/classifier/1"


def save_state(classifier: SmallClassifier, path: str | os.PathLike, *, image_size: int) -> Path:
    """The same classifier as plain weights + its shape (read with weights_only=True by load_state)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in classifier.state_dict().items()}
    meta = {"in_channels": classifier.in_channels, "num_classes": classifier.num_classes, "image_size": image_size}
    torch.save({"format": STATE_FORMAT, "state_dict": state, **meta}, path)
    return path


def load_state(checkpoint: dict) -> ClassifierFeatures:
    """Rebuild a ClassifierFeatures from what save_state wrote (already torch.load-ed)."""
    net = SmallClassifier(in_channels=int(checkpoint["in_channels"]), num_classes=int(checkpoint["num_classes"]))
    net.load_state_dict(checkpoint["state_dict"])
    return ClassifierFeatures(net, image_size=int(checkpoint["image_size"]))
