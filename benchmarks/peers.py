"""Training and sampling images/s of this project against the tools a user would pick instead, in one run (rows:
docs/benchmarks.md); the verdict: is ours first beyond the rows' widest spread, and ahead in every repeat?

    pip install -e '.[peers]'        # denoising-diffusion-pytorch and diffusers (never needed by make test)
    python benchmarks/peers.py --repeats 3
"""

import argparse
import copy
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace as Tool
from typing import Any

import common
import loops
import torch
import torch.nn.functional as F
from loops import Row
from mnist_quality import mnist_or_digits
from torch import Tensor, nn

from ddpm.diffusion.generate import to_uint8
from ddpm.diffusion.network import to_channels_last
from ddpm.precision import fast_bf16
from ddpm.sampling.runtime import default_batch_size, resolve_sampling_precision

PEERS_HINT = "pip install -e '.[peers]'"
SMOKE = {"batch_size": 8, "steps_train": 1, "num_samples": 4, "sample_batch": 4, "steps": 2}
ROWS = {"ours": "lightning-ddpm (Trainer + callbacks)", "ours_bare": "lightning-ddpm, bare loop (no Lightning)",
        "dd_pytorch": "denoising-diffusion-pytorch", "diffusers": "diffusers"}  # fmt: skip
NUM_CLASSES, CHANNELS, IMAGE_SIZE, TIMESTEPS, P_UNCOND = 10, 1, 32, 1000, 0.1
DD_PYTORCH_UNET = {"dim": 26, "dim_mults": (1, 2, 2)}  # 1,117,351 parameters (experiment=mnist: 1,114,209
# at 4fac82e, peers_cpu.json; 1,192,641 since its FiLM scale-shift: the peer now has 6% fewer, at 490 MFLOP vs 493)
# Each build_<row>(setup) returns a Tool: net and forward(x, t, y) (parameters, FLOPs), options (what it ran with),
# train(n): seconds of n timed optimizer steps after one untimed, sample(labels): uint8 images on the CPU, or None.
# setup: args, device, bf16 (autocast / weights only where bf16 is faster than float32), data (MNIST in RAM), folder.


def autocast(setup: Any) -> Any:
    return torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=setup.bf16)


def timed_steps(step: Callable[[], object], device: torch.device) -> Callable[[int], float]:
    return lambda steps: (step(), common.timed(lambda: [step() for _ in range(steps)], device)[1])[1]


def runner(setup: Any, kind: str, channels_last: bool = False) -> loops.Runner:
    """experiment=mnist as train.py composes it (the untimed sanity check and end-of-fit grid shrunk), as a row."""
    row = Row(kind, "bf16" if setup.bf16 else "fp32", channels_last=channels_last, tf32=None)
    cfg = loops.compose(row, setup.args.batch_size, setup.device, setup.folder, ["experiment=mnist",
                        "trainer.num_sanity_val_steps=0", "callbacks.sample_grid.num_samples=4",
                        "callbacks.sample_grid.sampler.steps=2"])  # fmt: skip
    return loops.Runner(row, cfg, setup.data, setup.device, setup.folder)


def build_ours(setup: Any) -> Tool:
    """The product (a Trainer on experiment=mnist), each step timed from the previous batch's end to its own;
    sampling: generate with sample.py's defaults (precision auto, NHWC), DDIM."""
    args, device, ours = setup.args, setup.device, runner(setup, "product")
    net, ddim, cfg = to_channels_last(ours.net).eval().to(device), common.sampler("ddim", args.steps), ours.fit.cfg
    options = {"batch": args.sample_batch, "guidance": args.guidance, "precision": resolve_sampling_precision("auto",
               device)}  # fmt: skip
    sample = lambda labels: common.draw(net, ours.fit.module.diffusion, ddim, len(labels), device, labels=labels,  # noqa: E731
                                        **options).images  # fmt: skip
    described = [f"train: Trainer precision {ours.precision}, module.channels_last false, AdamW, grad clip "
                 f"{cfg.trainer.gradient_clip_val}, EMA, callbacks: {', '.join(cfg.callbacks)}, loggers: csv, "
                 "tensorboard", "sample: precision auto, channels_last, DDIM"]  # fmt: skip
    return Tool(
        net=ours.net,
        forward=ours.net,
        options=described,
        sample=sample,
        train=lambda n: ours.window(0, n, clock=True)["step_s"] * n,
    )


