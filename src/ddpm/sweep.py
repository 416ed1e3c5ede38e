"""Experiment bookkeeping: W&B run names and groups from Hydra, the sweep summary table.

`SweepSummary` is a Hydra callback (conf/train.yaml, `hydra.callbacks.summary`). Each job writes `result.json` (its
overrides, status, objective and, for a failed job, the error on one line and its traceback) into its own output
folder, on whichever machine runs it, so the summary works for every launcher. In a multirun each job's end also
rewrites `summary.csv` in the sweep directory from every `result.json` there (best first, failed jobs last with
their error), and the multirun's end writes it again and prints it: the table exists however the sweep ends.

Exit status of a sweep with failed jobs: Hydra's BasicSweeper (`-m a=1,2`) runs every job of its batch, then
re-raises the first failed job's error (hydra/_internal/core_plugins/basic_sweeper.py: `r.return_value` of a
FAILED JobReturn, hydra/core/utils.py), before the callbacks' `on_multirun_end`: the sweep exits 1, and this
callback prints the table when the process exits. An Optuna study (ddpm.optuna_sweeper) records a failed trial
and goes on: it exits 0 unless `hydra.sweeper.max_failures` is reached or no trial completed.
"""

import atexit
import csv
import io
import json
import math
import os
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from ddpm.atomic import atomic_write_text
from ddpm.job_end import RESULT_FILE, keeps_finished_record, write_status
from ddpm.ranks import first_process

SUMMARY_FILE = "summary.csv"
SHOWN_CHARS = 70  # characters of a cell (an error) in the printed table; summary.csv has all


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
            node.name = automatic_name(hydra)
        if node.get("group") is None and hydra.mode == RunMode.MULTIRUN:
            node.group = str(hydra.sweep.dir)  # every job of one sweep shares it


def automatic_name(hydra: Any) -> str:
    """A W&B run's name where `logger.wandb.name` is null: the command line's overrides, else the run folder's."""
    return hydra.job.override_dirname or Path(hydra.runtime.output_dir).name


def continue_wandb_run(cfg: DictConfig, run_id: str | None, *, in_place: bool) -> None:
    """A resume in place (a requeued job, `ckpt_path` inside the run folder) continues its checkpoint's W&B run
    (`run_id`, ddpm.job_end.KeepWandbRun) where `logger.wandb.id` is null and W&B runs online; before, each requeue
    began a new run, splitting the curves. A resume into a new folder (a branch) starts its own run, as does an
    offline one (`wandb sync` of two offline folders of one id keeps only the later). The name the run started
    with stays, unless `logger.wandb.name` is given."""
    node = (cfg.get("logger") or {}).get("wandb")
    if node is None or run_id is None or not in_place or node.get("id") is not None:
        return
    if (node.get("mode") or os.environ.get("WANDB_MODE")) in ("offline", "dryrun", "disabled"):
        return
    with open_dict(node):
        automatic = HydraConfig.initialized() and node.get("name") == automatic_name(HydraConfig.get())
        node.id, node.resume, node.name = run_id, "allow", None if automatic else node.get("name")


