"""Faults of round 3, data: mistakes users make and faults machines have, each ending in a clear stop naming the
key or file, or in a correct run. Rows D1-D12 of docs/reliability.md ("Faults of round 3: data") point here.

- refusals name the key the user set (data.limit=0 blamed data.val_size);
- a run whose processes would draw no full optimizer step per epoch is refused at setup (2 DDP ranks with
  data.batch_size=1000 on 1,617 digits trained zero steps and exited 0);
- every Pillow mode is converted by a stated rule or refused naming the file (float TIFFs became black);
- decompression bombs and other decoder errors name the file and the setting to change;
- http(s) shards: a 404, a cut-off body and a stalled server each end in an error naming the URL, never a hang.
"""

import io
import struct
import tarfile
import threading
import warnings
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import train
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpm.data.image_folder import ImageFolderSource
from ddpm.data.images import ImageModeError, to_eight_bit, to_mode
from ddpm.data.make_shards import main as make_shards
from ddpm.data.make_shards import write_shards
from ddpm.data.ram import RAMDataModule
from ddpm.data.shards import ShardError
from ddpm.data.sources import CIFAR10Source, DigitsSource, MNISTSource
from ddpm.data.webdataset import ShardStream, WebDataModule

# --- case 2: a refusal names the key the user set ------------------------------------------------------------------


def test_train_py_with_data_limit_0_names_data_limit_not_val_size(tmp_path: Path) -> None:
    result = train("data.limit=0", f"hydra.run.dir={tmp_path / 'run'}", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "data.limit=0 must be an integer >= 1 or null" in output
    assert "val_size" not in output


RAM = {"source": DigitsSource(), "image_size": 8, "channels": 1}
WEB = {"urls": "shards/s-{0..3}.tar", "image_size": 8}


@pytest.mark.parametrize(
    ("build", "change", "named"),
    [
        (RAMDataModule, {"limit": 0}, "data.limit=0"),
        (RAMDataModule, {"limit": -5}, "data.limit=-5"),  # used to drop the last 5 images silently
        (RAMDataModule, {"batch_size": 0}, "data.batch_size=0"),
        (RAMDataModule, {"num_workers": -1}, "data.num_workers=-1"),
        (RAMDataModule, {"val_size": 0}, "data.val_size=0"),
        (RAMDataModule, {"val_size": 1.5}, "data.val_size=1.5"),
        (RAMDataModule, {"image_size": 0}, "data.image_size=0"),
        (RAMDataModule, {"channels": 2}, "data.channels=2"),
        (RAMDataModule, {"max_ram_fraction": 0.0}, "data.max_ram_fraction=0.0"),
        (RAMDataModule, {"max_ram_fraction": 1.5}, "data.max_ram_fraction=1.5"),
        (WebDataModule, {"batch_size": 0}, "data.batch_size=0"),
        (WebDataModule, {"epoch_length": 0}, "data.epoch_length=0"),
        (WebDataModule, {"num_workers": -2}, "data.num_workers=-2"),
        (WebDataModule, {"shuffle_buffer": -1}, "data.shuffle_buffer=-1"),
        (WebDataModule, {"val_shards": 0}, "data.val_shards=0"),
        (WebDataModule, {"image_size": -8}, "data.image_size=-8"),
        (WebDataModule, {"channels": 4}, "data.channels=4"),
        (WebDataModule, {"on_error": "ignore"}, "data.on_error='ignore'"),
        (WebDataModule, {"timeout_s": 0}, "data.timeout_s=0"),
        (WebDataModule, {"max_pixels": 0}, "data.max_pixels=0"),
        (MNISTSource, {"root": "x", "split": "val"}, "data.source.split='val'"),
        (CIFAR10Source, {"root": "x", "split": "auto"}, "data.source.split='auto'"),
        (ImageFolderSource, {"root": "x", "max_pixels": -1}, "data.source.max_pixels=-1"),
    ],
)
def test_every_argument_refusal_names_the_key_the_user_set(build, change: dict, named: str) -> None:
    base = RAM if build is RAMDataModule else WEB if build is WebDataModule else {}
    with pytest.raises(ValueError, match=f"^{named.replace('.', '[.]')} must be "):
        build(**(base | change))


def test_a_limit_that_leaves_no_training_images_names_data_limit_too() -> None:
    dm = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, limit=1, batch_size=1)
    with pytest.raises(ValueError, match=r"holds out 1 of the 1 images \(data\.limit=1 of 1797\).*raise data\.limit"):
        dm.setup("fit")
    small = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, limit=20, batch_size=64)
    with pytest.raises(ValueError, match=r"19 training images \(20 images \(data\.limit=20 of 1797\).*batch_size=64"):
        small.setup("fit")  # 20 images, 1 held out (round(20 * 0.05) = 1): the batch check names the limit


