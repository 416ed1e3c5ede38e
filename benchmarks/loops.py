"""Training speed, written once for throughput.py, gpu.py and peers.py: a row (`Row`) on a train config is built once
(`Runner`), takes its first steps (`prepare`: a cold compile happens there), then is timed in windows the scripts
interleave (`measure`) and summed up (`figures`). docs/benchmarks.md says what each runner times.
"""

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import common
import lightning.pytorch as pl
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from ddpm.callbacks.ema import ema_decay
from ddpm.data.ram import random_hflip, scale_to_unit
from ddpm.data.sources import DigitsSource, ImageSet
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.precision import configure_precision, uses_cudagraphs
from ddpm.training import build_callbacks, build_loggers, resolve_config
from ddpm.weights.lightning_io import AtomicCheckpointIO

PEAK_FLOPS = {  # dense tensor-core peaks (SXM), FLOP/s; by a substring of torch.cuda.get_device_name()
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}
PRECISION = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
FITS = ("product", "lightning", "paired")  # the runners with a Trainer


@dataclass(frozen=True)
class Row:
    runner: str  # product (train.py's Trainer) | lightning (a bare Trainer) | bare | paired (both) | data
    precision: str = "fp32"  # fp32 | tf32 | bf16 | fp16
    compile: str | None = None  # torch.compile mode of the loss (DiffusionModule's); None: eager
    data: str = "datamodule"  # the bare loop's batches: disk (a PNG per image) | ram (random picks) | datamodule
    batch_mult: int = 1
    channels_last: bool = False  # module.channels_last (NHWC weights and inputs)
    fused_attention: bool = True  # False: SDPA's math kernel (bare rows)
    net: str = "ours"  # ours | diffusers (UNet2DModel with the same arguments and weights; bare rows)
    ema: bool = False  # the bare loop's EMA lerp
    tf32: bool | None = False  # of float32: off, or None: as train.py sets it (precision tf32: on)


def compose(row: Row, batch: int, device: torch.device, folder: Path, overrides: list[str],
            backend: str = "inductor") -> DictConfig:  # fmt: skip
    """train.py's config with `overrides` (a preset, an experiment) at the row's batch, precision, compile, layout."""
    return common.compose("train", [
        f"data.batch_size={batch * row.batch_mult}", f"compile={row.compile or 'false'}",
        f"trainer.precision={PRECISION[row.precision]}", f"module.compile_backend={backend}",
        f"module.channels_last={row.channels_last}", f"trainer.accelerator={'gpu' if device.type == 'cuda' else 'cpu'}",
        f"paths.output_dir={folder}", *overrides])  # fmt: skip


