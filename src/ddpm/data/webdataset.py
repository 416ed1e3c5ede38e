"""WebDataModule: streams tar shards (WebDataset layout: `<key>.png` + `<key>.cls` per sample) for data
too large to preload, with the same uint8 (B, C, H, W) batches and device-side scaling as RAMDataModule.

Training resamples: each (rank, DataLoader worker) slot passes over all training shards for ever, each pass in
its own fresh order (seeded by the seed, the slot and the step the run started or resumed at), through a
shuffle buffer; an epoch is the next fixed number of batches of that stream (`epoch_length`; the workers are
persistent, so the next epoch goes on where this one stopped). A pass holds each image once, so every image has the
same chance to be drawn, whatever the number of shards, slots, images per shard and the epoch's length (a slot reading
a fixed part of the shards drew the images of a small part more often: 2x with 3 shards and 4 slots).

Validation is one ordered pass over `val_urls` (or the last `val_shards` of `urls`), split by rank, then by
worker: slot s of S reads shards[s::S]; with fewer shards than slots, slots share a shard and each keeps every
k-th sample of it, so every sample goes to exactly one slot (WebDataset's own splitter would leave slots empty
and raise "No samples found").

Local paths, `file:` and `pipe:` shards are opened with `webdataset.gopen`; http(s) ones are streamed with a
per-read timeout (`timeout_s`), and every failure names the URL (see ddpm.data.shards). With on_error=skip,
each pass over a slot's shards warns with the count of shards it could not read.
"""

import itertools
import random
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from ddpm.data.images import PILLOW_MAX_PIXELS
from ddpm.data.ram import Batch, ScaleOnDevice
from ddpm.data.sampler import RunShape, check_training_batches
from ddpm.data.shards import OnError, ShardError, Skipped, expand_urls, read_shard, same_shard, worker_share
from ddpm.data.sources import require, require_channels, require_image_size, require_positive_int


class SlotStream(IterableDataset[Batch]):
    """A training slot's endless stream of batches, kept across epochs: each epoch takes the next ones, so a pass
    goes on where the last epoch stopped (begun anew each epoch, an epoch shorter than a shard never reached the
    later images of any shard). DataLoader workers are persistent and keep theirs; a new fit or resume (another
    `start`) draws a fresh stream."""

    _stream: Iterator[Batch] | None = None
    _stream_start: int | None = None  # the `start` (first optimizer step) the stream was drawn for

    def next_epoch(self, start: int, make: Callable[[], Iterator[Batch]], count: int) -> Iterator[Batch]:
        if self._stream is None or self._stream_start != start:
            self._stream, self._stream_start = make(), start
        return itertools.islice(self._stream, count)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_stream": None, "_stream_start": None}  # a generator stays in its process


