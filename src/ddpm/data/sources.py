"""Dataset readers: each turns a dataset on disk (or bundled) into one uint8 tensor plus labels.

`Source.load(image_size=S, channels=C)` -> ImageSet(images (N, C, S, S) uint8 in [0, 255], labels (N,)
int64). Readers know nothing of models or Lightning; the RAM datamodule preloads what they return.
`require*` are the argument checks of the readers and datamodules: each refusal names the key the user sets.
"""

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import Tensor

from ddpm.data.idx import read_idx, read_idx_header
from ddpm.data.images import convert_channels, fit_to_size


@dataclass(frozen=True)
class ImageSet:
    images: Tensor  # (N, C, H, W) uint8
    labels: Tensor  # (N,) int64
    num_classes: int | None
    class_names: tuple[str, ...] = ()  # the name of each label, where the source has names (image folders)


class Source(Protocol):
    def prepare(self) -> None: ...  # download if asked; runs once per node before `load`

    def count(self) -> int: ...  # number of images, known without decoding them (for the RAM check)

    def files(self) -> list[Path]: ...  # the files the images are read from (what cached statistics depend on)

    def load(self, *, image_size: int, channels: int | None, limit: int | None = None) -> ImageSet: ...  # first N


# --- argument checks: each refusal names the key the user sets (data.<arg>, data.source.<arg>) ---------------


def require(key: str, value: Any, ok: Callable[[Any], bool], rule: str, fix: str = "") -> None:
    """ValueError `key=value must be <rule>[; fix]` unless ok(value)."""
    if not ok(value):
        raise ValueError(f"{key}={value!r} must be {rule}" + (f"; {fix}" if fix else ""))


def require_positive_int(key: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    rule = f"an integer >= {minimum}" + (" or null" if allow_none else "")
    require(key, value, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum, rule)


def require_channels(key: str, value: Any) -> None:
    require(key, value, lambda v: v in (None, 1, 3), "1, 3 or null (it follows model.in_channels unless set)")


def require_image_size(key: str, value: Any) -> None:
    require(key, value, lambda v: isinstance(v, int) and v >= 1, "an integer >= 1 (it follows model.image_size)")


def finish(
    images: Tensor, labels: Tensor, num_classes: int | None, *, image_size: int, channels: int | None,
    pad: bool = False, limit: int | None = None,
) -> ImageSet:  # fmt: skip
    """The first `limit` (None: all) square uint8 images at image_size (MNIST's padded: `pad`) with `channels`."""
    images, labels = images[:limit], labels[:limit]
    images = convert_channels(fit_to_size(images, image_size, pad=pad), channels)
    return ImageSet(images=images.contiguous(), labels=labels.long(), num_classes=num_classes)


def download_dir(root: str | None, what: str) -> Path:
    """data.root as the folder a download goes into (created; unset or a file refused, naming the key)."""
    if root is None or str(root) == "":
        raise FileNotFoundError(f"data.root is not set; point it at the folder to download {what} into")
    folder = Path(root).expanduser()
    if folder.exists() and not folder.is_dir():
        raise FileNotFoundError(f"data.root={root} is a file, not a folder; point it at the folder to download {what} "
                                "into")  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def require_dir(root: str | Path | None, what: str, fix: str) -> Path:
    """The dataset directory, or an error that says which value to set."""
    if root is None or str(root) == "":
        raise FileNotFoundError(f"data.root is not set; point it at {what} ({fix})")
    path = Path(root).expanduser()
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"data.root={root} is a file, not a folder; point data.root at the folder holding "
                                f"{what} ({fix})")  # fmt: skip
    if not path.is_dir():
        raise FileNotFoundError(f"data.root={root} does not exist (resolved: {path.resolve()}); {fix}")
    if not any(path.iterdir()):
        raise FileNotFoundError(f"data.root={root} is empty; it should hold {what} ({fix})")
    return path


@dataclass(frozen=True, kw_only=True)
class DigitsSource:
    """scikit-learn's bundled 1,797 real 8x8 handwritten digits (16 grey levels), 10 classes: no download."""

    def prepare(self) -> None:
        pass

    def count(self) -> int:
        return 1797

    def files(self) -> list[Path]:
        return []  # scikit-learn's own copy

    def load(self, *, image_size: int, channels: int | None, limit: int | None = None) -> ImageSet:
        from sklearn.datasets import load_digits

        digits = load_digits()
        grey = torch.from_numpy(digits.images).float().mul(255.0 / 16.0).round().to(torch.uint8)  # (N, 8, 8)
        labels = torch.from_numpy(digits.target)
        return finish(grey[:, None], labels, 10, image_size=image_size, channels=channels, limit=limit)


