"""Generating evaluation samples on every DDP rank: disjoint, batch-aligned index ranges, gathered back.

Rank r draws the images with indices [first, first + count) of the N requested, in whole batches of
the batch size, so each image's noise (seeded by `batch_seed(seed, batch start)`) and label are
those that one process would draw for that index: the gathered set is identical for any world size.
Plain torch.distributed; without an initialised process group everything runs as one rank.
"""

import os

import torch
import torch.distributed as dist
from torch import Tensor


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, or (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(num_samples: int, batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first index, count) of `rank`: batches 0..ceil(N/B)-1 dealt out in contiguous, balanced runs."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
    batches = -(-num_samples // batch_size)
    begin, end = rank * batches // world_size, (rank + 1) * batches // world_size
    first, stop = begin * batch_size, min(end * batch_size, num_samples)
    return first, max(0, stop - first)


def collective_device() -> torch.device:
    """NCCL exchanges CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(rows: Tensor) -> Tensor:
    """Concatenate every rank's (n_r, ...) tensor in rank order, on every rank (CPU result); sizes may differ."""
    _, size = world()
    if size == 1:
        return rows.cpu()
    device = collective_device()
    count = torch.tensor([len(rows)], device=device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count)
    longest = int(max(c.item() for c in counts))
    padded = torch.zeros((longest, *rows.shape[1:]), dtype=rows.dtype, device=device)
    padded[: len(rows)] = rows.to(device)
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(c.item())].cpu() for g, c in zip(gathered, counts, strict=True)])


def init_from_env() -> bool:
    """Join the process group torchrun describes (WORLD_SIZE > 1); True if this call created it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True
