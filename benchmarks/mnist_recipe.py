"""An MNIST recipe's quality, as docs/mnist.md reports it, and the sampler table of docs/benchmarks.md: per run
(seed), --num-samples images per sampler and guidance weight, scored by mnist_quality.py's classifier (cfid, ckid,
accuracy as asked), the paired cfid ratio to a --reference sampler at w = 0 and to --baseline runs, the floor (real
held-out digits) and, for a latent run, its VAE's reconstructions of them (the best anything decoded through it can
score); with several samplers, the fewest-calls one within the reference's noise. Resumable per row.

    python benchmarks/mnist_recipe.py --runs outputs/mnist_s1,outputs/mnist_s2 --guidance 0,0.5,1 --reference ddpm1000
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import common
import torch
from mnist_quality import Scored, Scorer

from ddpm.diffusion.generate import to_uint8
from ddpm.diffusion.network import compile_network
from ddpm.metrics.features import file_digest
from ddpm.metrics.fid import DEFAULT_CACHE_DIR
from ddpm.sampling.runtime import default_batch_size, guidance_interval, load_decoder, resolve_sampling_precision
from ddpm.weights import load_model

SMOKE = {"num_samples": 8, "resamples": 20, "guidance": "0", "reference": "dpm++sde15", "sampler": "ddim4",
         "compile_backend": "eager"}  # fmt: skip


def interval(text: str) -> tuple[float, float]:
    try:
        return guidance_interval([float(v) for v in text.split(",")], key="--guidance-interval")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--runs", required=True, help="comma-separated run folders (their ema.pt) or weights files")
    add("--label", default="recipe", help="the recipe's name in the JSON and the table")
    add("--sampler", default="dpm++sde25", help=f"comma-separated presets of {', '.join(common.SAMPLERS)}")
    add("--guidance", default="0", help="comma-separated guidance weights")
    add("--guidance-interval", type=interval, default=None, help="sigma_lo,sigma_hi: guide only there (sample.py's)")
    add("--reference", default="none", help="a sampler preset at w = 0 for the paired ratio, or none")
    add("--baseline", help="comma-separated runs of the recipe to compare with, paired with --runs (seeds)")
    add("--num-samples", type=int, default=500)
    add("--resamples", type=int, default=400, help="bootstrap resamples per interval")
    add("--classifier", type=Path, help="default: benchmarks/results/mnist_classifier.pt")
    add("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder")
    add("--cache-dir", default=DEFAULT_CACHE_DIR, help="reference statistics cache")
    add("--features-dir", type=Path, help="each row's features (resume); default outputs/recipe_features")
    add("--seed", type=int, default=0)
    add("--precision", default="auto", help="the network calls: auto (sample.py's), 32 or bf16")
    add("--compile", action="store_true", help="torch.compile each run's network once (an untimed draw first)")
    add("--compile-backend", default="inductor", help="torch.compile backend (with --compile)")
    add("--plot", type=Path, help="PNG: cfid and accuracy against w (runs' mean, min-max)")
    common.add_arguments(p, repeats=None)
    return p


class Rows:
    """Draws (or reads back from --features-dir) and scores the rows of every run; each run's model loaded once."""

    def __init__(self, args: argparse.Namespace, device: torch.device, scorer: Scorer, folder: Path) -> None:
        self.args, self.device, self.scorer, self.folder, self.models = args, device, scorer, folder, {}

    def model(self, path: Path) -> tuple:
        if path not in self.models:
            loaded, args = load_model(path, self.device), self.args
            net = loaded.net.to(memory_format=torch.channels_last)
            net = compile_network(net, args.compile_backend) if args.compile else net
            vae = load_decoder(loaded.config.get("latent"), self.device)  # a latent model: decoded as sample.py does
            options = {"precision": args.precision, "seed": args.seed, "decode": vae.decode if vae else None,
                       "compile": args.compile, "compile_backend": args.compile_backend}  # fmt: skip
            for g in [float(g) for g in args.guidance.split(",")] if args.compile else []:  # the compile: untimed,
                rows = min(default_batch_size(self.device, guided=g != 0), args.num_samples)  # at the timed shape
                common.draw(net, loaded.diffusion, common.sampler("ddim", 2), rows, self.device, guidance=g, **options)
            self.models[path] = net, loaded.diffusion, options, vae
        return self.models[path]

    def ceiling(self, path: Path) -> dict | None:
        """A latent run's VAE reconstructing the floor's held-out digits (a posterior sample, decoded as sample.py
        decodes): the best a model decoded through it can score. None for a pixel model. A run whose rows were all
        read back is not prepared (compiled) for this: only its config is read, for the VAE."""
        loaded = self.models.get(path)
        vae = loaded[3] if loaded else load_decoder(load_model(path, self.device).config.get("latent"), self.device)
        if vae is None:
            return None
        images, labels = self.scorer.held_out(self.args.num_samples)
        mean, logvar = vae.encode(images)
        noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(self.args.seed)).to(mean.device)
        return self.scorer.score(to_uint8(vae.decode(vae.to_diffusion(mean, logvar, noise))).cpu(), labels).intervals

    def __call__(self, path: Path, sampler: str, guidance: float) -> tuple[dict, Scored]:
        args, limited = self.args, self.args.guidance_interval if guidance else None  # w = 0: the same either way
        where = (f"_i{limited[0]:g}-{limited[1]:g}" if limited else "") + ("" if args.precision == "32" else
                                                                            f"_{args.precision}")  # fmt: skip
        tag = f"{path.parent.name}_{file_digest(path)}"  # two runs in folders of the same name are not mixed up
        seed = f"_s{args.seed}" if args.seed else ""  # seed 0: the files' names before --seed
        file = self.folder / f"{tag}_{sampler}_w{guidance:g}{where}{seed}_{args.num_samples}_{self.scorer.name}.pt"
        if file.is_file():
            scored = self.scorer.score(file=file)
        else:
            net, diffusion, options, _ = self.model(path)
            out = common.draw(net, diffusion, common.sampler(sampler), args.num_samples, self.device,
                              guidance=guidance, interval=limited, **options)  # fmt: skip
            scored = self.scorer.score(out.images, out.labels, file=file, nfe=out.nfe, seconds=out.seconds)
        if "accuracy" not in scored.intervals:
            raise SystemExit(f"{path}: an unconditional model; mnist_recipe.py scores class-conditional runs")
        return {"run": str(path), "sampler": sampler, "guidance": guidance, "guidance_interval": limited,
                **scored.saved, **scored.intervals}, scored  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    run = common.start(__file__, p, argv, smoke=SMOKE)
    args, device = run.args, run.device
    args.precision = resolve_sampling_precision(args.precision, device, key="--precision")
    try:
        samplers = common.parse_rows(args.sampler, common.SAMPLERS, flag="--sampler")
    except ValueError as error:
        p.error(str(error))
    runs, baselines = ([Path(r) / "ema.pt" if Path(r).is_dir() else Path(r) for r in (text or "").split(",") if r]
                       for text in (args.runs, args.baseline))  # fmt: skip
    if baselines and len(baselines) != len(runs):
        raise SystemExit(f"--baseline names {len(baselines)} runs, --runs {len(runs)}: pair them one to one (seeds)")
    weights = [float(g) for g in args.guidance.split(",")]
    rows, pairs = [], {}  # (key, sampler, w) -> [(set, its reference or baseline set)], one per run
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
                rows += [] if args.reference in samplers and 0.0 in weights else [reference]
            for sampler, g in ((s, g) for s in samplers for g in weights):
                item, scored = row(path, sampler, g)
                if base is not None and g == 0:
                    item["vs_reference"] = scorer.ratio(scored, base)
                    pairs.setdefault(("vs_reference", sampler, g), []).append((scored, base))
                if baselines:
                    before = row(baselines[i], sampler, g)[1]
                    item.update(baseline=str(baselines[i]), vs_baseline=scorer.ratio(scored, before))
                    pairs.setdefault(("vs_baseline", sampler, g), []).append((scored, before))
                rows.append(item)
                print(f"{path}: {sampler} w={g:g} cfid {item['cfid']['value']:.2f} accuracy "
                      f"{item['accuracy']['value']:.3f}", flush=True)  # fmt: skip
        ceilings = {str(path): c for path in runs if (c := row.ceiling(path)) is not None}
        pooled = {key: scorer.mean_ratio(group) for key, group in pairs.items()}
    summary = summarise(rows, pooled, args.num_samples)
    report = {"label": args.label, "runs": [str(p) for p in runs], "baseline": [str(p) for p in baselines],
              "sampler": args.sampler, "guidance_interval": args.guidance_interval, "reference": args.reference,
              "num_samples": args.num_samples, "resamples": args.resamples, "precision": args.precision,
              "compile": args.compile, "classifier": scorer.name, "data": scorer.data, "floor": floor,
              "vae_ceiling": ceilings, "rows": rows,
              "summary": summary, "fastest_within_noise": fastest_within_noise(summary)}  # fmt: skip
    run.write(report, f"mnist_recipe_{args.label}.json")
    print(show(report))
    if args.plot:
        guidance_curve(report, samplers[0], args.plot)
    return report


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "runs": values}


