"""Per-step metrics are logged only on the steps Lightning writes, and the loggers get the same rows as
when every step logs (the other steps skip `self.log`, whose Python cost is Lightning's main per-step overhead)."""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import tiny_unet
from lightning.pytorch.loggers import CSVLogger

import ddpm.callbacks.monitor
import ddpm.callbacks.nan_guard
import ddpm.module
from ddpm.callbacks.monitor import Monitor
from ddpm.callbacks.nan_guard import NaNGuard
from ddpm.data.ram import RAMDataModule
from ddpm.data.sources import DigitsSource
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.module import DiffusionModule
from ddpm.optim import AdamW

DETERMINISTIC_KEYS = ("train/loss", "train/grad_norm", "train/skipped_steps")  # images/s depends on the clock


def train_and_read_csv(tmp_path: Path, *, log_every_n_steps: int, max_steps: int) -> tuple[list[dict], int]:
    """A seeded tiny run with the Monitor and NaN guard; returns the CSV rows and the number of self.log calls."""
    pl.seed_everything(0, verbose=False)
    net = tiny_unet(num_classes=10)
    module = DiffusionModule(net=net, diffusion=GaussianDiffusion(num_timesteps=100, p_uncond=0.2),
                             optim=AdamW(lr=1e-3, warmup_steps=0))  # fmt: skip
    calls = []
    log = module.log
    module.log = lambda *args, **kwargs: calls.append(args[0]) or log(*args, **kwargs)  # type: ignore[method-assign]
    data = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, batch_size=8, limit=64, val_size=8)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0, num_sanity_val_steps=0,
        log_every_n_steps=log_every_n_steps, logger=CSVLogger(tmp_path, name="csv"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True, gradient_clip_val=1.0,
        callbacks=[Monitor(), NaNGuard()],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    path = next(tmp_path.glob("csv/*/metrics.csv"))
    with path.open() as f:
        rows = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return rows, len(calls)


def logged(rows: list[dict]) -> dict[int, dict[str, str]]:
    """step -> the deterministic keys logged at it (as text, so the comparison has no rounding)."""
    out: dict[int, dict[str, str]] = {}
    for row in rows:
        values = {k: row[k] for k in DETERMINISTIC_KEYS if k in row}
        if values:
            out.setdefault(int(row["step"]), {}).update(values)
    return out


@pytest.mark.slow
def test_logging_only_on_logged_steps_writes_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gated, gated_calls = train_and_read_csv(tmp_path / "gated", log_every_n_steps=3, max_steps=7)
    for module in (ddpm.module, ddpm.callbacks.monitor, ddpm.callbacks.nan_guard):
        monkeypatch.setattr(module, "logs_this_step", lambda trainer: True)  # the old behaviour: log every step
    every, every_calls = train_and_read_csv(tmp_path / "every", log_every_n_steps=3, max_steps=7)

    assert logged(gated) == logged(every)
    assert sorted(logged(gated)) == [2, 5]  # Lightning writes batches 3 and 6 of 7 (steps counted from 0)
    assert set(logged(gated)[2]) == set(DETERMINISTIC_KEYS)
    assert gated_calls == 2 * 4  # loss, grad norm, images/s, skipped steps: on the two written steps only
    assert every_calls == 7 * 4 - 1  # every step (images/s needs two batch ends first)


def test_logs_this_step_outside_a_trainer_is_true() -> None:
    assert ddpm.callbacks.monitor.logs_this_step(None)
    module = DiffusionModule(net=tiny_unet(), diffusion=GaussianDiffusion(num_timesteps=100), optim=AdamW(lr=1e-3))
    x0 = torch.zeros(2, 1, 8, 8)
    logged_keys = []
    module.log = lambda name, *args, **kwargs: logged_keys.append(name)  # type: ignore[method-assign]
    module.training_step((x0, torch.zeros(2, dtype=torch.long)), 0)  # no Trainer attached: logs as before
    assert logged_keys == ["train/loss"]


def test_images_per_sec_leaves_out_a_sample_grid_or_fid_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 10 images, 1 s each; a grid drawn at a batch's end (9 s, inside off_the_clock) made the next
    logged train/images_per_sec read 20 images / 11 s instead of 10/s (about 10x low at a grid step in real runs)."""
    from types import SimpleNamespace

    from ddpm.callbacks.monitor import off_the_clock

    clock = [0.0]
    monkeypatch.setattr(ddpm.callbacks.monitor.time, "perf_counter", lambda: clock[0])
    trainer = SimpleNamespace(
        world_size=1, fast_dev_run=False, _logger_connector=SimpleNamespace(should_update_logs=True)
    )
    rates: list[float] = []
    module = SimpleNamespace(log=lambda name, value, **kwargs: rates.append(value), device=torch.device("cpu"))
    monitor = Monitor(window=2, grad_norm=False)
    batch = (torch.zeros(10, 1, 2, 2), torch.zeros(10))
    for index in range(5):
        monitor.on_train_batch_end(trainer, module, None, batch, index)  # type: ignore[arg-type]
        if index == 2:
            with off_the_clock(trainer):  # type: ignore[arg-type]
                clock[0] += 9.0
        clock[0] += 1.0
    assert rates == [10.0] * 4


def test_the_progress_bar_shows_no_val_loss_from_the_sanity_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sanity check's one batch of the untrained model is no validation: its val/loss stood on the bar for the
    whole run where no validation had run yet."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.callbacks import RichProgressBar

    from ddpm.callbacks.monitor import ProgressBar

    monkeypatch.setattr(RichProgressBar, "on_validation_end", lambda *args: None)  # no console here
    bar = ProgressBar(only_on_terminal=False)
    metrics = {"val/loss": torch.tensor(1.056)}
    bar.on_validation_end(SimpleNamespace(sanity_checking=True, callback_metrics=metrics), None)
    assert "val/loss" not in bar._shown
    bar.on_validation_end(SimpleNamespace(sanity_checking=False, callback_metrics=metrics), None)
    assert bar._shown["val/loss"] == pytest.approx(1.056)
