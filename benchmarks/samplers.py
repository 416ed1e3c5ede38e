"""Samplers x steps x guidance on a trained MNIST model: classifier FID, conditional accuracy, speed.

    python train.py experiment=mnist data.root=../shared/data/mnist
    python benchmarks/mnist_quality.py --save-classifier mnist_classifier.pt        # optional, else trained here
    python benchmarks/samplers.py --ckpt outputs/.../ema.pt --classifier mnist_classifier.pt [--num-samples 1000]
    python benchmarks/samplers.py --ckpt ... --configs ddim50,dpm++10 --guidance 0,3    # a subset

For every configuration the same N images are drawn (labels 0..9 in turn, same seeds): the FID is the
"classifier FID" (`cfid@N`: the classifier's penultimate features, against the statistics of every MNIST
image in --data-root, cached), the accuracy is how often the classifier reads the requested label. The
classifier KID (`ckid@N`) is unbiased in N, so it stays comparable where FID's small-sample bias (1024-d
features) dominates.
NFE counts network calls per image trajectory; with guidance each call runs the conditional and the
unconditional half in one doubled batch. images/s is measured side by side in this one run (GPU: synchronised).
Prints a table, writes JSON under benchmarks/results/ and a section of docs/benchmarks.md.
"""

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddpm.checkpoint import load_ema_model
from ddpm.data.sources import MNISTSource
from ddpm.diffusion.generate import class_cycle, generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.samplers.dpm_solver import DPMSolverSampler
from ddpm.metrics.features import FeatureExtractor, classifier_extractor
from ddpm.metrics.fid import DEFAULT_CACHE_DIR, compute_metrics, count_tag, reference_stats

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {  # name -> (sampler class, constructor arguments)
    "ddpm1000": (DDPMSampler, {"steps": None}),
    "ddpm250": (DDPMSampler, {"steps": 250}),
    "ddim100": (DDIMSampler, {"steps": 100}),
    "ddim50": (DDIMSampler, {"steps": 50}),
    "ddim20": (DDIMSampler, {"steps": 20}),
    "dpm++20": (DPMSolverSampler, {"steps": 20}),
    "dpm++10": (DPMSolverSampler, {"steps": 10}),
}
BEGIN, END = "<!-- benchmarks/samplers.py: begin -->", "<!-- benchmarks/samplers.py: end -->"


def get_classifier(args: argparse.Namespace) -> FeatureExtractor:
    """The classifier file given, or one trained here on --data-root (mnist_quality.py's recipe)."""
    if args.classifier is not None:
        return classifier_extractor(args.classifier)
    from mnist_quality import train_classifier  # the sibling script (benchmarks/ is this script's folder)

    from ddpm.metrics.classifier import save_torchscript

    data = MNISTSource(root=args.data_root).load(image_size=32, channels=1)
    model, held_out = train_classifier(data.images, data.labels, epochs=args.epochs, seed=0)
    path = save_torchscript(model, args.save_classifier, image_size=32)
    print(f"classifier trained (held-out accuracy {held_out:.3f}) -> {path}")
    return classifier_extractor(path)


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(loaded, sampler, guidance: float, args: argparse.Namespace, device: torch.device) -> dict:
    """Draw the N images with one configuration; time it; return speed and the generated batch."""
    net, diffusion = loaded.net, loaded.diffusion
    labels = class_cycle(args.num_samples, net.num_classes) if net.num_classes is not None else None
    synchronise(device)
    began = time.perf_counter()
    out = generate(net=net, betas=diffusion.betas64(), prediction=diffusion.prediction, sampler=sampler,
                   image_shape=(net.in_channels, net.image_size, net.image_size), num_samples=args.num_samples,
                   labels=labels, null_class=net.num_classes, guidance=guidance, seed=args.seed,
                   batch_size=args.batch_size, device=device)  # fmt: skip
    synchronise(device)
    return {"out": out, "seconds": time.perf_counter() - began}


def markdown(rows: list[dict], meta: dict) -> str:
    tag = count_tag(meta["num_samples"])
    lines = [
        f"### Samplers on MNIST ({meta['num_samples']} samples, {meta['machine']}, torch {meta['torch']}, "
        f"commit {meta['commit']})",
        "",
        f"| sampler | NFE | guidance | cfid@{tag} | ckid@{tag} (x1e3) | accuracy | images/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = f"{r['accuracy']:.3f}" if r["accuracy"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['nfe']} | {r['guidance']:g} | {r['cfid']:.3f} | {1e3 * r['ckid']:.2f} "
            f"± {1e3 * r['ckid_std']:.2f} | {acc} | {r['images_per_s']:.1f} |"
        )
    lines += [
        "",
        f"`{meta['command']}`; cfid: classifier FID against the statistics of {meta['reference']}; "
        "ckid: classifier KID (unbiased, so comparable across sample counts), mean ± std over subsets.",
        "",
    ]
    return "\n".join(lines)