def flops(fn: Callable[[], Any]) -> float:
    """FLOPs fn() runs (FlopCounterMode: 2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def step_flops(net: nn.Module, batch: int, device: torch.device) -> float:
    """FLOPs of one training step (forward + backward) at `batch`, counted at <= 8 images and scaled."""
    n, net, diffusion = min(batch, 8), copy.deepcopy(net).to(device), GaussianDiffusion().to(device)
    x0 = torch.randn(n, net.in_channels, net.image_size, net.image_size, device=device)
    y = torch.zeros(n, dtype=torch.long, device=device) if net.num_classes is not None else None
    t = diffusion.sample_timesteps(n, device)
    return flops(lambda: diffusion.loss(net, x0, t, torch.randn_like(x0), y).backward()) * batch / n


def peak_flops(device: torch.device, precision: str) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v[precision] for k, v in PEAK_FLOPS.items() if k in name), None)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def load_images(net: nn.Module, count: int) -> ImageSet:
    """scikit-learn's digits (offline), resized to the model's size and channels, repeated up to `count`."""
    data = DigitsSource().load(image_size=net.image_size, channels=net.in_channels)
    repeat = -(-count // len(data.images))
    return ImageSet(data.images.repeat(repeat, 1, 1, 1)[:count], data.labels.repeat(repeat)[:count], 10)


def twin_refusal(cfg: DictConfig) -> str | None:
    """Why UNet2DModel cannot express `cfg`'s UNet (named model.<argument>), or that there is no diffusers; None where
    make_twin works."""
    import importlib.util

    from ddpm.config.build import keyed
    from ddpm.models.diffusers_unet import DIFFUSERS_EXTRA, NotUNet2D, unet2d_config

    arguments = OmegaConf.to_container(cfg.model, resolve=True)
    try:
        unet2d_config({k: v for k, v in arguments.items() if k != "_target_"})
    except NotUNet2D as error:
        return f"no UNet2DModel twin: {keyed(str(error), 'model', list(arguments))}"
    return None if importlib.util.find_spec("diffusers") else f"no UNet2DModel twin: no diffusers; {DIFFUSERS_EXTRA}"


def make_twin(cfg: DictConfig) -> nn.Module:
    """model=diffusers_unet2d with the arguments and (seeded) weights of `cfg`'s UNet: the same network as diffusers'
    UNet2DModel computes it."""
    from ddpm.models.diffusers_unet import DiffusersUNet2D
    from ddpm.weights.unet2d_mapping import to_unet2d_state

    torch.manual_seed(cfg.seed)
    base, arguments = instantiate(cfg.model), OmegaConf.to_container(cfg.model, resolve=True)
    arguments.pop("_target_")
    twin = DiffusersUNet2D(**{k: v for k, v in arguments.items() if k != "downsample"})  # all true: checked
    twin.unet.load_state_dict(to_unet2d_state(base.state_dict(), arguments))
    return twin


class PNGFolder(Dataset):
    """One PNG per image on disk, decoded with PIL at every access (the naive baseline)."""

    def __init__(self, data: ImageSet, folder: Path) -> None:
        self.paths, self.labels = [folder / f"{i:06d}.png" for i in range(len(data.images))], data.labels
        for path, image in zip(self.paths, data.images.permute(0, 2, 3, 1).numpy(), strict=True):
            Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(path)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        with Image.open(self.paths[i]) as image:
            array = torch.from_numpy(np.asarray(image).copy())
        return (array[None] if array.ndim == 2 else array.permute(2, 0, 1)), self.labels[i]


def ram_batches(data: ImageSet, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Random (uint8 images, labels) batches from RAM, the same sequence every time (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    while True:
        index = torch.randint(0, len(data.images), (batch,), generator=generator)
        yield data.images[index], data.labels[index]


def endless(loader: Any) -> Iterator:
    while True:
        yield from loader


def set_tf32(precision: str, tf32: bool | None = None) -> None:
    """TF32 as a train.py process of this precision has it (None), or on / off; set before every timing."""
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.allow_tf32 = tf32 is not False
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if tf32 is None:
        configure_precision(precision)


def datamodule(cfg: DictConfig, data: ImageSet) -> Any:
    """The config's data module on `data` (a RAM source; a call argument: a config node would be read-only)."""
    source = SimpleNamespace(prepare=lambda: None, count=lambda: len(data.images), load=lambda **_: data)
    return instantiate(cfg.data, _partial_=True)(source=source)


