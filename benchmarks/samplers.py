"""Samplers x steps x guidance on a trained MNIST model: classifier FID, conditional accuracy, speed.

    python train.py experiment=mnist data.root=../shared/data/mnist
    python benchmarks/mnist_quality.py --save-classifier mnist_classifier.pt        # optional, else trained here
    python benchmarks/samplers.py --ckpt outputs/.../ema.pt --classifier mnist_classifier.pt [--num-samples 1000]
    python benchmarks/samplers.py --ckpt ... --configs ddim50,dpm++10 --guidance 0,3    # a subset

Resumable: every row is written to --out (and its classifier features to --features-dir) as soon as it finishes;
the same command run again skips the rows already there (same checkpoint, samples, seed, batch, precision and
commit), so the table can be built across sessions. Rows run cheapest first (NFE x guided batch). The JSON carries
benchmarks/common.py's provenance (a dirty tree is refused unless --allow-dirty). --smoke: 8 samples of two cheap
configurations, a quick classifier, nothing written but --out (and --docs if given).

For every configuration the same N images are drawn (labels 0..9 in turn, same seeds): the FID is the
"classifier FID" (`cfid@N`: the classifier's penultimate features, against the statistics of every MNIST
image in --data-root, cached), the accuracy is how often the classifier reads the requested label. The
classifier KID (`ckid@N`) is unbiased in N, so it stays comparable where FID's small-sample bias (1024-d
features) dominates.
NFE counts network calls per image trajectory; with guidance each call runs the conditional and the
unconditional half in one doubled batch. images/s is each row's own wall time (GPU: synchronised); rows resumed
from another session were timed there. Sampling runs as sample.py's defaults do (--precision auto: bf16 network
calls where the device runs bf16 natively; --compile to compile the network).
Intervals: 95% bootstrap over the N images (ddpm.metrics.bootstrap: --resamples resamples, centred on the value);
"vs DDPM-1000" is the cfid ratio to ddpm1000 at the same guidance, both sets resampled together (image i of
every row has the same label and initial noise).
Prints a table, writes JSON under benchmarks/results/ and a section of docs/benchmarks.md.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import common
import torch

from ddpm.diffusion.generate import class_cycle, compile_network, generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.samplers.dpm_solver import DPMSolverSampler
from ddpm.diffusion.samplers.dpm_solver_sde import DPMSolverSDESampler
from ddpm.diffusion.samplers.edm import EDMSampler
from ddpm.diffusion.samplers.restart import RestartSampler
from ddpm.metrics.bootstrap import Reference, SetStatistics, bootstrap, draws, paired_ratio, resample_weights
from ddpm.metrics.classifier import classifier_file
from ddpm.metrics.features import FeatureExtractor, classifier_extractor
from ddpm.metrics.fid import DEFAULT_CACHE_DIR, count_tag, kernel_distance, reference_stats
from ddpm.sampling.runtime import default_batch_size, resolve_sampling_precision
from ddpm.weights import load_model

REPO = common.REPO
CONFIGS = {  # name -> (sampler class, constructor arguments)
    "ddpm1000": (DDPMSampler, {"steps": None}),
    "ddpm250": (DDPMSampler, {"steps": 250}),
    "ddim100": (DDIMSampler, {"steps": 100}),
    "ddim50": (DDIMSampler, {"steps": 50}),
    "ddim20": (DDIMSampler, {"steps": 20}),
    "dpm++20": (DPMSolverSampler, {"steps": 20}),
    "dpm++10": (DPMSolverSampler, {"steps": 10}),
    "dpm++sde15": (DPMSolverSDESampler, {"steps": 15}),
    "dpm++sde20": (DPMSolverSDESampler, {"steps": 20}),
    "dpm++sde25": (DPMSolverSDESampler, {"steps": 25}),
    "edm13": (EDMSampler, {"steps": 13}),  # deterministic Heun, 25 NFE
    "edm13_churn": (EDMSampler, {"steps": 13, "churn": 40.0, "s_tmin": 0.05, "s_tmax": 50.0, "s_noise": 1.003}),
    "restart": (RestartSampler, {"steps": 9, "restarts": 2, "restart_steps": 2, "t_min": 0.06, "t_max": 0.30}),
}
BEGIN, END = "<!-- benchmarks/samplers.py: begin -->", "<!-- benchmarks/samplers.py: end -->"
SMOKE = {"num_samples": 8, "resamples": 20, "epochs": 1, "configs": "ddim20,dpm++10", "compile_backend": "eager"}


def get_classifier(args: argparse.Namespace, source, tmp: Path) -> FeatureExtractor:
    """The classifier file given, or one trained here on --data-root (ddpm.metrics.classifier; under --smoke a
    quick one in a temp folder, never where a real run looks)."""
    if args.classifier:
        return classifier_extractor(args.classifier)
    path = tmp / "classifier.pt" if args.smoke and not args.save_classifier.is_file() else args.save_classifier
    return classifier_extractor(classifier_file(path, source=source, epochs=args.epochs))  # smoke: source is cut


def nfe_cost(name: str, guidance: float) -> int:
    """Network rows per image of one configuration: its network_evaluations() (else its steps), doubled with guidance
    (rows run cheapest first)."""
    cls, kwargs = CONFIGS[name]
    sampler = cls(**kwargs)
    calls = sampler.network_evaluations() if hasattr(sampler, "network_evaluations") else kwargs["steps"] or 1000
    return calls * (2 if guidance else 1)


def measure(net, loaded, sampler, guidance: float, args: argparse.Namespace, device: torch.device) -> dict:
    """Draw the N images with one configuration; time it; return speed and the generated batch."""
    diffusion = loaded.diffusion
    labels = class_cycle(args.num_samples, net.num_classes) if net.num_classes is not None else None
    common.sync(device)
    began = time.perf_counter()
    out = generate(
        net=net,
        betas=diffusion.betas64(),
        prediction=diffusion.prediction,
        sigma_data=diffusion.sigma_data,
        sampler=sampler,
        image_shape=(net.in_channels, net.image_size, net.image_size),
        num_samples=args.num_samples,
        labels=labels,
        null_class=net.num_classes,
        guidance=guidance,
        seed=args.seed,
        batch_size=batch_for(args, guidance, device),
        device=device,
        precision=args.precision,
        compile=args.compile,
        compile_backend=args.compile_backend,
    )
    common.sync(device)
    return {"out": out, "seconds": time.perf_counter() - began}


def batch_for(args: argparse.Namespace, guidance: float, device: torch.device) -> int:
    """--batch-size, or sample.py's auto batch for this guidance (its [cond; uncond] call doubles the rows)."""
    return int(args.batch_size) if args.batch_size != "auto" else default_batch_size(device, guided=guidance != 0)


