"""load_model(path): the EMA model of any weights file or folder this project writes, by its format.

<run>/checkpoints/*.ckpt, <run>/ema.pt   -> torch_file      (torch.load(weights_only=True))
<run>/ema.safetensors                    -> safetensors_file (no unpickling)
a `python -m ddpm.export` folder          -> diffusers_folder (JSON + safetensors, no diffusers needed)
"""

import os
from pathlib import Path

import torch

from ddpm.weights.diffusers_folder import load_export
from ddpm.weights.model import CheckpointError, LoadedModel
from ddpm.weights.safetensors_file import load_safetensors_model
from ddpm.weights.torch_file import load_torch_model


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """Rebuild the run's UNet and schedule and load its EMA weights (eval, float32, on `device`).

    `path`: a .ckpt, an ema.pt, an ema.safetensors, or a folder written by `python -m ddpm.export`."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "model_index.json").is_file():
            raise CheckpointError(
                f"{local} is a folder, not a checkpoint; pass <run dir>/ema.pt, <run dir>/ema.safetensors, "
                "<run dir>/checkpoints/last.ckpt, or a folder written by python -m ddpm.export (with model_index.json)"
            )
        return load_export(local, device)
    if local.suffix == ".safetensors":
        return load_safetensors_model(local, device)
    return load_torch_model(local, device)
