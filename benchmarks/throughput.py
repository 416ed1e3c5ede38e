"""Training throughput, row by row, all rows measured in one run (ratios between rows are the result).

    python benchmarks/throughput.py --model seed_mnist --batch-size 128 --steps 100 --device cuda
    python benchmarks/throughput.py --model unet_tiny --steps 30 --rows same_bare_fp32,same_lightning_fp32,data_only \
        --repeats 5          # rows interleaved 5 times; medians, and the overhead as the median of paired ratios

Rows (--rows, comma-separated; default all):
  disk_fp32               bare eager float32 loop, PNG files read with PIL every step (DataLoader), TF32 off
  ram_fp32                ... images preloaded as one uint8 tensor (RAM), scaled on the device
  ram_tf32                ... float32 with TF32 matmuls/convolutions (GPUs of capability >= 8.0)
  ram_bf16, ram_fp16      ... autocast bf16 / fp16 (fp16 with a GradScaler on CUDA)
  ram_bf16_batch2x        ... twice the batch
  ram_bf16_compile        ... torch.compile (inductor; compile time excluded by the warm-up steps)
  ram_bf16_channels_last  ... NHWC weights and inputs
  ram_bf16_math_attn      ... fused attention off (SDPA math kernel: materialises the attention map)
  full                    the whole recipe at once: RAM, bf16, 4x batch, compile, channels_last, fused attention
  lightning_bf16          the same model through our Trainer (DiffusionModule + RAMDataModule), bf16-mixed
  lightning_full          the whole recipe through our Trainer (module.compile, module.channels_last, bf16-mixed)
  lightning_compile       our Trainer with what experiment=mnist picks on a CPU with native bf16: bf16-mixed and
                            compile (compile=auto), NCHW, the batch as given
  same_bare_fp32          identical settings pair: RAMDataModule loader, AdamW from ddpm.optim, grad clip 1.0,
  same_lightning_fp32       float32; bare loop vs Trainer -> the Lightning overhead (acceptance: within 5%)
  paired_fp32             the same pair step by step: a bare step right after every Lightning step, in one process;
                            the overhead is the median of neighbouring steps' ratios (the machine's drift cancels)
  data_only               the RAM datamodule alone (load, transfer, scale): images/s vs the model's (>= 10x)

Columns: images/s, ms/step, s per 60,000-image epoch, peak memory (CUDA), data-wait fraction, MFU (FLOPs of
one step from FlopCounterMode, 2 per multiply-add, over the device's dense peak; n/a on CPU). Writes JSON under
benchmarks/results/ with the machine, torch version and git commit.
"""

import argparse
import copy
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image
from report import machine, write_report  # benchmarks/report.py
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from ddpm.data.ram import RAMDataModule, scale_to_unit
from ddpm.data.sources import DigitsSource, ImageSet
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.models.unet import UNet
from ddpm.module import DiffusionModule
from ddpm.optim import AdamW

REPO = Path(__file__).resolve().parents[1]
PEAK_FLOPS = {  # dense tensor-core peaks (SXM), FLOP/s; by a substring of torch.cuda.get_device_name()
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Row:
    runner: str  # bare | lightning | paired (Lightning with a bare step after each) | data
    data: str = "ram"  # disk | ram | datamodule
    precision: str = "fp32"  # fp32 | tf32 | bf16 | fp16
    batch_mult: int = 1
    compile: bool = False
    channels_last: bool = False
    fused_attention: bool = True


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


class TensorSource:
    """The benchmark's images as a RAMDataModule source (already at the model's size)."""

    def __init__(self, data: ImageSet) -> None:
        self.data = data

    def prepare(self) -> None:
        pass

    def count(self) -> int:
        return len(self.data.images)

    def load(self, *, image_size: int, channels: int | None) -> ImageSet:
        return self.data


class PNGFolder(Dataset):
    """One PNG per image on disk, decoded with PIL at every access (the naive baseline)."""

    def __init__(self, data: ImageSet, folder: Path) -> None:
        self.paths, self.labels = [], data.labels
        for i, image in enumerate(data.images):
            path = folder / f"{i:06d}.png"
            array = image.permute(1, 2, 0).numpy()
            Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array).save(path)
            self.paths.append(path)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        with Image.open(self.paths[i]) as image:
            array = torch.from_numpy(np.asarray(image).copy())
        array = array[None] if array.ndim == 2 else array.permute(2, 0, 1)
        return array, self.labels[i]


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    torch.set_float32_matmul_precision("high" if on else "highest")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def endless(loader: DataLoader) -> Iterator:
    while True:
        yield from loader