def interval(p: dict, scale: float = 1.0, spec: str = ".2f") -> str:
    return f"{scale * p['value']:{spec}} [{scale * p['low']:{spec}}, {scale * p['high']:{spec}}]"


def fastest_within_noise(rows: list[dict]) -> tuple[str | None, dict[float, list[str]]]:
    """The configurations whose cfid is not worse than DDPM-1000's beyond the noise (the paired ratio's interval
    reaches 1 or lies below it), per guidance, and the fastest (fewest network calls) that is so at every guidance
    DDPM-1000 was drawn at; among equally fast ones, the lowest unguided ratio. sample.py's default is this choice
    on the committed table (tests/test_config.py)."""
    ok: dict[float, list[str]] = {}
    for r in rows:
        if r.get("vs_ddpm1000") is not None and r["vs_ddpm1000"]["low"] <= 1.0:
            ok.setdefault(r["guidance"], []).append(r["config"])
    drawn = {r["guidance"] for r in rows if r["config"] == "ddpm1000"}
    if 0.0 not in drawn:
        return None, ok
    common = set.intersection(*(set(ok.get(g, [])) for g in drawn))
    unguided = {r["config"]: (r["nfe"], r["vs_ddpm1000"]["value"]) for r in rows if r["guidance"] == 0.0}
    return (min(common, key=unguided.__getitem__) if common else None), ok


