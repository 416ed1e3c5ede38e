"""Samplers x guidance on a trained MNIST model: classifier FID, KID and accuracy (scoring.py), speed.

    python train.py experiment=mnist data.root=../shared/data/mnist
    python benchmarks/samplers.py --ckpt outputs/.../ema.pt [--num-samples 1000]
    python benchmarks/samplers.py --ckpt ... --configs ddim50,dpm++10 --guidance 0,3    # a subset

Every configuration (a preset of common.SAMPLERS) draws the same N images (labels 0..9 in turn, same seeds), as
sample.py draws them (--precision, --batch-size auto, --compile: one compiled network for every row); rows run
cheapest first (network calls x guided batch), after one untimed draw per guidance. NFE: network calls per image;
images/s: each row's own wall time. "vs DDPM-1000": the paired cfid ratio to ddpm1000 at the same guidance.
Resumable: each row's features go to --features-dir as it finishes, named by the run's key (checkpoint, samples,
seed, batch, precision, classifier, commit); a run with the same key draws only the rows missing and its table holds
every row of the key, whatever --configs and --guidance say. Writes JSON (benchmarks/results/samplers.json) and this
script's section of --docs (docs/benchmarks.md). --smoke: 8 samples of two cheap configurations, no docs.
"""

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import common
from scoring import Scorer

from ddpm.diffusion.network import compile_network
from ddpm.metrics.fid import DEFAULT_CACHE_DIR, count_tag
from ddpm.sampling.runtime import resolve_sampling_precision
from ddpm.weights import load_model

BEGIN, END = "<!-- benchmarks/samplers.py: begin -->", "<!-- benchmarks/samplers.py: end -->"
CONFIGS = [n for n in common.SAMPLERS if n not in ("ddim4", "dpm++sde25_logsnr")]  # the table's rows
SMOKE = {"num_samples": 8, "resamples": 20, "epochs": 1, "configs": "ddim20,dpm++10", "compile_backend": "eager"}


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
    every = set.intersection(*(set(ok.get(g, [])) for g in drawn))
    unguided = {r["config"]: (r["nfe"], r["vs_ddpm1000"]["value"]) for r in rows if r["guidance"] == 0.0}
    return (min(every, key=unguided.__getitem__) if every else None), ok


def markdown(rows: list[dict], meta: dict) -> str:
    tag, m = count_tag(meta["num_samples"]), meta["provenance"]
    cells = [[r["config"], r["nfe"], f"{r['guidance']:g}", interval(r["cfid"]),
              interval(r["vs_ddpm1000"], spec=".3f") if r.get("vs_ddpm1000") else "-", interval(r["ckid"], 1e3),
              interval(r["accuracy"], spec=".3f") if r.get("accuracy") else "-", f"{r['images_per_s']:.2f}"]
             for r in rows]  # fmt: skip
    best, ok = fastest_within_noise(rows)
    return "\n".join([
        f"### Samplers on MNIST ({meta['num_samples']} samples, {m['cpu'] if m['gpu'] is None else m['gpu']}, "
        f"{m['cpu_capability']} ({' '.join(k for k, v in m['cpu_flags'].items() if v)}), {m['threads']} threads, "
        f"torch {m['torch']}, commit {(m['commit'] or 'none')[:7]}{' (dirty)' if m['dirty'] else ''})", "",
        common.table(["sampler", "NFE", "guidance", f"cfid@{tag} [95%]", "vs DDPM-1000 [95%]",
                      f"ckid@{tag} x1e3 [95%]", "accuracy [95%]", "images/s"], cells), "",
        "Within the noise of DDPM-1000 (paired cfid ratio's interval reaches 1 or lies below): "
        + "; ".join(f"guidance {g:g}: {', '.join(names)}" for g, names in sorted(ok.items()))
        + ". Fewest network calls at every guidance with a DDPM-1000 row (ties: the lower unguided ratio): "
        f"**{best or 'none'}**.", "",
        f"`{meta['command']}` (precision {meta['precision']}, compile {meta['compile']}, batch {meta['batch_size']});"
        f" cfid: classifier FID against the statistics of {meta['reference']}; ckid: classifier KID (unbiased "
        f"MMD^2); [95%]: bootstrap over the {meta['num_samples']} images ({meta['resamples']} resamples, centred on "
        "the value); vs DDPM-1000: the cfid ratio, paired resamples. images/s: each row's own wall time.", "",
    ])  # fmt: skip


