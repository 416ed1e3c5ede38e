"""Training throughput, row by row, all rows measured in one run (ratios between rows are the result).

    python benchmarks/throughput.py --model seed_mnist --batch-size 128 --steps 100 --device cuda
    python benchmarks/throughput.py --model unet_tiny --steps 30 --rows same_bare_fp32,same_lightning_fp32,data_only \
        --repeats 5          # rows interleaved 5 times; medians, and the overhead as the median of paired ratios

Every row trains --model's preset in train.py's config (loops.py: `Bare`, the plain loop, or `Fit`, the Trainer):
  disk_fp32               bare float32 loop, TF32 off, one PNG file per image read with PIL every step (DataLoader)
  ram_fp32                ... images preloaded as one uint8 tensor (RAM), scaled on the device
  ram_tf32, ram_bf16, ram_fp16   ... TF32 matmuls / bf16 autocast / fp16 autocast (a GradScaler on CUDA)
  ram_bf16_batch2x, ram_bf16_compile, ram_bf16_channels_last, ram_bf16_math_attn   ... twice the batch /
                          torch.compile / NHWC / the SDPA math kernel (fused attention off)
  full                    RAM, bf16, 4x batch, compile, channels_last, fused attention
  ram_fp32_diffusers, ram_bf16_diffusers   ram_fp32 and ram_bf16 on diffusers' UNet2DModel with the same weights
                          (only where --rows names them: a preset UNet2DModel expresses, not seed_mnist or unet64)
  lightning_bf16, lightning_full, lightning_compile   a bare Trainer (no callbacks, loggers or EMA: Lightning's own
                          cost; peers.py and gpu.py time the product's) with bf16 / the full recipe / compile
  same_bare_fp32, same_lightning_fp32   the same float32 step, bare loop (the data module's loader) and Trainer
  paired_fp32             that pair step by step: a bare step right after every Lightning step, in one process; the
                          overhead is the median of neighbouring steps' ratios (the machine's drift cancels)
  data_only               the RAM data module alone (load, transfer, scale): images/s vs the model's (>= 10x)
Columns: images/s median [min-max] over --repeats interleaved repeats; "x <base>": each repeat's ratio to
disk_fp32's (else the first row's); ms/step; s per 60,000-image epoch; data-wait fraction; compile s (the first
step minus a steady one); peak memory (CUDA); MFU (FlopCounterMode's FLOPs of a step over the dense peak).
"""

import argparse
import contextlib
import copy
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import loops
import torch
from hydra.utils import instantiate
from loops import load_images
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader

SMOKE = {"model": "unet_tiny", "steps": 1, "warmup": 0, "compile_warmup": 0, "images": 64, "batch_size": 8,
         "disk_workers": 0, "compile_backend": "eager"}  # fmt: skip
PRECISION = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


@dataclass(frozen=True)
class Row:
    runner: str  # bare | lightning | paired (Lightning with a bare step after each) | data
    data: str = "ram"  # disk | ram | datamodule
    precision: str = "fp32"  # fp32 | tf32 | bf16 | fp16
    batch_mult: int = 1
    compile: bool = False
    channels_last: bool = False
    fused_attention: bool = True
    net: str = "ours"  # ours | diffusers (model=diffusers_unet2d: UNet2DModel with the same arguments and weights)


ROWS = {
    "disk_fp32": Row("bare", data="disk"),
    "ram_fp32": Row("bare"),
    "ram_tf32": Row("bare", precision="tf32"),
    "ram_bf16": Row("bare", precision="bf16"),
    "ram_fp16": Row("bare", precision="fp16"),
    "ram_bf16_batch2x": Row("bare", precision="bf16", batch_mult=2),
    "ram_bf16_compile": Row("bare", precision="bf16", compile=True),
    "ram_bf16_channels_last": Row("bare", precision="bf16", channels_last=True),
    "ram_bf16_math_attn": Row("bare", precision="bf16", fused_attention=False),
    "full": Row("bare", precision="bf16", batch_mult=4, compile=True, channels_last=True),
    "ram_fp32_diffusers": Row("bare", net="diffusers"),
    "ram_bf16_diffusers": Row("bare", precision="bf16", net="diffusers"),
    "lightning_bf16": Row("lightning", data="datamodule", precision="bf16"),
    "lightning_full": Row("lightning", "datamodule", "bf16", batch_mult=4, compile=True, channels_last=True),
    "lightning_compile": Row("lightning", data="datamodule", precision="bf16", compile=True),
    "same_bare_fp32": Row("bare", data="datamodule"),
    "same_lightning_fp32": Row("lightning", data="datamodule"),
    "paired_fp32": Row("paired", data="datamodule"),
    "data_only": Row("data", data="datamodule"),
}
DIFFUSERS_ROWS = [name for name, row in ROWS.items() if row.net == "diffusers"]  # run only when --rows names them