def summarise(rows: list[dict], pooled: dict[tuple[str, str, float], dict], num: int) -> list[dict]:
    """Per (sampler, guidance): the mean and spread over the runs of cfid, ckid, accuracy, images/s and the paired
    ratios, and each ratio's mean over the runs with its interval over the images (`pooled`: the models held fixed)."""
    out = []
    for sampler, g in dict.fromkeys((r["sampler"], r["guidance"]) for r in rows):
        group = [r for r in rows if (r["sampler"], r["guidance"]) == (sampler, g)]
        item = {"sampler": sampler, "guidance": g, "runs": len(group), "nfe": group[0]["nfe"], "images_per_s": None}
        if all("seconds" in r for r in group):  # each row's own wall time
            item["images_per_s"] = statistics.fmean(num / r["seconds"] for r in group)
        item.update({name: spread([r[name]["value"] for r in group]) for name in ("cfid", "ckid", "accuracy")})
        for key in ("vs_reference", "vs_baseline"):
            if all(key in r for r in group):
                item.update({key: spread([r[key]["value"] for r in group]), f"{key}_pooled": pooled[(key, sampler, g)],
                             f"{key}_high": max(r[key]["high"] for r in group)})  # fmt: skip
        out.append(item)
    return out


def fastest_within_noise(rows: list[dict], name: str = "sampler", ratio: str = "vs_reference_pooled") -> tuple:
    """Per guidance, the samplers whose cfid is not worse than the reference's beyond the noise (the paired ratio's
    interval reaches 1 or lies below it); and the one with the fewest network calls that is so at every guidance with
    ratios (ties: the lower unguided ratio), None without unguided ratios. sample.py's default is this choice on the
    committed sampler table (tests/test_config.py)."""
    ok, drawn = {}, {r["guidance"] for r in rows if r.get(ratio) is not None}
    for r in rows:
        if r.get(ratio) is not None and r[ratio]["low"] <= 1.0:
            ok.setdefault(r["guidance"], []).append(r[name])
    if 0.0 not in drawn:
        return None, ok
    every = set.intersection(*(set(ok.get(g, [])) for g in drawn))
    unguided = {r[name]: (r["nfe"], r[ratio]["value"]) for r in rows if r["guidance"] == 0.0 and r.get(ratio)}
    return (min(every, key=unguided.__getitem__) if every else None), ok


