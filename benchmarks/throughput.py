"""Training images/s of one preset, row by row (loops.py's runners), from the design notes' strict float32 loop over
PNG files through each step of the recipe, our Trainer against the bare loop (separate and step-paired), diffusers'
UNet2DModel and the data module alone, in one run. Columns and rows: docs/benchmarks.md.

    python benchmarks/throughput.py --model unet_mnist --rows disk_fp32,ram_fp32,ram_bf16,full --repeats 3
"""

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import common
import loops
import torch
from hydra.utils import instantiate
from loops import Row

SMOKE = {"model": "unet_tiny", "steps": 1, "warmup": 0, "compile_warmup": 0, "images": 64, "batch_size": 8,
         "disk_workers": 0, "compile_backend": "eager"}  # fmt: skip
ROWS = {
    "disk_fp32": Row("bare", data="disk"),
    "ram_fp32": Row("bare", data="ram"),
    "ram_tf32": Row("bare", "tf32", data="ram"),
    "ram_bf16": Row("bare", "bf16", data="ram"),
    "ram_fp16": Row("bare", "fp16", data="ram"),
    "ram_bf16_batch2x": Row("bare", "bf16", data="ram", batch_mult=2),
    "ram_bf16_compile": Row("bare", "bf16", "default", data="ram"),
    "ram_bf16_channels_last": Row("bare", "bf16", data="ram", channels_last=True),
    "ram_bf16_math_attn": Row("bare", "bf16", data="ram", fused_attention=False),
    "full": Row("bare", "bf16", "default", data="ram", batch_mult=4, channels_last=True),
    "ram_fp32_diffusers": Row("bare", data="ram", net="diffusers"),
    "ram_bf16_diffusers": Row("bare", "bf16", data="ram", net="diffusers"),
    "lightning_bf16": Row("lightning", "bf16"),
    "lightning_full": Row("lightning", "bf16", "default", batch_mult=4, channels_last=True),
    "lightning_compile": Row("lightning", "bf16", "default"),
    "same_bare_fp32": Row("bare"),
    "same_lightning_fp32": Row("lightning"),
    "paired_fp32": Row("paired"),
    "data_only": Row("data"),
}
DIFFUSERS_ROWS = [name for name, row in ROWS.items() if row.net == "diffusers"]  # run only when --rows names them


def summarise(results: dict[str, dict], ips: dict[str, list[float]]) -> dict[str, Any]:
    """The Lightning overhead (paired per repeat, and step-paired), the data rate, the recipe over disk_fp32."""
    summary: dict[str, Any] = {}
    if "same_bare_fp32" in ips and "same_lightning_fp32" in ips:
        ratio = common.paired_ratios(ips, "same_lightning_fp32")["same_bare_fp32"]  # bare / Lightning
        summary["lightning_overhead"] = {k: ([v - 1 for v in x] if k == "runs" else x - 1) for k, x in ratio.items()}
        summary["lightning_overhead_within_5pct"] = summary["lightning_overhead"]["median"] <= 0.05
    if "paired_fp32" in results:
        summary["lightning_overhead_paired"] = results["paired_fp32"]["paired_overhead"]
        summary["lightning_overhead_paired_within_5pct"] = summary["lightning_overhead_paired"]["median"] <= 0.05
    models = [r["images_per_s"] for r in results.values() if r["runner"] != "data"]
    if "data_only" in results and models:
        summary["data_vs_fastest_model"] = results["data_only"]["images_per_s"] / max(models)
        summary["data_at_least_10x"] = summary["data_vs_fastest_model"] >= 10
    if "disk_fp32" in ips:  # the design notes' starting point: strict float32 eager, one file per image
        vs = common.paired_ratios(ips, "disk_fp32")
        summary.update({f"{n}_vs_disk_fp32": vs[n] for n in ("full", "lightning_full", "ram_bf16_compile") if n in vs})
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="unet_tiny", help="a preset in conf/model/ (--smoke: unet_tiny)")
    add("--batch-size", type=int, default=64)
    add("--steps", type=int, default=50, help="timed steps per row and repeat")
    add("--warmup", type=int, default=5, help="untimed steps before each repeat's timed ones")
    add("--compile-warmup", type=int, default=5, help="steps of a compile row before its repeats (after the first)")
    add("--images", type=int, default=4096, help="images in the dataset (digits, repeated)")
    add("--disk-workers", type=int, default=2, help="DataLoader workers of the PNG-file row")
    add("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    common.add_arguments(parser, rows=list(ROWS), default_rows=[n for n in ROWS if n not in DIFFUSERS_ROWS])
    run = common.start(__file__, parser, argv, rows=ROWS, smoke=SMOKE)
    args, device, names = run.args, run.device, run.rows
    with tempfile.TemporaryDirectory() as tmp:
        cfg = lambda n: loops.compose(ROWS[n], args.batch_size, device, Path(tmp) / n, [f"model={args.model}"],  # noqa: E731
                                      args.compile_backend)  # fmt: skip
        first = cfg(names[0])
        if set(names) & set(DIFFUSERS_ROWS) and (reason := loops.twin_refusal(first)):
            raise SystemExit(f"--rows {','.join(DIFFUSERS_ROWS)} need a diffusers twin of --model {args.model}: "
                             f"{reason}; leave those rows out (the default does)")  # fmt: skip
        torch.manual_seed(first.seed)
        base = instantiate(first.model)
        data, runners, info = loops.load_images(base, args.images), {}, {}
        for n in names:
            (Path(tmp) / n).mkdir()
            runners[n] = loops.Runner(ROWS[n], cfg(n), data, device, Path(tmp) / n, args.disk_workers)
            info[n] = runners[n].prepare(1 + args.compile_warmup * bool(ROWS[n].compile))
        runs = common.run_interleaved(names, args.repeats, lambda n, _: runners[n].measure(args.warmup, args.steps,
                                      clock=True), lambda r: f"{r['step_s'] * 1e3:.1f} ms/step")  # fmt: skip
    ips = {n: [runners[n].batch / r["step_s"] for r in runs[n]] for n in names}
    baseline = "disk_fp32" if "disk_fp32" in names else names[0]
    vs = common.paired_ratios(ips, baseline)
    results = {n: {"row": n, **asdict(ROWS[n]), "batch_size": runners[n].batch, "vs_baseline": vs[n],
                   **loops.figures(runners[n], runs[n], info[n], None if n == "data_only" else
                                   loops.step_flops(base, runners[n].batch, device))} for n in names}  # fmt: skip
    report = {"model": args.model, "parameters": sum(p.numel() for p in base.parameters()), "args": vars(args),
              "baseline": baseline, "rows": list(results.values()), "summary": summarise(results, ips)}  # fmt: skip
    print(common.table(["row", "batch", "images/s [min-max]", f"x {baseline} [min-max]", "ms/step", "s/60k", "wait",
                        "compile s", "peak MiB", "MFU"],
                       [[r["row"], r["batch_size"], common.figure(r, ".1f", "images_per_s"),
                         common.figure(r["vs_baseline"]) + "x", r["ms_per_step"], r["s_per_60k_epoch"],
                         f"{r['data_wait_fraction']:.1%}", r["compile_s"], r["peak_memory_mib"],
                         r["mfu"] and f"{r['mfu']:.1%}"] for r in results.values()]))  # fmt: skip
    for key, value in report["summary"].items():
        print(f"{key}: {common.figure(value, '.3f') if isinstance(value, dict) else value}")
    run.write(report, f"throughput_{args.model}_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
