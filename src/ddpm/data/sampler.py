"""A training order that is a pure function of (seed, epoch), and a DataLoader that resumes mid-epoch.

Lightning 2.6 restores the position inside an epoch only for a *stateful* loader (one with
`state_dict`/`load_state_dict`): the fit loop saves its state in the checkpoint and loads it before
the iterator is created. `ResumableLoader` counts the batches it has handed out this epoch; on
resume its `ResumableSampler` replays the same permutation (seed + epoch, as DistributedSampler)
and skips the batches already trained on. No global RNG is drawn: not for the order, and not for
the iterator's worker seed (the loader gets its own generator), so resuming and validating leave
the training RNG streams alone.

The position is global, so it survives a resume at another world size or batch size: the epoch keeps its
permutation (seed + epoch; DistributedSampler deals position p of it to rank p % world_size), and the
checkpoint records `samples_seen`, the S first positions of it trained on. The resumed run's W ranks each skip
ceil(S / W) indices of their share, so no sample of the epoch comes twice, every rank keeps the same number of
batches, and fewer than W samples go unseen this epoch; when no whole batch is left, the next epoch starts.
`position_for` tells the LightningModule where Lightning's own batch count within the epoch must stand: Lightning
decides from its own progress whether the checkpoint's epoch goes on (then at this loader's count) or a new one
starts (then at 0, whole).
"""

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
        self.skip = 0  # indices to drop from the start of the pass over epoch `skip_epoch` (set on resume)
        self.skip_epoch = 0

    def pending(self) -> int:
        """The indices this pass skips: the resume's, unless the loop moved on to the next epoch first
        (trainer.limit_train_batches ended the resumed epoch at the checkpoint)."""
        return self.skip if self.epoch == self.skip_epoch else 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.pending() :]
        self.skip = 0
        return iter(indices)


class EvaluationShare(DistributedSampler):
    """Rank r's indices r, r + W, r + 2W, ... in order: each sample on one rank, none twice (DistributedSampler
    pads the last ranks with repeats, so a per-sample mean over ranks counts some twice, ddpm.epoch_mean). A rank
    past a set of fewer than W samples takes one of them again: Lightning skips the epoch-end hooks of a process
    with no batch, and the others would wait for it in the reduce. A DistributedSampler, so Lightning keeps it."""

    def __init__(self, dataset: Dataset[Any], *, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        size = len(dataset)  # type: ignore[arg-type]
        self.indices = list(range(rank, size, num_replicas)) or ([rank % size] if size else [])

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def rank_loader(dataset: Dataset[Any], *, train: bool, trainer: Any, **loader: Any) -> DataLoader:
    """This process's loader of a map-style set (`loader`: DataLoader's other arguments): training a ResumableLoader
    over a ResumableSampler, whole batches only; validation every sample once over the ranks (EvaluationShare)."""
    world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
    share = ResumableSampler if train else EvaluationShare
    return (ResumableLoader if train else DataLoader)(dataset, sampler=share(dataset, num_replicas=world, rank=rank),
                                                      generator=generator(), drop_last=train, **loader)  # fmt: skip


class ResumableLoader(DataLoader):
    """A DataLoader over a ResumableSampler whose state is (epoch, batches handed out this epoch, samples seen)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler) or self.batch_size is None:
            raise TypeError("ResumableLoader needs sampler=ResumableSampler(...) and a batch_size")
        self.batches_done = 0  # batches of the current epoch counted as done (Lightning's count)
        self.consumed = 0  # indices of this rank's share trained on (or skipped) this epoch
        self.resumed_epoch: int | None = None  # the checkpoint's epoch, until Lightning's count follows

    def __iter__(self) -> Iterator[Any]:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        self.consumed = sampler.pending()
        self.batches_done = len(self) - (len(sampler) - self.consumed) // self.batch_size  # type: ignore[operator]
        for batch in super().__iter__():
            self.batches_done += 1
            self.consumed += self.batch_size  # type: ignore[operator]
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        return {"epoch": sampler.epoch, "batches_done": self.batches_done, "batch_size": self.batch_size,  # type: ignore[dict-item]
                "num_replicas": sampler.num_replicas, "samples_seen": self.consumed * sampler.num_replicas}  # fmt: skip

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        world = sampler.num_replicas
        seen = state.get("samples_seen")  # global positions of the epoch's permutation (older checkpoints: derived)
        if seen is None:
            seen = state["batches_done"] * state.get("batch_size", self.batch_size) * state.get("num_replicas", world)
        skip = -(-seen // world)  # every rank the same count: no position below `seen` comes again
        left = max(0, (len(sampler) - skip) // self.batch_size)  # type: ignore[operator]  # 0: the epoch's pass is empty
        sampler.set_epoch(state["epoch"])
        sampler.skip, sampler.skip_epoch, self.consumed = skip, state["epoch"], skip
        self.batches_done, self.resumed_epoch = len(self) - left, state["epoch"]

    def position_for(self, epoch: int) -> int | None:
        """Once after a resume: the batches Lightning must count as done as it starts `epoch`: this loader's count
        in the checkpoint's epoch; 0 in a later one (Lightning found the checkpoint's epoch finished, whatever is
        left of it at the new sizes: the next epoch starts whole, pending() gives its pass no skip). None
        without a resume."""
        resumed, self.resumed_epoch = self.resumed_epoch, None
        return None if resumed is None else self.batches_done if epoch == resumed else 0


def generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator for a DataLoader, so creating its iterator draws nothing from the global torch RNG."""
    return torch.Generator().manual_seed(default_seed() if seed is None else seed)