def build_ours_bare(setup: Any) -> Tool:
    """The same config's objects in the bare loop: NHWC, no Lightning, callbacks, EMA or logging."""
    bare = runner(setup, "bare", channels_last=True)
    options = [f"train: bare loop, {'bf16 autocast' if setup.bf16 else 'fp32'}, channels_last, AdamW, grad clip 1.0; "
               "no Lightning, callbacks, EMA or logging"]  # fmt: skip
    return Tool(
        net=bare.net, forward=bare.net, options=options, train=lambda n: bare.window(1, n)["step_s"] * n, sample=None
    )


def build_dd_pytorch(setup: Any) -> Tool:
    """denoising-diffusion-pytorch's CFG Unet + GaussianDiffusion: README loss, its Trainer's Adam and clip."""
    from denoising_diffusion_pytorch import classifier_free_guidance as cfg

    cfg.tqdm = partial(cfg.tqdm, disable=True)  # no progress bar per sampled batch
    args, device, batches = setup.args, setup.device, loops.ram_batches(setup.data, setup.args.batch_size)
    unet = cfg.Unet(num_classes=NUM_CLASSES, cond_drop_prob=P_UNCOND, channels=CHANNELS, **DD_PYTORCH_UNET)
    diffusion = cfg.GaussianDiffusion(unet, image_size=IMAGE_SIZE, timesteps=TIMESTEPS, objective="pred_noise",
                                      sampling_timesteps=args.steps, beta_schedule="linear",
                                      ddim_sampling_eta=0.0).to(device)  # fmt: skip
    sampling = copy.deepcopy(diffusion).eval()
    optimizer = torch.optim.Adam(diffusion.parameters(), lr=1e-4, betas=(0.9, 0.99))  # its Trainer's

    def step() -> None:
        images, labels = next(batches)
        with autocast(setup):  # images in [0, 1]: it normalises itself
            loss = diffusion(images.to(device).float().div_(255), classes=labels.to(device))
        loss.backward()
        nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def sample(labels: Tensor) -> Tensor:
        with autocast(setup):  # cond_scale: 1 + w (its update is cond - null); rescaled_phi 0: no rescaling
            return torch.cat([to_uint8(sampling.sample(classes=chunk.to(device), cond_scale=1 + args.guidance,
                                                       rescaled_phi=0.0) * 2 - 1).cpu()  # its images: [0, 1]
                              for chunk in labels.split(args.sample_batch)])  # fmt: skip

    precision = "bf16 autocast" if setup.bf16 else "fp32"
    options = [f"train: {precision}, Adam, grad clip 1.0", f"sample: {precision}, DDIM, separate cond and null calls"]
    return Tool(
        net=unet,
        forward=partial(unet, cond_drop_prob=0.0),
        options=options,
        train=timed_steps(step, device),
        sample=sample,
    )


def build_diffusers(setup: Any) -> Tool:
    """Our network as diffusers' UNet2DModel (loops.make_twin) with its DDPMScheduler, trained as
    train_unconditional.py trains (with class labels), sampled with a guided DDIMScheduler loop."""
    from diffusers import DDIMScheduler, DDPMScheduler
    from diffusers.optimization import get_scheduler

    args, device, null = setup.args, setup.device, NUM_CLASSES
    batches = loops.ram_batches(setup.data, args.batch_size)
    unet = loops.make_twin(common.compose("train", ["experiment=mnist"])).unet
    unet = unet.to(device, memory_format=torch.channels_last)
    dtype = torch.bfloat16 if setup.bf16 else torch.float32
    sampling = copy.deepcopy(unet).eval().to(dtype)
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS, beta_schedule="linear")
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
        with autocast(setup):
            output = unet(noise_scheduler.add_noise(clean, noise, timesteps), timesteps, class_labels=labels,
                          return_dict=False)[0]  # fmt: skip
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
            out.append(to_uint8(x).cpu())
        return torch.cat(out)

    options = [
        f"train: {'bf16 autocast' if setup.bf16 else 'fp32'}, channels_last, AdamW, grad clip 1.0, cosine LR",
        f"sample: UNet in {str(dtype).removeprefix('torch.')}, channels_last, DDIM, one [cond; null] batch",
    ]
    return Tool(
        net=unet,
        forward=lambda x, t, y: unet(x, t, class_labels=y),
        options=options,
        sample=sample,
        train=timed_steps(step, device),
    )