class ShardStream(SlotStream):
    """Batches of uint8 images and int64 labels from the shards of this rank and worker (see the module doc)."""

    def __init__(
        self,
        urls: list[str],
        *,
        image_size: int,  # H = W of the batches (images of other sizes are resized)
        channels: int | None,  # 1 or 3 channels; None keeps the shards'
        batch_size: int,  # images per batch (per device)
        batches_per_epoch: int | None,  # per rank; None: one ordered pass over the shards (validation)
        shuffle_buffer: int = 0,  # samples held for shuffling (0: stream order)
        seed: int = 0,  # seed of the shard order and the shuffle buffer
        on_error: OnError = "raise",  # damaged samples: raise, or skip with a warning
        rank: int = 0,  # this process's global rank
        world_size: int = 1,  # number of processes
        max_pixels: int | None = PILLOW_MAX_PIXELS,  # images over this many pixels are refused (None: no limit)
        timeout_s: float = 60.0,  # http(s) shards: the longest wait for each read
    ) -> None:
        super().__init__()
        self.urls, self.image_size, self.channels, self.batch_size = urls, image_size, channels, batch_size
        self.batches_per_epoch, self.shuffle_buffer, self.seed = batches_per_epoch, shuffle_buffer, seed
        self.on_error, self.rank, self.world_size = on_error, rank, world_size
        self.max_pixels, self.timeout_s = max_pixels, timeout_s
        self.start = 0  # the optimizer step the run started at (a resume's: a fresh order, not the first passes')

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("a validation stream has no length known in advance")
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        share = worker_share(self.urls, rank=self.rank, world_size=self.world_size, seed=self.seed, start=self.start)
        if self.batches_per_epoch is None:  # validation: one ordered pass over this slot's part
            samples = self._samples(share.shards, share.offset, share.stride, share.rng)
            yield from batches(samples, self.batch_size, count=None)
            return

        def make() -> Iterator[Batch]:  # every shard, in this slot's own order each pass
            samples = self._samples(self.urls, 0, 1, share.rng)
            if self.shuffle_buffer > 1:
                samples = shuffle_buffer(samples, self.shuffle_buffer, share.rng)
            return batches(samples, self.batch_size, count=None)

        yield from self.next_epoch(self.start, make, share.batch_count(self.batches_per_epoch))

    def _samples(self, shards: list[str], offset: int, stride: int, rng: random.Random) -> Iterator[tuple[Tensor, int]]:
        """One ordered pass (validation), or endless passes in a fresh random order each (training)."""
        while True:
            order = list(shards) if self.batches_per_epoch is None else rng.sample(shards, len(shards))
            produced, skipped = 0, Skipped()
            for url in order:
                for i, item in enumerate(self._read(url, skipped)):
                    if i % stride == offset:
                        produced += 1
                        yield item
            if skipped.shards:
                warnings.warn(
                    f"data.on_error=skip: {len(skipped.shards)} of the {len(order)} shard(s) of this pass could not "
                    f"be read and were skipped: {skipped.shards}",
                    stacklevel=2,
                )
            if self.batches_per_epoch is None:
                return
            if produced == 0:  # every shard of this slot is empty or unreadable: stop instead of spinning
                raise ShardError(f"no readable samples in the shards {order}; check data.urls and the shard files")

    def _read(self, url: str, skipped: Skipped) -> Iterator[tuple[Tensor, int]]:
        return read_shard(url, image_size=self.image_size, channels=self.channels, on_error=self.on_error,
                          max_pixels=self.max_pixels, timeout_s=self.timeout_s, skipped=skipped)  # fmt: skip


def shuffle_buffer(items: Iterator, size: int, rng: random.Random) -> Iterator:
    """Reservoir-style shuffle: hold `size` items, emit a random one as each new item arrives."""
    buffer = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        i = rng.randrange(size)
        yield buffer[i]
        buffer[i] = item
    rng.shuffle(buffer)
    yield from buffer


def batches(items: Iterator[tuple[Tensor, int]], batch_size: int, *, count: int | None) -> Iterator[Batch]:
    """Stack samples into (B, C, H, W) uint8 + (B,) int64; `count` full batches, or all (last one partial)."""
    images, labels, made = [], [], 0
    for image, label in items:
        if count is not None and made >= count:
            return
        if images and image.shape != images[0].shape:  # data.channels=null keeps each file's mode
            raise ShardError(f"the shards mix images of shapes {tuple(images[0].shape)} and {tuple(image.shape)} "
                             "(grey and colour files); set data.channels=1 or 3 to convert every image")  # fmt: skip
        images.append(image)
        labels.append(label)
        if len(images) == batch_size:
            yield torch.stack(images), torch.tensor(labels, dtype=torch.int64)
            images, labels, made = [], [], made + 1
    if count is not None and made < count:
        raise ShardError(f"the shards ended after {made} of {count} batches")  # cannot happen when resampling
    if images:
        yield torch.stack(images), torch.tensor(labels, dtype=torch.int64)


