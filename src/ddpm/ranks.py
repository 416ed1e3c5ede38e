"""Which process this is: the one place the rank and the world size are answered. Plain torch.distributed.

Before a process group exists, the launcher's environment says it (`first_process`: torchrun, Lightning's DDP
children, srun); once one is initialised, `world()` reads it. `init_from_env` joins the group torchrun describes
(sample.py under torchrun); `all_gather_rows` concatenates every rank's rows in rank order.
"""

import os

import torch
import torch.distributed as dist
from torch import Tensor

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")  # torchrun, Lightning, SLURM


def first_process() -> bool:
    """True unless a launcher (torchrun, Lightning's DDP children, srun) says this is not the first process."""
    return all(os.environ.get(name, "0") in ("", "0") for name in RANK_VARIABLES)


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, or (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env() -> bool:
    """Join the process group torchrun describes (WORLD_SIZE > 1); True if this call created it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def collective_device() -> torch.device:
    """NCCL exchanges CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(rows: Tensor) -> Tensor:
    """Concatenate every rank's (n_r, ...) tensor in rank order, on every rank (CPU result); sizes may differ, and a
    rank without rows takes the others' trailing shape (its empty placeholder may have another: a latent model's)."""
    _, size = world()
    if size == 1:
        return rows.cpu()
    device = collective_device()
    shape = torch.tensor(rows.shape, device=device)  # (n_r, ...): every rank's has the same number of dims
    shapes = [torch.zeros_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape)
    counts = [int(s[0].item()) for s in shapes]
    trailing = next((tuple(s[1:].tolist()) for s in shapes if s[0] > 0), tuple(rows.shape[1:]))
    longest = max(counts)
    padded = torch.zeros((longest, *trailing), dtype=rows.dtype, device=device)
    if len(rows):
        padded[: len(rows)] = rows.to(device)
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:count].cpu() for g, count in zip(gathered, counts, strict=True)])
