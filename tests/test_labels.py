"""Every label is checked, not only the first batch's: a RAM data set's whole label tensor at setup, before the first
step; every streamed batch on the device (no host sync), read at the next logged step or checkpoint save, so the run
stops before a checkpoint of it is written. The label num_classes is the null class of guidance: a data label equal
to it would train silently as "no class"."""

from pathlib import Path

import pytest
import torch
from helpers import compose

from ddpm import training
from ddpm.data.make_shards import write_shards
from ddpm.data.ram import RAMDataModule
from ddpm.data.sources import DigitsSource, ImageSet

SHORT = ["trainer.val_check_interval=1000", "trainer.num_sanity_val_steps=0", "callbacks.sample_grid=null",
         "logger=[csv]", "optim.warmup_steps=0"]  # fmt: skip


def fit(tmp_path: Path, *overrides: str) -> None:
    training.train(compose("train", [*SHORT, f"paths.output_dir={tmp_path}", *overrides]))


def streamed(tmp_path: Path, bad: int) -> list[str]:
    """Overrides of a run on one training shard of 80 digits whose sample 70 has label `bad` (and a clean
    validation shard), streamed in order: batch 8 of 8 images, i.e. step 9, is the first to hold it."""
    data = DigitsSource().load(image_size=8, channels=1)
    labels = data.labels[:88].clone()
    labels[70] = bad
    train = write_shards(data.images[:80], labels[:80], tmp_path / "shards", samples_per_shard=80)
    val = write_shards(data.images[80:88], labels[80:88], tmp_path / "shards", samples_per_shard=8, prefix="val")
    return ["data=webdataset", f"data.urls={train[0]}", f"data.val_urls={val[0]}", "data.batch_size=8",
            "data.num_workers=0", "data.shuffle_buffer=0", "data.epoch_length=80", "model.image_size=8",
            "model.num_classes=10", "trainer.max_steps=20"]  # fmt: skip


def saved_steps(run: Path) -> list[int]:
    return sorted(int(torch.load(p, weights_only=True)["global_step"]) for p in run.glob("checkpoints/step_*.ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize("bad", [10, 12, -1])  # the null class, beyond it (an embedding read out of range), negative
def test_a_bad_label_in_a_later_streamed_batch_stops_the_run_before_the_next_checkpoint(tmp_path: Path,
                                                                                         bad: int) -> None:  # fmt: skip
    """One training shard of 80 digits, streamed in order (no shuffle, one process): sample 70 is in batch 8 (step
    9). The first batch is fine, so the first-batch check passes; the device-side check stops the run at the step-9
    checkpoint save, naming the label and model.num_classes. Checkpoints of steps 3 and 6 stay; none of step 9."""
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"labels must be 0\.\.9") as info:
        fit(run, *streamed(tmp_path, bad), "trainer.log_every_n_steps=50", "callbacks.checkpoint.every_n_train_steps=3")
    assert "1 label(s)" in str(info.value) and "model.num_classes=10" in str(info.value)
    assert str(bad) in str(info.value)
    assert saved_steps(run) == [3, 6]
    assert not (run / "ema.pt").exists()


@pytest.mark.slow
def test_a_bad_streamed_label_is_caught_at_a_logged_step_too(tmp_path: Path) -> None:
    """No checkpoint in the run: the first logged step after the bad batch (0-based step 8) stops it: step 11
    (log_every_n_steps=4 logs 3, 7, 11), not the end of the run (15 and 19 would be logged)."""
    with pytest.raises(ValueError, match=r"model\.num_classes=10"):
        fit(tmp_path / "run", *streamed(tmp_path, 10), "trainer.log_every_n_steps=4", "callbacks.checkpoint=null")
    rows = (tmp_path / "run" / "csv" / "metrics.csv").read_text().splitlines()
    steps = [int(row.split(",")[rows[0].split(",").index("step")]) for row in rows[1:] if row]
    assert max(steps) == 11


def test_a_ram_data_set_with_the_null_class_among_its_labels_is_refused_at_setup(tmp_path: Path) -> None:
    """Digits (labels 0..9) for a 9-class model: label 9 is the null class. Refused before the first step, counting
    the images, naming model.num_classes=10 as the fix; nothing trained, no checkpoint."""
    with pytest.raises(ValueError, match=r"images .*have labels outside 0\.\.8") as info:
        fit(tmp_path, "model.num_classes=9", "data.limit=400", "trainer.max_steps=5")
    count = int((DigitsSource().load(image_size=8, channels=1).labels[:400] == 9).sum())
    assert f"{count} of the" in str(info.value) and "set model.num_classes=10" in str(info.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "ema.pt").exists()


def test_ram_check_labels_names_negative_and_out_of_range_labels() -> None:
    images = torch.zeros(6, 1, 8, 8, dtype=torch.uint8)
    data = RAMDataModule(source=DigitsSource(), image_size=8, batch_size=2)
    data.data = ImageSet(images, torch.tensor([0, 1, 2, 3, 4, -1]), 5)
    with pytest.raises(ValueError, match=r"1 of the 6 images .*labels span \[-1, 4\].* labels must be >= 0"):
        data.check_labels(5)
    data.check_labels(None)  # unconditional: labels unused
    data.data = ImageSet(images, torch.tensor([0, 1, 2, 3, 4, 4]), 5)
    data.check_labels(5)
    data.data = ImageSet(images, torch.zeros(6, dtype=torch.int64), None)  # unlabelled: its labels all 0
    with pytest.raises(
        ValueError, match=r"model.num_classes=5 but the 6 images have no classes .*model.num_classes=null"
    ):
        data.check_labels(5)  # trained silently: classes 1..4 never trained, then sampled


def test_an_image_folder_with_more_class_folders_than_classes_is_refused_naming_them(tmp_path: Path) -> None:
    """11 class folders (a..k) for model.num_classes=10: the images of folder k would train as the null class. Refused
    at setup naming folder k; nothing trained."""
    from PIL import Image

    root = tmp_path / "folders"
    for i, name in enumerate("abcdefghijk"):
        (root / name).mkdir(parents=True)
        for j in range(3):
            Image.new("L", (8, 8), color=20 * i + j).save(root / name / f"{j}.png")
    with pytest.raises(ValueError, match=r"class folders \['k'\] are beyond it") as info:
        fit(tmp_path / "run", "data=image_folder", f"data.root={root}", "data.channels=1", "data.val_size=3",
            "data.batch_size=4", "model.image_size=8", "model.num_classes=10", "trainer.max_steps=3")  # fmt: skip
    assert "3 of the 33 images" in str(info.value) and "model.num_classes=11" in str(info.value)
    assert not (tmp_path / "run" / "checkpoints").exists()
