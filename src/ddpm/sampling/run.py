"""sample(cfg): load a run's EMA weights, draw images, write grid.png and samples.npz (and metrics.json).

Before anything is drawn, output_dir must be writable (created, a probe file written) and its disk must have room
for the outputs; the outputs are written atomically (whole or absent).

Under torchrun every rank draws a disjoint, batch-aligned share of the images (same images as one
process); rank 0 gathers them, writes the files and measures the metrics (`metrics=[fid,kid,is]`).
"""

import errno
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig
from torch import Tensor

from ddpm.config import validate_config
from ddpm.data.images import save_png, tile
from ddpm.diffusion.generate import Generated, NonFiniteSamplesError, class_cycle, compile_network
from ddpm.metrics.evaluate import generate_sharded
from ddpm.metrics.features import build_extractor
from ddpm.metrics.fid import METRICS, compute_metrics, reference_stats
from ddpm.metrics.sharding import init_from_env, world
from ddpm.run_dir import claim
from ddpm.sampling.runtime import (
    check_guidance,
    default_batch_size,
    guidance_interval,
    resolve_device,
    resolve_sampling_precision,
)
from ddpm.weights import load_model
from ddpm.weights.atomic import WriteError, atomic_write, atomic_write_text
from ddpm.weights.model import instantiate_local

SAMPLE_FILES = ("grid.png", "samples.npz", "metrics.json")  # what a sample.py call writes into output_dir


def requested_labels(labels: int | list[int] | None, num_samples: int, num_classes: int | None) -> Tensor | None:
    """(N,) int64: the given labels repeated in turn, or every class in turn; None for unconditional models."""
    if num_classes is None:
        if labels is not None:
            raise ValueError(f"labels={labels} given, but the model is unconditional; leave labels unset")
        return None
    if labels is None:
        return class_cycle(num_samples, num_classes)
    wanted = torch.tensor([labels] if isinstance(labels, int) else list(labels), dtype=torch.long)
    if len(wanted) == 0 or wanted.min() < 0 or wanted.max() >= num_classes:
        raise ValueError(
            f"labels={wanted.tolist()} must be in 0..{num_classes - 1} (the model has {num_classes} classes)"
        )
    return wanted[torch.arange(num_samples) % len(wanted)]


def resolve_batch_size(batch_size: int | str | None, device: torch.device, *, guided: bool) -> int:
    """`batch_size: auto` (or null): generate.default_batch_size for the device; an integer as given."""
    if batch_size is None or str(batch_size) == "auto":
        return default_batch_size(device, guided=guided)
    if isinstance(batch_size, str) and not batch_size.isdigit():
        raise ValueError(f"batch_size={batch_size!r} must be auto or a positive integer")
    if int(batch_size) <= 0:
        raise ValueError(f"batch_size={batch_size} must be > 0 (or auto)")
    return int(batch_size)


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


def write_outputs(out: Generated, out_dir: Path, nrow: int) -> None:
    """grid.png (at most 256 images, white borders; grey or RGB as the model) and samples.npz: images (N, H, W, C)
    uint8, labels (N,) int64."""
    grid = tile(out.images[:256], nrow=nrow)
    atomic_write(out_dir / "grid.png", lambda f: save_png(grid, f))
    labels = out.labels.numpy() if out.labels is not None else np.full(len(out.images), -1, dtype=np.int64)
    images = out.images.permute(0, 2, 3, 1).numpy()
    atomic_write(out_dir / "samples.npz", lambda f: np.savez(f, images=images, labels=labels), size=images.nbytes)


def requested_metrics(metrics: DictConfig | None) -> list[str]:
    """The metric names switched on by `metrics=[fid,kid,is]` (conf/metrics/*.yaml), in a fixed order."""
    return [name for name in METRICS if metrics is not None and metrics.get(name)]


def measure(out: Generated, cfg: DictConfig, run_config: dict, device: torch.device) -> dict[str, float]:
    """FID/KID/IS of the generated images against the run's training data (statistics cached)."""
    names, options = requested_metrics(cfg.metrics), cfg.metrics
    extractor = build_extractor(str(options.features), device)
    if "source" not in run_config.get("data", {}):  # a re-saved diffusers folder carries no data config
        raise ValueError(
            "metrics: the run's data config has no `source` reader (data=webdataset?), so there is no training "
            "set to compute reference statistics from; evaluate a run trained on digits, mnist, cifar10 or image_folder"
        )
    node = dict(run_config["data"]["source"])
    if options.get("data_root"):
        node["root"] = str(options.data_root)
    image_size, channels = out.images.shape[-1], out.images.shape[1]
    reference = reference_stats(
        instantiate_local(node),
        image_size=image_size,
        channels=channels,
        extractor=extractor,
        cache_dir=str(options.cache_dir),
        batch_size=options.batch_size,
    )
    features, logits = extractor(out.images, batch_size=options.batch_size)
    return compute_metrics(
        names, features=features, logits=logits, reference=reference, kind=extractor.kind, labels=out.labels
    )


