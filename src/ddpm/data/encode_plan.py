"""What `python -m ddpm.data.encode` checks before encoding: its settings, the images of the data config (a RAM
source or streamed WebDataset shards) and the output folder (never another encoding's)."""

import functools
import hashlib
import json
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import Tensor

from ddpm.atomic import process_alive
from ddpm.data.latent_shards import META, PER_FOLDER, PER_SHARD, LatentShardError, content, read_header
from ddpm.models.vae import VAE

LATENTS = "ddpm.data.latents.LatentDataModule"
SETTINGS = ("vae", "out", "samples_per_shard", "batch_size", "devices", "device")  # conf/encode.yaml's own keys
Chunk = tuple[int, int, int, Callable[[], tuple[Tensor, Tensor]]]  # shard index, first image, images, load()


@dataclass(frozen=True)
class Plan:
    """The checked settings every worker needs, and the header every shard carries."""

    vae: str  # the VAE folder
    out: Path  # the output folder
    batch_size: int  # images per encoder call
    devices: int  # worker processes
    device: str  # cpu or cuda
    header: dict[str, Any]  # ddpm.data.latent_shards: a shard's __meta__.json without first and samples

    def device_of(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device == "cuda" else torch.device("cpu")


def settings_of(cfg: DictConfig) -> dict[str, Any]:
    """encode.yaml's own keys, checked, each refusal naming its key."""
    unknown = sorted(set(cfg) - {"data", *SETTINGS})
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}: python -m ddpm.data.encode reads data and {list(SETTINGS)}")
    for key in ("vae", "out"):
        if cfg.get(key) in (None, "", "???") or cfg._get_node(key)._is_missing():  # type: ignore[union-attr]
            raise ValueError(f"{key} is not set: python -m ddpm.data.encode vae=<VAE folder> out=<folder> data=...")
    for key, minimum in (("samples_per_shard", 1), ("batch_size", 1), ("devices", 1)):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{key}={value!r} must be an integer >= {minimum}")
    device = cfg.get("device")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r} must be auto, cpu or cuda")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and cfg.devices > torch.cuda.device_count():
        raise ValueError(f"devices={cfg.devices} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return {"vae": str(Path(str(cfg.vae)).expanduser()), "out": Path(str(cfg.out)).expanduser(),
            "samples_per_shard": cfg.samples_per_shard,
            "batch_size": cfg.batch_size, "devices": cfg.devices, "device": device}  # fmt: skip


@dataclass
class RAMImages:
    """A RAM source's images, in its order (data.limit applied); a chunk is a slice."""

    images: Tensor  # (N, C, H, W) uint8
    labels: Tensor  # (N,) int64; -1 where the source has no classes
    num_classes: int | None

    @property
    def count(self) -> int:
        return len(self.images)

    def chunks(self, size: int) -> Iterator[Chunk]:
        for index, first in enumerate(range(0, len(self.images), size)):
            rows = slice(first, first + size)
            yield index, first, len(self.images[rows]), lambda rows=rows: (self.images[rows], self.labels[rows])


@dataclass
class FolderImages:
    """An image folder's files in a seeded random order, decoded chunk by chunk (only the chunks encoded, in the
    worker that encodes them). Its class sub-folders list the images class by class: streamed latents in that order
    gave batches of a few classes (a shuffle buffer holds about one shard)."""

    files: list[tuple[Path, int]]  # (image, label), shuffled
    decode: Callable[[list[tuple[Path, int]]], tuple[Tensor, Tensor]]  # ImageFolderSource.decode at the size
    num_classes: int | None
    header: dict[str, str]  # in every shard's header and meta.json: the order, and which files it is of
    SEED: ClassVar[int] = 0

    @classmethod
    def of(cls, source: Any, image_size: int, channels: int, limit: int | None) -> "FolderImages":
        files = source.kept_files(limit)  # the images the pixel run with this data.limit trains on
        order = torch.randperm(len(files), generator=torch.Generator().manual_seed(cls.SEED)).tolist()
        decode = functools.partial(source.decode, image_size=image_size, channels=channels)
        shuffled, root = [files[i] for i in order], Path(source.root).expanduser()  # the files come expanded
        header = {"order": f"shuffled (seed {cls.SEED})", "files": listing(shuffled, root)}
        return cls(shuffled, decode, source.num_classes(), header)

    @property
    def count(self) -> int:
        return len(self.files)

    def chunks(self, size: int) -> Iterator[Chunk]:
        for index, first in enumerate(range(0, len(self.files), size)):
            rows = self.files[first : first + size]
            yield index, first, len(rows), lambda rows=rows: self._load(rows)

    def _load(self, rows: list[tuple[Path, int]]) -> tuple[Tensor, Tensor]:
        images, labels = self.decode(rows)
        return images, labels if self.num_classes is not None else torch.full_like(labels, -1)


