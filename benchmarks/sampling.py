"""Sampling throughput (images/s), row by row, all rows measured in one run on the same model.

    python benchmarks/sampling.py --model unet_mnist --num-samples 512 --steps 20 --repeats 3
    python benchmarks/sampling.py --ckpt outputs/2026-11-23/12-00-00/ema.pt --steps 50 --guidance 2

Rows (--rows, comma-separated; default all):
  fp32_eager      the default path before `precision`/`channels_last`/`compile`: float32, eager, NCHW, batch 256
  bf16            the network under bf16 autocast (generate's precision=bf16), batch 256
  channels_last   NHWC weights (generate's channels_last=True), float32, batch 256
  compile         torch.compile (inductor, dynamic=False; a partial last batch padded), float32, batch 256
  bf16_compile    bf16 and compile, batch 256
  defaults        what sample.py now picks here: batch_size auto, precision auto, channels_last, compile false
  defaults_compile  the same with compile=true

Rows are interleaved --repeats times (ABC CBA ...); the table shows medians and the min-max over repeats. A compiled
row's network is compiled once, before its first timing (one untimed batch: the compile time, reported apart); an
eager row's first use is one untimed batch too (oneDNN kernel set-up). The sampler (--sampler: ddim, respaced ddpm
or dpm_solver, DPM-Solver++) runs --steps steps. Writes JSON under benchmarks/results/ with the CPU model, its
capability (AVX512/AMX: torch.backends.cpu.get_cpu_capability()), native bf16, torch version
and git commit.

Same images? With --classifier (a file of benchmarks/mnist_quality.py --save-classifier; trained here if missing)
each row's images of its first repeat get a classifier FID with a 95% bootstrap interval (ddpm.metrics.bootstrap),
and rows that draw the same noise as fp32_eager (same batch size: the initial noise is seeded per batch) are
compared with its images pixel by pixel:
the fraction of uint8 values that differ, their mean and largest difference.
"""

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from report import machine, write_report  # benchmarks/report.py

from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.generate import compile_network, generate, to_channels_last
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.samplers.dpm_solver import DPMSolverSampler
from ddpm.sampling.runtime import default_batch_size, resolve_sampling_precision
from ddpm.weights import load_model

REPO = Path(__file__).resolve().parents[1]
SAMPLERS = {"ddim": DDIMSampler, "ddpm": DDPMSampler, "dpm_solver": DPMSolverSampler}


@dataclass(frozen=True)
class Row:
    precision: str = "32"  # 32 | bf16 | auto
    compile: bool = False
    batch_size: int | None = 256  # None: sample.py's auto
    channels_last: bool = False


ROWS = {
    "fp32_eager": Row(),
    "bf16": Row(precision="bf16"),
    "channels_last": Row(channels_last=True),
    "compile": Row(compile=True),
    "bf16_compile": Row(precision="bf16", compile=True),
    "defaults": Row(precision="auto", batch_size=None, channels_last=True),
    "defaults_compile": Row(precision="auto", compile=True, batch_size=None, channels_last=True),
}


def load(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, GaussianDiffusion]:
    """The checkpoint's EMA network, or a preset from conf/model/ with random weights (and the default schedule)."""
    if args.ckpt:
        loaded = load_model(args.ckpt, device)
        return loaded.net.eval(), loaded.diffusion
    torch.manual_seed(0)
    net = instantiate(OmegaConf.load(REPO / "conf" / "model" / f"{args.model}.yaml"))
    if args.guidance and net.num_classes is None:
        net = instantiate(OmegaConf.load(REPO / "conf" / "model" / f"{args.model}.yaml"), num_classes=10)
    with torch.no_grad():  # random, not zero-initialised, output: realistic images for the sampler's clipping
        for p in net.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return net.to(device).eval(), GaussianDiffusion()


def run_row(
    name: str, row: Row, net, compiled: dict, warmed: set, diffusion, args, device: torch.device
) -> dict[str, Any]:
    guided = bool(args.guidance) and net.num_classes is not None
    batch = row.batch_size or default_batch_size(device, guided=guided)
    precision = resolve_sampling_precision(row.precision, device)
    sampler = SAMPLERS[args.sampler](steps=args.steps)
    labels = torch.arange(args.num_samples) % net.num_classes if net.num_classes is not None else None
    common = dict(betas=diffusion.betas64(), prediction=diffusion.prediction, sampler=sampler,
                  image_shape=(net.in_channels, net.image_size, net.image_size), null_class=net.num_classes,
                  guidance=args.guidance if guided else 0.0, seed=0, batch_size=batch, device=device,
                  precision=precision, compile=row.compile)  # fmt: skip
    compile_s = None
    n = min(batch, args.num_samples)
    key = (n, precision, row.channels_last)
    if row.channels_last not in compiled:  # the eager network of each layout, made once
        compiled[row.channels_last] = to_channels_last(net) if row.channels_last else net
    eager = compiled[row.channels_last]
    if not row.compile and key not in warmed:  # first use: one untimed batch (kernel set-up)
        warmed.add(key)
        generate(net=eager, num_samples=n, labels=None if labels is None else labels[:n], **common)
    if row.compile and key not in compiled:  # compile once: one untimed batch (the compile time, reported)
        compiled[key] = compile_network(eager)
        began = time.perf_counter()
        # n: the timed run's network batch, so nothing recompiles while timed
        generate(net=compiled[key], num_samples=n, labels=None if labels is None else labels[:n], **common)
        compile_s = time.perf_counter() - began
    network = compiled[key] if row.compile else eager
    out = generate(net=network, num_samples=args.num_samples, labels=labels, **common)
    return {"row": name, "batch_size": batch, "precision": precision, "compile": row.compile,
            "channels_last": row.channels_last,
            "images_per_s": out.images_per_second, "seconds": out.seconds, "compile_s": compile_s,
            "images": out.images, "labels": out.labels}  # fmt: skip


