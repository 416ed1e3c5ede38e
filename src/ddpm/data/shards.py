"""Reading WebDataset tar shards: URL patterns, which shards each (rank, worker) slot reads, and decoding.

A shard is a tar of `<key>.png` (or jpg/webp) + `<key>.cls` members per sample, opened with
`webdataset.gopen`: local paths, `file:`, `pipe:` and http(s) URLs.
"""

import io
import tarfile
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor

from ddpm.data.images import convert_channels, fit_to_size

OnError = Literal["raise", "skip"]
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
LABEL_EXTENSIONS = ("cls", "label")
Sample = tuple[str, dict[str, bytes]]  # key, {extension: bytes}


class ShardError(ValueError):
    """A shard that cannot be read (truncated, corrupt, or holding samples without image or class)."""


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """'dir/shard-{000000..000009}.tar' (or a list of such; '::' joins patterns) -> the shard URLs, in order."""
    from webdataset.shardlists import expand_urls as expand  # braces, '::', $WDS_ variables

    patterns = [urls] if isinstance(urls, str) else list(urls)
    expanded = [url for pattern in patterns for url in expand(str(pattern))]
    if not expanded:
        raise ValueError("data.urls is empty; give shards as 'path/shard-{000000..000099}.tar' or a list")
    return expanded


def assign_shards(shards: list[str], slot: int, slots: int) -> tuple[list[str], int, int]:
    """The shards of one (rank, worker) slot, and (offset, stride): keep samples i with i % stride == offset."""
    if len(shards) >= slots:
        return shards[slot::slots], 0, 1
    shard = slot % len(shards)
    sharers = len(range(shard, slots, len(shards)))  # slots reading this shard
    return [shards[shard]], slot // len(shards), sharers


def read_tar(url: str) -> Iterator[Sample]:
    """Stream a tar shard as (key, {ext: bytes}), grouping consecutive members by key (name up to the first dot)."""
    from webdataset.gopen import gopen

    with gopen(url, "rb") as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
        key, fields = None, {}
        for member in tar:
            if not member.isfile():
                continue
            folder, _, name = member.name.rpartition("/")
            stem, _, ext = name.partition(".")
            member_key = f"{folder}/{stem}" if folder else stem
            if member_key != key and key is not None:
                yield key, fields
                fields = {}
            key = member_key
            fields[ext.lower()] = tar.extractfile(member).read()  # type: ignore[union-attr]
        if key is not None:
            yield key, fields


def decode(fields: dict[str, bytes], *, image_size: int, channels: int | None) -> tuple[Tensor, int]:
    """{png|jpg..: bytes, cls: b'3'} -> (C, image_size, image_size) uint8, class index."""
    import numpy as np
    from PIL import Image

    image_ext = next((e for e in IMAGE_EXTENSIONS if e in fields), None)
    label_ext = next((e for e in LABEL_EXTENSIONS if e in fields), None)
    if image_ext is None or label_ext is None:
        raise ValueError(f"the sample has fields {sorted(fields)}; it needs an image ({IMAGE_EXTENSIONS}) and a .cls")
    with Image.open(io.BytesIO(fields[image_ext])) as image:
        image = image.convert("L" if channels == 1 or (channels is None and image.mode == "L") else "RGB")
        array = np.asarray(image, dtype=np.uint8)
    array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
    tensor = fit_to_size(torch.from_numpy(array.copy())[None], image_size)
    return convert_channels(tensor, channels)[0], int(fields[label_ext].decode().strip())


_DAMAGED = (tarfile.TarError, EOFError, OSError, zlib.error)  # truncated or corrupt archives


def read_shard(url: str, *, image_size: int, channels: int | None, on_error: OnError) -> Iterator[tuple[Tensor, int]]:
    """Decoded samples of one shard; a damaged sample raises ShardError naming the shard, or is skipped and counted."""
    skipped, key = 0, None
    samples = read_tar(url)
    while True:
        try:
            sample = next(samples, None)
        except _DAMAGED as error:  # the archive itself (truncated, not a tar): nothing more can be read
            skipped += 1
            _fail_or_count(url, "at its start" if key is None else f"after sample {key!r}", error, on_error)
            break
        if sample is None:
            break
        key, fields = sample
        try:
            item = decode(fields, image_size=image_size, channels=channels)
        except Exception as error:  # PIL raises many types for damaged images
            skipped += 1
            _fail_or_count(url, f"in sample {key!r}", error, on_error)
            continue
        yield item
    if skipped:
        warnings.warn(
            f"data.on_error=skip: skipped {skipped} damaged sample(s) in shard {url} (a truncated archive counts "
            "as one; the samples after the damage are lost)",
            stacklevel=2,
        )


def _fail_or_count(url: str, where: str, error: Exception, on_error: OnError) -> None:
    if on_error == "raise":
        raise ShardError(
            f"shard {url} cannot be read {where}: {type(error).__name__}: {error}; rewrite it "
            "(python -m ddpm.data.make_shards), remove it from data.urls, or set data.on_error=skip"
        ) from error