def forward_flops(forward: Callable[[Tensor, Tensor, Tensor], Any], device: torch.device, n: int = 2) -> float:
    """FLOPs of one conditional forward pass per image, counted on n images (2 per multiply-add)."""
    x, y = torch.randn(n, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, device=device), torch.arange(n, device=device) % NUM_CLASSES
    with torch.no_grad():
        return loops.flops(lambda: forward(x, torch.randint(0, TIMESTEPS, (n,), device=device), y)) / n


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
        ratio = base and common.paired_ratios({"r": runs, "o": base}, "o")["r"]["median"]
        return [f"{r[f'{column}_images_per_s']:.1f} [{min(runs):.1f}-{max(runs):.1f}]", ratio and f"{ratio:.2f}x"]

    rows = [[r["tool"], f"{r['parameters']:,}", f"{r['fwd_flops_per_image'] / 1e6:.1f}", *cells(r, "train"),
             *cells(r, "sample")] for r in results]  # fmt: skip
    head = ["tool", "params", "MFLOP/img", "train img/s [min-max]", "x ours", "sample img/s [min-max]", "x ours"]
    return "\n".join([common.table(head, rows), *(f"  {r['tool']}: {'; '.join(r['options'])}" for r in results)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--batch-size", type=int, default=128, help="training batch, the same for every tool")
    add("--steps-train", type=int, default=20, help="timed training steps per row and repeat")
    add("--num-samples", type=int, default=256, help="images sampled per row and repeat")
    add("--sample-batch", type=int, default=None, help="images per sampling batch (default: sample.py's)")
    add("--steps", type=int, default=20, help="DDIM steps")
    add("--guidance", type=float, default=3.0, help="w: eps = (1 + w) eps_cond - w eps_null")
    add("--data-root", default=common.MNIST_ROOT, help="MNIST IDX folder (else scikit-learn's digits)")
    common.add_arguments(p, rows=list(ROWS), device="cpu")
    run = common.start(__file__, p, argv, rows=ROWS, smoke=SMOKE)
    args, device = run.args, run.device
    if min(args.batch_size, args.steps_train, args.num_samples, args.sample_batch or 1) < 1 or args.guidance < 0:
        p.error("--batch-size, --steps-train, --num-samples, --sample-batch must be >= 1, --guidance >= 0")
    if not 1 <= args.steps < TIMESTEPS:
        p.error(f"--steps must be in 1..{TIMESTEPS - 1} (DDIM)")
    args.sample_batch = args.sample_batch or default_batch_size(device, guided=args.guidance > 0)
    source, data_name = mnist_or_digits(args.data_root, allow_digits=True)
    labels, tools = torch.arange(args.num_samples) % NUM_CLASSES, {}
    with tempfile.TemporaryDirectory() as folder:
        setup = Tool(args=args, device=device, bf16=fast_bf16(device.type), folder=Path(folder),
                     data=source.load(image_size=IMAGE_SIZE, channels=CHANNELS))  # fmt: skip
        for name in run.rows:  # a missing peer stops the run (without it, another comparison), except under --smoke
            torch.manual_seed(0)
            try:
                tools[name] = globals()[f"build_{name}"](setup)
            except ImportError as error:
                if name.startswith("ours") or not args.smoke:
                    raise SystemExit(
                        f"{ROWS[name]} is missing ({error}): {PEERS_HINT}, or leave it out of --rows"
                    ) from error
                print(f"--smoke: skipping {name}: {ROWS[name]} is not installed ({error}); {PEERS_HINT}")
                continue
            tools[name].train(1)  # untimed: kernel set-up
            if tools[name].sample is not None:
                tools[name].sample(labels[: min(args.sample_batch, args.num_samples)])

        def measure(name: str, _repeat: int) -> tuple[float, float | None]:
            tool = tools[name]
            train = args.steps_train * args.batch_size / tool.train(args.steps_train)
            sample = None if tool.sample is None else len(labels) / common.timed(lambda: tool.sample(labels), device)[1]
            return train, sample

        runs = common.run_interleaved(list(tools), args.repeats, measure,
                                      lambda r: f"train {r[0]:.1f}, sample {r[1] or 0:.2f} images/s")  # fmt: skip
    results = []
    for n, tool in tools.items():
        row = {"key": n, "tool": ROWS[n], "parameters": sum(p.numel() for p in tool.net.parameters()),
               "options": tool.options, "fwd_flops_per_image": forward_flops(tool.forward, device)}  # fmt: skip
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
