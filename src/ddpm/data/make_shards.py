"""Write any RAM source as WebDataset tar shards (`<key>.png` + `<key>.cls` per sample), for data=webdataset.

    python -m ddpm.data.make_shards digits shards/digits --samples-per-shard 200 --image-size 16 --channels 1
    python -m ddpm.data.make_shards mnist:../shared/data/mnist shards/mnist --samples-per-shard 1000
    python -m ddpm.data.make_shards cifar10:data/cifar10 shards/cifar10 --image-size 32 --channels 3
    python -m ddpm.data.make_shards folder:data/faces shards/faces --image-size 64 --channels 3

SOURCE is digits | mnist:ROOT | cifar10:ROOT | folder:ROOT. Samples are shuffled (seeded) before sharding,
so every shard mixes the classes; a folder is decoded one shard at a time (it need not fit in RAM). The last line
printed is the `data.urls=...` value to train with.
A folder's images convert by the mode rule of ddpm.data.images; a file that is refused (a mode or range with
no stated conversion, a damaged file, more pixels than --max-pixels) stops the command naming it. They are decoded
upright (their EXIF orientation applied, as viewers show them) and stored as those pixels in orientation-free PNGs,
so a shard reads the same in any reader; ddpm.data.shards applies the orientation of JPEGs in other tools' shards.
"""

import argparse
import io
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ddpm.atomic import atomic_write
from ddpm.data.image_folder import ImageFolderSource
from ddpm.data.images import PILLOW_MAX_PIXELS
from ddpm.data.sources import CIFAR10Source, DigitsSource, MNISTSource, Source


@dataclass(frozen=True, kw_only=True)
class FolderSource(ImageFolderSource):
    """ImageFolderSource whose refusals name this command's option."""

    setting: ClassVar[str] = "--max-pixels"


SOURCES = {
    "digits": lambda root, max_pixels: DigitsSource(),
    "mnist": lambda root, max_pixels: MNISTSource(root=root, split="auto"),
    "cifar10": lambda root, max_pixels: CIFAR10Source(root=root, split="train"),
    "folder": lambda root, max_pixels: FolderSource(root=root, max_pixels=max_pixels),
}


def parse_source(spec: str, max_pixels: int | None = PILLOW_MAX_PIXELS) -> Source:
    """'digits' | 'mnist:ROOT' | 'cifar10:ROOT' | 'folder:ROOT' -> a reader from ddpm.data.sources."""
    name, _, root = spec.partition(":")
    if name not in SOURCES:
        raise ValueError(f"unknown source {spec!r}; use digits, mnist:ROOT, cifar10:ROOT or folder:ROOT")
    if name != "digits" and not root:
        raise ValueError(f"source {name} needs a folder: {name}:ROOT")
    return SOURCES[name](root or None, max_pixels)


def count(text: str) -> int:
    """--limit: a count >= 1 (0 wrote nothing but crashed; a negative one dropped the last samples)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count >= 1")
    return int(text)


def pixel_count(text: str) -> int | None:
    """--max-pixels: a count >= 1, or null / none for no limit."""
    if text.lower() in ("null", "none"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pixel count >= 1 or null")
    return int(text)


def png_bytes(image: Tensor) -> bytes:
    """(C, H, W) uint8 -> PNG bytes (grey for C = 1, RGB for C = 3)."""
    array = image.permute(1, 2, 0).numpy()
    array = array[:, :, 0] if array.shape[2] == 1 else array
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="PNG")
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: identical inputs, identical shards
    tar.addfile(info, io.BytesIO(data))


def _write_shard(file: BinaryIO, *, images: Tensor, labels: Tensor, first: int) -> None:
    with tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, (image, label) in enumerate(zip(images, labels, strict=True), start=first):
            _add(tar, f"{i:08d}.png", png_bytes(image))
            _add(tar, f"{i:08d}.cls", str(int(label)).encode())


def write_shards(
    images: Tensor, labels: Tensor, out: str | Path, *, samples_per_shard: int, prefix: str = "shard"
) -> list[Path]:
    """images (N, C, H, W) uint8, labels (N,) -> out/prefix-000000.tar, ... in the given order."""
    if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels):
        raise ValueError(f"expected (N, C, H, W) uint8 images and N labels, got {tuple(images.shape)} {images.dtype}")
    if samples_per_shard < 1:
        raise ValueError(f"--samples-per-shard={samples_per_shard} must be >= 1")
    starts = range(0, len(images), samples_per_shard)
    chunks = (
        (images[start : start + samples_per_shard], labels[start : start + samples_per_shard]) for start in starts
    )
    return write_chunks(chunks, out, samples_per_shard=samples_per_shard, prefix=prefix)


def write_chunks(
    chunks: Iterable[tuple[Tensor, Tensor]], out: str | Path, *, samples_per_shard: int, prefix: str = "shard"
) -> list[Path]:
    """One shard per (images, labels) chunk of `samples_per_shard` (the last may hold fewer), each written as it
    comes: a folder is decoded shard by shard (write_folder_shards), never whole."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard, (images, labels) in enumerate(chunks):
        write = partial(_write_shard, images=images, labels=labels, first=shard * samples_per_shard)
        paths.append(atomic_write(out / f"{prefix}-{shard:06d}.tar", write))  # whole or absent (a killed writer)
    return paths


