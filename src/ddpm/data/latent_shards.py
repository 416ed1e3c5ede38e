"""The encoded-latents format: WebDataset tar shards of a VAE's posteriors, and the folder's meta.json.

    <out>/meta.json                   what the folder holds (below), written last, when every shard is whole
    <out>/latents-000000.tar, ...     `samples_per_shard` images each, in the source's order (an
                                      image folder's shuffled, seeded: its files come class by class)

A shard's first member, `__meta__.json`, is the folder's meta without `count` and `shards` (a streamed source's
size is known only at the end) and with `first` and `samples`: the global index of its first image and how many
it holds. Then per image i (key `%08d` of i): `<key>.mean.npy`, `<key>.logvar.npy` (float16, (c, h, w): the
posterior N(mean, exp(logvar)) of ddpm.models.vae.VAE.encode, unscaled) and `<key>.cls` (the label; -1: none).
Tar headers carry no time or owner, so the same images and VAE give the same bytes.

meta.json: {"format", "vae" (absolute folder), "vae_identity", "scaling_factor", "shift_factor", "latent_shape"
[c, h, w], "image_shape" [C, H, W], "num_classes", "stored", "samples_per_shard", "data" (the encode-time data
config, resolved), "count", "shards" [file names]}.
"""

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ddpm.atomic import atomic_write_bytes
from ddpm.data.shards import read_tar

FORMAT = "lightning-ddpm latents 1"
STORED = "posterior mean and logvar, float16"
META, HEADER = "meta.json", "__meta__.json"
PER_SHARD = ("first", "samples")  # a shard header's own keys
PER_FOLDER = ("count", "shards")  # meta.json's keys known only when every shard is written
# Data keys that change how batches are served, not which images are encoded (ignored when comparing encodings).
SERVING = ("batch_size", "num_workers", "pin_memory", "max_ram_fraction", "val_size", "split_seed", "hflip",
           "epoch_length", "shuffle_buffer", "seed", "timeout_s", "val_shards", "on_error")  # fmt: skip


class LatentShardError(ValueError):
    """A latent shard or meta.json that is missing, torn or of another encoding (the message names the file)."""


def shard_name(index: int) -> str:
    return f"latents-{index:06d}.tar"


def npy(array: Tensor) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array.numpy(), allow_pickle=False)
    return buffer.getvalue()


def write_shard(path: Path, header: dict[str, Any], first: int, mean: Tensor, logvar: Tensor, labels: Tensor) -> None:
    """One shard, atomically (ddpm.atomic): `header` + (first, samples), then mean/logvar (n, c, h, w) as float16."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        meta = header | {"first": first, "samples": len(mean)}
        _add(tar, HEADER, json.dumps(meta, sort_keys=True).encode())
        for i in range(len(mean)):
            key = f"{first + i:08d}"
            _add(tar, f"{key}.mean.npy", npy(mean[i].to(torch.float16).contiguous()))
            _add(tar, f"{key}.logvar.npy", npy(logvar[i].to(torch.float16).contiguous()))
            _add(tar, f"{key}.cls", str(int(labels[i])).encode())
    atomic_write_bytes(path, buffer.getvalue())


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def read_header(path: Path) -> dict[str, Any]:
    """A shard's `__meta__.json` (its first member only)."""
    try:
        with tarfile.open(path, mode="r|") as tar:
            member = next(iter(tar), None)
            if member is None or member.name != HEADER:
                raise LatentShardError(f"{path} does not start with {HEADER}: not a latent shard")
            return json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
    except (tarfile.TarError, OSError, EOFError, ValueError) as error:
        if isinstance(error, LatentShardError):
            raise
        raise LatentShardError(f"{path} cannot be read ({type(error).__name__}: {error})") from error