def markdown(rows: list[dict], meta: dict) -> str:
    tag = count_tag(meta["num_samples"])
    m = meta["provenance"]
    lines = [
        f"### Samplers on MNIST ({meta['num_samples']} samples, {m['cpu'] if m['gpu'] is None else m['gpu']}, "
        f"{m['cpu_capability']} ({' '.join(k for k, v in m['cpu_flags'].items() if v)}), {m['threads']} threads, "
        f"torch {m['torch']}, commit {(m['commit'] or 'none')[:7]}{' (dirty)' if m['dirty'] else ''})",
        "",
        f"| sampler | NFE | guidance | cfid@{tag} [95%] | vs DDPM-1000 [95%] | ckid@{tag} x1e3 [95%] | accuracy [95%] "
        "| images/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = interval(r["vs_ddpm1000"], spec=".3f") if r.get("vs_ddpm1000") else "-"
        acc = interval(r["accuracy"], spec=".3f") if r.get("accuracy") else "-"
        lines.append(
            f"| {r['config']} | {r['nfe']} | {r['guidance']:g} | {interval(r['cfid'])} | {ratio} | "
            f"{interval(r['ckid'], 1e3)} | {acc} | {r['images_per_s']:.2f} |"
        )
    best, ok = fastest_within_noise(rows)
    lines += [
        "",
        "Within the noise of DDPM-1000 (paired cfid ratio's interval reaches 1 or lies below): "
        + "; ".join(f"guidance {g:g}: {', '.join(names)}" for g, names in sorted(ok.items()))
        + f". Fastest at every guidance with a DDPM-1000 row: **{best or 'none'}**.",
        "",
        f"`{meta['command']}` (precision {meta['precision']}, compile {meta['compile']}, batch {meta['batch_size']});"
        f" cfid: classifier FID against the statistics of {meta['reference']}; ckid: classifier KID (unbiased "
        f"MMD^2); [95%]: bootstrap over the {meta['num_samples']} images ({meta['resamples']} resamples, centred on "
        "the value); vs DDPM-1000: the cfid ratio, paired resamples. images/s: each row's own wall time.",
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, required=True, help="the run's ema.pt (or a .ckpt)")
    p.add_argument("--classifier", type=Path, help="TorchScript classifier (mnist_quality.py --save-classifier)")
    p.add_argument(
        "--save-classifier",
        type=Path,
        default=common.RESULTS / "mnist_classifier.pt",
        help="where a classifier trained here is kept",
    )
    p.add_argument("--epochs", type=int, default=4, help="classifier training epochs (without --classifier)")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder")
    p.add_argument("--num-samples", type=int, default=1000)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--guidance", default="0,1,3", help="comma-separated guidance weights")
    p.add_argument("--batch-size", default="auto", help="images per batch; auto: sample.py's batch_size=auto")
    p.add_argument("--precision", default="auto", help="auto, 32 or bf16 (the network calls)")
    p.add_argument("--compile", action="store_true", help="torch.compile the network (compiled once)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (with --compile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per interval")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="reference statistics cache")
    p.add_argument(
        "--features-dir",
        type=Path,
        default=None,
        help="each row's classifier features, for paired intervals when resuming (default "
        "outputs/samplers_features; --smoke: a temp folder)",
    )
    p.add_argument("--fresh", action="store_true", help="ignore the rows already in --out")
    p.add_argument(
        "--docs", type=Path, default=None, help="Markdown file to update (default docs/benchmarks.md; --smoke: none)"
    )
    common.add_arguments(p, repeats=None)
    return p


def resumable(out: Path | None, args: argparse.Namespace, key: dict) -> list[dict]:
    """The rows of an earlier run with the same key (their features still on disk), else none."""
    if out is None or args.fresh or not out.is_file():
        return []
    earlier = json.loads(out.read_text())
    if earlier.get("key") != key:
        print(f"{out} holds another run ({earlier.get('key')}); starting afresh (its rows are replaced)")
        return []
    return [r for r in earlier["rows"] if (args.features_dir / r["features"]).is_file()]


def with_intervals(rows: list[dict], stats: dict, args: argparse.Namespace) -> list[dict]:
    """Each row's bootstrap intervals, and its paired cfid ratio to ddpm1000 at the same guidance."""
    weights = resample_weights(args.num_samples, args.resamples, seed=args.seed)
    drawn = {key: draws(s, weights) for key, s in stats.items()}  # once per row: its intervals and its ratio
    out = []
    for r in rows:
        key, base = (r["config"], r["guidance"]), ("ddpm1000", r["guidance"])
        row = {**r, **{k: v.as_dict() for k, v in bootstrap(stats[key], weights, drawn=drawn[key]).items()}}
        if base in stats:
            ratio = paired_ratio(stats[key], stats[base], weights, drawn=(drawn[key], drawn[base]))
            row["vs_ddpm1000"] = ratio.as_dict()
        out.append(row)
    return out


def order(rows: list[dict]) -> list[dict]:
    names = list(CONFIGS)
    return sorted(rows, key=lambda r: (r["guidance"], names.index(r["config"])))


def main(argv: list[str] | None = None) -> None:
    p = parser()
    run = common.start(__file__, p, argv, smoke=SMOKE)
    args = run.args
    try:
        configs = common.parse_rows(args.configs, CONFIGS, flag="--configs")
    except ValueError as error:
        p.error(str(error))
    if args.batch_size != "auto" and not args.batch_size.isdigit():
        p.error(f"--batch-size {args.batch_size}: a positive integer or auto")
    with tempfile.TemporaryDirectory() as tmp:
        if args.features_dir is None:
            args.features_dir = Path(tmp) if args.smoke else REPO / "outputs/samplers_features"
        if args.docs is None and not args.smoke:
            args.docs = REPO / "docs/benchmarks.md"
        build_table(run, args, configs, Path(tmp))


