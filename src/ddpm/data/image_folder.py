"""A folder of images, one sub-folder per class: `data=image_folder`'s reader (a ddpm.data.sources.Source)."""

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from ddpm.data.images import PILLOW_MAX_PIXELS, centre_crop, open_image
from ddpm.data.sources import ImageSet, require, require_dir


def _hidden(path: Path, folder: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(folder).parts)


_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff"}


@dataclass(frozen=True, kw_only=True)
class ImageFolderSource:
    """root/<class>/<image>: classes are the sorted sub-folder names; resized and centre-cropped at preload.

    Every image is decoded upright (its EXIF orientation applied, as viewers show it). Every Pillow mode converts
    by the rule in ddpm.data.images (16-bit scaled, float and 32-bit integer files by their range, transparency
    onto white) or is refused naming the file; so is a file over `max_pixels`."""

    root: str | None  # the folder of class sub-folders
    conditional: bool = True  # False: one class (labels all 0, num_classes None)
    max_pixels: int | None = PILLOW_MAX_PIXELS  # refuse larger images (decompression bombs); None: no limit (trusted)
    setting: ClassVar[str] = "data.source.max_pixels"  # the key that sets max_pixels, named in refusals

    def __post_init__(self) -> None:
        require("data.source.max_pixels", self.max_pixels, lambda v: v is None or (isinstance(v, int) and v >= 1),
                "an integer >= 1, or null for no limit (only for trusted files)")  # fmt: skip

    def _classes(self) -> list[Path]:
        """Class folders: the visible sub-folders, sorted; a folder's place in that order is its label."""
        root = require_dir(self.root, "one sub-folder of images per class", "set data.root=...")
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def _files(self) -> list[tuple[Path, int]]:
        """(image, label) for every visible image file under the class folders (hidden files and folders, such as
        .ipynb_checkpoints/ or macOS's ._x.png, are not images of the class)."""
        classes = self._classes()
        listed = {folder: [path for path in sorted(folder.rglob("*")) if path.suffix.lower() in _EXTENSIONS
                           and path.is_file() and not _hidden(path, folder)] for folder in classes}  # fmt: skip
        if not any(listed.values()):
            raise FileNotFoundError(
                f"data.root={self.root} has no images in class sub-folders (root/<class>/*.png|jpg...); fix data.root"
            )
        empty = [folder.name for folder, files in listed.items() if not files]
        if empty and self.conditional:  # skipped, it would give every later class the label of the one before
            raise FileNotFoundError(
                f"data.root={self.root}: the class folder(s) {empty} hold no images; each visible sub-folder is a "
                "class, labelled by its place in sorted order: add its images, or move the folder out of data.root"
            )
        return [(path, label) for label, folder in enumerate(classes) for path in listed[folder]]

    def prepare(self) -> None:
        pass

    def count(self) -> int:
        return len(self._files())

    def files(self) -> list[Path]:
        return [path for path, _ in self._files()]

    def load(self, *, image_size: int, channels: int | None, limit: int | None = None) -> ImageSet:
        files = self.kept_files(limit)  # only these are decoded
        images, labels = self.decode(files, image_size=image_size, channels=channels)
        num_classes = self.num_classes()
        names = tuple(folder.name for folder in self._classes()) if self.conditional else ()
        return ImageSet(images=images, labels=labels, num_classes=num_classes, class_names=names)

    def num_classes(self) -> int | None:
        return len(self._classes()) if self.conditional else None  # every class folder holds images

    def kept_files(self, limit: int | None) -> list[tuple[Path, int]]:
        """The (image, label) pairs `data.limit` keeps: all, or a seeded sample in folder order, every class in
        proportion (the first files are the first classes': the files are in class order)."""
        files = self._files()
        if limit is None or limit >= len(files):
            return files
        return [files[i] for i in sorted(random.Random(0).sample(range(len(files)), limit))]

    def labelled_files(self) -> list[tuple[Path, int]]:
        """(image, label) in class order (labels all 0 when not conditional)."""
        return self._files() if self.conditional else [(path, 0) for path, _ in self._files()]

    def decode(self, files: list[tuple[Path, int]], *, image_size: int, channels: int | None) -> tuple[Tensor, Tensor]:
        """(images (N, C, image_size, image_size) uint8, labels (N,) int64) of (image, label) pairs."""
        mode = "L" if channels == 1 else "RGB"
        images = torch.empty(len(files), 1 if mode == "L" else 3, image_size, image_size, dtype=torch.uint8)
        for i, (path, _) in enumerate(files):
            image = open_image(path, mode, name=str(path), max_pixels=self.max_pixels, setting=self.setting)
            images[i] = centre_crop(image, image_size)
        labels = torch.tensor([label for _, label in files], dtype=torch.int64)
        return images, labels if self.conditional else torch.zeros_like(labels)
