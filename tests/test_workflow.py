"""Experiment workflow: W&B offline logging, multirun grids with a summary, Optuna with sqlite, SLURM, lr_find."""

import csv
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import TINY_RUN, compose, train, wandb_dirs
from omegaconf import OmegaConf
from PIL import Image

from ddpm.callbacks.monitor import eta_seconds
from ddpm.sweep import collect, format_table
from ddpm.tuning import unbias


def wandb_records(path: Path) -> Iterator[object]:
    """The protobuf Records of an offline run's .wandb file (W&B's leveldb-style log: 32 KiB blocks of
    chunks with a 7-byte header crc32, length, type; 1 = full, 2/3/4 = first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunk = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


@pytest.mark.slow
def test_wandb_offline_run_has_config_scalars_and_captioned_grid(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(*TINY_RUN, "model.num_classes=10", "logger=[csv,wandb]", f"hydra.run.dir={run_dir}",
          extra_env=wandb_dirs(tmp_path))  # fmt: skip
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    records = list(wandb_records(next(offline.glob("*.wandb"))))
    by_type: dict[str, list] = {}
    for record in records:
        by_type.setdefault(record.WhichOneof("record_type"), []).append(record)
    (run_record,) = by_type["run"]
    assert run_record.run.project == "lightning-ddpm"
    assert "model.num_classes=10" in run_record.run.display_name  # the name comes from the overrides
    config = {item.key: json.loads(item.value_json) for r in by_type["config"] for item in r.config.update}
    assert config["config"]["model"]["num_classes"] == 10 and config["config"]["trainer"]["max_steps"] == 6
    history: dict[str, list] = {}
    for record in by_type["history"]:
        for item in record.history.item:
            history.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
    assert len(history["train/loss"]) == 6 and all(math.isfinite(v) for v in history["train/loss"])
    assert len(history["val/loss"]) >= 2
    assert "lr-AdamW" in history and history["train/grad_norm"][0] > 0 and history["train/images_per_sec"][0] > 0
    assert history["samples/grid/captions"][-1] == ["labels: " + " ".join(str(i % 10) for i in range(4))]
    (image,) = history["samples/grid/filenames"][-1]
    assert (offline / "files" / image).is_file() and image.endswith(".png")
    logged = np.asarray(Image.open(offline / "files" / image).convert("RGB"))  # wandb cast floats in [0, 1]: black
    ours = np.asarray(Image.open(sorted((run_dir / "samples").glob("step_*.png"))[-1]).convert("RGB"))
    np.testing.assert_array_equal(logged, ours)
    # The same monitor keys reach the csv logger.
    with (run_dir / "csv" / "metrics.csv").open() as f:
        columns = set(csv.DictReader(f).fieldnames or [])
    assert {"train/grad_norm", "train/images_per_sec"} <= columns


@pytest.mark.slow
def test_grid_multirun_gives_each_job_its_folder_and_ends_with_a_summary(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = train("-m", *TINY_RUN, "callbacks.sample_grid=null", "optim.lr=1e-4,3e-4", f"hydra.sweep.dir={sweep}",
                   extra_env=wandb_dirs(tmp_path))  # fmt: skip
    for job, lr in [("0", 1e-4), ("1", 3e-4)]:
        config = yaml.safe_load((sweep / job / "config.yaml").read_text())
        assert config["optim"]["lr"] == pytest.approx(lr)
        assert (sweep / job / "ema.pt").is_file()
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["job"] for r in rows) == ["0", "1"] and {r["status"] for r in rows} == {"COMPLETED"}
    losses = [float(r["val/loss"]) for r in rows]
    assert losses == sorted(losses) and all(math.isfinite(v) for v in losses)  # best first
    assert "Sweep summary" in result.stdout and "optim.lr" in result.stdout


@pytest.mark.slow
def test_optuna_sweep_runs_two_trials_into_sqlite(tmp_path: Path) -> None:
    import optuna

    sweep = tmp_path / "study"
    tiny = [o for o in TINY_RUN if not o.startswith("data.batch_size")]  # a value given here is not searched
    train("hparams_search=optuna", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep}", *tiny,
          "callbacks.sample_grid=null", extra_env=wandb_dirs(tmp_path))  # fmt: skip
    study = optuna.load_study(study_name="ddpm", storage=f"sqlite:///{sweep}/optuna.db")
    trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(trials) == 2 and all(math.isfinite(t.value) for t in trials)
    assert set(trials[0].params) == {"optim.lr", "data.batch_size", "ema.decay", "model.dropout", "optim.warmup_steps"}
    jobs = sorted(p.parent for p in sweep.glob("*/config.yaml"))
    assert len(jobs) == 2
    values = sorted(json.loads((job / "result.json").read_text())["val/loss"] for job in jobs)
    assert values == pytest.approx(sorted(t.value for t in trials))
    assert (sweep / "summary.csv").is_file()
    # The same command again continues the study (README: "sqlite: rerun continues"): a third trial, in its own folder
    train("hparams_search=optuna", "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={sweep}", *tiny,
          "callbacks.sample_grid=null", extra_env=wandb_dirs(tmp_path))  # fmt: skip
    study = optuna.load_study(study_name="ddpm", storage=f"sqlite:///{sweep}/optuna.db")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert study.trials[2].params != study.trials[0].params  # not the seeded sampler's first draw again (a replay)
    assert len(list(sweep.glob("*/config.yaml"))) == 3
    assert len((sweep / "summary.csv").read_text().splitlines()) == 1 + 3


@pytest.mark.slow
def test_lr_find_plots_suggests_and_applies(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train(*TINY_RUN, "trainer.val_check_interval=1000", "tune=lr_find", "tune.lr_find.num_steps=30",
                   "tune.apply=true", f"hydra.run.dir={run_dir}", extra_env=wandb_dirs(tmp_path))  # fmt: skip
    assert (run_dir / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((run_dir / "lr_find.json").read_text())
    assert len(record["lr"]) == len(record["loss"]) == 30
    assert record["lr"][0] == pytest.approx(1e-7) and record["lr"] == sorted(record["lr"])
    assert record["suggested_lr"] == pytest.approx(record["lr_at_min"] / 10)
    assert "suggested optim.lr=" in result.stdout
    config = yaml.safe_load((run_dir / "config.yaml").read_text())  # tune.apply: the run trains with it
    assert config["optim"]["lr"] == pytest.approx(record["suggested_lr"], rel=1e-2)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def test_slurm_launcher_composes_and_matches_the_plugin_schema() -> None:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    overrides = ["hydra/launcher=slurm", "trainer.devices=8", "trainer.num_nodes=2"]
    cfg = compose("train", overrides, return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    merged = OmegaConf.merge(OmegaConf.structured(SlurmQueueConf), launcher)  # raises on an unknown key
    assert merged._target_.endswith("SlurmLauncher")
    assert (merged.nodes, merged.gpus_per_node, merged.tasks_per_node) == (2, 8, 8)
    assert merged.timeout_min > 0 and "partition" in merged


def test_optuna_search_space_and_storage_compose() -> None:
    cfg = compose("train", ["hparams_search=optuna"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "minimize"
    assert set(sweeper.params) == {"optim.lr", "data.batch_size", "ema.decay", "model.dropout", "optim.warmup_steps"}
    assert sweeper.storage == f"sqlite:///multirun/optuna/{sweeper.study_name}/optuna.db"


def test_summary_sorts_best_first_and_tolerates_failures(tmp_path: Path) -> None:
    for job, value, status in [("0", 0.5, "COMPLETED"), ("1", 0.2, "COMPLETED"), ("2", None, "FAILED")]:
        (tmp_path / job).mkdir()
        result = {"overrides": [f"optim.lr={job}e-4"], "status": status, "val/loss": value}
        (tmp_path / job / "result.json").write_text(json.dumps(result))
    rows = collect(tmp_path, "val/loss")
    assert [r["job"] for r in rows] == ["1", "0", "2"] and rows[0]["optim.lr"] == "1e-4"
    assert [r["job"] for r in collect(tmp_path, "val/loss", maximize=True)] == ["0", "1", "2"]
    assert format_table(rows).splitlines()[0].split() == ["job", "optim.lr", "val/loss", "status", "error"]


def test_eta_and_lr_find_debiasing() -> None:
    assert eta_seconds((0.0, 100), now=10.0, step=200, max_steps=1100) == pytest.approx(90.0)
    assert eta_seconds(None, now=1.0, step=5, max_steps=10) is None
    # Lightning's smoothed loss of a constant 1.0 loss: running mean debiased by 1 - 0.98**(i + 2).
    lightning = [(1 - 0.98 ** (i + 1)) / (1 - 0.98 ** (i + 2)) for i in range(5)]
    assert unbias(lightning) == pytest.approx([1.0] * 5)


def wandb_run(run_dir: Path) -> dict[str, list]:
    """The records of the one offline W&B run under `run_dir`, by type."""
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    by_type: dict[str, list] = {}
    for record in wandb_records(next(offline.glob("*.wandb"))):
        by_type.setdefault(record.WhichOneof("record_type"), []).append(record)
    return by_type


@pytest.mark.slow
def test_checkpoints_keep_the_wandb_run_and_a_failure_after_fit_is_a_failed_run(tmp_path: Path) -> None:
    """Every checkpoint keeps its W&B run's id (a requeue continues that run: below); a job that failed after fit
    (here: no step taken, max_time 0) was finished in W&B as a success before the failure."""
    first, failed = tmp_path / "first", tmp_path / "failed"
    wandb = ["logger=[csv,wandb]"]
    train(*TINY_RUN, *wandb, "trainer.max_steps=3", f"hydra.run.dir={first}", extra_env=wandb_dirs(tmp_path))
    (one,) = wandb_run(first)["run"]
    assert torch.load(first / "checkpoints" / "last.ckpt", weights_only=True)["wandb_run_id"] == one.run.run_id
    result = train(*TINY_RUN, *wandb, "+trainer.max_time=00:00:00:00", f"hydra.run.dir={failed}", check=False,
                   extra_env=wandb_dirs(tmp_path))  # fmt: skip
    assert result.returncode == 1 and json.loads((failed / "result.json").read_text())["status"] == "FAILED"
    assert [r.exit.exit_code for r in wandb_run(failed)["exit"]] == [1]


@pytest.mark.parametrize(
    ("node", "in_place", "continued"),
    [
        ({"mode": "online", "name": "mine"}, True, True),  # a requeue: the same run, the name given kept
        ({"mode": "online"}, False, False),  # a resume into a new folder: a branch, its own run
        ({"mode": "offline"}, True, False),  # wandb sync keeps only the later of two offline folders of one id
        ({"mode": "online", "id": "chosen"}, True, False),  # the user's id stands
    ],
)
def test_a_requeue_continues_its_wandb_run_online(node: dict, in_place: bool, continued: bool) -> None:
    from ddpm.sweep import continue_wandb_run

    cfg = OmegaConf.create({"logger": {"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger", **node}}})
    continue_wandb_run(cfg, "abc123", in_place=in_place)
    wandb = cfg.logger.wandb
    assert (wandb.get("id") == "abc123" and wandb.get("resume") == "allow") is continued
    assert wandb.get("name") == node.get("name")
