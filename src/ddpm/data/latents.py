"""`data=latents`: train on a VAE's latents written by `python -m ddpm.data.encode` (ddpm.data.latent_shards).

Each image is stored as its posterior's mean and log-variance (float16); a batch crosses to the device as
moments (B, 2c, h, w) float16 and becomes z_d = (mean + exp(logvar / 2) noise - shift) * scale there
(ddpm.models.vae.VAE.to_diffusion), float32: a fresh posterior sample every training step, as LDM trains
(Rombach et al. 2022). Validation batches take the posterior mean (noise-free, so val/loss compares across steps).

RAM (`stream: false`): every latent preloaded (float16, shared with the workers), the train/val split of
RAMDataModule (randperm seeded by split_seed over the encoded order) and its resumable sampler. Streamed
(`stream: true`): the shards are read in the DataLoader workers, split over (rank, worker) slots as WebDataModule
splits them, filtered to the same train/val split, resampled for ever through a shuffle buffer, `epoch_length`
samples per epoch. `latent_record` gives the run config's `latent` record from meta.json alone.
"""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from ddpm.data.latent_shards import content, read_meta, read_shard
from ddpm.data.latent_stream import Batch, LatentStream
from ddpm.data.ram import ImageTensorDataset, available_ram_bytes, keep_batch, start_method
from ddpm.data.sampler import ResumableSampler, RunShape, check_training_batches, rank_loader
from ddpm.data.sources import require, require_positive_int

TARGET = "ddpm.data.latents.LatentDataModule"
RECORD = ("vae", "vae_identity", "scaling_factor", "shift_factor", "latent_shape", "image_shape", "data")


def latent_record(data_config: dict[str, Any]) -> dict[str, Any] | None:
    """The run config's `latent` record (the VAE and its scaling) of a resolved `data` node, from its meta.json;
    None when the node is not a LatentDataModule."""
    if data_config.get("_target_") != TARGET:
        return None
    return record_of(read_meta(data_config.get("root")))


DECODERS = ("ddpm.callbacks.sample_grid.SampleGrid", "ddpm.callbacks.fid.FID")  # callbacks that decode latents


def check_decoder_folder(record: dict[str, Any], callbacks: dict[str, Any]) -> None:
    """Before a latent run's first step: the VAE its sample grid and FID callback decode through (meta.json's
    `vae`) is there and holds the encoding VAE's weights. Found at the first grid instead, it cost the steps since
    the last checkpoint and the run's ema.pt."""
    using = [f"callbacks.{k}" for k, v in callbacks.items() if isinstance(v, dict) and v.get("_target_") in DECODERS]
    if not using:
        return
    from ddpm.models.vae import folder_identity

    folder, identity = Path(record["vae"]), record["vae_identity"]
    fix = f"or train without decoded images: {' '.join(f'{name}=null' for name in using)}"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{' and '.join(using)} decode the latents through the VAE they were encoded with, {folder} (data.root's "
            f"meta.json), which holds no config.json: put that VAE folder back there (identity {identity}), {fix}"
        )
    if (found := folder_identity(folder)) != identity:
        raise ValueError(
            f"{' and '.join(using)} decode the latents through the VAE in {folder} (data.root's meta.json), which "
            f"now holds the VAE {found}, not {identity} that encoded them: its images would be wrong; put the "
            f"encoding VAE back there, {fix}"
        )


def record_of(meta: dict[str, Any]) -> dict[str, Any]:
    """meta.json's RECORD keys; `data`: the encode-time pixel data config (its source: the metrics' reference),
    without the keys that only served batches."""
    return {key: content(meta[key]) if key == "data" else meta[key] for key in RECORD}


def to_diffusion(moments: Tensor, scale: float, shift: float, *, sample: bool) -> Tensor:
    """moments (B, 2c, h, w) = cat(mean, logvar) -> z_d = (z - shift) * scale, float32; z a posterior sample
    (mean + exp(logvar / 2) noise, noise from the global RNG on moments' device) or the mean (VAE.to_diffusion)."""
    mean, logvar = moments.float().chunk(2, dim=1)
    z = mean + (0.5 * logvar).exp() * torch.randn_like(mean) if sample else mean
    return (z - shift) * scale


def split(n: int, val_size: float | int, split_seed: int) -> tuple[Tensor, Tensor]:
    """(train, val) indices of n images: RAMDataModule's split (randperm seeded by split_seed), each sorted."""
    n_val = val_size if isinstance(val_size, int) else max(1, round(n * val_size))
    if n_val >= n:
        raise ValueError(f"data.val_size={val_size} holds out {n_val} of the {n} encoded images, leaving no training "
                         "images; lower data.val_size or raise data.limit")  # fmt: skip
    order = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))
    return order[n_val:].sort().values, order[:n_val].sort().values


