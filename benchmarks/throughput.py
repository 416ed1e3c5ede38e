"""Training throughput, row by row, all rows measured in one run (ratios between rows are the result).

    python benchmarks/throughput.py --model seed_mnist --batch-size 128 --steps 100 --device cuda
    python benchmarks/throughput.py --model unet_tiny --steps 30 --rows same_bare_fp32,same_lightning_fp32,data_only \
        --repeats 5          # rows interleaved 5 times; medians, and the overhead as the median of paired ratios

Rows (--rows, comma-separated; default all but the two diffusers rows):
  disk_fp32               bare eager float32 loop, PNG files read with PIL every step (DataLoader), TF32 off
  ram_fp32                ... images preloaded as one uint8 tensor (RAM), scaled on the device
  ram_tf32                ... float32 with TF32 matmuls/convolutions (GPUs of capability >= 8.0)
  ram_bf16, ram_fp16      ... autocast bf16 / fp16 (fp16 with a GradScaler on CUDA)
  ram_bf16_batch2x        ... twice the batch
  ram_bf16_compile        ... torch.compile (inductor; compile time excluded by the warm-up steps)
  ram_bf16_channels_last  ... NHWC weights and inputs
  ram_bf16_math_attn      ... fused attention off (SDPA math kernel: materialises the attention map)
  full                    the whole recipe at once: RAM, bf16, 4x batch, compile, channels_last, fused attention
  ram_fp32_diffusers      ram_fp32 and ram_bf16 on diffusers' UNet2DModel with the same weights (model=diffusers_unet2d;
  ram_bf16_diffusers        the diffusers extra, and a preset UNet2DModel expresses: not seed_mnist, unet64)
  lightning_bf16          the same model through our Trainer (DiffusionModule + RAMDataModule), bf16-mixed
  lightning_full          the whole recipe through our Trainer (module.compile, module.channels_last, bf16-mixed)
  lightning_compile       our Trainer with what experiment=mnist picks on a CPU with native bf16: bf16-mixed and
                            compile (compile=auto), NCHW, the batch as given
  same_bare_fp32          identical settings pair: RAMDataModule loader, AdamW from ddpm.optim, grad clip 1.0,
  same_lightning_fp32       float32; bare loop vs Trainer -> the Lightning overhead (acceptance: within 5%)
  paired_fp32             the same pair step by step: a bare step right after every Lightning step, in one process;
                            the overhead is the median of neighbouring steps' ratios (the machine's drift cancels)
  data_only               the RAM datamodule alone (load, transfer, scale): images/s vs the model's (>= 10x)

The Lightning rows are a bare Trainer (no EMA, checkpoint, logger or our callbacks): they measure Lightning's own
overhead; benchmarks/peers.py times the whole product (train.py's Trainer and callbacks).
Rows run interleaved (ABC CBA ...; --repeats, 3 by default; benchmarks/common.py). Columns: images/s as the
median [min-max] over repeats; "x <base>": the median [min-max] of each repeat's ratio to the first row's (or
disk_fp32's) figure in the same repeat; ms/step, s per 60,000-image epoch, data-wait fraction, compile s (the
first step minus a steady one: cold in the first repeat), peak memory (CUDA), MFU (FLOPs of one step from
FlopCounterMode, 2 per multiply-add, over the device's dense peak; n/a on CPU). JSON with the provenance.
"""

import argparse
import copy
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import common
import torch
from _training_loops import (
    PNGFolder,
    Row,
    TensorSource,
    bare_run,
    bare_step,
    data_run,
    endless,
    lightning_run,
    set_tf32,
)
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from ddpm.data.ram import RAMDataModule
from ddpm.data.sources import DigitsSource, ImageSet
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.models.unet import UNet

PEAK_FLOPS = {  # dense tensor-core peaks (SXM), FLOP/s; by a substring of torch.cuda.get_device_name()
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}
SMOKE = {
    "model": "unet_tiny",
    "steps": 1,
    "warmup": 0,
    "compile_warmup": 0,
    "images": 64,
    "batch_size": 8,
    "disk_workers": 0,
    "compile_backend": "eager",
}


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
    "lightning_full": Row(
        "lightning", data="datamodule", precision="bf16", batch_mult=4, compile=True, channels_last=True
    ),
    "lightning_compile": Row("lightning", data="datamodule", precision="bf16", compile=True),
    "same_bare_fp32": Row("bare", data="datamodule"),
    "same_lightning_fp32": Row("lightning", data="datamodule"),
    "paired_fp32": Row("paired", data="datamodule"),
    "data_only": Row("data", data="datamodule"),
}
DIFFUSERS_ROWS = [name for name, row in ROWS.items() if row.net == "diffusers"]  # run only when --rows names them