# --- case 3: no full optimizer step per process and epoch ----------------------------------------------------------


@pytest.mark.slow
def test_two_ddp_ranks_with_a_batch_over_each_share_are_refused_at_setup(tmp_path: Path) -> None:
    """1,797 digits, val_size 0.1: 180 held out, 1,617 to train, 808 per rank (DistributedSampler, drop_last).
    A batch of 1000 fits the whole set but not one rank's share: zero steps. Refused, non-zero, no ema.pt."""
    run_dir = tmp_path / "run"
    result = train("trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "data.batch_size=1000",
                   "trainer.max_steps=4", f"hydra.run.dir={run_dir}", check=False, timeout=600)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "1617 training images" in output and "808 per process" in output, output[-3000:]
    assert "data.batch_size=1000" in output and "trainer.devices=2" in output and "zero optimizer steps" in output
    assert "lower data.batch_size to at most 808" in output
    assert not list(run_dir.rglob("ema.pt")) and not list(run_dir.rglob("ema.safetensors"))
    assert all('"COMPLETED"' not in path.read_text() for path in run_dir.rglob("result.json"))


def fake_trainer(world_size: int = 1, accumulate: int = 1, limit: int | float = 1.0, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, global_rank=rank, num_devices=world_size, num_nodes=1,
                           accumulate_grad_batches=accumulate, limit_train_batches=limit)  # fmt: skip


def digits_dm(batch_size: int, **trainer) -> RAMDataModule:
    dm = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, batch_size=batch_size, val_size=0.1)
    dm.trainer = fake_trainer(**trainer)
    return dm


def test_the_batch_check_uses_each_rank_share_of_the_training_set() -> None:
    """808 = floor(1617 / 2) per rank, 539 = floor(1617 / 3): the largest batch that gives each rank one batch."""
    for world, share in ((1, 1617), (2, 808), (3, 539)):
        for rank in range(world):
            digits_dm(share, world_size=world, rank=rank).setup("fit")
            with pytest.raises(ValueError, match=rf"{share} per process|{share} training images"):
                digits_dm(share + 1, world_size=world, rank=rank).setup("fit")


def test_ram_validation_under_ddp_gives_each_image_to_one_rank_none_twice() -> None:
    """180 validation digits over 7 ranks: 26 or 25 each, every image once. The loader had no sampler, so Lightning
    put in its DistributedSampler, which pads the last ranks with repeats (val/loss counted 2 images twice here,
    a different mean on another device count). A DistributedSampler subclass, so Lightning keeps it; a rank past
    a tiny set's end gets one image again (a process with no batch skips the epoch-end reduce the others wait in)."""
    from torch.utils.data import DistributedSampler

    for world, val_size in ((7, 0.1), (4, 3)):
        seen = []
        for rank in range(world):
            dm = digits_dm(4, world_size=world, rank=rank)
            dm.val_size = val_size
            dm.setup("fit")
            loader = dm.val_dataloader()
            assert isinstance(loader.sampler, DistributedSampler)
            seen.append([bytes(image.numpy()) for batch in loader for image in batch[0]])
        flat = [image for share in seen for image in share]
        expected = sorted(bytes(image.numpy()) for image in dm.val_set.images[dm.val_set.index])
        if world == 7:
            assert len(expected) == 180 and sorted(flat) == expected
            assert [len(share) for share in seen] == [26, 26, 26, 26, 26, 25, 25]
        else:  # 3 images on 4 ranks
            assert sorted(set(flat)) == expected and [len(share) for share in seen] == [1, 1, 1, 1]


