"""`python sample.py ckpt=...` before and after the sampling defaults of issues 12 and 18, end to end: the real
command, timed.

    python benchmarks/sample_defaults.py --ckpt outputs/<mnist run>/ema.pt --num-samples 64 --repeats 2

Rows, run as `sample.py` subprocesses, interleaved (AB BA ...), each with the same checkpoint, seed, labels
and guidance:
- `before`: what the command ran before issue 12: ancestral DDPM on all T steps, float32, NCHW, batch 256
  (`sampler=ddpm sampler.steps=null precision=32 channels_last=false batch_size=256`);
- `ddpm250`: the default between issues 12 and 18, DDPM respaced to 250 steps (`sampler=ddpm`)
  with today's other defaults;
- `now`: the command with no options: SDE-DPM-Solver++(2M) with 20 steps (conf/sample.yaml, the sampler table's
  fastest within noise of DDPM-1000), `precision=auto`, `channels_last=true`, `batch_size=auto`;
- `now_compile` (optional, --rows): the same with `compile=true`.
images/s is sample.py's own figure (the sampling loop); "wall s" is the whole process (start-up, model load,
outputs). With --num-samples below 256 the `before` batch is --num-samples, which favours `before` on a CPU
(64-image batches are ~1.7x faster per image there than 256): the ratio is then a lower bound.
That the images are as good is the sampler table's and benchmarks/sampling.py's measurement, not this one's.
Rows run interleaved (--repeats, 3 by default; benchmarks/common.py): images/s is the median [min-max], "vs first"
the median [min-max] of each repeat's ratio to the first row's figure in the same repeat. JSON with the provenance.
--smoke: 2 images, 2 sampler steps for every row (`--set sampler.steps=2`), one repeat.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

REPO = common.REPO
SMOKE = {"num_samples": 2}

ROWS = {
    "before": {
        "sampler": "ddpm",
        "sampler.steps": "null",
        "precision": "32",
        "channels_last": "false",
        "batch_size": "256",
    },
    "ddpm250": {"sampler": "ddpm"},
    "now": {},
    "now_compile": {"compile": "true"},
}
PRINTED = re.compile(
    r"(?P<n>\d+) images in (?P<s>[\d.]+) s \((?P<ips>[\d.]+) images/s, (?P<nfe>\d+) network evaluations per batch; "
    r"batch (?P<batch>\d+), precision (?P<precision>\w+)(?P<rest>[^)]*)\)"
)


def run_row(name: str, args: argparse.Namespace, out: Path) -> dict:
    """One `sample.py` subprocess for row `name`; its printed figures and its wall time."""
    overrides = {
        "ckpt": args.ckpt,
        "num_samples": str(args.num_samples),
        "guidance": str(args.guidance),
        "seed": "0",
        "device": args.device,
        "output_dir": str(out),
        "hydra.run.dir": str(out),  # nothing left under outputs/
        **ROWS[name],
    }
    overrides.update(dict(item.split("=", 1) for item in args.set))
    command = [sys.executable, str(REPO / "sample.py"), *(f"{k}={v}" for k, v in overrides.items())]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"row {name}: sample.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found = PRINTED.search(done.stdout)
    if found is None:
        raise SystemExit(f"row {name}: sample.py printed no '<n> images in <s> s' line:\n{done.stdout[-2000:]}")
    seconds = float(found["s"]) or int(found["n"]) / float(found["ips"])  # printed to 0.1 s; images/s to 0.01
    return {
        "images_per_s": int(found["n"]) / seconds,
        "seconds": seconds,
        "wall_s": wall,
        "nfe": int(found["nfe"]),
        "batch": int(found["batch"]),
        "precision": found["precision"],
        "options": found["rest"].strip(", "),
        "overrides": ROWS[name],
    }


def measure(args: argparse.Namespace, names: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        runs = common.run_interleaved(
            names,
            args.repeats,
            lambda name, r: run_row(name, args, Path(tmp) / f"{name}_{r}"),
            lambda r: f"{r['images_per_s']:8.3f} images/s  {r['wall_s']:7.1f} s wall",
        )
    vs = common.paired_ratios({name: [r["images_per_s"] for r in runs[name]] for name in names}, names[0])
    rows = []
    for name in names:
        ips = common.stats(r["images_per_s"] for r in runs[name])
        rows.append(
            {
                "row": name,
                **{k: runs[name][0][k] for k in ("nfe", "batch", "precision", "options")},
                "overrides": ROWS[name],
                "images_per_s": ips["median"],
                "images_per_s_min": ips["min"],
                "images_per_s_max": ips["max"],
                "images_per_s_runs": ips["runs"],
                "seconds_runs": [r["seconds"] for r in runs[name]],
                "wall_s_runs": [r["wall_s"] for r in runs[name]],
                "vs_first": vs[name],
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| row | network calls | batch | precision, options | images/s [min-max] | wall s | vs first [min-max] |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        ips = {"median": r["images_per_s"], "min": r["images_per_s_min"], "max": r["images_per_s_max"]}
        lines.append(
            f"| `{r['row']}` | {r['nfe']} | {r['batch']} | {r['precision']} {r['options']} | "
            f"{common.figure(ips, '.3f')} | {statistics.median(r['wall_s_runs']):.0f} | "
            f"{common.figure(r['vs_first'])}x |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> common.Run:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a run's ema.pt (or any ckpt sample.py reads)")
    parser.add_argument("--num-samples", type=int, default=64, help="images per row and repeat")
    parser.add_argument("--guidance", type=float, default=0.0, help="w (conditional models)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sample.py override for every row, applied last (e.g. sampler.steps=2 to shrink)",
    )
    common.add_arguments(parser, rows=list(ROWS), default_rows=["before", "ddpm250", "now"])
    run = common.start(__file__, parser, argv, rows=ROWS, smoke=SMOKE)
    if run.args.smoke:
        run.args.set = [*run.args.set, "sampler.steps=2"]
    if not Path(run.args.ckpt).exists():
        parser.error(f"--ckpt {run.args.ckpt} does not exist: pass a run's ema.pt (python train.py writes one)")
    if any("=" not in item for item in run.args.set):
        parser.error("--set takes KEY=VALUE")
    return run


def main(argv: list[str] | None = None) -> None:
    run = parse(argv)
    args = run.args
    rows = measure(args, run.rows)
    info = run.provenance()  # run.device: resolved as sample.py resolves --device
    print(
        f"\nsample.py before and after ({args.num_samples} images, guidance {args.guidance}, {info['cpu']}, "
        f"{info['cpu_capability']}, OMP_NUM_THREADS {args.threads or 'unset'})\n"
    )
    print(table(rows))
    run.write({"args": vars(args), "rows": rows}, f"sample_defaults_{run.device.type}.json")


if __name__ == "__main__":
    main()
