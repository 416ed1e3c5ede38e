"""An MNIST recipe's quality, as docs/mnist.md reports it: per training run (seed), 500 samples per guidance weight
with one sampler, scored by the MNIST classifier; DDPM-1000 on the same model for the paired ratio; the floor.

    python train.py experiment=mnist data.root=../shared/data/mnist seed=1 hydra.run.dir=outputs/mnist_s1  # x 3 seeds
    python benchmarks/mnist_recipe.py --runs outputs/mnist_s1,outputs/mnist_s2,outputs/mnist_s3 --label after \
        --guidance 0,0.5,1,1.5,2,3 --reference ddpm1000 --classifier mnist_classifier.pt

- cfid@500: the classifier FID (ddpm.metrics: the classifier's penultimate features) against every MNIST image in
  --data-root; accuracy@500: how often the classifier reads the requested label (labels 0..9 in turn, w = 0 is
  unguided conditional sampling). Both with 95% bootstrap intervals over the 500 images.
- floor: the same metrics on 500 real digits the classifier never saw (its held-out split,
  ddpm.metrics.classifier.held_out_split): what a perfect generator would score at n = 500.
- vs reference: the cfid ratio to --reference (e.g. ddpm1000, all T steps) at w = 0 on the same model, paired
  (image i of both sets has the same label and initial noise; resampled together).
- vs baseline: with --baseline (another recipe's runs, paired with --runs in order: the same seed), the cfid ratio
  of each run to its baseline run at every weight, paired the same way: before/after at equal compute.
- per weight: the mean over the runs, and the spread (min-max) of the runs' values; for the ratios also the mean's
  95% interval over the images, the runs' models held fixed (ddpm.metrics.bootstrap.mean_paired_ratio).
- --guidance-interval lo,hi: every w > 0 guides only at steps whose sigma_t is in (lo, hi] (sample.py's
  guidance_interval, Kynkaanniemi et al. 2024); its rows' features are kept apart from the full-interval rows'.
--precision: the network calls, as sample.py's `precision`: auto is bf16 on CUDA bf16 and AMX CPUs, else 32; pass 32
to compare with float32 figures on any machine (bf16 rows' features are kept apart). The JSON records it.
Resumable: each (run, sampler, guidance) row's features are kept in --features-dir, named by the run's folder and
a digest of its weights, and by the classifier's name (a row is never scored with another run's or classifier's
features). The JSON carries
benchmarks/common.py's provenance. --smoke: 8 samples, 1 guidance weight, a quick classifier.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import common
import torch

from ddpm.diffusion.generate import class_cycle, generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.samplers.dpm_solver_sde import DPMSolverSDESampler
from ddpm.diffusion.samplers.edm import EDMSampler
from ddpm.diffusion.samplers.restart import RestartSampler
from ddpm.metrics.bootstrap import (
    Reference,
    SetStatistics,
    bootstrap,
    draws,
    mean_paired_ratio,
    paired_ratio,
    resample_weights,
)
from ddpm.metrics.classifier import classifier_file, held_out_split
from ddpm.metrics.features import classifier_extractor, file_digest
from ddpm.metrics.fid import DEFAULT_CACHE_DIR, reference_stats
from ddpm.sampling.runtime import default_batch_size, guidance_interval, resolve_sampling_precision
from ddpm.weights import load_model

SAMPLERS = {  # name -> a sampler of sample.py's config groups, or of the sampler table (samplers.py's CONFIGS)
    "dpm++sde25": lambda: DPMSolverSDESampler(steps=25),
    "dpm++sde20": lambda: DPMSolverSDESampler(steps=20),
    "dpm++sde15": lambda: DPMSolverSDESampler(steps=15),
    "dpm++sde25_logsnr": lambda: DPMSolverSDESampler(steps=25, spacing="logsnr"),  # uniform in log sigma
    "ddpm250": lambda: DDPMSampler(steps=250),
    "ddpm1000": lambda: DDPMSampler(steps=None),
    "ddim50": lambda: DDIMSampler(steps=50),
    "ddim4": lambda: DDIMSampler(steps=4),
    "edm13_churn": lambda: EDMSampler(steps=13, churn=40.0, s_tmin=0.05, s_tmax=50.0, s_noise=1.003),  # 25 NFE
    "restart": lambda: RestartSampler(steps=9, restarts=2, restart_steps=2, t_min=0.06, t_max=0.30),  # 25 NFE
}
SMOKE = {"num_samples": 8, "resamples": 20, "guidance": "0", "reference": "dpm++sde15", "sampler": "ddim4"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="comma-separated run folders (their ema.pt) or weights files")
    p.add_argument("--label", default="recipe", help="the recipe's name in the JSON and the table")
    p.add_argument("--sampler", default="dpm++sde25", choices=sorted(SAMPLERS), help="the sampler of every row")
    p.add_argument("--guidance", default="0", help="comma-separated guidance weights")
    p.add_argument("--guidance-interval", type=interval, default=None,
                   help="sigma_lo,sigma_hi: guide only where sigma_t is in (sigma_lo, sigma_hi] (sample.py's "
                   "guidance_interval); default: every step")  # fmt: skip
    p.add_argument("--reference", default="none", help="a sampler of SAMPLERS at w = 0 for the paired ratio, or none")
    p.add_argument("--baseline", help="comma-separated runs of the recipe to compare with, paired with --runs")
    p.add_argument("--num-samples", type=int, default=500)
    p.add_argument("--resamples", type=int, default=400, help="bootstrap resamples per interval")
    p.add_argument("--classifier", type=Path, help="default: benchmarks/results/mnist_classifier.pt")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="reference statistics cache")
    p.add_argument("--features-dir", type=Path, help="each row's features (resume); default outputs/recipe_features")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto",
                   help="the network calls: auto (bf16 on CUDA bf16 and AMX CPUs, else 32), 32 or bf16")  # fmt: skip
    p.add_argument("--plot", type=Path, help="PNG: cfid and accuracy against w (runs' mean, min-max)")
    common.add_arguments(p, repeats=None)
    return p


def interval(text: str) -> tuple[float, float]:
    try:
        return guidance_interval([float(v) for v in text.split(",")], key="--guidance-interval")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def weights_file(run: str) -> Path:
    path = Path(run)
    return path / "ema.pt" if path.is_dir() else path


def draw(path: Path, sampler: str, guidance: float, args: argparse.Namespace, device: torch.device) -> dict:
    """The N images of one row (same labels and seeds in every row) and the seconds they took."""
    loaded = load_model(path, device)
    net = loaded.net.to(memory_format=torch.channels_last)
    labels = class_cycle(args.num_samples, net.num_classes) if net.num_classes is not None else None
    began = time.perf_counter()
    out = generate(net=net, betas=loaded.diffusion.betas64(), prediction=loaded.diffusion.prediction,
                   sigma_data=loaded.diffusion.sigma_data,
                   sampler=SAMPLERS[sampler](), image_shape=(net.in_channels, net.image_size, net.image_size),
                   num_samples=args.num_samples, labels=labels, null_class=net.num_classes, guidance=guidance,
                   guidance_interval=args.guidance_interval if guidance else None,
                   seed=args.seed, batch_size=default_batch_size(device, guided=guidance != 0), device=device,
                   precision=args.precision)  # fmt: skip
    return {"images": out.images, "labels": labels, "nfe": out.nfe, "seconds": time.perf_counter() - began}


def scored(extractor, terms: Reference, images: torch.Tensor, labels, weights, file: Path, extra: dict) -> tuple:
    """((SetStatistics, its draws), bootstrap intervals) of a set of images, its features kept in `file`; the draws
    (bootstrap.draws over `weights`) serve its intervals and every paired ratio it takes part in."""
    if not file.is_file():
        features, logits = extractor(images)
        torch.save({"features": features, "logits": logits, "labels": labels, **extra}, file)
    saved = torch.load(file, weights_only=True)
    stats = SetStatistics(terms, saved["features"], logits=saved["logits"], labels=saved["labels"])
    drawn = draws(stats, weights)
    return (stats, drawn), {k: v.as_dict() for k, v in bootstrap(stats, weights, drawn=drawn).items()}, saved


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "runs": values}


def main(argv: list[str] | None = None) -> dict:
    run = common.start(__file__, parser(), argv, smoke=SMOKE)
    args, device = run.args, run.device
    args.precision = resolve_sampling_precision(args.precision, device, key="--precision")
    runs = [weights_file(r) for r in args.runs.split(",")]
    baselines = [weights_file(r) for r in args.baseline.split(",")] if args.baseline else []
    if baselines and len(baselines) != len(runs):
        raise SystemExit(f"--baseline names {len(baselines)} runs, --runs {len(runs)}: pair them one to one (seeds)")
    guidances = [float(g) for g in args.guidance.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        features_dir = args.features_dir or (Path(tmp) if args.smoke else common.REPO / "outputs/recipe_features")
        features_dir.mkdir(parents=True, exist_ok=True)
        source, data_name = common.mnist_or_digits(
            args.data_root, allow_digits=args.smoke, limit=common.SMOKE_IMAGES if args.smoke else None
        )
        path = args.classifier or classifier_file(  # under --smoke `source` holds only its first SMOKE_IMAGES
            Path(tmp) / "classifier.pt" if args.smoke else common.RESULTS / "mnist_classifier.pt",
            source=source, epochs=1 if args.smoke else 4)  # fmt: skip
        extractor = classifier_extractor(path).to(device)
        cache = common.reference_cache(args.cache_dir, smoke=args.smoke, tmp=tmp)
        reference = reference_stats(source, image_size=32, channels=1, extractor=extractor, cache_dir=cache)
        terms, weights = Reference.of(reference), resample_weights(args.num_samples, args.resamples, seed=args.seed)
        data = source.load(image_size=32, channels=1)
        held = held_out_split(len(data.images))[0][: args.num_samples]
        _, floor, _ = scored(extractor, terms, data.images[held], data.labels[held], weights,
                             features_dir / f"floor_{extractor.name}_{args.num_samples}.pt", {})  # fmt: skip
        rows, pairs = [], {}  # (key, w) -> [((set, draws), (its reference or baseline set, draws))], one per run
        for i, path in enumerate(runs):
            tag = row_tag(path)
            base = None
            if args.reference != "none":
                row = measure_row(path, args.reference, 0.0, args, device, extractor, terms, weights, features_dir, tag)
                base = row.pop("stats")
                rows.append(row)
            for g in guidances:
                row = measure_row(path, args.sampler, g, args, device, extractor, terms, weights, features_dir, tag)
                stats = row.pop("stats")
                if base is not None and g == 0:
                    row["vs_reference"] = ratio(stats, base, weights)
                    pairs.setdefault(("vs_reference", g), []).append((stats, base))
                if baselines:
                    other = baselines[i]
                    before = measure_row(other, args.sampler, g, args, device, extractor, terms, weights, features_dir,
                                         row_tag(other))  # fmt: skip
                    row["baseline"] = str(other)
                    row["vs_baseline"] = ratio(stats, before["stats"], weights)
                    pairs.setdefault(("vs_baseline", g), []).append((stats, before["stats"]))
                rows.append(row)
                print(f"{path}: {args.sampler} w={g:g} cfid {row['cfid']['value']:.2f} accuracy "
                      f"{row['accuracy']['value']:.3f}", flush=True)  # fmt: skip
    pooled = {key: mean_paired_ratio([(a, b) for (a, _), (b, _) in group], weights,
                                     drawn=[(da, db) for (_, da), (_, db) in group]).as_dict()
              for key, group in pairs.items()}  # fmt: skip
    summary = summarise(rows, pooled)
    report = {"label": args.label, "runs": [str(p) for p in runs], "baseline": [str(p) for p in baselines],
              "sampler": args.sampler, "guidance_interval": args.guidance_interval, "reference": args.reference,
              "num_samples": args.num_samples, "resamples": args.resamples, "precision": args.precision,
              "classifier": extractor.name,
              "data": data_name, "floor": floor, "rows": rows, "summary": summary}  # fmt: skip
    run.write(report, f"mnist_recipe_{args.label}.json")
    print(table(report))
    if args.plot:
        guidance_curve(report, args.plot)
    return report


def ratio(a: tuple, b: tuple, weights: torch.Tensor) -> dict:
    """paired_ratio of two (SetStatistics, draws) sets, with the draws computed once."""
    return paired_ratio(a[0], b[0], weights, drawn=(a[1], b[1])).as_dict()


def row_tag(path: Path) -> str:
    """A run's name in its rows' feature files: the folder and a digest of the weights (two runs in folders of the
    same name, whose files have the same size, are not mixed up)."""
    return f"{path.parent.name}_{file_digest(path)}"


def measure_row(path, sampler, guidance, args, device, extractor, terms, weights, features_dir, tag) -> dict:
    limited = args.guidance_interval if guidance else None  # w = 0 draws the same images with or without one
    where = f"_i{limited[0]:g}-{limited[1]:g}" if limited else ""
    where += "" if args.precision == "32" else f"_{args.precision}"  # float32 rows keep their earlier file names
    file = features_dir / f"{tag}_{sampler}_w{guidance:g}{where}_{args.num_samples}_{extractor.name}.pt"
    drawn = {"images": None, "labels": None, "nfe": None, "seconds": None}
    if not file.is_file():
        drawn = draw(path, sampler, guidance, args, device)
    extra = {"nfe": drawn["nfe"], "seconds": drawn["seconds"]}
    stats, intervals, saved = scored(extractor, terms, drawn["images"], drawn["labels"], weights, file, extra)
    if "accuracy" not in intervals:
        raise SystemExit(f"{path}: an unconditional model; mnist_recipe.py scores class-conditional runs (accuracy)")
    return {"run": str(path), "sampler": sampler, "guidance": guidance, "guidance_interval": limited,
            "nfe": saved["nfe"], "seconds": saved["seconds"], **intervals, "stats": stats}  # fmt: skip


def summarise(rows: list[dict], pooled: dict[tuple[str, float], dict]) -> list[dict]:
    """Per (sampler, guidance): the mean and spread over the runs of cfid, accuracy and the paired ratios, and each
    ratio's mean over the runs with its interval over the images (`pooled`: bootstrap.mean_paired_ratio per (key,
    w), the runs' models held fixed)."""
    out = []
    for sampler, g in dict.fromkeys((r["sampler"], r["guidance"]) for r in rows):
        group = [r for r in rows if (r["sampler"], r["guidance"]) == (sampler, g)]
        item = {"sampler": sampler, "guidance": g, "runs": len(group)}
        for name in ("cfid", "accuracy"):
            item[name] = spread([r[name]["value"] for r in group])
        for key in ("vs_reference", "vs_baseline"):
            if all(key in r for r in group):
                item[key] = spread([r[key]["value"] for r in group])
                item[f"{key}_high"] = max(r[key]["high"] for r in group)
                item[f"{key}_pooled"] = pooled[(key, g)]
        out.append(item)
    return out


