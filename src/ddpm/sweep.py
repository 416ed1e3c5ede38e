"""Experiment bookkeeping: W&B run names and groups from Hydra, and the end-of-sweep summary table.

`SweepSummary` is a Hydra callback (conf/train.yaml, `hydra.callbacks.summary`). Each job writes
`result.json` (its overrides, status and objective) into its own output folder, on whichever machine
runs it, so the summary works for every launcher; at the end of a multirun the callback collects the
`result.json` files under the sweep directory into `summary.csv`, sorted best first, and prints it.
"""

import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

RESULT_FILE = "result.json"
SUMMARY_FILE = "summary.csv"


def name_wandb_run(cfg: DictConfig) -> None:
    """Fill `logger.wandb.name` (the run's overrides) and `.group` (the sweep directory) where they are null.

    Done here rather than with `${hydra:...}` in conf/logger/wandb.yaml, so the logger config composes
    without Hydra's runtime (tests, notebooks) and a `python train.py` without overrides still gets a name.
    """
    node = (cfg.get("logger") or {}).get("wandb")
    if node is None or not HydraConfig.initialized():
        return
    hydra = HydraConfig.get()
    with open_dict(node):
        if node.get("name") is None:
            node.name = hydra.job.override_dirname or Path(hydra.runtime.output_dir).name
        if node.get("group") is None and hydra.mode == RunMode.MULTIRUN:
            node.group = str(hydra.sweep.dir)  # every job of one sweep shares it


def finish_wandb(loggers: list[Any]) -> None:
    """Close the W&B run, so the next job of an in-process multirun starts its own (WandbLogger does not)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger.experiment.finish()


class SweepSummary(Callback):
    """Writes each job's result.json; after a multirun, summary.csv (best first) in the sweep directory."""

    def __init__(self, *, objective: str = "val/loss", direction: str = "minimize") -> None:
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"hydra.callbacks.summary.direction={direction!r} must be minimize or maximize")
        self.objective, self.direction = objective, direction

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Before the sweeper starts: Optuna's sqlite storage lives in the sweep directory.
        Path(config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        hydra = HydraConfig.get()
        completed = job_return.status == JobStatus.COMPLETED
        value = job_return.return_value if completed else None
        result = {
            "overrides": list(hydra.overrides.task),
            "status": job_return.status.name,
            self.objective: float(value) if isinstance(value, int | float) else None,
        }
        path = Path(hydra.runtime.output_dir) / RESULT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir, self.objective, maximize=self.direction == "maximize")
        if not rows:
            return
        path = write_summary(rows, sweep_dir / SUMMARY_FILE)
        print(f"\nSweep summary ({self.objective}, {self.direction}; best first): {path}")
        print(format_table(rows))


def collect(sweep_dir: Path, objective: str, *, maximize: bool = False) -> list[dict[str, Any]]:
    """One row per job under `sweep_dir`: job folder, each override, status, objective; best first."""
    rows = []
    for path in sorted(sweep_dir.rglob(RESULT_FILE)):
        if any(part.startswith("replaced-") for part in path.relative_to(sweep_dir).parts):
            continue  # an earlier sweep's jobs, moved aside by overwrite=true (ddpm.run_dir)
        result = json.loads(path.read_text())
        overrides = dict(item.split("=", 1) for item in result["overrides"] if "=" in item)
        value = result.get(objective)
        rows.append({"job": str(path.parent.relative_to(sweep_dir)), **overrides, objective: value,
                     "status": result["status"]})  # fmt: skip

    def key(row: dict[str, Any]) -> float:
        value = row[objective]
        if value is None or not math.isfinite(value):
            return math.inf
        return -value if maximize else value

    return sorted(rows, key=key)


def write_summary(rows: list[dict[str, Any]], path: Path) -> Path:
    columns = list(dict.fromkeys(column for row in rows for column in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows as an aligned plain-text table (readable in SLURM logs and CI output)."""
    columns = list(dict.fromkeys(column for row in rows for column in row))
    cells = [columns] + [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in cells)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if isinstance(value, float) else str(value)
