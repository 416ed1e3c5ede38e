"""Paths the docs promise, each run once through the real train.py / sample.py (tiny digits runs).

bf16-mixed on CPU, v-prediction with min-SNR weighting, the three samplers, guidance and its refusals
(unconditional model; conditional model whose null class was never trained, diffusion.p_uncond=0), the
guided training-time grid, and the LR range test without tune.apply. The guidance check itself
(`check_guidance`, shared by sample.py and the grid callback) is unit-tested first.
"""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import TINY_RUN, compose, sample, train
from PIL import Image

from ddpm.run_checks import check_callback_guidance
from ddpm.sampling.runtime import check_guidance
from ddpm.weights.model import run_config
from ddpm.weights.torch_file import load_checkpoint

STEPS = 6  # TINY_RUN's trainer.max_steps


# --- the guidance check (unit) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guidance", "num_classes", "p_uncond"),
    [(0.0, None, 0.1), (0.0, None, 0.0), (0.0, 10, 0.0), (3.0, 10, 0.1), (1.0, 10, None)],
)
def test_check_guidance_accepts_what_the_model_can_do(guidance, num_classes, p_uncond) -> None:
    check_guidance(guidance, num_classes=num_classes, p_uncond=p_uncond)


def test_check_guidance_refuses_an_unconditional_model() -> None:
    with pytest.raises(
        ValueError,
        match=r"^guidance=3\.0: guidance needs a class-conditional model.*unconditional; set guidance=0",
    ):
        check_guidance(3.0, num_classes=None, p_uncond=0.1)


def test_check_guidance_refuses_an_untrained_null_class() -> None:
    """p_uncond=0: the null class never saw a training label; the error names the key, p_uncond and the fix."""
    with pytest.raises(ValueError, match=r"callbacks\.sample_grid\.guidance=2\.0: .*diffusion\.p_uncond=0\.0") as info:
        check_guidance(2.0, num_classes=10, p_uncond=0.0, key="callbacks.sample_grid.guidance")
    assert "set callbacks.sample_grid.guidance=0" in str(info.value)
    assert "diffusion.p_uncond > 0" in str(info.value)


@pytest.mark.parametrize("guidance", [-1.0, math.nan, math.inf])
def test_check_guidance_refuses_a_negative_or_non_finite_weight(guidance: float) -> None:
    """NaN and inf passed (NaN fails every comparison) and the sampler then blamed the weights or bf16."""
    refusal = r"^guidance=.*: a guidance weight must be finite and >= 0 .*; set guidance=0 or a positive weight$"
    with pytest.raises(ValueError, match=refusal):
        check_guidance(guidance, num_classes=10, p_uncond=0.1)


def test_train_refuses_a_callback_guidance_the_model_cannot_honour_before_reading_data() -> None:
    """train() checks the sample grid's and FID's guidance at entry (the callbacks do not check again)."""
    config = {
        "model": {"num_classes": 10},
        "diffusion": {"p_uncond": 0.0},
        "callbacks": {"sample_grid": {"guidance": 3.0}},
    }
    with pytest.raises(ValueError, match=r"^callbacks\.sample_grid\.guidance=3\.0: .*diffusion\.p_uncond=0\.0"):
        check_callback_guidance(config)
    config["model"]["num_classes"] = None
    with pytest.raises(ValueError, match=r"^callbacks\.sample_grid\.guidance=3\.0: guidance needs a class-conditional"):
        check_callback_guidance(config)
    check_callback_guidance(config | {"callbacks": {"sample_grid": {"guidance": 0.0}}})


# --- tiny runs (module-scoped: each trained once) -----------------------------------------------------------


def tiny_run(folder: Path, *overrides: str) -> Path:
    train(*TINY_RUN, *overrides, f"hydra.run.dir={folder}")
    return folder


@pytest.fixture(scope="module")
def unconditional_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default digits experiment (model.num_classes: null)."""
    return tiny_run(tmp_path_factory.mktemp("unconditional"))


@pytest.fixture(scope="module")
def v_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("v"), "diffusion.prediction=v", "diffusion.loss_weighting=min_snr")


@pytest.fixture(scope="module")
def guided_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conditional, p_uncond 0.1 (the default), training-time grid with guidance 3."""
    return tiny_run(tmp_path_factory.mktemp("guided"), "model.num_classes=10", "callbacks.sample_grid.guidance=3")