def listing(files: list[tuple[Path, int]], root: Path) -> str:
    """The files an image folder's shards are of, in order: their count and a digest of (path under root, label).
    A folder whose files changed (an unreadable image removed, as its refusal advises) shuffles into another order:
    shards of the old one, skipped as finished, gave some images twice and lost others."""
    digest = hashlib.sha256("\n".join(f"{path.relative_to(root)}\t{label}" for path, label in files).encode())
    return f"{len(files)} files, sha256 {digest.hexdigest()[:16]}"


@dataclass
class StreamImages:
    """WebDataset shards read in order (data.urls, then data.val_urls); only the chunks encoded are decoded."""

    urls: list[str]
    image_size: int
    channels: int
    max_pixels: int | None
    num_classes: int | None
    count: None = None  # not known before the end

    def chunks(self, size: int) -> Iterator[Chunk]:
        from ddpm.data.shards import DAMAGED, read_tar, shard_fix

        pending: list[tuple[str, str, dict[str, bytes]]] = []
        index = first = 0
        for url in self.urls:
            key = None
            try:
                for key, fields in read_tar(url):
                    pending.append((url, key, fields))
                    if len(pending) == size:
                        yield index, first, size, lambda batch=pending: self._decode(batch)
                        index, first, pending = index + 1, first + size, []
            except DAMAGED as error:  # truncated, corrupt, cut off: encoding on would leave its samples out
                where = "at its start" if key is None else f"after sample {key!r}"
                why = f"{where}: {type(error).__name__}: {error}"
                raise ValueError(f"shard {url} cannot be read {why}; {shard_fix(error)}, or remove it") from error
        if pending:
            yield index, first, len(pending), lambda batch=pending: self._decode(batch)

    def _decode(self, samples: list[tuple[str, str, dict[str, bytes]]]) -> tuple[Tensor, Tensor]:
        from ddpm.data.shards import decode

        images, labels = [], []
        for url, key, fields in samples:
            try:
                image, label = decode(fields, image_size=self.image_size, channels=self.channels,
                                      max_pixels=self.max_pixels, key=key)  # fmt: skip
            except Exception as error:  # PIL raises many types for damaged images
                raise ValueError(f"shard {url}, sample {key!r}: {error}; remove it from the shard") from error
            images.append(image)
            labels.append(label)
        return torch.stack(images), torch.tensor(labels, dtype=torch.int64)


