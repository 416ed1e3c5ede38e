"""Shared by the tests that run train.py as a subprocess: the overrides of a tiny, seconds-long run."""

TINY = [
    "data.limit=256",
    "data.batch_size=32",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint.every_n_train_steps=3",
    "callbacks.sample_grid.every_n_steps=6",
    "callbacks.sample_grid.num_samples=4",
    "callbacks.sample_grid.sampler.steps=4",
]