def config(row: Row, args: argparse.Namespace, device: torch.device, folder: Path) -> Any:
    """train.py's config of --model with the row's batch, precision, compile and layout."""
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    return common.compose("train", [
        f"model={args.model}", f"data.batch_size={args.batch_size * row.batch_mult}", f"compile={row.compile}",
        f"trainer.precision={PRECISION[row.precision]}", f"module.compile_backend={args.compile_backend}",
        f"module.channels_last={row.channels_last}", f"trainer.accelerator={accelerator}",
        f"paths.output_dir={folder}"])  # fmt: skip


def diffusers_twin(base: torch.nn.Module, arguments: dict[str, Any], model: str) -> torch.nn.Module:
    """make_twin, or for a preset UNet2DModel cannot express (or without diffusers) a stop before anything is timed,
    naming why and the rows to drop."""
    if reason := loops.twin_refusal(arguments):
        raise SystemExit(f"--rows {','.join(DIFFUSERS_ROWS)} need a diffusers twin of --model {model}: {reason}; "
                         "leave those rows out (the default does)")  # fmt: skip
    return loops.make_twin(base, arguments)


def bare_run(bare: loops.Bare, batches: Any, row: Row, steps: int, warmup: int) -> dict[str, float]:
    """Seconds per step and data-wait seconds per step (each step synced), the first step (compile: compiling)."""
    loops.set_tf32(bare.precision, row.precision == "tf32")
    with contextlib.nullcontext() if row.fused_attention else sdpa_kernel(SDPBackend.MATH):
        times = [common.timed(lambda: bare.step(batches, clock=True), bare.device) for _ in range(warmup + steps)]
    return {"step_s": statistics.fmean(t for _, t in times[warmup:]), "first_step_s": times[0][1],
            "wait_s": statistics.fmean(w for w, _ in times[warmup:])}  # fmt: skip


def lightning_run(fit: loops.Fit, bare: loops.Bare | None, steps: int, warmup: int) -> dict[str, float]:
    """A bare Trainer's steps, each timed from the previous batch's end to its own; with `bare`, one bare step right
    after every Lightning step, outside its span: the overhead is the median of neighbouring steps' ratios."""
    pairs = loops.endless(bare.loader) if bare else None
    timer = loops.Steps(fit.device, between=bare and (lambda: bare.step(pairs, clock=True)))
    fit.fit(warmup + steps + 1, timer, tf32=False)
    spans, waits = (s[:steps] for s in timer.spans(warmup))
    timing = {"step_s": statistics.fmean(spans), "wait_s": statistics.fmean(waits),
              "first_step_s": timer.ends[1] - timer.starts[0]}  # fmt: skip
    if bare is not None:
        neighbours = timer.between_s[warmup : warmup + len(spans)]
        timing["paired_overhead"] = statistics.median(s / b - 1 for s, b in zip(spans, neighbours, strict=True))
        timing["bare_step_s"] = statistics.fmean(neighbours)
    return timing


def data_run(dm: Any, steps: int, warmup: int, device: torch.device) -> dict[str, float]:
    """The data module alone: a batch loaded, moved to the device and scaled."""
    dm.setup("fit")
    batches = loops.endless(dm.train_dataloader())

    def fetch() -> None:
        images, labels = next(batches)
        dm.on_after_batch_transfer((images.to(device), labels.to(device)), 0)

    total = sum(common.timed(fetch, device)[1] * (i >= warmup) for i in range(warmup + steps))
    return {"step_s": total / steps, "wait_s": total / steps, "first_step_s": 0.0}