def write_folder_shards(source: ImageFolderSource, order: Tensor, out: str | Path, *, samples_per_shard: int,
                        image_size: int, channels: int | None) -> list[Path]:  # fmt: skip
    """The folder's files in `order`, decoded one shard at a time (ImageNet at 256 px does not fit in RAM): the
    same shards as writing the loaded set in that order."""
    listed = source.labelled_files()
    files = [listed[i] for i in order.tolist()]
    starts = range(0, len(files), samples_per_shard)
    chunks = (source.decode(files[start : start + samples_per_shard], image_size=image_size, channels=channels)
              for start in starts)  # fmt: skip
    return write_chunks(chunks, out, samples_per_shard=samples_per_shard)


def url_pattern(paths: list[Path], prefix: str = "shard") -> str:
    """The brace pattern naming `paths` (written by write_shards), for data.urls."""
    return str(paths[0].parent / f"{prefix}-{{000000..{len(paths) - 1:06d}}}.tar")


def write_source(source: Source, args: argparse.Namespace) -> tuple[list[Path], Tensor, int | None]:
    """(shards, the order written, classes): a folder decoded shard by shard, another source loaded whole."""
    folder = isinstance(source, ImageFolderSource)
    size = source.count() if folder else None
    data = None if folder else source.load(image_size=args.image_size, channels=args.channels)
    order = torch.arange(size if data is None else len(data.images))
    if not args.no_shuffle:
        order = torch.randperm(len(order), generator=torch.Generator().manual_seed(args.seed))
    order, sizes = order[: args.limit], {"samples_per_shard": args.samples_per_shard}
    if data is not None:
        return write_shards(data.images[order], data.labels[order], args.out, **sizes), order, data.num_classes
    paths = write_folder_shards(source, order, args.out, image_size=args.image_size, channels=args.channels, **sizes)
    return paths, order, source.num_classes()


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="digits | mnist:ROOT | cifar10:ROOT | folder:ROOT")
    parser.add_argument("out", help="output folder for the shards")
    parser.add_argument("--samples-per-shard", type=int, default=1000, help="samples per tar file")
    parser.add_argument("--image-size", type=int, default=32, help="H = W of the stored images")
    parser.add_argument("--channels", type=int, choices=(1, 3), default=None, help="1 or 3; default: the source's")
    parser.add_argument("--limit", type=count, default=None, help="write only the first N samples (after shuffling)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle before sharding")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the source's order")
    parser.add_argument("--max-pixels", type=pixel_count, default=PILLOW_MAX_PIXELS,
                        help="folder: refuse images with more pixels (decompression bombs); null: no limit, only "
                        "for trusted files")  # fmt: skip
    args = parser.parse_args(argv)

    try:
        source = parse_source(args.source, args.max_pixels)
    except ValueError as error:
        parser.error(str(error))
    try:
        paths, order, classes = write_source(source, args)
    except (ValueError, FileNotFoundError) as error:  # names the file (or data.root) and what to change
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    print(f"wrote {len(order)} samples ({classes} classes) in {len(paths)} shards under {args.out}")
    print(f"'data.urls=\"{url_pattern(paths)}\"'")  # quoted for Hydra's override grammar
    return paths


if __name__ == "__main__":
    main()
