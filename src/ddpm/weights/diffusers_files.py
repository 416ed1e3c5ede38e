"""What both kinds of diffusers folder share: file names, reading JSON and weights, our schedule as a diffusers
scheduler config and back, and the last steps of rebuilding the model (needs no diffusers).
"""

import json
from pathlib import Path
from typing import Any

import torch

from ddpm.diffusion.edm import EDMDiffusion
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.schedule import SCHEDULES, make_betas
from ddpm.weights.model import CheckpointError, LoadedModel, build_model

PREDICTION_TYPE = {"eps": "epsilon", "v": "v_prediction"}
BETA_SCHEDULE = {"linear": "linear", "cosine": "squaredcos_cap_v2"}  # informative only: trained_betas wins
EDM_SCHEDULE = "edm"  # informative beta_schedule of an EDM model (diffusers reads only trained_betas then)
DIFFUSION_TARGET = "ddpm.diffusion.gaussian.GaussianDiffusion"
RUN_CONFIG = "ddpm_config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def scheduler_config(diffusion: GaussianDiffusion | EDMDiffusion) -> dict[str, Any]:
    """DDPMScheduler arguments reproducing `diffusion` exactly: our float64 betas as trained_betas (EDM: its levels
    as alpha_bar_t = 1 / (1 + sigma_t^2), with the adapter's eps)."""
    betas = diffusion.betas64()
    return dict(
        num_train_timesteps=diffusion.num_timesteps,
        trained_betas=betas.tolist(),  # float64 values; JSON keeps them exactly
        beta_start=float(betas[0]),
        beta_end=float(betas[-1]),
        beta_schedule=BETA_SCHEDULE.get(diffusion.schedule, EDM_SCHEDULE),
        prediction_type=PREDICTION_TYPE.get(diffusion.prediction, "epsilon"),  # EDM: the adapter returns eps
        variance_type="fixed_small",
        clip_sample=True,
        clip_sample_range=1.0,
        thresholding=False,
        timestep_spacing="trailing",
        steps_offset=0,
        rescale_betas_zero_snr=False,
    )


def read_json(path: Path, folder: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise CheckpointError(
            f"{folder} lacks {path.relative_to(folder)}; re-export with python -m ddpm.export"
        ) from error
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not readable JSON ({error}); re-export with python -m ddpm.export") from error
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(loaded).__name__}, not an object; re-export with python -m ddpm.export"
        )
    return loaded


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """unet/diffusion_pytorch_model.safetensors (no unpickling)."""
    from safetensors.torch import load_file

    weights = folder / "unet" / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(
            f"{folder} lacks unet/{WEIGHTS} (lightning-ddpm reads safetensors weights only, not .bin or sharded ones)"
        )
    try:
        return load_file(str(weights))
    except Exception as error:
        raise CheckpointError(
            f"{weights} is not a readable safetensors file (truncated or corrupt: {error})"
        ) from error


def _schedule_of(scheduler: dict[str, Any], num_timesteps: int) -> str | None:
    """Which of our schedules the scheduler's betas are: trained_betas or beta_schedule's, within 1e-6 relative of
    ours (JSON holds beta_start and beta_end as written; trained_betas: np.linspace's, or ours copied in float32)."""
    betas = scheduler.get("trained_betas")
    for schedule in SCHEDULES:
        try:
            ours = make_betas(schedule, num_timesteps)
        except ValueError:
            continue
        given = torch.tensor(betas or [], dtype=torch.float64)
        if betas and given.shape == ours.shape and torch.allclose(given, ours, rtol=1e-6, atol=0):
            return schedule
        kind = scheduler.get("beta_schedule", "linear")
        if betas or kind != BETA_SCHEDULE[schedule]:
            continue
        if schedule == "cosine":
            return schedule  # diffusers' betas_for_alpha_bar: our formula (s = 0.008, max_beta 0.999)
        start, end = scheduler.get("beta_start", 0.0001), scheduler.get("beta_end", 0.02)
        if torch.allclose(torch.linspace(start, end, num_timesteps, dtype=torch.float64), ours, rtol=1e-6, atol=0):
            return schedule
    return None


def diffusion_from_scheduler(scheduler: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The diffusion config of a folder without ddpm_config.json (re-saved or made by diffusers): prediction_type
    and our schedule from its betas; p_uncond is unknown then (None: guidance is not checked against it)."""
    prediction = {v: k for k, v in PREDICTION_TYPE.items()}.get(scheduler.get("prediction_type", "epsilon"))
    num_timesteps = scheduler.get("num_train_timesteps", 1000)
    where = f"{folder}/scheduler/scheduler_config.json"
    if prediction is None:
        raise CheckpointError(f"{where}: prediction_type {scheduler['prediction_type']!r}; ours: {PREDICTION_TYPE}")
    if scheduler.get("rescale_betas_zero_snr"):
        raise CheckpointError(f"{where}: rescale_betas_zero_snr=true changes the betas; none of our schedules does")
    schedule = _schedule_of(scheduler, num_timesteps)
    if schedule is None:
        described = "trained_betas" if scheduler.get("trained_betas") else (
            f"beta_schedule={scheduler.get('beta_schedule')!r}, beta_start={scheduler.get('beta_start')}, "
            f"beta_end={scheduler.get('beta_end')}"
        )  # fmt: skip
        raise CheckpointError(
            f"{where}: {described} at T={num_timesteps} is none of our schedules {sorted(SCHEDULES)} (linear: 1e-4 to "
            "0.02 scaled by 1000/T; cosine: squaredcos_cap_v2)"
        )
    return {"_target_": DIFFUSION_TARGET, "num_timesteps": num_timesteps, "schedule": schedule,
            "prediction": prediction, "p_uncond": None}  # fmt: skip


def rebuild(
    folder: Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    scheduler: dict[str, Any],
    device: torch.device | str,
) -> LoadedModel:
    """build_model from a folder's config and weights (in our network's keys); where the folder carries
    ddpm_config.json, its scheduler must still be the run's schedule (else it was edited)."""
    diffusion_config = config.get("diffusion")
    if not isinstance(diffusion_config, dict):
        raise CheckpointError(f"{folder / RUN_CONFIG} has no diffusion section; re-export")
    p_uncond = diffusion_config.get("p_uncond")  # None when unknown: guidance is then not checked against it
    loaded = build_model(
        {"model": config["model"], "diffusion": {**diffusion_config, "p_uncond": p_uncond or 0.0}},
        weights,
        source=str(folder),
        device=device,
    )
    loaded.diffusion.p_uncond = p_uncond
    if (folder / RUN_CONFIG).is_file():
        expected = scheduler_config(loaded.diffusion)
        changed = [
            k for k in ("num_train_timesteps", "trained_betas", "prediction_type") if scheduler.get(k) != expected[k]
        ]
        if changed:
            raise CheckpointError(
                f"{folder}: scheduler_config.json's {changed} disagree with the run's diffusion config; the folder "
                "was edited; re-export with python -m ddpm.export"
            )
    return LoadedModel(net=loaded.net, diffusion=loaded.diffusion, config=config)
