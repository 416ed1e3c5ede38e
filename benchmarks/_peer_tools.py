"""peers.py's rows (a part of that script, split for length; no command line of its own): each tool's network,
the options it runs with, and its timed training and sampling jobs. See peers.py for what each row is."""

import copy
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import common
import torch
import torch.nn.functional as F
from _training_loops import BatchTimer
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ddpm.data.sources import ImageSet
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.generate import compile_network, generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.optim import AdamW
from ddpm.sampling.runtime import resolve_sampling_precision
from ddpm.training import build_callbacks, build_loggers, resolve_config
from ddpm.weights.lightning_io import AtomicCheckpointIO

ROWS = {
    "ours": "lightning-ddpm (Trainer + callbacks)",
    "ours_bare": "lightning-ddpm, bare loop (no Lightning)",
    "dd_pytorch": "denoising-diffusion-pytorch",
    "diffusers": "diffusers",
}
NUM_CLASSES, CHANNELS, IMAGE_SIZE, TIMESTEPS, P_UNCOND = 10, 1, 32, 1000, 0.1
DD_PYTORCH_UNET = {"dim": 26, "dim_mults": (1, 2, 2)}  # 1,117,351 parameters (unet_mnist: 1,114,209)
DIFFUSERS_UNET = {
    "block_out_channels": (32, 64, 64),
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "down_block_types": ("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
    "up_block_types": ("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    "attention_head_dim": 64,
}  # unet_mnist's layout in diffusers' blocks: 1,114,209 parameters


@dataclass(frozen=True)
class Setup:
    """What every row is built with."""

    device: torch.device
    bf16: bool  # bf16 autocast / weights: where bf16 is faster than float32 (precision.fast_bf16: CUDA, AMX CPUs)
    compile: bool
    backend: str  # torch.compile backend
    batch_size: int
    sample_batch: int
    steps: int
    guidance: float  # w, this project's convention
    channels_last_all: bool  # channels_last for every network and job, documented by its tool or not
    data: ImageSet
    source: Any  # the same images as a data source (ours: the product's RAMDataModule reads it)

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def compiled(self, fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=False, backend=self.backend) if self.compile else fn

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Random (uint8 images, labels) batches from RAM; the same sequence for every tool."""
        generator = torch.Generator().manual_seed(0)
        while True:
            index = torch.randint(0, len(self.data.images), (self.batch_size,), generator=generator)
            yield self.data.images[index], self.data.labels[index]


@dataclass
class Tool:
    """One row: a tool's network, the options it runs with, and its two timed jobs."""

    key: str
    parameters: int
    fwd_flops_per_image: float
    options: list[str]
    train: Callable[[int], float]  # seconds of n timed optimizer steps, after one untimed step
    sample: Callable[[Tensor], Tensor] | None  # labels (N,) -> uint8 images (N, C, H, W) on the CPU


def timed(step: Callable[[], object], device: torch.device) -> Callable[[int], float]:
    def train(steps: int) -> float:
        step()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        common.sync(device)
        return time.perf_counter() - began

    return train


def to_uint8(x: Tensor, low: float) -> Tensor:
    """Images in [low, 1] -> uint8 [0, 255] on the CPU (what a sampler's caller saves)."""
    return ((x.float().clamp(low, 1) - low) * (255 / (1 - low))).round().to(torch.uint8).cpu()


def forward_flops(forward: Callable[[Tensor, Tensor, Tensor], Any], device: torch.device, n: int = 2) -> float:
    """FLOPs of one conditional forward pass per image, counted on n images (2 per multiply-add)."""
    x = torch.randn(n, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, device=device)
    t, y = torch.randint(0, TIMESTEPS, (n,), device=device), torch.arange(n, device=device) % NUM_CLASSES
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        forward(x, t, y)
    return counter.get_total_flops() / n


def count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def trainer_fit(setup: Setup, cfg: Any) -> Callable[[int], float]:
    """n timed steps through a fresh Trainer of train.py's objects (set-up and the first step untimed)."""

    def train(steps: int) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            run_cfg = copy.deepcopy(cfg)
            run_cfg.paths.output_dir, run_cfg.trainer.max_steps = tmp, steps + 1
            resolved = resolve_config(run_cfg)  # as ddpm.training.train: checked, `auto` decided
            torch.manual_seed(run_cfg.seed)
            net, diffusion, optim = (instantiate(run_cfg[k]) for k in ("model", "diffusion", "optim"))
            module = instantiate(run_cfg.module, _partial_=True)(
                net=net, diffusion=diffusion, optim=optim, run_config=resolved, compile=resolved["module"]["compile"]
            )
            timer = BatchTimer(setup.device)
            trainer = instantiate(
                run_cfg.trainer,
                precision=resolved["trainer"]["precision"],
                logger=build_loggers(run_cfg),
                callbacks=[*build_callbacks(run_cfg)[1], timer],
                default_root_dir=tmp,
                plugins=[AtomicCheckpointIO()],
            )
            # the source as a call argument, not merged into the config: a frozen-dataclass source (DigitsSource,
            # MNIST missing) would become a read-only node that instantiate's resolve cannot write
            trainer.fit(module, datamodule=instantiate(run_cfg.data, _partial_=True)(source=setup.source))
        return sum(timer.spans(0)[0][:steps])

    return train


def ours_sampler(setup: Setup, net: nn.Module) -> Callable[[Tensor], Tensor]:
    """generate with sample.py's defaults: precision auto, NHWC weights, DDIM."""
    sampling_net = copy.deepcopy(net).eval().to(memory_format=torch.channels_last)
    sampling_net = compile_network(sampling_net, setup.backend) if setup.compile else sampling_net
    diffusion, sampler = GaussianDiffusion(p_uncond=P_UNCOND), DDIMSampler(steps=setup.steps)
    return lambda labels: generate(
        net=sampling_net, betas=diffusion.betas64(), prediction=diffusion.prediction, sampler=sampler,
        image_shape=(CHANNELS, IMAGE_SIZE, IMAGE_SIZE), num_samples=len(labels), labels=labels, null_class=NUM_CLASSES,
        guidance=setup.guidance, seed=0, batch_size=setup.sample_batch, device=setup.device,
        precision=resolve_sampling_precision("auto", setup.device), compile=setup.compile,
        compile_backend=setup.backend).images  # fmt: skip


def build_ours(setup: Setup) -> Tool:
    """The product: experiment=mnist composed as train.py composes it, sized and set like every other row."""
    overrides = ["experiment=mnist", f"data.batch_size={setup.batch_size}", "paths.output_dir=unset",
                 f"trainer.precision={'bf16-mixed' if setup.bf16 else '32-true'}", f"compile={setup.compile}",
                 f"trainer.accelerator={'gpu' if setup.device.type == 'cuda' else 'cpu'}",
                 f"module.compile_backend={setup.backend}", f"module.channels_last={setup.channels_last_all}",
                 # untimed either way, so shrunk: the sanity check and the end-of-fit grid (each step's hook is timed)
                 "trainer.num_sanity_val_steps=0", "callbacks.sample_grid.num_samples=4",
                 "callbacks.sample_grid.sampler.steps=2"]  # fmt: skip
    with initialize_config_dir(config_dir=str(common.REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    net = instantiate(cfg.model).to(setup.device)
    options = [
        f"train: Trainer precision {cfg.trainer.precision}, module.channels_last {setup.channels_last_all}, "
        f"AdamW, grad clip {cfg.trainer.gradient_clip_val}, EMA, callbacks: {', '.join(cfg.callbacks)}, "
        "loggers: csv, tensorboard",
        "sample: generate precision=auto, channels_last, DDIM",
    ]
    options += ["torch.compile"] if setup.compile else []
    return Tool("ours", count(net), forward_flops(net, setup.device), options, trainer_fit(setup, cfg),
                ours_sampler(setup, net))  # fmt: skip


def build_ours_bare(setup: Setup) -> Tool:
    """The same network in a bare loop: GaussianDiffusion.loss, AdamW, clip 1.0, bf16 autocast where faster, NHWC."""
    net = instantiate(OmegaConf.load(common.REPO / "conf/model/unet_mnist.yaml")).to(setup.device)
    net = net.to(memory_format=torch.channels_last)
    model, batches = setup.compiled(net), setup.batches()
    diffusion = GaussianDiffusion(p_uncond=P_UNCOND).to(setup.device)
    optimizer, schedule = AdamW(lr=1e-4, warmup_steps=0).build(list(net.parameters()), global_batch_size=64)

    def step() -> None:
        images, labels = (t.to(setup.device) for t in next(batches))
        x0 = (images.float() / 127.5 - 1).contiguous(memory_format=torch.channels_last)
        t = diffusion.sample_timesteps(len(x0), setup.device)
        with setup.autocast():
            loss = diffusion.loss(model, x0, t, torch.randn_like(x0), diffusion.drop_labels(labels, NUM_CLASSES))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        schedule.step()

    options = [
        f"train: bare loop, {'bf16 autocast' if setup.bf16 else 'fp32'}, channels_last, AdamW, grad clip 1.0; "
        "no Lightning, callbacks, EMA or logging"
    ]
    return Tool("ours_bare", count(net), forward_flops(net, setup.device), options, timed(step, setup.device), None)


def build_dd_pytorch(setup: Setup) -> Tool:
    """denoising-diffusion-pytorch's CFG Unet + GaussianDiffusion: README loss, its Trainer's Adam and clip."""
    from denoising_diffusion_pytorch import classifier_free_guidance as cfg

    cfg.tqdm = partial(cfg.tqdm, disable=True)  # no progress bar per sampled batch
    device, batches = setup.device, setup.batches()
    unet = cfg.Unet(num_classes=NUM_CLASSES, cond_drop_prob=P_UNCOND, channels=CHANNELS, **DD_PYTORCH_UNET)
    diffusion = cfg.GaussianDiffusion(unet, image_size=IMAGE_SIZE, timesteps=TIMESTEPS, objective="pred_noise",
                                      sampling_timesteps=setup.steps, beta_schedule="linear",
                                      ddim_sampling_eta=0.0).to(device)  # fmt: skip
    flops = forward_flops(partial(unet, cond_drop_prob=0.0), device)
    layout = torch.channels_last if setup.channels_last_all else torch.contiguous_format  # not in its docs
    diffusion = diffusion.to(memory_format=layout)
    sampling = copy.deepcopy(diffusion).eval()
    for model in (diffusion.model, sampling.model):  # forward_with_cond_scale calls self.forward, not self(...)
        model.forward = setup.compiled(model.forward)
    optimizer = torch.optim.Adam(diffusion.parameters(), lr=1e-4, betas=(0.9, 0.99))  # its Trainer's defaults

    def step() -> None:
        images, labels = next(batches)
        images = images.to(device).float().div_(255).contiguous(memory_format=layout)  # [0, 1]: it normalises itself
        with setup.autocast():
            loss = diffusion(images, classes=labels.to(device))
        loss.backward()
        nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def sample(labels: Tensor) -> Tensor:
        out = []
        for chunk in labels.split(setup.sample_batch):
            with setup.autocast():  # cond_scale: 1 + w (its update is cond - null); rescaled_phi 0: no rescaling
                out.append(
                    to_uint8(
                        sampling.sample(classes=chunk.to(device), cond_scale=1 + setup.guidance, rescaled_phi=0.0), 0.0
                    )
                )
        return torch.cat(out)

    precision = ("bf16 autocast" if setup.bf16 else "fp32") + (", channels_last" if setup.channels_last_all else "")
    options = [f"train: {precision}, Adam, grad clip 1.0", f"sample: {precision}, DDIM, separate cond and null calls"]
    compiled = ["torch.compile"] if setup.compile else []
    return Tool("dd_pytorch", count(unet), flops, options + compiled, timed(step, device), sample)


def build_diffusers(setup: Setup) -> Tool:
    """diffusers' UNet2DModel + DDPMScheduler as train_unconditional.py trains it (with class labels), DDIM."""
    from diffusers import DDIMScheduler, DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.utils import logging

    device, null, batches = setup.device, NUM_CLASSES, setup.batches()
    unet = UNet2DModel(sample_size=IMAGE_SIZE, in_channels=CHANNELS, out_channels=CHANNELS,
                       num_class_embeds=NUM_CLASSES + 1, **DIFFUSERS_UNET).to(device)  # fmt: skip
    flops = forward_flops(lambda x, t, y: unet(x, t, class_labels=y), device)
    dtype = torch.bfloat16 if setup.bf16 else torch.float32
    logging.set_verbosity_error()  # "modules to keep in float32: []": .to(dtype) is what torch_dtype would do
    sampling = setup.compiled(copy.deepcopy(unet).eval().to(dtype=dtype, memory_format=torch.channels_last))
    unet = unet.to(memory_format=torch.channels_last)
    model, noise_scheduler = setup.compiled(unet), DDPMScheduler(num_train_timesteps=TIMESTEPS, beta_schedule="linear")
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=500, num_training_steps=10**6)
    ddim = DDIMScheduler(num_train_timesteps=TIMESTEPS, beta_schedule="linear", timestep_spacing="trailing")
    ddim.set_timesteps(setup.steps)

    def step() -> None:
        images, labels = next(batches)
        clean = images.to(device).float().div_(127.5).sub_(1).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device)
        labels = torch.where(torch.rand(labels.shape, device=device) < P_UNCOND, null, labels)  # CFG's label drop
        noise, timesteps = torch.randn_like(clean), torch.randint(0, TIMESTEPS, (clean.shape[0],), device=device)
        with setup.autocast():
            output = model(
                noise_scheduler.add_noise(clean, noise, timesteps), timesteps, class_labels=labels, return_dict=False
            )[0]
        F.mse_loss(output.float(), noise.float()).backward()
        nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()

    def eps(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if setup.guidance == 0:  # no guidance: the conditional batch alone, as the other rows
            return sampling(x, t, class_labels=y, return_dict=False)[0]
        both = torch.cat([y, torch.full_like(y, null)])
        cond, uncond = sampling(torch.cat([x, x]), t, class_labels=both, return_dict=False)[0].chunk(2)
        return uncond + (1 + setup.guidance) * (cond - uncond)  # guidance_scale = 1 + w

    @torch.no_grad()
    def sample(labels: Tensor) -> Tensor:
        out = []
        for chunk in labels.split(setup.sample_batch):
            y = chunk.to(device)
            x = torch.randn((len(y), CHANNELS, IMAGE_SIZE, IMAGE_SIZE), device=device, dtype=dtype)
            for t in ddim.timesteps:
                x = ddim.step(eps(x, t, y), t, x, eta=0.0, return_dict=False)[0]
            out.append(to_uint8(x, -1.0))
        return torch.cat(out)

    options = [
        f"train: {'bf16 autocast' if setup.bf16 else 'fp32'}, channels_last, AdamW, grad clip 1.0, cosine LR",
        f"sample: UNet in {str(dtype).removeprefix('torch.')}, channels_last, DDIM, one [cond; null] batch",
    ]
    compiled = ["torch.compile"] if setup.compile else []
    return Tool("diffusers", count(unet), flops, options + compiled, timed(step, device), sample)


BUILDERS = {"ours": build_ours, "ours_bare": build_ours_bare, "dd_pytorch": build_dd_pytorch,
            "diffusers": build_diffusers}  # fmt: skip
