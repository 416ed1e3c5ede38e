"""Multi-node training for real on one machine: two "nodes" of one process each (CPU, gloo), four launchers.

- torchrun: docs/scaling.md's command (c10d rendezvous), started twice on 127.0.0.1 as two agents;
- Lightning's own variables (MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE: LightningEnvironment);
- srun: docs/scaling.md's SLURM line with the environment srun gives two tasks on two nodes, set by hand
  (SLURMEnvironment; the master address comes from SLURM_NODELIST);
- hydra/launcher=submitit_local: a multirun of two jobs (pickled, run by submitit's local controller), each of two
  submitit tasks. Lightning reads no SUBMITIT_* variable, so `hydra.job.env_set` turns the task's ids into
  Lightning's (as srun's variables are under hydra/launcher=slurm), and each job gets its own master port.

The documented commands run with GPU -> CPU substitutions only (`on_cpu`: accelerator, 8 devices -> 1, the head
node -> 127.0.0.1 and a free port), a 4-step run appended. Each run must form a world of 2 (Lightning logs members
1/2 and 2/2; optim/global_batch = 2 x data.batch_size in metrics.csv), train its 4 steps, and only rank 0 writes
checkpoints and ema.pt. Every process tree is killed at TIMEOUT_S, or as soon as one process fails.
"""

import contextlib
import csv
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import PYTHON, REPO, env
from test_docs_commands import DOCUMENTED, PATH

pytestmark = pytest.mark.slow

TIMEOUT_S = 300
BATCH = 16
RUN = [f"data.batch_size={BATCH}", "data.limit=256", "trainer.max_steps=4", "trainer.val_check_interval=2",
       "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=2",
       "callbacks.sample_grid.every_n_steps=4", "callbacks.sample_grid.num_samples=4",
       "callbacks.sample_grid.sampler.steps=2"]  # fmt: skip
MEMBER = re.compile(r"Initializing distributed: GLOBAL_RANK: (\d+), MEMBER: (\d+)/(\d+)")


def documented(prefix: str) -> str:
    (text,) = [c for c, where in DOCUMENTED.items() if c.startswith(prefix) and where.startswith("docs/scaling.md")]
    return text


def on_cpu(text: str, port: int) -> str:
    """The documented GPU command on this machine: 1 CPU process per node, the head node at 127.0.0.1:port."""
    cpu = {r"--nproc-per-node[= ]8\b": "--nproc-per-node=1", r"\$HEAD_NODE:\d+": f"127.0.0.1:{port}",
           r"trainer\.accelerator=gpu": "trainer.accelerator=cpu", r"trainer\.devices=8\b": "trainer.devices=1",
           r"(?<= )train\.py(?= )": f"{REPO}/train.py"}  # fmt: skip
    for pattern, replacement in cpu.items():
        text = re.sub(pattern, replacement, text)
    assert "gpu" not in text and "trainer.devices=1" in text and "trainer.num_nodes=2" in text, text
    return " ".join([text, *RUN])


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (torchrun's workers run in sessions of their own, so no process group holds all)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [root]
    while todo:
        tree.append(pid := todo.pop())
        todo += children.get(pid, [])
    return tree


def run_together(lines: list[str], cwd: Path, envs: list[dict[str, str]]) -> str:
    """Start every line (bash, from `cwd`) at once, each with its environment; wait for all of them. A failure or
    TIMEOUT_S kills every process tree (a lone rank would wait for its peer) and fails with the logs."""
    logs = [cwd / f"process_{i}.log" for i in range(len(lines))]
    procs = [subprocess.Popen(line, shell=True, executable="/bin/bash", cwd=cwd, env=env(PATH=PATH, **extra),
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
             for line, extra, log in zip(lines, envs, logs, strict=True)]  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for pid in [pid for p in procs if p.poll() is None for pid in process_tree(p.pid)]:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    codes = [p.wait() for p in procs]
    output = "\n".join(f"--- {line}\n{log.read_text()}" for line, log in zip(lines, logs, strict=True))
    assert codes == [0] * len(procs), f"exit codes {codes} (after {TIMEOUT_S} s: -9):\n{output[-8000:]}"
    return output


def assert_world_of_two(run_dir: Path, output: str) -> None:
    """Two members of one world, the global batch doubled, 4 steps trained, checkpoints and ema.pt of rank 0 only."""
    assert sorted(MEMBER.findall(output)) == [("0", "1", "2"), ("1", "2", "2")], output[-4000:]
    with (run_dir / "csv" / "metrics.csv").open() as f:
        batches = {float(row["optim/global_batch"]) for row in csv.DictReader(f) if row.get("optim/global_batch")}
    assert batches == {2 * BATCH}, batches
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt", "step_0000002.ckpt", "step_0000004.ckpt"], checkpoints
    assert (run_dir / "ema.pt").is_file() and (run_dir / "ema.safetensors").is_file()
    assert output.count("EMA weights: ") == 1, output[-4000:]  # printed by the rank that exports: rank 0


def test_torchrun_two_nodes(tmp_path: Path) -> None:
    """docs/scaling.md's torchrun command, started on both "nodes"; the c10d rendezvous assigns the node ranks."""
    line = on_cpu(documented("torchrun "), free_ports(1)[0])
    output = run_together([line, line], tmp_path, [{}, {}])
    run_dir = tmp_path / re.search(r"hydra\.run\.dir=(\S+)", line).group(1)
    assert_world_of_two(run_dir, output)


def test_lightning_environment_two_nodes(tmp_path: Path) -> None:
    """Two `python train.py` processes that Lightning's variables make node 0 and node 1 of one world."""
    line = " ".join([PYTHON, f"{REPO}/train.py", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1",
                     "trainer.num_nodes=2", f"hydra.run.dir={tmp_path}/run", *RUN])  # fmt: skip
    port = str(free_ports(1)[0])
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "LOCAL_RANK": "0",
             "WORLD_SIZE": "2"} for node in (0, 1)]  # fmt: skip
    assert_world_of_two(tmp_path / "run", run_together([line, line], tmp_path, envs))


