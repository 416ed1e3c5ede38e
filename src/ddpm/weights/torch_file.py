"""PyTorch files this project writes: a Lightning training checkpoint (`.ckpt`) and the EMA export (`ema.pt`).

Both are read with `torch.load(weights_only=True)`, so a file from elsewhere cannot run code when loaded;
every failure becomes a CheckpointError that says what to do. `ema.pt` holds the EMA weights and the
resolved run config: {"format": EXPORT_FORMAT, "ema_state_dict": ..., "config": ...}.
"""

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ddpm.atomic import atomic_save
from ddpm.weights.model import CHECKPOINT_KEY, CheckpointError, LoadedModel, build_model, run_config

EXPORT_FORMAT = "lightning-ddpm/ema-export/1"


ADVICE = {  # what to pass instead, by the setting that named the file
    "ckpt": "pass ckpt=<run dir>/ema.pt or a .ckpt written by train.py (<run dir>/checkpoints/last.ckpt)",
    "ckpt_path": (
        "resume with ckpt_path=<run dir> (its checkpoints/last.ckpt) or ckpt_path=<run dir>/checkpoints/step_*.ckpt"
    ),
}


def first_sentence(error: BaseException, limit: int = 200) -> str:
    """The error's first sentence, at most `limit` characters (torch's zip errors go on with general advice)."""
    lines = str(error).strip().splitlines()
    sentence = lines[0].split(". ")[0] if lines else type(error).__name__
    return sentence if len(sentence) <= limit else sentence[: limit - 3] + "..."


def load_checkpoint(path: str | os.PathLike, *, key: str = "ckpt") -> dict[str, Any]:
    """torch.load with weights_only=True, turning every failure into a CheckpointError that says what to do;
    `key` is the setting that named the file (ckpt for sample.py and export, ckpt_path for a resume)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{key}={str(path)!r} does not exist; {ADVICE.get(key, ADVICE['ckpt'])}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "global" in str(error).lower() or "blocked" in str(error):  # a pickle naming code: never built here
            found = next((line.strip() for line in str(error).splitlines() if "global" in line.lower()), "")
            raise CheckpointError(
                f"{path} holds Python objects that safe loading refuses ({found[:200]}); it was not written by "
                "lightning-ddpm, and loading it unsafely could run code from the file"
            ) from error
        advice = not_a_checkpoint(path, key)
        what = "is not a PyTorch checkpoint at all (another kind of file, or damaged)"
        raise CheckpointError(f"{path} {what}; {advice}") from error
    except Exception as error:  # garbage bytes also raise IndexError, KeyError, struct.error, ...
        raise CheckpointError(
            f"{path} is not a readable PyTorch checkpoint (truncated or corrupt: {first_sentence(error)}); "
            "use another checkpoint of the run, e.g. the previous step's"
        ) from error
    if not isinstance(checkpoint, dict) or CHECKPOINT_KEY not in checkpoint:
        raise CheckpointError(
            f"{path} is a PyTorch file but not a lightning-ddpm checkpoint (no {CHECKPOINT_KEY!r}); "
            f"{ADVICE.get(key, ADVICE['ckpt'])}"
        )
    return checkpoint


def export_folder_of(path: Path) -> Path | None:
    """The diffusers pipeline folder (model_index.json) that `path`, a file or component folder, is part of."""
    return next((f for f in (path.parent, path.parent.parent) if (f / "model_index.json").is_file()), None)


def not_a_checkpoint(path: Path, key: str) -> str:
    """The advice for a file that is no checkpoint: a file of an export folder means the folder; a damaged one
    (a checkpoint's name) another checkpoint of the run."""
    folder = export_folder_of(path)
    if folder is not None and key == "ckpt":
        return f"{path.name} is a file of the diffusers folder {folder}: pass ckpt={folder}"
    if path.suffix in (".ckpt", ".pt", ".pth"):
        return "use another checkpoint of the run, e.g. the previous step's"
    return ADVICE.get(key, ADVICE["ckpt"])


def load_torch_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """The EMA model of a `.ckpt` or `ema.pt`."""
    checkpoint = load_checkpoint(path)
    return build_model(run_config(checkpoint), checkpoint[CHECKPOINT_KEY], source=str(path), device=device)


def export_ema(path: str | os.PathLike, ema_state_dict: Mapping[str, Tensor], config: Mapping[str, Any]) -> Path:
    """Write the EMA weights and the run config as a small file that sample.py (and others) can load."""
    state = {k: v.detach().cpu().clone() for k, v in ema_state_dict.items()}
    return atomic_save({"format": EXPORT_FORMAT, CHECKPOINT_KEY: state, "config": dict(config)}, path)