def show(report: dict) -> str:
    f, n = report["floor"], report["num_samples"]

    def ratio(s: dict, key: str) -> str:
        r, p = s.get(key), s.get(f"{key}_pooled")
        return f"{r['mean']:.3f} [{r['min']:.3f}-{r['max']:.3f}] (95%: {p['low']:.3f}-{p['high']:.3f})" if r else "-"

    rows = [[s["sampler"], s["nfe"], f"{s['guidance']:g}", f"{s['cfid']['mean']:.2f} [{s['cfid']['min']:.2f}-"
             f"{s['cfid']['max']:.2f}]", f"{s['cfid']['mean'] / f['cfid']['value']:.2f}",
             f"{s['accuracy']['mean']:.3f} [{s['accuracy']['min']:.3f}-{s['accuracy']['max']:.3f}]",
             f"{1e3 * s['ckid']['mean']:.1f}", ratio(s, "vs_reference"), ratio(s, "vs_baseline"),
             s["images_per_s"]] for s in report["summary"]]  # fmt: skip
    rows.append(real_row("floor (real held-out digits)", f, f))
    rows += [real_row(f"its VAE's reconstructions ({run})", c, f) for run, c in report.get("vae_ceiling", {}).items()]
    best, ok = report["fastest_within_noise"]
    return "\n".join([common.table([report["label"], "NFE", "w", f"cfid@{n} mean [min-max]", "x floor",
                                    "accuracy mean [min-max]", f"ckid@{n} x1e3", "vs reference mean [min-max] (95%)",
                                    "vs baseline mean [min-max] (95%)", "images/s"], rows),
                      *([f"within the noise of {report['reference']}: " + "; ".join(
                          f"w = {g:g}: {', '.join(names)}" for g, names in sorted(ok.items())) +
                         f"; fewest network calls at every weight with ratios: {best}"] if ok else [])])  # fmt: skip


def real_row(name: str, scored: dict, floor: dict) -> list:
    """show()'s row of a set drawn by no sampler: the held-out digits, or a VAE's reconstructions of them."""
    cfid, ratio = scored["cfid"], scored["cfid"]["value"] / floor["cfid"]["value"]
    value = f"{cfid['value']:.2f} [{cfid['low']:.2f}, {cfid['high']:.2f}]"
    return [name, "", "", value, f"{ratio:.2f}", f"{scored['accuracy']['value']:.3f}", "", "", "", ""]


def guidance_curve(report: dict, sampler: str, path: Path) -> None:
    """cfid (x floor) and accuracy against the guidance weight w, the sampler's rows: mean over runs, min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = sorted((s for s in report["summary"] if s["sampler"] == sampler), key=lambda s: s["guidance"])
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
    fig.suptitle(f"{sampler}, {n} samples per point")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
