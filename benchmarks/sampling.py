"""Sampling speed (images/s), row by row, all rows measured in one run: generate's options in this process, and the
whole `python sample.py` command as a subprocess (before and after the sampling defaults of issues 12 and 18).

    python benchmarks/sampling.py --model unet_mnist --num-samples 512 --sampler ddim --steps 20 --repeats 3
    python benchmarks/sampling.py --ckpt outputs/<mnist run>/ema.pt --rows before,ddpm250,now --num-samples 64

In this process, on one network (--ckpt's EMA weights, or --model's preset with random weights), --sampler (a
preset of common.SAMPLERS or a conf/sampler/ group; --steps overrides its steps): fp32_eager (float32, NCHW, eager,
batch 256), bf16 (bf16 network calls), channels_last (NHWC), compile (torch.compile, a partial batch padded),
bf16_compile; defaults / defaults_compile (sample.py's: batch_size auto, precision auto, NHWC); defaults_decoded
(defaults, a latent --ckpt's samples decoded by its VAE: the decoder's cost beside defaults); fp32_batch_auto,
fp32_nhwc_batch_auto, fp32_compile_batch_auto (float32 at sample.py's batch). A row's first use of a network is one
untimed batch (kernel set-up; compiled: the compile, reported as compile s). With --classifier each row's images get
a cfid [95%] (scoring.py), and rows drawing the noise of the first row (same batch) are compared with its images:
the fraction of uint8 values that differ, their mean and largest difference.
sample.py, end to end (needs --ckpt; --sampler does not apply, --set KEY=VALUE adds an override to each): before
(DDPM on all T steps, float32, NCHW, batch 256), ddpm250 (`sampler=ddpm`, the default between issues 12 and 18),
now (no options), now_compile (`compile=true`); images/s is sample.py's own figure, wall s the whole process.
"vs first": each repeat's images/s over the first row's in the same repeat. --smoke: 4 images, 2 sampler steps.
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
DEFAULT_ROWS = [name for name in IN_PROCESS if not ROWS[name].decode]
PRINTED = re.compile(
    r"(?P<n>\d+) images in (?P<s>[\d.]+) s \((?P<ips>[\d.]+) images/s, (?P<nfe>\d+) network evaluations per batch; "
    r"batch (?P<batch>\d+), precision (?P<precision>\w+)(?P<rest>[^)]*)\)"
)


def load(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any]:
    """The checkpoint's EMA network, or a preset from conf/model/ with random weights (and the default schedule); a
    latent model's VAE (else None)."""
    if args.ckpt:
        loaded = load_model(args.ckpt, device)
        return loaded.net.eval(), loaded.diffusion, load_decoder(loaded.config.get("latent"), device)
    torch.manual_seed(0)
    conf = OmegaConf.load(common.REPO / "conf" / "model" / f"{args.model}.yaml")
    net = instantiate(conf, **({"num_classes": 10} if args.guidance and conf.get("num_classes") is None else {}))
    with torch.no_grad():  # random, not zero-initialised, output: realistic images for the sampler's clipping
        for p in net.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return net.to(device).eval(), GaussianDiffusion(), None


class InProcess:
    """Draws rows on one network: each layout's copy made once, each compiled shape compiled once."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.net, self.diffusion, self.vae = load(args, device)
        self.args, self.device, self.eager, self.networks = args, device, {}, {}
        self.sampler = common.sampler(args.sampler, args.steps)

    def __call__(self, name: str, _repeat: int) -> dict[str, Any]:
        row, args, net = ROWS[name], self.args, self.net
        if row.decode and self.vae is None:
            raise SystemExit(f"row {name} decodes a latent model's samples: give --ckpt a run trained on latents")
        guidance = args.guidance if net.num_classes is not None else 0.0
        batch = row.batch_size or default_batch_size(self.device, guided=guidance != 0)
        precision = resolve_sampling_precision(row.precision, self.device)
        n = min(batch, args.num_samples)  # the network batch: nothing recompiles while timed
        if row.channels_last not in self.eager:
            self.eager[row.channels_last] = to_channels_last(net) if row.channels_last else net
        key, compile_s = (row.channels_last, row.compile, n, precision), None
        decode = self.vae.decode if row.decode else None
        options = {"guidance": guidance, "batch": batch, "precision": precision, "compile": row.compile,
                   "compile_backend": args.compile_backend, "decode": decode}  # fmt: skip
        if key not in self.networks:  # first use: one untimed batch (kernel set-up; compiled: the compile)
            eager = self.eager[row.channels_last]
            self.networks[key] = compile_network(eager, args.compile_backend) if row.compile else eager
            first = common.draw(self.networks[key], self.diffusion, self.sampler, n, self.device, **options)
            compile_s = first.seconds if row.compile else None
        out = common.draw(self.networks[key], self.diffusion, self.sampler, args.num_samples, self.device, **options)
        return {**asdict(row), "row": name, "batch_size": batch, "precision": precision, "nfe": out.nfe,
                "images_per_s": out.images_per_second, "compile_s": compile_s, "images": out.images,
                "labels": out.labels}  # fmt: skip


def sample_py(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One `python sample.py` for row `name`: its printed figures and its wall seconds."""
    overrides = {"ckpt": args.ckpt, "num_samples": args.num_samples, "guidance": args.guidance, "seed": 0,
                 "device": args.device, "output_dir": out, "hydra.run.dir": out, **ROWS[name],
                 **dict(item.split("=", 1) for item in args.set)}  # fmt: skip
    stdout, wall = common.entry_point("sample.py", [f"{k}={v}" for k, v in overrides.items()], args.threads)
    found = PRINTED.search(stdout)
    if found is None:
        raise SystemExit(f"row {name}: sample.py printed no '<n> images in <s> s' line:\n{stdout[-2000:]}")
    seconds = float(found["s"]) or int(found["n"]) / float(found["ips"])  # printed to 0.1 s; images/s to 0.01
    return {"row": name, "overrides": ROWS[name], "nfe": int(found["nfe"]), "batch_size": int(found["batch"]),
            "precision": found["precision"], "options": found["rest"].strip(", "), "compile_s": None,
            "images_per_s": int(found["n"]) / seconds, "seconds": seconds, "wall_s": wall}  # fmt: skip


