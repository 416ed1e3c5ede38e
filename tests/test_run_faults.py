"""Faults of runs and scale: a run folder that holds another run, a ckpt_path naming a folder, a run that trains
zero steps, a resume at another world size (2 gloo processes -> 1 and 1 -> 2), a node that never joins.

Every case is `python train.py ...` as a user types it, in its own process group, killed as a whole on timeout.
The probe callback (test_ddp.SeenProbe) records which training images each rank saw.
"""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from ddpm.resume import check_resume, hpc_checkpoint, requeued_from, resolve_ckpt_path
from ddpm.run_dir import RUN_FILES, RunFolderGuard, RunFolderTaken, claim_run, release
from ddpm.weights import CheckpointError

LR = 1e-3  # optim.lr at optim.base_batch_size=32; optim.scaling=linear: 2e-3 for the 2-process global batch of 64
BASE = [*helpers.TINY_RUN, "optim.lr=1e-3", "optim.scaling=linear", "optim.base_batch_size=32",
        "optim.warmup_steps=20", "+callbacks.probe._target_=test_ddp.SeenProbe"]  # fmt: skip
DDP = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu"]


class StopBeforeTraining(Callback):
    """Test-only: stops fitting before its first optimizer step, as a signal or trainer.max_time would."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True


def start(*overrides: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`python train.py *overrides` in a new session (its own process group)."""
    argv = [helpers.PYTHON, "train.py", *overrides]
    return subprocess.Popen(argv, cwd=helpers.REPO, env=helpers.env(**(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def finish(process: subprocess.Popen[str], timeout: float = 420) -> tuple[int, str]:
    """Its exit status and output; past `timeout` the whole process group is killed and the test fails."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"train.py ran past {timeout} s (killed):\n{output[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output


def train(*overrides: str, timeout: float = 420, extra_env: dict[str, str] | None = None) -> tuple[int, str]:
    return finish(start(*overrides, extra_env=extra_env), timeout)


def ok(*overrides: str, **kwargs: Any) -> str:
    code, output = train(*overrides, **kwargs)
    assert code == 0, output[-4000:]
    return output


def free_ports(n: int) -> list[int]:
    """n distinct ports nobody listens on (bound at once, so they differ; released for the runs)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def ema_updates(checkpoint: dict[str, Any]) -> int:
    (state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("EMA")]
    return state["num_updates"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base: 6 steps on 1 process (checkpoints at 3 and 6). two: base's step 3 resumed on 2 processes to step 9."""
    root = tmp_path_factory.mktemp("runs")
    ok(*BASE, f"hydra.run.dir={root / 'base'}", f"+callbacks.probe.out_dir={root / 'base_probe'}")
    ok(*BASE, *DDP, "trainer.max_steps=9", f"ckpt_path={root / 'base/checkpoints/step_0000003.ckpt'}",
       f"hydra.run.dir={root / 'two'}", f"+callbacks.probe.out_dir={root / 'two_probe'}")  # fmt: skip
    return root


# --- a run never overwrites another run's results --------------------------------------------------------------


@pytest.mark.slow
def test_a_rerun_into_a_finished_run_is_refused_and_overwrite_moves_it_aside(runs: Path, tmp_path: Path) -> None:
    run = shutil.copytree(runs / "base", tmp_path / "run")  # a finished run (its own copy: this test replaces it)
    before = digests(run)
    code, output = train(*helpers.TINY_RUN, f"hydra.run.dir={run}")
    assert code != 0
    for advice in (f"ckpt_path={run}/checkpoints/last.ckpt", "another hydra.run.dir", "overwrite=true"):
        assert advice in output, output[-3000:]
    assert digests(run) == before  # nothing written: not ema.pt, not result.json, not even Hydra's .hydra/

    ok(*helpers.TINY_RUN, "overwrite=true", f"hydra.run.dir={run}")
    (replaced,) = run.glob("replaced-*")
    assert digests(replaced) == before  # the old run, whole
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last.ckpt",
        *(f"step_000000{s}.ckpt" for s in (3, 6)),
    ]
    assert json.loads((run / "result.json").read_text())["status"] == "COMPLETED"


@pytest.mark.slow
def test_a_sweep_into_a_used_sweep_folder_is_refused_before_any_job(runs: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    shutil.copytree(runs / "base", sweep / "0")  # job 0 of an earlier sweep
    before = digests(sweep)
    code, output = train("-m", "optim.lr=-1", f"hydra.sweep.dir={sweep}")
    assert code != 0 and f"hydra.sweep.dir={sweep} already holds" in output and "overwrite=true" in output
    assert digests(sweep) == before


@pytest.mark.slow
def test_resuming_in_place_from_the_checkpoints_folder_continues_the_run(runs: Path, tmp_path: Path) -> None:
    """ckpt_path=<run>/checkpoints (the folder) with the same hydra.run.dir: no last-v1.ckpt, the old checkpoints and
    the old metrics stay."""
    run = shutil.copytree(runs / "base", tmp_path / "run")  # moved there: its checkpoints name another dirpath
    old_metrics = (run / "csv" / "metrics.csv").read_text()
    ok(*BASE, "trainer.max_steps=9", f"ckpt_path={run}/checkpoints", f"hydra.run.dir={run}",
       f"+callbacks.probe.out_dir={tmp_path / 'probe'}")  # fmt: skip
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step_0000003.ckpt", "step_0000006.ckpt", "step_0000009.ckpt"], names
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 9
    (kept,) = (run / "csv").glob("metrics-*.csv")
    assert kept.read_text() == old_metrics
    assert yaml.safe_load((run / "resume_diff.yaml").read_text())["resumed_from"] == f"{run}/checkpoints/last.ckpt"


def test_run_folder_rule_for_checkpoint_folders_requeues_and_other_ranks(tmp_path: Path, monkeypatch) -> None:
    run, outside = tmp_path / "run", tmp_path / "shared_ckpts"
    (outside / "step_0000001.ckpt").parent.mkdir()
    (outside / "step_0000001.ckpt").write_bytes(b"x")
    with pytest.raises(RunFolderTaken, match=r"callbacks\.checkpoint\.dirpath="):
        claim_run(run, ckpt_path=None, overwrite=False, checkpoint_dirs=[outside])
    (run / "config.yaml").write_text("{}")
    (run / "hpc_ckpt_2.ckpt").write_bytes(b"x")
    (run / "hpc_ckpt_10.ckpt").write_bytes(b"x")
    assert hpc_checkpoint(run) == run / "hpc_ckpt_10.ckpt"  # Lightning's SLURM requeue: resumes in place
    release()  # each claim_run here stands for a process of its own (a process's marks go at its exit)
    claim_run(run, ckpt_path=hpc_checkpoint(run), overwrite=False)
    release()
    with pytest.raises(RunFolderTaken):
        claim_run(run, ckpt_path=None, overwrite=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a DDP child writes into the folder rank 0 claimed
    claim_run(run, ckpt_path=None, overwrite=False)


def test_a_requeued_job_that_named_a_ckpt_path_resumes_from_the_requeues_checkpoint(tmp_path: Path) -> None:
    """SLURM runs a requeued job's first command again: where that named ckpt_path (a resume, of this run or of
    another), the newer hpc checkpoint the requeue saved in the run folder was ignored (up to a checkpoint interval
    trained again), or the run folder was refused as another run's."""
    from omegaconf import OmegaConf

    run, other = tmp_path / "run", tmp_path / "other" / "checkpoints" / "last.ckpt"
    (run / "checkpoints").mkdir(parents=True)
    other.parent.mkdir(parents=True)
    for path in (other, run / "checkpoints" / "last.ckpt", run / "config.yaml"):
        path.write_bytes(b"x")
    assert requeued_from(run, other) == other  # no requeue yet
    os.utime(run / "checkpoints" / "last.ckpt", (1, 1))
    (run / "hpc_ckpt_1.ckpt").write_bytes(b"x")
    assert requeued_from(run, None) == requeued_from(run, other) == run / "hpc_ckpt_1.ckpt"
    assert requeued_from(run, tmp_path / "typo.ckpt") == tmp_path / "typo.ckpt"  # refused by name later
    assert requeued_from(run, run / "checkpoints" / "last.ckpt") == run / "hpc_ckpt_1.ckpt"
    os.utime(run / "hpc_ckpt_1.ckpt", (0, 0))
    assert requeued_from(run, run / "checkpoints" / "last.ckpt") == run / "checkpoints" / "last.ckpt"  # saved after
    config = OmegaConf.create({"ckpt_path": str(other), "resume_dir": None, "overwrite": False})
    RunFolderGuard._claim(run, config, RUN_FILES, "hydra.run.dir", everything=True)  # the requeue: not refused
    assert (run / "config.yaml").is_file()


# --- ckpt_path: a run folder or its checkpoints/ folder, and the resume's advice ---------------------------------


def test_ckpt_path_takes_a_run_or_checkpoints_folder_and_advises_a_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("step_0000003.ckpt", "step_0000006.ckpt"):
        (run / "checkpoints" / name).write_bytes(b"x")
    for given in (run, run / "checkpoints"):
        with pytest.raises(CheckpointError) as info:
            resolve_ckpt_path(str(given), resume_dir=None, output_dir=tmp_path / "new")
        message = str(info.value)
        assert "step_0000003.ckpt, step_0000006.ckpt" in message
        assert f"ckpt_path={run / 'checkpoints' / 'step_0000006.ckpt'}" in message and "ckpt=" not in message
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    for given in (run, run / "checkpoints"):
        assert (
            resolve_ckpt_path(str(given), resume_dir=None, output_dir=tmp_path / "new") == run / "checkpoints/last.ckpt"
        )
    torch.save({"weights": torch.zeros(1)}, tmp_path / "foreign.ckpt")
    for wrong in (tmp_path / "nope.ckpt", tmp_path / "foreign.ckpt", run / "checkpoints" / "last.ckpt"):
        with pytest.raises(CheckpointError) as info:  # absent, another project's, garbage: never sample.py's advice
            check_resume(wrong, {}, tmp_path / "new")
        assert " ckpt=" not in str(info.value) and "ema.pt" not in str(info.value)
        assert wrong.name == "last.ckpt" or "resume with ckpt_path=" in str(info.value)


@pytest.mark.slow
def test_ckpt_path_naming_an_ema_export_points_at_the_runs_last_ckpt(runs: Path, tmp_path: Path) -> None:
    code, output = train(*BASE, f"ckpt_path={runs / 'base' / 'ema.pt'}", f"hydra.run.dir={tmp_path / 'new'}")
    assert code != 0 and f"ckpt_path={runs / 'base' / 'checkpoints' / 'last.ckpt'}" in output, output[-3000:]
    assert not (tmp_path / "new" / "config.yaml").exists()


# --- never a run that COMPLETED zero steps ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_fit_that_takes_no_step_fails_and_exports_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, output = train(*helpers.TINY_RUN, "+callbacks.stop._target_=test_run_faults.StopBeforeTraining",
                         f"hydra.run.dir={run}")  # fmt: skip
    assert code != 0 and "the run took no optimizer step" in output, output[-3000:]
    assert not (run / "ema.pt").exists() and not (run / "ema.safetensors").exists()
    assert json.loads((run / "result.json").read_text())["status"] == "FAILED"


@pytest.mark.slow
def test_resuming_a_run_already_at_max_steps_is_refused_up_front(runs: Path, tmp_path: Path) -> None:
    code, output = train(*BASE, f"ckpt_path={runs / 'base'}", f"hydra.run.dir={tmp_path / 'again'}")
    assert code != 0 and "is at step 6 and trainer.max_steps=6" in output and "trainer.max_steps=12" in output
    assert not (tmp_path / "again" / "ema.pt").exists() and not (tmp_path / "again" / "config.yaml").exists()
    run = shutil.copytree(runs / "base", tmp_path / "run")  # in place: the finished run's record stays
    before = (run / "result.json").read_text()
    code, output = train(*BASE, f"ckpt_path={run}", f"hydra.run.dir={run}")
    assert code != 0 and "trainer.max_steps=12" in output
    assert (run / "result.json").read_text() == before and json.loads(before)["status"] == "COMPLETED"


# --- resume at another world size -------------------------------------------------------------------------------


def assert_continued(checkpoint: dict[str, Any], *, step: int, lr: float) -> None:
    """Step, Adam's per-parameter step count (moments never reset), EMA updates, LR rule and its warm-up."""
    assert checkpoint["global_step"] == step
    (optimizer,) = checkpoint["optimizer_states"]
    states = list(optimizer["state"].values())
    assert states and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in states)
    assert {float(s["step"]) for s in states} == {step}  # a reset would count only this run's steps
    assert ema_updates(checkpoint) == step
    (schedule,) = checkpoint["lr_schedulers"]
    assert schedule["base_lrs"] == [pytest.approx(lr)] and schedule["last_epoch"] == step
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(lr * min(1.0, (step + 1) / 20))  # warm-up goes on


def seen(probe: Path, rank: int) -> list[str]:
    return json.loads((probe / f"seen_{rank}.json").read_text())["seen"]


@pytest.mark.slow
def test_one_process_resumed_on_two_continues_with_the_scaled_lr(runs: Path) -> None:
    assert_continued(load(runs / "two/checkpoints/last.ckpt"), step=9, lr=2 * LR)
    world = yaml.safe_load((runs / "two" / "resume_diff.yaml").read_text())["world"]
    assert world["checkpoint"] == {"world_size": 1, "global_batch": 32, "lr": pytest.approx(LR)}
    assert world["now"] == {"world_size": 2, "global_batch": 64, "lr": pytest.approx(2 * LR)} and world["changed"]
    # Epoch 0 has 243 images: steps 1-3 saw 96 of its permutation on 1 process; the 2 processes skip those 96
    # (1 batch of 32 each) and finish the epoch with 2 more batches each (steps 4-5): no image twice. Epoch 1
    # (3 batches each) is steps 6-8, step 9 the first of epoch 2.
    before, after = (
        seen(runs / "base_probe", 0)[: 3 * 32],
        seen(runs / "two_probe", 0)[:64] + seen(runs / "two_probe", 1)[:64],
    )
    assert len(set(before) | set(after)) == 96 + 128


@pytest.mark.slow
def test_two_processes_resumed_on_one_continues_with_the_scaled_lr(runs: Path, tmp_path: Path) -> None:
    out, probe = tmp_path / "one", tmp_path / "one_probe"
    output = ok(*BASE, "trainer.max_steps=10", f"ckpt_path={runs / 'two'}", f"hydra.run.dir={out}",
                f"+callbacks.probe.out_dir={probe}")  # fmt: skip
    assert "the checkpoint's was 0.002" in output
    assert_continued(load(out / "checkpoints/last.ckpt"), step=10, lr=LR)
    world = yaml.safe_load((out / "resume_diff.yaml").read_text())["world"]
    assert (world["checkpoint"]["world_size"], world["now"]["world_size"]) == (2, 1) and world["changed"]
    # Epoch 2 on 2 processes: step 9 saw 2 x 32 images; the 1 process skips those 64 (2 of its batches).
    two = seen(runs / "two_probe", 0)[-32:] + seen(runs / "two_probe", 1)[-32:]
    assert len(set(two) | set(seen(probe, 0))) == 64 + 32


# --- a node that never joins -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_node_that_never_joins_is_a_bounded_wait_naming_the_address(tmp_path: Path) -> None:
    """Node 0 of 2 alone (rank 0 waits for a client), and node 1 alone (it cannot reach rank 0): both stop within
    dist_timeout_s plus start-up, naming MASTER_ADDR, MASTER_PORT and who joined."""
    common = ["data.limit=256", "data.batch_size=32", "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2",
              "trainer.accelerator=cpu", "dist_timeout_s=10"]  # fmt: skip
    started, ports = time.monotonic(), free_ports(2)  # one port each: the two must never meet
    processes = []
    for node in (0, 1):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[node]), "NODE_RANK": str(node), "WORLD_SIZE": "2"}
        processes.append(start(*common, f"hydra.run.dir={tmp_path / str(node)}", extra_env=env))
    for node, process in enumerate(processes):
        code, output = finish(process, timeout=240)
        assert code != 0 and time.monotonic() - started < 240
        assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={ports[node]}" in output, output[-3000:]
        assert "expected 2 processes" in output
        assert ("1 of 2 ranks joined" if node == 0 else "could not reach rank 0 at 127.0.0.1") in output


def test_a_run_refused_at_start_up_does_not_block_the_corrected_command(tmp_path: Path) -> None:
    """A start-up refusal (data.root mistyped) leaves a FAILED result.json (and the loggers' folders) in the fixed
    hydra.run.dir; the folder then counted as another run's, and the corrected command was refused in turn. Its
    files now move aside (nothing is deleted). A finished run's folder is still refused."""
    run = tmp_path / "run"
    failed = helpers.train(*helpers.TINY_RUN, "data=mnist", f"data.root={tmp_path / 'typo'}", f"hydra.run.dir={run}",
                           check=False)  # fmt: skip
    assert failed.returncode == 1 and json.loads((run / "result.json").read_text())["status"] == "FAILED"
    (run / "notes.txt").write_text("the user's own file")  # moved with the failed run's files before: kept
    helpers.train(*helpers.TINY_RUN, "callbacks.sample_grid=null", f"hydra.run.dir={run}")  # the corrected one
    assert json.loads((run / "result.json").read_text())["status"] == "COMPLETED" and (run / "ema.pt").is_file()
    (aside,) = run.glob("replaced-*")
    assert json.loads((aside / "result.json").read_text())["status"] == "FAILED" and (run / "notes.txt").is_file()
    with pytest.raises(RunFolderTaken, match="already holds another run's results"):
        claim_run(run, ckpt_path=None, overwrite=False)


def test_a_job_killed_before_its_first_checkpoint_does_not_block_the_next(tmp_path: Path) -> None:
    """Each job's result.json says RUNNING until it ends; one killed (SIGKILL, out of memory) before any work keeps
    it, and a new run into its folder moves it aside as a failed start's (its process, the folder's mark, is gone).
    A killed job with checkpoints is still another run's: refused."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"overrides": [], "status": "RUNNING"}))
    claim_run(run, ckpt_path=None, overwrite=False)
    (aside,) = run.glob("replaced-*")
    assert json.loads((aside / "result.json").read_text())["status"] == "RUNNING"
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (other / "result.json").write_text(json.dumps({"overrides": [], "status": "RUNNING"}))
    with pytest.raises(RunFolderTaken, match="already holds another run's results"):
        claim_run(other, ckpt_path=None, overwrite=False)
    assert not (other / ".running").exists()  # a refused run holds nothing


def test_a_folder_mark_is_the_process_own_only_while_it_runs(tmp_path: Path) -> None:
    """`.running` names the host and pid writing into a folder. A mark naming this very process but not taken by it
    (a restarted container reuses the host name and a small pid) was read as this process's: every check skipped.
    A resume in place took over a live process's mark (two resumes of one run at once); it takes over another host's
    only (a requeued job). A checkpoint folder outside the run holds none (Lightning warns on a non-empty one)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (run / ".running").write_text(f"{socket.gethostname()} {os.getpid()}")
    with pytest.raises(RunFolderTaken, match="already holds another run's results"):
        claim_run(run, ckpt_path=None, overwrite=False)
    busy = subprocess.Popen(["sleep", "60"])
    try:
        (run / ".running").write_text(f"{socket.gethostname()} {busy.pid}")
        with pytest.raises(RunFolderTaken, match=f"being written by another process \\(pid {busy.pid}"):
            claim_run(run, ckpt_path=run / "checkpoints" / "last.ckpt", overwrite=False)
    finally:
        busy.kill(), busy.wait()
    (run / ".running").write_text("another-node 1")
    claim_run(run, ckpt_path=run / "checkpoints" / "last.ckpt", overwrite=False)  # a requeue elsewhere: taken over
    assert (run / ".running").read_text() == f"{socket.gethostname()} {os.getpid()}"
    release()
    outside = tmp_path / "ckpts"
    claim_run(tmp_path / "new", ckpt_path=None, overwrite=False, checkpoint_dirs=[outside])
    assert (tmp_path / "new" / ".running").is_file() and not (outside / ".running").exists()
    release()


def test_a_stop_hydra_never_sees_is_written_and_train_outside_hydra_writes_no_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hydra's on_job_end sees Exceptions only: a KeyboardInterrupt or SystemExit (Lightning's own SIGTERM, a run
    without the Preemption callback, Ctrl-C before the fit while the trainer is built) left result.json saying
    RUNNING. Outside a Hydra job with the summary callback, nothing would write the final status, so no RUNNING is
    written (train() called from a notebook or a test)."""
    from ddpm import training
    from ddpm.job_end import recorded, write_running

    for stop, said in ((KeyboardInterrupt(), "stopped: KeyboardInterrupt"), (SystemExit(1), "stopped: SystemExit 1")):
        with pytest.raises(type(stop)), recorded(tmp_path, "val/loss"):
            raise stop
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["status"] == "INTERRUPTED" and result["error"] == said
    with pytest.raises(ValueError), recorded(tmp_path / "x", "val/loss"):  # an Exception: Hydra's to record
        raise ValueError("boom")
    assert not (tmp_path / "x").exists()
    assert write_running(tmp_path / "y", "val/loss") is None and not (tmp_path / "y").exists()

    def ctrl_c(cfg: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "build_loggers", ctrl_c)  # after the network and the data module are built
    cfg = helpers.compose("train", [*helpers.TINY_RUN, f"paths.output_dir={tmp_path / 'run'}"])
    with pytest.raises(KeyboardInterrupt):
        training.train(cfg)
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "INTERRUPTED"
