"""Training cost of experiment=mnist's recipe before and after the quality study (issue 18): equal compute?

    python benchmarks/recipe_cost.py --repeats 3

Rows, each a real `python train.py experiment=mnist` subprocess in strict float32 eager (`trainer.precision=32-true
compile=false`: the cost the goal is stated in, on any CPU), same seed, no validation, grid or checkpoints:
- `before`: the recipe at 2b99e39, written out as overrides (DDPM's linear schedule, eps prediction, uniform
  weighting, p_uncond 0.1, lr 1e-3, warm-up 200, constant LR, EMA 0.999, dropout 0, conditioning added, not FiLM);
- `after`: experiment=mnist as committed (conf/experiment/mnist.yaml).
Figure: the median of the run's logged `train/images_per_sec` (our Trainer: step, EMA, callbacks) after the first
--skip logged values (start-up, first steps). Rows run interleaved (AB BA ..., benchmarks/common.py); "vs before"
is each repeat's ratio to `before` in the same repeat. Both recipes train the same network (unet_mnist) for the
same steps at the same batch, so the cost per image is the whole cost ratio. JSON with the provenance.
--smoke: 6 steps of 8 images, one repeat.
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

REPO = common.REPO
SMOKE = {"steps": 6, "batch_size": 8, "skip": 1, "log_every": 1}
BEFORE = {  # conf/experiment/mnist.yaml at 2b99e39, which the study started from (the group first, then its keys)
    "diffusion": "linear",
    "diffusion.prediction": "eps",
    "diffusion.loss_weighting": "uniform",
    "diffusion.p_uncond": "0.1",
    "optim.lr": "1e-3",
    "optim.warmup_steps": "200",
    "optim.decay": "none",
    "ema.decay": "0.999",
    "model.dropout": "0.0",
    "model.scale_shift": "false",
}
ROWS = {"before": BEFORE, "after": {}}
FIXED = [  # the cost the goal is stated in, and nothing but steps
    "trainer.precision=32-true",
    "compile=false",
    "trainer.limit_val_batches=0",
    "callbacks.sample_grid=null",
    "callbacks.checkpoint=null",
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--batch-size", type=int, default=64, help="data.batch_size (experiment=mnist: 64)")
    p.add_argument("--skip", type=int, default=4, help="logged images/s values left out at the start")
    p.add_argument("--log-every", type=int, default=5, help="trainer.log_every_n_steps")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX files")
    common.add_arguments(p, rows=list(ROWS), repeats=3)
    return p


def command(row: str, args: argparse.Namespace, out: Path) -> list[str]:
    data = (
        [f"data.root={args.data_root}"]
        if Path(args.data_root).is_dir()
        else ["data=digits"]  # --smoke without MNIST: the same shapes (digits resized to 32x32)
    )
    overrides = [f"{k}={v}" for k, v in ROWS[row].items()]
    return [
        sys.executable, "train.py", "experiment=mnist", *data, *overrides, *FIXED,
        f"trainer.max_steps={args.steps}", f"data.batch_size={args.batch_size}",
        f"trainer.log_every_n_steps={args.log_every}", f"hydra.run.dir={out}",
    ]  # fmt: skip


def images_per_sec(out: Path, skip: int) -> float:
    """The median logged train/images_per_sec of the run in `out` after the first `skip` values."""
    (metrics,) = out.glob("csv/**/metrics.csv")
    with metrics.open() as f:
        values = [float(r["train/images_per_sec"]) for r in csv.DictReader(f) if r.get("train/images_per_sec")]
    if len(values) <= skip:
        raise SystemExit(f"{metrics}: {len(values)} logged images/s values, need more than --skip {skip}")
    return statistics.median(values[skip:])


def main(argv: list[str] | None = None) -> dict:
    run = common.start(__file__, parser(), argv, rows=ROWS, smoke=SMOKE)
    args = run.args
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    with tempfile.TemporaryDirectory(prefix="recipe_cost_") as tmp:

        def measure(row: str, repeat: int) -> float:
            out = Path(tmp) / f"{row}_{repeat}"
            done = subprocess.run(command(row, args, out), cwd=REPO, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{row}: train.py exited {done.returncode}\n{done.stderr[-3000:]}")
            return images_per_sec(out, args.skip)

        runs = common.run_interleaved(run.rows, args.repeats, measure, lambda v: f"{v:.1f} images/s")
    ratios = common.paired_ratios(runs, run.rows[0])
    rows = {name: {"images_per_sec": common.stats(v), "vs_first": ratios[name]} for name, v in runs.items()}
    print(f"\n| row (our Trainer, float32 eager) | images/s | vs {run.rows[0]} |\n|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {common.figure(r['images_per_sec'], '.1f')} | {common.figure(r['vs_first'], '.3f')} |")
    report = {"rows": rows, "before": BEFORE, "fixed": FIXED, "steps": args.steps, "batch_size": args.batch_size}
    run.write(report, "recipe_cost_cpu.json")
    return report


if __name__ == "__main__":
    main()
