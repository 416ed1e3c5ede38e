"""What sampling writes: the grid (one writer, for sample.py and the training-time grids), samples.npz, and the
checks that the output folder can take them, made before anything is drawn. Files are written whole or not at all
(ddpm.atomic).

`tile` lays images out as torchvision's make_grid does, without its float round trip or its import (seconds of
sample.py's start-up); `save_png` writes an 8-bit grey or RGB PNG.
"""

import errno
import shutil
import tempfile
from pathlib import Path

import numpy as np
from torch import Tensor

from ddpm.atomic import WriteError, atomic_write


def tile(images: Tensor, *, nrow: int, padding: int = 2, pad_value: int = 255) -> Tensor:
    """(N, C, H, W) uint8 -> (C, rows * (H + padding) + padding, cols * (W + padding) + padding) uint8: the images
    in rows of min(nrow, N) on a `pad_value` background, torchvision's make_grid layout without its float round trip
    or its import (seconds of sample.py's start-up)."""
    n, channels, height, width = images.shape
    cols = min(nrow, n)
    rows = -(-n // cols)
    grid = images.new_full(
        (channels, rows * (height + padding) + padding, cols * (width + padding) + padding), pad_value
    )
    for i, image in enumerate(images):
        top, left = (height + padding) * (i // cols) + padding, (width + padding) * (i % cols) + padding
        grid[:, top : top + height, left : left + width] = image
    return grid


def save_png(grid: Tensor, file) -> None:
    """A (1 or 3, H, W) uint8 image as an 8-bit grey or RGB PNG to a path or binary file object."""
    from PIL import Image

    array = grid.permute(1, 2, 0).numpy()
    Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array).save(file, format="png")


CLASS_COLUMNS = 32  # the most classes a grid gives a column each (labels 0..K-1 in turn: a class per column)


def grid_columns(count: int, num_classes: int | None) -> int:
    """The columns of a grid of `count` images: one per class up to CLASS_COLUMNS classes, else a square (a
    1,000-class model's grid was one row, 66,050 pixels wide)."""
    if num_classes is not None and num_classes <= CLASS_COLUMNS:
        return num_classes
    return max(1, int(count**0.5))


def write_grid(images: Tensor, path: Path, *, nrow: int) -> Tensor:
    """(N, C, H, W) uint8 images as one PNG grid at `path` (white borders; grey or RGB as the images); the grid."""
    grid = tile(images, nrow=nrow)
    atomic_write(path, lambda f: save_png(grid, f))
    return grid


def check_output_dir(out_dir: Path) -> None:
    """Before anything is drawn: `out_dir` is created if missing and a probe file created and removed in it; a
    WriteError naming output_dir otherwise (a read-only folder, a path under a file, no permission)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as error:
        raise WriteError(
            error.errno or errno.EACCES,
            f"output_dir={out_dir} cannot be written ({error.strerror or error}), so grid.png and samples.npz could "
            "not be saved; nothing was drawn. Pass a folder you can write: output_dir=<folder>",
        ) from error


def check_room(out_dir: Path, num_samples: int, image_shape: tuple[int, int, int]) -> None:
    """Before anything is drawn: the disk of `out_dir` has room for samples.npz (uint8, uncompressed) and grid.png
    (at most 256 images with borders, written as PNG: at most its raw size)."""
    channels, height, width = image_shape
    needed = num_samples * channels * height * width + min(num_samples, 256) * channels * (height + 2) * (width + 2)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise WriteError(
            errno.ENOSPC,
            f"output_dir={out_dir} has {free:,} bytes free, but num_samples={num_samples} images of {image_shape} "
            f"need about {needed:,} bytes (samples.npz and grid.png); nothing was drawn. Free disk space, pass "
            "output_dir=<folder on a disk with room> or draw fewer (num_samples)",
        )


def write_samples(images: Tensor, labels: Tensor | None, out_dir: Path, *, nrow: int) -> None:
    """grid.png (at most 256 images) and samples.npz: images (N, H, W, C) uint8, labels (N,) int64 (-1: none)."""
    write_grid(images[:256], out_dir / "grid.png", nrow=nrow)
    labels_np = labels.numpy() if labels is not None else np.full(len(images), -1, dtype=np.int64)
    array = images.permute(0, 2, 3, 1).numpy()
    atomic_write(out_dir / "samples.npz", lambda f: np.savez(f, images=array, labels=labels_np), size=array.nbytes)
