"""Training and sampling images/s of this project against the tools a user would pick instead, in one run.

    pip install -e '.[peers]'        # denoising-diffusion-pytorch and diffusers (never needed by make test)
    python benchmarks/peers.py --repeats 3
    python benchmarks/peers.py --repeats 5 --threads 2 --compile          # every tool's network compiled
    python benchmarks/peers.py --rows ours,diffusers --steps-train 50 --num-samples 512 --device cuda
    python benchmarks/peers.py --channels-last all   # the same memory layout for every tool

Rows (--rows; default all), each about unet_mnist's 1.11M parameters, class-conditional (label drop 0.1), on 32x32
MNIST (uint8 in RAM, scaled on the device inside the timed step), the same batch for every tool:
  ours        the product: train.py's objects for experiment=mnist (DiffusionModule, RAMDataModule, the EMA callback,
              every callback of conf/callbacks/default.yaml, the CSV and TensorBoard loggers) in a Lightning Trainer
              built as ddpm.training.train builds it; precision as `auto` picks it; sampling = generate with
              sample.py's defaults (precision auto, NHWC)
  ours_bare   a bare PyTorch loop over the same network (GaussianDiffusion.loss, AdamW, grad clip 1.0, bf16 autocast
              where it is faster, NHWC): no Lightning, no callbacks, no EMA; training only (labelled: not the product)
  dd_pytorch  denoising-diffusion-pytorch's classifier-free-guidance Unet(dim=26, dim_mults=(1, 2, 2)) and
              GaussianDiffusion, Adam and grad clip 1.0 as its Trainer, bf16 autocast where faster (its accelerate mixed
              precision); sampling = diffusion.sample(classes, cond_scale) with DDIM (--steps, eta 0)
  diffusers   UNet2DModel with unet_mnist's layout and num_class_embeds=11, DDPMScheduler, the loop of its
              train_unconditional example (AdamW, grad clip 1.0, cosine LR, bf16 autocast, channels_last); sampling =
              the DDIMScheduler loop on a doubled [cond; null] batch, the UNet in bf16 and channels_last
Each peer runs its documented fast options; bf16 only where it is faster than float32, for every row alike
(precision.fast_bf16, `auto`'s rule: CUDA bf16, AMX CPUs).
--compile: torch.compile on every tool's network. --channels-last all: NHWC for every network and job.

Guidance w = --guidance in this project's convention eps = (1 + w) eps_cond - w eps_null (cond_scale =
guidance_scale = 1 + w for the peers); batches of --sample-batch images (default: sample.py's). Every row gets one
untimed training step and sampling batch first (warm-up s: with --compile, the compile); then the repeats run all
rows interleaved (ABC CBA ...; benchmarks/common.py), each timed training segment after one more untimed step
(ours: a fresh Trainer per segment, its set-up untimed; each step timed batch end to batch end, so the EMA and
callbacks are in it). Figures: median [min-max] over repeats; "x ours": each repeat's ratio to ours in the same
repeat, median. The summary says per column whether ours is first and beyond the noise two ways: the margin of
the medians against the widest [min-max] spread, and the paired ratios ours / best peer within each repeat
(ahead in every repeat is beyond the noise); the same for ours_bare, labelled. --smoke skips a missing peer.
"""

import argparse
import time
from typing import Any

import common
import torch
from _peer_tools import BUILDERS, CHANNELS, IMAGE_SIZE, NUM_CLASSES, ROWS, TIMESTEPS, Setup, Tool
from torch import Tensor

from ddpm.precision import fast_bf16
from ddpm.sampling.runtime import default_batch_size

PEERS_HINT = "pip install -e '.[peers]'"
SMOKE = {"batch_size": 8, "steps_train": 1, "num_samples": 4, "sample_batch": 4, "steps": 2, "compile_backend": "eager"}


def build(names: list[str], setup: Setup, smoke: bool) -> dict[str, Tool]:
    """Every row's tool; a peer that is not installed stops the run (a comparison without it is another one),
    except under --smoke, which skips it and says so."""
    tools = {}
    for name in names:
        torch.manual_seed(0)
        try:
            tools[name] = BUILDERS[name](setup)
        except ImportError as error:
            if name.startswith("ours"):
                raise
            if not smoke:
                raise SystemExit(
                    f"{ROWS[name]} is missing ({error}): {PEERS_HINT}, or leave it out of --rows"
                ) from error
            print(f"--smoke: skipping {name}: {ROWS[name]} is not installed ({error}); {PEERS_HINT}")
    return tools