def pixel_difference(images: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """uint8 images against the same-noise float32 eager images: fraction of values that differ, mean, max."""
    diff = (images.int() - base.int()).abs()
    return {"differ": float((diff > 0).double().mean()), "mean": float(diff.double().mean()), "max": int(diff.max())}


def score(results: list[dict], args: argparse.Namespace) -> None:
    """cfid [95%] of every row's images and the pixel difference to fp32_eager's, added to the rows in place."""
    from mnist_quality import classifier_file  # the sibling script

    from ddpm.data.sources import MNISTSource
    from ddpm.metrics.bootstrap import Reference, SetStatistics, bootstrap, resample_weights
    from ddpm.metrics.features import classifier_extractor
    from ddpm.metrics.fid import reference_stats

    path = classifier_file(args.classifier, data_root=args.data_root, epochs=args.classifier_epochs)
    extractor = classifier_extractor(path)
    first = results[0]["images"]
    reference = reference_stats(MNISTSource(root=args.data_root), image_size=first.shape[-1],
                                channels=first.shape[1], extractor=extractor)  # fmt: skip
    weights = resample_weights(len(first), args.resamples, seed=0)
    terms = Reference.of(reference)  # once for every row
    base = next((r for r in results if r["row"] == "fp32_eager"), None)
    for r in results:
        features, logits = extractor(r["images"])
        stats = SetStatistics(terms, features, logits=logits, labels=r["labels"])
        r.update({k: v.as_dict() for k, v in bootstrap(stats, weights).items()})
        if base is not None and r["batch_size"] == base["batch_size"]:
            r["pixels_vs_fp32"] = pixel_difference(r["images"], base["images"])


def table(results: list[dict]) -> str:
    base = next((r["images_per_s"] for r in results if r["row"] == "fp32_eager"), None)
    lines = [f"{'row':<18}{'batch':>6}{'prec':>6}{'NHWC':>6}{'compile':>8}{'img/s':>9}{'min-max':>14}{'vs fp32':>9}"
             f"{'compile s':>10}{'cfid [95%]':>24}{'px differ':>10}{'mean':>6}{'max':>5}"]  # fmt: skip
    for r in results:
        ratio = f"{r['images_per_s'] / base:.2f}x" if base else "n/a"
        comp = "n/a" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        runs = r["images_per_s_runs"]
        spread = f"{min(runs):.2f}-{max(runs):.2f}"
        fid = f"{r['cfid']['value']:.2f} [{r['cfid']['low']:.2f}, {r['cfid']['high']:.2f}]" if "cfid" in r else "n/a"
        px = r.get("pixels_vs_fp32")
        pixels = f"{px['differ']:>10.2%}{px['mean']:>6.2f}{px['max']:>5}" if px else f"{'n/a':>10}{'':>6}{'':>5}"
        lines.append(f"{r['row']:<18}{r['batch_size']:>6}{r['precision']:>6}{r['channels_last']!s:>6}{r['compile']!s:>8}"
                     f"{r['images_per_s']:>9.2f}{spread:>14}{ratio:>9}{comp:>10}{fid:>24}{pixels}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default=None, help="a run's ema.pt/.ckpt/export folder (else --model, random)")
    parser.add_argument("--model", default="unet_mnist", help="a preset in conf/model/ (random weights)")
    parser.add_argument("--sampler", choices=list(SAMPLERS), default="ddim")
    parser.add_argument("--steps", type=int, default=20, help="sampler steps (network evaluations per batch)")
    parser.add_argument("--num-samples", type=int, default=512, help="images per row and repeat")
    parser.add_argument("--guidance", type=float, default=0.0, help="classifier-free guidance (conditional)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row, interleaved (ABC CBA ...); medians")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--classifier", default=None, help="score each row's images with this TorchScript MNIST "
                        "classifier (trained here and saved there if the file is missing)")  # fmt: skip
    parser.add_argument("--classifier-epochs", type=int, default=4, help="epochs of a classifier trained here")
    parser.add_argument(
        "--data-root", default=str(REPO.parent / "shared/data/mnist"), help="MNIST (the cfid reference)"
    )
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the cfid interval")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sampling_<model>_<dev>)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.repeats < 1 or args.num_samples < 1 or args.steps < 1:
        parser.error("--repeats, --num-samples and --steps must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    net, diffusion = load(args, device)
    compiled: dict = {}
    warmed: set = set()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):  # alternate the order, so slow drift of the machine hits every row
        for name in names if repeat % 2 == 0 else names[::-1]:
            runs[name].append(run_row(name, ROWS[name], net, compiled, warmed, diffusion, args, device))
            print(f"done {name} ({repeat + 1}/{args.repeats}): {runs[name][-1]['images_per_s']:.2f} images/s",
                  flush=True)  # fmt: skip
    results = []
    for name in names:
        first = runs[name][0]
        results.append({**first, "images_per_s": statistics.median(r["images_per_s"] for r in runs[name]),
                        "images_per_s_runs": [r["images_per_s"] for r in runs[name]],
                        "compile_s": next((r["compile_s"] for r in runs[name] if r["compile_s"]), None)})  # fmt: skip
    if args.classifier:
        score(results, args)
    for r in results:
        del r["images"], r["labels"]
    label = Path(args.ckpt).stem if args.ckpt else args.model
    report = {"model": label, "parameters": sum(p.numel() for p in net.parameters()), "args": vars(args),
              "machine": machine(device), "rows": results}  # fmt: skip
    print(table(results))
    write_report(report, args.out, f"sampling_{label}_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
