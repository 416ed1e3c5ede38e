"""Validation means over every sample of every process, reduced once at the epoch's end by all of them.

Lightning's `self.log(..., sync_dist=True)` all-reduces a metric at the epoch's end on the processes that logged
it: a process given no validation batch (a streamed validation shard with fewer samples than the (rank, worker)
slots sharing it) never joins, and the others wait in the all-reduce for ever. Here each process adds its
batches' sums and sample count, and `reduce` sums them across processes from `on_validation_epoch_end`, which
every process runs whatever its batch count: the mean over all samples (Lightning's: the mean of the processes'
means).
"""

import lightning.pytorch as pl
import torch
from torch import Tensor


class EpochMeans:
    """Per-sample means of the metrics `keys` over one validation epoch of every process."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self._sums: Tensor | None = None  # (len(keys) + 1,): the metrics' sums, then the sample count

    def add(self, values: tuple[Tensor, ...], count: int) -> None:
        """A batch of `count` samples whose metrics (batch means, in `keys` order) are `values`; no host sync."""
        size = values[0].new_tensor(float(count), dtype=torch.float32)
        batch = torch.stack([*(value.detach().float() * count for value in values), size])
        self._sums = batch if self._sums is None else self._sums + batch

    def reset(self) -> None:
        """At the epoch's start: nothing of a validation that raised is kept."""
        self._sums = None

    def reduce(self, module: pl.LightningModule) -> dict[str, Tensor]:
        """{key: mean} over every process's samples ({} where none had any); called by every process, once."""
        sums = self._sums if self._sums is not None else torch.zeros(len(self.keys) + 1, device=module.device)
        self._sums = None
        total = module.trainer.strategy.reduce(sums, reduce_op="sum")
        if total[-1] <= 0:
            return {}
        return {key: total[i] / total[-1] for i, key in enumerate(self.keys)}
