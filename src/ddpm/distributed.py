"""Joining the other processes of a multi-process run: a bounded wait, then an error that says who is missing.

`torch.distributed.init_process_group` (Lightning's DDP strategies call it when fitting starts) makes rank 0
a TCPStore server that waits for the other ranks, and every other rank a client that retries connecting to
MASTER_ADDR:MASTER_PORT; both give up after the process group's timeout (Lightning's default: 30 minutes).
`dist_timeout_s` (conf/train.yaml) is that wait here. Once every rank has joined, `RestoreCollectiveTimeout`
gives the collectives (all-reduce, barriers) Lightning's 30-minute default back, so a short join timeout never
cuts a slow rank-0 save or sample grid short. `explain_join_failure` turns the store's error ("Timed out after
N seconds waiting for clients. 1/2 clients joined.", or a client's connection timeout) into one naming
MASTER_ADDR, MASTER_PORT, the world size expected and how many ranks joined.
"""

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from torch import nn


class PeersMissing(RuntimeError):
    """The processes of a multi-process run did not all join within dist_timeout_s."""


def bound_join(trainer: pl.Trainer, seconds: float) -> None:
    """Give a multi-process strategy `seconds` to gather its ranks (pair with RestoreCollectiveTimeout)."""
    if not seconds > 0:
        raise ValueError(f"dist_timeout_s={seconds} must be > 0 (seconds to wait for every process to join)")
    if trainer.world_size > 1 and hasattr(trainer.strategy, "_timeout"):
        trainer.strategy._timeout = timedelta(seconds=seconds)  # DDP/FSDP strategies pass it to init_process_group


class RestoreCollectiveTimeout(Callback):
    """After the ranks joined (setup runs after init_process_group), collectives get Lightning's default timeout."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.set_timeout(default_pg_timeout)


@contextmanager
def explain_join_failure(*, world_size: int, num_nodes: int, seconds: float) -> Iterator[None]:
    """Re-raise a rendezvous failure (before the process group exists) as PeersMissing, saying who is missing."""
    try:
        yield
    except dist.DistError as error:
        if dist.is_initialized():
            raise  # a collective failed mid-run: not a join failure
        raise PeersMissing(
            join_message(str(error), world_size=world_size, num_nodes=num_nodes, seconds=seconds)
        ) from error


def join_message(error: str, *, world_size: int, num_nodes: int, seconds: float) -> str:
    addr, port = os.environ.get("MASTER_ADDR", "<unset>"), os.environ.get("MASTER_PORT", "<unset>")
    joined = re.search(r"(\d+)/(\d+) clients joined", error)
    if joined:
        seen = f"{joined[1]} of {joined[2]} ranks joined (this one, rank 0, included)"
    else:
        seen = f"this rank could not reach rank 0 at {addr}:{port}"
    where = f"MASTER_ADDR={addr} MASTER_PORT={port}"
    return (
        f"the run expected {world_size} processes (trainer.num_nodes={num_nodes} x trainer.devices) but {seen} "
        f"within dist_timeout_s={seconds:g} ({where}). Start the same command on every node with the same "
        f"{where} and NODE_RANK 0..{num_nodes - 1} (or torchrun --nnodes={num_nodes}), check that node 0 is "
        "reachable on MASTER_PORT from the others (firewall, the node's address), or raise dist_timeout_s if the "
        f"nodes start far apart. Torch said: {error.strip().splitlines()[0][:300]}"
    )


def slurm_plugins(*, requeue: bool = True) -> list[SLURMEnvironment]:
    """Under SLURM, requeue the job on its pre-timeout signal: Lightning saves hpc_ckpt_<n>.ckpt in the run folder
    and calls `scontrol requeue`; the requeued job resumes in place (ddpm.resume.requeued_from). A job of the
    submitit launcher (hydra/launcher=slurm) is warned with submitit's signal (USR2, or SUBMITIT_PREEMPT_SIGNAL),
    whose handler submitit installs first: it ended the job without a checkpoint (max_num_timeout=0) or resubmitted
    it with none, and Lightning installs its own only where no handler is. Lightning takes that signal here."""
    if not requeue or not SLURMEnvironment.detect():
        return []
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return [SLURMEnvironment(auto_requeue=True)]  # sbatch's --signal=USR1@<s> (docs/scaling.md)
    warned = getattr(signal, f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}")
    signal.signal(warned, signal.SIG_DFL)  # submitit's checkpoint_and_try_requeue
    return [SLURMEnvironment(auto_requeue=True, requeue_signal=warned)]


def keep_buffers_local(module: nn.Module) -> None:
    """DDP broadcasts rank 0's buffers before every forward, validation's too: a collective per batch, so ranks
    given different numbers of validation batches (a streamed validation pass) waited for each other for ever. Ours
    are constants built alike on every rank (the schedule, the validation grid) or each rank's own on purpose (the
    labels it saw): DDP leaves them alone (torch's `_ddp_params_and_buffers_to_ignore`)."""
    module._ddp_params_and_buffers_to_ignore = [name for name, _ in module.named_buffers()]
