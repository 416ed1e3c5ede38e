"""Training and sampling images/s of this project against the tools a user would pick instead, in one run.

    pip install -e '.[peers]'        # denoising-diffusion-pytorch and diffusers (never needed by make test)
    python benchmarks/peers.py --repeats 3 [--compile] [--channels-last all]

Rows (--rows), about unet_mnist's 1.11M parameters each, class-conditional, 32x32 MNIST in RAM, one batch for all:
`ours` the product (loops.Fit on experiment=mnist: callbacks, EMA, loggers; sampling as sample.py draws, DDIM),
`ours_bare` its objects in loops.Bare (no Lightning, callbacks or EMA; not the product), `dd_pytorch`
(denoising-diffusion-pytorch's CFG Unet, its Trainer's Adam and clip, its DDIM), `diffusers` (UNet2DModel, its
train_unconditional loop, a guided DDIMScheduler loop). bf16 only where faster than float32 (precision.fast_bf16).
Guidance w: eps = (1 + w) eps_cond - w eps_null (the peers' scale 1 + w). One untimed training step and sampling
batch per row first (warm-up s), then the repeats interleaved; "x ours": each repeat's ratio to ours. The verdict:
is ours first beyond the rows' widest spread, and ahead in every repeat? --smoke skips a missing peer.
"""

import argparse
import copy
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import common
import torch
import torch.nn.functional as F
from loops import Bare, Fit, Steps
from scoring import mnist_or_digits
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ddpm.diffusion.network import compile_network, to_channels_last
from ddpm.precision import fast_bf16
from ddpm.sampling.runtime import default_batch_size, resolve_sampling_precision

PEERS_HINT = "pip install -e '.[peers]'"
SMOKE = {"batch_size": 8, "steps_train": 1, "num_samples": 4, "sample_batch": 4, "steps": 2, "compile_backend": "eager"}
ROWS = {"ours": "lightning-ddpm (Trainer + callbacks)", "ours_bare": "lightning-ddpm, bare loop (no Lightning)",
        "dd_pytorch": "denoising-diffusion-pytorch", "diffusers": "diffusers"}  # fmt: skip
NUM_CLASSES, CHANNELS, IMAGE_SIZE, TIMESTEPS, P_UNCOND = 10, 1, 32, 1000, 0.1
DD_PYTORCH_UNET = {"dim": 26, "dim_mults": (1, 2, 2)}  # 1,117,351 parameters (unet_mnist: 1,114,209)
DIFFUSERS_UNET = {"block_out_channels": (32, 64, 64), "layers_per_block": 1, "norm_num_groups": 8,
                  "down_block_types": ("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"), "attention_head_dim": 64,
                  "up_block_types": ("AttnUpBlock2D", "UpBlock2D", "UpBlock2D")}  # fmt: skip  # unet_mnist's layout


@dataclass(frozen=True)
class Setup:
    """What every row is built with."""

    args: argparse.Namespace
    device: torch.device
    bf16: bool  # bf16 autocast / weights where bf16 is faster than float32
    data: Any  # ImageSet
    source: Any  # the same images as a data source (ours: the product's data module reads it)
    folder: Path  # ours' run folder

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def compiled(self, fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=False, backend=self.args.compile_backend) if self.args.compile else fn

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Random (uint8 images, labels) batches from RAM; the same sequence for every peer."""
        generator = torch.Generator().manual_seed(0)
        while True:
            index = torch.randint(0, len(self.data.images), (self.args.batch_size,), generator=generator)
            yield self.data.images[index], self.data.labels[index]

    def config(self, channels_last: bool) -> Any:
        """experiment=mnist as train.py composes it, sized and set like every other row."""
        return common.compose("train", [
            "experiment=mnist", f"data.batch_size={self.args.batch_size}", f"paths.output_dir={self.folder}",
            f"trainer.precision={'bf16-mixed' if self.bf16 else '32-true'}", f"compile={self.args.compile}",
            f"trainer.accelerator={'gpu' if self.device.type == 'cuda' else 'cpu'}",
            f"module.compile_backend={self.args.compile_backend}", f"module.channels_last={channels_last}",
            # untimed either way, so shrunk: the sanity check and the end-of-fit grid (each step's hook is timed)
            "trainer.num_sanity_val_steps=0", "callbacks.sample_grid.num_samples=4",
            "callbacks.sample_grid.sampler.steps=2"])  # fmt: skip


@dataclass
class Tool:
    """One row: a tool's network, the options it runs with, and its two timed jobs."""

    key: str
    parameters: int
    fwd_flops_per_image: float
    options: list[str]
    train: Callable[[int], float]  # seconds of n timed optimizer steps, after one untimed step
    sample: Callable[[Tensor], Tensor] | None  # labels (N,) -> uint8 images (N, C, H, W) on the CPU