def write_docs(path: Path, table: str) -> None:
    """Replace this script's section of the Markdown file (between its markers), or append one."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    section = f"{BEGIN}\n{table}{END}"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def machine(device: torch.device) -> str:
    """The GPU's name, or the CPU model (/proc/cpuinfo on Linux)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text() if cpuinfo.is_file() else "").splitlines()
        if line.startswith("model name")
    ]
    return names[0] if names else platform.processor() or platform.machine()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, required=True, help="the run's ema.pt (or a .ckpt)")
    parser.add_argument("--classifier", type=Path, help="TorchScript classifier (mnist_quality.py --save-classifier)")
    parser.add_argument("--save-classifier", type=Path, default=REPO / "benchmarks/results/mnist_classifier.pt",
                        help="where a classifier trained here is kept")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=4, help="classifier training epochs (without --classifier)")
    parser.add_argument("--data-root", default=str(REPO.parent / "shared/data/mnist"), help="MNIST IDX folder")
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    parser.add_argument("--guidance", default="0,1,3", help="comma-separated guidance weights")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda ...")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="reference statistics cache")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/samplers.json")
    parser.add_argument("--docs", type=Path, default=REPO / "docs/benchmarks.md", help="Markdown file to update")
    args = parser.parse_args()
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    return args


def main() -> None:
    args = parse_args()
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    loaded = load_ema_model(args.ckpt, device)
    net = loaded.net
    extractor = get_classifier(args).to(device)
    reference = reference_stats(MNISTSource(root=args.data_root), image_size=net.image_size,
                                channels=net.in_channels, extractor=extractor, cache_dir=args.cache_dir)  # fmt: skip
    guidances = [float(g) for g in args.guidance.split(",")] if net.num_classes is not None else [0.0]
    warm = DDIMSampler(steps=2)  # first-call costs (allocations, cuDNN autotuning) stay out of the timings
    generate(net=net, betas=loaded.diffusion.betas64(), prediction=loaded.diffusion.prediction, sampler=warm,
             image_shape=(net.in_channels, net.image_size, net.image_size), num_samples=min(args.batch_size, 64),
             labels=None, null_class=net.num_classes, device=device)  # fmt: skip
    rows = []
    print(f"{'sampler':10}{'NFE':>6}{'w':>5}{'cfid':>10}{'ckid':>10}{'accuracy':>10}{'images/s':>10}")
    for name in args.configs.split(","):
        cls, kwargs = CONFIGS[name]
        for guidance in guidances:
            run = measure(loaded, cls(**kwargs), guidance, args, device)
            out = run["out"]
            features, logits = extractor(out.images)
            values = compute_metrics(["fid", "kid"], features=features, logits=logits, reference=reference,
                                     kind="classifier", labels=out.labels)  # fmt: skip
            tag = count_tag(len(out.images))
            row = {"config": name, "sampler": cls.__name__, **{k: v for k, v in kwargs.items()}, "nfe": out.nfe,
                   "guidance": guidance, "cfid": values[f"cfid@{tag}"], "ckid": values[f"ckid@{tag}"],
                   "ckid_std": values[f"ckid_std@{tag}"], "accuracy": values.get(f"accuracy@{tag}"),
                   "images_per_s": len(out.images) / run["seconds"], "seconds": run["seconds"]}  # fmt: skip
            rows.append(row)
            acc = f"{row['accuracy']:.3f}" if row["accuracy"] is not None else "-"
            print(f"{name:10}{out.nfe:>6}{guidance:>5g}{row['cfid']:>10.3f}{row['ckid']:>10.5f}{acc:>10}"
                  f"{row['images_per_s']:>10.1f}")  # fmt: skip
    meta = {
        "num_samples": args.num_samples, "batch_size": args.batch_size, "seed": args.seed, "ckpt": str(args.ckpt),
        "reference": f"{reference.num} MNIST images in {args.data_root}", "machine": machine(device),
        "torch": torch.__version__, "commit": git_commit(), "features": extractor.name,
        "command": "python " + " ".join(sys.argv),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    write_docs(args.docs, markdown(rows, meta))
    print(f"-> {args.out}, {args.docs}")


if __name__ == "__main__":
    main()
