"""last.ckpt holds the fit's end, and a resume from such a file logs each step at its own number.

Lightning's ModelCheckpoint writes `last.ckpt` at the fit's end only when it saved nothing before
(`on_train_end`), so a run whose trainer.max_steps is not a multiple of `every_n_train_steps`, or one stopped by
trainer.max_time, kept `last.ckpt` at its last periodic save, behind `ema.pt`: `ckpt_path=<run>/checkpoints/
last.ckpt` with a longer max_steps trained those steps again. Here every ModelCheckpoint with `save_last` that has
not saved at the final step does so inside that step's batch, after every other callback, as a periodic save would
(saved at the fit's end, after Lightning has closed the epoch, a resume began the next epoch: the rest of the cut
one was never trained on); a stop at another point (trainer.max_time) saves when training ends.

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

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if 0 <= trainer.max_steps <= trainer.global_step and not trainer.fit_loop.epoch_loop._should_accumulate():
            self._save_behind(trainer, in_batch=True)  # inside the batch, as a periodic save: the epoch's position

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save_behind(trainer)  # other stops: trainer.max_time, max_epochs (a whole epoch), a callback's

    def _save_behind(self, trainer: pl.Trainer, in_batch: bool = False) -> None:
        """last.ckpt of every save_last ModelCheckpoint that has not saved at this step. In the last batch only
        where the checkpoint saves at its step (monitor step or none: a metric's save waits for the validation,
        which would then find this step saved) and will not save here itself (every_n_train_steps)."""
        for checkpoint in trainer.checkpoint_callbacks:
            if not isinstance(checkpoint, ModelCheckpoint) or not checkpoint.save_last or trainer.global_step == 0:
                continue
            every = checkpoint._every_n_train_steps
            due = in_batch and (
                checkpoint.monitor not in (None, "step") or (every and trainer.global_step % every == 0)
            )
            if checkpoint._last_global_step_saved != trainer.global_step and not due:
                checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))
