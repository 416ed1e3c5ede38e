"""Streaming a VAE's latent shards (ddpm.data.latent_shards) for `data=latents data.stream=true`.

As WebDataModule streams pixel shards (ddpm.data.webdataset): every (rank, DataLoader worker) slot keeps the images
of one split (the train/val split of ddpm.data.latents); training passes over all the shards for ever, each pass in
the slot's own fresh shard order (seeded by the seed, the slot and the step the run started or resumed at)
through its own shuffle buffer, `batches_per_epoch` batches per rank and epoch, each epoch going on where the last
stopped (webdataset.SlotStream); validation reads the slot's part of
the shards once (ddpm.data.shards' `assign_shards`: slots that share a shard keep every k-th of its images).
"""

import random
from collections.abc import Iterator

from torch import Tensor

from ddpm.data.latent_shards import iter_samples
from ddpm.data.shards import worker_share
from ddpm.data.webdataset import SlotStream, batches, shuffle_buffer

Batch = tuple[Tensor, Tensor]  # moments (B, 2c, h, w) float16 (z_d float32 (B, c, h, w) on the device), labels (B,)


class LatentStream(SlotStream):
    """Batches of moments and labels read from the shards of this (rank, worker) slot, keeping the images of one
    split; training: `batches_per_epoch` per rank from endless passes (None: one ordered pass, validation)."""

    def __init__(
        self,
        paths: list[str],
        *,
        keep: Tensor,  # (N,) bool: the images of this split
        headers: dict[str, dict],  # each path's expected __meta__.json (ddpm.data.latent_shards.iter_samples)
        batch_size: int,
        batches_per_epoch: int | None,  # per rank; None: one ordered pass (validation)
        shuffle_buffer: int,  # samples held for shuffling (training)
        seed: int,  # seed of the shard order and the shuffle buffer
        rank: int,
        world_size: int,
    ) -> None:
        super().__init__()
        self.paths, self.keep, self.headers, self.batch_size = paths, keep, headers, batch_size
        self.batches_per_epoch, self.shuffle_buffer, self.seed = batches_per_epoch, shuffle_buffer, seed
        self.rank, self.world_size = rank, world_size
        self.start = 0  # the optimizer step the run started at (a resume's: a fresh order, not the first passes')

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("a validation stream has no length known in advance")
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        share = worker_share(self.paths, rank=self.rank, world_size=self.world_size, seed=self.seed, start=self.start)
        if self.batches_per_epoch is None:  # validation: one ordered pass over this slot's part
            yield from batches(self._pass(share.shards, share.offset, share.stride), self.batch_size, count=None)
            return
        make = lambda: batches(self._passes(self.paths, share.rng), self.batch_size, count=None)  # noqa: E731
        yield from self.next_epoch(self.start, make, share.batch_count(self.batches_per_epoch))  # every shard

    def _passes(self, paths: list[str], rng: random.Random) -> Iterator[Batch]:
        """Endless passes over the images of `paths`, each in a fresh shard order through its own shuffle buffer
        (emptied at the pass's end, so a pass holds each image once)."""
        while True:
            order = rng.sample(paths, len(paths))
            produced = 0
            items = self._pass(order, offset=0, stride=1)
            for item in shuffle_buffer(items, self.shuffle_buffer, rng) if self.shuffle_buffer > 1 else items:
                produced += 1
                yield item
            if produced == 0:
                raise ValueError(f"the shards {order} hold no training images (all in the validation split?); "
                                 "check data.root and data.val_size")  # fmt: skip

    def _pass(self, paths: list[str], offset: int, stride: int) -> Iterator[Batch]:
        """The slot's images of the split in `paths`, in order: every stride-th, from offset (shared shards)."""
        for path in paths:
            kept = (item for item in iter_samples(path, self.headers[path]) if self._kept(item[0]))
            for i, (_, moments, label) in enumerate(kept):
                if i % stride == offset:
                    yield moments, label

    def _kept(self, index: int) -> bool:
        return index < len(self.keep) and bool(self.keep[index])