def iter_samples(path: str | Path, header: dict[str, Any]) -> Iterator[tuple[int, Tensor, int]]:
    """(index, moments (2c, h, w) float16 = cat(mean, logvar), label) of each image of the shard `header` (its
    expected `__meta__.json`) describes, in order; a shard of another encoding, a torn or malformed one raises
    LatentShardError naming it (the streamed path's check as the preload's: at the shard's end, the count)."""
    expected, shape, checked = header["first"], header["latent_shape"], False
    try:
        for key, fields in read_tar(str(path)):
            if key == "__meta__" and not checked:
                if different := differing(json.loads(fields.get("json", b"{}")), header):
                    raise LatentShardError(f"{path} holds another encoding than expected: {different} differ")
                checked = True
                continue
            if not checked:
                raise LatentShardError(f"{path} does not start with {HEADER}: not a latent shard")
            if not key.isdigit() or {"mean.npy", "logvar.npy", "cls"} - set(fields):
                raise LatentShardError(f"{path}: sample {key!r} has fields {sorted(fields)}, not mean.npy, "
                                       "logvar.npy and cls")  # fmt: skip
            if int(key) != expected:
                raise LatentShardError(f"{path}: sample {int(key)} where {expected} was expected")
            mean, logvar = (_array(fields[f"{name}.npy"], path, key, shape) for name in ("mean", "logvar"))
            yield int(key), torch.cat([mean, logvar]), int(fields["cls"].decode())
            expected += 1
    except (tarfile.TarError, OSError, EOFError, ValueError) as error:
        if isinstance(error, LatentShardError):
            raise
        raise LatentShardError(f"{path} is torn or damaged ({type(error).__name__}: {error})") from error
    if expected - header["first"] != header["samples"]:
        raise LatentShardError(f"{path} holds {expected - header['first']} of its {header['samples']} samples: it is "
                               "torn; rerun the encode command to rewrite it")  # fmt: skip


def _array(data: bytes, path: str | Path, key: str, shape: list[int]) -> Tensor:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as error:
        raise LatentShardError(f"{path}: sample {key} holds a damaged array ({error})") from error
    if array.dtype != np.float16 or list(array.shape) != list(shape):
        raise LatentShardError(f"{path}: sample {key} holds {array.dtype} {list(array.shape)}, not float16 {shape}")
    return torch.from_numpy(array)


def content(data: dict[str, Any]) -> dict[str, Any]:
    """The keys of a data config node that decide which images are encoded."""
    return {k: v for k, v in data.items() if k not in SERVING}


def differing(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The keys in which two headers describe different latents: `data` by its content() (a serving key such as
    data.num_workers encodes the same images), `vae` (the folder) not at all (`vae_identity` is the VAE)."""
    keys = sorted(k for k in set(found) | set(expected) if k not in ("vae", "data") and found.get(k) != expected.get(k))
    return keys + (["data"] if content(found.get("data") or {}) != content(expected.get("data") or {}) else [])


def read_shard(path: Path, header: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """A whole shard checked against `header` (its expected `__meta__.json`): (moments (n, 2c, h, w), labels (n,))."""
    rows, labels = [], []
    for _, moments, label in iter_samples(path, header):  # its header checked first
        rows.append(moments)
        labels.append(label)
    shape = (0, 2 * header["latent_shape"][0], *header["latent_shape"][1:])
    return (torch.stack(rows) if rows else torch.empty(shape, dtype=torch.float16)), torch.tensor(labels).long()


def shard_problem(path: Path, header: dict[str, Any]) -> str | None:
    """Why the shard at `path` is not the whole shard `header` describes (None: it is)."""
    try:
        read_shard(path, header)
    except LatentShardError as error:
        return str(error)
    return None


def read_meta(folder: str | Path, key: str = "data.root") -> dict[str, Any]:
    """The meta.json of an encoded folder; refusals name `key` (the setting that points at the folder)."""
    path = Path(folder).expanduser() / META
    fix = "encode the data first: python -m ddpm.data.encode vae=<VAE folder> data=<option> out=<folder>"
    if not path.is_file():
        shards = sorted(path.parent.glob("latents-*.tar")) if path.parent.is_dir() else []
        why = "an encode that has not finished (rerun it to complete it)" if shards else "not an encoded folder"
        raise FileNotFoundError(f"{key}={folder} has no {META}: {why}; {fix}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise LatentShardError(f"{path} cannot be read ({error}); rerun the encode command to rewrite it") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise LatentShardError(f"{path} is not a latents folder of format {FORMAT!r} (format: {found!r}); {fix}")
    return meta
