"""Training cost of the MNIST recipes against experiment=mnist, as CPU time side by side:

    python benchmarks/recipe_cost.py --repeats 3
    python benchmarks/recipe_cost.py --rows after,vae,latent --latents latents/mnist --repeats 3

Rows, each a real `python train.py` subprocess in strict float32 eager (`trainer.precision=32-true compile=false`),
same seed, no validation, grids or checkpoints: `before`, experiment=mnist's recipe at 2b99e39 written out as
overrides (BEFORE); `after`, experiment=mnist as committed; `vae`, experiment=mnist_vae; `latent`,
experiment=mnist_latent on the encoded folder --latents. Figure: the median of the run's logged
`train/images_per_sec` after the first --skip logged values; "vs first": each repeat's ratio to the first row in
the same repeat. Every row trains batches of 64 (--batch-size), so a step's cost is 1 / images/s. With after, vae
and latent: the latent recipe's share of experiment=mnist's training compute, per repeat, (vae steps / vae images/s
+ latent steps / latent images/s) / (mnist steps / mnist images/s), with each experiment's max_steps.
--smoke: 6 steps of 8 images.
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
GRID = {"vae": "callbacks.vae_grid=null"}  # the cost the goal is stated in, and nothing but steps


def data(row: str, args: argparse.Namespace) -> list[str]:
    """The row's data: the MNIST files (digits under --smoke without them), or the encoded --latents."""
    if row == "latent":
        return [f"data.root={args.latents}"]
    if Path(args.data_root).is_dir():
        return [f"data.root={args.data_root}"]
    return ["data=digits", *(["data.image_size=32", "data.channels=1"] if row == "vae" else [])]


def latent_share(runs: dict[str, list[float]]) -> dict | None:
    """Per repeat: the latent recipe's training compute (VAE + latent steps) / experiment=mnist's."""
    if not {"after", "vae", "latent"} <= runs.keys():
        return None
    steps = {row: common.compose("train", [f"experiment={EXPERIMENTS[row]}"]).trainer.max_steps for row in runs}
    shares = [(steps["vae"] / v + steps["latent"] / lat) / (steps["after"] / a)
              for a, v, lat in zip(runs["after"], runs["vae"], runs["latent"], strict=True)]  # fmt: skip
    return {"share": common.stats(shares), "steps": {row: steps[row] for row in ("after", "vae", "latent")}}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--batch-size", type=int, default=64, help="data.batch_size (experiment=mnist: 64)")
    p.add_argument("--skip", type=int, default=4, help="logged images/s values left out at the start")
    p.add_argument("--log-every", type=int, default=5, help="trainer.log_every_n_steps")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX files")
    p.add_argument("--latents", help="the encoded folder of the latent row (python -m ddpm.data.encode ... out=)")
    common.add_arguments(p, rows=list(ROWS), default_rows=["before", "after"], repeats=3)
    return p


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
    if "latent" in run.rows and not args.latents:
        raise SystemExit("--rows latent needs --latents <encoded folder> (python -m ddpm.data.encode ... out=)")
    with tempfile.TemporaryDirectory(prefix="recipe_cost_") as tmp:

        def measure(row: str, repeat: int) -> float:
            out = Path(tmp) / f"{row}_{repeat}"
            grid = GRID.get(row, "callbacks.sample_grid=null")
            common.entry_point("train.py", [f"experiment={EXPERIMENTS[row]}", *data(row, args), *FIXED, grid,
                                            *(f"{k}={v}" for k, v in ROWS[row].items()),
                                            f"trainer.max_steps={args.steps}", f"hydra.run.dir={out}",
                                            f"data.batch_size={args.batch_size}",
                                            f"trainer.log_every_n_steps={args.log_every}"], args.threads)  # fmt: skip
            return images_per_sec(out, args.skip)

        runs = common.run_interleaved(run.rows, args.repeats, measure, lambda v: f"{v:.1f} images/s")
    ratios = common.paired_ratios(runs, run.rows[0])
    rows = {name: {"images_per_sec": common.stats(v), "vs_first": ratios[name]} for name, v in runs.items()}
    print(common.table(["row (our Trainer, float32 eager)", "images/s", f"vs {run.rows[0]}"],
                       [[n, common.figure(r["images_per_sec"], ".1f"), common.figure(r["vs_first"], ".3f")]
                        for n, r in rows.items()]))  # fmt: skip
    share = latent_share(runs)
    if share:
        print(
            f"mnist_latent's training compute (VAE {share['steps']['vae']} + latent {share['steps']['latent']} "
            f"steps) / experiment=mnist's ({share['steps']['after']} steps): {common.figure(share['share'], '.3f')}"
        )
    report = {"rows": rows, "before": BEFORE, "fixed": FIXED, "steps": args.steps, "batch_size": args.batch_size,
              "latent_share": share}  # fmt: skip
    run.write(report, "recipe_cost_cpu.json" if set(run.rows) <= {"before", "after"} else "recipe_cost_latent_cpu.json")
    return report


if __name__ == "__main__":
    main()
