"""load_model(path): the EMA model of any weights file or folder this project writes or reads, by its format.

<run>/checkpoints/*.ckpt, <run>/ema.pt   -> torch_file       (torch.load(weights_only=True))
<run>/ema.safetensors                    -> safetensors_file (no unpickling)
a diffusers folder (model_index.json)    -> its unet decides (JSON + safetensors, no diffusers needed):
    diffusers' UNet2DModel               -> diffusers_native (python -m ddpm.export, or made by diffusers itself)
    lightning-ddpm's DDPMUNet2DModel     -> diffusers_folder (python -m ddpm.export's adapter fallback)
"""

import os
from pathlib import Path

import torch

from ddpm.weights.diffusers_files import read_json
from ddpm.weights.diffusers_folder import ADAPTER, LEGACY_ADAPTERS, load_export
from ddpm.weights.diffusers_native import NATIVE_UNET, load_native
from ddpm.weights.model import CheckpointError, LoadedModel
from ddpm.weights.safetensors_file import load_safetensors_model
from ddpm.weights.torch_file import export_folder_of, load_torch_model


def load_folder(folder: Path, device: torch.device | str = "cpu") -> LoadedModel:
    """A diffusers pipeline folder, by the unet its model_index.json names (a latent model's decoder: its `vae/`)."""
    unet = read_json(folder / "model_index.json", folder).get("unet")
    if unet == NATIVE_UNET:
        return with_own_vae(load_native(folder, device), folder)
    if unet in LEGACY_ADAPTERS:
        return with_own_vae(load_export(folder, device), folder)
    raise CheckpointError(
        f"{folder} is a diffusers folder whose unet is {unet}; lightning-ddpm reads {NATIVE_UNET} (in its UNet's "
        f"family) and its own {ADAPTER}"
    )


def with_own_vae(loaded: LoadedModel, folder: Path) -> LoadedModel:
    """An exported latent model decodes with the VAE in its own folder (copied byte for byte at export)."""
    latent = loaded.config.get("latent")
    if not latent or not (folder / "vae" / "config.json").is_file():
        return loaded
    return LoadedModel(net=loaded.net, diffusion=loaded.diffusion,
                       config=loaded.config | {"latent": latent | {"vae": str(folder / "vae")}})  # fmt: skip


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """Rebuild the run's network and schedule and load its EMA weights (eval, float32, on `device`).

    `path`: a .ckpt, an ema.pt, an ema.safetensors, a folder written by `python -m ddpm.export`, or a diffusers
    pipeline folder of a UNet2DModel our UNet expresses with a DDPMScheduler / DDIMScheduler of our schedules."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "model_index.json").is_file() and (folder := export_folder_of(local / "config.json")):
            raise CheckpointError(f"{local} is the {local.name} of the diffusers folder {folder}: pass the folder")
        if not (local / "model_index.json").is_file() and (local / "config.json").is_file():  # one component
            raise CheckpointError(
                f"{local} holds one diffusers model (config.json), not a pipeline: a VAE (<run dir>/vae) is used by "
                "python -m ddpm.data.encode vae=...; sample.py takes a diffusion run's ema.pt or a pipeline folder "
                "with model_index.json (python -m ddpm.export)"
            )
        if not (local / "model_index.json").is_file():
            raise CheckpointError(
                f"{local} is a folder, not a checkpoint; pass <run dir>/ema.pt, <run dir>/ema.safetensors, "
                "<run dir>/checkpoints/last.ckpt, or a diffusers pipeline folder (with model_index.json), e.g. one "
                "written by python -m ddpm.export"
            )
        return load_folder(local, device)
    if local.suffix == ".safetensors":
        return load_safetensors_model(local, device)
    return load_torch_model(local, device)