def time_sample(tool: Tool, labels: Tensor, device: torch.device) -> float:
    """Sampling images/s for len(labels) images, uint8 on the CPU at the end."""
    began = time.perf_counter()
    tool.sample(labels)
    common.sync(device)
    return len(labels) / (time.perf_counter() - began)


def spread(s: dict[str, Any]) -> float:
    """(max - min) / median: the run-to-run noise of one figure."""
    return (s["max"] - s["min"]) / s["median"]


def row_result(tool: Tool, warm: dict[str, float], train: list[float], sample: list[float]) -> dict[str, Any]:
    out = {
        "key": tool.key,
        "tool": ROWS[tool.key],
        "parameters": tool.parameters,
        "fwd_flops_per_image": tool.fwd_flops_per_image,
        "options": tool.options,
        **warm,
    }
    for column, runs in (("train", train), ("sample", sample)):
        s = common.stats(runs) if runs else None
        out.update(
            {f"{column}_images_per_s": s and s["median"], f"{column}_runs": runs, f"{column}_spread": s and spread(s)}
        )
    return out


def verdict(results: list[dict[str, Any]], column: str, ours: str = "ours") -> dict[str, Any] | None:
    """Is `ours` first in `column` against the best peer, beyond the largest run-to-run spread of the rows, and
    ahead in every repeat (paired ratios ours / best peer: the rows of one repeat saw the same machine)?"""
    mine = next((r for r in results if r["key"] == ours and r[f"{column}_runs"]), None)
    peers = [r for r in results if not r["key"].startswith("ours") and r[f"{column}_runs"]]
    if mine is None or not peers:
        return None
    best = max(peers, key=lambda r: r[f"{column}_images_per_s"])
    margin = mine[f"{column}_images_per_s"] / best[f"{column}_images_per_s"] - 1
    noise = max(r[f"{column}_spread"] for r in [mine, *peers]) if len(mine[f"{column}_runs"]) > 1 else None
    paired = common.paired_ratios({"ours": mine[f"{column}_runs"], "best": best[f"{column}_runs"]}, "best")["ours"]
    return {
        "ours": ROWS[ours],
        "best_peer": best["tool"],
        "margin": margin,
        "noise": noise,
        "ours_first": margin > 0,
        "beyond_noise": None if noise is None else margin > noise,  # None: one repeat measures no noise
        "paired": paired,
        "paired_ratios": paired["runs"],
        "ahead_in": sum(p > 1 for p in paired["runs"]),
        "beyond_noise_paired": None if len(paired["runs"]) < 2 else paired["min"] > 1,
    }


def verdict_line(v: dict[str, Any]) -> str:
    first = f"{v['ours']} {'first' if v['ours_first'] else 'NOT first'}"
    if v["noise"] is None:
        return f"{first} (best peer {v['best_peer']}, margin {v['margin']:+.1%}; noise unknown: one repeat)"
    beyond = "beyond" if v["beyond_noise"] else "within"
    return (
        f"{first} (best peer {v['best_peer']}, margin {v['margin']:+.1%}, noise {v['noise']:.1%}: {beyond} noise; "
        f"paired per repeat {common.figure(v['paired'])}x, ahead in {v['ahead_in']} of {len(v['paired_ratios'])})"
    )


def table(results: list[dict[str, Any]]) -> str:
    ours = next((r for r in results if r["key"] == "ours"), None)

    def cell(r: dict[str, Any], column: str) -> str:
        runs = r[f"{column}_runs"]
        if not runs:
            return f"{'n/a':<25}{'':>7}"
        ratio = (
            "n/a"
            if ours is None or not ours[f"{column}_runs"]
            else f"{common.paired_ratios({'r': runs, 'o': ours[f'{column}_runs']}, 'o')['r']['median']:.2f}x"
        )
        return f"{r[f'{column}_images_per_s']:.1f} [{min(runs):.1f}-{max(runs):.1f}]".ljust(25) + f"{ratio:>7}"

    lines = [
        f"{'tool':<42}{'params':>11}{'MFLOP/img':>11}  {'train img/s [min-max]':<25}{'x ours':>7}  "
        f"{'sample img/s [min-max]':<25}{'x ours':>7}{'warm-up s':>11}"
    ]
    for r in results:
        lines.append(
            f"{r['tool']:<42}{r['parameters']:>11,}{r['fwd_flops_per_image'] / 1e6:>11.1f}  {cell(r, 'train')}  "
            f"{cell(r, 'sample')}{r['warmup_train_s']:>6.1f}+{r['warmup_sample_s']:.1f}"
        )
    return "\n".join([*lines, *(f"  {r['tool']}: {'; '.join(r['options'])}" for r in results)])