def step_flops(net: nn.Module, batch: int, device: torch.device) -> float:
    """FLOPs of one training step (forward + backward) at `batch`, measured at <= 8 images and scaled."""
    n, net, diffusion = min(batch, 8), copy.deepcopy(net).to(device), GaussianDiffusion().to(device)
    x0 = torch.randn(n, net.in_channels, net.image_size, net.image_size, device=device)
    y = torch.zeros(n, dtype=torch.long, device=device) if net.num_classes is not None else None
    with FlopCounterMode(display=False) as counter:
        diffusion.loss(net, x0, diffusion.sample_timesteps(n, device), torch.randn_like(x0), y).backward()
    return counter.get_total_flops() * batch / n


def peak_flops(device: torch.device, precision: str) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    table = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if table is None else table[precision]


def load_images(net: UNet, count: int) -> ImageSet:
    """scikit-learn's digits (offline), resized to the model's size and channels, repeated up to `count`."""
    data = DigitsSource().load(image_size=net.image_size, channels=net.in_channels)
    repeat = -(-count // len(data.images))
    return ImageSet(data.images.repeat(repeat, 1, 1, 1)[:count], data.labels.repeat(repeat)[:count], 10)


def diffusers_twin(base: UNet, arguments: dict[str, Any], model: str) -> torch.nn.Module:
    """model=diffusers_unet2d with `base`'s arguments and weights (ddpm.weights.unet2d_mapping): the same network, as
    diffusers' UNet2DModel computes it (same parameters and outputs to float rounding). A preset UNet2DModel cannot
    express, or no diffusers, stops the run before anything is timed, naming why and the rows to drop."""
    from ddpm.models.diffusers_unet import DiffusersUNet2D, NotUNet2D, unet2d_config
    from ddpm.weights.unet2d_mapping import to_unet2d_state

    try:
        unet2d_config(arguments)  # NotUNet2D names what UNet2DModel cannot express (e.g. a level that does not halve)
        twin = DiffusersUNet2D(**{k: v for k, v in arguments.items() if k != "downsample"})  # all true: checked
    except (NotUNet2D, ImportError) as error:
        raise SystemExit(
            f"--rows {','.join(DIFFUSERS_ROWS)} need a diffusers twin of --model {model}: {error}; "
            "leave those rows out (the default does)"
        ) from error
    twin.unet.load_state_dict(to_unet2d_state(base.state_dict(), arguments))
    return twin


def run_row(
    row: Row, base: UNet, data: ImageSet, args: argparse.Namespace, device: torch.device, twin: Any = None
) -> dict[str, Any]:
    """One timed run of `row`: step, wait and first-step seconds (and the paired overhead of paired_fp32)."""
    batch = args.batch_size * row.batch_mult
    torch.manual_seed(0)
    set_tf32(row.precision == "tf32")
    net = copy.deepcopy(twin if row.net == "diffusers" else base).to(device)
    if row.runner == "bare":  # the Lightning rows compile and convert in DiffusionModule.configure_model
        net = net.to(memory_format=torch.channels_last) if row.channels_last else net
        if row.compile:
            net.compile(backend=args.compile_backend)
    dm = None
    if row.data == "datamodule":
        dm = RAMDataModule(
            source=TensorSource(data), image_size=net.image_size, batch_size=batch, val_size=batch, num_workers=0
        )
        dm.setup("fit")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup = args.warmup + (args.compile_warmup if row.compile else 0)
    with tempfile.TemporaryDirectory() as folder:
        if row.runner == "data":
            timing = data_run(dm, steps=args.steps, warmup=warmup, device=device)
        elif row.runner in ("lightning", "paired"):
            twin = None  # paired_fp32: a bare step on a twin model after every Lightning step
            if row.runner == "paired":
                twin = bare_step(
                    row, copy.deepcopy(base).to(device), endless(dm.train_dataloader()), device=device, dm=dm
                )
            timing = lightning_run(row, net, dm, args, warmup, device, twin)
        else:
            if row.data == "disk":
                batches = endless(
                    DataLoader(
                        PNGFolder(data, Path(folder)),
                        batch_size=batch,
                        shuffle=True,
                        drop_last=True,
                        num_workers=args.disk_workers,
                        persistent_workers=args.disk_workers > 0,
                    )
                )
            elif row.data == "datamodule":
                batches = endless(dm.train_dataloader())
            else:
                generator = torch.Generator().manual_seed(0)
                batches = (
                    (data.images[i], data.labels[i])
                    for i in iter(lambda: torch.randint(0, len(data.images), (batch,), generator=generator), None)
                )
            timing = bare_run(row, bare_step(row, net, batches, device=device, dm=dm), steps=args.steps, warmup=warmup)
    set_tf32(False)
    timing["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return timing


def row_result(name: str, runs: list[dict], vs: dict[str, Any], base: UNet, args, device) -> dict[str, Any]:
    """A row's figures over its repeats: true medians with min-max; compile_s: the first repeat's (cold)."""
    row = ROWS[name]
    batch = args.batch_size * row.batch_mult
    ips = common.stats(batch / r["step_s"] for r in runs)
    flops = None if row.runner == "data" else step_flops(base, batch, device)
    peak = peak_flops(device, row.precision)
    first = [r["first_step_s"] - r["step_s"] for r in runs]
    return {
        "row": name,
        **asdict(row),
        "batch_size": batch,
        "images_per_s": ips["median"],
        "images_per_s_min": ips["min"],
        "images_per_s_max": ips["max"],
        "images_per_s_runs": ips["runs"],
        "vs_baseline": vs,
        "ms_per_step": 1e3 * statistics.median(r["step_s"] for r in runs),
        "s_per_60k_epoch": 60_000 / ips["median"],
        "data_wait_fraction": statistics.median(r["wait_s"] / r["step_s"] for r in runs),
        "peak_memory_mib": runs[0]["peak_memory_mib"] and max(r["peak_memory_mib"] for r in runs),
        "flops_per_step": flops,
        "mfu": None if peak is None or flops is None else flops * ips["median"] / batch / peak,
        "compile_s": first[0] if row.compile else None,
        "compile_s_runs": first if row.compile else None,
        **(paired_figures(runs) if row.runner == "paired" else {}),
    }


def paired_figures(runs: list[dict]) -> dict[str, Any]:
    """paired_fp32: the step-paired overhead (per repeat: the median of neighbouring steps' ratios), the twin's step."""
    return {"paired_overhead": common.stats(r["paired_overhead"] for r in runs),
            "bare_step_s": statistics.median(r["bare_step_s"] for r in runs)}  # fmt: skip


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


def table(results: list[dict], base: str) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"{'row':<24}{'batch':>6}{'img/s [min-max]':>24}{'x ' + base + ' [min-max]':>28}{'ms/step':>10}"
        f"{'s/60k':>9}{'wait':>7}{'compile s':>10}{'peak MiB':>10}{'MFU':>7}"
    ]
    for r in results:
        ips = {"median": r["images_per_s"], "min": r["images_per_s_min"], "max": r["images_per_s_max"]}
        lines.append(
            f"{r['row']:<24}{r['batch_size']:>6}{common.figure(ips, '.1f'):>24}{common.figure(r['vs_baseline']):>27}x"
            f"{r['ms_per_step']:>10.2f}{r['s_per_60k_epoch']:>9.1f}{r['data_wait_fraction']:>7.1%}"
            f"{fmt(r['compile_s'], '.1f'):>10}{fmt(r['peak_memory_mib'], '.0f'):>10}{fmt(r['mfu'], '.1%'):>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="unet_tiny", help="a preset in conf/model/ (--smoke: unet_tiny)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per row")
    parser.add_argument("--compile-warmup", type=int, default=5, help="extra untimed steps of the compile row")
    parser.add_argument("--images", type=int, default=4096, help="images in the dataset (digits, repeated)")
    parser.add_argument("--disk-workers", type=int, default=2, help="DataLoader workers of the PNG-file row")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    common.add_arguments(parser, rows=list(ROWS), default_rows=[n for n in ROWS if n not in DIFFUSERS_ROWS])
    run = common.start(__file__, parser, argv, rows=ROWS, smoke=SMOKE)
    args, device, names = run.args, run.device, run.rows
    torch.manual_seed(0)
    preset = OmegaConf.to_container(OmegaConf.load(common.REPO / "conf" / "model" / f"{args.model}.yaml"))
    base: UNet = instantiate(preset)
    arguments = {k: v for k, v in preset.items() if k != "_target_"}
    twin = diffusers_twin(base, arguments, args.model) if set(names) & set(DIFFUSERS_ROWS) else None
    data = load_images(base, args.images)
    runs = common.run_interleaved(
        names,
        args.repeats,
        lambda name, _: run_row(ROWS[name], base, data, args, device, twin),
        lambda r: f"{r['step_s'] * 1e3:.1f} ms/step",
    )
    ips_runs = {n: [args.batch_size * ROWS[n].batch_mult / r["step_s"] for r in runs[n]] for n in names}
    baseline = "disk_fp32" if "disk_fp32" in names else names[0]
    vs = common.paired_ratios(ips_runs, baseline)
    results = {n: row_result(n, runs[n], vs[n], base, args, device) for n in names}
    report = {
        "model": args.model,
        "parameters": sum(p.numel() for p in base.parameters()),
        "args": vars(args),
        "baseline": baseline,
        "rows": list(results.values()),
        "summary": summarise(results, ips_runs),
    }
    print(table(list(results.values()), baseline))
    for key, value in report["summary"].items():
        print(f"{key}: {common.figure(value, '.3f') if isinstance(value, dict) else value}")
    run.write(report, f"throughput_{args.model}_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
