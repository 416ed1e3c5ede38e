"""Reading WebDataset tar shards: URL patterns, which shards each (rank, worker) slot reads, and decoding.

A shard is a tar of `<key>.png` (or jpg/webp) + `<key>.cls` members per sample. http(s) URLs are streamed
by `HTTPShard` (urllib, every read bounded by `timeout_s`, a body shorter than its Content-Length an error:
tarfile would take a cut at a member boundary for the archive's end); local paths, `file:` and `pipe:` are
opened with `webdataset.gopen`. Every archive must end at tar's end-of-archive marker (tarfile takes a cut, or a
damaged header, for the end: such a shard read short, silently). Every error names the shard's URL (and the
sample's key where there is one).
"""

import http.client
import io
import os
import random
import tarfile
import urllib.error
import urllib.request
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Literal

from torch import Tensor
from torch.utils.data import get_worker_info

from ddpm.data.images import PILLOW_MAX_PIXELS, centre_crop, convert_channels, open_image

OnError = Literal["raise", "skip"]
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
LABEL_EXTENSIONS = ("cls", "label")
Sample = tuple[str, dict[str, bytes]]  # key, {extension: bytes}


class ShardError(ValueError):
    """A shard that cannot be read (truncated, corrupt, or holding samples without image or class)."""


def expand_urls(urls: str | Sequence[str], key: str = "data.urls") -> list[str]:
    """'dir/shard-{000000..000009}.tar' (or a list of such; '::' joins patterns) -> the shard URLs, in order."""
    from webdataset.shardlists import expand_urls as expand  # braces, '::', $WDS_ variables

    patterns = [urls] if isinstance(urls, str) else list(urls)
    expanded = [url for pattern in patterns for url in expand(str(pattern))]
    if not expanded:
        raise ValueError(f"{key} is empty; give shards as 'path/shard-{{000000..000099}}.tar' or a list")
    return expanded


def same_shard(url: str) -> str:
    """A URL as compared with others: a local path resolved (shards/./a.tar, file:shards/a.tar and
    file:///abs/shards/a.tar are the same file)."""
    local = url.removeprefix("file://") if url.startswith("file://") else url.removeprefix("file:")
    return url if "://" in local or local.startswith("pipe:") else os.path.realpath(local)


def shard_fix(error: BaseException) -> str:
    """What to do about a shard that cannot be read, by why."""
    if isinstance(error, RemoteShardError):
        return "check that the server serves it (each read waits at most data.timeout_s)"
    if isinstance(error, FileNotFoundError):
        return "check data.urls / data.val_urls (no such file: a brace range past the last shard, or a moved folder)"
    return "rewrite it (python -m ddpm.data.make_shards)"


def assign_shards(shards: list[str], slot: int, slots: int) -> tuple[list[str], int, int]:
    """The shards of one (rank, worker) slot, and (offset, stride): keep samples i with i % stride == offset."""
    if len(shards) >= slots:
        return shards[slot::slots], 0, 1
    shard = slot % len(shards)
    sharers = len(range(shard, slots, len(shards)))  # slots reading this shard
    return [shards[shard]], slot // len(shards), sharers


@dataclass(frozen=True)
class WorkerShare:
    """One (rank, DataLoader worker) slot's shards, (offset, stride) inside them (assign_shards), and its RNG."""

    shards: list[str]
    offset: int
    stride: int
    rng: random.Random
    worker: int
    workers: int

    def batch_count(self, batches_per_epoch: int) -> int:
        """This worker's part of an epoch of `batches_per_epoch` batches (the workers' parts add up to it)."""
        return batches_per_epoch // self.workers + int(self.worker < batches_per_epoch % self.workers)


def worker_share(shards: list[str], *, rank: int, world_size: int, seed: int, start: int = 0) -> WorkerShare:
    """The share of `shards` read by this DataLoader worker of rank `rank`, with an RNG seeded by (seed, start, slot):
    every slot shuffles differently, and again in a run resumed at optimizer step `start` (a resume restarts the
    workers and their streams, which would replay the first passes)."""
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    slot = rank * workers + worker
    mine, offset, stride = assign_shards(shards, slot, world_size * workers)
    return WorkerShare(mine, offset, stride, random.Random(f"{seed}-{start}-{slot}"), worker, workers)


