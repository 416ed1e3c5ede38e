"""Sampling speed (images/s), the one script: generate()'s options row by row in this process, and the whole
`python sample.py` as a subprocess (needs --ckpt; gpu.py's sampling part is its `now` row), all rows interleaved in
one run; --classifier scores each in-process row (mnist_quality.py). Rows and columns: docs/benchmarks.md.

    python benchmarks/sampling.py --model unet_mnist --num-samples 512 --sampler ddim20 --repeats 3
    python benchmarks/sampling.py --ckpt outputs/<mnist run>/ema.pt --rows before,ddpm250,now --num-samples 64
"""

import argparse
import re
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.network import compile_network, to_channels_last
from ddpm.sampling.runtime import default_batch_size, load_decoder, resolve_sampling_precision
from ddpm.weights import load_model

SMOKE = {"num_samples": 4, "steps": 2, "classifier_epochs": 1, "resamples": 20, "compile_backend": "eager"}


@dataclass(frozen=True)
class Row:
    precision: str = "32"  # 32 | bf16 | auto
    compile: bool = False
    batch_size: int | None = 256  # None: sample.py's auto
    channels_last: bool = False
    decode: bool = False  # a latent model's samples decoded through its VAE (sample.py's images)


ROWS: dict[str, Row | dict[str, str]] = {
    "fp32_eager": Row(),
    "bf16": Row(precision="bf16"),
    "channels_last": Row(channels_last=True),
    "compile": Row(compile=True),
    "bf16_compile": Row(precision="bf16", compile=True),
    "defaults": Row(precision="auto", batch_size=None, channels_last=True),
    "defaults_compile": Row(precision="auto", compile=True, batch_size=None, channels_last=True),
    "defaults_decoded": Row(precision="auto", batch_size=None, channels_last=True, decode=True),  # latent --ckpt
    "fp32_batch_auto": Row(batch_size=None),
    "fp32_nhwc_batch_auto": Row(batch_size=None, channels_last=True),
    "fp32_compile_batch_auto": Row(compile=True, batch_size=None, channels_last=True),
    # sample.py as a subprocess: its overrides
    "before": {
        "sampler": "ddpm",
        "sampler.steps": "null",
        "precision": "32",
        "channels_last": "false",
        "batch_size": "256",
    },
    "ddpm250": {"sampler": "ddpm"},
    "now": {},
    "now_compile": {"compile": "true"},
}
IN_PROCESS = [name for name, row in ROWS.items() if isinstance(row, Row)]
PRINTED = re.compile(
    r"(?P<n>\d+) images in (?P<s>[\d.]+) s \((?P<ips>[\d.]+) images/s, (?P<nfe>\d+) network evaluations per batch; "
    r"batch (?P<batch>\d+), precision (?P<precision>\w+)(?P<rest>[^)]*)\)"
)


def load(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any]:
    """--ckpt's EMA network, diffusion and VAE decoder (a latent model's, else None), or --model's preset with random
    weights (not zero-initialised outputs: realistic images for the sampler's clipping) and the default schedule."""
    if args.ckpt:
        loaded = load_model(args.ckpt, device)
        return loaded.net.eval(), loaded.diffusion, load_decoder(loaded.config.get("latent"), device)
    torch.manual_seed(0)
    conf = OmegaConf.load(common.REPO / "conf" / "model" / f"{args.model}.yaml")
    net = instantiate(conf, **({"num_classes": 10} if args.guidance and conf.get("num_classes") is None else {}))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return net.to(device).eval(), GaussianDiffusion(), None


