"""Reading this project's checkpoints safely, rebuilding the model from the saved config, and export.

Two kinds of file are read here: a full Lightning checkpoint written by train.py (`.ckpt`), and
the small EMA export (`ema.pt`: EMA weights plus the resolved config). Both are read with
`torch.load(weights_only=True)`, so a file from elsewhere cannot run code when loaded, and
the model is rebuilt only from `_target_`s inside this package. `load_ema_model` also takes the
run's `ema.safetensors` (ddpm.safetensors_io) and a diffusers folder written by `python -m ddpm.export`
(ddpm.export.load_export); neither is unpickled.
"""

import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from ddpm.callbacks.ema import CHECKPOINT_KEY
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.models.unet import UNet

EXPORT_FORMAT = "lightning-ddpm/ema-export/1"


class CheckpointError(ValueError):
    """A file that is missing, unreadable, or not a checkpoint of this project."""


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """torch.load with weights_only=True, turning every failure into a CheckpointError that says what to do."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not exist; pass ckpt=<run dir>/checkpoints/last.ckpt (or the run's ema.pt)"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} holds Python objects that safe loading refuses ({str(error).splitlines()[0][:200]}); it was not "
            "written by lightning-ddpm, and loading it unsafely could run code from the file"
        ) from error
    except Exception as error:  # garbage bytes also raise IndexError, KeyError, struct.error, ...
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint (truncated or corrupt: {str(error)[:200]}); "
            "use another checkpoint of the run, e.g. the previous step's"
        ) from error
    if not isinstance(checkpoint, dict) or CHECKPOINT_KEY not in checkpoint:
        raise CheckpointError(
            f"{path} is a PyTorch file but not a lightning-ddpm checkpoint (no {CHECKPOINT_KEY!r}); "
            "pass a .ckpt written by train.py or its ema.pt export"
        )
    return checkpoint


def run_config(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config the checkpoint's run was trained with."""
    config = checkpoint.get("config") or checkpoint.get("hyper_parameters", {}).get("config")
    if not config or "model" not in config or "diffusion" not in config:
        raise CheckpointError("the checkpoint carries no run config (model, diffusion); it cannot be rebuilt")
    return config


def instantiate_local(node: Mapping[str, Any]) -> Any:
    """hydra.utils.instantiate, refusing any `_target_` outside the ddpm package (a foreign config cannot
    make this process import and call arbitrary code)."""
    from hydra.utils import get_class, instantiate

    def targets(value: Any) -> list[str]:
        if isinstance(value, Mapping):
            found = [value["_target_"]] if "_target_" in value else []
            return found + [t for v in value.values() for t in targets(v)]
        if isinstance(value, list):
            return [t for v in value for t in targets(v)]
        return []

    def local_class(target: Any) -> bool:
        # Resolve it: the prefix alone passes "ddpm.checkpoint.os.system", which is os.system.
        if not str(target).startswith("ddpm."):
            return False
        try:
            return get_class(str(target)).__module__.startswith("ddpm.")
        except Exception:  # not importable, or not a class
            return False

    foreign = [t for t in targets(node) if not local_class(t)]
    if foreign:
        raise CheckpointError(f"the checkpoint's config names classes outside lightning-ddpm: {foreign}")
    return instantiate(dict(node))


@dataclass(frozen=True)
class LoadedModel:
    """The EMA network (eval mode, float32) and the schedule of a run, with its config."""

    net: UNet
    diffusion: GaussianDiffusion
    config: dict[str, Any]


def load_ema_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """Rebuild the run's UNet and schedule from the checkpoint's config and load the EMA weights into it.

    `path`: a .ckpt, an ema.pt, an ema.safetensors, or a folder written by `python -m ddpm.export`."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "model_index.json").is_file():
            raise CheckpointError(
                f"{local} is a folder, not a checkpoint; pass <run dir>/ema.pt, <run dir>/ema.safetensors, "
                "<run dir>/checkpoints/last.ckpt, or a folder written by python -m ddpm.export (with model_index.json)"
            )
        from ddpm.export import load_export  # imports this module

        return load_export(local, device)
    if local.suffix == ".safetensors":
        from ddpm.safetensors_io import load_ema_model_safetensors  # imports this module

        return load_ema_model_safetensors(local, device)
    checkpoint = load_checkpoint(path)
    config = run_config(checkpoint)
    net, diffusion = instantiate_local(config["model"]), instantiate_local(config["diffusion"])
    weights = checkpoint[CHECKPOINT_KEY]
    try:
        net.load_state_dict(weights)
    except RuntimeError as error:
        raise CheckpointError(f"{path}: the EMA weights do not fit the model its config describes ({error})") from error
    return LoadedModel(net=net.float().eval().to(device), diffusion=diffusion.to(device), config=config)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write(file)` on a temporary file in the same folder, fsync, then rename: never a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """torch.save to `path` atomically (`atomic_write`)."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def export_ema(path: str | os.PathLike, ema_state_dict: Mapping[str, Tensor], config: Mapping[str, Any]) -> Path:
    """Write the EMA weights and the run config as a small file that sample.py (and others) can load."""
    state = {k: v.detach().cpu().clone() for k, v in ema_state_dict.items()}
    return atomic_save({"format": EXPORT_FORMAT, CHECKPOINT_KEY: state, "config": dict(config)}, path)
