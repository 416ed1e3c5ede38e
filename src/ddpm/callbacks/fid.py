"""Logs `val/fid@K` (or `val/cfid@K` with a classifier) every N optimizer steps, for sweeps to optimise.

Every rank samples a disjoint share of the K images with a fast sampler from the EMA weights and
extracts their features; the features are gathered on every rank, so all ranks compute and log the
same value and none waits idle in a collective. The training set's statistics are computed once
(rank 0, cached on disk) when fitting starts.
"""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ddpm.callbacks.monitor import off_the_clock
from ddpm.callbacks.sample_grid import sample_with_ema
from ddpm.diffusion.generate import class_cycle
from ddpm.diffusion.network import SamplingPrecision
from ddpm.diffusion.samplers.base import Sampler
from ddpm.metrics.evaluate import generate_shard, sharded_features
from ddpm.metrics.features import FeatureExtractor, build_extractor
from ddpm.metrics.fid import DEFAULT_CACHE_DIR, IS_SPLITS, METRICS, FeatureStats, compute_metrics, reference_stats
from ddpm.sampling.runtime import guidance_interval as guidance_interval_of


class FID(Callback):
    """Every `every_n_steps` optimizer steps: FID (and optionally KID/IS) of `num_samples` EMA samples."""

    def __init__(
        self,
        *,
        sampler: Sampler,  # a fast sampler, e.g. DDIM 50 steps or DDPM respaced to 100
        every_n_steps: int = 5000,  # optimizer steps between evaluations
        num_samples: int = 1000,  # K generated images per evaluation (all ranks together)
        metrics: tuple[str, ...] = ("fid",),  # any of fid, kid, is
        features: str = "inception",  # inception, or a TorchScript/state-dict classifier file
        guidance: float = 0.0,  # classifier-free guidance weight for conditional models
        guidance_interval: tuple[float, float] | None = None,  # [sigma_lo, sigma_hi]: guide only there; None: always
        seed: int = 0,  # same noise every evaluation, so values are comparable across steps
        batch_size: int = 250,  # images per sampling (and feature) batch on each rank
        cache_dir: str = DEFAULT_CACHE_DIR,  # where the training-set statistics are cached
        precision: SamplingPrecision = "auto",  # the network's: auto (bf16 on CUDA, AMX CPUs), 32 or bf16; x_t float32
    ) -> None:
        if every_n_steps < 1 or num_samples < 2:
            raise ValueError(
                f"callbacks.fid: every_n_steps={every_n_steps} must be >= 1 and num_samples={num_samples} >= 2"
            )
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise ValueError(f"callbacks.fid.metrics={list(metrics)}: unknown {unknown}; choose from {list(METRICS)}")
        if "is" in metrics and num_samples < IS_SPLITS:  # found at the first evaluation, before its checkpoint
            raise ValueError(f"callbacks.fid.num_samples={num_samples}: metrics {list(metrics)} need at least "
                             f"{IS_SPLITS} (is: {IS_SPLITS} splits)")  # fmt: skip
        self.sampler, self.every_n_steps, self.num_samples = sampler, every_n_steps, num_samples
        self.metrics, self.features, self.guidance, self.seed = tuple(metrics), features, guidance, seed
        self.batch_size, self.cache_dir = batch_size, cache_dir
        self.guidance_interval = guidance_interval_of(guidance_interval, key="callbacks.fid.guidance_interval")
        self.precision = precision
        self.extractor: FeatureExtractor | None = None
        self.reference: FeatureStats | None = None
        self.last_step = -1

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = trainer.datamodule
        sized = hasattr(datamodule, "image_size") and hasattr(datamodule, "channels")
        if getattr(datamodule, "source", None) is None or not sized:
            raise ValueError(
                "callbacks.fid needs a datamodule with `source`, `image_size` and `channels` (the RAM datamodule, or "
                "data=latents encoded from one) for the training set's statistics; this run's data has no source "
                "(WebDataset shards, or latents encoded from them): leave callbacks.fid out"
            )
        self.extractor = build_extractor(self.features, pl_module.device, key="callbacks.fid.features")
        if "is" in self.metrics and not self.extractor.has_logits:
            raise ValueError(f"callbacks.fid.metrics: is needs class logits; callbacks.fid.features={self.features} "
                             "has none (no logits method): drop is, or use a classifier with logits")  # fmt: skip
        stats = {"source": datamodule.source, "image_size": datamodule.image_size, "channels": datamodule.channels}
        if trainer.is_global_zero:  # compute (or load) once, then the other ranks read the cache
            self.reference = reference_stats(**stats, extractor=self.extractor, cache_dir=self.cache_dir)
        trainer.strategy.barrier("fid-reference")
        if not trainer.is_global_zero:
            self.reference = reference_stats(**stats, extractor=self.extractor, cache_dir=self.cache_dir)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_step = trainer.global_step  # the step a fit starts at was evaluated before (a resume) or is 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step != self.last_step and step % self.every_n_steps == 0:
            self.last_step = step
            with off_the_clock(trainer):
                metrics = self.evaluate(trainer, pl_module)
            # Not self.log: at a step Lightning does not log, the value waited for its next logging step, under
            # that step (the last one: never); mixing both, Lightning's copy overwrote newer values here.
            values = {f"val/{name}": float(value) for name, value in metrics.items()}
            trainer._logger_connector.log_metrics(values)  # now, at this batch's step, as Lightning's own rows
            trainer.callback_metrics.update({k: torch.tensor(v) for k, v in values.items()})  # objective, monitors

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Sample this rank's share from the EMA weights, gather the features, compute the metrics."""
        assert self.extractor is not None and self.reference is not None, "on_fit_start has not run"
        net = pl_module.net
        labels = class_cycle(self.num_samples, net.num_classes) if net.num_classes is not None else None
        mine = sample_with_ema(
            trainer,
            pl_module,
            sampler=self.sampler,
            num_samples=self.num_samples,
            guidance=self.guidance,
            guidance_interval=self.guidance_interval,
            seed=self.seed,
            batch_size=self.batch_size,
            precision=self.precision,
            draw=generate_shard,
        )
        features, logits = sharded_features(self.extractor, mine.images, self.batch_size)
        return compute_metrics(
            self.metrics,
            features=features,
            logits=logits,
            reference=self.reference,
            kind=self.extractor.kind,
            labels=labels,
            seed=self.seed,
        )