# --- MNIST (IDX files, LeCun et al.) -------------------------------------------------------------

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def find_idx(root: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        for folder in (root, root / "MNIST" / "raw"):  # the latter is torchvision's download layout
            if (folder / name).is_file():
                return folder / name
    return None


@dataclass(frozen=True, kw_only=True)
class MNISTSource:
    """MNIST from IDX files under `root` (gz or not): the four standard files, or just the test pair."""

    root: str | None  # folder with the IDX files (or torchvision's MNIST/raw layout)
    split: Literal["auto", "train", "test", "all"] = "auto"  # auto: train+test if present, else test
    download: bool = False  # fetch the files with torchvision when they are missing

    def __post_init__(self) -> None:
        require("data.source.split", self.split, lambda v: v in ("auto", "train", "test", "all"),
                "'auto', 'train', 'test' or 'all'")  # fmt: skip

    def prepare(self) -> None:
        """With download=true, fetch each wanted split (auto and all: both) whose two files are not under root (a
        folder holding only the test pair fetched nothing, then split=all refused it naming download=true)."""
        if not self.download or not (missing := self._missing()):
            return
        from torchvision.datasets import MNIST

        root = download_dir(self.root, "MNIST")
        for split in missing:
            MNIST(str(root), train=split == "train", download=True)

    def _missing(self) -> list[str]:
        root = Path(self.root).expanduser() if self.root else None
        wanted = ["train", "test"] if self.split in ("auto", "all") else [self.split]
        have = lambda split: root is not None and all(find_idx(root, stem) for stem in _MNIST_FILES[split])  # noqa: E731
        return [split for split in wanted if not have(split)]

    def _files(self) -> list[tuple[Path, Path]]:
        root = require_dir(self.root, "the MNIST IDX files", "set data.root=... or data.source.download=true")
        found = {s: [find_idx(root, stem) for stem in stems] for s, stems in _MNIST_FILES.items()}
        complete = {s: tuple(p) for s, p in found.items() if all(p)}
        wanted = {"auto": ["train", "test"], "all": ["train", "test"]}.get(self.split, [self.split])
        pairs = [complete[s] for s in wanted if s in complete]
        if self.split == "all" and len(pairs) < 2:
            pairs = []
        if not pairs:
            names = ", ".join(f"{a}[.gz] + {b}[.gz]" for a, b in (_MNIST_FILES[s] for s in wanted))
            raise FileNotFoundError(
                f"data.root={self.root} has no MNIST {self.split} files (looked for {names}); "
                "point data.root at them or set data.source.download=true"
            )
        return pairs  # type: ignore[return-value]

    def count(self) -> int:
        return sum(read_idx_header(images)[1][0] for images, _ in self._files())

    def files(self) -> list[Path]:
        return [path for pair in self._files() for path in pair]

    def load(self, *, image_size: int, channels: int | None, limit: int | None = None) -> ImageSet:
        arrays = [(read_idx(images), read_idx(labels)) for images, labels in self._files()]
        for (images, labels), (path, _) in zip(arrays, self._files(), strict=True):
            if images.ndim != 3 or len(images) != len(labels):
                raise ValueError(f"{path}: {images.shape} images for {len(labels)} labels; not an MNIST pair")
        images = torch.from_numpy(np.concatenate([a for a, _ in arrays]).copy())[:, None]  # (N, 1, 28, 28)
        labels = torch.from_numpy(np.concatenate([b for _, b in arrays]).astype(np.int64))
        return finish(images, labels, 10, image_size=image_size, channels=channels, pad=True, limit=limit)


# --- CIFAR-10 (Krizhevsky 2009, python pickle batches) --------------------------------------------

_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_BATCHES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


@dataclass(frozen=True, kw_only=True)
class CIFAR10Source:
    """CIFAR-10 from torchvision's `cifar-10-batches-py` folder under `root`; downloads when asked."""

    root: str | None  # folder holding (or to hold) cifar-10-batches-py/
    split: Literal["train", "test", "all"] = "train"
    download: bool = False  # fetch and verify the archive with torchvision when missing

    def __post_init__(self) -> None:
        require("data.source.split", self.split, lambda v: v in ("train", "test", "all"), "'train', 'test' or 'all'")

    def prepare(self) -> None:
        """With download=true, fetch the archive unless every batch file is there (a partly extracted folder)."""
        names = _CIFAR_BATCHES["train"] + _CIFAR_BATCHES["test"]
        folder = Path(self.root).expanduser() / _CIFAR_DIR if self.root else None
        if self.download and (folder is None or not all((folder / name).is_file() for name in names)):
            from torchvision.datasets import CIFAR10

            CIFAR10(str(download_dir(self.root, f"{_CIFAR_DIR}/")), train=True, download=True)

    def _batches(self) -> list[Path]:
        root = require_dir(self.root, f"{_CIFAR_DIR}/", "set data.root=... or data.source.download=true")
        wanted = _CIFAR_BATCHES["train"] + _CIFAR_BATCHES["test"] if self.split == "all" else _CIFAR_BATCHES[self.split]
        paths = [root / _CIFAR_DIR / name for name in wanted]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"data.root={self.root} lacks {_CIFAR_DIR}/{missing}; set data.source.download=true or fix data.root"
            )
        return paths

    def count(self) -> int:
        return 10_000 * len(self._batches())

    def files(self) -> list[Path]:
        return self._batches()

    def load(self, *, image_size: int, channels: int | None, limit: int | None = None) -> ImageSet:
        images, labels = [], []
        for path in self._batches():
            with path.open("rb") as f:
                try:
                    batch = pickle.load(f, encoding="latin1")
                except Exception as error:  # garbage bytes raise almost anything (KeyError, MemoryError, ...)
                    raise ValueError(f"{path} is corrupt ({error!r}); delete it and re-download") from error
            if not isinstance(batch, dict) or "data" not in batch or "labels" not in batch:
                raise ValueError(f"{path} is not a CIFAR-10 batch (no 'data' and 'labels'); delete it and re-download")
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.append(np.asarray(batch["labels"], dtype=np.int64))
        tensor = torch.from_numpy(np.concatenate(images))
        labels = torch.from_numpy(np.concatenate(labels))
        return finish(tensor, labels, 10, image_size=image_size, channels=channels, limit=limit)