def build_table(run: common.Run, args: argparse.Namespace, configs: list[str], tmp: Path) -> None:
    """Measure the rows not yet in --out (the JSON written after each), then the intervals, the JSON and Markdown."""
    loaded = load_model(args.ckpt, run.device)
    net = loaded.net
    args.precision = resolve_sampling_precision(args.precision, run.device)
    source, data_name = common.mnist_or_digits(
        args.data_root, allow_digits=args.smoke, limit=common.SMOKE_IMAGES if args.smoke else None
    )
    extractor = get_classifier(args, source, tmp).to(run.device)
    cache = common.reference_cache(args.cache_dir, smoke=args.smoke, tmp=tmp)
    reference = reference_stats(source, image_size=net.image_size, channels=net.in_channels, extractor=extractor,
                                cache_dir=cache)  # fmt: skip
    key = {"ckpt": str(args.ckpt.resolve()), "ckpt_bytes": args.ckpt.stat().st_size, "num_samples": args.num_samples,
           "seed": args.seed, "batch_size": args.batch_size, "precision": args.precision,
           "classifier": extractor.name, "commit": run.git["commit"]}  # fmt: skip
    meta = {"key": key, **key, "compile": args.compile, "resamples": args.resamples, "provenance": run.provenance(),
            "reference": f"{reference.num} images of {data_name}", "features": extractor.name,
            "command": "python " + " ".join(sys.argv)}  # fmt: skip
    out = Path(args.out) if args.out else (None if args.smoke else common.RESULTS / "samplers.json")
    rows = resumable(out, args, key)
    measure_rows(run, rows, loaded, extractor, configs, meta)
    stats, terms = {}, Reference.of(reference)  # the reference's terms, computed once for every row
    for r in rows:
        saved = torch.load(args.features_dir / r["features"], weights_only=True)
        stats[(r["config"], r["guidance"])] = SetStatistics(terms, saved["features"], logits=saved["logits"],
                                                            labels=saved["labels"])  # fmt: skip
    final = order(with_intervals(rows, stats, args))
    for r in final:
        features = stats[(r["config"], r["guidance"])].f
        r[f"ckid_subsets@{count_tag(args.num_samples)}"] = kernel_distance(reference, features)[0]
    run.write({**meta, "rows": final}, "samplers.json")
    text = markdown(final, meta)
    print(text)
    if args.docs is not None:
        write_docs(args.docs, text)
        print(f"-> {args.docs}")


def measure_rows(run: common.Run, rows: list[dict], loaded, extractor, configs: list[str], meta: dict) -> None:
    """Draw and score every (configuration, guidance) not in `rows` yet, cheapest first; append and save each."""
    args, device, net = run.args, run.device, loaded.net
    guidances = [float(g) for g in args.guidance.split(",")] if net.num_classes is not None else [0.0]
    done = {(r["config"], r["guidance"]) for r in rows}
    todo = sorted(((n, g) for n in configs for g in guidances if (n, g) not in done), key=lambda c: nfe_cost(*c))
    print(f"{len(done)} rows resumed; {len(todo)} to run: {todo}", flush=True)
    args.features_dir.mkdir(parents=True, exist_ok=True)
    network = compile_network(net, args.compile_backend) if args.compile and todo else net  # once, for every row
    for guidance in {g for _, g in todo}:  # first-call costs (allocations, compilation) stay out of the timings
        first = argparse.Namespace(**{**vars(args), "num_samples": batch_for(args, guidance, device)})
        measure(network, loaded, DDIMSampler(steps=2), guidance, first, device)
    for name, guidance in todo:
        cls, kwargs = CONFIGS[name]
        measured = measure(network, loaded, cls(**kwargs), guidance, args, device)
        generated, seconds = measured["out"], measured["seconds"]
        features, logits = extractor(generated.images)
        file = f"{name}_w{guidance:g}.pt"
        torch.save({"features": features.cpu(), "logits": None if logits is None else logits.cpu(),
                    "labels": generated.labels}, args.features_dir / file)  # fmt: skip
        rows.append({"config": name, "sampler": cls.__name__, **kwargs, "nfe": generated.nfe, "guidance": guidance,
                     "images_per_s": len(generated.images) / seconds, "seconds": seconds,
                     "features": file})  # fmt: skip
        run.write({**meta, "rows": rows}, "samplers.json")
        print(f"{name:10}{generated.nfe:>6}{guidance:>5g}  {rows[-1]['images_per_s']:.2f} images/s ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