class Bare:
    """A plain PyTorch loop on `cfg`'s objects: a uint8 batch to the device, scaled (and flipped where the data config
    says), the loss DiffusionModule computes (compiled as it compiles it: the same function and graph), backward
    (scaled under fp16), foreach clipping, the config's optimizer and LR schedule, with `ema` the EMA's one lerp."""

    def __init__(self, cfg: DictConfig, data: ImageSet, device: torch.device, *, net: nn.Module | None = None,
                 ema: bool = True, tf32: bool | None = None) -> None:  # fmt: skip
        self.device, self.tf32, resolved = device, tf32, resolve_config(cfg)  # checked, as train.py checks it
        self.precision, mode = resolved["trainer"]["precision"], resolved["module"]["compile"]
        self.graphs = uses_cudagraphs(mode if isinstance(mode, str) else None)
        torch.manual_seed(cfg.seed)
        self.net = net if net is not None else instantiate(cfg.model)
        diffusion, optim = instantiate(cfg.diffusion), instantiate(cfg.optim)
        holder = instantiate(cfg.module, _partial_=True)(net=self.net, diffusion=diffusion, optim=optim,
                                                          compile=mode).to(device)  # fmt: skip
        holder.configure_model()  # compiles the loss as the Trainer does: dynamo reuses a Trainer row's graph
        self.loss, self.diffusion, self.params = holder._loss_fn, holder.diffusion, list(self.net.parameters())
        self.optimizer, self.schedule = optim.build(self.params, global_batch_size=cfg.data.batch_size,
                                                    total_steps=cfg.trainer.max_steps)  # fmt: skip
        self.scaler = torch.amp.GradScaler(enabled=self.precision == "16-mixed" and device.type == "cuda")
        self.ema, self.updates, self.clip = instantiate(cfg.ema) if ema else None, 0, cfg.trainer.gradient_clip_val
        self.live = [p.detach() for p in self.params]
        self.shadow = [p.float().clone() for p in self.live] if ema else []
        module = datamodule(cfg, data)
        module.setup("fit")
        self.loader, self.hflip, self.channels_last = module.train_dataloader(), module.hflip, holder.channels_last

    def step(self, batches: Iterator, clock: bool = False) -> float:
        """One optimizer step on the next batch; with `clock`, synced once the batch is on the device and scaled,
        and at the end: the seconds the batch took (the data wait)."""
        began = time.perf_counter()
        images, labels = (t.to(self.device, non_blocking=True) for t in next(batches))
        x0 = random_hflip(scale_to_unit(images)) if self.hflip else scale_to_unit(images)
        x0 = x0.contiguous(memory_format=torch.channels_last) if self.channels_last else x0
        if clock:
            common.sync(self.device)
        fetched = time.perf_counter() - began
        t, noise = self.diffusion.sample_timesteps(len(x0), x0.device), torch.randn_like(x0)
        classes = None if self.net.num_classes is None else self.diffusion.drop_labels(labels, self.net.num_classes)
        dtype = AUTOCAST.get(self.precision)  # as Lightning's: autocast without its weight-cast cache
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=False):
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss = self.loss(x0, t, noise, classes)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        if self.ema is not None:
            torch._foreach_lerp_(self.shadow, self.live, 1.0 - ema_decay(self.ema.decay, self.updates, self.ema.warmup))
        self.updates += 1
        if clock:
            common.sync(self.device)
        return fetched

    def steps(self, count: int, batches: Iterator) -> float:
        """Seconds of `count` steps, synced before and after only (the CPU runs ahead as in training)."""
        set_tf32(self.precision, self.tf32)
        return common.timed(lambda: [self.step(batches) for _ in range(count)], self.device)[1]


class Steps(pl.Callback):
    """Times a fit's batches: the end of every batch, synced (with `at`, only of the batches counted there: no host
    sync between them), and the start of every batch. `between()` runs after every batch, outside the spans."""

    def __init__(self, device: torch.device, at: tuple[int, int] | None = None, between: Callable | None = None):
        self.device, self.at, self.between, self.count = device, at, between, 0
        self.starts, self.ends, self.resumed, self.between_s = [], {}, [], []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1
        if self.at is None or self.count in self.at:
            common.sync(self.device)
            self.ends[self.count] = time.perf_counter()
        self.resumed.append(time.perf_counter())
        if self.between is not None:
            self.between()
            self.between_s.append(time.perf_counter() - self.resumed[-1])
            self.resumed[-1] = time.perf_counter()

    def spans(self, skip: int) -> tuple[list[float], list[float]]:
        """(step seconds, seconds before the step's batch arrived) of the batches after the first skip + 1; a span
        runs from the end of the previous batch (after between()) to the end of its own."""
        resumed, n = self.resumed[skip:], range(skip + 2, self.count + 1)
        steps = [self.ends[i] - r for i, r in zip(n, resumed, strict=False)]
        return steps, [self.starts[i - 1] - r for i, r in zip(n, resumed, strict=False)]

    @property
    def window(self) -> float:
        if self.at is None or self.at[1] not in self.ends:
            raise RuntimeError(f"the fit ended after {self.count} batches, before batch {self.at and self.at[1]}")
        return self.ends[self.at[1]] - self.ends[self.at[0]]


