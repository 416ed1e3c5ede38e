"""Training cost of the MNIST recipes against experiment=mnist: each row a real `python train.py` in strict float32
eager, interleaved; the figure is the median logged train/images_per_sec; with after, vae and latent rows, the latent
recipe's share of experiment=mnist's training compute, each run at its experiment's steps and batch size
(docs/latent.md). Rows and columns: docs/benchmarks.md.

    python benchmarks/recipe_cost.py --rows after,vae,latent --latents latents/mnist --repeats 3
"""

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

import common

SMOKE = {"steps": 6, "batch_size": 8, "skip": 1, "log_every": 1}
BEFORE = {  # conf/experiment/mnist.yaml at 2b99e39, which the study started from (the group first, then its keys)
    "diffusion": "linear", "diffusion.prediction": "eps", "diffusion.loss_weighting": "uniform",
    "diffusion.p_uncond": "0.1", "optim.lr": "1e-3", "optim.warmup_steps": "200", "optim.decay": "none",
    "ema.decay": "0.999", "model.dropout": "0.0", "model.scale_shift": "false",
}  # fmt: skip
ROWS = {"before": BEFORE, "after": {}, "vae": {}, "latent": {}}
EXPERIMENTS = {"before": "mnist", "after": "mnist", "vae": "mnist_vae", "latent": "mnist_latent"}
FIXED = ["trainer.precision=32-true", "compile=false", "trainer.limit_val_batches=0", "callbacks.checkpoint=null"]


def overrides(row: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The row's train.py command: its experiment and data (MNIST, digits under --smoke without it, or the encoded
    --latents), FIXED, no grid (the goal's cost is steps alone), the row's keys, the sizes."""
    if row == "latent":
        data = [f"data.root={args.latents}"]
    elif Path(args.data_root).is_dir():
        data = [f"data.root={args.data_root}"]
    else:
        data = ["data=digits", *(["data.image_size=32", "data.channels=1"] if row == "vae" else [])]
    grid = "callbacks.vae_grid=null" if row == "vae" else "callbacks.sample_grid=null"
    return [f"experiment={EXPERIMENTS[row]}", *data, *FIXED, grid, *(f"{k}={v}" for k, v in ROWS[row].items()),
            f"trainer.max_steps={args.steps}", f"hydra.run.dir={out}", f"trainer.log_every_n_steps={args.log_every}",
            *([f"data.batch_size={args.batch_size}"] if args.batch_size else [])]  # fmt: skip


def images_per_sec(out: Path, skip: int) -> float:
    """The median logged train/images_per_sec of the run in `out` after the first `skip` values."""
    (metrics,) = out.glob("csv/**/metrics.csv")
    with metrics.open() as f:
        values = [float(r["train/images_per_sec"]) for r in csv.DictReader(f) if r.get("train/images_per_sec")]
    if len(values) <= skip:
        raise SystemExit(f"{metrics}: {len(values)} logged images/s values, need more than --skip {skip}")
    return statistics.median(values[skip:])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--batch-size", type=int, default=None, help="data.batch_size of every run (default: its own)")
    p.add_argument("--skip", type=int, default=4, help="logged images/s values left out at the start")
    p.add_argument("--log-every", type=int, default=5, help="trainer.log_every_n_steps")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX files")
    p.add_argument("--latents", help="the encoded folder of the latent row (python -m ddpm.data.encode ... out=)")
    common.add_arguments(p, rows=list(ROWS), default_rows=["before", "after"], repeats=3)
    run = common.start(__file__, p, argv, rows=ROWS, smoke=SMOKE)
    args = run.args
    if "latent" in run.rows and not args.latents:
        raise SystemExit("--rows latent needs --latents <encoded folder> (python -m ddpm.data.encode ... out=)")
    with tempfile.TemporaryDirectory(prefix="recipe_cost_") as tmp:

        def measure(row: str, repeat: int) -> float:
            common.entry_point("train.py", overrides(row, args, Path(tmp) / f"{row}_{repeat}"), args.threads)
            return images_per_sec(Path(tmp) / f"{row}_{repeat}", args.skip)

        runs = common.run_interleaved(run.rows, args.repeats, measure, lambda v: f"{v:.1f} images/s")
    ratios, share = common.paired_ratios(runs, run.rows[0]), None
    rows = {name: {"images_per_sec": common.stats(v), "vs_first": ratios[name]} for name, v in runs.items()}
    print(common.table(["row (our Trainer, float32 eager)", "images/s", f"vs {run.rows[0]}"],
                       [[n, common.figure(r["images_per_sec"], ".1f"), common.figure(r["vs_first"], ".3f")]
                        for n, r in rows.items()]))  # fmt: skip
    if {"after", "vae", "latent"} <= runs.keys():  # per repeat: (VAE + latent images' time) / experiment=mnist's
        configs = {r: common.compose("train", [f"experiment={EXPERIMENTS[r]}"]) for r in ("after", "vae", "latent")}
        images = {r: c.trainer.max_steps * c.data.batch_size for r, c in configs.items()}  # the recipes' own
        share = {"share": common.stats((images["vae"] / v + images["latent"] / lat) / (images["after"] / a) for a, v,
                                       lat in zip(runs["after"], runs["vae"], runs["latent"], strict=True)),
                 "steps": {r: c.trainer.max_steps for r, c in configs.items()},
                 "batch_size": {r: c.data.batch_size for r, c in configs.items()}}  # fmt: skip
        print(
            "mnist_latent's training compute (VAE {vae} + latent {latent} images) / experiment=mnist's ({after} "
            "images): {share}".format(**images, share=common.figure(share["share"], ".3f"))
        )
    report = {"rows": rows, "before": BEFORE, "fixed": FIXED, "steps": args.steps, "batch_size": args.batch_size,
              "latent_share": share}  # fmt: skip
    run.write(report, "recipe_cost_cpu.json" if set(run.rows) <= {"before", "after"} else "recipe_cost_latent_cpu.json")
    return report


if __name__ == "__main__":
    main()
