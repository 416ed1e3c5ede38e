"""throughput.py's training loops (a part of that script, split for length; no command line of its own): the
bare PyTorch step, a Lightning Trainer run timed batch by batch, the data module alone, and their data sources."""

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset

from ddpm.data.ram import RAMDataModule, scale_to_unit
from ddpm.data.sources import ImageSet
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.models.unet import UNet
from ddpm.module import DiffusionModule
from ddpm.optim import AdamW


class BatchTimer(pl.Callback):
    """Times a Trainer's training batches: span i runs from the end of batch i-1 (after `between`, if any) to
    the end of batch i, so it holds everything the Trainer and callbacks do per step. `between()` runs outside
    the spans, after every batch (throughput.py's paired bare step); its durations are kept too."""

    def __init__(self, device: torch.device, between: Callable[[], object] | None = None) -> None:
        self.device, self.between = device, between
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.resumed: list[float] = []  # when the next span starts
        self.between_s: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        common.sync(self.device)
        self.ends.append(time.perf_counter())
        self.resumed.append(self.ends[-1])
        if self.between is not None:
            self.between()
            self.resumed[-1] = time.perf_counter()
            self.between_s.append(self.resumed[-1] - self.ends[-1])

    def spans(self, skip: int) -> tuple[list[float], list[float]]:
        """(step seconds, seconds waiting for the batch) of the batches after the first `skip` + 1."""
        resumed, ends, starts = self.resumed[skip:], self.ends[skip + 1 :], self.starts[skip + 1 :]
        return [e - r for r, e in zip(resumed, ends, strict=False)], [
            s - r for r, s in zip(resumed, starts, strict=False)
        ]


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
    net: str = "ours"  # ours | diffusers (model=diffusers_unet2d: UNet2DModel with the same arguments and weights)


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
            array = image.permute(1, 2, 0).numpy()
            self.paths.append(folder / f"{i:06d}.png")
            Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array).save(self.paths[-1])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        with Image.open(self.paths[i]) as image:
            array = torch.from_numpy(np.asarray(image).copy())
        return (array[None] if array.ndim == 2 else array.permute(2, 0, 1)), self.labels[i]


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    torch.set_float32_matmul_precision("high" if on else "highest")


def endless(loader: DataLoader) -> Iterator:
    while True:
        yield from loader


def bare_step(
    row: Row, net: nn.Module, batches: Iterator, *, device: torch.device, dm: RAMDataModule | None
) -> Callable[[], float]:
    """One step of a plain PyTorch loop (fetch, loss, backward, clip, AdamW, LR schedule); returns its fetch time."""
    diffusion = GaussianDiffusion().to(device)
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
        common.sync(device)
        fetched = time.perf_counter()
        y = diffusion.drop_labels(labels, net.num_classes) if net.num_classes is not None else None
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = diffusion.loss(net, x0, diffusion.sample_timesteps(x0.shape[0], device), torch.randn_like(x0), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        common.sync(device)
        return fetched - start

    return step


def bare_run(row: Row, step: Callable[[], float], *, steps: int, warmup: int) -> dict[str, float]:
    """A plain PyTorch loop: seconds per step, data-wait seconds per step, the first step (with compile: compiling)."""
    total = wait = first = 0.0
    with nullcontext() if row.fused_attention else sdpa_kernel(SDPBackend.MATH):
        for i in range(warmup + steps):
            start = time.perf_counter()
            fetch = step()
            first = time.perf_counter() - start if i == 0 else first
            if i >= warmup:
                total, wait = total + time.perf_counter() - start, wait + fetch
    return {"step_s": total / steps, "wait_s": wait / steps, "first_step_s": first}


def lightning_run(
    row: Row,
    net: UNet,
    dm: RAMDataModule,
    args: argparse.Namespace,
    warmup: int,
    device: torch.device,
    between: Callable[[], float] | None = None,
) -> dict[str, Any]:
    module = DiffusionModule(
        net=net,
        diffusion=GaussianDiffusion(),
        optim=AdamW(lr=1e-4, warmup_steps=0),
        compile=row.compile,
        compile_backend=args.compile_backend,
        channels_last=row.channels_last,
    )
    timer = BatchTimer(device, between)
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=1,
        precision="bf16-mixed" if row.precision == "bf16" else "32-true",
        max_steps=warmup + args.steps + 1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        log_every_n_steps=50,
    )
    trainer.fit(module, datamodule=dm)
    spans, waits = (s[: args.steps] for s in timer.spans(warmup))
    out = {
        "step_s": sum(spans) / len(spans),
        "wait_s": sum(waits) / len(waits),
        "first_step_s": timer.ends[0] - timer.starts[0],
    }
    if between is not None:  # the bare step ran right before each span: per-step ratios of neighbours
        bare = timer.between_s[warmup : warmup + len(spans)]
        out["paired_overhead"] = statistics.median(s / b - 1 for s, b in zip(spans, bare, strict=True))
        out["bare_step_s"] = sum(bare) / len(bare)
    return out


def data_run(dm: RAMDataModule, *, steps: int, warmup: int, device: torch.device) -> dict[str, float]:
    batches, total = endless(dm.train_dataloader()), 0.0
    for step in range(warmup + steps):
        start = time.perf_counter()
        images, labels = next(batches)
        dm.on_after_batch_transfer((images.to(device), labels.to(device)), 0)
        common.sync(device)
        total += time.perf_counter() - start if step >= warmup else 0.0
    return {"step_s": total / steps, "wait_s": total / steps, "first_step_s": 0.0}
