"""The default `python train.py` leaves a TensorBoard event file beside metrics.csv: scalars, the sample grid as
an image and the run config as text, read back with TensorBoard's own reader."""

import csv
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_RUN, train
from PIL import Image


@pytest.mark.slow
def test_default_run_writes_scalars_grid_and_config_to_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    train(*TINY_RUN, f"hydra.run.dir={run_dir}")  # no logger override: the default loggers
    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    reader = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    reader.Reload()
    tags = reader.Tags()
    assert {"train/loss", "val/loss", "train/grad_norm", "lr-AdamW"} <= set(tags["scalars"]), tags["scalars"]

    with (run_dir / "csv" / "metrics.csv").open() as f:  # the same numbers as the CSV logger's
        csv_losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    tb_losses = [event.value for event in reader.Scalars("train/loss")]
    np.testing.assert_allclose(tb_losses, csv_losses, rtol=1e-6)

    (grid,) = reader.Images("samples/grid")
    assert grid.step == 6
    png = tmp_path / "grid.png"
    png.write_bytes(grid.encoded_image_string)
    with Image.open(png) as image, Image.open(run_dir / "samples" / "step_0000006.png") as saved:
        assert image.size == saved.size and image.size[0] > 16  # the same grid as the PNG in the run folder

    (config,) = reader.Tensors("config/text_summary")
    text = config.tensor_proto.string_val[0].decode()
    assert "_target_: ddpm.models.unet.UNet" in text and "max_steps: 6" in text
