"""train.py and sample.py as real subprocesses on tiny configs (the commands a user types)."""

import csv
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import TINY_RUN, sample, train


@pytest.fixture(scope="module")
def conditional_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    train(*TINY_RUN, "model.num_classes=10", f"hydra.run.dir={run_dir}")
    return run_dir


@pytest.mark.slow
def test_train_writes_config_checkpoints_ema_grid_and_metrics(conditional_run: Path) -> None:
    """A run leaves its resolved config, step checkpoints + last, the EMA export, a grid and both losses."""
    config = yaml.safe_load((conditional_run / "config.yaml").read_text())
    assert config["model"]["num_classes"] == 10 and config["trainer"]["max_steps"] == 6
    checkpoints = sorted(p.name for p in (conditional_run / "checkpoints").iterdir())
    assert {"last.ckpt", "step_0000003.ckpt", "step_0000006.ckpt"} <= set(checkpoints), checkpoints
    assert (conditional_run / "ema.pt").is_file()
    assert (conditional_run / "samples" / "step_0000006.png").is_file()
    with (conditional_run / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    train_losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val_losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(train_losses) == 6 and all(np.isfinite(train_losses))
    assert len(val_losses) >= 2 and all(np.isfinite(val_losses))
    checkpoint = torch.load(conditional_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 6 and "ema_state_dict" in checkpoint


@pytest.mark.slow
def test_sample_is_reproducible_and_honours_labels(conditional_run: Path, tmp_path: Path) -> None:
    """Same seed -> same images (from last.ckpt and from ema.pt alike); labels repeat in turn."""
    outs = []
    for name, ckpt in [("a", "checkpoints/last.ckpt"), ("b", "ema.pt")]:
        out = tmp_path / name
        sample(f"ckpt={conditional_run / ckpt}", "num_samples=6", "batch_size=4", "labels=[3,5]", "guidance=2",
               "sampler.steps=5", "seed=7", f"hydra.run.dir={out}")  # fmt: skip
        outs.append(np.load(out / "samples.npz"))
        assert (out / "grid.png").is_file()
    images, labels = outs[0]["images"], outs[0]["labels"]
    assert images.shape == (6, 16, 16, 1) and images.dtype == np.uint8
    assert labels.tolist() == [3, 5, 3, 5, 3, 5]
    np.testing.assert_array_equal(images, outs[1]["images"])


@pytest.mark.slow
def test_sample_errors_name_the_problem(conditional_run: Path, tmp_path: Path) -> None:
    """A missing checkpoint, a non-checkpoint file and guidance on bad labels each fail with a clear message."""
    missing = sample(f"ckpt={tmp_path / 'nope.ckpt'}", f"hydra.run.dir={tmp_path}", check=False)
    assert missing.returncode != 0 and "nope.ckpt" in missing.stderr + missing.stdout
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(os.urandom(1000))
    bad = sample(f"ckpt={junk}", f"hydra.run.dir={tmp_path}", check=False)
    assert bad.returncode != 0 and "junk.ckpt" in bad.stderr + bad.stdout
    labels = sample(f"ckpt={conditional_run / 'ema.pt'}", "labels=[12]", f"hydra.run.dir={tmp_path}", check=False)
    assert labels.returncode != 0 and "0..9" in labels.stderr + labels.stdout


@pytest.mark.slow
def test_train_rejects_a_bad_config_value(tmp_path: Path) -> None:
    """A model that cannot be built fails before training, naming the key to change."""
    result = train("model.image_size=18", f"hydra.run.dir={tmp_path}", check=False)
    assert result.returncode != 0
    assert "model.image_size=18" in result.stderr + result.stdout
