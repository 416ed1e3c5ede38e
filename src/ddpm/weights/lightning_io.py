"""AtomicCheckpointIO: Lightning checkpoints written whole or not at all, read without unpickling code.

A save goes through `ddpm.atomic.atomic_save` (temporary file, fsync, rename), so a process killed at
any instant leaves either the old file or the new one, never a torn `*.ckpt`, and a failed write (full disk,
size limit) raises one WriteError naming the path, the bytes, the free space and the fix. Weights that are
not finite are refused before anything is written. Loads use `ddpm.weights.torch_file.load_checkpoint`
(`torch.load(weights_only=True)` with errors that say what to do).
"""

from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ddpm.atomic import atomic_save
from ddpm.weights.model import CHECKPOINT_KEY, CheckpointError, non_finite_tensors
from ddpm.weights.torch_file import load_checkpoint


class NonFiniteCheckpointError(RuntimeError):
    """Refusing to write a checkpoint whose weights hold NaN or inf."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with temp-file + fsync + rename saves, a finiteness check, and safe loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        bad = non_finite_tensors(checkpoint.get("state_dict", {})) + non_finite_tensors(
            checkpoint.get(CHECKPOINT_KEY, {})
        )
        if bad:
            raise NonFiniteCheckpointError(
                f"not writing {path}: weights {bad[:5]} are NaN/inf at step {checkpoint.get('global_step')}; "
                "the last checkpoint on disk is the last good one (lower optim.lr, or use bf16 instead of fp16)"
            )
        atomic_save(checkpoint, path)

    def load_checkpoint(
        self, path: Any, map_location: Callable | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            return super().load_checkpoint(path, weights_only=False)
        checkpoint = load_checkpoint(path, key="ckpt_path")
        bad = non_finite_tensors(checkpoint.get("state_dict", {})) + non_finite_tensors(
            checkpoint.get(CHECKPOINT_KEY, {})
        )
        if bad:
            raise CheckpointError(
                f"{path}: weights {bad[:5]} hold NaN or inf; resuming would train from broken weights. Resume from "
                "an earlier checkpoint of the run (ckpt_path=<run dir>/checkpoints/step_*.ckpt)"
            )
        return checkpoint
