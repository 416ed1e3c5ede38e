"""`python sample.py ckpt=...` before and after issue 12's defaults, end to end: the real command, timed.

    python benchmarks/sample_defaults.py --ckpt outputs/<mnist run>/ema.pt --num-samples 64 --repeats 2

Rows, run as `sample.py` subprocesses, interleaved (AB BA ...), each with the same checkpoint, seed, labels
and guidance:
- `before`: what the command ran before: ancestral DDPM on all T steps, float32, NCHW, batch 256
  (`sampler.steps=null precision=32 channels_last=false batch_size=256`);
- `now`: the command with no options: DDPM respaced to 250 steps (conf/sampler/ddpm.yaml, the sampler table's
  fastest within noise of DDPM-1000), `precision=auto`, `channels_last=true`, `batch_size=auto`;
- `now_compile` (optional, --rows): the same with `compile=true`.
images/s is sample.py's own figure (the sampling loop); "wall s" is the whole process (start-up, model load,
outputs). With --num-samples below 256 the `before` batch is --num-samples, which favours `before` on a CPU
(64-image batches are ~1.7x faster per image there than 256): the ratio is then a lower bound.
That the images are as good is the sampler table's and benchmarks/sampling.py's measurement, not this one's.
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

import torch
from report import REPO, machine, write_report

from ddpm.sampling import resolve_device

ROWS = {
    "before": {"sampler.steps": "null", "precision": "32", "channels_last": "false", "batch_size": "256"},
    "now": {},
    "now_compile": {"compile": "true"},
}
PRINTED = re.compile(
    r"(?P<n>\d+) images in (?P<s>[\d.]+) s \((?P<ips>[\d.]+) images/s, (?P<nfe>\d+) network evaluations per batch; "
    r"batch (?P<batch>\d+), precision (?P<precision>\w+)(?P<rest>[^)]*)\)"
)


def run_row(name: str, args: argparse.Namespace, out: Path) -> dict:
    """One `sample.py` subprocess for row `name`; its printed figures and its wall time."""
    overrides = {"ckpt": args.ckpt, "num_samples": str(args.num_samples), "guidance": str(args.guidance),
                 "seed": "0", "device": args.device, "output_dir": str(out), **ROWS[name]}  # fmt: skip
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
    seconds = float(found["s"])  # printed to 0.1 s; its images/s only to 0.01
    return {"images_per_s": int(found["n"]) / seconds, "seconds": seconds, "wall_s": wall,
            "nfe": int(found["nfe"]), "batch": int(found["batch"]), "precision": found["precision"],
            "options": found["rest"].strip(", "), "overrides": ROWS[name]}  # fmt: skip


def measure(args: argparse.Namespace) -> list[dict]:
    names = args.rows.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in names if repeat % 2 == 0 else reversed(names):
                runs[name].append(run_row(name, args, Path(tmp) / f"{name}_{repeat}"))
                r = runs[name][-1]
                print(f"  repeat {repeat}: {name:<12} {r['images_per_s']:8.3f} images/s  {r['wall_s']:7.1f} s wall")
    base = statistics.median(r["images_per_s"] for r in runs[names[0]])
    rows = []
    for name in names:
        ips = [r["images_per_s"] for r in runs[name]]
        rows.append({"row": name, **{k: runs[name][0][k] for k in ("nfe", "batch", "precision", "options")},
                     "overrides": ROWS[name], "images_per_s": statistics.median(ips), "images_per_s_runs": ips,
                     "seconds_runs": [r["seconds"] for r in runs[name]],
                     "wall_s_runs": [r["wall_s"] for r in runs[name]],
                     "vs_first": statistics.median(ips) / base})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| row | network calls | batch | precision, options | images/s [min-max] | wall s | vs first |",
             "|---|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        ips = r["images_per_s_runs"]
        lines.append(f"| `{r['row']}` | {r['nfe']} | {r['batch']} | {r['precision']} {r['options']} | "
                     f"{r['images_per_s']:.3f} [{min(ips):.3f}-{max(ips):.3f}] | "
                     f"{statistics.median(r['wall_s_runs']):.0f} | {r['vs_first']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a run's ema.pt (or any ckpt sample.py reads)")
    parser.add_argument("--rows", default="before,now", help=f"comma-separated, from {', '.join(ROWS)}; the first "
                        "is the reference")  # fmt: skip
    parser.add_argument("--num-samples", type=int, default=64, help="images per row and repeat")
    parser.add_argument("--guidance", type=float, default=0.0, help="w (conditional models)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every row, interleaved")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for sample.py (default: its own)")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a sample.py override for every row, applied last (e.g. sampler.steps=2 to shrink)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sample_defaults_<dev>.json)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.rows.split(",") if name not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    if not Path(args.ckpt).exists():
        parser.error(f"--ckpt {args.ckpt} does not exist: pass a run's ema.pt (python train.py writes one)")
    if any("=" not in item for item in args.set):
        parser.error("--set takes KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rows = measure(args)
    device = resolve_device(args.device)  # the device sample.py ran on
    info = {**machine(device), "threads": args.threads or torch.get_num_threads()}
    print(f"\nsample.py before and after ({args.num_samples} images, guidance {args.guidance}, {info['cpu']}, "
          f"{info['cpu_capability']}, {info['threads']} threads)\n")  # fmt: skip
    print(table(rows))
    write_report({"machine": info, "args": vars(args), "rows": rows}, args.out, f"sample_defaults_{device.type}.json")


if __name__ == "__main__":
    main()