@dataclass(frozen=True)
class RunShape:
    """How the Trainer splits the work: processes and micro-batches per optimizer step."""

    world_size: int = 1  # trainer.devices x trainer.num_nodes
    rank: int = 0
    devices: int = 1  # trainer.devices (per node)
    num_nodes: int = 1
    accumulate: int = 1  # trainer.accumulate_grad_batches
    limit_train_batches: int | float | None = None  # trainer.limit_train_batches (None: no limit)

    @classmethod
    def of(cls, trainer: Any) -> "RunShape":
        """The shape of `trainer` (None, outside a Trainer: one process, no accumulation)."""
        if trainer is None:
            return cls()
        world = int(getattr(trainer, "world_size", 1))
        nodes = int(getattr(trainer, "num_nodes", 1) or 1)
        return cls(world_size=world, rank=int(getattr(trainer, "global_rank", 0)),
                   devices=int(getattr(trainer, "num_devices", max(1, world // nodes))), num_nodes=nodes,
                   accumulate=int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
                   limit_train_batches=getattr(trainer, "limit_train_batches", None))  # fmt: skip

    def processes(self) -> str:
        return (f"{self.world_size} process(es) (trainer.devices={self.devices} x "
                f"trainer.num_nodes={self.num_nodes})")  # fmt: skip

    def limited(self, batches: int) -> int:
        """The batches Lightning runs per epoch out of `batches` under trainer.limit_train_batches."""
        limit = self.limit_train_batches
        if limit is None or (isinstance(limit, float) and limit == 1.0):
            return batches
        return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def check_training_batches(
    *, batches: int, shape: RunShape, source: str, batch_size: int, fix_more: Callable[[int], str]
) -> None:
    """Refuse an epoch of `batches` per process that gives no full optimizer step, naming the keys to change.

    The datamodules run it at setup with each process's share (the DistributedSampler's split with drop_last).
    Zero batches would train zero steps; fewer than trainer.accumulate_grad_batches would make every optimizer
    step average fewer micro-batches than configured (Lightning steps at the epoch's end and divides each loss
    by accumulate_grad_batches, so the gradient shrinks by that ratio while the LR scaling rule assumes the full
    global batch). `source` says where the per-process count comes from (with its keys); `fix_more(k)` how to
    get k batches per process."""
    run = shape.limited(batches)
    where = f"{source}: {batches} full batch(es) of data.batch_size={batch_size} per process and epoch"
    if run < batches:
        where += f", {run} under trainer.limit_train_batches={shape.limit_train_batches}"
    limited = run < batches  # trainer.limit_train_batches is what cuts the epoch short

    def more(needed: int) -> str:
        return "raise trainer.limit_train_batches" if limited else fix_more(needed)

    if run < 1:
        raise ValueError(f"{where}, so the run would train zero optimizer steps; {more(max(1, shape.accumulate))}")
    if run < shape.accumulate:
        raise ValueError(
            f"{where}, fewer than trainer.accumulate_grad_batches={shape.accumulate}: every optimizer step would "
            f"average only {run} of the {shape.accumulate} micro-batches it is scaled for (Lightning steps at each "
            f"epoch's end); lower trainer.accumulate_grad_batches to at most {run}, or {more(shape.accumulate)}"
        )
