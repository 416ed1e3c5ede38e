"""The training loops of throughput.py, peers.py and gpu.py, all on a train config's objects (conf/ composed as the
command line would: `common.compose("train", overrides)`):

- `Bare`: a plain PyTorch loop. A batch of uint8 images to the device, scaled (and flipped where the data config
  says), the loss DiffusionModule computes (compiled exactly as it compiles it: the same function, so the same graph),
  backward (scaled under fp16), foreach clipping to trainer.gradient_clip_val, the config's optimizer and LR schedule,
  and with `ema` the EMA callback's one foreach lerp. Its layout and precision: module.channels_last,
  trainer.precision (32-true, bf16-mixed, 16-mixed); TF32 as train.py sets it, or as `tf32` says.
- `Fit`: Lightning's Trainer on the same objects, a new one per fit on one module: the product (train.py's callbacks
  and loggers) or bare (none: Lightning's own cost). `Steps` times its batches.
"""

import copy
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import Dataset
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
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def step_flops(net: nn.Module, batch: int, device: torch.device) -> float:
    """FLOPs of one training step (forward + backward) at `batch`, counted at <= 8 images and scaled."""
    n, net, diffusion = min(batch, 8), copy.deepcopy(net).to(device), GaussianDiffusion().to(device)
    x0 = torch.randn(n, net.in_channels, net.image_size, net.image_size, device=device)
    y = torch.zeros(n, dtype=torch.long, device=device) if net.num_classes is not None else None
    with FlopCounterMode(display=False) as counter:
        diffusion.loss(net, x0, diffusion.sample_timesteps(n, device), torch.randn_like(x0), y).backward()
    return counter.get_total_flops() * batch / n


def peak_flops(device: torch.device, precision: str) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v[precision] for k, v in PEAK_FLOPS.items() if k in name), None)