def test_fewer_batches_than_gradient_accumulation_are_refused_naming_it() -> None:
    digits_dm(404, accumulate=4).setup("fit")  # 1617 // 404 = 4 batches: one full step of 4 micro-batches
    with pytest.raises(ValueError, match=r"3 full batch\(es\) .*trainer\.accumulate_grad_batches=4.*at most 3.*"
                       r"data\.batch_size to at most 404"):  # fmt: skip
        digits_dm(405, accumulate=4).setup("fit")
    with pytest.raises(ValueError, match=r"0 under trainer\.limit_train_batches=0.*raise trainer\.limit_train_batches"):
        digits_dm(64, limit=0).setup("fit")
    digits_dm(64, limit=0).setup("validate")  # only fitting trains


def test_lightning_steps_a_short_accumulation_once_per_epoch_end_scaled_down() -> None:
    """The fact behind the accumulation refusal: with 1 batch per epoch and accumulate_grad_batches=4, Lightning
    steps at each epoch's end on a gradient divided by 4 (not the zero steps one might fear; a quarter-size one)."""
    grads = []

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.w - 1).pow(2).sum()  # d/dw at w = 0: -2

        def on_before_optimizer_step(self, optimizer) -> None:
            grads.append(self.w.grad.item())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    data = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=4)
    trainer = pl.Trainer(max_epochs=3, accumulate_grad_batches=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(Probe(), data)
    assert trainer.global_step == 3 and grads == [-0.5, -0.5, -0.5]


def test_webdataset_epoch_under_one_batch_per_rank_names_devices_and_epoch_length() -> None:
    dm = WebDataModule(urls="s-{0..3}.tar", image_size=8, batch_size=64, epoch_length=100)
    dm.trainer = fake_trainer(world_size=2)
    with pytest.raises(ValueError, match=r"data\.epoch_length=100 samples split over 2 process\(es\) \(trainer\."
                       r"devices=2 x trainer\.num_nodes=1\): 0 full batch.*at least 128.*at most 50"):  # fmt: skip
        dm.setup("fit")
    dm.trainer = fake_trainer(world_size=1, accumulate=2)
    with pytest.raises(ValueError, match=r"trainer\.accumulate_grad_batches=2"):
        dm.setup("fit")


# --- case 4: every Pillow mode by a stated rule, or refused naming the file ----------------------------------------


def quadrants(values: list) -> np.ndarray:
    """An 8x8 array whose four 4x4 quadrants hold values[0..3] (top-left, top-right, bottom-left, bottom-right)."""
    out = np.empty((8, 8), dtype=np.asarray(values).dtype)
    out[:4, :4], out[:4, 4:], out[4:, :4], out[4:, 4:] = values
    return out


def folder_of(tmp_path: Path, images: dict[str, Image.Image], suffix: str = ".tif") -> Path:
    root = tmp_path / "root"
    for name, image in images.items():
        (root / name).mkdir(parents=True)
        image.save(root / name / f"{name}{suffix}")
    return root


def load_grey(root: Path, **source) -> np.ndarray:
    return ImageFolderSource(root=str(root), **source).load(image_size=8, channels=1).images[:, 0].numpy()


def test_float_tiffs_in_unit_range_scale_by_255_and_in_byte_range_pass_as_they_are(tmp_path: Path) -> None:
    unit = Image.fromarray(quadrants(np.array([0.0, 0.25, 0.5, 1.0], dtype=np.float32)))
    byte = Image.fromarray(quadrants(np.array([0.0, 7.4, 200.0, 255.0], dtype=np.float32)))
    root = folder_of(tmp_path, {"a_unit": unit, "b_byte": byte})
    assert Image.open(root / "a_unit" / "a_unit.tif").mode == "F"
    grey = load_grey(root)
    np.testing.assert_array_equal(grey[0], quadrants([0, 64, 128, 255]))  # 63.75 -> 64, 127.5 -> 128 (to even)
    np.testing.assert_array_equal(grey[1], quadrants([0, 7, 200, 255]))


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        ([0.1, float("nan"), 0.5, 1.0], r"16 of its 64 float pixels \(mode F\) are NaN or inf"),
        ([0.1, float("inf"), 0.5, 1.0], r"NaN or inf"),
        ([-1.0, 0.0, 0.5, 1.0], r"mode F.*range is -1\.\.1;"),
        ([0.0, 10.0, 300.0, 1.0], r"mode F.*range is 0\.\.300;"),
    ],
    ids=["nan", "inf", "negative", "above-255"],
)
def test_float_tiffs_with_nan_or_another_range_are_refused_naming_the_file(tmp_path, values, pattern) -> None:
    root = folder_of(tmp_path, {"cls": Image.fromarray(quadrants(np.array(values, dtype=np.float32)))})
    with pytest.raises(ValueError, match=rf"{root / 'cls' / 'cls.tif'}: .*{pattern}.* 8- or 16-bit PNG"):
        load_grey(root)


