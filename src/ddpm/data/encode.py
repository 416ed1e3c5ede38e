"""Encode a data set once into a VAE's latents, for `data=latents` (Rombach et al. 2022, latent diffusion):

    python -m ddpm.data.encode vae=<AutoencoderKL folder> data=mnist data.image_size=32 out=latents/mnist

The config is conf/encode.yaml: any `data` option (`data.root=...` as for train.py), at `data.image_size` pixels
and the VAE's channels. Every image of the source (train and validation alike: `data=latents` holds out its own
`data.val_size` by the same seeded split as RAMDataModule) is encoded by ddpm.models.vae.VAE into the posterior's
mean and log-variance, stored in float16 (ddpm.data.latent_shards): training then draws a fresh posterior sample
each step, as LDM trains, for the cost of storing two arrays instead of one sample.

Shards are written whole or not at all (ddpm.atomic); a rerun checks the shards already there, skips the whole
ones and rewrites torn ones, so an interrupted encode is finished by running the same command again. An `out`
holding another VAE's or another data set's latents is refused. `devices=N` starts N worker processes (a local
process pool: spawned, one per GPU; forked on the CPU, each with its share of the cores) that encode the shards j
with j % N == rank: an encode is a one-off pass that one node finishes, so no launcher or process group is needed,
and nothing is exchanged but each worker's count. meta.json is written last, when every shard is whole.
"""

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ddpm.atomic import atomic_write_text
from ddpm.config import CONF
from ddpm.data.encode_plan import Plan, images_of, prepare_out, settings_of
from ddpm.data.latent_shards import (
    FORMAT,
    META,
    STORED,
    LatentShardError,
    read_header,
    shard_name,
    shard_problem,
    write_shard,
)
from ddpm.models.vae import VAE


@dataclass(frozen=True)
class Share:
    """What one worker did: the source's shard count, images encoded and skipped (already whole), seconds."""

    shards: int
    encoded: int
    skipped: int
    seconds: float


def encode(cfg: DictConfig) -> dict[str, Any]:
    """Encode `cfg.data` with the VAE `cfg.vae` into `cfg.out`; returns the folder's meta.json (see the module doc)."""
    plan, images, vae = plan_of(cfg)
    prepare_out(plan.out, plan.header)
    start = time.perf_counter()
    if plan.devices == 1:
        shares = [encode_share(plan, images, 0, vae)]
    else:
        import torch.multiprocessing as mp  # registers torch's reductions: the images cross in shared memory

        # CUDA cannot be forked into; CPU workers fork (no second start-up, the modules are imported already).
        context = mp.get_context("spawn" if plan.device == "cuda" else "fork")
        with ProcessPoolExecutor(plan.devices, mp_context=context) as pool:
            shares = list(pool.map(encode_share, [plan] * plan.devices, [images] * plan.devices, range(plan.devices)))
    wall = time.perf_counter() - start
    meta = finish(plan, max(share.shards for share in shares))
    encoded, skipped = sum(s.encoded for s in shares), sum(s.skipped for s in shares)
    rate = encoded / max(max(s.seconds for s in shares), 1e-9)
    print(f"encoded {encoded} images in {wall:.1f} s ({rate:.1f} images/s over {plan.devices} device(s) on "
          f"{plan.device}); {skipped} were encoded already; {meta['count']} in {len(meta['shards'])} "
          "shards")  # fmt: skip
    c, h, _ = meta["latent_shape"]
    print(f"train on them: data=latents data.root={plan.out} model.in_channels={c} model.image_size={h}")
    return meta


def plan_of(cfg: DictConfig) -> tuple[Plan, Any, VAE]:
    """The checked settings with every shard's header, the images to encode, and the VAE (on the CPU)."""
    settings = settings_of(cfg)
    vae = VAE.load(settings["vae"], "cpu")
    data = OmegaConf.to_container(cfg.data, resolve=True)
    images, data = images_of(data, vae)  # the data node as encoded (channels: the VAE's)
    latent_shape = list(vae.latent_shape(data["image_size"]))
    header = {
        "format": FORMAT,
        "vae": str(Path(settings["vae"]).resolve()),
        "vae_identity": vae.identity,
        "scaling_factor": vae.scale,
        "shift_factor": vae.shift,
        "latent_shape": latent_shape,
        "image_shape": [vae.in_channels, data["image_size"], data["image_size"]],
        "num_classes": images.num_classes,
        "stored": STORED,
        "samples_per_shard": settings["samples_per_shard"],
        "data": data,
        **getattr(images, "header", {}),  # an image folder's order
    }
    plan = Plan(header=header, **{k: v for k, v in settings.items() if k != "samples_per_shard"})
    return plan, images, vae


