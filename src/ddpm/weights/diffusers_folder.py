"""The diffusers pipeline folder of a run's EMA model: `export_diffusers` writes it, `load_export` reads it back.

Writing needs diffusers (its own `DDPMPipeline.save_pretrained`); reading needs only JSON and safetensors, so
sample.py takes ckpt=<folder> without diffusers. The folder's layout and how to use it in diffusers are in
`python -m ddpm.export --help` (ddpm/export.py).
"""

import inspect
import json
import os
from pathlib import Path
from typing import Any

import torch

from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.schedule import SCHEDULES, make_betas
from ddpm.models.unet import UNet
from ddpm.weights.model import CheckpointError, LoadedModel, build_model

UNET_TARGET = "ddpm.models.unet.UNet"
ADAPTER = ["ddpm.weights.diffusers_adapter", "DDPMUNet2DModel"]
LEGACY_ADAPTERS = (ADAPTER, ["ddpm.diffusers_adapter", "DDPMUNet2DModel"])  # folders exported before the move
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


def export_diffusers(loaded: LoadedModel, out: str | os.PathLike) -> Path:
    """Write the diffusers pipeline folder of `loaded` (a run's EMA model) at `out` (created; a previous export is
    replaced)."""
    from diffusers import DDPMPipeline, DDPMScheduler

    from ddpm.weights.diffusers_adapter import DDPMUNet2DModel

    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "model_index.json").is_file())):
        raise FileExistsError(f"out={out} exists and is not an export folder; pass a new or empty folder")
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
    if index.get("unet") not in LEGACY_ADAPTERS:
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
    weights = folder / "unet" / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{folder} lacks unet/{WEIGHTS}; re-export with python -m ddpm.export")
    try:
        state = load_file(str(weights))
    except Exception as error:
        raise CheckpointError(
            f"{weights} is not a readable safetensors file (truncated or corrupt: {error})"
        ) from error
    p_uncond = diffusion_config.get("p_uncond")  # None when unknown: guidance is then not checked against it
    model = {"_target_": UNET_TARGET, **arguments}
    loaded = build_model(
        {"model": model, "diffusion": {**diffusion_config, "p_uncond": p_uncond or 0.0}},
        {k.removeprefix("net."): v for k, v in state.items()},
        source=str(folder),
        device=device,
    )
    loaded.diffusion.p_uncond = p_uncond
    expected = scheduler_config(loaded.diffusion)
    changed = [
        k for k in ("num_train_timesteps", "trained_betas", "prediction_type") if scheduler.get(k) != expected[k]
    ]
    if changed:
        raise CheckpointError(
            f"{folder}: scheduler_config.json's {changed} disagree with the run's diffusion config; the folder was "
            "edited; re-export with python -m ddpm.export"
        )
    return LoadedModel(net=loaded.net, diffusion=loaded.diffusion, config=config)
