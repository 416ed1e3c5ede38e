"""sample(cfg): load a run's EMA weights, draw images, write grid.png and samples.npz (and metrics.json).

Before anything is drawn, output_dir must be writable (created, a probe file written) and its disk must have room
for the outputs; the outputs are written atomically (whole or absent).

Under torchrun every rank draws a disjoint, batch-aligned share of the images (same images as one
process); rank 0 gathers them, writes the files and measures the metrics (`metrics=[fid,kid,is]`).
"""

import json
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import Tensor

from ddpm.atomic import atomic_write_text
from ddpm.config import build, validate_config
from ddpm.config.build import keyed_errors
from ddpm.config.entries import SampleKeys
from ddpm.data.sources import Source
from ddpm.diffusion.generate import Generated, NonFiniteSamplesError, class_cycle, denoiser_for
from ddpm.diffusion.samplers.base import decoded
from ddpm.logs import say
from ddpm.metrics.evaluate import generate_sharded, shard
from ddpm.metrics.features import FeatureExtractor, build_extractor
from ddpm.metrics.fid import IS_SPLITS, METRICS, compute_metrics, reference_key, reference_path, reference_stats
from ddpm.ranks import first_process, init_from_env, world
from ddpm.run_dir import SAMPLE_FILES, claim, holding, refuse_training_run
from ddpm.sampling.outputs import check_output_dir, check_room, grid_columns, write_samples
from ddpm.sampling.runtime import (
    check_guidance,
    default_batch_size,
    guidance_interval,
    load_decoder,
    resolve_device,
    resolve_sampling_precision,
)
from ddpm.weights import load_model
from ddpm.weights.model import instantiate_local


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
    """`batch_size: auto` (or null): runtime.default_batch_size for the device; an integer (checked by the
    config's schema, SampleKeys) as given."""
    return default_batch_size(device, guided=guided) if batch_size in (None, "auto") else int(batch_size)


def requested_metrics(metrics: DictConfig | None) -> list[str]:
    """The metric names switched on by `metrics=[fid,kid,is]` (conf/metrics/*.yaml), in a fixed order."""
    return [name for name in METRICS if metrics is not None and metrics.get(name)]


def training_source(run_config: dict) -> dict:
    """The `source` node of the pixels the run learned (a latent run: those its latents were encoded from), the
    metrics' reference; refused (before anything is drawn) where the run config has none."""
    data = (run_config.get("latent") or {}).get("data") or run_config.get("data") or {}
    if "source" not in data:
        latent = " (a latent run: its latents are WebDataset shards' or its config predates latent.data)"
        raise ValueError(
            "metrics: the run's data config has no `source` reader (data=webdataset?"
            f"{latent if run_config.get('latent') else ''}), so there is no training set to compute reference "
            "statistics from; evaluate a run trained on digits, mnist, cifar10 or image_folder"
        )
    return data["source"]


def reference_source(cfg: DictConfig, run_config: dict) -> Source:
    """The metrics' reference: the run's training source, read from metrics.data_root where given."""
    node = dict(training_source(run_config))
    if cfg.metrics.get("data_root"):
        node["root"] = str(cfg.metrics.data_root)
    return instantiate_local(node)


def metrics_extractor(cfg: DictConfig, run_config: dict, num_samples: int, device: torch.device,
                      pixels: tuple[int, int, int]) -> FeatureExtractor:  # fmt: skip
    """The metrics' feature extractor, and their settings checked, before any image is drawn (a mistyped
    metrics.features, Inception's weights missing offline, `is` without logits, the training data moved since
    training were found after all of them). `pixels`: the images' (C, H, W)."""
    source = reference_source(cfg, run_config)
    extractor = build_extractor(str(cfg.metrics.features), device)
    try:
        source.files()
    except FileNotFoundError as error:  # its statistics cached: they stand (reference_stats)
        key = reference_key(source, image_size=pixels[-1], channels=pixels[0], extractor=extractor.name)
        if not reference_path(str(cfg.metrics.cache_dir), key).is_file():
            where = getattr(source, "root", None)
            raise FileNotFoundError(f"metrics: the run's training data, the reference, is not in {where} (moved since "
                                    "training?); pass its folder as metrics.data_root=<folder>") from error  # fmt: skip
    if "is" in requested_metrics(cfg.metrics) and not extractor.has_logits:
        raise ValueError(f"metrics=[is] needs class logits; metrics.features={cfg.metrics.features} has none")
    if num_samples < (IS_SPLITS if "is" in requested_metrics(cfg.metrics) else 2):
        raise ValueError(f"num_samples={num_samples}: the metrics need at least 2 images (is: {IS_SPLITS})")
    return extractor


