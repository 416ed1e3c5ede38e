"""Export a run's EMA model as a diffusers pipeline folder that diffusers loads with its own API.

    python -m ddpm.export ckpt=outputs/<date>/<time>/ema.pt out=exports/digits

ckpt is anything sample.py takes (`ema.pt`, a `.ckpt`, `ema.safetensors`). The folder (written by diffusers'
own `DDPMPipeline.save_pretrained`, plus our run config) holds:

    model_index.json                       DDPMPipeline; unet = ["ddpm.diffusers_adapter", "DDPMUNet2DModel"]
    unet/config.json                       our UNet's constructor arguments (+ sample_size = image_size)
    unet/diffusion_pytorch_model.safetensors   the EMA weights (float32, keys "net.<UNet key>")
    scheduler/scheduler_config.json        DDPMScheduler with exactly our schedule (below)
    ddpm_config.json                       the resolved run config (diffusers ignores it; our loader reads it)

Loading it in diffusers (diffusers 0.42 imports no module a model_index.json names; import ours first):

    import ddpm.diffusers_adapter  # noqa: F401  (puts DDPMUNet2DModel where from_pretrained looks)
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
    import ddpm.diffusers_adapter  # noqa: F401
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

`load_export(folder)` reads such a folder back as a ddpm.checkpoint.LoadedModel without diffusers (JSON and
safetensors only), so sample.py can take ckpt=<folder>.
"""

import argparse
import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

from ddpm.checkpoint import CheckpointError, LoadedModel, instantiate_local, load_ema_model
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.schedule import SCHEDULES, make_betas
from ddpm.models.unet import UNet

UNET_TARGET = "ddpm.models.unet.UNet"
ADAPTER = ["ddpm.diffusers_adapter", "DDPMUNet2DModel"]
PREDICTION_TYPE = {"eps": "epsilon", "v": "v_prediction"}
BETA_SCHEDULE = {"linear": "linear", "cosine": "squaredcos_cap_v2"}  # informative only: trained_betas wins
RUN_CONFIG = "ddpm_config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
# UNet arguments that describe the network (checkpoint_activations is a training-time switch, left out).
UNET_ARGS = [p for p in inspect.signature(UNet.__init__).parameters if p not in ("self", "checkpoint_activations")]


def scheduler_config(diffusion: GaussianDiffusion) -> dict[str, Any]:
    """DDPMScheduler arguments reproducing `diffusion` exactly: our float64 betas as trained_betas."""
    betas = diffusion.betas64()
    return dict(
        num_train_timesteps=diffusion.num_timesteps,
        trained_betas=betas.tolist(),  # float64 values; JSON keeps them exactly
        beta_start=float(betas[0]),
        beta_end=float(betas[-1]),
        beta_schedule=BETA_SCHEDULE[diffusion.schedule],
        prediction_type=PREDICTION_TYPE[diffusion.prediction],
        variance_type="fixed_small",
        clip_sample=True,
        clip_sample_range=1.0,
        thresholding=False,
        timestep_spacing="trailing",
        steps_offset=0,
        rescale_betas_zero_snr=False,
    )


def unet_arguments(model_config: dict[str, Any]) -> dict[str, Any]:
    """The adapter's config from the run's model node; only our UNet can be exported."""
    if model_config.get("_target_") != UNET_TARGET:
        raise ValueError(
            f"model._target_={model_config.get('_target_')!r}: only {UNET_TARGET} can be exported to diffusers"
        )
    unknown = sorted(set(model_config) - {*UNET_ARGS, "_target_", "checkpoint_activations"})
    if unknown:
        raise ValueError(f"model config keys {unknown} are not UNet arguments; cannot export")
    return {k: model_config[k] for k in UNET_ARGS if k in model_config}


def load_for_export(ckpt: str | os.PathLike) -> LoadedModel:
    """The EMA model of a .ckpt / ema.pt, or of an ema.safetensors (read without unpickling)."""
    if Path(ckpt).suffix == ".safetensors":
        from ddpm.safetensors_io import load_ema_model_safetensors

        return load_ema_model_safetensors(ckpt)
    return load_ema_model(ckpt)


def export_diffusers(ckpt: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the diffusers pipeline folder of the run's EMA model at `out` (created; a previous export is replaced)."""
    from diffusers import DDPMPipeline, DDPMScheduler

    from ddpm.diffusers_adapter import DDPMUNet2DModel

    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "model_index.json").is_file())):
        raise FileExistsError(f"out={out} exists and is not an export folder; pass a new or empty folder")
    loaded = load_for_export(ckpt)
    unet = DDPMUNet2DModel(**unet_arguments(dict(loaded.config["model"])))
    unet.net.load_state_dict(loaded.net.state_dict())
    scheduler = DDPMScheduler(**scheduler_config(loaded.diffusion))
    DDPMPipeline(unet=unet.eval(), scheduler=scheduler).save_pretrained(out, safe_serialization=True)
    (out / RUN_CONFIG).write_text(json.dumps(loaded.config, indent=2) + "\n")
    return out