class LatentDataModule(pl.LightningDataModule):
    """A VAE's encoded latents (meta.json + shards in `root`): RAM-preloaded or streamed, see the module doc."""

    def __init__(
        self,
        *,
        root: str,  # the encoded folder (python -m ddpm.data.encode ... out=<root>)
        stream: bool = False,  # False: preload every latent in RAM; True: stream from the shards
        batch_size: int = 64,  # per device
        num_workers: int = 0,  # DataLoader workers
        val_size: int | float = 0.05,  # held-out images: a fraction, or a count
        split_seed: int = 0,  # seed of the train/val split (independent of the run seed)
        limit: int | None = None,  # use only the first `limit` encoded images
        max_ram_fraction: float = 0.5,  # refuse to preload more than this share of the available RAM
        epoch_length: int | None = None,  # streamed: training samples per epoch, all devices (None: the split's size)
        shuffle_buffer: int = 1000,  # streamed: samples held per worker for shuffling
        seed: int = 0,  # streamed: seed of the shard order and the shuffle buffer
        pin_memory: bool | None = None,  # None: pin when CUDA is available
    ) -> None:
        super().__init__()
        require_positive_int("data.batch_size", batch_size)
        require_positive_int("data.num_workers", num_workers, minimum=0)
        require("data.val_size", val_size, lambda v: 0 < v < 1 or (isinstance(v, int) and v >= 1),
                "a fraction in (0, 1) or a count >= 1")  # fmt: skip
        require_positive_int("data.limit", limit, allow_none=True)
        require_positive_int("data.epoch_length", epoch_length, allow_none=True)
        require_positive_int("data.shuffle_buffer", shuffle_buffer, minimum=0)
        require("data.max_ram_fraction", max_ram_fraction, lambda v: 0 < v <= 1, "in (0, 1]")
        self.root, self.stream, self.batch_size = str(Path(root).expanduser()), stream, batch_size
        self.num_workers = num_workers
        self.val_size, self.split_seed, self.limit = val_size, split_seed, limit
        self.max_ram_fraction = max_ram_fraction
        self.epoch_length, self.shuffle_buffer, self.seed = epoch_length, shuffle_buffer, seed
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.meta = read_meta(self.root)
        self.latent = record_of(self.meta)  # the run config's `latent` record
        self.latent_shape: list[int] = self.meta["latent_shape"]
        self.channels, self.image_size = self.meta["image_shape"][0], self.meta["image_shape"][1]  # pixels (FID)
        self.source = self._source()
        self.count = min(self.meta["count"], limit or self.meta["count"])
        self.train_set: Any = None  # ImageTensorDataset (RAM) or LatentStream, after setup
        self.val_set: Any = None
        self.labels: Tensor | None = None

    @property
    def num_classes(self) -> int | None:
        return self.meta["num_classes"]

    def _source(self) -> Any:
        """The pixel data's source (ddpm.data.sources), rebuilt from the encode-time data config (FID reference
        statistics); None for streamed pixel shards, which have no source."""
        node = (self.meta.get("data") or {}).get("source")
        if not isinstance(node, dict) or "_target_" not in node:
            return None
        from hydra.utils import instantiate

        return instantiate(node)

    def check_model(self, in_channels: int, image_size: int) -> None:
        """The model's input against the latents' (c, h, w), refused naming both (called by the module's setup)."""
        c, h, w = self.latent_shape
        if (in_channels, image_size) != (c, h) or h != w:
            raise ValueError(
                f"the latents in data.root={self.root} are {c}x{h}x{w} (c x h x w, meta.json's latent_shape) but "
                f"model.in_channels={in_channels} and model.image_size={image_size}; set model.in_channels={c} "
                f"model.image_size={h}"
            )

    def check_labels(self, num_classes: int | None) -> None:
        """Every label against the model's classes before the first step (RAM: all of them; streamed: the set's
        num_classes from meta.json). Nothing to check for an unconditional model."""
        if num_classes is None:
            return
        if self.labels is None:  # streamed
            known = self.num_classes
            if known is not None and known > num_classes:
                raise ValueError(f"the latents in data.root={self.root} hold {known} classes (meta.json) but "
                                 f"model.num_classes={num_classes}; set model.num_classes={known}")  # fmt: skip
            return
        bad = (self.labels < 0) | (self.labels >= num_classes)
        if not bad.any():
            return
        low, high = (int(v) for v in torch.aminmax(self.labels))
        unlabelled = "the encoded data set has no labels (-1): set model.num_classes=null, or encode a labelled set"
        fix = f"set model.num_classes={high + 1}" if low >= 0 else unlabelled
        raise ValueError(
            f"{int(bad.sum())} of the {len(self.labels)} encoded images in data.root={self.root} have labels outside "
            f"0..{num_classes - 1}, the classes of model.num_classes={num_classes} (labels span [{low}, {high}]; "
            f"label {num_classes} is the null class of guidance); {fix}"
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train, val = split(self.count, self.val_size, self.split_seed)
        shape = RunShape.of(self.trainer)
        if self.stream:
            self._stream(train, val, shape)
        else:
            moments, self.labels = self._load()
            if self.num_workers > 0 and start_method() != "fork":  # as RAMDataModule: /dev/shm only for spawn
                moments.share_memory_()
                self.labels.share_memory_()
            self.train_set = ImageTensorDataset(moments, self.labels, train)
            self.val_set = ImageTensorDataset(moments, self.labels, val)
            if stage in (None, "fit"):
                share = len(ResumableSampler(self.train_set, num_replicas=shape.world_size, rank=shape.rank))
                self._check_batches(share, f"{len(train)} training latents", shape)

    def _load(self) -> tuple[Tensor, Tensor]:
        c, h, w = self.latent_shape
        needed = self.count * 2 * c * h * w * 2
        budget = self.max_ram_fraction * available_ram_bytes()
        if needed > budget:
            raise MemoryError(f"preloading {self.count} latents needs {needed / 2**30:.1f} GiB but data.max_ram_"
                              f"fraction={self.max_ram_fraction} of the available RAM is {budget / 2**30:.1f} GiB; "
                              "set data.stream=true, lower data.limit or raise data.max_ram_fraction")  # fmt: skip
        moments = torch.empty(self.count, 2 * c, h, w, dtype=torch.float16)
        labels = torch.empty(self.count, dtype=torch.int64)
        for path, header in self.shard_headers().items():
            if (first := header["first"]) >= self.count:
                break
            rows, shard_labels = read_shard(Path(path), header)
            n = min(header["samples"], self.count - first)
            moments[first : first + n], labels[first : first + n] = rows[:n], shard_labels[:n]
        return moments, labels

    def shard_headers(self) -> dict[str, dict[str, Any]]:
        """Each shard's path and the `__meta__.json` it must hold (meta.json's, with its first image and count)."""
        header = {k: v for k, v in self.meta.items() if k not in ("count", "shards")}
        size, count = self.meta["samples_per_shard"], self.meta["count"]
        return {str(Path(self.root) / name): header | {"first": i * size, "samples": min(size, count - i * size)}
                for i, name in enumerate(self.meta["shards"])}  # fmt: skip

    def _stream(self, train: Tensor, val: Tensor, shape: RunShape) -> None:
        headers = self.shard_headers()
        paths = list(headers)
        epoch = self.epoch_length or len(train)
        per_rank = epoch // (self.batch_size * shape.world_size)
        self._check_batches(epoch // shape.world_size, f"data.epoch_length={epoch} latents", shape)
        masks = [torch.zeros(self.count, dtype=torch.bool) for _ in range(2)]
        for mask, rows in zip(masks, (train, val), strict=True):
            mask[rows] = True
        common = dict(headers=headers, batch_size=self.batch_size, shuffle_buffer=self.shuffle_buffer,
                      seed=self.seed, rank=shape.rank, world_size=shape.world_size)  # fmt: skip
        self.train_set = LatentStream(paths, keep=masks[0], batches_per_epoch=per_rank, **common)
        self.val_set = LatentStream(paths, keep=masks[1], batches_per_epoch=None, **common)

    def _check_batches(self, share: int, source: str, shape: RunShape) -> None:
        """`share`: training latents per process and epoch; at least one optimizer step's batches of them."""
        more = "raise data.epoch_length" if self.stream else "use more images (data.limit, data.val_size)"

        def fix(needed: int) -> str:
            return f"lower data.batch_size to at most {share // needed}" if share >= needed else more

        check_training_batches(batches=share // self.batch_size, shape=shape, source=source,
                               batch_size=self.batch_size, fix_more=fix)  # fmt: skip

    def _loader(self, dataset: Any, *, train: bool) -> DataLoader[Batch]:
        if dataset is None:
            raise RuntimeError("LatentDataModule.setup() has not run")
        common = dict(num_workers=self.num_workers, persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory)
        if self.stream:
            return DataLoader(dataset, batch_size=None, **common)
        return rank_loader(dataset, train=train, trainer=self.trainer, batch_size=self.batch_size,
                           collate_fn=keep_batch, **common)  # fmt: skip

    def train_dataloader(self) -> DataLoader[Batch]:
        if isinstance(self.train_set, LatentStream) and self.trainer is not None:  # after a checkpoint is restored
            self.train_set.start = self.trainer.global_step
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.val_set, train=False)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Batch:
        moments, labels = batch
        sample = self.trainer is None or self.trainer.training
        return to_diffusion(moments, self.meta["scaling_factor"], self.meta["shift_factor"], sample=sample), labels