def load_images(net: nn.Module, count: int) -> ImageSet:
    """scikit-learn's digits (offline), resized to the model's size and channels, repeated up to `count`."""
    data = DigitsSource().load(image_size=net.image_size, channels=net.in_channels)
    repeat = -(-count // len(data.images))
    return ImageSet(data.images.repeat(repeat, 1, 1, 1)[:count], data.labels.repeat(repeat)[:count], 10)


def model_arguments(cfg: DictConfig) -> dict[str, Any]:
    """The UNet's constructor arguments in `cfg` (what a UNet2DModel twin is made from)."""
    return {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "_target_"}


def twin_refusal(arguments: dict[str, Any]) -> str | None:
    """Why diffusers' UNet2DModel cannot express a UNet of these arguments (its keys named model.<argument>), why
    there is no twin here (no diffusers), or None."""
    import importlib.util

    from ddpm.config.build import keyed
    from ddpm.models.diffusers_unet import DIFFUSERS_EXTRA, NotUNet2D, unet2d_config

    try:
        unet2d_config(arguments)
    except NotUNet2D as error:
        return f"no UNet2DModel twin: {keyed(str(error), 'model', list(arguments))}"
    return None if importlib.util.find_spec("diffusers") else f"no UNet2DModel twin: no diffusers; {DIFFUSERS_EXTRA}"


def make_twin(base: nn.Module, arguments: dict[str, Any]) -> nn.Module:
    """model=diffusers_unet2d with `base`'s arguments and weights: the same network as diffusers' UNet2DModel
    computes it (twin_refusal says where there is none)."""
    from ddpm.models.diffusers_unet import DiffusersUNet2D
    from ddpm.weights.unet2d_mapping import to_unet2d_state

    twin = DiffusersUNet2D(**{k: v for k, v in arguments.items() if k != "downsample"})  # all true: checked
    twin.unet.load_state_dict(to_unet2d_state(base.state_dict(), arguments))
    return twin


class TensorSource:
    """Images already at the model's size as a RAMDataModule source."""

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


def endless(loader: Any) -> Iterator:
    while True:
        yield from loader


def set_tf32(precision: str, tf32: bool | None = None) -> None:
    """TF32 as a train.py process of this precision has it (torch's defaults, then configure_precision: on for
    32-true on Ampere+), or on / off as `tf32` says. Set before every timing: rows share this process."""
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.allow_tf32 = tf32 is not False
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if tf32 is None:
        configure_precision(precision)


def datamodule(cfg: DictConfig, source: Any) -> Any:
    # the source as a call argument, not merged into the config: a frozen-dataclass source would become a
    # read-only node that instantiate's resolve cannot write
    return instantiate(cfg.data, _partial_=True)(source=source)


class Bare:
    """A plain PyTorch loop on `cfg`'s objects (module docstring); `net`: the config's UNet, or a twin of it."""

    def __init__(self, cfg: DictConfig, source: Any, device: torch.device, *, net: nn.Module | None = None,
                 ema: bool = True, tf32: bool | None = None) -> None:  # fmt: skip
        self.device, self.tf32, self.resolved = device, tf32, resolve_config(cfg)  # checked, as train.py checks it
        self.precision, mode = self.resolved["trainer"]["precision"], self.resolved["module"]["compile"]
        self.graphs = uses_cudagraphs(mode if isinstance(mode, str) else None)
        torch.manual_seed(cfg.seed)
        self.net = net if net is not None else instantiate(cfg.model)
        diffusion, optim = instantiate(cfg.diffusion), instantiate(cfg.optim)
        # The loss the Trainer compiles, compiled as it compiles it (DiffusionModule.configure_model): a holder
        # module only, no Trainer; the same function and graph, so dynamo reuses a Trainer row's compilation.
        holder = instantiate(cfg.module, _partial_=True)(net=self.net, diffusion=diffusion, optim=optim,
                                                          compile=mode).to(device)  # fmt: skip
        holder.configure_model()
        self.loss, self.diffusion, self.params = holder._loss_fn, holder.diffusion, list(self.net.parameters())
        self.optimizer, self.schedule = optim.build(self.params, global_batch_size=cfg.data.batch_size,
                                                    total_steps=cfg.trainer.max_steps)  # fmt: skip
        self.scaler = torch.amp.GradScaler(enabled=self.precision == "16-mixed" and device.type == "cuda")
        self.ema, self.updates, self.clip = instantiate(cfg.ema) if ema else None, 0, cfg.trainer.gradient_clip_val
        self.live = [p.detach() for p in self.params]
        self.shadow = [p.float().clone() for p in self.live] if ema else []
        data = datamodule(cfg, source)
        data.setup("fit")
        self.loader, self.hflip, self.channels_last = data.train_dataloader(), data.hflip, cfg.module.channels_last

    def step(self, batches: Iterator, clock: bool = False) -> float:
        """One optimizer step on the next batch; with `clock`, synced after the batch is on the device and scaled:
        the seconds it took (the data wait)."""
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

    def steps(self, count: int, batches: Iterator | None = None) -> float:
        """Seconds of `count` steps, synced before and after only (the CPU runs ahead as in training)."""
        set_tf32(self.precision, self.tf32)
        batches = batches or endless(self.loader)  # a new epoch, as each fit of the Trainer rows starts one
        return common.timed(lambda: [self.step(batches) for _ in range(count)], self.device)[1]


class Steps(pl.Callback):
    """Times a fit's training batches: the end of every batch, synced (or with `at`, only of the batches counted
    there: no host sync between them), and the start of every batch. `between()` runs after every batch, outside
    the timed spans (throughput.py's paired bare step); its seconds are kept too."""

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
        """(step seconds, seconds before the step's batch arrived) of the batches after the first skip + 1."""
        resumed, n = self.resumed[skip:], range(skip + 2, self.count + 1)
        steps = [self.ends[i] - r for i, r in zip(n, resumed, strict=False)]
        return steps, [self.starts[i - 1] - r for i, r in zip(n, resumed, strict=False)]

    @property
    def window(self) -> float:
        if self.at is None or self.at[1] not in self.ends:
            raise RuntimeError(f"the fit ended after {self.count} batches, before batch {self.at and self.at[1]}")
        return self.ends[self.at[1]] - self.ends[self.at[0]]


class Fit:
    """Lightning's Trainer on `cfg`'s objects: one module and data module, a new Trainer per fit; `product`: with
    train.py's callbacks and loggers (else none, no validation: Lightning's own cost)."""

    def __init__(self, cfg: DictConfig, source: Any, device: torch.device, folder: Path, product: bool = True):
        self.cfg, self.device, self.folder, self.product = cfg, device, folder, product
        self.resolved = resolve_config(cfg)  # checked, as train.py checks it
        self.precision = self.resolved["trainer"]["precision"]
        torch.manual_seed(cfg.seed)
        self.net, diffusion, optim = (instantiate(cfg[key]) for key in ("model", "diffusion", "optim"))
        self.module = instantiate(cfg.module, _partial_=True)(net=self.net, diffusion=diffusion, optim=optim,
                                                               run_config=self.resolved,
                                                               compile=self.resolved["module"]["compile"])  # fmt: skip
        self.datamodule = datamodule(cfg, source)

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
