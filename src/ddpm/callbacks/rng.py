"""Global RNG states (Python, NumPy, torch CPU and CUDA) in every checkpoint, one entry per rank.

Training randomness (timesteps, noise, label dropout, dropout, flips) comes from the global
generators. This callback snapshots them after each training batch, before checkpoints and
validation run, and puts the snapshot back (a) when validation ends, so evaluation and sample
grids never shift the training streams, and (b) when a resumed run starts training, so step k+1
after a resume draws exactly what it drew in an uninterrupted run.

Every rank draws its own training randomness: when fitting starts, each process reseeds the global
generators from (seed, global rank), as EDM does (Karras et al. 2022, training_loop.py), so the
ranks of a DDP run draw different timesteps, noise, label drops and flips (with one device the seed
is the run seed). The model was built before, from the run seed alone, so its weights agree on
every rank; the data order comes from its own generator (data/sampler.py).
"""

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

RngState = dict[str, Any]


def rank_seed(seed: int, rank: int, world_size: int) -> int:
    """The seed of rank `rank`'s training randomness: seed * world_size + rank (EDM), in [0, 2**31)."""
    return (seed * world_size + rank) % (1 << 31)


def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (CUDA included); PL_GLOBAL_SEED is left alone."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def collect() -> RngState:
    """The global RNG states as plain tensors, lists and numbers (loadable with weights_only=True)."""
    states = _collect_rng_states(include_cuda=True)
    name, keys, pos, has_gauss, cached = states["numpy"]
    states["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    version, internal, gauss = states["python"]
    states["python"] = [version, list(internal), gauss]
    return states


def restore(states: RngState) -> None:
    """Set the global RNG states from `collect()` output (CUDA states only where this process has the devices)."""
    name, keys, pos, has_gauss, cached = states["numpy"]
    cuda = states.get("torch.cuda", [])
    plain = dict(states, numpy=(name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if not torch.cuda.is_available() or len(cuda) != torch.cuda.device_count():
        plain.pop("torch.cuda", None)
    _set_rng_states(plain)


class RNGState(Callback):
    """Seeds each rank from (seed, rank); saves the per-rank RNG snapshot taken after the last training batch;
    restores it on resume."""

    def __init__(self, *, seed: int | None = None) -> None:
        self.seed = seed  # the run seed; None: the generators are left as they are (unseeded runs)
        self.snapshot: RngState | None = None  # after the last training batch of this process
        self.loaded: list[RngState | None] | None = None  # per rank, from a checkpoint, until training starts

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.seed is not None:  # a resumed run then restores its snapshot at train start
            seed_all(rank_seed(self.seed, trainer.global_rank, trainer.world_size))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.snapshot = collect()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training and self.snapshot is not None:
            restore(self.snapshot)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.loaded is None:
            return
        if len(self.loaded) != trainer.world_size:  # decided alike on every rank: rank 0 says it (it had a state)
            rank_zero_warn(
                f"the checkpoint holds RNG states for {len(self.loaded)} rank(s), this run has {trainer.world_size}; "
                "training goes on, but not bit-for-bit as the original run would have"
            )
        if trainer.global_rank < len(self.loaded) and self.loaded[trainer.global_rank] is not None:
            self.snapshot = self.loaded[trainer.global_rank]
            restore(self.snapshot)  # type: ignore[arg-type]
        self.loaded = None

    def state_dict(self) -> dict[str, Any]:
        states = [self.snapshot]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, self.snapshot)
        return {"per_rank": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict.get("per_rank")
