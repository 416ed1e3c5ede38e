"""An MNIST recipe's quality, as docs/mnist.md reports it: per training run (seed), 500 samples per guidance weight
with one sampler, scored by the MNIST classifier (scoring.py); a reference sampler for the paired ratio; the floor.

    python train.py experiment=mnist data.root=../shared/data/mnist seed=1 hydra.run.dir=outputs/mnist_s1  # x 3 seeds
    python benchmarks/mnist_recipe.py --runs outputs/mnist_s1,outputs/mnist_s2,outputs/mnist_s3 --label after \
        --guidance 0,0.5,1,1.5,2,3 --reference ddpm1000

--sampler / --reference: presets of common.SAMPLERS. floor: 500 real digits the classifier never saw. vs reference:
each run's cfid ratio to --reference at w = 0 on the same model, paired; vs baseline: with --baseline (runs of
another recipe, paired with --runs in order: the same seed) the ratio of each run to its baseline run at every
weight. Per weight: the mean over the runs and their spread (min-max); for the ratios also the mean's 95% interval
over the images, the runs' models held fixed. --guidance-interval lo,hi: w > 0 guides only where sigma_t is in
(lo, hi]. --precision: the network calls as sample.py's (auto: bf16 on CUDA and AMX CPUs, else 32). Resumable: each
row's features are kept in --features-dir, named by the run's folder and weights digest, the sampler, guidance,
interval, precision, count and classifier. --smoke: 8 samples, 1 weight, cheap samplers.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import common
import torch
from scoring import Scored, Scorer

from ddpm.metrics.features import file_digest
from ddpm.metrics.fid import DEFAULT_CACHE_DIR
from ddpm.sampling.runtime import guidance_interval, load_decoder, resolve_sampling_precision
from ddpm.weights import load_model

SMOKE = {"num_samples": 8, "resamples": 20, "guidance": "0", "reference": "dpm++sde15", "sampler": "ddim4"}


def interval(text: str) -> tuple[float, float]:
    try:
        return guidance_interval([float(v) for v in text.split(",")], key="--guidance-interval")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="comma-separated run folders (their ema.pt) or weights files")
    p.add_argument("--label", default="recipe", help="the recipe's name in the JSON and the table")
    p.add_argument("--sampler", default="dpm++sde25", choices=list(common.SAMPLERS), help="every row's sampler")
    p.add_argument("--guidance", default="0", help="comma-separated guidance weights")
    p.add_argument("--guidance-interval", type=interval, default=None, help="sigma_lo,sigma_hi (sample.py's)")
    p.add_argument("--reference", default="none", help="a sampler preset at w = 0 for the paired ratio, or none")
    p.add_argument("--baseline", help="comma-separated runs of the recipe to compare with, paired with --runs")
    p.add_argument("--num-samples", type=int, default=500)
    p.add_argument("--resamples", type=int, default=400, help="bootstrap resamples per interval")
    p.add_argument("--classifier", type=Path, help="default: benchmarks/results/mnist_classifier.pt")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="reference statistics cache")
    p.add_argument("--features-dir", type=Path, help="each row's features (resume); default outputs/recipe_features")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto", help="the network calls: auto, 32 or bf16")
    p.add_argument("--plot", type=Path, help="PNG: cfid and accuracy against w (runs' mean, min-max)")
    common.add_arguments(p, repeats=None)
    return p


class Rows:
    """Draws (or reads back) and scores the rows of every run."""

    def __init__(self, args: argparse.Namespace, device: torch.device, scorer: Scorer, folder: Path) -> None:
        self.args, self.device, self.scorer, self.folder = args, device, scorer, folder

    def __call__(self, path: Path, sampler: str, guidance: float) -> tuple[dict, Scored]:
        args, limited = self.args, self.args.guidance_interval if guidance else None  # w = 0: the same either way
        where = (f"_i{limited[0]:g}-{limited[1]:g}" if limited else "") + ("" if args.precision == "32" else
                                                                            f"_{args.precision}")  # fmt: skip
        tag = f"{path.parent.name}_{file_digest(path)}"  # two runs in folders of the same name are not mixed up
        file = self.folder / f"{tag}_{sampler}_w{guidance:g}{where}_{args.num_samples}_{self.scorer.name}.pt"
        if file.is_file():
            scored = self.scorer.score(file=file)
        else:
            loaded = load_model(path, self.device)
            net = loaded.net.to(memory_format=torch.channels_last)
            vae = load_decoder(loaded.config.get("latent"), self.device)  # a latent model: decoded as sample.py does
            options = {"guidance": guidance, "interval": limited, "precision": args.precision, "seed": args.seed,
                       "decode": vae.decode if vae else None}  # fmt: skip
            out = common.draw(net, loaded.diffusion, common.sampler(sampler), args.num_samples, self.device, **options)
            scored = self.scorer.score(out.images, out.labels, file=file, nfe=out.nfe, seconds=out.seconds)
        if "accuracy" not in scored.intervals:
            raise SystemExit(f"{path}: an unconditional model; mnist_recipe.py scores class-conditional runs")
        return {"run": str(path), "sampler": sampler, "guidance": guidance, "guidance_interval": limited,
                **scored.saved, **scored.intervals}, scored  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    run = common.start(__file__, parser(), argv, smoke=SMOKE)
    args, device = run.args, run.device
    args.precision = resolve_sampling_precision(args.precision, device, key="--precision")
    runs, baselines = ([Path(r) / "ema.pt" if Path(r).is_dir() else Path(r) for r in (text or "").split(",") if r]
                       for text in (args.runs, args.baseline))  # fmt: skip
    if baselines and len(baselines) != len(runs):
        raise SystemExit(f"--baseline names {len(baselines)} runs, --runs {len(runs)}: pair them one to one (seeds)")
    rows, pairs = [], {}  # (key, w) -> [(set, its reference or baseline set)], one per run
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.features_dir or (Path(tmp) if args.smoke else common.REPO / "outputs/recipe_features")
        folder.mkdir(parents=True, exist_ok=True)
        scorer = Scorer(classifier=args.classifier, data_root=args.data_root, smoke=args.smoke, folder=Path(tmp),
                        device=device, num=args.num_samples, resamples=args.resamples, seed=args.seed,
                        cache_dir=args.cache_dir)  # fmt: skip
        floor = scorer.floor(args.num_samples, folder / f"floor_{scorer.name}_{args.num_samples}.pt").intervals
        row = Rows(args, device, scorer, folder)
        for i, path in enumerate(runs):
            base = None
            if args.reference != "none":
                reference, base = row(path, args.reference, 0.0)
                rows.append(reference)
            for g in [float(g) for g in args.guidance.split(",")]:
                item, scored = row(path, args.sampler, g)
                if base is not None and g == 0:
                    item["vs_reference"] = scorer.ratio(scored, base)
                    pairs.setdefault(("vs_reference", g), []).append((scored, base))
                if baselines:
                    before = row(baselines[i], args.sampler, g)[1]
                    item.update(baseline=str(baselines[i]), vs_baseline=scorer.ratio(scored, before))
                    pairs.setdefault(("vs_baseline", g), []).append((scored, before))
                rows.append(item)
                print(f"{path}: {args.sampler} w={g:g} cfid {item['cfid']['value']:.2f} accuracy "
                      f"{item['accuracy']['value']:.3f}", flush=True)  # fmt: skip
        pooled = {key: scorer.mean_ratio(group) for key, group in pairs.items()}
    report = {"label": args.label, "runs": [str(p) for p in runs], "baseline": [str(p) for p in baselines],
              "sampler": args.sampler, "guidance_interval": args.guidance_interval, "reference": args.reference,
              "num_samples": args.num_samples, "resamples": args.resamples, "precision": args.precision,
              "classifier": scorer.name, "data": scorer.data, "floor": floor, "rows": rows,
              "summary": summarise(rows, pooled)}  # fmt: skip
    run.write(report, f"mnist_recipe_{args.label}.json")
    print(show(report))
    if args.plot:
        guidance_curve(report, args.plot)
    return report


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "runs": values}


def summarise(rows: list[dict], pooled: dict[tuple[str, float], dict]) -> list[dict]:
    """Per (sampler, guidance): the mean and spread over the runs of cfid, accuracy and the paired ratios, and each
    ratio's mean over the runs with its interval over the images (`pooled`, the runs' models held fixed)."""
    out = []
    for sampler, g in dict.fromkeys((r["sampler"], r["guidance"]) for r in rows):
        group = [r for r in rows if (r["sampler"], r["guidance"]) == (sampler, g)]
        item = {"sampler": sampler, "guidance": g, "runs": len(group)}
        item.update({name: spread([r[name]["value"] for r in group]) for name in ("cfid", "accuracy")})
        for key in ("vs_reference", "vs_baseline"):
            if all(key in r for r in group):
                item.update({key: spread([r[key]["value"] for r in group]), f"{key}_pooled": pooled[(key, g)],
                             f"{key}_high": max(r[key]["high"] for r in group)})  # fmt: skip
        out.append(item)
    return out


def show(report: dict) -> str:
    floor, f = report["floor"]["cfid"]["value"], report["floor"]
    nfe = {(r["sampler"], r["guidance"]): r["nfe"] for r in report["rows"]}

    def ratio(s: dict, key: str) -> str:
        r, p = s.get(key), s.get(f"{key}_pooled")
        return f"{r['mean']:.3f} [{r['min']:.3f}-{r['max']:.3f}] (95%: {p['low']:.3f}-{p['high']:.3f})" if r else "-"

    rows = [[s["sampler"], nfe[(s["sampler"], s["guidance"])], f"{s['guidance']:g}",
             f"{s['cfid']['mean']:.2f} [{s['cfid']['min']:.2f}-{s['cfid']['max']:.2f}]",
             f"{s['cfid']['mean'] / floor:.2f}",
             f"{s['accuracy']['mean']:.3f} [{s['accuracy']['min']:.3f}-{s['accuracy']['max']:.3f}]",
             ratio(s, "vs_reference"), ratio(s, "vs_baseline")] for s in report["summary"]]  # fmt: skip
    floor_cfid = f"{floor:.2f} [{f['cfid']['low']:.2f}, {f['cfid']['high']:.2f}]"
    rows.append(["floor (real held-out digits)", "", "", floor_cfid, "1.00", f"{f['accuracy']['value']:.3f}", "", ""])
    return common.table([report["label"], "NFE", "w", f"cfid@{report['num_samples']} mean [min-max]", "x floor",
                         "accuracy mean [min-max]", "vs reference mean [min-max] (95%)",
                         "vs baseline mean [min-max] (95%)"], rows)  # fmt: skip


def guidance_curve(report: dict, path: Path) -> None:
    """cfid (x floor) and accuracy against the guidance weight w, the sampler's rows: mean over runs, min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = sorted((s for s in report["summary"] if s["sampler"] == report["sampler"]), key=lambda s: s["guidance"])
    w, n, floor = [s["guidance"] for s in rows], report["num_samples"], report["floor"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, name, label in zip(axes, ("cfid", "accuracy"), (f"cfid@{n}", "accuracy (as asked)"), strict=True):
        mean = [s[name]["mean"] for s in rows]
        bars = [[m - s[name]["min"] for m, s in zip(mean, rows, strict=True)],
                [s[name]["max"] - m for m, s in zip(mean, rows, strict=True)]]  # fmt: skip
        ax.errorbar(w, mean, yerr=bars, marker="o", capsize=3, label=f"{report['label']} ({rows[0]['runs']} runs)")
        ax.axhline(floor[name]["value"], color="grey", linestyle="--", label=f"floor: {n} real held-out digits")
        ax.set(xlabel="guidance weight w", ylabel=label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['sampler']}, {n} samples per point")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