class InProcess:
    """Draws rows on one network: each layout's copy made once, each compiled shape compiled once; a row's first use
    of a network is one untimed batch (kernel set-up; compiled: the compile and one batch, kept as compile_s)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.net, self.diffusion, self.vae = load(args, device)
        self.args, self.device, self.networks, self.eager = args, device, {}, {}
        self.sampler = common.sampler(args.sampler, args.steps)

    def __call__(self, name: str) -> dict[str, Any]:
        row, args = ROWS[name], self.args
        if row.decode and self.vae is None:
            raise SystemExit(f"row {name} decodes a latent model's samples: give --ckpt a run trained on latents")
        guidance = args.guidance if self.net.num_classes is not None else 0.0
        batch = row.batch_size or default_batch_size(self.device, guided=guidance != 0)
        precision = resolve_sampling_precision(row.precision, self.device)
        n, compile_s = min(batch, args.num_samples), None  # n: the network's batch; nothing recompiles while timed
        options = {"guidance": guidance, "batch": batch, "precision": precision, "compile": row.compile,
                   "compile_backend": args.compile_backend,
                   "decode": self.vae.decode if row.decode else None}  # fmt: skip
        key = (row.channels_last, row.compile, n, precision)
        if key not in self.networks:
            if row.channels_last not in self.eager:
                self.eager[row.channels_last] = to_channels_last(self.net) if row.channels_last else self.net
            eager = self.eager[row.channels_last]
            self.networks[key] = compile_network(eager, args.compile_backend) if row.compile else eager
            first = common.draw(self.networks[key], self.diffusion, self.sampler, n, self.device, **options)
            compile_s = first.seconds if row.compile else None
        out = common.draw(self.networks[key], self.diffusion, self.sampler, args.num_samples, self.device, **options)
        return {**asdict(row), "row": name, "batch_size": batch, "precision": precision, "nfe": out.nfe,
                "images_per_s": out.images_per_second, "compile_s": compile_s, "images": out.images,
                "labels": out.labels}  # fmt: skip


def sample_py(overrides: dict[str, Any], threads: int | None = None) -> dict[str, Any]:
    """One `python sample.py overrides...`: its printed figures (images/s of its sampling loop) and wall seconds."""
    stdout, wall = common.entry_point("sample.py", [f"{k}={v}" for k, v in overrides.items()], threads)
    found = PRINTED.search(stdout)
    if found is None:
        raise SystemExit(f"sample.py printed no '<n> images in <s> s' line:\n{stdout[-2000:]}")
    seconds = float(found["s"]) or int(found["n"]) / float(found["ips"])  # printed to 0.1 s; images/s to 0.01
    return {"nfe": int(found["nfe"]), "batch_size": int(found["batch"]), "precision": found["precision"],
            "options": found["rest"].strip(", "), "compile_s": None, "images_per_s": int(found["n"]) / seconds,
            "seconds": seconds, "wall_s": wall}  # fmt: skip


def score(results: list[dict], args: argparse.Namespace, device: torch.device) -> None:
    """cfid [95%] of every in-process row's images, and their difference to the first row's (the same noise where
    the batch is the same), added to the rows."""
    from mnist_quality import Scorer

    drawn = [r for r in results if "images" in r]
    first = drawn[0]["images"]
    with tempfile.TemporaryDirectory() as tmp:
        scorer = Scorer(classifier=args.classifier, data_root=args.data_root, smoke=args.smoke, folder=Path(tmp),
                        device=device, num=len(first), resamples=args.resamples, epochs=args.classifier_epochs,
                        image_size=first.shape[-1], channels=first.shape[1])  # fmt: skip
    for r in drawn:
        r.update(scorer.score(r["images"], r["labels"]).intervals)
        if r["batch_size"] == drawn[0]["batch_size"]:
            diff = (r["images"].int() - first.int()).abs().double()
            r["pixels_vs_first"] = {"differ": float((diff > 0).double().mean()), "mean": float(diff.mean()),
                                    "max": int(diff.max())}  # fmt: skip


def show(results: list[dict]) -> str:
    rows = []
    for r in results:
        layout = ("NHWC" if r.get("channels_last") else "NCHW") + (", compiled" if r.get("compile") else "")
        options = r.get("options", layout)
        fid, px = r.get("cfid"), r.get("pixels_vs_first")
        rows.append([r["row"], r["nfe"], r["batch_size"], f"{r['precision']} {options}",
                     common.figure(r, ".3f", "images_per_s"), common.figure(r["vs_first"]) + "x", r["compile_s"],
                     statistics.median(r["wall_s_runs"]) if "wall_s_runs" in r else None,
                     fid and f"{fid['value']:.2f} [{fid['low']:.2f}, {fid['high']:.2f}]", px and f"{px['differ']:.2%}",
                     px and f"{px['mean']:.2f} / {px['max']}"])  # fmt: skip
    return common.table(["row", "calls", "batch", "precision, options", "images/s [min-max]", "vs first [min-max]",
                         "first batch s", "wall s", "cfid [95%]", "values differ", "mean / max"], rows)  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--ckpt", default=None, help="a run's ema.pt/.ckpt/export folder (else --model, random)")
    add("--model", default="unet_mnist", help="a preset in conf/model/ (random weights)")
    add("--sampler", default="ddim20", help=f"a preset ({', '.join(common.SAMPLERS)}) or a conf/sampler/ group")
    add("--steps", type=int, default=None, help="the sampler's steps (default: the preset's)")
    add("--num-samples", type=int, default=512, help="images per row and repeat")
    add("--guidance", type=float, default=0.0, help="classifier-free guidance (conditional)")
    add("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="a sample.py override (its rows)")
    add("--classifier", default=None, help="score each row with this MNIST classifier (trained if missing)")
    add("--classifier-epochs", type=int, default=4, help="epochs of a classifier trained here")
    add("--data-root", default=common.MNIST_ROOT, help="MNIST (the cfid reference)")
    add("--resamples", type=int, default=1000, help="bootstrap resamples of the cfid interval")
    common.add_arguments(p, rows=list(ROWS), default_rows=[n for n in IN_PROCESS if not ROWS[n].decode])
    run = common.start(__file__, p, argv, rows=ROWS, smoke=SMOKE)
    args = run.args
    args.set += ["sampler.steps=2"] if args.smoke else []
    if args.num_samples < 1 or any("=" not in item for item in args.set):
        p.error("--num-samples must be >= 1, and --set takes KEY=VALUE")
    if not args.ckpt and set(run.rows) - set(IN_PROCESS):
        p.error("the sample.py rows (before, ddpm250, now, now_compile) need --ckpt: a run's ema.pt")
    in_process = InProcess(args, run.device) if set(run.rows) & set(IN_PROCESS) else None
    with tempfile.TemporaryDirectory() as tmp:

        def measure(name: str, repeat: int) -> dict[str, Any]:
            if name in IN_PROCESS:
                return in_process(name)
            out = Path(tmp) / f"{name}_{repeat}"
            overrides = {"ckpt": args.ckpt, "num_samples": args.num_samples, "guidance": args.guidance, "seed": 0,
                         "device": args.device, "output_dir": out, "hydra.run.dir": out, **ROWS[name],
                         **dict(item.split("=", 1) for item in args.set)}  # fmt: skip
            return {"row": name, "overrides": ROWS[name], **sample_py(overrides, args.threads)}

        runs = common.run_interleaved(run.rows, args.repeats, measure, lambda r: f"{r['images_per_s']:.3f} images/s")
    vs = common.paired_ratios({n: [r["images_per_s"] for r in rs] for n, rs in runs.items()}, run.rows[0])
    results = [{**rs[0], **common.rate(r["images_per_s"] for r in rs), "vs_first": vs[n],
                "compile_s": next((r["compile_s"] for r in rs if r["compile_s"]), None),
                **({"wall_s_runs": [r["wall_s"] for r in rs]} if "wall_s" in rs[0] else {})}
               for n, rs in runs.items()]  # fmt: skip
    if args.classifier and in_process is not None:
        score(results, args, run.device)
    for r, key in ((r, key) for r in results for key in ("images", "labels")):
        r.pop(key, None)
    label = Path(args.ckpt).stem if args.ckpt else args.model
    report = {"model": label, "sampler": args.sampler, "steps": args.steps, "args": vars(args), "rows": results,
              "parameters": in_process and sum(p.numel() for p in in_process.net.parameters())}  # fmt: skip
    print(show(results))
    run.write(report, f"sampling_{label}_{run.device.type}.json")
    return report


if __name__ == "__main__":
    main()