def sample(cfg: DictConfig) -> Generated:
    """Run the sampling described by conf/sample.yaml; returns the images and their labels."""
    validate_config(cfg, entry="sample")  # types and unknown keys, naming the key; num_samples=2e1 becomes 20
    if not cfg.get("ckpt"):
        raise ValueError(
            "no checkpoint given; pass ckpt=<run dir>/ema.pt (or its ema.safetensors, a checkpoints/*.ckpt, "
            "or a folder written by python -m ddpm.export)"
        )
    if cfg.num_samples <= 0:
        raise ValueError(f"num_samples={cfg.num_samples} must be > 0")
    if world()[0] == 0:  # before any work: never over another call's images (ddpm.run_dir's rule)
        claim(Path(cfg.output_dir), ckpt_path=None, overwrite=bool(cfg.get("overwrite", False)), patterns=SAMPLE_FILES,
              key="output_dir")  # fmt: skip
        check_output_dir(Path(cfg.output_dir))
    created = init_from_env()
    try:
        return _sample(cfg)
    finally:
        if created:
            torch.distributed.destroy_process_group()


def _sample(cfg: DictConfig) -> Generated:
    device = resolve_device(cfg.device)
    loaded = load_model(cfg.ckpt, device)
    net, diffusion = loaded.net, loaded.diffusion
    check_guidance(cfg.guidance, num_classes=net.num_classes, p_uncond=diffusion.p_uncond)  # before any sampling
    interval = guidance_interval(cfg.get("guidance_interval"))
    labels_cfg = list(cfg.labels) if isinstance(cfg.labels, ListConfig) else cfg.labels
    labels = requested_labels(labels_cfg, cfg.num_samples, net.num_classes)
    guided = cfg.guidance != 0 and labels is not None
    batch_size = resolve_batch_size(cfg.get("batch_size", "auto"), device, guided=guided)
    precision = resolve_sampling_precision(cfg.get("precision", "auto"), device)
    compiled = bool(cfg.get("compile", False))
    channels_last = bool(cfg.get("channels_last", True))
    if channels_last:  # in place: this network is sample.py's own; before compiling (the graph keeps the layout)
        net = net.to(memory_format=torch.channels_last)
    if world()[0] == 0:
        check_room(Path(cfg.output_dir), cfg.num_samples, (net.in_channels, net.image_size, net.image_size))
    try:
        out = _draw(cfg, net, diffusion, labels, batch_size, precision, compiled, device, interval)
    except NonFiniteSamplesError as error:
        raise NonFiniteSamplesError(
            f"{error}. Nothing was written. Check the weights of ckpt={cfg.ckpt} (an earlier checkpoint of the run), "
            "or sample with precision=32"
        ) from error
    if world()[0] != 0:
        return out
    out_dir = Path(cfg.output_dir)
    write_outputs(out, out_dir, nrow=net.num_classes or int(len(out.images[:256]) ** 0.5))
    print(
        f"{len(out.images)} images in {out.seconds:.1f} s ({out.images_per_second:.2f} images/s, "
        f"{out.nfe} network evaluations per batch; batch {batch_size}, precision {precision}"
        f"{', channels_last' if channels_last else ''}{', compiled' if compiled else ''}) "
        f"-> {out_dir / 'grid.png'}, {out_dir / 'samples.npz'}"
    )
    if requested_metrics(cfg.get("metrics")):
        values = measure(out, cfg, loaded.config, device)
        text = json.dumps({**values, "features": str(cfg.metrics.features)}, indent=2)
        atomic_write_text(out_dir / "metrics.json", text)
        print("  ".join(f"{name} {value:.4g}" for name, value in values.items()), f"-> {out_dir / 'metrics.json'}")
    return out


def _draw(
    cfg: DictConfig,
    net,
    diffusion,
    labels,
    batch_size: int,
    precision,
    compiled: bool,
    device,
    interval: tuple[float, float] | None,
) -> Generated:
    """All ranks' images of sample.py's settings (each rank draws its share)."""
    return generate_sharded(
        net=compile_network(net) if compiled else net,  # compiled once, for every batch and step
        betas=diffusion.betas64(),
        prediction=diffusion.prediction,
        sigma_data=diffusion.sigma_data,
        sampler=instantiate(cfg.sampler),
        image_shape=(net.in_channels, net.image_size, net.image_size),
        num_samples=cfg.num_samples,
        labels=labels,
        null_class=net.num_classes,
        guidance=cfg.guidance,
        guidance_interval=interval,
        seed=cfg.seed,
        batch_size=batch_size,
        device=device,
        precision=precision,
        compile=compiled,
    )
