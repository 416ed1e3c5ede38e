"""A training order that is a pure function of (seed, epoch), and a DataLoader that resumes mid-epoch.

Lightning 2.6 restores the position inside an epoch only for a *stateful* loader (one with
`state_dict`/`load_state_dict`): the fit loop saves its state in the checkpoint and loads it before
the iterator is created. `ResumableLoader` counts the batches it has handed out this epoch; on
resume its `ResumableSampler` replays the same permutation (seed + epoch, as DistributedSampler)
and skips the batches already trained on. No global RNG is drawn: not for the order, and not for
the iterator's worker seed (the loader gets its own generator), so resuming and validating leave
the training RNG streams alone.
"""

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def default_seed() -> int:
    """The run seed Lightning's seed_everything exports (PL_GLOBAL_SEED), else 0, like Lightning's own sampler."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class ResumableSampler(DistributedSampler):
    """This rank's share of randperm(N) seeded by seed + epoch; `skip` drops the first indices of the next pass.

    A DistributedSampler subclass, so Lightning neither wraps nor replaces it under DDP.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        num_replicas: int = 1,  # world size
        rank: int = 0,  # this process's global rank
        shuffle: bool = True,  # permute each epoch (False: dataset order)
        seed: int | None = None,  # None: PL_GLOBAL_SEED, else 0
        drop_last: bool = True,  # every rank gets the same number of samples, none repeated
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=default_seed() if seed is None else seed,
            drop_last=drop_last,
        )
        self.skip = 0  # indices to drop from the start of the next pass (set on resume)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.skip :]
        self.skip = 0
        return iter(indices)


class ResumableLoader(DataLoader):
    """A DataLoader over a ResumableSampler whose state is (epoch, batches handed out this epoch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler) or self.batch_size is None:
            raise TypeError("ResumableLoader needs sampler=ResumableSampler(...) and a batch_size")
        self.batches_done = 0  # batches handed out in the current epoch

    def __iter__(self) -> Iterator[Any]:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        self.batches_done = sampler.skip // self.batch_size  # type: ignore[operator]
        for batch in super().__iter__():
            self.batches_done += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        return {"epoch": sampler.epoch, "batches_done": self.batches_done, "batch_size": self.batch_size}  # type: ignore[dict-item]

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        if state["batches_done"] >= len(self):  # stopped on the epoch's last batch: the next epoch starts afresh
            sampler.set_epoch(state["epoch"] + 1)
            sampler.skip = 0
        elif state.get("batch_size") != self.batch_size:
            raise ValueError(
                f"the checkpoint stopped mid-epoch at data.batch_size={state.get('batch_size')}, this run has "
                f"{self.batch_size}; resume with the same data.batch_size (or from an end-of-epoch checkpoint)"
            )
        else:
            sampler.set_epoch(state["epoch"])
            sampler.skip = state["batches_done"] * self.batch_size  # type: ignore[operator]
        self.batches_done = sampler.skip // self.batch_size  # type: ignore[operator]


def generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator for a DataLoader, so creating its iterator draws nothing from the global torch RNG."""
    return torch.Generator().manual_seed(default_seed() if seed is None else seed)