def run_row(name: str, data: Any, args: argparse.Namespace, device: torch.device, twin: Any) -> dict[str, Any]:
    """One timed run of row `name`: step, wait and first-step seconds (and the paired overhead of paired_fp32)."""
    row, batch = ROWS[name], args.batch_size * ROWS[name].batch_mult
    warmup, source = args.warmup + (args.compile_warmup if row.compile else 0), loops.TensorSource(data)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as folder:
        cfg = config(row, args, device, Path(folder))
        if row.runner == "data":
            timing = data_run(loops.datamodule(cfg, source), args.steps, warmup, device)
        elif row.runner in ("lightning", "paired"):
            bare = loops.Bare(cfg, source, device, ema=False) if row.runner == "paired" else None
            fit = loops.Fit(cfg, source, device, Path(folder), product=False)
            timing = lightning_run(fit, bare, args.steps, warmup)
        else:
            net = copy.deepcopy(twin) if row.net == "diffusers" else None
            bare = loops.Bare(cfg, source, device, net=net, ema=False)
            if row.data == "disk":
                files = loops.PNGFolder(data, Path(folder))
                batches = loops.endless(
                    DataLoader(
                        files,
                        batch_size=batch,
                        shuffle=True,
                        drop_last=True,
                        num_workers=args.disk_workers,
                        persistent_workers=args.disk_workers > 0,
                    )
                )
            elif row.data == "ram":
                generator = torch.Generator().manual_seed(0)
                picks = iter(lambda: torch.randint(0, len(data.images), (batch,), generator=generator), None)
                batches = ((data.images[i], data.labels[i]) for i in picks)
            else:
                batches = loops.endless(bare.loader)
            timing = bare_run(bare, batches, row, args.steps, warmup)
    timing["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return timing


def row_result(name: str, runs: list[dict], vs: dict, flops: float | None, args, device) -> dict[str, Any]:
    """A row's figures over its repeats: true medians with min-max; compile_s: the first repeat's (cold)."""
    row, batch = ROWS[name], args.batch_size * ROWS[name].batch_mult
    peak, ips = loops.peak_flops(device, row.precision), common.stats(batch / r["step_s"] for r in runs)
    first = [r["first_step_s"] - r["step_s"] for r in runs]
    paired = (
        {
            "paired_overhead": common.stats(r["paired_overhead"] for r in runs),
            "bare_step_s": statistics.median(r["bare_step_s"] for r in runs),
        }
        if row.runner == "paired"
        else {}
    )
    return {"row": name, **asdict(row), "batch_size": batch, "images_per_s": ips["median"],
            "images_per_s_min": ips["min"], "images_per_s_max": ips["max"], "images_per_s_runs": ips["runs"],
            "vs_baseline": vs, "ms_per_step": 1e3 * statistics.median(r["step_s"] for r in runs),
            "s_per_60k_epoch": 60_000 / ips["median"], "flops_per_step": flops,
            "data_wait_fraction": statistics.median(r["wait_s"] / r["step_s"] for r in runs),
            "peak_memory_mib": runs[0]["peak_memory_mib"] and max(r["peak_memory_mib"] for r in runs),
            "mfu": None if peak is None or flops is None else flops * ips["median"] / batch / peak,
            "compile_s": first[0] if row.compile else None, "compile_s_runs": first if row.compile else None,
            **paired}  # fmt: skip


def summarise(results: dict[str, dict], ips_runs: dict[str, list[float]]) -> dict[str, Any]:
    """The Lightning overhead (paired per repeat, and step-paired), the data rate, the recipe over disk_fp32."""
    summary: dict[str, Any] = {}
    if "same_bare_fp32" in ips_runs and "same_lightning_fp32" in ips_runs:
        ratio = common.paired_ratios(ips_runs, "same_lightning_fp32")["same_bare_fp32"]  # bare / Lightning
        summary["lightning_overhead"] = {k: ([v - 1 for v in x] if k == "runs" else x - 1) for k, x in ratio.items()}
        summary["lightning_overhead_within_5pct"] = summary["lightning_overhead"]["median"] <= 0.05
    if "paired_fp32" in results:
        summary["lightning_overhead_paired"] = results["paired_fp32"]["paired_overhead"]
        summary["lightning_overhead_paired_within_5pct"] = summary["lightning_overhead_paired"]["median"] <= 0.05
    models = [r["images_per_s"] for r in results.values() if r["runner"] != "data"]
    if "data_only" in results and models:
        summary["data_vs_fastest_model"] = results["data_only"]["images_per_s"] / max(models)
        summary["data_at_least_10x"] = summary["data_vs_fastest_model"] >= 10
    if "disk_fp32" in ips_runs:  # the design notes' starting point: strict float32 eager, one file per image
        vs = common.paired_ratios(ips_runs, "disk_fp32")
        summary.update({f"{n}_vs_disk_fp32": vs[n] for n in ("full", "lightning_full", "ram_bf16_compile") if n in vs})
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="unet_tiny", help="a preset in conf/model/ (--smoke: unet_tiny)")
    add("--batch-size", type=int, default=64)
    add("--steps", type=int, default=50, help="timed steps per row")
    add("--warmup", type=int, default=5, help="untimed steps per row")
    add("--compile-warmup", type=int, default=5, help="extra untimed steps of the compile rows")
    add("--images", type=int, default=4096, help="images in the dataset (digits, repeated)")
    add("--disk-workers", type=int, default=2, help="DataLoader workers of the PNG-file row")
    add("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    common.add_arguments(parser, rows=list(ROWS), default_rows=[n for n in ROWS if n not in DIFFUSERS_ROWS])
    run = common.start(__file__, parser, argv, rows=ROWS, smoke=SMOKE)
    args, device, names = run.args, run.device, run.rows
    cfg = config(ROWS[names[0]], args, device, Path("unused"))
    torch.manual_seed(cfg.seed)
    base = instantiate(cfg.model)
    twin = diffusers_twin(base, loops.model_arguments(cfg), args.model) if set(names) & set(DIFFUSERS_ROWS) else None
    data = load_images(base, args.images)
    runs = common.run_interleaved(names, args.repeats, lambda name, _: run_row(name, data, args, device, twin),
                                  lambda r: f"{r['step_s'] * 1e3:.1f} ms/step")  # fmt: skip
    ips_runs = {n: [args.batch_size * ROWS[n].batch_mult / r["step_s"] for r in runs[n]] for n in names}
    baseline = "disk_fp32" if "disk_fp32" in names else names[0]
    vs = common.paired_ratios(ips_runs, baseline)
    batches = {n: args.batch_size * ROWS[n].batch_mult for n in names}
    flops = {n: None if ROWS[n].runner == "data" else loops.step_flops(base, batches[n], device) for n in names}
    results = {n: row_result(n, runs[n], vs[n], flops[n], args, device) for n in names}
    parameters = sum(p.numel() for p in base.parameters())
    report = {"model": args.model, "parameters": parameters, "args": vars(args), "baseline": baseline,
              "rows": list(results.values()), "summary": summarise(results, ips_runs)}  # fmt: skip
    head = ["row", "batch", "images/s [min-max]", f"x {baseline} [min-max]", "ms/step", "s/60k", "wait", "compile s",
            "peak MiB", "MFU"]  # fmt: skip
    print(common.table(head, [[r["row"], r["batch_size"], common.images_per_s(r, ".1f"),
                               common.figure(r["vs_baseline"]) + "x", r["ms_per_step"], r["s_per_60k_epoch"],
                               f"{r['data_wait_fraction']:.1%}", r["compile_s"], r["peak_memory_mib"],
                               r["mfu"] and f"{r['mfu']:.1%}"] for r in results.values()]))  # fmt: skip
    for key, value in report["summary"].items():
        print(f"{key}: {common.figure(value, '.3f') if isinstance(value, dict) else value}")
    run.write(report, f"throughput_{args.model}_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
