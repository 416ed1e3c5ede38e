"""Export a run's EMA model as a diffusers pipeline folder that diffusers loads with its own API.

    python -m ddpm.export ckpt=outputs/<date>/<time>/ema.pt out=exports/digits

ckpt is anything sample.py takes (`ema.pt`, a `.ckpt`, `ema.safetensors`). The folder (written by diffusers'
own `DDPMPipeline.save_pretrained`, plus our run config) holds:

    model_index.json                       DDPMPipeline; unet = ["ddpm.weights.diffusers_adapter", "DDPMUNet2DModel"]
    unet/config.json                       our UNet's constructor arguments (+ sample_size = image_size)
    unet/diffusion_pytorch_model.safetensors   the EMA weights (float32, keys "net.<UNet key>")
    scheduler/scheduler_config.json        DDPMScheduler with exactly our schedule (below)
    ddpm_config.json                       the resolved run config (diffusers ignores it; our loader reads it)

Loading it in diffusers (diffusers 0.42 imports no module a model_index.json names; import ours first):

    import ddpm.weights.diffusers_adapter  # noqa: F401  (puts DDPMUNet2DModel where from_pretrained looks)
    from diffusers import DDIMPipeline, DDPMPipeline
    images = DDPMPipeline.from_pretrained("exports/digits")(batch_size=16, output_type="np").images
    images = DDIMPipeline.from_pretrained("exports/digits")(
        batch_size=16, num_inference_steps=50, eta=0.0, use_clipped_model_output=True, output_type="np"
    ).images

The scheduler is our schedule exactly: `trained_betas` are our float64 betas (beta_start/end/schedule are
written for the reader only: trained_betas takes precedence), num_train_timesteps = T, prediction_type
"epsilon" / "v_prediction" for diffusion.prediction eps / v, clip_sample=True with clip_sample_range=1.0
(our samplers' clip_denoised), variance_type="fixed_small" (sampler=ddpm's default), timestep_spacing="trailing"
and steps_offset=0 (sampler=ddim's default spacing). What each pipeline then equals:

- DDPMPipeline(num_inference_steps=T) is our `sampler=ddpm` on all T timesteps (the same draws from the same
  generator). With fewer steps DDPMScheduler picks its own trailing timesteps, not our sampler.steps respacing.
- DDIMPipeline converts the config to DDIMScheduler, whose set_alpha_to_one defaults to True (the last step
  goes to alpha_bar = 1, as ours); with num_inference_steps = S dividing T and eta=0 it is our
  `sampler=ddim sampler.steps=S` (trailing spacing) when called with use_clipped_model_output=True (ours
  re-derives eps from the clipped x0; the pipeline's default does not). For S not dividing T, DDIMScheduler
  steps to t - T // S rather than the next listed timestep (diffusers issue #12633): pass an S dividing T.
- diffusers keeps alpha_bar in float32 (ours float64), so images agree to within a uint8 level or so, not bit
  for bit (tests/test_export.py measures it).

Class-conditional models: DDPMPipeline / DDIMPipeline pass no class labels, so they call the UNet with
class_labels=None, the null class: unconditional samples. Classifier-free guidance (Ho & Salimans 2022),
eps = (1 + w) eps(x, y) - w eps(x, null) with null = num_classes, is a short loop by hand (this is
`python sample.py ckpt=... sampler=ddim sampler.steps=50 guidance=3 labels=[0,1,2,3]`, up to the noise):

    import torch
    import ddpm.weights.diffusers_adapter  # noqa: F401
    from diffusers import DDIMScheduler, DDPMPipeline

    pipe = DDPMPipeline.from_pretrained("exports/digits")
    unet, scheduler = pipe.unet.eval(), DDIMScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(50)  # S dividing T
    w, y = 3.0, torch.tensor([0, 1, 2, 3])
    null = torch.full_like(y, unet.config.num_classes)
    size = unet.config.sample_size
    x = torch.randn(len(y), unet.config.in_channels, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in scheduler.timesteps:
            cond, uncond = unet(torch.cat([x, x]), t, class_labels=torch.cat([y, null])).sample.chunk(2)
            out = (1 + w) * cond - w * uncond  # eps, or v: guidance is linear in either
            x = scheduler.step(out, t, x, eta=0.0, use_clipped_model_output=True).prev_sample
    images = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (B, C, H, W)

`ddpm.weights.load_model(folder)` reads such a folder back without diffusers (JSON and safetensors only), so
sample.py can take ckpt=<folder>.
"""

import argparse
from pathlib import Path

from ddpm.weights import CheckpointError, load_model
from ddpm.weights.diffusers_folder import export_diffusers


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m ddpm.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("settings", nargs="+", metavar="key=value", help="ckpt=<run>/ema.pt out=<folder>")
    args = parser.parse_args(argv)
    settings: dict[str, str] = {}
    for item in args.settings:
        key, sep, value = item.partition("=")
        if not sep or key not in ("ckpt", "out") or not value:
            parser.error(f"{item!r}: expected ckpt=<run>/ema.pt and out=<folder>")
        settings[key] = value
    missing = [k for k in ("ckpt", "out") if k not in settings]
    if missing:
        parser.error(f"missing {' and '.join(f'{k}=...' for k in missing)}")
    try:
        out = export_diffusers(load_model(settings["ckpt"]), settings["out"])
    except (CheckpointError, FileExistsError, ValueError) as error:
        parser.exit(1, f"python -m ddpm.export: {error}\n")
    print(
        f"diffusers pipeline: {out} (import ddpm.weights.diffusers_adapter, "
        f"then DDPMPipeline.from_pretrained({str(out)!r}))"
    )
    return out


if __name__ == "__main__":
    main()