def timed_steps(step: Callable[[], object], device: torch.device) -> Callable[[int], float]:
    return lambda steps: (step(), common.timed(lambda: [step() for _ in range(steps)], device)[1])[1]


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


def build_ours(setup: Setup) -> Tool:
    """The product (loops.Fit on experiment=mnist), each step timed from the previous batch's end to its own."""
    args = setup.args
    cfg = setup.config(args.channels_last == "all")
    fit = Fit(cfg, setup.source, setup.device, setup.folder)
    net = to_channels_last(fit.net).eval().to(setup.device)
    net = compile_network(net, args.compile_backend) if args.compile else net
    options = {
        "precision": resolve_sampling_precision("auto", setup.device),
        "compile": args.compile,
        "compile_backend": args.compile_backend,
        "batch": args.sample_batch,
        "guidance": args.guidance,
    }
    ddim = common.sampler("ddim", args.steps)

    def train(steps: int) -> float:
        timer = Steps(setup.device)
        fit.fit(steps + 1, timer)
        return sum(timer.spans(0)[0][:steps])

    def sample(labels: Tensor) -> Tensor:
        return common.draw(net, fit.module.diffusion, ddim, len(labels), setup.device, labels=labels, **options).images

    described = [f"train: Trainer precision {fit.precision}, module.channels_last {cfg.module.channels_last}, AdamW, "
                 f"grad clip {cfg.trainer.gradient_clip_val}, EMA, callbacks: {', '.join(cfg.callbacks)}, loggers: "
                 "csv, tensorboard", "sample: precision auto, channels_last, DDIM"]  # fmt: skip
    described += ["torch.compile"] if args.compile else []
    return Tool("ours", count(fit.net), forward_flops(fit.net.to(setup.device), setup.device), described, train, sample)


def build_ours_bare(setup: Setup) -> Tool:
    """The same config's objects in loops.Bare: NHWC, no Lightning, callbacks, EMA or logging."""
    bare = Bare(setup.config(True), setup.source, setup.device, ema=False)
    options = [f"train: bare loop, {'bf16 autocast' if setup.bf16 else 'fp32'}, channels_last, AdamW, grad clip 1.0; "
               "no Lightning, callbacks, EMA or logging"]  # fmt: skip
    train = lambda steps: (bare.steps(1), bare.steps(steps))[1]  # noqa: E731
    return Tool("ours_bare", count(bare.net), forward_flops(bare.net, setup.device), options, train, None)


