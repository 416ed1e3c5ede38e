"""RAMDataModule: the whole dataset preloaded once as one uint8 tensor, batches scaled on the device.

Host memory holds (N, C, H, W) uint8 (a quarter of float32), shared with DataLoader workers through
shared memory; host-to-device copies stay uint8 and `on_after_batch_transfer` maps them to [-1, 1].
"""

import multiprocessing
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ddpm.data.sampler import ResumableSampler, RunShape, check_training_batches, rank_loader
from ddpm.data.sources import (
    ImageSet,
    Source,
    require,
    require_channels,
    require_image_size,
    require_positive_int,
)

Batch = tuple[Tensor, Tensor]  # images (B, C, H, W), labels (B,) int64


class ImageTensorDataset(Dataset[Batch]):
    """Indexes rows of preloaded tensors; `__getitems__` gathers a whole batch in one indexing op."""

    def __init__(self, images: Tensor, labels: Tensor, index: Tensor) -> None:
        self.images, self.labels, self.index = images, labels, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Batch:
        row = self.index[i]
        return self.images[row], self.labels[row]

    def __getitems__(self, indices: list[int]) -> Batch:
        rows = self.index[torch.as_tensor(indices)]
        return self.images[rows], self.labels[rows]


def keep_batch(batch: Batch) -> Batch:
    """Collate for `__getitems__`: the dataset already returns stacked tensors."""
    return batch


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def scale_to_unit(images: Tensor) -> Tensor:
    """uint8 [0, 255] -> float32 [-1, 1]: x / 127.5 - 1."""
    return images.float().div_(127.5).sub_(1.0)


def random_hflip(images: Tensor) -> Tensor:
    """Flip each image left-right with probability 1/2 (on its device, from the global torch RNG)."""
    flip = torch.rand(images.shape[0], device=images.device) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def validate_image_set(data: ImageSet, *, image_size: int) -> None:
    images, labels = data.images, data.labels
    if images.dtype != torch.uint8:
        raise ValueError(f"the data source returned {images.dtype} images; sources must return uint8 in [0, 255]")
    if images.ndim != 4 or images.shape[-2:] != (image_size, image_size):
        raise ValueError(f"the data source returned images of shape {tuple(images.shape)}, not (N, C, {image_size}, "
                         f"{image_size}); check data.image_size")  # fmt: skip
    if len(images) != len(labels):
        raise ValueError(f"the data source returned {len(images)} images but {len(labels)} labels")


class ScaleOnDevice(pl.LightningDataModule):
    """Base of the datamodules: uint8 batches cross to the device, then become [-1, 1] floats (+ flips)."""

    hflip: bool = False  # random horizontal flips of training batches

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Batch:
        images, labels = batch
        images = scale_to_unit(images)
        if self.hflip and self.trainer is not None and self.trainer.training:
            images = random_hflip(images)
        return images, labels


def start_method() -> str:
    """How DataLoader workers will start: the start method set, else the platform's default (not fixed here)."""
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


