"""`train.py trainer=ddp` on two CPU processes (gloo), as a real subprocess: the ranks see different data,
end with identical weights, and only rank 0 writes checkpoints and sample grids.

The probe below is a test-only callback, added with `+callbacks.probe._target_=test_ddp.SeenProbe` and
PYTHONPATH=tests (a `tests` package installed by some dependency shadows `tests.test_ddp`).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]


class SeenProbe(Callback):
    """Writes, per rank, digests of the training images it saw, its global batch size and final weights."""

    def __init__(self, *, out_dir: str) -> None:
        self.out_dir, self.seen = Path(out_dir), []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args) -> None:
        self.seen += [hashlib.sha1(image.cpu().numpy().tobytes()).hexdigest() for image in batch[0]]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(pl_module.net.state_dict(), self.out_dir / f"weights_{rank}.pt")
        info = {"seen": self.seen, "world_size": trainer.world_size, "global_batch": pl_module.global_batch_size()}
        (self.out_dir / f"seen_{rank}.json").write_text(json.dumps(info))


@pytest.mark.slow
def test_ddp_two_cpu_ranks_split_the_data_and_agree_on_weights(tmp_path: Path):
    run_dir, probe = tmp_path / "run", tmp_path / "probe"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO / "tests")}  # fmt: skip
    cmd = [sys.executable, "train.py", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
           "data.limit=512", "data.batch_size=16", "trainer.max_steps=4", "trainer.val_check_interval=2",
           "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=2",
           "callbacks.sample_grid.every_n_steps=4", "callbacks.sample_grid.num_samples=4",
           "callbacks.sample_grid.sampler.steps=2", f"hydra.run.dir={run_dir}",
           "+callbacks.probe._target_=test_ddp.SeenProbe", f"+callbacks.probe.out_dir={probe}"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    infos = [json.loads((probe / f"seen_{rank}.json").read_text()) for rank in range(2)]
    assert [i["world_size"] for i in infos] == [2, 2]
    assert [i["global_batch"] for i in infos] == [32, 32]  # the LR scaling rule sees 16 x 2 devices
    seen = [set(i["seen"]) for i in infos]
    assert len(infos[0]["seen"]) == len(infos[1]["seen"]) == 4 * 16
    assert not seen[0] & seen[1]  # the 1,797 digits are all distinct images, so disjoint indices <=> disjoint sets

    weights = [torch.load(probe / f"weights_{rank}.pt", weights_only=True) for rank in range(2)]
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=0, atol=0, msg=key)
    first = next(iter(weights[0].values()))
    assert not torch.equal(first, torch.zeros_like(first))

    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt", "step_0000002.ckpt", "step_0000004.ckpt"], checkpoints
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step_0000004.png"]
    assert len(list(run_dir.glob("**/ema.pt"))) == 1