def test_train_py_on_float_tiffs_with_nan_stops_naming_the_file(tmp_path: Path) -> None:
    """The case as reported: [0, 1] float TIFFs, some NaN, trained to the end on black images; now a clear stop."""
    images = {f"c{i}": Image.fromarray(quadrants(np.array([0.2, np.nan, 0.6, 1.0], np.float32))) for i in range(2)}
    root = folder_of(tmp_path, images)
    result = train("data=image_folder", f"data.root={root}", "data.num_workers=0", "data.batch_size=1",
                   "data.val_size=1", f"hydra.run.dir={tmp_path / 'run'}", check=False)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"{root / 'c0' / 'c0.tif'}: 16 of its 64 float pixels (mode F) are NaN or inf" in output, output[-3000:]


def test_int32_tiffs_go_by_their_real_range(tmp_path: Path) -> None:
    files = {
        "a_byte": quadrants(np.array([0, 100, 200, 255], dtype=np.int32)),  # 8-bit values: as they are
        "b_short": quadrants(np.array([0, 25700, 1000, 65535], dtype=np.int32)),  # 16-bit: x * 255 / 65535
    }
    root = folder_of(tmp_path, {name: Image.fromarray(array) for name, array in files.items()})
    assert Image.open(root / "a_byte" / "a_byte.tif").mode == "I"
    grey = load_grey(root)
    np.testing.assert_array_equal(grey[0], quadrants([0, 100, 200, 255]))
    np.testing.assert_array_equal(grey[1], quadrants([0, 100, 4, 255]))  # 25700 = 257 * 100; 1000 -> 3.89 -> 4
    for values, shown in (([-1, 0, 5, 9], "-1..9"), ([0, 70000, 5, 9], "0..70000")):
        bad = folder_of(tmp_path / shown, {"x": Image.fromarray(quadrants(np.array(values, dtype=np.int32)))})
        with pytest.raises(ValueError, match=rf"x\.tif: 32-bit integer \(mode I\).* range is {shown};.*16-bit PNG"):
            load_grey(bad)


def test_sixteen_bit_files_scale_from_65535(tmp_path: Path) -> None:
    values = quadrants(np.array([0, 257 * 100, 257 * 7, 65535], dtype=np.uint16))
    root = tmp_path / "root"
    (root / "a_png").mkdir(parents=True)
    Image.fromarray(values).save(root / "a_png" / "grey16.png")  # I;16 (little-endian) PNG
    (root / "b_tiff").mkdir()
    Image.fromarray(values.astype(">u2")).save(root / "b_tiff" / "grey16b.tif")  # I;16B TIFF
    assert [Image.open(p).mode for p in sorted(root.rglob("*.*"))] == ["I;16", "I;16B"]
    for grey in load_grey(root):
        np.testing.assert_array_equal(grey, quadrants([0, 100, 7, 255]))
    for mode, dtype in (("I;16L", "<u2"), ("I;16N", "=u2"), ("I;16B", ">u2")):  # modes Pillow will not save as PNG
        image = Image.frombytes(mode, (8, 8), values.astype(dtype).tobytes())
        np.testing.assert_array_equal(np.asarray(to_mode(image, "L")), quadrants([0, 100, 7, 255]), err_msg=mode)