class Fit:
    """Lightning's Trainer on `cfg`'s objects, a new Trainer per fit of one module; `product`: with train.py's
    callbacks and loggers (else none, no validation: Lightning's own cost)."""

    def __init__(self, cfg: DictConfig, data: ImageSet, device: torch.device, folder: Path, product: bool) -> None:
        self.cfg, self.folder, self.product, resolved = cfg, folder, product, resolve_config(cfg)  # checked
        self.precision = resolved["trainer"]["precision"]
        torch.manual_seed(cfg.seed)
        self.net, diffusion, optim = (instantiate(cfg[key]) for key in ("model", "diffusion", "optim"))
        self.module = instantiate(cfg.module, _partial_=True)(net=self.net, diffusion=diffusion, optim=optim,
                                                               run_config=resolved,
                                                               compile=resolved["module"]["compile"])  # fmt: skip
        self.datamodule = datamodule(cfg, data)

    def fit(self, steps: int, *callbacks: pl.Callback, tf32: bool | None = None) -> None:
        set_tf32(self.precision, tf32)
        extra = {"logger": build_loggers(self.cfg), "plugins": [AtomicCheckpointIO()]} if self.product else {
            "logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "limit_val_batches": 0,
            "num_sanity_val_steps": 0}  # fmt: skip
        product = build_callbacks(self.cfg)[1] if self.product else []
        trainer = instantiate(self.cfg.trainer, precision=self.precision, max_steps=steps, enable_model_summary=False,
                              callbacks=[*product, *callbacks], default_root_dir=str(self.folder), **extra)  # fmt: skip
        trainer.fit(self.module, datamodule=self.datamodule)
        self.module.trainer = self.datamodule.trainer = None  # the fit's optimizer state and EMA copy go now
        gc.collect()