def encode_share(plan: Plan, images: Any, rank: int, vae: VAE | None = None) -> Share:
    """Worker `rank` of `plan.devices`: encode and write the shards j with j % devices == rank that are not whole
    (`vae`: the one the plan loaded, in a single process; a worker process loads its own)."""
    device = plan.device_of(rank)
    if plan.devices > 1 and device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.devices))
    vae = VAE.load(plan.vae, device) if vae is None else vae.to(device)
    if vae.identity != plan.header["vae_identity"]:
        raise ValueError(f"the VAE in {plan.vae} changed while encoding (identity {vae.identity}, was "
                         f"{plan.header['vae_identity']}); rerun the command")  # fmt: skip
    encoded = skipped = shards = 0
    size = plan.header["samples_per_shard"]
    start = time.perf_counter()
    with progress(rank, images.count and -(-images.count // plan.devices)) as advance:
        for index, first, count, load in images.chunks(size):
            shards = index + 1
            if index % plan.devices != rank:
                continue
            path = plan.out / shard_name(index)
            header = plan.header | {"first": first, "samples": count}
            problem = shard_problem(path, header) if path.exists() else "missing"
            if problem is None:
                skipped += count
            else:
                if problem != "missing":
                    print(f"rewriting {path}: {problem}", file=sys.stderr)
                pixels, labels = load()
                mean, logvar = encode_images(vae, pixels, plan.batch_size)
                write_shard(path, plan.header, first, mean, logvar, labels)
                encoded += count
            advance(count)
    return Share(shards=shards, encoded=encoded, skipped=skipped, seconds=time.perf_counter() - start)


def encode_images(vae: VAE, images: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (n, C, H, W) -> the posterior's (mean, logvar) (n, c, h, w) float16 on the CPU, in batches."""
    means, logvars = [], []
    for start in range(0, len(images), batch_size):
        mean, logvar = vae.encode(images[start : start + batch_size])
        means.append(mean.half().cpu())
        logvars.append(logvar.half().cpu())
        if not (torch.isfinite(means[-1]).all() and torch.isfinite(logvars[-1]).all()):  # stored as inf: NaN loss
            raise ValueError(f"the VAE {vae.folder} gives posterior means of magnitude up to "
                             f"{mean.abs().max().item():.3g} for images {start}..{start + len(mean) - 1}: not finite "
                             "in float16 (at most 65504), in which the shards store them; this VAE's latents are "
                             "unusable as they are (is it the VAE you meant to pass?)")  # fmt: skip
    return torch.cat(means), torch.cat(logvars)


@contextmanager
def progress(rank: int, total: int | None) -> Iterator[Callable[[int], None]]:
    """rich's progress bar of worker 0 (its share; the others stay quiet), silent when stderr is not a terminal;
    yields advance(images)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    with Progress(console=console, disable=rank != 0 or not console.is_terminal, transient=True) as bar:
        task = bar.add_task("encoding", total=total)
        yield lambda count: bar.advance(task, count)


def finish(plan: Plan, shards: int) -> dict[str, Any]:
    """meta.json, once every shard 0..shards-1 is there and its header follows the one before."""
    count = 0
    for index in range(shards):
        path = plan.out / shard_name(index)
        if not path.is_file():
            raise LatentShardError(f"{path} is missing after the encode; rerun the same command to write it")
        header = read_header(path)
        if header.get("first") != count:
            raise LatentShardError(f"{path} starts at image {header.get('first')}, not {count}; rerun the command")
        count += header["samples"]
    meta = plan.header | {"count": count, "shards": [shard_name(i) for i in range(shards)]}
    atomic_write_text(plan.out / META, json.dumps(meta, indent=2) + "\n")
    return meta


def compose_encode(overrides: list[str]) -> DictConfig:
    """conf/encode.yaml with command-line overrides, as Hydra composes train.py's config."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("encode", overrides=overrides)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return {}
    return encode(compose_encode(argv))


if __name__ == "__main__":
    from hydra.errors import HydraException

    from ddpm.config.overrides import hint_misspelled_overrides

    with hint_misspelled_overrides("encode"):
        try:
            main()
        except (ValueError, FileNotFoundError, MemoryError, HydraException) as error:  # each names what to change
            print(f"python -m ddpm.data.encode: error: {error}", file=sys.stderr)
            sys.exit(1)