def test_eight_bit_modes_convert_by_pillow_with_transparency_onto_white(tmp_path: Path) -> None:
    """Files in every 8-bit mode Pillow writes (TIFF, PNG), and in memory the ones it does not: each one flat colour."""
    pa = Image.new("PA", (8, 8), (0, 0))
    pa.putpalette([10, 20, 30] * 256)
    files = {  # name: (image, suffix, expected RGB)
        "cmyk": (Image.new("CMYK", (8, 8), (0, 255, 255, 0)), ".tif", (255, 0, 0)),
        "ycbcr": (Image.new("YCbCr", (8, 8), (128, 128, 128)), ".tif", (128, 128, 128)),
        "lab": (Image.new("LAB", (8, 8), (128, 128, 128)), ".tif", (119, 119, 119)),  # L* = 50: sRGB 119, neutral
        "pa_clear": (pa, ".tif", (255, 255, 255)),
        "one_bit": (Image.new("1", (8, 8), 1), ".png", (255, 255, 255)),
        "la_clear": (Image.new("LA", (8, 8), (0, 0)), ".png", (255, 255, 255)),
        "la_opaque": (Image.new("LA", (8, 8), (40, 255)), ".png", (40, 40, 40)),
    }
    root = tmp_path / "root"
    for name, (image, suffix, _) in files.items():
        (root / name).mkdir(parents=True)
        image.save(root / name / f"{name}{suffix}")
        assert Image.open(root / name / f"{name}{suffix}").mode == image.mode, name
    rgb = ImageFolderSource(root=str(root)).load(image_size=8, channels=3).images
    for index, name in enumerate(sorted(files)):
        got = rgb[index].float().mean((1, 2)).tolist()
        assert got == pytest.approx(files[name][2], abs=2.0), name  # littleCMS and YCbCr round within a level
    in_memory = {
        "HSV": (Image.new("HSV", (8, 8), (0, 255, 255)), (255, 0, 0)),
        "RGBa": (Image.new("RGBa", (8, 8), (0, 0, 0, 0)), (255, 255, 255)),
        "La": (Image.new("La", (8, 8), (0, 0)), (255, 255, 255)),
        "RGBX": (Image.new("RGBX", (8, 8), (200, 40, 10, 0)), (200, 40, 10)),  # X is padding, not alpha
    }
    for mode, (image, expected) in in_memory.items():
        assert to_mode(image, "RGB").getpixel((3, 3)) == expected, mode