class WebDataModule(ScaleOnDevice):
    """Streams WebDataset tar shards: resampled training epochs of fixed length, one ordered validation pass."""

    def __init__(
        self,
        *,
        urls: str | Sequence[str],  # training shards: 'dir/shard-{000000..000099}.tar' or a list
        image_size: int,  # H = W of the model's images
        channels: int | None = None,  # convert to 1 or 3 channels; None keeps the shards'
        val_urls: str | Sequence[str] | None = None,  # validation shards; None: hold out the last `val_shards`
        val_shards: int = 1,  # shards of `urls` held out for validation when val_urls is None
        batch_size: int = 64,  # per device
        num_workers: int = 2,  # DataLoader workers (decoding runs in them)
        epoch_length: int = 10_000,  # training samples per epoch, across all ranks
        shuffle_buffer: int = 1000,  # samples held per worker for shuffling
        seed: int = 0,  # seed of the shard order and shuffle buffer (rank and worker are mixed in)
        on_error: OnError = "raise",  # a damaged shard: raise an error naming it, or skip with a warning
        num_classes: int | None = None,  # classes in the shards' .cls labels (informational)
        hflip: bool = False,  # random horizontal flips (on the device)
        pin_memory: bool | None = None,  # None: pin when CUDA is available
        max_pixels: int | None = PILLOW_MAX_PIXELS,  # refuse larger images (decompression bombs); None: no limit
        timeout_s: float = 60.0,  # http(s) shards: the longest wait for each read before the shard fails
    ) -> None:
        super().__init__()
        require("data.on_error", on_error, lambda v: v in ("raise", "skip"), "'raise' or 'skip'")
        require_image_size("data.image_size", image_size)
        require_channels("data.channels", channels)
        counts = {"batch_size": (batch_size, 1), "epoch_length": (epoch_length, 1), "num_workers": (num_workers, 0),
                  "shuffle_buffer": (shuffle_buffer, 0)}  # fmt: skip
        for key, (value, minimum) in counts.items():
            require_positive_int(f"data.{key}", value, minimum=minimum)
        if val_urls is None:  # else val_shards is not used
            require_positive_int("data.val_shards", val_shards)
        require_positive_int("data.max_pixels", max_pixels, allow_none=True)
        require("data.timeout_s", timeout_s, lambda v: isinstance(v, int | float) and v > 0, "a number of seconds > 0")
        self.urls, self.val_urls, self.val_shards = urls, val_urls, val_shards
        self.image_size, self.channels = image_size, channels
        self.batch_size, self.num_workers = batch_size, num_workers
        self.epoch_length, self.shuffle_buffer, self.seed, self.on_error = epoch_length, shuffle_buffer, seed, on_error
        self.num_classes, self.hflip, self.max_pixels, self.timeout_s = num_classes, hflip, max_pixels, timeout_s
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.train_set: ShardStream | None = None
        self.val_set: ShardStream | None = None

    def split_urls(self) -> tuple[list[str], list[str]]:
        """(training shards, validation shards)."""
        train = expand_urls(self.urls)
        if self.val_urls is not None:
            val = expand_urls(self.val_urls, key="data.val_urls")
            training = {same_shard(url) for url in train}
            shared = [url for url in val if same_shard(url) in training]
            if shared:  # a val/loss (the sweeps' objective) on training images
                raise ValueError(f"data.val_urls and data.urls share {len(shared)} shard(s) ({', '.join(shared[:3])}): "
                                 "validation images would train too; take them out of data.urls, or leave "
                                 "data.val_urls unset to hold out data.urls' last data.val_shards")  # fmt: skip
            return train, val
        if not 1 <= self.val_shards < len(train):
            raise ValueError(
                f"data.val_shards={self.val_shards} cannot be held out of the {len(train)} shards of data.urls; "
                "set data.val_urls to separate validation shards, or data.val_shards between 1 and "
                f"{len(train) - 1}"
            )
        return train[: -self.val_shards], train[-self.val_shards :]

    def setup(self, stage: str | None = None) -> None:
        train, val = self.split_urls()
        shape = RunShape.of(self.trainer)
        rank, world = shape.rank, shape.world_size
        per_rank = self.epoch_length // (self.batch_size * world)
        if stage in (None, "fit"):
            source = f"data.epoch_length={self.epoch_length} samples" + (
                f" split over {shape.processes()}" if world > 1 else "")  # fmt: skip

            def fix(needed: int) -> str:
                fits = self.epoch_length // (needed * world)  # the largest batch size that gives `needed` batches
                lower = f" or lower data.batch_size to at most {fits}" if fits else ""
                return f"raise data.epoch_length to at least {needed * self.batch_size * world}{lower}"

            check_training_batches(batches=per_rank, shape=shape, source=source, batch_size=self.batch_size,
                                   fix_more=fix)  # fmt: skip
        common = dict(image_size=self.image_size, channels=self.channels, batch_size=self.batch_size,
                      seed=self.seed, on_error=self.on_error, rank=rank, world_size=world,
                      max_pixels=self.max_pixels, timeout_s=self.timeout_s)  # fmt: skip
        self.train_set = ShardStream(train, batches_per_epoch=per_rank, shuffle_buffer=self.shuffle_buffer, **common)
        self.val_set = ShardStream(val, batches_per_epoch=None, **common)

    def _loader(self, dataset: ShardStream | None) -> DataLoader[Batch]:
        if dataset is None:
            raise RuntimeError("WebDataModule.setup() has not run")
        return DataLoader(
            dataset,
            batch_size=None,  # the stream yields whole batches
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader[Batch]:
        if self.train_set is not None and self.trainer is not None:  # after a checkpoint is restored
            self.train_set.start = self.trainer.global_step
        return self._loader(self.train_set)

    def val_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.val_set)
