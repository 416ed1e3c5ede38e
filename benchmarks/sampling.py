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
  fp32_batch_auto   float32, eager, NCHW at sample.py's batch (batch_size auto): the defaults' batch without the rest
  fp32_nhwc_batch_auto  float32 and channels_last at sample.py's batch: the defaults with precision=32
  fp32_compile_batch_auto  the same with compile=true: defaults_compile with precision=32

Rows run interleaved (ABC CBA ...; --repeats, 3 by default; benchmarks/common.py): images/s is the median
[min-max] over repeats, "vs fp32" the median [min-max] of each repeat's ratio to fp32_eager's figure in the same
repeat. A compiled row's network is compiled once, before its first timing (one untimed batch: the compile time,
reported apart); an eager row's first use is one untimed batch too (oneDNN kernel set-up). The sampler
(--sampler: ddim, respaced ddpm or dpm_solver, DPM-Solver++) runs --steps steps. JSON with the provenance.

Quality: with --classifier (a file of benchmarks/mnist_quality.py --save-classifier; trained here if missing)
each row's images of its first repeat get a classifier FID with a 95% bootstrap interval (ddpm.metrics.bootstrap),
and rows that draw the same noise as fp32_eager (same batch size: the initial noise is seeded per batch) are
compared with its images value by value: the fraction of uint8 values that differ, their mean and largest
difference. bf16 network calls change many uint8 values (the cfid says whether that matters); NHWC and
compile move a few by one level (float sums in another order): "same images" holds only for the same row.
"""

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.generate import compile_network, generate, to_channels_last
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.samplers.dpm_solver import DPMSolverSampler
from ddpm.sampling.runtime import default_batch_size, resolve_sampling_precision
from ddpm.weights import load_model

SAMPLERS = {"ddim": DDIMSampler, "ddpm": DDPMSampler, "dpm_solver": DPMSolverSampler}
SMOKE = {"num_samples": 4, "steps": 2, "classifier_epochs": 1, "resamples": 20, "compile_backend": "eager"}


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
    "fp32_batch_auto": Row(batch_size=None),
    "fp32_nhwc_batch_auto": Row(batch_size=None, channels_last=True),
    "fp32_compile_batch_auto": Row(compile=True, batch_size=None, channels_last=True),
}


def load(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, GaussianDiffusion]:
    """The checkpoint's EMA network, or a preset from conf/model/ with random weights (and the default schedule)."""
    if args.ckpt:
        loaded = load_model(args.ckpt, device)
        return loaded.net.eval(), loaded.diffusion
    torch.manual_seed(0)
    conf = OmegaConf.load(common.REPO / "conf" / "model" / f"{args.model}.yaml")
    net = instantiate(conf, **({"num_classes": 10} if args.guidance and conf.get("num_classes") is None else {}))
    with torch.no_grad():  # random, not zero-initialised, output: realistic images for the sampler's clipping
        for p in net.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return net.to(device).eval(), GaussianDiffusion()


class Rows:
    """Runs rows on one network: each layout's eager copy made once, each compiled shape compiled once."""

    def __init__(self, net, diffusion: GaussianDiffusion, args: argparse.Namespace, device: torch.device) -> None:
        self.net, self.diffusion, self.args, self.device = net, diffusion, args, device
        self.networks: dict = {}
        self.warmed: set = set()

    def __call__(self, name: str, _repeat: int = 0) -> dict[str, Any]:
        row, net, args, device = ROWS[name], self.net, self.args, self.device
        guided = bool(args.guidance) and net.num_classes is not None
        batch = row.batch_size or default_batch_size(device, guided=guided)
        precision = resolve_sampling_precision(row.precision, device)
        labels = torch.arange(args.num_samples) % net.num_classes if net.num_classes is not None else None
        shared = dict(
            betas=self.diffusion.betas64(),
            prediction=self.diffusion.prediction,
            sigma_data=self.diffusion.sigma_data,
            sampler=SAMPLERS[args.sampler](steps=args.steps),
            image_shape=(net.in_channels, net.image_size, net.image_size),
            null_class=net.num_classes,
            guidance=args.guidance if guided else 0.0,
            seed=0,
            batch_size=batch,
            device=device,
            precision=precision,
            compile=row.compile,
            compile_backend=args.compile_backend,
        )
        n = min(batch, args.num_samples)  # the timed run's network batch: nothing recompiles while timed
        key, compile_s = (n, precision, row.channels_last), None
        if row.channels_last not in self.networks:
            self.networks[row.channels_last] = to_channels_last(net) if row.channels_last else net
        eager = self.networks[row.channels_last]
        first = None if labels is None else labels[:n]
        if not row.compile and key not in self.warmed:  # first use: one untimed batch (kernel set-up)
            self.warmed.add(key)
            generate(net=eager, num_samples=n, labels=first, **shared)
        if row.compile and key not in self.networks:  # compile once: one untimed batch (the compile time)
            self.networks[key] = compile_network(eager, args.compile_backend)
            began = time.perf_counter()
            generate(net=self.networks[key], num_samples=n, labels=first, **shared)
            compile_s = time.perf_counter() - began
        out = generate(
            net=self.networks[key] if row.compile else eager, num_samples=args.num_samples, labels=labels, **shared
        )
        return {
            "row": name,
            "batch_size": batch,
            "precision": precision,
            "compile": row.compile,
            "channels_last": row.channels_last,
            "images_per_s": out.images_per_second,
            "seconds": out.seconds,
            "compile_s": compile_s,
            "images": out.images,
            "labels": out.labels,
        }


