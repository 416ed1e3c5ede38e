"""`train.py trainer=ddp` on two CPU processes (gloo), as a real subprocess: the ranks see different data and
draw different timesteps, end with identical weights, only rank 0 writes checkpoints and sample grids; a rerun
draws the same timesteps, and a resume from a mid-run checkpoint (same world size) ends bit for bit where the
straight run did.

The probe below is a test-only callback, added with `+callbacks.probe._target_=test_ddp.SeenProbe`
(helpers.ENV puts tests/ on PYTHONPATH; a `tests` package installed by some dependency shadows `tests.test_ddp`).
"""

import hashlib
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import train
from lightning.pytorch.callbacks import Callback


class SeenProbe(Callback):
    """Writes, per rank, digests of the training images it saw, the timesteps it drew, its global batch size
    and its final weights."""

    def __init__(self, *, out_dir: str) -> None:
        self.out_dir, self.seen, self.timesteps = Path(out_dir), [], []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        draw = pl_module.diffusion.sample_timesteps

        def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
            t = draw(*args, **kwargs)
            self.timesteps.append(t.tolist())
            return t

        pl_module.diffusion.sample_timesteps = recorded

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args) -> None:
        self.seen += [hashlib.sha1(image.cpu().numpy().tobytes()).hexdigest() for image in batch[0]]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(pl_module.net.state_dict(), self.out_dir / f"weights_{rank}.pt")
        info = {"seen": self.seen, "timesteps": self.timesteps, "world_size": trainer.world_size,
                "global_batch": pl_module.global_batch_size()}  # fmt: skip
        (self.out_dir / f"seen_{rank}.json").write_text(json.dumps(info))


DDP = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "data.limit=512", "data.batch_size=16",
       "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
       "callbacks.checkpoint.every_n_train_steps=2", "callbacks.sample_grid.every_n_steps=4",
       "callbacks.sample_grid.num_samples=4", "callbacks.sample_grid.sampler.steps=2",
       "+callbacks.probe._target_=test_ddp.SeenProbe"]  # fmt: skip


def ddp_run(root: Path, name: str, *overrides: str) -> tuple[Path, list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
    """A 2-rank run in root/name: (run dir, each rank's probe info, each rank's final weights)."""
    run_dir, probe = root / name, root / f"{name}_probe"
    train(*DDP, "trainer.max_steps=4", *overrides, f"hydra.run.dir={run_dir}", f"+callbacks.probe.out_dir={probe}",
          timeout=900)  # fmt: skip
    infos = [json.loads((probe / f"seen_{rank}.json").read_text()) for rank in range(2)]
    weights = [torch.load(probe / f"weights_{rank}.pt", weights_only=True) for rank in range(2)]
    return run_dir, infos, weights


def assert_equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], list[dict]]:
    return ddp_run(tmp_path_factory.mktemp("ddp"), "straight")


@pytest.mark.slow
def test_ddp_two_cpu_ranks_split_the_data_and_agree_on_weights(straight) -> None:
    run_dir, infos, weights = straight
    assert [i["world_size"] for i in infos] == [2, 2]
    assert [i["global_batch"] for i in infos] == [32, 32]  # the LR scaling rule sees 16 x 2 devices
    seen = [set(i["seen"]) for i in infos]
    assert len(infos[0]["seen"]) == len(infos[1]["seen"]) == 4 * 16
    assert not seen[0] & seen[1]  # the 1,797 digits are all distinct images, so disjoint indices <=> disjoint sets

    assert_equal_weights(weights[0], weights[1])
    first = next(iter(weights[0].values()))
    assert not torch.equal(first, torch.zeros_like(first))

    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt", "step_0000002.ckpt", "step_0000004.ckpt"], checkpoints
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step_0000004.png"]
    assert len(list(run_dir.glob("**/ema.pt"))) == 1


@pytest.mark.slow
def test_each_rank_draws_its_own_timesteps_and_a_rerun_draws_them_again(straight, tmp_path: Path) -> None:
    """seed_everything(seed) alone gives every rank the same stream: B distinct (t, eps) pairs in a global batch
    of 2B. Each rank is reseeded from (seed, rank), so the ranks differ, and the same command repeats them."""
    _, infos, _ = straight
    drawn = [i["timesteps"] for i in infos]
    assert len(drawn[0]) == len(drawn[1]) == 4 and all(len(step) == 16 for step in drawn[0])
    for step in range(4):
        assert drawn[0][step] != drawn[1][step], f"step {step}: both ranks drew {drawn[0][step]}"
    _, again, weights_again = ddp_run(tmp_path, "rerun")
    assert [i["timesteps"] for i in again] == drawn
    assert_equal_weights(weights_again[0], straight[2][0])


@pytest.mark.slow
def test_ddp_resume_with_the_same_world_size_is_exact(straight, tmp_path: Path) -> None:
    """Resumed from the straight run's step-2 checkpoint, each rank draws what it drew in steps 3-4 and the
    final weights are the straight run's, bit for bit."""
    run_dir, infos, weights = straight
    _, resumed, resumed_weights = ddp_run(tmp_path, "resumed", f"ckpt_path={run_dir}/checkpoints/step_0000002.ckpt")
    for rank in range(2):
        assert resumed[rank]["timesteps"] == infos[rank]["timesteps"][2:]
        assert resumed[rank]["seen"] == infos[rank]["seen"][2 * 16 :]
        assert_equal_weights(resumed_weights[rank], weights[rank])


@pytest.mark.slow
def test_sigterm_to_rank_0_stops_both_ranks_at_the_next_logged_step_with_one_checkpoint(tmp_path: Path) -> None:
    """SIGTERM reaches rank 0 only. The ranks agree on it at the steps Lightning logs (a broadcast there, not a host
    sync at every step): both stop after the same logged step, rank 0 writes last.ckpt, the run exits 143."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import REPO, env

    run_dir = tmp_path / "run"
    command = [sys.executable, "train.py", *DDP[:-1], "trainer.max_steps=400", "trainer.log_every_n_steps=25",
               "trainer.val_check_interval=1000", "callbacks.sample_grid=null", f"hydra.run.dir={run_dir}"]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not list((run_dir / "checkpoints").glob("step_*.ckpt")) and time.monotonic() < deadline:
            time.sleep(0.2)  # training has begun on both ranks
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 143, output[-3000:]
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < step < 400 and step % 25 == 0, step  # eager per-step agreement: 1 chance in 25
    assert f"saved {run_dir / 'checkpoints' / 'last.ckpt'} at step {step}" in output


def test_epoch_means_are_per_sample_means_and_empty_processes_take_part() -> None:
    """ddpm.epoch_mean: batches of 3 and 1 samples with means 1 and 4 average to (3 + 4) / 4 per sample; a process
    without batches still reduces (zeros), and an epoch without samples anywhere logs nothing."""
    from types import SimpleNamespace

    from ddpm.epoch_mean import EpochMeans

    reduced: list[torch.Tensor] = []
    strategy = SimpleNamespace(reduce=lambda t, reduce_op: reduced.append(t) or t)
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=strategy), device=torch.device("cpu"))
    means = EpochMeans(("val/loss", "val/kl"))
    means.add((torch.tensor(1.0), torch.tensor(2.0)), 3)
    means.add((torch.tensor(4.0, dtype=torch.bfloat16), torch.tensor(0.0)), 1)
    assert {k: v.item() for k, v in means.reduce(module).items()} == {"val/loss": 1.75, "val/kl": 1.5}
    assert means.reduce(module) == {} and reduced[-1].tolist() == [0.0, 0.0, 0.0]  # reset, and still reduced