@pytest.fixture(scope="module")
def no_null_class_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conditional with diffusion.p_uncond=0: the null class is never trained."""
    return tiny_run(tmp_path_factory.mktemp("p_uncond_0"), "model.num_classes=10", "diffusion.p_uncond=0")


def draw(run_dir: Path, out: Path, *overrides: str, check: bool = True):
    """sample.py from the run's ema.pt: 4 images, 4 sampler steps, into `out`."""
    return sample(f"ckpt={run_dir / 'ema.pt'}", "num_samples=4", "sampler.steps=4", *overrides,
                  f"output_dir={out}", f"hydra.run.dir={out}", check=check)  # fmt: skip


def saved_samples(out: Path) -> tuple[np.ndarray, list[int]]:
    with np.load(out / "samples.npz") as saved:
        return saved["images"], saved["labels"].tolist()


def assert_real_images(images: np.ndarray, shape: tuple[int, ...] = (4, 16, 16, 1)) -> None:
    """uint8 of the right shape, not a constant (NaN turned uint8 gives one value everywhere)."""
    assert images.dtype == np.uint8 and images.shape == shape
    assert np.unique(images).size > 8, np.unique(images)


def logged(run_dir: Path, key: str) -> list[float]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


# --- bf16-mixed on CPU ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_mixed_training_on_cpu(tmp_path: Path) -> None:
    """trainer.precision=bf16-mixed trains on CPU autocast: finite losses, float32 EMA export, a checkpoint."""
    result = train(*TINY_RUN, "trainer.precision=bf16-mixed", f"hydra.run.dir={tmp_path}")
    assert "bfloat16 Automatic Mixed Precision" in result.stdout + result.stderr
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["precision"] == "bf16-mixed"
    losses = logged(tmp_path, "train/loss")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS
    weights = load_checkpoint(tmp_path / "ema.pt")["ema_state_dict"]
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())


# --- v-prediction with min-SNR weighting, and the three samplers -------------------------------------------


@pytest.mark.slow
def test_v_prediction_min_snr_run_records_its_target(v_run: Path) -> None:
    for path in (v_run / "ema.pt", v_run / "checkpoints" / "last.ckpt"):
        diffusion = run_config(load_checkpoint(path))["diffusion"]
        assert (diffusion["prediction"], diffusion["loss_weighting"]) == ("v", "min_snr"), path
    losses = logged(v_run, "train/loss")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "dpm_solver"])
def test_v_prediction_samples_with_every_sampler(v_run: Path, tmp_path: Path, sampler: str) -> None:
    result = draw(v_run, tmp_path, f"sampler={sampler}")
    images, labels = saved_samples(tmp_path)
    assert_real_images(images)
    assert labels == [-1] * 4
    assert "4 network evaluations per batch; batch 4," in result.stdout  # 4 images: a batch of 4, not of batch_size


# --- guidance: unconditional models ------------------------------------------------------------------------


@pytest.mark.slow
def test_unconditional_sampling_without_guidance(unconditional_run: Path, tmp_path: Path) -> None:
    draw(unconditional_run, tmp_path)
    images, labels = saved_samples(tmp_path)
    assert_real_images(images)
    assert labels == [-1] * 4