class Runner:
    """A row built once on its config; `resident`: the bytes it keeps on the device between windows."""

    def __init__(self, row: Row, cfg: DictConfig, data: ImageSet, device: torch.device, folder: Path,
                 workers: int = 0) -> None:  # fmt: skip
        self.row, self.device, self.batch, before = row, device, cfg.data.batch_size, allocated(device)
        self.tf32, self.bare, self.step_estimate = True if row.precision == "tf32" else row.tf32, None, 0.0
        self.fit = Fit(cfg, data, device, folder, row.runner == "product") if row.runner in FITS else None
        if row.runner in ("bare", "paired"):
            net = make_twin(cfg) if row.net == "diffusers" else None
            self.bare = Bare(cfg, data, device, net=net, ema=row.ema, tf32=self.tf32)
        if row.runner == "data":
            self.data = datamodule(cfg, data)
            self.data.setup("fit")
        self.net = None if row.runner == "data" else (self.fit or self.bare).net
        self.precision = (self.fit or self.bare).precision if row.runner != "data" else PRECISION[row.precision]
        if row.data == "disk":
            self.loader = DataLoader(PNGFolder(data, folder), batch_size=self.batch, shuffle=True, drop_last=True,
                                     num_workers=workers, persistent_workers=workers > 0)  # fmt: skip
        self.picks = ram_batches(data, self.batch)
        self.resident = allocated(device) - before

    def feed(self) -> Iterator:
        """The bare loop's batches: PNG files, random picks from RAM, or (a new epoch) the config's data module."""
        if self.row.data == "ram":
            return self.picks
        return endless(self.loader if self.row.data == "disk" else self.bare.loader)

    def prepare(self, steps: int) -> dict[str, Any]:
        """The row's first `steps` steps, each timed: the first (a cold compile) and a steady estimate."""
        before, times = allocated(self.device), [0.0]
        if self.fit is not None:
            probe = Steps(self.device)
            self.fit.fit(steps, probe, tf32=self.tf32)
            times = [probe.ends[i + 1] - probe.starts[i] for i in range(steps)]
        if self.bare is not None:
            feed, attention = self.feed(), self.attention()
            with attention:
                bare = [self.bare.steps(1, feed) for _ in range(1 if self.fit else steps)]
            times = times if self.fit else bare
        self.resident += allocated(self.device) - before  # the optimizer's state, graph pools
        self.step_estimate = statistics.median(times[1:] or times)
        return {"first_step_s": times[0], "prepare_steps_s": times}

    def attention(self) -> Any:
        return contextlib.nullcontext() if self.row.fused_attention else sdpa_kernel(SDPBackend.MATH)

    def window(self, warmup: int, steps: int, clock: bool = False) -> dict[str, float]:
        """Seconds per step over `steps` steps after `warmup` untimed ones (a Trainer: a new fit). clock: every step
        synced and its data wait kept (a Trainer's span: from the end of the previous batch); else synced at the
        window's ends only."""
        if self.row.runner == "data":  # a batch loaded, moved to the device and scaled
            batches = endless(self.data.train_dataloader())
            fetch = lambda: self.data.on_after_batch_transfer([t.to(self.device) for t in next(batches)], 0)  # noqa: E731
            total = sum(common.timed(fetch, self.device)[1] * (i >= warmup) for i in range(warmup + steps))
            return {"step_s": total / steps, "wait_s": total / steps}
        if self.fit is not None and not clock:
            timer = Steps(self.device, at=(max(warmup, 1), max(warmup, 1) + steps))
            self.fit.fit(timer.at[1], timer, tf32=self.tf32)
            return {"step_s": timer.window / steps}
        if self.fit is not None:  # paired: a bare step right after every Lightning step, outside its span
            pairs = self.bare and self.feed()
            timer = Steps(self.device, between=self.bare and (lambda: self.bare.step(pairs, clock=True)))
            self.fit.fit(warmup + steps + 1, timer, tf32=self.tf32)
            spans, waits = (s[:steps] for s in timer.spans(warmup))
            out = {"step_s": statistics.fmean(spans), "wait_s": statistics.fmean(waits)}
            if self.bare is not None:  # the overhead: the median of neighbouring steps' ratios (drift cancels)
                near = timer.between_s[warmup : warmup + len(spans)]
                out["paired_overhead"] = statistics.median(s / b - 1 for s, b in zip(spans, near, strict=True))
                out["bare_step_s"] = statistics.fmean(near)
            return out
        batches = self.feed()
        with self.attention():
            if not clock:
                self.bare.steps(warmup, batches)
                return {"step_s": self.bare.steps(steps, batches) / steps}
            set_tf32(self.bare.precision, self.tf32)
            step = lambda: self.bare.step(batches, clock=True)  # noqa: E731
            times = [common.timed(step, self.device) for _ in range(warmup + steps)][warmup:]
        return {"step_s": statistics.fmean(t for _, t in times), "wait_s": statistics.fmean(w for w, _ in times)}

    def measure(self, warmup: int, steps: int, clock: bool = False) -> dict[str, Any]:
        """window(), with the peak memory above what was allocated before it (CUDA)."""
        cuda, base = self.device.type == "cuda", allocated(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        out = self.window(warmup, steps, clock)
        peak = torch.cuda.max_memory_allocated(self.device) - base if cuda else None
        return {**out, "steps": steps, "peak_above_bytes": peak}


def figures(runner: Runner, runs: list[dict], info: dict, flops: float | None, peak: str | None = None) -> dict:
    """A row's figures over its windows: images/s median [min-max], ms/step, s per 60,000-image epoch, data-wait
    fraction, peak memory, MFU (of `peak` precision's peak, else the row's), compile s (first step - a steady one)."""
    step_s, rate = statistics.median(r["step_s"] for r in runs), common.rate(runner.batch / r["step_s"] for r in runs)
    above = [r["peak_above_bytes"] for r in runs if r.get("peak_above_bytes") is not None]
    top = peak_flops(runner.device, peak or runner.row.precision)
    out = {**rate, "ms_per_step": 1e3 * step_s, "s_per_60k_epoch": 60_000 / rate["images_per_s"],
           "flops_per_step": flops, "peak_memory_mib": (runner.resident + max(above)) / 2**20 if above else None,
           "mfu": None if top is None or flops is None else flops * rate["images_per_s"] / runner.batch / top,
           "compile_s": info["first_step_s"] - step_s if runner.row.compile else None}  # fmt: skip
    if all("wait_s" in r for r in runs):
        out["data_wait_fraction"] = statistics.median(r["wait_s"] / r["step_s"] for r in runs)
    if runner.row.runner == "paired":
        out["paired_overhead"] = common.stats(r["paired_overhead"] for r in runs)
        out["bare_step_s"] = statistics.median(r["bare_step_s"] for r in runs)
    return out