def test_srun_two_nodes(tmp_path: Path) -> None:
    """docs/scaling.md's srun line (its #SBATCH --nodes=2, --ntasks-per-node = trainer.devices) as the two tasks
    srun would start; SLURMEnvironment takes the master address from the node list, the job id names the run."""
    line = on_cpu(documented("srun ").removeprefix("srun "), 0)
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.[1-2]", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
           "MASTER_PORT": str(free_ports(1)[0])}  # fmt: skip
    envs = [{**job, "SLURM_PROCID": str(task), "SLURM_LOCALID": "0", "SLURM_NODEID": str(task)} for task in (0, 1)]
    output = run_together([line, line], tmp_path, envs)
    assert_world_of_two(tmp_path / "outputs" / "slurm-4242", output)


def test_submitit_local_multirun_of_two_worlds(tmp_path: Path) -> None:
    """`python train.py -m hydra/launcher=submitit_local` over two learning rates, tasks_per_node=2 as
    conf/hydra/launcher/slurm.yaml sets it (= trainer.devices): each job is a world of its 2 tasks."""
    # submitit's task ids as Lightning's variables, set by Hydra in each task before train(); a master port per job
    # (the nested interpolation is quoted for Hydra's override grammar)
    ranks = ["+hydra.job.env_set.LOCAL_RANK=${oc.env:SUBMITIT_LOCAL_LOCALID}",
             "+hydra.job.env_set.NODE_RANK=${oc.env:SUBMITIT_LOCAL_NODEID}",
             '+hydra.job.env_set.MASTER_PORT="${oc.env:PORT_${hydra.job.num}}"']  # fmt: skip
    argv = [PYTHON, f"{REPO}/train.py", "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
            *ranks, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "optim.lr=1e-4,2e-4",
            f"hydra.sweep.dir={tmp_path}/sweep", *RUN]  # fmt: skip
    ports = {f"PORT_{job}": str(port) for job, port in enumerate(free_ports(2))}
    run_together([shlex.join(argv)], tmp_path, [{"MASTER_ADDR": "127.0.0.1", **ports}])
    summary = (tmp_path / "sweep" / "summary.csv").read_text()
    assert summary.count("COMPLETED") == 2, summary
    jobs: dict[int, str] = {}  # job number -> the logs of its submitit tasks
    for folder in (tmp_path / "sweep" / ".submitit").iterdir():
        output = "\n".join(log.read_text() for log in sorted(folder.glob("*_log.*")))
        if exported := re.search(r"EMA weights: \S*/sweep/(\d+)/ema\.pt", output):
            jobs[int(exported.group(1))] = output
    assert sorted(jobs) == [0, 1], summary
    for job, output in jobs.items():
        assert_world_of_two(tmp_path / "sweep" / str(job), output)


def test_a_failing_process_stops_the_others_at_once(tmp_path: Path) -> None:
    """run_together does not wait for the rest when one process fails: their whole trees are killed."""
    began = time.monotonic()
    with pytest.raises(AssertionError, match=r"exit codes \[-9, 3\]"):
        run_together(["sleep 120 & echo $! > sleep.pid; wait", "sleep 1; exit 3"], tmp_path, [{}, {}])
    assert time.monotonic() - began < 30
    sleeper = int((tmp_path / "sleep.pid").read_text())
    for _ in range(50):  # killed: gone (or a zombie) once the kill has landed
        if not running(sleeper):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"{sleeper} (the sleeping child of a killed process) still runs")


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
