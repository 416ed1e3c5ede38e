"""A small CNN digit classifier whose penultimate layer serves as an offline feature extractor.

`SmallClassifier` takes (B, C, S, S) images in [-1, 1] and returns (B, K) logits; `features` gives the
(B, 1024) penultimate activations. `ClassifierFeatures` wraps a trained one for evaluation: uint8
images in, features (`forward`) or logits (`logits`) out; saved as TorchScript it is what
`metrics.features=<path>` loads (see ddpm.metrics.features for the contract). `train_classifier` trains one
on uint8 images (a seeded 90/10 split, held-out accuracy returned); `classifier_file` returns a saved file,
training and saving one first if it is missing (the benchmarks' and the classifier-FID callback's feature file).
"""

import os
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ddpm.data.sources import Source


class SmallClassifier(nn.Module):
    """Three conv blocks and a linear head on (B, C, S, S) images in [-1, 1] -> (B, K) logits."""

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


def to_unit(images: Tensor) -> Tensor:
    """uint8 [0, 255] -> float [-1, 1]."""
    return images.float() / 127.5 - 1.0


@torch.no_grad()
def predict(model: nn.Module, images: Tensor) -> Tensor:
    """uint8 (N, C, S, S) -> predicted labels (N,), in chunks of 512."""
    model.eval()
    return torch.cat([model(to_unit(chunk)).argmax(1) for chunk in images.split(512)])


def accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> tuple[float, Tensor]:
    """Fraction of `images` classified as `labels`, and the predictions."""
    predicted = predict(model, images)
    return (predicted == labels).float().mean().item(), predicted


def held_out_split(count: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(held-out, training) indices of `train_classifier`'s seeded split: 10% held out, the first of a permutation.
    The held-out images are real data the classifier never saw: the floor of the classifier metrics."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[: count // 10], order[count // 10 :]


@torch.enable_grad()  # callers may sit inside torch.no_grad (a benchmark's scoring)
def train_classifier(images: Tensor, labels: Tensor, *, epochs: int, seed: int = 0,
                     num_classes: int = 10) -> tuple[SmallClassifier, float]:  # fmt: skip
    """Train on a seeded 90% split of uint8 (N, C, S, S) images (Adam 2e-3, batch 128, shifts of up to 2 pixels);
    return the model and its accuracy on the other 10%."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    held, train = held_out_split(len(images), seed)
    torch.randperm(len(images), generator=generator)  # the split's draw: the epochs' shuffles follow it, as before
    model = SmallClassifier(in_channels=images.shape[1], num_classes=num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(epochs):
        model.train()
        for batch in train[torch.randperm(len(train), generator=generator)].split(128):
            shift = torch.randint(-2, 3, (2,), generator=generator).tolist()  # small translations
            x = torch.roll(to_unit(images[batch]), shifts=shift, dims=(2, 3))
            loss = F.cross_entropy(model(x), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model, accuracy(model, images[held], labels[held])[0]


def classifier_file(path: str | os.PathLike, *, source: Source, image_size: int = 32, channels: int = 1,
                    epochs: int = 4, limit: int | None = None) -> Path:  # fmt: skip
    """`path` if it exists, else a classifier trained on `source` (the first `limit` images; seed 0) at
    `image_size`, saved there as TorchScript (a feature extractor for metrics.features / classifier FID)."""
    if Path(path).is_file():
        return Path(path)
    data = source.load(image_size=image_size, channels=channels)
    images, labels = data.images[:limit], data.labels[:limit]
    model, held_out = train_classifier(images, labels, epochs=epochs, num_classes=data.num_classes or 10)
    saved = save_torchscript(model, path, image_size=image_size)
    print(f"classifier trained on {len(images)} images (held-out accuracy {held_out:.3f}) -> {saved}")
    return saved