class RAMDataModule(ScaleOnDevice):
    """Preloads `source` into RAM (uint8) once per process; seeded train/val split; device-side scaling."""

    def __init__(
        self,
        *,
        source: Source,  # a reader from ddpm.data.sources
        image_size: int,  # H = W of the stored images (the model's image_size)
        channels: int | None = None,  # convert to 1 or 3 channels; None keeps the source's
        batch_size: int = 64,  # per device
        num_workers: int = 0,  # DataLoader workers (0: load in the main process, fine for RAM data)
        val_size: int | float = 0.05,  # held-out images: a fraction, or a count
        split_seed: int = 0,  # seed of the train/val split (independent of the run seed)
        hflip: bool = False,  # random horizontal flips (off for digits)
        limit: int | None = None,  # use only `limit` images, the first (an image folder: a seeded sample) (smoke runs)
        max_ram_fraction: float = 0.5,  # refuse to preload more than this share of the available RAM
        pin_memory: bool | None = None,  # None: pin when CUDA is available
        root: str | None = None,  # the dataset folder (the user-facing `data.root`, read by the source)
    ) -> None:
        super().__init__()
        require_image_size("data.image_size", image_size)
        require_channels("data.channels", channels)
        require_positive_int("data.batch_size", batch_size)
        require_positive_int("data.num_workers", num_workers, minimum=0)
        require("data.val_size", val_size, lambda v: 0 < v < 1 or (isinstance(v, int) and v >= 1),
                "a fraction in (0, 1) or a count >= 1")  # fmt: skip
        require_positive_int("data.limit", limit, allow_none=True)
        require("data.max_ram_fraction", max_ram_fraction, lambda v: 0 < v <= 1, "in (0, 1]",
                "it is the share of the available RAM the preloaded images may take")  # fmt: skip
        self.source, self.image_size, self.channels = source, image_size, channels
        self.batch_size, self.num_workers, self.val_size = batch_size, num_workers, val_size
        self.split_seed, self.hflip, self.limit = split_seed, hflip, limit
        self.max_ram_fraction, self.root = max_ram_fraction, root
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.data: ImageSet | None = None
        self.loaded = 0  # images the source returned (before data.limit)
        self.train_set: ImageTensorDataset | None = None
        self.val_set: ImageTensorDataset | None = None

    @property
    def num_classes(self) -> int | None:
        return None if self.data is None else self.data.num_classes

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self.data is None:
            self._load()
        if stage in (None, "fit"):
            self._check_batches(RunShape.of(self.trainer))

    def _load(self) -> None:
        self._check_ram()
        data = self.source.load(image_size=self.image_size, channels=self.channels, limit=self.limit)  # only those
        self.loaded = len(data.images) if self.limit is None else self.source.count()  # the source's, before the limit
        validate_image_set(data, image_size=self.image_size)
        if self.num_workers > 0 and start_method() != "fork":  # spawn pickles the set to each worker: shared, not
            data.images.share_memory_()  # copied; fork's workers read the parent's pages, and /dev/shm (Docker's
            data.labels.share_memory_()  # 64 MB) could not hold CIFAR-10
        train, val = self._split(len(data.images))
        self.data = data
        self.train_set = ImageTensorDataset(data.images, data.labels, train)
        self.val_set = ImageTensorDataset(data.images, data.labels, val)

    def check_labels(self, num_classes: int | None) -> None:
        """Every label of the preloaded set against the model's classes, once, before the first step (the training
        step also checks each batch, on the device). Nothing to check for an unconditional model."""
        if num_classes is None or self.data is None or len(self.data.labels) == 0:
            return
        if self.data.num_classes is None:  # its labels are all 0: classes 1.. would never train, yet be sampled
            raise ValueError(f"model.num_classes={num_classes} but the {self._images(len(self.data.labels))} have no "
                             "classes (an unconditional source, e.g. data.source.conditional=false); set "
                             "model.num_classes=null, or give the data its classes")  # fmt: skip
        labels = self.data.labels
        bad = (labels < 0) | (labels >= num_classes)
        if not bad.any():
            return
        low, high = (int(v) for v in torch.aminmax(labels))
        names = self.data.class_names
        extra = f": class folders {list(names[num_classes:])} are beyond it" if len(names) > num_classes else ""
        if low < 0:
            fix = "labels must be >= 0: fix the data set's labels"
        else:
            fix = f"set model.num_classes={max(high + 1, len(names))}"
            fix += " or remove those folders from data.root" if extra else ", or fix the data set's labels"
        raise ValueError(
            f"{int(bad.sum())} of the {self._images(len(labels))} have labels outside 0..{num_classes - 1}, the "
            f"classes of model.num_classes={num_classes}{extra} (labels span [{low}, {high}]; label {num_classes} is "
            f"the null class of guidance); {fix}"
        )

    def _images(self, n: int) -> str:
        """'N images' with data.limit named when it cut the source."""
        return f"{n} images" + (f" (data.limit={self.limit} of {self.loaded})" if n < self.loaded else "")

    def _check_batches(self, shape: RunShape) -> None:
        """Each process's share (the DistributedSampler's split with drop_last) must give a full optimizer step."""
        assert self.train_set is not None and self.data is not None
        n = len(self.train_set)
        share = len(ResumableSampler(self.train_set, num_replicas=shape.world_size, rank=shape.rank))
        source = f"{n} training images ({self._images(len(self.data.images))} minus data.val_size={self.val_size})"
        if shape.world_size > 1:
            source += f" split over {shape.processes()} are {share} per process"
        fewer = ", or use fewer processes" if shape.world_size > 1 else ""

        def fix(needed: int) -> str:
            most = f"lower data.batch_size to at most {share // needed}" if share >= needed else "use more images"
            return most + fewer

        check_training_batches(batches=share // self.batch_size, shape=shape, source=source,
                               batch_size=self.batch_size, fix_more=fix)  # fmt: skip

    def _check_ram(self) -> None:
        count = self.source.count() if self.limit is None else min(self.limit, self.source.count())
        needed = count * (self.channels or 3) * self.image_size**2
        budget = self.max_ram_fraction * available_ram_bytes()
        if needed > budget:
            raise MemoryError(
                f"preloading {count} images at {self.image_size}x{self.image_size} needs {needed / 2**30:.1f} GiB "
                f"but data.max_ram_fraction={self.max_ram_fraction} of the available RAM is {budget / 2**30:.1f} "
                "GiB; lower data.image_size or data.limit, or raise data.max_ram_fraction if the machine has room"
            )

    def _split(self, n: int) -> tuple[Tensor, Tensor]:
        n_val = self.val_size if isinstance(self.val_size, int) else max(1, round(n * self.val_size))
        if n_val >= n:
            raise ValueError(
                f"data.val_size={self.val_size} holds out {n_val} of the {self._images(n)}, leaving no training "
                "images; lower data.val_size" + (" or raise data.limit" if n < self.loaded else "")
            )
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.split_seed))
        return order[n_val:].sort().values, order[:n_val].sort().values

    def _loader(self, dataset: Dataset[Batch] | None, *, train: bool) -> DataLoader[Batch]:
        if dataset is None:
            raise RuntimeError("RAMDataModule.setup() has not run")
        # Training order: a function of (seed, epoch) that resumes mid-epoch, drawing no global RNG (data/sampler.py).
        return rank_loader(dataset, train=train, trainer=self.trainer, batch_size=self.batch_size,
                           num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                           pin_memory=self.pin_memory, collate_fn=keep_batch)  # fmt: skip

    def train_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.val_set, train=False)