def parse(argv: list[str] | None) -> common.Run:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=128, help="training batch, the same for every tool")
    p.add_argument("--steps-train", type=int, default=20, help="timed training steps per row and repeat")
    p.add_argument("--num-samples", type=int, default=256, help="images sampled per row and repeat")
    p.add_argument(
        "--sample-batch",
        type=int,
        default=None,
        help="images per sampling batch (default: sample.py's for the device: on a CPU 32 guided, 64 not)",
    )
    p.add_argument("--steps", type=int, default=20, help="DDIM steps")
    p.add_argument("--guidance", type=float, default=3.0, help="w: eps = (1 + w) eps_cond - w eps_null")
    p.add_argument("--compile", action="store_true", help="torch.compile every tool's network")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (with --compile)")
    p.add_argument(
        "--channels-last",
        choices=["documented", "all"],
        default="documented",
        help="documented: each tool's own layout advice; all: every network and job channels_last",
    )
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder (else scikit-learn's digits)")
    common.add_arguments(p, rows=list(ROWS), device="cpu")
    run = common.start(__file__, p, argv, rows=ROWS, smoke=SMOKE)
    args = run.args
    if min(args.batch_size, args.steps_train, args.num_samples, args.steps, args.sample_batch or 1) < 1:
        p.error("--batch-size, --steps-train, --num-samples, --sample-batch, --steps must be >= 1")
    if not 1 <= args.steps < TIMESTEPS or args.guidance < 0:
        p.error(f"--steps must be in 1..{TIMESTEPS - 1} (DDIM) and --guidance >= 0")
    args.sample_batch = args.sample_batch or default_batch_size(run.device, guided=args.guidance > 0)
    if args.compile and args.num_samples > args.sample_batch and args.num_samples % args.sample_batch:
        p.error(
            "with --compile, --num-samples must be a multiple of --sample-batch (a partial last batch "
            "would recompile the peers' networks inside the timing)"
        )
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = parse(argv)
    args, device = run.args, run.device
    source, data_name = common.mnist_or_digits(args.data_root, allow_digits=True)
    setup = Setup(
        device=device,
        bf16=fast_bf16(device.type),
        compile=args.compile,
        backend=args.compile_backend,
        batch_size=args.batch_size,
        sample_batch=args.sample_batch,
        steps=args.steps,
        guidance=args.guidance,
        channels_last_all=args.channels_last == "all",
        data=source.load(image_size=IMAGE_SIZE, channels=CHANNELS),
        source=source,
    )
    labels = torch.arange(args.num_samples) % NUM_CLASSES
    tools, warm = build(run.rows, setup, args.smoke), {}
    for name, tool in tools.items():  # untimed: kernel set-up, with --compile the compilation
        began = time.perf_counter()
        tool.train(0)
        trained = time.perf_counter()
        if tool.sample is not None:
            tool.sample(labels[: min(args.sample_batch, args.num_samples)])
        warm[name] = {"warmup_train_s": trained - began, "warmup_sample_s": time.perf_counter() - trained}
        print(f"built {name}: {tool.parameters:,} parameters; warm-up {warm[name]}", flush=True)

    def measure(name: str, _repeat: int) -> tuple[float, float | None]:
        tool = tools[name]
        train = args.steps_train * args.batch_size / tool.train(args.steps_train)
        return train, None if tool.sample is None else time_sample(tool, labels, device)

    runs = common.run_interleaved(
        list(tools),
        args.repeats,
        measure,
        lambda r: f"train {r[0]:.1f}, sample {'n/a' if r[1] is None else f'{r[1]:.2f}'} images/s",
    )
    results = [
        row_result(tools[n], warm[n], [t for t, _ in runs[n]], [s for _, s in runs[n] if s is not None]) for n in tools
    ]
    summary = {
        "train": verdict(results, "train"),
        "sample": verdict(results, "sample"),
        "train_bare": verdict(results, "train", ours="ours_bare"),
    }
    if "ours" in tools and "ours_bare" in tools:  # what Lightning, the callbacks and the EMA cost per step
        summary["trainer_vs_bare"] = common.paired_ratios(
            {n: [t for t, _ in runs[n]] for n in ("ours", "ours_bare")}, "ours_bare"
        )["ours"]
    report = {
        "data": data_name,
        "precision": "bf16" if setup.bf16 else "32",
        "args": vars(args),
        "rows": results,
        "skipped": [n for n in run.rows if n not in tools],
        "summary": summary,
    }
    print(table(results))
    for column, v in summary.items():
        if v is not None:
            print(f"{column}: {common.figure(v) + 'x' if column == 'trainer_vs_bare' else verdict_line(v)}")
    run.write(report, f"peers_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