def measure(out: Generated, cfg: DictConfig, run_config: dict, extractor: FeatureExtractor) -> dict[str, float]:
    """FID/KID/IS of the generated images against the run's training data (statistics cached)."""
    names, options = requested_metrics(cfg.metrics), cfg.metrics
    image_size, channels = out.images.shape[-1], out.images.shape[1]
    reference = reference_stats(
        reference_source(cfg, run_config),
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


@holding()
def sample(cfg: DictConfig) -> Generated:
    """Run the sampling described by conf/sample.yaml; returns the images and their labels."""
    keys = SampleKeys.of(validate_config(cfg, entry="sample"))  # types, ranges, unknown keys; 2e1 becomes 20
    if not keys.ckpt:
        raise ValueError(
            "no checkpoint given; pass ckpt=<run dir>/ema.pt (or its ema.safetensors, a checkpoints/*.ckpt, "
            "or a folder written by python -m ddpm.export)"
        )
    if first_process():  # before any work (and the process group): never over another call's images (run_dir)
        refuse_training_run(Path(keys.output_dir))
        claim(Path(keys.output_dir), ckpt_path=None, overwrite=keys.overwrite, patterns=SAMPLE_FILES, key="output_dir")
        check_output_dir(Path(keys.output_dir))
    created = init_from_env()
    try:
        return _sample(keys, cfg)
    finally:
        if created:
            torch.distributed.destroy_process_group()


def _sample(keys: SampleKeys, cfg: DictConfig) -> Generated:
    device = resolve_device(keys.device)
    loaded = load_model(keys.ckpt, device)
    net, diffusion = loaded.net, loaded.diffusion
    check_guidance(keys.guidance, num_classes=net.num_classes, p_uncond=diffusion.p_uncond)  # before any sampling
    interval = guidance_interval(keys.guidance_interval)
    labels = requested_labels(keys.labels, keys.num_samples, net.num_classes)
    batch_size = resolve_batch_size(keys.batch_size, device, guided=keys.guidance != 0 and labels is not None)
    precision = resolve_sampling_precision(keys.precision, device)
    if keys.channels_last:  # in place: this network is sample.py's own; before compiling (the graph keeps the layout)
        net = net.to(memory_format=torch.channels_last)
    vae = load_decoder(loaded.config.get("latent"), device, keys.vae)  # a latent model's decoder, else None
    pixels = tuple(loaded.config["latent"]["image_shape"]) if vae else (net.in_channels, net.image_size, net.image_size)
    extractor = None
    if world()[0] == 0:
        check_room(Path(keys.output_dir), keys.num_samples, pixels)
        if requested_metrics(cfg.get("metrics")):  # refused before the images, not after
            extractor = metrics_extractor(cfg, loaded.config, keys.num_samples, device, pixels)
    guidance = keys.guidance if labels is not None else 0.0
    denoiser = denoiser_for(net, diffusion, guidance=guidance, interval=interval, precision=precision,
                            compile=keys.compile, rows=min(batch_size, keys.num_samples))  # fmt: skip
    shape = (keys.num_samples, net.in_channels, net.image_size, net.image_size)
    try:  # all ranks' images (each rank draws its share)
        sampler = decoded(build(cfg.sampler), vae.decode if vae else None)
        with keyed_errors("sampler", cfg.sampler._target_):  # steps against the model's T: sampler.steps=...
            out = generate_sharded(denoiser, sampler, shape, labels=labels, seed=keys.seed, batch_size=batch_size,
                                   device=device)  # fmt: skip
    except NonFiniteSamplesError as error:
        raise NonFiniteSamplesError(
            f"{error}. Nothing was written. Check the weights of ckpt={keys.ckpt} (an earlier checkpoint of the run), "
            "or sample with precision=32"
        ) from error
    if world()[0] != 0:
        return out
    out_dir = Path(keys.output_dir)
    write_samples(out.images, out.labels, out_dir, nrow=grid_columns(len(out.images[:256]), net.num_classes))
    drawn = min(batch_size, shard(keys.num_samples, batch_size, world()[1], 0)[1])  # the batch rank 0 drew (its shard)
    say(
        f"{len(out.images)} images in {out.seconds:.1f} s ({out.images_per_second:.2f} images/s, "
        f"{out.nfe} network evaluations per batch; batch {drawn}, precision {precision}"
        f"{', channels_last' if keys.channels_last else ''}{', compiled' if keys.compile else ''}) "
        f"-> {out_dir / 'grid.png'}, {out_dir / 'samples.npz'}"
    )
    if extractor is not None:
        values = measure(out, cfg, loaded.config, extractor)
        text = json.dumps({**values, "features": str(cfg.metrics.features)}, indent=2)
        atomic_write_text(out_dir / "metrics.json", text)
        say("  ".join(f"{name} {value:.4g}" for name, value in values.items()) + f" -> {out_dir / 'metrics.json'}")
    return out
