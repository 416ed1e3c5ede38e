"""Soak: does a long training run's resident memory grow? (issue 36: a benchmark, not a timed test). Runs the default
experiment (`python train.py`: digits) for --steps steps with validation, checkpoints and grids, reads the resident
memory of the process and its children and the step it has logged every --interval s, and reports the growth from
the warm-up to the end of training (docs/reliability.md). Extra Hydra overrides follow `--`.

    python benchmarks/soak.py --steps 20000
"""

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

SMOKE = {"steps": 60, "val_every": 20, "ckpt_every": 30, "grid_every": 30, "interval": 0.5}
SMOKE_OVERRIDES = ["data.limit=256", "data.batch_size=16", "trainer.log_every_n_steps=5",
                   "+logger.csv.flush_logs_every_n_steps=5", "callbacks.sample_grid.num_samples=4",
                   "callbacks.sample_grid.sampler.steps=4"]  # fmt: skip


def rss_mb(pid: int) -> tuple[float, int]:
    """Summed VmRSS (MB) of `pid` and its descendants, and how many processes that is (0 if `pid` is gone)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the parent pid: the field after the state, after the name in (...) (which may hold spaces)
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue  # exited meanwhile
    family, total = [pid], 0.0
    for p in family:  # grows while walked: children of children
        family.extend(child for child, parent in parents.items() if parent == p)
    for p in list(family):
        try:
            line = next(x for x in Path(f"/proc/{p}/status").read_text().splitlines() if x.startswith("VmRSS:"))
            total += int(line.split()[1]) / 1024  # kB
        except (OSError, StopIteration):  # exited, or a zombie (no VmRSS)
            family.remove(p)
    return total, len(family)


def logged_step(run_dir: Path) -> int | None:
    """The highest step in the run's csv/metrics.csv (None before its first write, or read mid-write)."""
    try:
        with (run_dir / "csv" / "metrics.csv").open() as f:
            return max((int(r["step"]) for r in csv.DictReader(f) if r.get("step")), default=None)
    except (OSError, ValueError, csv.Error):
        return None


def command(args: argparse.Namespace, device: str, run_dir: Path) -> list[str]:
    return [sys.executable, "train.py", f"trainer.max_steps={args.steps}",
            f"trainer.val_check_interval={args.val_every}",
            f"callbacks.checkpoint.every_n_train_steps={args.ckpt_every}",
            f"callbacks.sample_grid.every_n_steps={args.grid_every}",
            f"trainer.accelerator={'cpu' if device == 'cpu' else 'gpu'}", f"hydra.run.dir={run_dir}",
            *(SMOKE_OVERRIDES if args.smoke else []), *args.overrides]  # fmt: skip


def soak(args: argparse.Namespace, device: str, tmp: Path) -> tuple[list[dict], float]:
    """Run train.py, reading its memory every --interval s; the readings and the wall time."""
    run_dir, log, start, readings = tmp / "run", (tmp / "train.log").open("w"), time.perf_counter(), []
    process = subprocess.Popen(command(args, device, run_dir), cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        while process.poll() is None:
            mb, processes = rss_mb(process.pid)
            step = logged_step(run_dir)
            if step is not None and processes:
                readings.append({"seconds": round(time.perf_counter() - start, 1), "step": step,
                                 "rss_mb": round(mb, 1), "processes": processes})  # fmt: skip
            time.sleep(args.interval)
    finally:  # Ctrl-C or an error here: the run must not go on training unwatched
        if process.poll() is None:
            process.terminate()
            process.wait()
        log.close()
    if process.returncode != 0:
        raise SystemExit(f"train.py exited {process.returncode}:\n{(tmp / 'train.log').read_text()[-3000:]}")
    return readings, time.perf_counter() - start


def growth(readings: list[dict], steps: int, warmup: float) -> dict:
    """The median reading over the last 5% of the steps up to the first reading at the last logged step (training,
    not the export after it) against the median over 5% of the steps from `warmup` of them (one reading wanders by
    tens of MB with the allocator, a median of several does not)."""
    last = readings[-1]["step"] if readings else 0
    training = readings[: next((i for i, r in enumerate(readings) if r["step"] == last), 0) + 1]
    if not any(warmup * steps <= r["step"] < last for r in training):
        raise SystemExit(f"{len(readings)} readings, none after the warm-up: lower --interval or raise --steps")

    def window(low: float, high: float) -> dict:  # the readings in [low, high], else the first at or after low
        inside = [r for r in training if low <= r["step"] <= high] or [next(r for r in training if r["step"] >= low)]
        return {"step": statistics.median(r["step"] for r in inside), "readings": len(inside),
                "rss_mb": round(statistics.median(r["rss_mb"] for r in inside), 1)}  # fmt: skip

    warm, end = window(warmup * steps, (warmup + 0.05) * steps), window(last - 0.05 * steps, last)
    mb = end["rss_mb"] - warm["rss_mb"]
    return {"warm": warm, "end": end, "growth_mb": round(mb, 1), "peak_mb": max(r["rss_mb"] for r in readings),
            "growth_mb_per_1000_steps": round(mb / (end["step"] - warm["step"]) * 1000, 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20_000, help="trainer.max_steps")
    p.add_argument("--val-every", type=int, default=500, help="trainer.val_check_interval")
    p.add_argument("--ckpt-every", type=int, default=500, help="callbacks.checkpoint.every_n_train_steps")
    p.add_argument("--grid-every", type=int, default=1000, help="callbacks.sample_grid.every_n_steps")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between memory readings")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps before growth is counted")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for train.py (after --)")
    common.add_arguments(p, repeats=None, device="cpu")
    run = common.start(__file__, p, argv, smoke=SMOKE)
    args = run.args
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        readings, wall = soak(args, run.device.type, Path(tmp))
    result = growth(readings, args.steps, args.warmup)
    shown = [readings[i] for i in sorted({round(k * (len(readings) - 1) / 20) for k in range(21)})]  # first, last
    print(common.table(["seconds", "step", "RSS MB", "processes"],
                       [[r["seconds"], r["step"], r["rss_mb"], r["processes"]] for r in shown]))  # fmt: skip
    warm, end = result["warm"], result["end"]
    print(f"\nafter warm-up (step {warm['step']}, {warm['rss_mb']} MB) to step {end['step']} ({end['rss_mb']} MB): "
          f"{result['growth_mb']:+} MB, {result['growth_mb_per_1000_steps']:+} MB per 1,000 steps; "
          f"peak {result['peak_mb']} MB; {wall:.0f} s")  # fmt: skip
    report = {**result, "steps": args.steps, "command": command(args, run.device.type, Path("<tmp>/run"))[1:],
              "interval_s": args.interval, "wall_s": round(wall, 1), "readings": readings}  # fmt: skip
    run.write(report, f"soak_{run.device.type}.json")
    return report


if __name__ == "__main__":
    main()
