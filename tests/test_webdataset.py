"""WebDataset shards: the writer and the streaming datamodule (round trip, rank/worker splits, damage, train.py)."""

import csv
import hashlib
import io
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import run, train
from torch.utils.data import DataLoader

from ddpm.data import make_shards as make_shards_module
from ddpm.data.image_folder import ImageFolderSource
from ddpm.data.make_shards import main as make_shards
from ddpm.data.make_shards import write_shards
from ddpm.data.shards import ShardError, assign_shards, decode, expand_urls, read_shard
from ddpm.data.sources import DigitsSource
from ddpm.data.webdataset import ShardStream, WebDataModule


def unique_images(n: int, size: int = 8, channels: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n distinct random uint8 images and labels 0..9."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=g)
    images[:, 0, 0, :4] = torch.tensor([[i >> 24, i >> 16 & 255, i >> 8 & 255, i & 255] for i in range(n)])
    return images, torch.arange(n) % 10


def digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


def stream(urls, *, batches_per_epoch=None, rank=0, world_size=1, batch_size=4, **kw) -> ShardStream:
    return ShardStream(urls, image_size=8, channels=1, batch_size=batch_size, batches_per_epoch=batches_per_epoch,
                       rank=rank, world_size=world_size, **kw)  # fmt: skip


def collect(dataset: ShardStream, workers: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All batches of one pass, through a DataLoader (timeout: a stuck worker fails instead of hanging)."""
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
    iterator = iter(loader)
    try:
        batches = list(iterator)
    finally:  # stop the workers now, even when an error's traceback keeps the iterator alive (pytest.raises)
        getattr(iterator, "_shutdown_workers", lambda: None)()
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def within(seconds: float, fn, *args):
    """Run fn(*args) in a thread; fail (instead of hanging the suite) if it takes longer than `seconds`."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=seconds)


@pytest.fixture
def shards(tmp_path: Path) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    images, labels = unique_images(80)
    paths = write_shards(images, labels, tmp_path / "shards", samples_per_shard=10)
    return [str(p) for p in paths], images, labels


def test_round_trip_gives_the_written_images_and_labels(shards):
    """Shards written by write_shards read back, in order, as the same uint8 images and labels."""
    urls, images, labels = shards
    got_images, got_labels = collect(stream(urls))
    assert got_images.dtype == torch.uint8 and got_images.shape == images.shape
    torch.testing.assert_close(got_images, images, rtol=0, atol=0)
    torch.testing.assert_close(got_labels, labels, rtol=0, atol=0)


def test_make_shards_cli_writes_the_source_images(tmp_path: Path, capsys):
    """`make_shards digits OUT` writes the digits source's images unchanged; it prints a brace pattern to use."""
    out = tmp_path / "digits"
    make_shards(["digits", str(out), "--samples-per-shard", "500", "--image-size", "16", "--channels", "1",
                 "--no-shuffle"])  # fmt: skip
    pattern = capsys.readouterr().out.strip().splitlines()[-1]
    assert pattern == f"'data.urls=\"{out}/shard-{{000000..000003}}.tar\"'"
    expected = DigitsSource().load(image_size=16, channels=1)
    dataset = ShardStream(expand_urls(f"{out}/shard-{{000000..000003}}.tar"), image_size=16, channels=1,
                          batch_size=256, batches_per_epoch=None)  # fmt: skip
    images, labels = collect(dataset)
    torch.testing.assert_close(images, expected.images, rtol=0, atol=0)
    torch.testing.assert_close(labels, expected.labels, rtol=0, atol=0)


def test_make_shards_of_a_folder_decodes_one_shard_at_a_time_and_writes_what_loading_it_whole_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make_shards folder:...` loaded the whole folder decoded into RAM, then a shuffled copy (ImageNet at 256 px:
    hundreds of GB); now each shard's files are decoded as it is written. The shards are byte for byte those of the
    loaded set written in the same seeded order (write_shards, the way it was)."""
    from PIL import Image

    root = tmp_path / "imgs"
    for i in range(23):
        (root / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), (i * 10, 255 - i * 10, i)).save(root / f"c{i % 3}" / f"{i:02d}.png")
    decoded: list[int] = []
    folder, decode_files = ImageFolderSource(root=str(root)), ImageFolderSource.decode

    def recorded(self: ImageFolderSource, files: list, **kwargs):
        decoded.append(len(files))
        return decode_files(self, files, **kwargs)

    monkeypatch.setattr(ImageFolderSource, "decode", recorded)
    make_shards([f"folder:{root}", str(tmp_path / "new"), "--samples-per-shard", "5", "--image-size", "8",
                 "--limit", "17"])  # fmt: skip
    assert decoded == [5, 5, 5, 2]  # never the whole folder
    monkeypatch.undo()
    whole = folder.load(image_size=8, channels=None)
    order = torch.randperm(23, generator=torch.Generator().manual_seed(0))[:17]
    old = write_shards(whole.images[order], whole.labels[order], tmp_path / "old", samples_per_shard=5)
    new = sorted((tmp_path / "new").glob("*.tar"))
    assert [p.name for p in old] == [p.name for p in new] and all(a.read_bytes() == b.read_bytes() for a, b in
                                                                  zip(old, new, strict=True))  # fmt: skip


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_make_shards_refuses_a_limit_below_one(tmp_path: Path, limit: str, capsys) -> None:
    """--limit 0 loaded everything, then failed with an IndexError; a negative limit dropped the last samples."""
    with pytest.raises(SystemExit) as info:
        make_shards(["digits", str(tmp_path / "out"), f"--limit={limit}"])
    assert info.value.code == 2 and f"{limit!r} is not a count >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("num_shards", [8, 3])
def test_two_ranks_two_workers_see_disjoint_parts_whose_union_is_all(tmp_path: Path, num_shards: int):
    """2 ranks x 2 workers: every sample is seen by exactly one (rank, worker), with 8 shards and with 3 (< 4 slots)."""
    images, labels = unique_images(num_shards * 10)
    urls = [str(p) for p in write_shards(images, labels, tmp_path, samples_per_shard=10)]
    seen = [{digest(im) for im in collect(stream(urls, rank=rank, world_size=2), workers=2)[0]} for rank in range(2)]
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {digest(im) for im in images}
    total = sum(len(s) for s in seen)
    assert total == len(images)


def test_assign_shards_splits_shards_then_samples():
    """>= slots: shards[slot::slots]; fewer: slots share a shard with a sample stride."""
    shards = [f"s{i}" for i in range(5)]
    assert [assign_shards(shards, s, 2)[0] for s in range(2)] == [["s0", "s2", "s4"], ["s1", "s3"]]
    assert [assign_shards(shards[:2], s, 4) for s in range(4)] == [
        (["s0"], 0, 2), (["s1"], 0, 2), (["s0"], 1, 2), (["s1"], 1, 2)]  # fmt: skip


def test_training_stream_has_a_fixed_epoch_length_and_resamples(shards):
    """Training yields exactly batches_per_epoch full batches per epoch, epoch after epoch, even past the data."""
    urls, _, _ = shards
    dataset = stream(urls[:1], batches_per_epoch=7, rank=1, world_size=2, shuffle_buffer=16, batch_size=4)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True, timeout=60)
    assert len(loader) == 7
    for _ in range(2):  # 7 x 4 = 28 samples from a slot that owns 1/4 of a 10-sample shard: it must cycle
        batches = list(loader)
        assert len(batches) == 7 and all(b[0].shape == (4, 1, 8, 8) for b in batches)


def test_datamodule_holds_out_validation_shards_and_scales_on_the_device(shards):
    """val_shards come off the end of urls; batches become [-1, 1] floats in on_after_batch_transfer."""
    urls, images, _ = shards
    dm = WebDataModule(urls=urls, image_size=8, channels=1, batch_size=4, num_workers=0, epoch_length=40)
    dm.setup("fit")
    assert dm.val_set.urls == urls[-1:] and dm.train_set.urls == urls[:-1] and len(dm.train_dataloader()) == 10
    x, _ = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
    torch.testing.assert_close(x, images[70:74].float() / 127.5 - 1)
    with pytest.raises(ValueError, match=r"data\.val_urls"):
        WebDataModule(urls=urls[0], image_size=8, batch_size=4).setup("fit")
    # validation shards that also train: a val/loss (the sweeps' objective) on training images, silently
    with pytest.raises(ValueError, match=r"data\.val_urls and data\.urls share 1 shard\(s\) \(.*shard-000007\.tar\)"):
        WebDataModule(urls=urls, val_urls=f"{Path(urls[0]).parent}/./shard-000007.tar", image_size=8).setup("fit")
    with pytest.raises(ValueError, match=r"data\.val_urls and data\.urls share 1 shard"):  # file://, as gopen reads
        WebDataModule(urls=urls, val_urls=f"file://{urls[3]}", image_size=8).setup("fit")
    with pytest.raises(ValueError, match=r"data\.val_urls is empty"):
        WebDataModule(urls=urls, val_urls=[], image_size=8).setup("fit")


@pytest.mark.parametrize("num_shards", [5, 3])  # more shards than the 4 slots, not a multiple; fewer
def test_every_training_slot_draws_every_image_equally_often(tmp_path: Path, num_shards: int):
    """4 slots (ranks), each an epoch of one pass's worth of images: every image drawn exactly once per slot. When
    each slot read a fixed part of the shards, a slot with less to read cycled it faster: with 5 shards slot 0 held
    two and its images came half as often; with 3, the shard split between two slots came twice as often."""
    images, labels = unique_images(num_shards * 20)
    urls = [str(p) for p in write_shards(images, labels, tmp_path, samples_per_shard=20)]
    per_epoch = len(images) // 5  # batches of 5: one pass over all images
    counts: dict[str, int] = {}
    for rank in range(4):
        for image in collect(stream(urls, batches_per_epoch=per_epoch, rank=rank, world_size=4, batch_size=5))[0]:
            counts[digest(image)] = counts.get(digest(image), 0) + 1
    assert counts == {digest(image): 4 for image in images}


def test_epochs_shorter_than_a_shard_go_on_where_the_last_one_stopped(tmp_path: Path):
    """Persistent workers keep their stream across epochs: 2 workers, epochs of half a shard each, 4 epochs = one
    pass per worker, so every image comes exactly twice. Each epoch began a new pass before, from the start of a
    shard: the later half of every shard was never drawn, in any epoch."""
    images, labels = unique_images(80)
    urls = [str(p) for p in write_shards(images, labels, tmp_path, samples_per_shard=40)]
    dataset = stream(urls, batches_per_epoch=10, batch_size=4)  # 5 batches (20 images) per worker and epoch
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True, timeout=60)
    counts: dict[str, int] = {}
    for _ in range(4):
        for image in torch.cat([x for x, _ in loader]):
            counts[digest(image)] = counts.get(digest(image), 0) + 1
    assert counts == {digest(image): 2 for image in images}


def test_shards_mixing_grey_and_colour_under_channels_null_are_refused_with_the_fix(tmp_path: Path) -> None:
    """data.channels=null keeps each file's mode: a grey file among colour ones failed in torch.stack ("stack expects
    each tensor to be equal size"), naming neither the cause nor the setting."""
    images = torch.full((4, 3, 8, 8), 100, dtype=torch.uint8)
    (path,) = write_shards(images, torch.zeros(4, dtype=torch.int64), tmp_path / "rgb", samples_per_shard=4)
    grey = write_shards(images[:1, :1], torch.zeros(1, dtype=torch.int64), tmp_path / "grey", samples_per_shard=1)
    with pytest.raises(ShardError, match=r"shapes \(3, 8, 8\) and \(1, 8, 8\).*data\.channels=1 or 3"):
        collect(
            ShardStream([str(path), str(grey[0])], image_size=8, channels=None, batch_size=5, batches_per_epoch=None)
        )
    assert len(collect(stream([str(path), str(grey[0])], batch_size=5))[0]) == 5  # channels=1: converted


def test_a_resumed_stream_draws_a_fresh_order_not_the_first_epochs_again(shards):
    """The pass count lives in the DataLoader workers and restarts with them: a resumed run (each SLURM requeue)
    replayed the first epochs' order. The order now also depends on the step the fit starts at."""
    from types import SimpleNamespace

    urls = shards[0]

    def first_epoch(global_step: int) -> list[str]:
        dm = WebDataModule(urls=urls, image_size=8, channels=1, batch_size=4, num_workers=0, epoch_length=16)
        dm.trainer = SimpleNamespace(global_step=global_step, world_size=1, global_rank=0)
        dm.setup("fit")
        return [digest(image) for x, _ in dm.train_dataloader() for image in x]

    assert first_epoch(0) == first_epoch(0)  # a run is reproducible
    assert first_epoch(500) != first_epoch(0) and first_epoch(500) == first_epoch(500)


def truncate(path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2 + 100])


def test_truncated_shard_raises_an_error_naming_it(shards):
    """By default a truncated shard stops the run with ShardError naming the file (from a worker too)."""
    urls, _, _ = shards
    truncate(urls[2])
    with pytest.raises(ShardError, match=r"shard-000002\.tar") as error:
        within(120, collect, stream(urls))
    assert "data.on_error=skip" in str(error.value)
    with pytest.raises(Exception, match=r"shard-000002\.tar"):
        within(120, collect, stream(urls), 2)


def test_a_shard_that_is_not_there_is_named_with_data_urls_to_check(shards):
    """A brace range past the last shard (or a moved folder) was told to rewrite the shard with make_shards."""
    urls, _, _ = shards
    missing = urls[0].replace("shard-000000", "shard-000099")
    with pytest.raises(ShardError, match=rf"shard {missing} cannot be read at its start: FileNotFoundError.*; check "
                                         r"data\.urls / data\.val_urls \(no such file"):  # fmt: skip
        within(120, collect, stream([missing]))


def test_skip_warns_with_the_count_and_keeps_the_rest(shards, tmp_path: Path):
    """on_error=skip: a bad image inside a sound tar is skipped and counted; the other samples all arrive."""
    urls, images, _ = shards
    bad = tmp_path / "bad.tar"
    with tarfile.open(urls[0]) as src, tarfile.open(bad, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name in {"00000003.png", "00000005.png"}:
                data = b"not a png" + data[:10]
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    with pytest.warns(UserWarning, match=r"skipped 2 damaged sample\(s\) in shard .*bad\.tar"):
        got, _ = within(120, collect, stream([str(bad), *urls[1:]], on_error="skip"))
    assert len(got) == len(images) - 2
    with pytest.raises(ShardError, match=r"bad\.tar.*in sample '00000003'"):
        within(120, collect, stream([str(bad)]))


def test_skip_on_a_truncated_shard_and_an_all_damaged_training_stream_do_not_hang(shards):
    """A truncated shard under skip loses its tail with a warning; a slot whose shards are all unreadable raises."""
    urls, images, _ = shards
    truncate(urls[1])
    with pytest.warns(UserWarning, match=r"skipped 1 damaged .*shard-000001\.tar"):
        got, _ = within(120, collect, stream(urls, on_error="skip"))
    assert len(images) - 10 < len(got) < len(images)
    Path(urls[0]).write_bytes(b"garbage" * 100)
    with pytest.warns(UserWarning), pytest.raises(ShardError, match="no readable samples"):
        within(120, collect, stream(urls[:1], batches_per_epoch=3, on_error="skip"))


@pytest.mark.parametrize("damage", ["cut_at_a_member", "cut_in_a_header", "zeros_over_a_header", "a_flipped_byte"])
def test_a_shard_cut_or_damaged_between_samples_is_refused_not_read_short(shards, damage: str) -> None:
    """tarfile takes a cut at a member boundary (a killed writer's shard) or any bad header for the archive's end:
    such a shard was read as a shorter one, silently, even under on_error=raise (GNU tar refuses it). Sample 3's
    header is damaged; samples 0-1 are read, sample 2 (its fields not known to be whole) and the rest are lost."""
    urls, images, _ = shards
    path, data = Path(urls[0]), bytearray(Path(urls[0]).read_bytes())
    with tarfile.open(path) as tar:
        at = tar.getmembers()[6].offset  # 00000003.png's header
    if damage.startswith("cut"):
        data = data[: at + (100 if damage == "cut_in_a_header" else 0)]
    elif damage == "zeros_over_a_header":
        data[at : at + 512] = bytes(512)  # tar's end-of-archive block, with samples after it
    else:
        data[at + 5] ^= 0xFF  # a byte of the name: a bad checksum
    path.write_bytes(bytes(data))
    whole = Path(urls[1]).read_bytes()  # a whole shard with data after its end-of-archive marker: read whole, as
    Path(urls[1]).write_bytes(whole + b"GARBAGE\n")  # GNU tar reads it (a torn copy's tail, another tar appended)
    assert len(list(read_shard(urls[1], image_size=8, channels=1, on_error="raise"))) == 10
    read = lambda on_error: list(read_shard(urls[0], image_size=8, channels=1, on_error=on_error))  # noqa: E731
    with pytest.raises(ShardError, match=r"shard-000000\.tar cannot be read after sample '00000001'.*end-of-archive"):
        read("raise")
    with pytest.warns(UserWarning, match=r"skipped 1 damaged sample\(s\) in shard .*shard-000000\.tar"):
        got = read("skip")
    assert torch.equal(torch.stack([image for image, _ in got]), images[:2])


def test_make_shards_killed_mid_shard_leaves_no_partial_shard(tmp_path: Path, monkeypatch) -> None:
    """Each shard is written to a temporary file and renamed: a writer stopped inside shard 1 leaves shard 0 whole
    and no shard-000001.tar, which would read as a shorter shard (and be taken for validation, the last shard)."""
    images, labels = unique_images(30)
    calls = iter(range(10**6))
    real = make_shards_module.png_bytes
    monkeypatch.setattr(make_shards_module, "png_bytes", lambda image: real(image) if next(calls) < 15 else 1 / 0)
    with pytest.raises(ZeroDivisionError):
        write_shards(images, labels, tmp_path / "out", samples_per_shard=10)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["shard-000000.tar"]
    got = list(read_shard(str(tmp_path / "out" / "shard-000000.tar"), image_size=8, channels=1, on_error="raise"))
    assert torch.equal(torch.stack([image for image, _ in got]), images[:10])


@pytest.mark.slow
def test_train_py_runs_on_shards(tmp_path: Path):
    """`make_shards` then `train.py data=webdataset data.urls=...` as real commands: val/loss and ema.pt."""
    out = tmp_path / "shards"
    run("python", "-m", "ddpm.data.make_shards", "digits", str(out), "--samples-per-shard", "300", "--image-size",
        "16", "--channels", "1", "--limit", "1200", timeout=120)  # fmt: skip
    run_dir = tmp_path / "run"
    train("data=webdataset", f'data.urls="{out}/shard-{{000000..000003}}.tar"', "data.batch_size=16",
          "data.epoch_length=96", "data.num_workers=2", "trainer.max_steps=8", "trainer.val_check_interval=4",
          "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=4",
          "callbacks.sample_grid.num_samples=4", "callbacks.sample_grid.sampler.steps=2",
          f"hydra.run.dir={run_dir}")  # fmt: skip
    with (run_dir / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sum(1 for r in rows if r.get("train/loss")) == 8
    assert sum(1 for r in rows if r.get("val/loss")) >= 2
    assert (run_dir / "ema.pt").is_file()


@pytest.mark.slow
def test_ddp_ranks_given_different_validation_batch_counts_finish(tmp_path: Path):
    """A streamed validation shard of one sample on 2 processes: rank 1 has no batch. It never joined Lightning's
    val/loss all-reduce, and rank 0's forward waited in DDP's buffer broadcast: the run hung at the sanity check."""
    for name, limit in (("train", "600"), ("val", "1")):
        run("python", "-m", "ddpm.data.make_shards", "digits", str(tmp_path / name), "--samples-per-shard", "300",
            "--image-size", "16", "--channels", "1", "--limit", limit, timeout=120)  # fmt: skip
    run_dir = tmp_path / "run"
    done = train("trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "data=webdataset",
          f'data.urls="{tmp_path}/train/shard-{{000000..000001}}.tar"', "data.num_workers=0",
          f"data.val_urls={tmp_path}/val/shard-000000.tar", "data.batch_size=4", "data.epoch_length=32",
          "trainer.max_steps=2", "trainer.val_check_interval=1", "callbacks.sample_grid=null",
          f"hydra.run.dir={run_dir}", timeout=240)  # fmt: skip
    with (run_dir / "csv" / "metrics.csv").open() as f:
        losses = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses) and (run_dir / "ema.pt").is_file()
    assert "sync_dist" not in done.stdout + done.stderr  # Lightning's advice, which would bring the hang back


@pytest.mark.parametrize("size", [(64, 40), (28, 24), (20, 36), (28, 28), (40, 40)])  # (width, height)
def test_an_image_in_a_shard_is_sized_as_an_image_folder_sizes_it(tmp_path: Path, size) -> None:
    """decode() read only the width: 28x24 came out (1, 28, 32) (torch.stack fails on a mixed batch), 64x40 was
    squashed to a square; a square 28x28 got a black border (MNIST's padding, for any image up to a quarter
    smaller). data=image_folder centre-crops (or resizes) the same file, and so does decode."""
    from PIL import Image

    pixels = torch.randint(0, 256, (size[1], size[0]), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    (tmp_path / "a").mkdir()
    Image.fromarray(pixels.numpy()).save(tmp_path / "a" / "x.png")
    folder = ImageFolderSource(root=str(tmp_path)).load(image_size=32, channels=1).images[0]
    image, label = decode({"png": (tmp_path / "a" / "x.png").read_bytes(), "cls": b"3"}, image_size=32, channels=1)
    assert image.shape == (1, 32, 32) and label == 3
    assert torch.equal(image, folder)