def _read_json(path: Path, folder: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise CheckpointError(
            f"{folder} lacks {path.relative_to(folder)}; re-export with python -m ddpm.export"
        ) from error
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not readable JSON ({error}); re-export with python -m ddpm.export") from error


def _diffusion_from_scheduler(scheduler: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The diffusion config whose betas are the scheduler's trained_betas (a folder re-saved by diffusers has
    no ddpm_config.json); p_uncond is unknown then (None: guidance is not checked against it)."""
    prediction = {v: k for k, v in PREDICTION_TYPE.items()}.get(scheduler.get("prediction_type"))
    num_timesteps, betas = scheduler.get("num_train_timesteps"), scheduler.get("trained_betas")
    if prediction is None or not betas or len(betas) != num_timesteps:
        raise CheckpointError(
            f"{folder}/scheduler/scheduler_config.json is not a lightning-ddpm export (prediction_type "
            f"{scheduler.get('prediction_type')!r}, trained_betas {'set' if betas else 'missing'}); re-export"
        )
    for schedule in SCHEDULES:
        try:
            if torch.equal(make_betas(schedule, num_timesteps), torch.tensor(betas, dtype=torch.float64)):
                return {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": num_timesteps,
                        "schedule": schedule, "prediction": prediction, "p_uncond": None}  # fmt: skip
        except ValueError:
            continue
    raise CheckpointError(f"{folder}: the scheduler's trained_betas are none of our schedules {sorted(SCHEDULES)}")


def load_export(folder: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """Rebuild the UNet and schedule of a folder written by export_diffusers (no diffusers, no unpickling)."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    index = _read_json(folder / "model_index.json", folder)
    if index.get("unet") != ADAPTER:
        raise CheckpointError(
            f"{folder} is a diffusers folder whose unet is {index.get('unet')}, not lightning-ddpm's {ADAPTER}; "
            "load it with diffusers, or pass a folder written by python -m ddpm.export"
        )
    unet_config = _read_json(folder / "unet" / "config.json", folder)
    scheduler = _read_json(folder / "scheduler" / "scheduler_config.json", folder)
    arguments = {k: unet_config[k] for k in UNET_ARGS if k in unet_config}
    if (folder / RUN_CONFIG).is_file():
        config = _read_json(folder / RUN_CONFIG, folder)
        diffusion_config = config.get("diffusion") if isinstance(config, dict) else None
        if not isinstance(diffusion_config, dict):
            raise CheckpointError(f"{folder / RUN_CONFIG} has no diffusion section; re-export")
    else:
        diffusion_config = _diffusion_from_scheduler(scheduler, folder)
        config = {"model": {"_target_": UNET_TARGET, **arguments}, "diffusion": diffusion_config}
    p_uncond = diffusion_config.get("p_uncond")
    try:
        net = UNet(**arguments)
        diffusion = instantiate_local({**diffusion_config, "p_uncond": p_uncond or 0.0})
    except CheckpointError as error:
        raise CheckpointError(f"{folder}: {error}") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder}: its config does not build a model ({str(error)[:300]}); re-export") from error
    diffusion.p_uncond = p_uncond
    expected = scheduler_config(diffusion)
    changed = [
        k for k in ("num_train_timesteps", "trained_betas", "prediction_type") if scheduler.get(k) != expected[k]
    ]
    if changed:
        raise CheckpointError(
            f"{folder}: scheduler_config.json's {changed} disagree with the run's diffusion config; the folder was "
            "edited; re-export with python -m ddpm.export"
        )
    weights = folder / "unet" / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{folder} lacks unet/{WEIGHTS}; re-export with python -m ddpm.export")
    try:
        state = load_file(str(weights))
    except Exception as error:
        raise CheckpointError(
            f"{weights} is not a readable safetensors file (truncated or corrupt: {error})"
        ) from error
    try:
        net.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    except RuntimeError as error:
        raise CheckpointError(f"{weights}: the weights do not fit unet/config.json ({str(error)[:600]})") from error
    return LoadedModel(net=net.float().eval().to(device), diffusion=diffusion.to(device), config=config)


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
        out = export_diffusers(settings["ckpt"], settings["out"])
    except (CheckpointError, FileExistsError, ValueError) as error:
        parser.exit(1, f"python -m ddpm.export: {error}\n")
    print(f"diffusers pipeline: {out} (import ddpm.diffusers_adapter, then DDPMPipeline.from_pretrained({str(out)!r}))")
    return out


if __name__ == "__main__":
    main()