def score(results: list[dict], args: argparse.Namespace, device: torch.device) -> None:
    """cfid [95%] of every in-process row's images, and their difference to the first row's (the same noise where
    the batch is the same), added to the rows."""
    from scoring import Scorer

    drawn = [r for r in results if "images" in r]
    with tempfile.TemporaryDirectory() as tmp:
        first = drawn[0]["images"]
        scorer = Scorer(classifier=args.classifier, data_root=args.data_root, smoke=args.smoke, folder=Path(tmp),
                        device=device, num=len(first), resamples=args.resamples, epochs=args.classifier_epochs,
                        image_size=first.shape[-1], channels=first.shape[1])  # fmt: skip
    for r in drawn:
        r.update(scorer.score(r["images"], r["labels"]).intervals)
        if r["batch_size"] == drawn[0]["batch_size"]:
            diff = (r["images"].int() - first.int()).abs().double()
            r["pixels_vs_first"] = {"differ": float((diff > 0).double().mean()), "mean": float(diff.mean()),
                                    "max": int(diff.max())}  # fmt: skip


def summarise(runs: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Each row's first repeat (its images and settings) with the images/s of every repeat and the paired ratios."""
    ips = {name: [r["images_per_s"] for r in rs] for name, rs in runs.items()}
    vs = common.paired_ratios(ips, next(iter(runs)))
    results = []
    for name, rs in runs.items():
        s = common.stats(ips[name])
        walls = {"wall_s_runs": [r["wall_s"] for r in rs]} if "wall_s" in rs[0] else {}
        results.append({**rs[0], "images_per_s": s["median"], "images_per_s_min": s["min"],
                        "images_per_s_max": s["max"], "images_per_s_runs": s["runs"], "vs_first": vs[name],
                        "compile_s": next((r["compile_s"] for r in rs if r["compile_s"]), None), **walls})  # fmt: skip
    return results


def show(results: list[dict]) -> str:
    head = ["row", "calls", "batch", "precision, options", "images/s [min-max]", "vs first [min-max]", "compile s",
            "wall s", "cfid [95%]", "values differ", "mean / max"]  # fmt: skip
    rows = []
    for r in results:
        ips = {"median": r["images_per_s"], "min": r["images_per_s_min"], "max": r["images_per_s_max"]}
        options = (
            r["options"]
            if "options" in r
            else f"{'NHWC' if r['channels_last'] else 'NCHW'}" + (", compiled" if r["compile"] else "")
        )
        fid = r.get("cfid") and f"{r['cfid']['value']:.2f} [{r['cfid']['low']:.2f}, {r['cfid']['high']:.2f}]"
        px = r.get("pixels_vs_first")
        wall = statistics.median(r["wall_s_runs"]) if "wall_s_runs" in r else None
        rows.append([r["row"], r["nfe"], r["batch_size"], f"{r['precision']} {options}", common.figure(ips, ".3f"),
                     common.figure(r["vs_first"]) + "x", r["compile_s"], wall, fid,
                     px and f"{px['differ']:.2%}", px and f"{px['mean']:.2f} / {px['max']}"])  # fmt: skip
    return common.table(head, rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=None, help="a run's ema.pt/.ckpt/export folder (else --model, random)")
    p.add_argument("--model", default="unet_mnist", help="a preset in conf/model/ (random weights)")
    p.add_argument("--sampler", default="ddim20", help=f"a preset ({', '.join(common.SAMPLERS)}) or a conf group")
    p.add_argument("--steps", type=int, default=None, help="the sampler's steps (default: the preset's)")
    p.add_argument("--num-samples", type=int, default=512, help="images per row and repeat")
    p.add_argument("--guidance", type=float, default=0.0, help="classifier-free guidance (conditional)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a sample.py override (its rows)")
    p.add_argument("--classifier", default=None, help="score each row with this MNIST classifier (trained if missing)")
    p.add_argument("--classifier-epochs", type=int, default=4, help="epochs of a classifier trained here")
    p.add_argument("--data-root", default=common.MNIST_ROOT, help="MNIST (the cfid reference)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the cfid interval")
    common.add_arguments(p, rows=list(ROWS), default_rows=DEFAULT_ROWS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser()
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
            return (
                in_process(name, repeat)
                if name in IN_PROCESS
                else sample_py(name, args, Path(tmp) / f"{name}_{repeat}")
            )

        runs = common.run_interleaved(run.rows, args.repeats, measure, lambda r: f"{r['images_per_s']:.3f} images/s")
    results = summarise(runs)
    if args.classifier and in_process is not None:
        score(results, args, run.device)
    for r, key in ((r, key) for r in results for key in ("images", "labels")):
        r.pop(key, None)
    label = Path(args.ckpt).stem if args.ckpt else args.model
    net = in_process.net if in_process else None
    report = {"model": label, "sampler": args.sampler, "steps": args.steps, "args": vars(args), "rows": results,
              "parameters": net and sum(p.numel() for p in net.parameters())}  # fmt: skip
    print(show(results))
    run.write(report, f"sampling_{label}_{run.device.type}.json")
    return report


if __name__ == "__main__":
    main()
