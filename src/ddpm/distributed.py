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

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from torch import nn

from ddpm.atomic import atomic_write_text

SLURM_JOB_FILE = ".slurm_job"  # the SLURM job that holds a run folder (restarted)


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


def slurm_plugins() -> list[SLURMEnvironment]:
    """Under SLURM (not torchrun inside an allocation, whose ranks stand: Lightning's own order), the SLURM environment
    with Lightning's requeue off. Its handler saved a checkpoint inside the signal handler, wherever each rank was,
    and the save's collectives met another collective on the other ranks: every rank hung until the time limit.
    ddpm.callbacks.preemption saves at a step the ranks agree on, then requeues where slurm_requeue (`requeue_signal`).
    Off or on, Lightning's handler stays off: the environment it detects by itself would install it."""
    if TorchElasticEnvironment.detect() or not SLURMEnvironment.detect():
        return []
    return [SLURMEnvironment(auto_requeue=False)]


def requeue_signal(*, requeue: bool = True) -> int | None:
    """The signal SLURM warns this job with before its time limit, on which it is checkpointed and requeued: USR1
    (sbatch's --signal=USR1@<s>), or submitit's under hydra/launcher=slurm (USR2, or SUBMITIT_PREEMPT_SIGNAL), whose
    handler submitit installed first: it ended the job without a checkpoint (max_num_timeout=0). None: no requeue."""
    if not requeue or not slurm_plugins():
        return None
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return signal.SIGUSR1
    warned = getattr(signal, f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}")
    signal.signal(warned, signal.SIG_DFL)  # submitit's checkpoint_and_try_requeue
    return warned


def slurm_job() -> str | None:
    """This SLURM job's id (an array task's: <array id>_<task id>), or None outside SLURM."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array else os.environ.get("SLURM_JOB_ID")


def requeue_job() -> str:
    """`scontrol requeue` this job; what it said."""
    job = slurm_job()
    try:
        done = subprocess.run(["scontrol", "requeue", str(job)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"scontrol requeue {job} failed ({error}): requeue it by hand"
    said = (done.stderr or done.stdout).strip()
    return f"requeued SLURM job {job}" if done.returncode == 0 else f"scontrol requeue {job} failed: {said}"


def restarted(folder: Path) -> bool:
    """A SLURM job run again (SLURM_RESTART_COUNT > 0: requeued after its warning signal's checkpoint, a preemption
    or a node failure) into the folder its earlier run held (its id in `SLURM_JOB_FILE`, there or in a job folder of
    a sweep folder): the same command, which resumes in place. Another run's folder, reused, is not this job's (the
    run-folder rule and overwrite stand)."""
    if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
        return False
    return any(_read(mark) == slurm_job() for mark in [folder / SLURM_JOB_FILE, *folder.glob(f"*/{SLURM_JOB_FILE}")])


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def mark_slurm_job(folder: Path) -> None:
    """Write this SLURM job's id into the run folder it holds, for `restarted` after a requeue."""
    if (job := slurm_job()) is not None:
        with contextlib.suppress(OSError):  # an unwritable folder: the run's first write names it
            atomic_write_text(folder / SLURM_JOB_FILE, f"{job}\n")


def check_requeue(*, requeue: bool, preemption: Any) -> None:
    """slurm_requeue=true under SLURM needs the preemption callback (`callbacks.preemption`, its config node here):
    Lightning's requeue is off, and nothing else takes the warning signal (the job died without a checkpoint).
    Refused before any work (the LR range test too)."""
    if requeue and preemption is None and slurm_plugins():
        raise ValueError("slurm_requeue=true under SLURM needs callbacks.preemption (on SLURM's warning signal it "
                         "saves last.ckpt and requeues the job): keep it, or set slurm_requeue=false")  # fmt: skip


def keep_buffers_local(module: nn.Module) -> None:
    """DDP broadcasts rank 0's buffers before every forward, validation's too: a collective per batch, so ranks
    given different numbers of validation batches (a streamed validation pass) waited for each other for ever. Ours
    are constants built alike on every rank (the schedule, the validation grid) or each rank's own on purpose (the
    labels it saw): DDP leaves them alone (torch's `_ddp_params_and_buffers_to_ignore`)."""
    module._ddp_params_and_buffers_to_ignore = [name for name, _ in module.named_buffers()]