class RemoteShardError(ConnectionError):
    """An http(s) shard that cannot be fetched or whose stream broke (the message names the URL)."""


class HTTPShard(io.RawIOBase):
    """The body of an http(s) URL as a stream: each read waits at most `timeout_s`; errors name the URL."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        super().__init__()
        self.url, self.timeout_s, self.received = url, timeout_s, 0
        try:
            self.response = urllib.request.urlopen(url, timeout=timeout_s)  # http(s) only: see open_shard
        except urllib.error.HTTPError as error:
            raise RemoteShardError(f"{url} answered HTTP {error.code} {error.reason}") from error
        except (OSError, http.client.HTTPException) as error:  # URLError, refused, timeout before the headers
            raise RemoteShardError(f"{url} cannot be fetched ({self._why(error)})") from error
        length = self.response.headers.get("Content-Length", "")
        self.expected = int(length) if length.strip().isdigit() else None  # None: chunked or close-delimited

    def _why(self, error: BaseException) -> str:
        reason = getattr(error, "reason", error)
        if isinstance(reason, TimeoutError):
            return f"no answer within data.timeout_s={self.timeout_s} s"
        return f"{type(reason).__name__}: {reason}"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        try:
            count = self.response.readinto(buffer)
        except (OSError, http.client.HTTPException) as error:  # a stall past the timeout, a reset, a broken chunk
            raise RemoteShardError(f"{self.url} broke off after {self.received} bytes ({self._why(error)})") from error
        if count == 0 and len(buffer) and self.expected is not None and self.received < self.expected:
            raise RemoteShardError(
                f"{self.url} ended after {self.received} of its {self.expected} bytes (Content-Length): the "
                "connection was closed mid-stream"
            )
        self.received += count
        return count

    def close(self) -> None:
        if hasattr(self, "response"):
            self.response.close()
        super().close()


def open_shard(url: str, *, timeout_s: float) -> IO[bytes]:
    """A binary stream of the shard at `url`: http(s) by HTTPShard, anything else by webdataset.gopen."""
    if url.lower().startswith(("http://", "https://")):
        return io.BufferedReader(HTTPShard(url, timeout_s=timeout_s), buffer_size=1 << 20)
    from webdataset.gopen import gopen

    return gopen(url, "rb")


class _Header(tarfile.TarInfo):
    """A member's header, noting on the archive why its reading stopped: tarfile ends an archive at any header it
    cannot read (none left, cut, a bad checksum, a zero block), as if it were the end."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as error:
            tar.stopped_by = error  # type: ignore[attr-defined]
            raise


def _check_end(tar: tarfile.TarFile) -> None:
    """The archive ended at tar's end-of-archive marker: two zero blocks, or one at the file's end (a killed
    writer's shard ends after a member; a damaged header reads as an end too, with samples after it)."""
    error = getattr(tar, "stopped_by", None)
    if isinstance(error, tarfile.EOFHeaderError) and not tar.fileobj.read(tarfile.BLOCKSIZE).strip(b"\0"):  # type: ignore[union-attr]
        return  # the marker's second zero block (or the file's end): what follows is not the archive's, as GNU tar
    why = "a zero block with data after it" if isinstance(error, tarfile.EOFHeaderError) else error
    raise tarfile.ReadError(f"the archive stops without tar's end-of-archive marker ({why}): truncated or damaged")


def read_tar(url: str, *, timeout_s: float = 60.0) -> Iterator[Sample]:
    """Stream a tar shard as (key, {ext: bytes}), grouping consecutive members by key (name up to the first dot).
    An archive cut or damaged between members is an error (its last group is not yielded: it may lack fields)."""
    with (
        open_shard(url, timeout_s=timeout_s) as stream,
        tarfile.open(fileobj=stream, mode="r|*", tarinfo=_Header) as tar,
    ):
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
        _check_end(tar)
        if key is not None:
            yield key, fields


