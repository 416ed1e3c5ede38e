"""The native diffusers folder: a DDPMPipeline whose unet is diffusers' own UNet2DModel, loadable by diffusers
alone. `write_native` writes a run's (our UNet mapped tensor by tensor through unet2d_mapping.py, or the
model=diffusers_unet2d network as it is); `load_native` reads one back onto our network, whether
`python -m ddpm.export` wrote it (with ddpm_config.json: the run's own model and schedule) or diffusers did
(`save_pretrained` of a UNet2DModel in our UNet's family and a DDPMScheduler / DDIMScheduler with one of our
schedules: anything else is refused, naming what). Reading needs no diffusers.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ddpm.models.diffusers_unet import NotUNet2D, unet2d_config
from ddpm.weights.diffusers_files import (
    RUN_CONFIG,
    diffusion_from_scheduler,
    read_json,
    read_weights,
    rebuild,
    scheduler_config,
)
from ddpm.weights.model import CheckpointError, LoadedModel
from ddpm.weights.unet2d_mapping import arguments_from_unet2d, from_unet2d_state, to_unet2d_state

UNET_TARGET = "ddpm.models.unet.UNet"
WRAPPER_TARGET = "ddpm.models.diffusers_unet.DiffusersUNet2D"  # model=diffusers_unet2d: a UNet2DModel already
NATIVE_UNET = ["diffusers", "UNet2DModel"]
SCHEDULERS = ("DDPMScheduler", "DDIMScheduler")
NOT_ARCHITECTURE = ("_target_", "checkpoint_activations")  # model keys that change no weight


def _arguments(model_config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_config.items() if k not in NOT_ARCHITECTURE}


def native_unet2d_config(model_config: Mapping[str, Any]) -> dict[str, Any]:
    """The UNet2DModel config of a run's model node; NotUNet2D where UNet2DModel cannot express it, ValueError
    for a model that is neither our UNet nor model=diffusers_unet2d."""
    target = model_config.get("_target_")
    if target not in (UNET_TARGET, WRAPPER_TARGET):
        raise ValueError(f"model._target_={target!r}: only {UNET_TARGET} and {WRAPPER_TARGET} can be exported")
    return unet2d_config(_arguments(model_config))


def unet2d_state(net: nn.Module, model_config: Mapping[str, Any]) -> dict[str, Tensor]:
    """The network's weights under UNet2DModel's names."""
    state = net.state_dict()
    if model_config["_target_"] == WRAPPER_TARGET:
        return {k.removeprefix("unet."): v for k, v in state.items()}
    return to_unet2d_state(state, _arguments(model_config))


def network_state(unet2d: Mapping[str, Tensor], model_config: Mapping[str, Any]) -> dict[str, Tensor]:
    """UNet2DModel weights under the names of the network `model_config` builds (the inverse of unet2d_state)."""
    if model_config["_target_"] == WRAPPER_TARGET:
        return {f"unet.{k}": v for k, v in unet2d.items()}
    return from_unet2d_state(unet2d, _arguments(model_config))


def write_native(loaded: LoadedModel, out: Path) -> Path:
    """The native folder of `loaded` at `out` (diffusers' save_pretrained, plus ddpm_config.json)."""
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    model_config = dict(loaded.config["model"])
    unet = UNet2DModel(**native_unet2d_config(model_config))
    unet.load_state_dict(unet2d_state(loaded.net, model_config), strict=True)
    scheduler = DDPMScheduler(**scheduler_config(loaded.diffusion))
    DDPMPipeline(unet=unet.eval(), scheduler=scheduler).save_pretrained(out, safe_serialization=True)
    (out / RUN_CONFIG).write_text(json.dumps(loaded.config, indent=2) + "\n")
    return out


def _run_config(folder: Path, unet_config: dict[str, Any]) -> dict[str, Any]:
    """ddpm_config.json, checked against unet/config.json (a disagreement: the folder was edited)."""
    config = read_json(folder / RUN_CONFIG, folder)
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"{folder / RUN_CONFIG} has no model section; re-export with python -m ddpm.export")
    try:
        expected = json.loads(json.dumps(native_unet2d_config(model)))
    except ValueError as error:
        raise CheckpointError(f"{folder / RUN_CONFIG}: {error}") from error
    differ = sorted(k for k, v in expected.items() if unet_config.get(k) != v)
    if differ:
        raise CheckpointError(
            f"{folder}: unet/config.json's {differ} disagree with {RUN_CONFIG}'s model; the folder was edited; "
            "re-export with python -m ddpm.export"
        )
    return config


def load_native(folder: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """Our network and schedule from a native folder (eval, float32, on `device`; no diffusers, no unpickling)."""
    folder = Path(folder).expanduser()
    index = read_json(folder / "model_index.json", folder)
    if index.get("unet") != NATIVE_UNET:
        raise CheckpointError(f"{folder}: its unet is {index.get('unet')}, not diffusers' UNet2DModel")
    scheduler_class = (index.get("scheduler") or [None, None])[-1]
    if scheduler_class not in SCHEDULERS:
        raise CheckpointError(
            f"{folder}: its scheduler is {scheduler_class!r}; lightning-ddpm reads a {' or a '.join(SCHEDULERS)}"
        )
    unet_config = read_json(folder / "unet" / "config.json", folder)
    scheduler = read_json(folder / "scheduler" / "scheduler_config.json", folder)
    if (folder / RUN_CONFIG).is_file():
        config = _run_config(folder, unet_config)
    else:
        try:
            arguments = arguments_from_unet2d(unet_config)
        except NotUNet2D as error:
            raise CheckpointError(f"{folder}: {error}; sample it with diffusers' own pipelines") from error
        diffusion = diffusion_from_scheduler(scheduler, folder)
        config = {"model": {"_target_": UNET_TARGET, **arguments}, "diffusion": diffusion}
    try:
        weights = network_state(read_weights(folder), config["model"])
    except ValueError as error:
        raise CheckpointError(f"{folder}: {error}") from error
    return rebuild(folder, config, weights, scheduler, device)