def write_docs(path: Path, text: str) -> None:
    """Replace this script's section of the Markdown file (between its markers), or append one."""
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    section = f"{BEGIN}\n{text}{END}"
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + section + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
    print(f"-> {path}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, required=True, help="the run's ema.pt (or a .ckpt)")
    p.add_argument("--classifier", type=Path, help="TorchScript MNIST classifier (default: results/, trained there)")
    p.add_argument("--epochs", type=int, default=4, help="epochs of a classifier trained here")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder")
    p.add_argument("--num-samples", type=int, default=1000)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--guidance", default="0,1,3", help="comma-separated guidance weights")
    p.add_argument("--batch-size", default="auto", help="images per batch; auto: sample.py's batch_size=auto")
    p.add_argument("--precision", default="auto", help="auto, 32 or bf16 (the network calls)")
    p.add_argument("--compile", action="store_true", help="torch.compile the network (compiled once)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (with --compile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per interval")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="reference statistics cache")
    p.add_argument("--features-dir", type=Path, help="rows' features (default outputs/samplers_features)")
    p.add_argument("--fresh", action="store_true", help="draw every row again, even if its features are there")
    p.add_argument("--docs", type=Path, help="Markdown file to update (default docs/benchmarks.md; --smoke: none)")
    common.add_arguments(p, repeats=None)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser()
    run = common.start(__file__, p, argv, smoke=SMOKE)
    args, device = run.args, run.device
    try:
        configs = common.parse_rows(args.configs, CONFIGS, flag="--configs")
    except ValueError as error:
        p.error(str(error))
    if args.batch_size != "auto" and not args.batch_size.isdigit():
        p.error(f"--batch-size {args.batch_size}: a positive integer or auto")
    with tempfile.TemporaryDirectory() as tmp:
        features = args.features_dir or (Path(tmp) if args.smoke else common.REPO / "outputs/samplers_features")
        features.mkdir(parents=True, exist_ok=True)
        loaded, precision = load_model(args.ckpt, device), resolve_sampling_precision(args.precision, device)
        net, batch = loaded.net, None if args.batch_size == "auto" else int(args.batch_size)
        scorer = Scorer(classifier=args.classifier, data_root=args.data_root, smoke=args.smoke, folder=Path(tmp),
                        device=device, num=args.num_samples, resamples=args.resamples, seed=args.seed,
                        epochs=args.epochs, cache_dir=args.cache_dir, image_size=net.image_size,
                        channels=net.in_channels)  # fmt: skip
        key = {"ckpt": str(args.ckpt.resolve()), "ckpt_bytes": args.ckpt.stat().st_size, "precision": precision,
               "num_samples": args.num_samples, "seed": args.seed, "batch_size": args.batch_size,
               "classifier": scorer.name, "commit": run.git["commit"]}  # fmt: skip
        tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        guidances = [float(g) for g in args.guidance.split(",")] if net.num_classes is not None else [0.0]
        todo = [(n, g) for n in configs for g in guidances]
        todo = [c for c in todo if args.fresh or not (features / f"{c[0]}_w{c[1]:g}_{tag}.pt").is_file()]
        todo.sort(key=lambda c: common.calls(common.sampler(c[0])) * (2 if c[1] else 1))
        print(f"{len(todo)} rows to draw: {todo}", flush=True)
        network = compile_network(net, args.compile_backend) if args.compile and todo else net  # once, every row
        options = {"batch": batch, "precision": precision, "compile": args.compile, "seed": args.seed,
                   "compile_backend": args.compile_backend}  # fmt: skip
        for g in {g for _, g in todo}:  # first-call costs (allocations, compilation) stay out of the timings
            common.draw(network, loaded.diffusion, common.sampler("ddim", 2), 2, device, guidance=g, **options)
        for name, g in todo:
            s = common.sampler(name)
            out = common.draw(network, loaded.diffusion, s, args.num_samples, device, guidance=g, **options)
            scorer.score(out.images, out.labels, file=features / f"{name}_w{g:g}_{tag}.pt", config=name, guidance=g,
                         sampler=type(s).__name__, settings=vars(s), nfe=out.nfe, seconds=out.seconds)  # fmt: skip
            print(f"{name:12}{out.nfe:>6}{g:>5g}  {out.images_per_second:.2f} images/s ({out.seconds:.0f} s)")
        rows = table_rows(scorer, sorted(features.glob(f"*_{tag}.pt")), args.num_samples)
    meta = {"key": key, **key, "compile": args.compile, "resamples": args.resamples, "provenance": run.provenance(),
            "reference": scorer.data, "features": scorer.name, "command": "python " + " ".join(sys.argv)}  # fmt: skip
    run.write({**meta, "rows": rows}, "samplers.json")
    text = markdown(rows, meta)
    print(text)
    if args.docs or not args.smoke:
        write_docs(args.docs or common.REPO / "docs/benchmarks.md", text)
    return rows


def table_rows(scorer: Scorer, files: list[Path], num: int) -> list[dict]:
    """Every row of the key (its features files): intervals, and the paired cfid ratio to ddpm1000 at its guidance;
    ordered by guidance, then as CONFIGS."""
    scored = {}
    for file in files:
        s = scorer.score(file=file)
        scored[(s.saved["config"], s.saved["guidance"])] = s
    rows = []
    for (name, g), s in sorted(scored.items(), key=lambda item: (item[0][1], CONFIGS.index(item[0][0]))):
        base = scored.get(("ddpm1000", g))
        rows.append({"config": name, "sampler": s.saved["sampler"], **s.saved["settings"], "nfe": s.saved["nfe"],
                     "guidance": g, "images_per_s": num / s.saved["seconds"], "seconds": s.saved["seconds"],
                     **s.intervals, "vs_ddpm1000": scorer.ratio(s, base) if base else None})  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