def build_dd_pytorch(setup: Setup) -> Tool:
    """denoising-diffusion-pytorch's CFG Unet + GaussianDiffusion: README loss, its Trainer's Adam and clip."""
    from denoising_diffusion_pytorch import classifier_free_guidance as cfg

    cfg.tqdm = partial(cfg.tqdm, disable=True)  # no progress bar per sampled batch
    args, device, batches = setup.args, setup.device, setup.batches()
    unet = cfg.Unet(num_classes=NUM_CLASSES, cond_drop_prob=P_UNCOND, channels=CHANNELS, **DD_PYTORCH_UNET)
    diffusion = cfg.GaussianDiffusion(unet, image_size=IMAGE_SIZE, timesteps=TIMESTEPS, objective="pred_noise",
                                      sampling_timesteps=args.steps, beta_schedule="linear",
                                      ddim_sampling_eta=0.0).to(device)  # fmt: skip
    flops = forward_flops(partial(unet, cond_drop_prob=0.0), device)
    layout = torch.channels_last if args.channels_last == "all" else torch.contiguous_format  # not in its docs
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
        with setup.autocast():  # cond_scale: 1 + w (its update is cond - null); rescaled_phi 0: no rescaling
            return torch.cat([to_uint8(sampling.sample(classes=chunk.to(device), cond_scale=1 + args.guidance,
                                                       rescaled_phi=0.0), 0.0)
                              for chunk in labels.split(args.sample_batch)])  # fmt: skip

    precision = ("bf16 autocast" if setup.bf16 else "fp32") + (", channels_last" if args.channels_last == "all" else "")
    options = [f"train: {precision}, Adam, grad clip 1.0", f"sample: {precision}, DDIM, separate cond and null calls"]
    options += ["torch.compile"] if args.compile else []
    return Tool("dd_pytorch", count(unet), flops, options, timed_steps(step, device), sample)