def error_line(error: BaseException) -> str:
    """`Type: message` on one line (a message's lines joined), for result.json, summary.csv and the logs."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def write_result(folder: Path, overrides: list[str], job_return: JobReturn, objective: str) -> Path:
    """`folder/result.json`: overrides, status, the objective's value; a failed job's error and traceback."""
    completed = job_return.status == JobStatus.COMPLETED
    value = job_return._return_value  # the public property re-raises a failed job's error
    error = value if isinstance(value, BaseException) and not completed else None
    folder.mkdir(parents=True, exist_ok=True)
    return write_status(folder, overrides, job_return.status.name, objective,
                        value=float(value) if completed and isinstance(value, int | float) else None,
                        error=error_line(error) if error is not None else None,
                        trace="".join(traceback.format_exception(error)) if error is not None else None)  # fmt: skip


class SweepSummary(Callback):
    """Writes each job's result.json; in a multirun, summary.csv (best first) after every job and at the end."""

    def __init__(self, *, objective: str = "val/loss", direction: str = "minimize") -> None:
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"hydra.callbacks.summary.direction={direction!r} must be minimize or maximize")
        self.objective, self.direction = objective, direction
        self._sweep_dir: Path | None = None  # set while a multirun runs

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Before the sweeper starts: Optuna's sqlite storage lives in the sweep directory.
        self._sweep_dir = Path(config.hydra.sweep.dir)
        self._sweep_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self._report_stopped)  # the sweeper raised: Hydra exits before on_multirun_end

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not first_process():  # each process of a DDP job (srun's tasks, Lightning's launches) ends a Hydra job
            return
        hydra, folder = HydraConfig.get(), Path(HydraConfig.get().runtime.output_dir)
        if not keeps_finished_record(folder, job_return.status.name) or hydra.mode == RunMode.MULTIRUN:
            write_result(folder, list(hydra.overrides.task), job_return, self.objective)
        if hydra.mode == RunMode.MULTIRUN:
            self.write(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._report_stopped)
        self._sweep_dir = None
        self.report(Path(config.hydra.sweep.dir), stopped=False)

    def _report_stopped(self) -> None:
        if self._sweep_dir is not None:
            self.report(self._sweep_dir, stopped=True)

    def write(self, sweep_dir: Path) -> list[dict[str, Any]]:
        """summary.csv from the result.json files under `sweep_dir` (atomic: jobs may end at the same time)."""
        rows = collect(sweep_dir, self.objective, maximize=self.direction == "maximize")
        if rows:
            write_summary(rows, sweep_dir / SUMMARY_FILE)
        return rows

    def report(self, sweep_dir: Path, *, stopped: bool) -> None:
        """Write summary.csv and print it, with a line on the failed jobs."""
        rows = self.write(sweep_dir)
        if not rows:
            return
        path = sweep_dir / SUMMARY_FILE
        how = "; the sweep stopped with the error above" if stopped else ""
        print(f"\nSweep summary ({self.objective}, {self.direction}; best first{how}): {path}")
        print(format_table(rows))
        failed = [row["job"] for row in rows if row["status"] == JobStatus.FAILED.name]
        if failed:
            print(f"{len(failed)} of {len(rows)} jobs failed ({', '.join(failed)}): {path.name} gives each one's "
                  f"error, its {RESULT_FILE} the traceback")  # fmt: skip
        if unfinished := [
            f"{row['job']} {row['status']}" for row in rows if row["status"] not in ("COMPLETED", "FAILED")
        ]:
            print(f"{len(unfinished)} of {len(rows)} jobs did not finish ({', '.join(unfinished)})")


def collect(sweep_dir: Path, objective: str, *, maximize: bool = False) -> list[dict[str, Any]]:
    """One row per job under `sweep_dir`: job folder, each override, objective, status, error; best first."""
    rows = []
    for path in sorted(sweep_dir.rglob(RESULT_FILE)):
        if any(part.startswith("replaced-") for part in path.relative_to(sweep_dir).parts):
            continue  # an earlier sweep's jobs, moved aside by overwrite=true (ddpm.run_dir)
        result = json.loads(path.read_text())
        overrides = dict(item.split("=", 1) for item in result["overrides"] if "=" in item)
        value = result.get(objective)
        rows.append({"job": str(path.parent.relative_to(sweep_dir)), **overrides, objective: value,
                     "status": result["status"], "error": result.get("error")})  # fmt: skip

    def key(row: dict[str, Any]) -> tuple:
        """Completed jobs with a value best first, then completed ones without, then failed ones; each in job
        order (the number, not the text: 2 before 10)."""
        value = row[objective]
        valued = value is not None and math.isfinite(value)
        number = tuple(int(part) if part.isdigit() else math.inf for part in Path(row["job"]).parts)
        return (row["status"] != "COMPLETED", not valued, (-value if maximize else value) if valued else 0, number)

    return sorted(rows, key=key)


def write_summary(rows: list[dict[str, Any]], path: Path) -> Path:
    columns = list(dict.fromkeys(column for row in rows for column in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write_text(path, text.getvalue())  # whole: jobs of a parallel launcher may end together


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows as an aligned plain-text table (readable in SLURM logs and CI output); long errors cut short."""
    columns = list(dict.fromkeys(column for row in rows for column in row))
    cells = [columns] + [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in cells)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