def bare_step(row: Row, net: nn.Module, diffusion: GaussianDiffusion, batches: Iterator, *, device: torch.device,
              dm: RAMDataModule | None) -> Callable[[], float]:  # fmt: skip
    """One step of a plain PyTorch loop (fetch, loss, backward, clip, AdamW, LR schedule); returns its fetch time."""
    optimizer, schedule = AdamW(lr=1e-4, warmup_steps=0).build(list(net.parameters()), global_batch_size=64)
    scaler = torch.amp.GradScaler(enabled=row.precision == "fp16" and device.type == "cuda")
    dtype = AUTOCAST.get(row.precision)
    memory_format = torch.channels_last if row.channels_last else torch.contiguous_format

    def step() -> float:
        start = time.perf_counter()
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        x0 = dm.on_after_batch_transfer((images, labels), 0)[0] if dm else scale_to_unit(images)
        x0 = x0.contiguous(memory_format=memory_format)
        sync(device)
        fetched = time.perf_counter()
        y = diffusion.drop_labels(labels, net.num_classes) if net.num_classes is not None else None
        t = diffusion.sample_timesteps(x0.shape[0], device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = diffusion.loss(net, x0, t, torch.randn_like(x0), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        sync(device)
        return fetched - start

    return step


def bare_run(row: Row, step: Callable[[], float], *, steps: int, warmup: int) -> dict[str, float]:
    """A plain PyTorch loop; returns seconds per step and the data-wait seconds per step."""
    total = wait = first = 0.0
    with nullcontext() if row.fused_attention else sdpa_kernel(SDPBackend.MATH):
        for i in range(warmup + steps):
            start = time.perf_counter()
            fetch = step()
            if i == 0:
                first = time.perf_counter() - start  # with compile: the compile (forward and backward graphs)
            if i >= warmup:
                total += time.perf_counter() - start
                wait += fetch
    return {"step_s": total / steps, "wait_s": wait / steps, "first_step_s": first}


class StepTimer(pl.Callback):
    """Times every training batch: end-to-end (batch end to batch end) and the wait before its start.

    With `interleave` (a bare_step), a bare-loop step runs right after every Lightning step, outside the
    timed Lightning span: pairs of steps measured milliseconds apart, so the machine's drift cancels.
    """

    def __init__(self, device: torch.device, interleave: Callable[[], float] | None = None) -> None:
        self.device, self.interleave = device, interleave
        self.starts, self.ends, self.resumed, self.bare = [], [], [], []  # per batch; bare: the twin's step time

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        sync(self.device)
        self.ends.append(time.perf_counter())
        self.resumed.append(self.ends[-1])  # when the next Lightning span starts
        if self.interleave is not None:
            self.interleave()
            self.resumed[-1] = time.perf_counter()
            self.bare.append(self.resumed[-1] - self.ends[-1])


def lightning_run(row: Row, net: UNet, dm: RAMDataModule, *, steps: int, warmup: int, device: torch.device,
                  interleave: Callable[[], float] | None = None,
                  backend: str = "inductor") -> dict[str, Any]:  # fmt: skip
    module = DiffusionModule(net=net, diffusion=GaussianDiffusion(), optim=AdamW(lr=1e-4, warmup_steps=0),
                             compile=row.compile, compile_backend=backend, channels_last=row.channels_last)  # fmt: skip
    timer = StepTimer(device, interleave)
    trainer = pl.Trainer(
        accelerator=device.type, devices=1, precision="bf16-mixed" if row.precision == "bf16" else "32-true",
        max_steps=warmup + steps + 1, limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer], log_every_n_steps=50,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    # Steps warmup+1 ..: span i runs from the previous batch's end (after its bare twin, if any) to its own end.
    resumed, ends, starts = timer.resumed[warmup:], timer.ends[warmup + 1 :], timer.starts[warmup + 1 :]
    spans = [e - r for r, e in zip(resumed, ends, strict=False)][:steps]
    waits = [s - r for r, s in zip(resumed, starts, strict=False)][:steps]
    out: dict[str, Any] = {"step_s": sum(spans) / len(spans), "wait_s": sum(waits) / len(waits),
                           "first_step_s": timer.ends[0] - timer.starts[0]}  # fmt: skip
    if interleave is not None:  # bare[i] ran right before span i: per-step ratios of neighbours
        bare = timer.bare[warmup : warmup + len(spans)]
        out["paired_overhead"] = statistics.median(s / b - 1 for s, b in zip(spans, bare, strict=True))
        out["bare_step_s"] = sum(bare) / len(bare)
    return out


def data_run(dm: RAMDataModule, *, steps: int, warmup: int, device: torch.device) -> dict[str, float]:
    batches, total = endless(dm.train_dataloader()), 0.0
    for step in range(warmup + steps):
        start = time.perf_counter()
        images, labels = next(batches)
        dm.on_after_batch_transfer((images.to(device), labels.to(device)), 0)
        sync(device)
        if step >= warmup:
            total += time.perf_counter() - start
    return {"step_s": total / steps, "wait_s": total / steps}


def step_flops(net: nn.Module, diffusion: GaussianDiffusion, batch: int, device: torch.device) -> float:
    """FLOPs of one training step (forward + backward) at `batch`, measured at <= 8 images and scaled."""
    n = min(batch, 8)
    net = copy.deepcopy(net).to(device)
    x0 = torch.randn(n, net.in_channels, net.image_size, net.image_size, device=device)
    y = torch.zeros(n, dtype=torch.long, device=device) if net.num_classes is not None else None
    with FlopCounterMode(display=False) as counter:
        diffusion.loss(net, x0, diffusion.sample_timesteps(n, device), torch.randn_like(x0), y).backward()
    return counter.get_total_flops() * batch / n


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if table is None else table[precision]


def load_images(net: UNet, count: int) -> ImageSet:
    """scikit-learn's digits (offline), resized to the model's size and channels, repeated up to `count`."""
    data = DigitsSource().load(image_size=net.image_size, channels=net.in_channels)
    repeat = -(-count // len(data.images))
    return ImageSet(data.images.repeat(repeat, 1, 1, 1)[:count], data.labels.repeat(repeat)[:count], 10)


def run_row(name: str, row: Row, base: UNet, data: ImageSet, args: argparse.Namespace, folder: Path) -> dict:
    device = torch.device(args.device)
    batch = args.batch_size * row.batch_mult
    torch.manual_seed(0)
    set_tf32(row.precision == "tf32")
    net = copy.deepcopy(base).to(device)
    if row.channels_last and row.runner == "bare":
        net = net.to(memory_format=torch.channels_last)
    if row.compile and row.runner == "bare":  # the Lightning rows compile in DiffusionModule.configure_model
        net.compile(backend=args.compile_backend)
    diffusion = GaussianDiffusion().to(device)
    dm = None
    if row.data == "datamodule":
        dm = RAMDataModule(source=TensorSource(data), image_size=net.image_size, batch_size=batch, val_size=batch,
                           num_workers=0)  # fmt: skip
        dm.setup("fit")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup = args.warmup + (args.compile_warmup if row.compile else 0)
    if row.runner == "data":
        timing = data_run(dm, steps=args.steps, warmup=warmup, device=device)  # type: ignore[arg-type]
    elif row.runner in ("lightning", "paired"):
        twin = bare_step(row, copy.deepcopy(base).to(device), diffusion, endless(dm.train_dataloader()),  # type: ignore[union-attr]
                         device=device, dm=dm) if row.runner == "paired" else None  # fmt: skip
        timing = lightning_run(row, net, dm, steps=args.steps, warmup=warmup, device=device, interleave=twin,  # type: ignore[arg-type]
                               backend=args.compile_backend)  # fmt: skip
    else:
        if row.data == "disk":
            loader = DataLoader(PNGFolder(data, folder), batch_size=batch, shuffle=True, drop_last=True,
                                num_workers=args.disk_workers, persistent_workers=args.disk_workers > 0)  # fmt: skip
            batches = endless(loader)
        elif row.data == "datamodule":
            batches = endless(dm.train_dataloader())  # type: ignore[union-attr]
        else:
            generator = torch.Generator().manual_seed(0)
            batches = iter(lambda: (lambda i: (data.images[i], data.labels[i]))(
                torch.randint(0, len(data.images), (batch,), generator=generator)), None)  # fmt: skip
        step = bare_step(row, net, diffusion, batches, device=device, dm=dm)
        timing = bare_run(row, step, steps=args.steps, warmup=warmup)
    set_tf32(False)
    ips = batch / timing["step_s"]
    flops = None if row.runner == "data" else step_flops(base, GaussianDiffusion().to(device), batch, device)
    peak = peak_flops(device, row.precision)
    return {
        "row": name, **row.__dict__, "batch_size": batch, "images_per_s": ips, "ms_per_step": 1e3 * timing["step_s"],
        "s_per_60k_epoch": 60_000 / ips, "data_wait_fraction": timing["wait_s"] / timing["step_s"],
        "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "flops_per_step": flops, "mfu": None if peak is None or flops is None else flops / timing["step_s"] / peak,
        **{k: timing[k] for k in ("paired_overhead", "bare_step_s") if k in timing},
        # the first step minus a steady one: the compile time of a compiled row (cold: the first repeat)
        "compile_s": timing["first_step_s"] - timing["step_s"] if row.compile else None,
    }  # fmt: skip


def median_run(runs: list[dict]) -> dict:
    """The run of median images/s (the upper median of an even count), with every repeat's figure attached."""
    ordered = sorted(runs, key=lambda r: r["images_per_s"])
    return {**ordered[len(ordered) // 2], "images_per_s_runs": [r["images_per_s"] for r in runs],
            "compile_s": runs[0]["compile_s"], "compile_s_runs": [r["compile_s"] for r in runs]}  # fmt: skip


def summarise(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Lightning overhead as the median of per-repeat ratios (each pair measured back to back); the data rate."""
    summary: dict[str, Any] = {}
    if "same_bare_fp32" in runs and "same_lightning_fp32" in runs:
        pairs = zip(runs["same_bare_fp32"], runs["same_lightning_fp32"], strict=True)
        overheads = sorted(bare["images_per_s"] / light["images_per_s"] - 1 for bare, light in pairs)
        summary["lightning_overhead"] = statistics.median(overheads)
        summary["lightning_overhead_per_repeat"] = overheads
        summary["lightning_overhead_within_5pct"] = summary["lightning_overhead"] <= 0.05
    if "paired_fp32" in runs:
        paired = sorted(r["paired_overhead"] for r in runs["paired_fp32"])
        summary["lightning_overhead_paired"] = statistics.median(paired)
        summary["lightning_overhead_paired_per_repeat"] = paired
        summary["lightning_overhead_paired_within_5pct"] = summary["lightning_overhead_paired"] <= 0.05
    models = [median_run(r)["images_per_s"] for name, r in runs.items() if ROWS[name].runner != "data"]
    if "data_only" in runs and models:
        summary["data_vs_fastest_model"] = median_run(runs["data_only"])["images_per_s"] / max(models)
        summary["data_at_least_10x"] = summary["data_vs_fastest_model"] >= 10
    if "disk_fp32" in runs:  # the design notes' starting point: strict float32 eager, one file per image
        baseline = median_run(runs["disk_fp32"])["images_per_s"]
        for name in ("full", "lightning_full"):
            if name in runs:
                summary[f"{name}_vs_disk_fp32"] = median_run(runs[name])["images_per_s"] / baseline
    return summary


def table(results: list[dict]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    base = next((r for r in results if r["row"] == "disk_fp32"), results[0])  # the strict float32 starting point
    lines = [f"{'row':<24}{'batch':>6}{'img/s':>10}{'min-max':>14}{'x ' + base['row']:>16}{'ms/step':>10}{'s/60k':>9}"
             f"{'wait':>7}{'compile s':>10}{'peak MiB':>10}{'MFU':>7}"]  # fmt: skip
    for r in results:
        runs = r.get("images_per_s_runs", [r["images_per_s"]])
        lines.append(
            f"{r['row']:<24}{r['batch_size']:>6}{r['images_per_s']:>10.1f}{f'{min(runs):.1f}-{max(runs):.1f}':>14}"
            f"{r['images_per_s'] / base['images_per_s']:>15.2f}x{r['ms_per_step']:>10.2f}"
            f"{r['s_per_60k_epoch']:>9.1f}{r['data_wait_fraction']:>7.1%}{fmt(r.get('compile_s'), '.1f'):>10}"
            f"{fmt(r['peak_memory_mib'], '.0f'):>10}{fmt(r['mfu'], '.1%'):>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="unet_tiny", help="a preset in conf/model/")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per row")
    parser.add_argument("--compile-warmup", type=int, default=5, help="extra untimed steps of the compile row")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--images", type=int, default=4096, help="images in the dataset (digits, repeated)")
    parser.add_argument("--disk-workers", type=int, default=2, help="DataLoader workers of the PNG-file row")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row, interleaved (ABC CBA ...); medians")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/throughput_<model>_<dev>)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base: UNet = instantiate(OmegaConf.load(REPO / "conf" / "model" / f"{args.model}.yaml"))
    data = load_images(base, args.images)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):  # alternate the order, so slow drift of the machine hits every row
            for name in names if repeat % 2 == 0 else names[::-1]:
                runs[name].append(run_row(name, ROWS[name], base, data, args, Path(folder)))
                print(f"done {name} ({repeat + 1}/{args.repeats}): {runs[name][-1]['images_per_s']:.1f} images/s",
                      flush=True)  # fmt: skip
    results = [median_run(runs[name]) for name in names]
    device = torch.device(args.device)
    report = {"model": args.model, "parameters": sum(p.numel() for p in base.parameters()), "args": vars(args),
              "machine": machine(device), "rows": results, "summary": summarise(runs)}  # fmt: skip
    print(table(results))
    print(json.dumps(report["summary"], indent=1))
    write_report(report, args.out, f"throughput_{args.model}_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
