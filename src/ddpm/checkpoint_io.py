"""AtomicCheckpointIO: Lightning checkpoints written whole or not at all, read without unpickling code.

A save goes to a hidden temporary file in the checkpoint's folder, is fsync'ed and renamed over
the target (`ddpm.checkpoint.atomic_save`), so a process killed at any instant leaves either the
old file or the new one, never a torn `*.ckpt`. Weights that are not finite are refused before
anything is written. Loads use `ddpm.checkpoint.load_checkpoint` (`torch.load(weights_only=True)`
with errors that say what to do).
"""

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ddpm.callbacks.ema import CHECKPOINT_KEY
from ddpm.checkpoint import atomic_save, load_checkpoint


class NonFiniteCheckpointError(RuntimeError):
    """Refusing to write a checkpoint whose weights hold NaN or inf."""


def non_finite_keys(state: Mapping[str, Any]) -> list[str]:
    """Names of floating tensors in `state` that hold NaN or inf."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()]


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with temp-file + fsync + rename saves, a finiteness check, and safe loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        bad = non_finite_keys(checkpoint.get("state_dict", {})) + non_finite_keys(checkpoint.get(CHECKPOINT_KEY, {}))
        if bad:
            raise NonFiniteCheckpointError(
                f"not writing {path}: weights {bad[:5]} are NaN/inf at step {checkpoint.get('global_step')}; "
                "the last checkpoint on disk is the last good one (lower optim.lr, or use bf16 instead of fp16)"
            )
        try:
            atomic_save(checkpoint, path)
        except OSError as error:
            raise OSError(
                error.errno,
                f"could not write checkpoint {path} ({error.strerror or error}); the previous checkpoints are intact. "
                "Free disk space (or point callbacks.checkpoint.dirpath elsewhere) and resume with ckpt_path=last",
            ) from error
        sync_folder(Path(path).parent)

    def load_checkpoint(
        self, path: Any, map_location: Callable | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            return super().load_checkpoint(path, weights_only=False)
        return load_checkpoint(path)


def sync_folder(folder: Path) -> None:
    """fsync a directory so a rename inside it survives a power cut (a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