def pixel_difference(images: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """uint8 images against the same-noise float32 eager images: fraction of values that differ, mean, max."""
    diff = (images.int() - base.int()).abs()
    return {"differ": float((diff > 0).double().mean()), "mean": float(diff.double().mean()), "max": int(diff.max())}


def score(results: list[dict], args: argparse.Namespace) -> None:
    """cfid [95%] of every row's images and the pixel difference to fp32_eager's, added to the rows in place."""
    from ddpm.metrics.bootstrap import Reference, SetStatistics, bootstrap, resample_weights
    from ddpm.metrics.classifier import classifier_file
    from ddpm.metrics.features import classifier_extractor
    from ddpm.metrics.fid import DEFAULT_CACHE_DIR, reference_stats

    first = results[0]["images"]
    source, _ = common.mnist_or_digits(
        args.data_root, allow_digits=args.smoke, limit=common.SMOKE_IMAGES if args.smoke else None
    )
    with tempfile.TemporaryDirectory() as tmp:  # --smoke never leaves its quick classifier where a real run looks
        path = args.classifier if Path(args.classifier).is_file() or not args.smoke else Path(tmp) / "classifier.pt"
        path = classifier_file(
            path,
            source=source,
            image_size=first.shape[-1],
            channels=first.shape[1],
            epochs=args.classifier_epochs,  # under --smoke `source` holds only its first SMOKE_IMAGES
        )
        extractor = classifier_extractor(path)
        cache = common.reference_cache(DEFAULT_CACHE_DIR, smoke=args.smoke, tmp=tmp)
        reference = reference_stats(source, image_size=first.shape[-1], channels=first.shape[1], extractor=extractor,
                                    cache_dir=cache)  # fmt: skip
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
    lines = [
        f"{'row':<18}{'batch':>6}{'prec':>6}{'NHWC':>6}{'compile':>8}{'img/s [min-max]':>22}{'vs fp32 [min-max]':>20}"
        f"{'compile s':>10}{'cfid [95%]':>24}{'px differ':>10}{'mean':>6}{'max':>5}"
    ]
    for r in results:
        ips = {"median": r["images_per_s"], "min": r["images_per_s_min"], "max": r["images_per_s_max"]}
        ratio = common.figure(r["vs_fp32"]) + "x" if r.get("vs_fp32") else "n/a"
        comp = "n/a" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        fid = f"{r['cfid']['value']:.2f} [{r['cfid']['low']:.2f}, {r['cfid']['high']:.2f}]" if "cfid" in r else "n/a"
        px = r.get("pixels_vs_fp32")
        pixels = f"{px['differ']:>10.2%}{px['mean']:>6.2f}{px['max']:>5}" if px else f"{'n/a':>10}{'':>6}{'':>5}"
        lines.append(
            f"{r['row']:<18}{r['batch_size']:>6}{r['precision']:>6}{r['channels_last']!s:>6}{r['compile']!s:>8}"
            f"{common.figure(ips):>22}{ratio:>20}{comp:>10}{fid:>24}{pixels}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=None, help="a run's ema.pt/.ckpt/export folder (else --model, random)")
    p.add_argument("--model", default="unet_mnist", help="a preset in conf/model/ (random weights)")
    p.add_argument("--sampler", choices=list(SAMPLERS), default="ddim")
    p.add_argument("--steps", type=int, default=20, help="sampler steps (network evaluations per batch)")
    p.add_argument("--num-samples", type=int, default=512, help="images per row and repeat")
    p.add_argument("--guidance", type=float, default=0.0, help="classifier-free guidance (conditional)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    p.add_argument(
        "--classifier",
        default=None,
        help="score each row's images with this TorchScript MNIST "
        "classifier (trained here and saved there if the file is missing)",
    )
    p.add_argument("--classifier-epochs", type=int, default=4, help="epochs of a classifier trained here")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST (the cfid reference)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the cfid interval")
    common.add_arguments(p, rows=list(ROWS))
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser()
    run = common.start(__file__, p, argv, rows=ROWS, smoke=SMOKE)
    args = run.args
    if args.num_samples < 1 or args.steps < 1:
        p.error("--num-samples and --steps must be >= 1")
    net, diffusion = load(args, run.device)
    runs = common.run_interleaved(
        run.rows, args.repeats, Rows(net, diffusion, args, run.device), lambda r: f"{r['images_per_s']:.2f} images/s"
    )
    ips_runs = {name: [r["images_per_s"] for r in rs] for name, rs in runs.items()}
    vs = common.paired_ratios(ips_runs, "fp32_eager") if "fp32_eager" in runs else {}
    results = []
    for name, rs in runs.items():
        ips = common.stats(ips_runs[name])
        results.append(
            {
                **rs[0],
                "images_per_s": ips["median"],
                "images_per_s_min": ips["min"],
                "images_per_s_max": ips["max"],
                "images_per_s_runs": ips["runs"],
                "vs_fp32": vs.get(name),
                "compile_s": next((r["compile_s"] for r in rs if r["compile_s"]), None),
            }
        )
    if args.classifier:
        score(results, args)
    for r in results:
        del r["images"], r["labels"]
    label = Path(args.ckpt).stem if args.ckpt else args.model
    report = {
        "model": label,
        "parameters": sum(p.numel() for p in net.parameters()),
        "args": vars(args),
        "rows": results,
    }
    print(table(results))
    run.write(report, f"sampling_{label}_{run.device.type}.json")
    return report


if __name__ == "__main__":
    main()
