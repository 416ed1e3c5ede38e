"""The EMA weights as one safetensors file (`<run>/ema.safetensors`) that rebuilds the model by itself.

The file holds the EMA state dict (float32 tensors, keyed as UNet.state_dict()) and, in the safetensors
header's metadata, the resolved run config as JSON under "ddpm_config" (and "format": FORMAT):

    save_ema_safetensors("ema.safetensors", ema.shadow, resolved_config)
    state_dict, config = load_ema_safetensors("ema.safetensors")
    loaded = load_safetensors_model("ema.safetensors")         # a ddpm.weights.LoadedModel

Reading never unpickles: safetensors is a JSON header plus raw tensor bytes, and the model is rebuilt only
from `_target_`s inside this package (ddpm.weights.model.instantiate_local). A file without our metadata
(e.g. a diffusers or transformers weights file), with config JSON that is not a run config, with tensors
that do not fit the model the config describes, or truncated, raises ddpm.weights.CheckpointError
naming the file, what is wrong and what to do.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor

from ddpm.atomic import atomic_write
from ddpm.weights.model import CheckpointError, LoadedModel, build_model
from ddpm.weights.torch_file import export_folder_of

FORMAT = "lightning-ddpm/ema-safetensors/1"
CONFIG_KEY = "ddpm_config"


def save_ema_safetensors(
    path: str | os.PathLike, ema_state_dict: Mapping[str, Tensor], config: Mapping[str, Any]
) -> Path:
    """Write the EMA weights with the run config (JSON, header metadata) to `path`, atomically (temp + rename)."""
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in ema_state_dict.items()}
    metadata = {"format": FORMAT, CONFIG_KEY: json.dumps(dict(config))}
    payload = save(tensors, metadata=metadata)
    return atomic_write(path, lambda f: f.write(payload), size=len(payload))


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The safetensors header's metadata ({} if none); CheckpointError if the file is missing or not safetensors."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} does not exist; pass ckpt=<run dir>/ema.safetensors (or the run's ema.pt)"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as error:  # SafetensorError: bad header, or a body shorter than the header says
        raise CheckpointError(
            f"{path} is not a readable safetensors file (truncated or corrupt: {str(error)[:200]}); "
            "use the run's ema.pt or a checkpoint under <run dir>/checkpoints/"
        ) from error


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run config stored in the file's metadata; CheckpointError if absent or not a run config."""
    metadata = read_metadata(path)
    if CONFIG_KEY not in metadata and (folder := export_folder_of(Path(path))):
        raise CheckpointError(f"{path} is a file of the diffusers folder {folder}: pass the folder")
    if CONFIG_KEY not in metadata:
        raise CheckpointError(
            f"{path} is a safetensors file without lightning-ddpm's {CONFIG_KEY!r} metadata (its metadata keys: "
            f"{sorted(metadata)}), so it does not say which model it holds; pass an ema.safetensors written by "
            "train.py, or the run's ema.pt / .ckpt"
        )
    try:
        config = json.loads(metadata[CONFIG_KEY])
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path}: its {CONFIG_KEY!r} metadata is not JSON ({error}); the file was not written by lightning-ddpm "
            "or was edited; use the run's ema.pt or re-export from a .ckpt"
        ) from error
    model, diffusion = (config.get(k) if isinstance(config, dict) else None for k in ("model", "diffusion"))
    if not isinstance(model, dict) or not isinstance(diffusion, dict):
        raise CheckpointError(
            f"{path}: its {CONFIG_KEY!r} metadata is not a lightning-ddpm run config (no model and diffusion "
            "sections); pass an ema.safetensors written by train.py, or the run's ema.pt"
        )
    return config


def load_ema_safetensors(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(EMA state dict on CPU, run config) from a file written by save_ema_safetensors. Never unpickles."""
    path = Path(path).expanduser()
    config = read_config(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            state_dict = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as error:
        raise CheckpointError(
            f"{path}: its tensors cannot be read (truncated or corrupt: {str(error)[:200]}); use the run's ema.pt"
        ) from error
    return state_dict, config


def load_safetensors_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """Rebuild the run's UNet and schedule from the file's config and load its EMA weights (eval, float32)."""
    state_dict, config = load_ema_safetensors(path)
    return build_model(config, state_dict, source=str(Path(path).expanduser()), device=device)