def table(report: dict) -> str:
    floor = report["floor"]["cfid"]["value"]
    lines = [f"| {report['label']} | NFE | w | cfid@{report['num_samples']} mean [min-max] | x floor | accuracy mean "
             "[min-max] | vs reference mean [min-max] (95%) | vs baseline mean [min-max] (95%) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    nfe = {(r["sampler"], r["guidance"]): r["nfe"] for r in report["rows"]}
    for s in report["summary"]:
        c, a = s["cfid"], s["accuracy"]
        versus, baseline = (_ratio(s.get(key), s.get(f"{key}_pooled")) for key in ("vs_reference", "vs_baseline"))
        lines.append(
            f"| {s['sampler']} | {nfe[(s['sampler'], s['guidance'])]} | {s['guidance']:g} | {c['mean']:.2f} "
            f"[{c['min']:.2f}-{c['max']:.2f}] | {c['mean'] / floor:.2f} | {a['mean']:.3f} "
            f"[{a['min']:.3f}-{a['max']:.3f}] | {versus} | {baseline} |"
        )
    f = report["floor"]
    lines.append(f"| floor (real held-out digits) | | | {floor:.2f} [{f['cfid']['low']:.2f}, {f['cfid']['high']:.2f}] "
                 f"| 1.00 | {f['accuracy']['value']:.3f} | | |")  # fmt: skip
    return "\n".join(lines)


def _ratio(ratio: dict | None, pooled: dict | None) -> str:
    if not ratio:
        return "-"
    spread = f"{ratio['mean']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]"
    return f"{spread} (95%: {pooled['low']:.3f}-{pooled['high']:.3f})"


def guidance_curve(report: dict, path: Path) -> None:
    """cfid (x floor) and accuracy against the guidance weight w, the sampler's rows: mean over runs, min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = sorted((s for s in report["summary"] if s["sampler"] == report["sampler"]), key=lambda s: s["guidance"])
    w, floor = [s["guidance"] for s in rows], report["floor"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, name, level, label in ((left, "cfid", floor["cfid"]["value"], f"cfid@{report['num_samples']}"),
                                   (right, "accuracy", floor["accuracy"]["value"], "accuracy (as asked)")):  # fmt: skip
        mean = [s[name]["mean"] for s in rows]
        low = [m - s[name]["min"] for m, s in zip(mean, rows, strict=True)]
        high = [s[name]["max"] - m for m, s in zip(mean, rows, strict=True)]
        ax.errorbar(
            w, mean, yerr=[low, high], marker="o", capsize=3, label=f"{report['label']} ({rows[0]['runs']} runs)"
        )
        ax.axhline(level, color="grey", linestyle="--", label=f"floor: {report['num_samples']} real held-out digits")
        ax.set(xlabel="guidance weight w", ylabel=label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['sampler']}, {report['num_samples']} samples per point")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