def build_diffusers(setup: Setup) -> Tool:
    """diffusers' UNet2DModel + DDPMScheduler as train_unconditional.py trains it (with class labels), DDIM."""
    from diffusers import DDIMScheduler, DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.utils import logging

    args, device, null, batches = setup.args, setup.device, NUM_CLASSES, setup.batches()
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
    ddim.set_timesteps(args.steps)

    def step() -> None:
        images, labels = next(batches)
        clean = images.to(device).float().div_(127.5).sub_(1).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device)
        labels = torch.where(torch.rand(labels.shape, device=device) < P_UNCOND, null, labels)  # CFG's label drop
        noise, timesteps = torch.randn_like(clean), torch.randint(0, TIMESTEPS, (clean.shape[0],), device=device)
        with setup.autocast():
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)
            output = model(noisy, timesteps, class_labels=labels, return_dict=False)[0]
        F.mse_loss(output.float(), noise.float()).backward()
        nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()

    def eps(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if args.guidance == 0:  # no guidance: the conditional batch alone, as the other rows
            return sampling(x, t, class_labels=y, return_dict=False)[0]
        both = torch.cat([y, torch.full_like(y, null)])
        cond, uncond = sampling(torch.cat([x, x]), t, class_labels=both, return_dict=False)[0].chunk(2)
        return uncond + (1 + args.guidance) * (cond - uncond)  # guidance_scale = 1 + w

    @torch.no_grad()
    def sample(labels: Tensor) -> Tensor:
        out = []
        for chunk in labels.split(args.sample_batch):
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
    options += ["torch.compile"] if args.compile else []
    return Tool("diffusers", count(unet), flops, options, timed_steps(step, device), sample)


BUILDERS = {"ours": build_ours, "ours_bare": build_ours_bare, "dd_pytorch": build_dd_pytorch,
            "diffusers": build_diffusers}  # fmt: skip


def build(names: list[str], setup: Setup) -> dict[str, Tool]:
    """Every row's tool; a missing peer stops the run (a comparison without it is another one), except under
    --smoke, which skips it and says so."""
    tools = {}
    for name in names:
        torch.manual_seed(0)
        try:
            tools[name] = BUILDERS[name](setup)
        except ImportError as error:
            if name.startswith("ours"):
                raise
            if not setup.args.smoke:
                raise SystemExit(
                    f"{ROWS[name]} is missing ({error}): {PEERS_HINT}, or leave it out of --rows"
                ) from error
            print(f"--smoke: skipping {name}: {ROWS[name]} is not installed ({error}); {PEERS_HINT}")
    return tools


def verdict(results: list[dict[str, Any]], column: str, ours: str = "ours") -> dict[str, Any] | None:
    """Is `ours` first in `column` against the best peer, beyond the largest run-to-run spread of the rows, and
    ahead in every repeat (paired ratios ours / best peer: the rows of one repeat saw the same machine)?"""
    mine = next((r for r in results if r["key"] == ours and r[f"{column}_runs"]), None)
    peers = [r for r in results if not r["key"].startswith("ours") and r[f"{column}_runs"]]
    if mine is None or not peers:
        return None
    best = max(peers, key=lambda r: r[f"{column}_images_per_s"])
    margin = mine[f"{column}_images_per_s"] / best[f"{column}_images_per_s"] - 1
    noise = max(r[f"{column}_spread"] for r in [mine, *peers]) if len(mine[f"{column}_runs"]) > 1 else None
    paired = common.paired_ratios({"ours": mine[f"{column}_runs"], "best": best[f"{column}_runs"]}, "best")["ours"]
    return {"ours": ROWS[ours], "best_peer": best["tool"], "margin": margin, "noise": noise, "ours_first": margin > 0,
            "beyond_noise": None if noise is None else margin > noise,  # None: one repeat measures no noise
            "paired": paired, "paired_ratios": paired["runs"], "ahead_in": sum(p > 1 for p in paired["runs"]),
            "beyond_noise_paired": None if len(paired["runs"]) < 2 else paired["min"] > 1}  # fmt: skip


def verdict_line(v: dict[str, Any]) -> str:
    first = f"{v['ours']} {'first' if v['ours_first'] else 'NOT first'} (best peer {v['best_peer']}, margin "
    if v["noise"] is None:
        return first + f"{v['margin']:+.1%}; noise unknown: one repeat)"
    return first + (f"{v['margin']:+.1%}, noise {v['noise']:.1%}: {'beyond' if v['beyond_noise'] else 'within'} "
                    f"noise; paired per repeat {common.figure(v['paired'])}x, ahead in {v['ahead_in']} of "
                    f"{len(v['paired_ratios'])})")  # fmt: skip


def show(results: list[dict[str, Any]]) -> str:
    ours = next((r for r in results if r["key"] == "ours"), {})

    def cells(r: dict[str, Any], column: str) -> list[str]:
        runs, base = r[f"{column}_runs"], ours.get(f"{column}_runs")
        if not runs:
            return ["n/a", ""]
        ratio = f"{common.paired_ratios({'r': runs, 'o': base}, 'o')['r']['median']:.2f}x" if base else "n/a"
        return [f"{r[f'{column}_images_per_s']:.1f} [{min(runs):.1f}-{max(runs):.1f}]", ratio]

    rows = [
        [
            r["tool"],
            f"{r['parameters']:,}",
            f"{r['fwd_flops_per_image'] / 1e6:.1f}",
            *cells(r, "train"),
            *cells(r, "sample"),
            f"{r['warmup_train_s']:.1f}+{r['warmup_sample_s']:.1f}",
        ]
        for r in results
    ]
    head = ["tool", "params", "MFLOP/img", "train img/s [min-max]", "x ours", "sample img/s [min-max]", "x ours",
            "warm-up s"]  # fmt: skip
    return "\n".join([common.table(head, rows), *(f"  {r['tool']}: {'; '.join(r['options'])}" for r in results)])


def parse(argv: list[str] | None) -> common.Run:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--batch-size", type=int, default=128, help="training batch, the same for every tool")
    add("--steps-train", type=int, default=20, help="timed training steps per row and repeat")
    add("--num-samples", type=int, default=256, help="images sampled per row and repeat")
    add("--sample-batch", type=int, default=None, help="images per sampling batch (default: sample.py's)")
    add("--steps", type=int, default=20, help="DDIM steps")
    add("--guidance", type=float, default=3.0, help="w: eps = (1 + w) eps_cond - w eps_null")
    add("--compile", action="store_true", help="torch.compile every tool's network")
    add("--compile-backend", default="inductor", help="torch.compile backend (with --compile)")
    add("--channels-last", choices=["documented", "all"], default="documented",
        help="documented: each tool's own layout advice; all: every network and job channels_last")  # fmt: skip
    add("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder (else scikit-learn's digits)")
    common.add_arguments(p, rows=list(ROWS), device="cpu")
    run = common.start(__file__, p, argv, rows=ROWS, smoke=SMOKE)
    args = run.args
    if min(args.batch_size, args.steps_train, args.num_samples, args.steps, args.sample_batch or 1) < 1:
        p.error("--batch-size, --steps-train, --num-samples, --sample-batch, --steps must be >= 1")
    if not 1 <= args.steps < TIMESTEPS or args.guidance < 0:
        p.error(f"--steps must be in 1..{TIMESTEPS - 1} (DDIM) and --guidance >= 0")
    args.sample_batch = args.sample_batch or default_batch_size(run.device, guided=args.guidance > 0)
    if args.compile and args.num_samples > args.sample_batch and args.num_samples % args.sample_batch:
        p.error("with --compile, --num-samples must be a multiple of --sample-batch (a partial last batch would "
                "recompile the peers' networks inside the timing)")  # fmt: skip
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = parse(argv)
    args, device = run.args, run.device
    source, data_name = mnist_or_digits(args.data_root, allow_digits=True)
    labels = torch.arange(args.num_samples) % NUM_CLASSES
    with tempfile.TemporaryDirectory() as folder:
        data = source.load(image_size=IMAGE_SIZE, channels=CHANNELS)
        setup = Setup(args, device, fast_bf16(device.type), data, source, Path(folder))
        tools, warm = build(run.rows, setup), {}
        for name, tool in tools.items():  # untimed: kernel set-up, with --compile the compilation
            began = time.perf_counter()
            tool.train(0)
            trained = time.perf_counter()
            if tool.sample is not None:
                tool.sample(labels[: min(args.sample_batch, args.num_samples)])
            warm[name] = {"warmup_train_s": trained - began, "warmup_sample_s": time.perf_counter() - trained}
            print(f"built {name}: {tool.parameters:,} parameters; warm-up {warm[name]}", flush=True)

        def measure(name: str, _repeat: int) -> tuple[float, float | None]:
            tool = tools[name]
            train = args.steps_train * args.batch_size / tool.train(args.steps_train)
            sample = None if tool.sample is None else len(labels) / common.timed(lambda: tool.sample(labels), device)[1]
            return train, sample

        runs = common.run_interleaved(list(tools), args.repeats, measure,
                                      lambda r: f"train {r[0]:.1f}, sample {r[1] or 0:.2f} images/s")  # fmt: skip
    results = []
    for n, tool in tools.items():
        row = {"key": n, "tool": ROWS[n], "parameters": tool.parameters, "options": tool.options,
               "fwd_flops_per_image": tool.fwd_flops_per_image, **warm[n]}  # fmt: skip
        for column, values in (("train", [t for t, _ in runs[n]]), ("sample", [s for _, s in runs[n] if s])):
            s = common.stats(values) if values else None
            row.update({f"{column}_images_per_s": s and s["median"], f"{column}_runs": values,
                        f"{column}_spread": s and (s["max"] - s["min"]) / s["median"]})  # fmt: skip
        results.append(row)
    summary = {"train": verdict(results, "train"), "sample": verdict(results, "sample"),
               "train_bare": verdict(results, "train", ours="ours_bare")}  # fmt: skip
    if "ours" in tools and "ours_bare" in tools:  # what Lightning, the callbacks and the EMA cost per step
        trains = {n: [t for t, _ in runs[n]] for n in ("ours", "ours_bare")}
        summary["trainer_vs_bare"] = common.paired_ratios(trains, "ours_bare")["ours"]
    report = {"data": data_name, "precision": "bf16" if setup.bf16 else "32", "args": vars(args), "rows": results,
              "skipped": [n for n in run.rows if n not in tools], "summary": summary}  # fmt: skip
    print(show(results))
    for column, v in summary.items():
        if v is not None:
            print(f"{column}: {common.figure(v) + 'x' if column == 'trainer_vs_bare' else verdict_line(v)}")
    run.write(report, f"peers_{device.type}.json")
    return report


if __name__ == "__main__":
    main()
