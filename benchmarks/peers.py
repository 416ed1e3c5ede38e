"""Training and sampling images/s of this project against the tools a user would pick instead, in one run.

    pip install -e '.[peers]'        # denoising-diffusion-pytorch and diffusers (never needed by make test)
    python benchmarks/peers.py --repeats 3
    python benchmarks/peers.py --repeats 5 --threads 2 --compile          # every tool's network compiled
    python benchmarks/peers.py --rows ours,diffusers --steps-train 50 --num-samples 512 --device cuda
    python benchmarks/peers.py --channels-last all   # the same memory layout for every tool (see below)

Rows (--rows, comma-separated; default all), each about unet_mnist's 1.11M parameters, class-conditional, on
32x32 MNIST held in RAM (uint8; scaled on the device inside the timed step), the same batch for every tool:
  ours        lightning-ddpm: conf/model/unet_mnist.yaml; training = benchmarks/throughput.py's bare_step
              (GaussianDiffusion.loss, AdamW, grad clip 1.0) with bf16 autocast where the device has native bf16
              and channels_last; sampling = ddpm.diffusion.generate with sample.py's defaults (precision auto, NHWC)
  dd_pytorch  denoising-diffusion-pytorch's classifier-free-guidance Unet(dim=26, dim_mults=(1, 2, 2)) and
              GaussianDiffusion: loss = diffusion(images, classes=labels), Adam and grad clip 1.0 as its Trainer,
              bf16 autocast (its Trainer's accelerate mixed precision); sampling = diffusion.sample(classes,
              cond_scale) with DDIM (sampling_timesteps = --steps, eta 0), under bf16 autocast too
  diffusers   diffusers' UNet2DModel (block_out_channels (32, 64, 64), attention at 8x8: the same layout as
              unet_mnist) with num_class_embeds=11 (10 classes + a null class) and DDPMScheduler: the loop of
              its train_unconditional example (add_noise, model(...).sample, MSE, AdamW, grad clip 1.0, cosine
              LR), bf16 autocast (the example's accelerate mixed_precision), channels_last; sampling = the
              DDIMScheduler loop on a doubled [cond; null] batch, the UNet cast to bf16 (its pipelines'
              torch_dtype) and channels_last (its inference speed-up guide)

Every row runs its tool's documented fast options; bf16 only where the device runs it natively (AVX512-BF16/AMX
CPUs, Ampere+ GPUs; float32 elsewhere, for every row alike). --compile: torch.compile (inductor, dynamic=False)
on every tool's network, training and sampling copies. --channels-last all: channels_last for every network and
job, documented by its tool or not (denoising-diffusion-pytorch says nothing of it): separates the memory
layout from the rest of a gap.

Columns: parameters, forward MFLOP per image (FlopCounterMode, 2 per multiply-add: the work behind a figure),
training images/s over --steps-train optimizer steps of --batch-size, sampling images/s for --num-samples images
(DDIM, --steps steps, classifier-free guidance w = --guidance in this project's convention
eps = (1 + w) eps_cond - w eps_null, i.e. cond_scale = guidance_scale = 1 + w for the peers) in batches of
--sample-batch images (default: sample.py's CPU/GPU default, the same for every tool). Each figure is the median
over --repeats, [min-max] beside it: that spread is the run-to-run noise. "x ours" is a tool's median over
this project's. "warm-up s": the untimed first training step + first sampling batch (with --compile, the
compile time). The summary says, per column, whether this project is first and by more than the noise, two
ways: the margin of the medians against the largest [min-max] spread of any row (strict: one outlier repeat of
any tool widens it), and the paired ratios ours / best peer within each repeat (the rows of one repeat saw the
same machine): ahead in every repeat is beyond the noise.

Order: every row gets one untimed training step and one untimed sampling batch before the first repeat (oneDNN
kernel set-up; with --compile the compilation, reported as warm-up seconds), then the repeats run all rows,
ABC CBA ..., each timed training segment after one more untimed step. Writes JSON to
benchmarks/results/peers_<device>.json (or --out) with the machine, torch version and git commit.
"""

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from report import machine, write_report  # benchmarks/report.py
from throughput import Row, bare_step, sync  # benchmarks/throughput.py: this project's fast training step
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ddpm.data.sources import DigitsSource, ImageSet, MNISTSource
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.generate import compile_network, generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.precision import native_bf16
from ddpm.sampling.runtime import default_batch_size, resolve_sampling_precision

