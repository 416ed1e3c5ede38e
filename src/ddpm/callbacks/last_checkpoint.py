"""last.ckpt holds the fit's end, and a resume from such a file logs each step at its own number.

Lightning's ModelCheckpoint writes `last.ckpt` at the fit's end only when it saved nothing before
(`on_train_end`), so a run whose trainer.max_steps is not a multiple of `every_n_train_steps`, or one stopped by
trainer.max_time, kept `last.ckpt` at its last periodic save, behind `ema.pt`: `ckpt_path=<run>/checkpoints/
last.ckpt` with a longer max_steps trained those steps again. Here every ModelCheckpoint with `save_last` that has
not saved at the final step does so when training ends (after the EMA's own end, before Lightning's check, which
then finds it done).

A checkpoint written at the fit's end stores the loop's batch count after its last increment, and Lightning's
restart adds one more (it expects the count of a save inside a batch), so the resumed run logged every metric one
step late (step N's at N + 1, nothing at N). Both count optimizer steps with one optimizer (a NaN-skipped step
still counts, as the LR schedule does), so the count is set to trainer.global_step at the fit's first batch.
"""

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


class LastCheckpoint(Callback):
    """Saves every `save_last` ModelCheckpoint's last.ckpt at the final step; aligns the logged step on resume."""

    def __init__(self) -> None:
        self._aligned = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._aligned = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._aligned:  # after Lightning's restart has set the count (the epoch loop's reset)
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
            self._aligned = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for checkpoint in trainer.checkpoint_callbacks:
            behind = checkpoint._last_global_step_saved != trainer.global_step if isinstance(
                checkpoint, ModelCheckpoint) else False  # fmt: skip
            if behind and checkpoint.save_last and trainer.global_step > 0:
                checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))