def decode(
    fields: dict[str, bytes],
    *,
    image_size: int,
    channels: int | None,
    max_pixels: int | None = PILLOW_MAX_PIXELS,
    key: str = "sample",
) -> tuple[Tensor, int]:
    """{png|jpg..: bytes, cls: b'3'} -> (C, image_size, image_size) uint8, class index. Decoded upright (EXIF
    orientation applied); modes convert as ddpm.data.images says (16-bit scaled, transparency onto white, ...);
    resized (a non-square one: its centre square) exactly as data=image_folder loads the same file; images over
    max_pixels are refused."""
    image_ext = next((e for e in IMAGE_EXTENSIONS if e in fields), None)
    label_ext = next((e for e in LABEL_EXTENSIONS if e in fields), None)
    if image_ext is None or label_ext is None:
        raise ValueError(f"the sample has fields {sorted(fields)}; it needs an image ({IMAGE_EXTENSIONS}) and a .cls")
    mode = {1: "L", 3: "RGB"}.get(channels)  # type: ignore[arg-type]
    image = open_image(fields[image_ext], mode, name=f"image {key}.{image_ext}", max_pixels=max_pixels,
                       setting="data.max_pixels")  # fmt: skip
    tensor = centre_crop(image, image_size)[None]  # as data=image_folder loads the same file (square: resized)
    return convert_channels(tensor, channels)[0], int(fields[label_ext].decode().strip())


DAMAGED = (tarfile.TarError, EOFError, OSError, zlib.error, http.client.HTTPException)  # truncated, corrupt, cut off


@dataclass
class Skipped:
    """What on_error=skip dropped: samples, and shards that could not be opened at all."""

    samples: int = 0
    shards: list[str] = field(default_factory=list)


def read_shard(
    url: str,
    *,
    image_size: int,
    channels: int | None,
    on_error: OnError,
    max_pixels: int | None = PILLOW_MAX_PIXELS,  # images over this many pixels are refused (None: no limit)
    timeout_s: float = 60.0,  # http(s): the longest wait for each read
    skipped: Skipped | None = None,  # counts what on_error=skip dropped, across shards
) -> Iterator[tuple[Tensor, int]]:
    """Decoded samples of one shard; a damaged sample raises ShardError naming the shard, or is skipped and counted."""
    skipped = Skipped() if skipped is None else skipped
    dropped, key, unreadable = 0, None, None
    samples = read_tar(url, timeout_s=timeout_s)
    while True:
        try:
            sample = next(samples, None)
        except DAMAGED as error:  # the archive itself (unreachable, truncated, not a tar): nothing more to read
            _fail_or_count(url, "at its start" if key is None else f"after sample {key!r}", error, on_error)
            dropped, unreadable = dropped + 1, error
            break
        if sample is None:
            break
        key, fields = sample
        try:
            item = decode(fields, image_size=image_size, channels=channels, max_pixels=max_pixels, key=key)
        except Exception as error:  # PIL raises many types for damaged images
            dropped += 1
            _fail_or_count(url, f"in sample {key!r}", error, on_error)
            continue
        yield item
    if key is None and unreadable is not None:
        skipped.shards.append(url)
        warnings.warn(f"data.on_error=skip: skipped shard {url}, which cannot be read ({unreadable})", stacklevel=2)
    elif dropped:
        skipped.samples += dropped
        warnings.warn(
            f"data.on_error=skip: skipped {dropped} damaged sample(s) in shard {url} (a truncated archive counts "
            "as one; the samples after the damage are lost)",
            stacklevel=2,
        )


def _fail_or_count(url: str, where: str, error: Exception, on_error: OnError) -> None:
    if on_error == "raise":
        raise ShardError(
            f"shard {url} cannot be read {where}: {type(error).__name__}: {error}; {shard_fix(error)}, remove it "
            "from its list, or set data.on_error=skip"
        ) from error