REPO = Path(__file__).resolve().parents[1]
PEERS_HINT = "pip install -e '.[peers]'"
ROWS = {"ours": "lightning-ddpm", "dd_pytorch": "denoising-diffusion-pytorch", "diffusers": "diffusers"}
NUM_CLASSES, CHANNELS, IMAGE_SIZE, TIMESTEPS = 10, 1, 32, 1000
P_UNCOND = 0.1  # label-drop probability of every tool's training (this project's diffusion.p_uncond)
DD_PYTORCH_UNET = {"dim": 26, "dim_mults": (1, 2, 2)}  # 1,117,351 parameters (unet_mnist: 1,114,209)
DIFFUSERS_UNET = {  # unet_mnist's layout in diffusers' blocks: 1,114,209 parameters
    "block_out_channels": (32, 64, 64),
    "layers_per_block": 1,
    "down_block_types": ("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
    "up_block_types": ("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    "norm_num_groups": 8,
    "attention_head_dim": 64,  # one head, as unet_mnist's num_heads: 1
}


@dataclass(frozen=True)
class Setup:
    """What every row is built with."""

    device: torch.device
    bf16: bool  # bf16 autocast / weights: where the device runs bf16 natively (precision.native_bf16)
    compile: bool
    batch_size: int
    sample_batch: int
    steps: int
    guidance: float  # w, this project's convention
    channels_last_all: bool  # channels_last for every network and job, documented by its tool or not


@dataclass
class Tool:
    """One row: a tool's network, the fast options it runs with, and its two timed jobs."""

    key: str
    parameters: int
    fwd_flops_per_image: float
    options: list[str]
    train_step: Callable[[], object]  # one optimizer step on the next RAM batch
    sample: Callable[[Tensor], Tensor]  # labels (N,) -> uint8 images (N, C, H, W) on the CPU


def autocast(setup: Setup) -> AbstractContextManager:
    return torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=setup.bf16)


def to_uint8(x: Tensor, low: float) -> Tensor:
    """Images in [low, 1] -> uint8 [0, 255] on the CPU (what a sampler's caller saves)."""
    return ((x.float().clamp(low, 1) - low) * (255 / (1 - low))).round().to(torch.uint8).cpu()


def calls(setup: Setup, guided: str) -> str:
    """How a sampling step calls the network, for the options column."""
    return guided if setup.guidance > 0 else "the conditional batch only (no guidance)"


def forward_flops(forward: Callable[[Tensor, Tensor, Tensor], Any], device: torch.device, n: int = 2) -> float:
    """FLOPs of one conditional forward pass per image, counted on n images (2 per multiply-add)."""
    x = torch.randn(n, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, device=device)
    t, y = torch.randint(0, TIMESTEPS, (n,), device=device), torch.arange(n, device=device) % NUM_CLASSES
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        forward(x, t, y)
    return counter.get_total_flops() / n


def count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def ram_batches(data: ImageSet, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Random batches (uint8 images, labels) from the images in RAM; the same sequence for every tool."""
    generator = torch.Generator().manual_seed(0)
    while True:
        index = torch.randint(0, len(data.images), (batch,), generator=generator)
        yield data.images[index], data.labels[index]


def build_ours(setup: Setup, batches: Iterator[tuple[Tensor, Tensor]]) -> Tool:
    """throughput.py's bare_step (bf16 where native, channels_last) and generate with sample.py's defaults."""
    net = instantiate(OmegaConf.load(REPO / "conf" / "model" / "unet_mnist.yaml")).to(setup.device)
    flops = forward_flops(net, setup.device)
    sampling_net = copy.deepcopy(net).eval().to(memory_format=torch.channels_last)  # as sample.py (channels_last)
    net = net.to(memory_format=torch.channels_last)
    precision = "bf16" if setup.bf16 else "fp32"
    row = Row("bare", precision=precision, channels_last=True, compile=setup.compile)
    diffusion = GaussianDiffusion(p_uncond=P_UNCOND).to(setup.device)
    step = bare_step(
        row, compile_network(net) if setup.compile else net, diffusion, batches, device=setup.device, dm=None
    )
    sampling_net = compile_network(sampling_net) if setup.compile else sampling_net  # compiled once
    sampler, betas = DDIMSampler(steps=setup.steps), diffusion.betas64()

    def sample(labels: Tensor) -> Tensor:
        return generate(
            net=sampling_net,
            betas=betas,
            prediction=diffusion.prediction,
            sampler=sampler,
            image_shape=(CHANNELS, IMAGE_SIZE, IMAGE_SIZE),
            num_samples=len(labels),
            labels=labels,
            null_class=NUM_CLASSES,
            guidance=setup.guidance,
            seed=0,
            batch_size=setup.sample_batch,
            device=setup.device,
            precision=resolve_sampling_precision("auto", setup.device),
            compile=setup.compile,
        ).images

    options = [
        f"train: {precision} autocast, channels_last, AdamW, grad clip 1.0",
        f"sample: generate precision=auto ({'bf16' if setup.bf16 else '32'}), channels_last, DDIM, "
        f"{calls(setup, 'one [cond; null] batch')}",
    ]
    return Tool("ours", count(net), flops, options + (["torch.compile"] if setup.compile else []), step, sample)


def build_dd_pytorch(setup: Setup, batches: Iterator[tuple[Tensor, Tensor]]) -> Tool:
    """denoising-diffusion-pytorch's CFG Unet + GaussianDiffusion: README loss, its Trainer's Adam and clip."""
    try:
        from denoising_diffusion_pytorch import classifier_free_guidance as cfg
    except ImportError as error:
        raise SystemExit(f"denoising-diffusion-pytorch is missing ({error}): {PEERS_HINT}") from error
    cfg.tqdm = partial(cfg.tqdm, disable=True)  # no progress bar per sampled batch
    device = setup.device
    unet = cfg.Unet(num_classes=NUM_CLASSES, cond_drop_prob=P_UNCOND, channels=CHANNELS, **DD_PYTORCH_UNET)
    diffusion = cfg.GaussianDiffusion(
        unet,
        image_size=IMAGE_SIZE,
        timesteps=TIMESTEPS,
        sampling_timesteps=setup.steps,
        objective="pred_noise",
        beta_schedule="linear",
        ddim_sampling_eta=0.0,
    ).to(device)
    flops = forward_flops(partial(unet, cond_drop_prob=0.0), device)
    layout = torch.channels_last if setup.channels_last_all else torch.contiguous_format  # not in its docs
    diffusion = diffusion.to(memory_format=layout)
    sampling = copy.deepcopy(diffusion).eval()
    if setup.compile:  # the forward itself: forward_with_cond_scale calls self.forward, not self(...)
        for model in (diffusion.model, sampling.model):
            model.forward = torch.compile(model.forward, dynamic=False)
    optimizer = torch.optim.Adam(diffusion.parameters(), lr=1e-4, betas=(0.9, 0.99))  # its Trainer's defaults

    def step() -> None:
        images, labels = next(batches)
        images, labels = images.to(device).float().div_(255), labels.to(device)  # [0, 1]: it normalises itself
        images = images.contiguous(memory_format=layout)
        with autocast(setup):
            loss = diffusion(images, classes=labels)
        loss.backward()
        nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        sync(device)

    def sample(labels: Tensor) -> Tensor:
        out = []
        for chunk in labels.split(setup.sample_batch):
            with autocast(setup):  # cond_scale: 1 + w (its update is cond - null); rescaled_phi 0: no rescaling
                images = sampling.sample(classes=chunk.to(device), cond_scale=1 + setup.guidance, rescaled_phi=0.0)
            out.append(to_uint8(images, 0.0))
        return torch.cat(out)

    precision = ("bf16 autocast" if setup.bf16 else "fp32") + (", channels_last" if setup.channels_last_all else "")
    options = [
        f"train: {precision}, Adam, grad clip 1.0",
        f"sample: {precision}, DDIM, {calls(setup, 'separate cond and null calls')}",
    ]
    return Tool("dd_pytorch", count(unet), flops, options + (["torch.compile"] if setup.compile else []), step, sample)


def build_diffusers(setup: Setup, batches: Iterator[tuple[Tensor, Tensor]]) -> Tool:
    """diffusers' UNet2DModel + DDPMScheduler as train_unconditional.py trains it (with class labels), DDIM."""
    try:
        from diffusers import DDIMScheduler, DDPMScheduler, UNet2DModel
        from diffusers.optimization import get_scheduler
    except ImportError as error:
        raise SystemExit(f"diffusers is missing ({error}): {PEERS_HINT}") from error
    device, null = setup.device, NUM_CLASSES
    unet = UNet2DModel(
        sample_size=IMAGE_SIZE,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        num_class_embeds=NUM_CLASSES + 1,
        **DIFFUSERS_UNET,
    ).to(device)
    flops = forward_flops(lambda x, t, y: unet(x, t, class_labels=y), device)
    dtype = torch.bfloat16 if setup.bf16 else torch.float32
    with quiet_diffusers():  # "modules to keep in float32: []": none, so .to(dtype) is what torch_dtype would do
        sampling = copy.deepcopy(unet).eval().to(dtype=dtype, memory_format=torch.channels_last)  # pipelines' dtype
    unet = unet.to(memory_format=torch.channels_last)
    model = torch.compile(unet, dynamic=False) if setup.compile else unet
    sampling_model = torch.compile(sampling, dynamic=False) if setup.compile else sampling
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS, beta_schedule="linear")
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=500, num_training_steps=10**6)
    ddim = DDIMScheduler(num_train_timesteps=TIMESTEPS, beta_schedule="linear", timestep_spacing="trailing")
    ddim.set_timesteps(setup.steps)

    def step() -> None:
        images, labels = next(batches)
        clean = images.to(device).float().div_(127.5).sub_(1).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device)
        labels = torch.where(torch.rand(labels.shape, device=device) < P_UNCOND, null, labels)  # CFG's label drop
        noise = torch.randn_like(clean)
        timesteps = torch.randint(0, TIMESTEPS, (clean.shape[0],), device=device)
        noisy = noise_scheduler.add_noise(clean, noise, timesteps)
        with autocast(setup):
            output = model(noisy, timesteps, class_labels=labels, return_dict=False)[0]
        loss = F.mse_loss(output.float(), noise.float())
        loss.backward()
        nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        sync(device)

    def eps(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if setup.guidance == 0:  # no guidance: the conditional batch alone, as the other rows
            return sampling_model(x, t, class_labels=y, return_dict=False)[0]
        both = torch.cat([y, torch.full_like(y, null)])
        cond, uncond = sampling_model(torch.cat([x, x]), t, class_labels=both, return_dict=False)[0].chunk(2)
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

    train = f"{'bf16 autocast' if setup.bf16 else 'fp32'}, channels_last, AdamW, grad clip 1.0, cosine LR"
    options = [
        f"train: {train}",
        f"sample: UNet in {str(dtype).removeprefix('torch.')}, channels_last, DDIM, "
        f"{calls(setup, 'one [cond; null] batch')}",
    ]
    return Tool("diffusers", count(unet), flops, options + (["torch.compile"] if setup.compile else []), step, sample)


@contextmanager
def quiet_diffusers() -> Iterator[None]:
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


BUILDERS = {"ours": build_ours, "dd_pytorch": build_dd_pytorch, "diffusers": build_diffusers}


def load_data(root: str) -> tuple[ImageSet, str]:
    """32x32 grey MNIST from the IDX files under `root`, or scikit-learn's digits when there are none."""
    if Path(root).is_dir():
        return MNISTSource(root=root).load(image_size=IMAGE_SIZE, channels=CHANNELS), f"MNIST ({root})"
    print(f"no MNIST under {root}: scikit-learn's digits at 32x32 instead (the same tensor shapes and cost)")
    return DigitsSource().load(image_size=IMAGE_SIZE, channels=CHANNELS), "digits (MNIST missing)"


def warm_up(tool: Tool, labels: Tensor, device: torch.device) -> dict[str, float]:
    """One untimed training step and one untimed sampling batch (kernel set-up; with --compile, compilation)."""
    began = time.perf_counter()
    tool.train_step()
    trained = time.perf_counter()
    tool.sample(labels)
    sync(device)
    return {"warmup_train_s": trained - began, "warmup_sample_s": time.perf_counter() - trained}


def time_train(tool: Tool, steps: int, batch: int, device: torch.device) -> float:
    """Training images/s over `steps` optimizer steps, after one untimed step."""
    tool.train_step()
    began = time.perf_counter()
    for _ in range(steps):
        tool.train_step()
    sync(device)
    return steps * batch / (time.perf_counter() - began)


def time_sample(tool: Tool, labels: Tensor, device: torch.device) -> float:
    """Sampling images/s for len(labels) images, uint8 on the CPU at the end."""
    began = time.perf_counter()
    tool.sample(labels)
    sync(device)
    return len(labels) / (time.perf_counter() - began)


def spread(runs: list[float]) -> float:
    """(max - min) / median: the run-to-run noise of one figure."""
    return (max(runs) - min(runs)) / statistics.median(runs)


def row_result(tool: Tool, warm: dict[str, float], train: list[float], sample: list[float]) -> dict[str, Any]:
    return {
        "key": tool.key,
        "tool": ROWS[tool.key],
        "parameters": tool.parameters,
        "fwd_flops_per_image": tool.fwd_flops_per_image,
        "options": tool.options,
        **warm,
        "train_images_per_s": statistics.median(train),
        "train_runs": train,
        "train_spread": spread(train),
        "sample_images_per_s": statistics.median(sample),
        "sample_runs": sample,
        "sample_spread": spread(sample),
    }


def verdict(results: list[dict[str, Any]], column: str) -> dict[str, Any] | None:
    """Is this project first in `column`, and by more than the largest run-to-run spread of the rows?"""
    ours = next((r for r in results if r["key"] == "ours"), None)
    peers = [r for r in results if r["key"] != "ours"]
    if ours is None or not peers:
        return None
    best = max(peers, key=lambda r: r[f"{column}_images_per_s"])
    margin = ours[f"{column}_images_per_s"] / best[f"{column}_images_per_s"] - 1
    noise = max(r[f"{column}_spread"] for r in results) if len(ours[f"{column}_runs"]) > 1 else None
    # ours / best peer within each repeat (rows interleaved, so both saw the same state of the machine)
    paired = [o / b for o, b in zip(ours[f"{column}_runs"], best[f"{column}_runs"], strict=True)]
    return {
        "best_peer": best["tool"],
        "margin": margin,
        "noise": noise,
        "ours_first": margin > 0,
        "beyond_noise": None if noise is None else margin > noise,  # None: one repeat measures no noise
        "paired_ratios": paired,
        "ahead_in": sum(p > 1 for p in paired),  # of len(paired) repeats
        "beyond_noise_paired": None if len(paired) < 2 else min(paired) > 1,  # ahead in every repeat
    }


def verdict_line(v: dict[str, Any]) -> str:
    first = "first" if v["ours_first"] else "NOT first"
    if v["noise"] is None:
        return f"ours {first} (best peer {v['best_peer']}, margin {v['margin']:+.1%}; noise unknown: --repeats 1)"
    beyond = "beyond" if v["beyond_noise"] else "within"
    paired = v["paired_ratios"]
    return (
        f"ours {first} (best peer {v['best_peer']}, margin {v['margin']:+.1%}, noise {v['noise']:.1%}: {beyond} noise;"
        f" paired per repeat {min(paired):.2f}-{max(paired):.2f}x, ahead in {v['ahead_in']} of {len(paired)})"
    )


def table(results: list[dict[str, Any]]) -> str:
    ours = next((r for r in results if r["key"] == "ours"), None)

    def ratio(r: dict[str, Any], column: str) -> str:
        return "n/a" if ours is None else f"{r[column] / ours[column]:.2f}x"

    def figure(r: dict[str, Any], column: str) -> str:
        runs = r[f"{column}_runs"]
        return f"{r[f'{column}_images_per_s']:.1f} [{min(runs):.1f}-{max(runs):.1f}]"

    lines = [
        f"{'tool':<29}{'params':>11}{'MFLOP/img':>11}  {'train img/s [min-max]':<25}{'x ours':>7}  "
        f"{'sample img/s [min-max]':<25}{'x ours':>7}{'warm-up s':>11}"
    ]
    for r in results:
        lines.append(
            f"{r['tool']:<29}{r['parameters']:>11,}{r['fwd_flops_per_image'] / 1e6:>11.1f}  "
            f"{figure(r, 'train'):<25}{ratio(r, 'train_images_per_s'):>7}  "
            f"{figure(r, 'sample'):<25}{ratio(r, 'sample_images_per_s'):>7}"
            f"{r['warmup_train_s']:>6.1f}+{r['warmup_sample_s']:.1f}"
        )
    for r in results:
        lines.append(f"  {r['tool']}: {'; '.join(r['options'])}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every row, interleaved (ABC CBA ...)")
    parser.add_argument("--batch-size", type=int, default=128, help="training batch, the same for every tool")
    parser.add_argument("--steps-train", type=int, default=20, help="timed training steps per row and repeat")
    parser.add_argument("--num-samples", type=int, default=256, help="images sampled per row and repeat")
    parser.add_argument(
        "--sample-batch",
        type=int,
        default=None,
        help="images per sampling batch (default: sample.py's for the device: on a CPU 32 guided, 64 not)",
    )
    parser.add_argument("--steps", type=int, default=20, help="DDIM steps")
    parser.add_argument("--guidance", type=float, default=3.0, help="w: eps = (1 + w) eps_cond - w eps_null")
    parser.add_argument("--compile", action="store_true", help="torch.compile every tool's network")
    parser.add_argument(
        "--channels-last",
        choices=["documented", "all"],
        default="documented",
        help="documented: each tool's own layout advice; all: every network and job channels_last",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--data-root", default=str(REPO.parent / "shared/data/mnist"), help="MNIST IDX folder")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/peers_<device>.json)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROWS))
    if unknown or not names:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if min(args.repeats, args.batch_size, args.steps_train, args.num_samples, args.steps, args.sample_batch or 1) < 1:
        parser.error("--repeats, --batch-size, --steps-train, --num-samples, --sample-batch, --steps must be >= 1")
    if not 1 <= args.steps < TIMESTEPS or args.guidance < 0:
        parser.error(f"--steps must be in 1..{TIMESTEPS - 1} (DDIM) and --guidance >= 0")
    args.sample_batch = args.sample_batch or default_batch_size(args.device, guided=args.guidance > 0)
    if args.compile and args.num_samples > args.sample_batch and args.num_samples % args.sample_batch:
        parser.error(
            "with --compile, --num-samples must be a multiple of --sample-batch (a partial last batch "
            "would recompile the peers' networks inside the timing)"
        )
    return args, names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, names = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    setup = Setup(
        device=device,
        bf16=native_bf16(device.type),
        compile=args.compile,
        batch_size=args.batch_size,
        sample_batch=args.sample_batch,
        steps=args.steps,
        guidance=args.guidance,
        channels_last_all=args.channels_last == "all",
    )
    data, data_name = load_data(args.data_root)
    labels = torch.arange(args.num_samples) % NUM_CLASSES
    tools, warm = {}, {}
    for name in names:
        torch.manual_seed(0)
        tools[name] = BUILDERS[name](setup, ram_batches(data, args.batch_size))
        warm[name] = warm_up(tools[name], labels[: min(args.sample_batch, args.num_samples)], device)
        print(
            f"built {name}: {tools[name].parameters:,} parameters; warm-up: train {warm[name]['warmup_train_s']:.1f} s,"
            f" sample {warm[name]['warmup_sample_s']:.1f} s",
            flush=True,
        )
    train: dict[str, list[float]] = {name: [] for name in names}
    sample: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):  # alternate the order, so slow drift of the machine hits every row
        for name in names if repeat % 2 == 0 else names[::-1]:
            train[name].append(time_train(tools[name], args.steps_train, args.batch_size, device))
            sample[name].append(time_sample(tools[name], labels, device))
            print(
                f"done {name} ({repeat + 1}/{args.repeats}): train {train[name][-1]:.1f}, "
                f"sample {sample[name][-1]:.2f} images/s",
                flush=True,
            )
    results = [row_result(tools[n], warm[n], train[n], sample[n]) for n in names]
    summary = {"train": verdict(results, "train"), "sample": verdict(results, "sample")}
    report = {
        "data": data_name,
        "precision": "bf16" if setup.bf16 else "32",
        "args": vars(args),
        "machine": machine(device),
        "rows": results,
        "summary": summary,
    }
    print(table(results))
    for column, v in summary.items():
        if v is not None:
            print(f"{column}: {verdict_line(v)}")
    write_report(report, args.out, f"peers_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