def test_a_mode_without_a_stated_rule_is_refused_naming_the_file_and_mode() -> None:
    with pytest.raises(ImageModeError, match=r"^odd\.bmp: Pillow mode 'BGR;15' has no stated conversion"):
        to_eight_bit(SimpleNamespace(mode="BGR;15"), "odd.bmp")


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_tar(path: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_shards_convert_modes_by_the_same_rule(tmp_path: Path) -> None:
    """A 16-bit PNG in a shard was clipped to 255 and an RGBA one lost its alpha (black); now as in image folders."""
    grey16 = Image.fromarray(np.full((8, 8), 257 * 100, dtype=np.uint16))
    clear = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    url = write_tar(tmp_path / "modes.tar", {"a.png": png_bytes(grey16), "a.cls": b"1", "b.png": png_bytes(clear),
                                             "b.cls": b"2"})  # fmt: skip
    images, labels = next(iter(DataLoader(shard_stream([url], batch_size=2), batch_size=None)))
    assert images[:, 0].flatten(1).unique(dim=1).flatten().tolist() == [100, 255] and labels.tolist() == [1, 2]


# --- case 5: decompression bombs and decoder errors name the file --------------------------------------------------


def png_header_only(width: int, height: int) -> bytes:
    """A 69-byte PNG whose IHDR says width x height (8-bit grey) over a trivial compressed body."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 100)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def bomb_folder(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "cls").mkdir(parents=True)
    Image.new("L", (8, 8), 3).save(root / "cls" / "a_fine.png")
    (root / "cls" / "b_bomb.png").write_bytes(png_header_only(20000, 20000))
    return root


def test_a_png_whose_header_says_20000x20000_is_refused_naming_the_file_and_max_pixels(tmp_path: Path) -> None:
    root = bomb_folder(tmp_path)
    assert len((root / "cls" / "b_bomb.png").read_bytes()) < 100
    bomb = root / "cls" / "b_bomb.png"
    with pytest.raises(ValueError, match=rf"{bomb} has 400,000,000 pixels, over data\.source\.max_pixels=89478485 "
                       r".*data\.source\.max_pixels=400000000 or more .*max_pixels=null"):  # fmt: skip
        load_grey(root)
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # restored


def test_between_one_and_two_times_the_limit_is_refused_too_and_null_lifts_it(tmp_path: Path) -> None:
    """Pillow only warns between 1x and 2x its limit; here the limit is the limit: 64 pixels over 40 is refused."""
    root = tmp_path / "root"
    (root / "cls").mkdir(parents=True)
    Image.new("L", (8, 8), 3).save(root / "cls" / "a.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning may pass either
        with pytest.raises(ValueError, match=r"a\.png has 64 pixels, over data\.source\.max_pixels=40 "):
            load_grey(root, max_pixels=40)
        assert load_grey(root, max_pixels=64)[0].max() == 3 and load_grey(root, max_pixels=None)[0].max() == 3
    assert Image.MAX_IMAGE_PIXELS == 89_478_485


def test_other_decoder_errors_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow raises SyntaxError, struct.error, ValueError ... besides OSError; each is named, with the file."""
    from PIL import PngImagePlugin

    root = tmp_path / "root"
    (root / "cls").mkdir(parents=True)
    Image.new("L", (8, 8), 3).save(root / "cls" / "a.png")

    def broken(self):
        raise SyntaxError("broken PNG file")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", broken)
    with pytest.raises(ValueError, match=rf"{root / 'cls' / 'a.png'} is not a readable image \(SyntaxError: broken"):
        load_grey(root)


def test_a_bomb_in_a_shard_names_the_url_the_key_and_data_max_pixels(tmp_path: Path) -> None:
    url = write_tar(tmp_path / "bomb.tar", {"ok.png": png_bytes(Image.new("L", (8, 8), 9)), "ok.cls": b"0",
                                            "big.png": png_header_only(20000, 20000), "big.cls": b"1"})  # fmt: skip
    with pytest.raises(ShardError, match=r"shard .*bomb\.tar cannot be read in sample 'big': .*image big\.png has "
                       r"400,000,000 pixels, over data\.max_pixels=89478485"):  # fmt: skip
        collect(shard_stream([url]))
    with pytest.warns(UserWarning, match=r"skipped 1 damaged sample\(s\) in shard .*bomb\.tar"):
        images, _ = collect(shard_stream([url], on_error="skip"))
    assert images.shape[0] == 1


def test_make_shards_on_a_folder_with_a_bomb_names_the_file_and_its_option(tmp_path: Path, capsys) -> None:
    root = bomb_folder(tmp_path)
    with pytest.raises(SystemExit) as stop:
        make_shards([f"folder:{root}", str(tmp_path / "out"), "--image-size", "8", "--channels", "1"])
    assert stop.value.code == 1
    assert (
        f"{root / 'cls' / 'b_bomb.png'} has 400,000,000 pixels, over --max-pixels=89478485" in capsys.readouterr().err
    )


# --- http(s) shards: never a hang -----------------------------------------------------------------------------------


def unique_images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n random 8x8 grey images whose first 4 pixels spell their index (the sample's identity)."""
    images = torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images[:, 0, 0, :4] = torch.tensor([[i >> 24, i >> 16 & 255, i >> 8 & 255, i & 255] for i in range(n)])
    return images, torch.arange(n) % 10


def ids(images: torch.Tensor) -> list[int]:
    head = images[:, 0, 0, :4].long()
    return (head[:, 0] << 24 | head[:, 1] << 16 | head[:, 2] << 8 | head[:, 3]).tolist()


def shard_stream(urls: list[str], **kw) -> ShardStream:
    return ShardStream(urls, **({"image_size": 8, "channels": 1, "batch_size": 4, "batches_per_epoch": None} | kw))


def collect(dataset: ShardStream, workers: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
    iterator = iter(loader)
    try:
        batches = list(iterator)
    finally:
        getattr(iterator, "_shutdown_workers", lambda: None)()
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def within(seconds: float, fn, *args):
    """fn(*args) in a thread; a TimeoutError (a failed test, not a hung suite) if it takes longer than `seconds`."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=seconds)
    finally:
        pool.shutdown(wait=False)


class ShardServer:
    """http.server on 127.0.0.1 in a thread: /files/NAME serves a shard, /missing/NAME answers 404, /cut/NAME
    sends the full Content-Length but only the body up to a tar member boundary and closes, /half/NAME half the
    body, /stall/NAME sends the headers and then nothing until the test ends."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files, self.release = files, threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                kind, _, name = self.path.lstrip("/").partition("/")
                body = owner.files.get(name)
                if kind == "missing" or body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if kind == "stall":
                    self.wfile.flush()
                    owner.release.wait(600)
                    return
                sent = {"cut": member_boundary(body, 3), "half": len(body) // 2}.get(kind, len(body))
                self.wfile.write(body[:sent])
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, kind: str, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{kind}/{name}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def member_boundary(body: bytes, samples: int) -> int:
    """The byte offset where sample number `samples` (2 members each) starts: a cut there leaves a well-formed
    tar without its end marker, which tarfile reads as a short archive, silently."""
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        return tar.getmembers()[2 * samples].offset


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    images, labels = unique_images(80)
    paths = write_shards(images, labels, tmp_path / "shards", samples_per_shard=10)
    served = ShardServer({p.name: p.read_bytes() for p in paths})
    served.names, served.images = [p.name for p in paths], images
    yield served
    served.close()


def test_http_shards_read_back_as_the_local_ones(server: ShardServer) -> None:
    images, _ = within(60, collect, shard_stream([server.url("files", name) for name in server.names]))
    torch.testing.assert_close(images, server.images, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        ("missing", r"answered HTTP 404"),
        ("cut", r"ended after \d+ of its \d+ bytes \(Content-Length\)"),
        ("half", r"ended after \d+ of its \d+ bytes|broke off"),
        ("stall", r"no answer within data\.timeout_s=2\.0 s"),
    ],
)
def test_http_404_cut_and_stalled_shards_end_in_an_error_naming_the_url(server, kind: str, pattern: str) -> None:
    url = server.url(kind, server.names[1])
    urls = [server.url("files", server.names[0]), url]
    with pytest.raises(ShardError, match=rf"shard {url} cannot be read .*{pattern}"):
        within(30, collect, shard_stream(urls, timeout_s=2.0))


def test_http_failures_under_skip_warn_with_the_count_of_skipped_shards(server: ShardServer) -> None:
    """Through the datamodule (data.timeout_s, data.on_error=skip): the 404 and the stalled shard are skipped with
    warnings that count them; every sample of the sound shards arrives."""
    good = [server.url("files", name) for name in server.names[:3]]
    bad = [server.url("missing", server.names[3]), server.url("stall", server.names[4])]
    train = [server.url("files", server.names[7])]  # validation shards are not training shards
    dm = WebDataModule(urls=train, val_urls=[*good, *bad], image_size=8, channels=1, batch_size=4, num_workers=0,
                       epoch_length=8, on_error="skip", timeout_s=2.0)  # fmt: skip
    dm.setup("fit")
    with pytest.warns(UserWarning) as caught:
        images, _ = within(60, collect, dm.val_set)
    messages = [str(w.message) for w in caught]
    assert any("2 of the 5 shard(s) of this pass could not be read" in m for m in messages), messages
    assert sum(f"skipped shard {url}" in m for m in messages for url in bad) == 2
    assert sorted(ids(images)) == list(range(30))


def test_two_ranks_two_workers_over_http_read_every_sample_exactly_once(server: ShardServer) -> None:
    urls = [server.url("files", name) for name in server.names]
    seen = Counter()
    for rank in range(2):
        images, _ = within(120, collect, shard_stream(urls, rank=rank, world_size=2, timeout_s=10.0), 2)
        seen.update(ids(images))
    assert seen == Counter(range(80))