@pytest.mark.slow
def test_unconditional_sampling_refuses_guidance(unconditional_run: Path, tmp_path: Path) -> None:
    result = draw(unconditional_run, tmp_path, "guidance=3", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "guidance=3" in output and "unconditional" in output and "model.num_classes" in output, output[-2000:]
    assert not (tmp_path / "samples.npz").exists()


# --- guidance: a conditional model without a trained null class (diffusion.p_uncond=0) -------------------


@pytest.mark.slow
def test_sampling_refuses_guidance_without_a_trained_null_class(no_null_class_run: Path, tmp_path: Path) -> None:
    refused = draw(no_null_class_run, tmp_path / "guided", "guidance=3", check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "diffusion.p_uncond=0" in output and "set guidance=0" in output, output[-2000:]
    draw(no_null_class_run, tmp_path / "plain")  # conditional sampling without guidance is fine
    images, labels = saved_samples(tmp_path / "plain")
    assert_real_images(images)
    assert labels == [0, 1, 2, 3]


@pytest.mark.slow
def test_guided_grid_without_a_trained_null_class_fails_before_training(tmp_path: Path) -> None:
    result = train(*TINY_RUN, "model.num_classes=10", "diffusion.p_uncond=0", "callbacks.sample_grid.guidance=3",
                   f"hydra.run.dir={tmp_path}", check=False)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "callbacks.sample_grid.guidance=3" in output and "diffusion.p_uncond=0" in output, output[-2000:]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "ema.pt").exists()
    assert not (tmp_path / "samples").exists()


# --- guidance: a conditional model trained for it ----------------------------------------------------------


@pytest.mark.slow
def test_training_grid_with_guidance(guided_run: Path) -> None:
    """callbacks.sample_grid.guidance=3 on a conditional p_uncond=0.1 model: the end-of-training grid PNG."""
    grid = guided_run / "samples" / f"step_{STEPS:07d}.png"
    with Image.open(grid) as image:
        assert image.size == (2 + 4 * (16 + 2), 2 + 16 + 2)  # 4 images of 16x16 in one row, 2-pixel padding


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["ddim", "dpm_solver"])
def test_guided_sampling_with_fast_samplers(guided_run: Path, tmp_path: Path, sampler: str) -> None:
    result = draw(guided_run, tmp_path, f"sampler={sampler}", "guidance=3", "labels=[1,7]")
    images, labels = saved_samples(tmp_path)
    assert_real_images(images)
    assert labels == [1, 7, 1, 7]
    assert "4 network evaluations per batch" in result.stdout


# --- LR range test without tune.apply ---------------------------------------------------------------------


@pytest.mark.slow
def test_lr_find_without_apply_writes_the_plot_and_stops(tmp_path: Path) -> None:
    result = train("data.limit=256", "data.batch_size=32", "tune=lr_find", "tune.lr_find.num_steps=5",
                   "optim.scaling=linear", "optim.base_batch_size=64", f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert "suggested optim.lr=" in result.stdout
    assert (tmp_path / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "lr_find.json").read_text())
    assert 2 <= len(record["lr"]) == len(record["loss"]) <= 5
    assert record["lr"] == sorted(record["lr"]) and record["lr_at_min"] in record["lr"]
    assert 0 < record["suggested_lr"] < math.inf
    # lr and lr_at_min are the optimizer's (optim.lr x 32/64 under the linear rule); suggested_lr is optim.lr's
    assert record["optimizer_lr_per_optim_lr"] == 0.5
    if not record["warning"]:  # an interior minimum: a tenth of it, in optim.lr's units
        assert record["suggested_lr"] == pytest.approx(record["lr_at_min"] / 10 / 0.5)
    # No training: no checkpoints, no EMA export, no grid, and the range test's temporary checkpoint removed.
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "ema.pt").exists()
    assert not (tmp_path / "samples").exists()
    assert not list(tmp_path.glob("*.ckpt")) and not list(tmp_path.glob(".lr_find*"))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.num_classes=10", "diffusion.p_uncond=0", "callbacks.sample_grid.guidance=3"], "sample_grid"),
        (["callbacks.sample_grid.guidance=2"], "sample_grid"),  # the default digits model is unconditional
        (
            [
                "model.num_classes=10",
                "diffusion.p_uncond=0",
                "+callbacks/fid=classifier",
                "callbacks.fid.features=clf.pt",
                "callbacks.fid.guidance=1",
            ],
            "fid",
        ),
    ],
)
def test_train_refuses_callback_guidance_before_any_data_is_read(tmp_path, overrides, key) -> None:
    """train()'s start-up check names the callback's key; the data module is never built."""
    from ddpm.training import resolve_config

    with pytest.raises(ValueError, match=rf"callbacks\.{key}\.guidance="):
        resolve_config(compose("train", [*overrides, f"paths.output_dir={tmp_path}"]))