def images_of(data: dict[str, Any], vae: VAE) -> tuple[RAMImages | StreamImages, dict[str, Any]]:
    """The images of the data config node `data` at the VAE's channels, and the node as encoded."""
    from ddpm.config.build import build
    from ddpm.data.image_folder import ImageFolderSource
    from ddpm.data.ram import RAMDataModule, validate_image_set
    from ddpm.data.shards import expand_urls
    from ddpm.data.webdataset import WebDataModule

    if data.get("_target_") == LATENTS:
        raise ValueError("data=latents is already encoded; pick the pixel data set (data=mnist, data.root=...)")
    if data.get("channels") not in (None, vae.in_channels):
        raise ValueError(f"data.channels={data['channels']} but the VAE ({vae.folder}) encodes {vae.in_channels}-"
                         f"channel images; set data.channels={vae.in_channels} or null")  # fmt: skip
    data = data | {"channels": vae.in_channels}
    if data.get("hflip"):
        warnings.warn("data.hflip=true: the latents are of the images as they are (no flipped copies); a latent "
                      "run trains without flips. data.hflip=false says so and silences this", stacklevel=2)  # fmt: skip
    try:
        vae.latent_shape(data["image_size"])
    except ValueError as error:
        raise ValueError(f"data.image_size: {error}; set data.image_size to a multiple of it") from error
    datamodule = build(data)
    if isinstance(datamodule, RAMDataModule) and isinstance(datamodule.source, ImageFolderSource):
        return FolderImages.of(datamodule.source, datamodule.image_size, vae.in_channels, datamodule.limit), data
    if isinstance(datamodule, RAMDataModule):
        datamodule.prepare_data()
        datamodule._check_ram()
        loaded = datamodule.source.load(image_size=datamodule.image_size, channels=datamodule.channels,
                                        limit=datamodule.limit)  # fmt: skip
        images, labels = loaded.images, loaded.labels
        validate_image_set(loaded, image_size=datamodule.image_size)
        labels = labels if loaded.num_classes is not None else torch.full_like(labels, -1)
        return RAMImages(images.contiguous(), labels, loaded.num_classes), data
    if isinstance(datamodule, WebDataModule):
        urls = expand_urls(datamodule.urls) + (expand_urls(datamodule.val_urls) if datamodule.val_urls else [])
        return StreamImages(urls, datamodule.image_size, vae.in_channels, datamodule.max_pixels,
                            datamodule.num_classes), data  # fmt: skip
    raise ValueError(f"data._target_={data.get('_target_')} is neither a RAM source nor WebDataset shards; encode "
                     "takes data=digits, mnist, cifar10, image_folder or webdataset")  # fmt: skip


def prepare_out(out: Path, header: dict[str, Any]) -> None:
    """Refuse an `out` that holds anything but this encoding's files; remove leftovers of killed writes."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={out} is a file; give a folder")
    out.mkdir(parents=True, exist_ok=True)
    leftover = re.compile(r"\.(?:latents-\d{6}\.tar|meta\.json)\.tmp-(\d+)")  # ddpm.atomic's temporary files
    shards, others = [], []
    for entry in sorted(out.iterdir()):
        if re.fullmatch(r"latents-\d{6}\.tar", entry.name):
            shards.append(entry)
        elif (match := leftover.fullmatch(entry.name)) is not None:
            if not process_alive(int(match[1])):
                entry.unlink(missing_ok=True)  # a temporary file of a killed encode
        elif entry.name != META:
            others.append(entry.name)
    if others:
        raise ValueError(f"out={out} holds files that are not latent shards ({others[:5]}); give a new or empty folder")
    if (out / META).exists():
        try:
            found = json.loads((out / META).read_text())
        except (OSError, ValueError):
            found = None
        if isinstance(found, dict):
            check_same(found, header, out / META, PER_FOLDER)
        else:  # unreadable: written again when every shard is whole
            (out / META).unlink()
    for shard in shards:
        try:
            found = read_header(shard)
        except LatentShardError:
            continue  # torn: the encode rewrites it
        check_same(found, header, shard, PER_SHARD)


def check_same(found: dict[str, Any], expected: dict[str, Any], where: Path, own: tuple[str, ...]) -> None:
    """Refuse `where` if it holds another encoding than `expected`, naming both."""
    fix = f"give another out=, or delete {where.parent} to encode afresh"
    if found.get("vae_identity") != expected["vae_identity"]:
        raise ValueError(
            f"{where} holds latents of the VAE {found.get('vae')} (identity {found.get('vae_identity')}), not of "
            f"vae={expected['vae']} (identity {expected['vae_identity']}); {fix}"
        )
    old, new = (content(d.get("data") or {}) for d in (found, expected))
    if old != new:
        raise ValueError(f"{where} holds latents of the data {old}, not of {new}; {fix}")
    keys = sorted(
        k for k in set(found) | set(expected) if k not in (*own, "data", "vae") and found.get(k) != expected.get(k)
    )
    if keys:
        values = ", ".join(f"{k}: {found.get(k)!r} there, {expected.get(k)!r} here" for k in keys)
        raise ValueError(f"{where} holds another encoding ({values}); {fix}")
