"""Export a run's EMA model as a diffusers pipeline folder that diffusers alone loads and samples.

    python -m ddpm.export ckpt=outputs/<date>/<time>/ema.pt out=exports/digits

ckpt is anything sample.py takes (`ema.pt`, a `.ckpt`, `ema.safetensors`). Needs diffusers
(pip install -e '.[diffusers]'). The folder (written by diffusers' own `DDPMPipeline.save_pretrained`, plus our
run config) holds:

    model_index.json                       DDPMPipeline; unet = ["diffusers", "UNet2DModel"]
    unet/config.json                       UNet2DModel's config: our UNet's layout (ddpm.models.diffusers_unet)
    unet/diffusion_pytorch_model.safetensors   the EMA weights (float32), mapped tensor by tensor onto UNet2DModel
    scheduler/scheduler_config.json        DDPMScheduler with exactly our schedule (below)
    ddpm_config.json                       the resolved run config (diffusers ignores it; our loader reads it)

The unet is diffusers' own UNet2DModel, so the folder needs no lightning-ddpm (no `import ddpm`):

    from diffusers import DDIMPipeline, DDPMPipeline
    images = DDPMPipeline.from_pretrained("exports/digits")(batch_size=16, output_type="np").images
    images = DDIMPipeline.from_pretrained("exports/digits")(
        batch_size=16, num_inference_steps=50, eta=0.0, use_clipped_model_output=True, output_type="np"
    ).images

A model UNet2DModel cannot express (a level that does not halve, `model.downsample`; num_heads > 1 at attention
layers of different widths, as unet64 and seed_mnist; channel_mult[0] != 1) is written as before, with the unet
`["ddpm.weights.diffusers_adapter", "DDPMUNet2DModel"]` (our UNet in a diffusers ModelMixin; its config our UNet's
arguments): the command prints that it fell back and why, and loading that folder needs
`import ddpm.weights.diffusers_adapter` first (diffusers 0.42 imports no module a model_index.json names).
An EDM model (diffusion=edm) is always the adapter: its config holds EDM's preconditioning (edm_sigma_data and
each timestep's sigma), the adapter applies it around our UNet and returns eps, and the scheduler's trained_betas are
its noise levels (alpha_bar_t = 1 / (1 + sigma_t^2)), prediction_type "epsilon": the pipelines below sample it.

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
  for bit (tests/test_diffusers_native.py measures it).

Class-conditional models: UNet2DModel's class embedding has num_classes + 1 rows, the last (label num_classes)
our null class. DDPMPipeline / DDIMPipeline pass no class labels, and a class-conditional UNet2DModel refuses to
run without them (the adapter folder took None as the null class), so sample those with the loop below.
Classifier-free guidance (Ho & Salimans 2022), eps = (1 + w) eps(x, y) - w eps(x, null), null = num_classes, is
`python sample.py ckpt=... sampler=ddim sampler.steps=50 guidance=3 labels=[0,1,2,3]` up to the noise; w = 0 draws
class y unguided, and y = null unconditional samples:

    import torch
    from diffusers import DDIMScheduler, UNet2DModel

    unet = UNet2DModel.from_pretrained("exports/digits", subfolder="unet").eval()
    scheduler = DDIMScheduler.from_pretrained("exports/digits", subfolder="scheduler")
    scheduler.set_timesteps(50)  # S dividing T
    w, y = 3.0, torch.tensor([0, 1, 2, 3])
    null = torch.full_like(y, unet.config.num_class_embeds - 1)
    size = unet.config.sample_size
    x = torch.randn(len(y), unet.config.in_channels, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in scheduler.timesteps:
            cond, uncond = unet(torch.cat([x, x]), t, class_labels=torch.cat([y, null])).sample.chunk(2)
            out = (1 + w) * cond - w * uncond  # eps, or v: guidance is linear in either
            x = scheduler.step(out, t, x, eta=0.0, use_clipped_model_output=True).prev_sample
    images = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (B, C, H, W)

The folder is written whole or not at all: into a hidden folder beside `out` (`.<name>.tmp-<host>-<pid>`), swapped
in once complete. An earlier export at `out` stays byte for byte until then and is replaced; a folder holding
anything else (another project's diffusers pipeline, other files) is refused and left untouched. A killed export
leaves `out` as it was; the next export removes its hidden leftovers. A full disk or a file-size limit is an error
naming the file, the bytes the folder needs and the bytes free.

`ddpm.weights.load_model(folder)` reads such a folder back without diffusers (JSON and safetensors only), and so
does it a folder diffusers itself saved (a UNet2DModel of our UNet's family, a DDPMScheduler or DDIMScheduler of
our linear or cosine schedule), so sample.py can take ckpt=<folder>.
"""

import argparse
from pathlib import Path

from ddpm.models.diffusers_unet import DIFFUSERS_EXTRA
from ddpm.weights import CheckpointError, load_model
from ddpm.weights.diffusers_folder import export_diffusers, fallback_reason


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
        import diffusers  # noqa: F401
    except ImportError:
        parser.exit(1, f"python -m ddpm.export needs diffusers, which is not installed: {DIFFUSERS_EXTRA}\n")
    try:
        loaded = load_model(settings["ckpt"])
        reason = fallback_reason(dict(loaded.config["model"]), dict(loaded.config["diffusion"]))
        out = export_diffusers(loaded, settings["out"])
    except (CheckpointError, OSError, ValueError) as error:  # OSError: a refused folder, a failed write (WriteError)
        parser.exit(1, f"python -m ddpm.export: {error}\n")
    if loaded.config.get("latent"):  # no diffusers pipeline class decodes a class-conditional UNet's latents
        adapter = (
            "" if reason is None else ", with lightning-ddpm's adapter UNet (import ddpm.weights.diffusers_adapter)"
        )
        loop = "README.md's 'Latent diffusion' loop" + (" with the adapter's two changes" if reason else "")
        print(f"diffusers folder: {out} (unet, scheduler and vae/{adapter}); DDPMPipeline would return latents, not "
              f"images: {loop} samples and decodes it")  # fmt: skip
    elif reason is None:
        print(f"diffusers pipeline: {out} (UNet2DModel; DDPMPipeline.from_pretrained({str(out)!r}), no ddpm needed)"
              + guided(loaded.net.num_classes, "DDPMPipeline cannot call it: it passes no class_labels"))  # fmt: skip
    else:
        print(
            f"diffusers pipeline: {out}, with lightning-ddpm's adapter UNet: diffusers' UNet2DModel cannot hold this "
            f"model ({reason}); import ddpm.weights.diffusers_adapter, then DDPMPipeline.from_pretrained({str(out)!r})"
            + guided(loaded.net.num_classes, "DDPMPipeline draws it unconditionally (no class_labels: the null class)")
        )
    return out


def guided(num_classes: int | None, pipeline: str) -> str:
    """What a class-conditional export needs beyond DDPMPipeline (README.md, 'Use the model elsewhere')."""
    if num_classes is None:
        return ""
    return f"; a class-conditional model ({num_classes} classes): {pipeline}; README.md's guided loop draws classes"


if __name__ == "__main__":
    main()
