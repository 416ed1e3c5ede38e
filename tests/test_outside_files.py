"""Files from outside are not taken at face value (issue 36, class 5), and the soak benchmark runs.

- EXIF orientation: photos stored sideways or mirrored with an Orientation tag 2..8 are read as every viewer shows
  them, through data=image_folder, make_shards -> the shard reader, and other tools' JPEG shards; the truth is the
  stored pixels (Pillow's plain decode, which ignores the tag) turned by numpy as the EXIF table says.
- A torn or foreign Inception weights file at the path torch hub reads, a torn reference statistics cache and a
  torn classifier file: each named, with the fix (or, for our own cache, computed again).
- benchmarks/soak.py --smoke: a real training subprocess whose memory is read and reported with its provenance.
"""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run
from PIL import Image

from ddpm.data import make_shards
from ddpm.data.image_folder import ImageFolderSource
from ddpm.data.images import open_image
from ddpm.data.shards import read_shard
from ddpm.data.sources import DigitsSource
from ddpm.metrics import features
from ddpm.metrics.classifier import SmallClassifier, save_torchscript
from ddpm.metrics.features import INCEPTION_FILE, INCEPTION_URL, FeatureExtractor, InceptionWeightsCorrupt
from ddpm.metrics.fid import reference_stats

ORIENTATION = 0x0112  # EXIF tag 274
# What viewers show for each EXIF Orientation, as numpy operations on the stored (H, W[, C]) pixels: EXIF 2.32
# (CIPA DC-008-2019) tag 0x0112, in exiftool's words for each value; np.rot90(a, -1) turns a clockwise.
SHOWN = {
    1: lambda a: a,  # Horizontal (normal)
    2: np.fliplr,  # Mirror horizontal
    3: lambda a: np.rot90(a, 2),  # Rotate 180
    4: np.flipud,  # Mirror vertical
    5: lambda a: np.rot90(np.fliplr(a), 1),  # Mirror horizontal and rotate 270 CW
    6: lambda a: np.rot90(a, -1),  # Rotate 90 CW
    7: lambda a: np.rot90(np.fliplr(a), -1),  # Mirror horizontal and rotate 90 CW
    8: lambda a: np.rot90(a, 1),  # Rotate 270 CW
}
# The spec's own definition of each value: where the stored 0th row and 0th column are seen.
ROW0_COL0 = {1: ("top", "left"), 2: ("top", "right"), 3: ("bottom", "right"), 4: ("bottom", "left"),
             5: ("left", "top"), 6: ("right", "top"), 7: ("right", "bottom"), 8: ("left", "bottom")}  # fmt: skip


def test_the_orientation_table_is_the_exif_specs() -> None:
    """SHOWN (the truth of the tests below) puts the stored first row and column where the spec says."""
    stored = np.arange(4 * 6).reshape(4, 6)
    for value, (row0, col0) in ROW0_COL0.items():
        shown = SHOWN[value](stored)
        sides = {"top": shown[0, :], "bottom": shown[-1, :], "left": shown[:, 0], "right": shown[:, -1]}
        assert set(sides[row0]) == set(stored[0, :]) and set(sides[col0]) == set(stored[:, 0]), value


def photo(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Seeded noise: no symmetry for a flip or turn to hide in."""
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def save_oriented(path: Path, array: np.ndarray, orientation: int, **options) -> np.ndarray:
    """Write `array` with EXIF Orientation `orientation`; returns the stored pixels: the same array written without
    the tag and decoded by Pillow (the JPEG loss included; Pillow itself applies TIFF's tag when it decodes)."""
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    Image.fromarray(array).save(path, exif=exif, **options)
    with Image.open(path) as image:
        assert image.getexif().get(ORIENTATION) == orientation  # the tag really is in the file
        kind = image.format
    untagged = io.BytesIO()
    Image.fromarray(array).save(untagged, format=kind, **options)
    with Image.open(untagged) as image:
        return np.asarray(image)


def centre(array: np.ndarray, size: int) -> np.ndarray:
    top, left = (array.shape[0] - size) // 2, (array.shape[1] - size) // 2
    return array[top : top + size, left : left + size]


def image_folder(root: Path, *, grey: bool) -> dict[int, np.ndarray]:
    """root/photos/o<v>.jpg for v = 1..8: 16x24 (landscape) JPEGs; {v: the 16x16 centre of what viewers show}."""
    (root / "photos").mkdir(parents=True)
    shown = {}
    for value in SHOWN:
        stored = save_oriented(root / "photos" / f"o{value}.jpg", photo((16, 24) if grey else (16, 24, 3), value),
                               value, quality=95)  # fmt: skip
        shown[value] = centre(SHOWN[value](stored), 16)  # 16x24 or, turned, 24x16: no resize, a centre crop
    return shown


def chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array[..., None] if array.ndim == 2 else array)).permute(2, 0, 1)


@pytest.mark.parametrize("grey", [False, True], ids=["rgb", "grey"])
def test_image_folder_reads_every_exif_orientation_as_viewers_show_it(tmp_path: Path, grey: bool) -> None:
    shown = image_folder(tmp_path, grey=grey)
    data = ImageFolderSource(root=str(tmp_path)).load(image_size=16, channels=1 if grey else 3)
    for i, value in enumerate(SHOWN):  # files in sorted order: o1 .. o8
        assert torch.equal(data.images[i], chw(shown[value])), f"orientation {value}"


def test_make_shards_stores_the_upright_pixels_and_the_reader_reads_them(tmp_path: Path) -> None:
    shown = image_folder(tmp_path / "folder", grey=False)
    paths = make_shards.main([f"folder:{tmp_path / 'folder'}", str(tmp_path / "shards"), "--image-size", "16",
                              "--channels", "3", "--no-shuffle", "--samples-per-shard", "3"])  # fmt: skip
    read = [image for path in paths for image, _ in read_shard(str(path), image_size=16, channels=3, on_error="raise")]
    assert len(read) == 8
    for image, value in zip(read, SHOWN, strict=True):
        assert torch.equal(image, chw(shown[value])), f"orientation {value}"
    with tarfile.open(paths[0]) as tar, Image.open(tar.extractfile(tar.getmembers()[0])) as stored:
        assert stored.format == "PNG" and ORIENTATION not in stored.getexif()  # no tag left for a reader to apply


def test_shard_reader_applies_the_orientation_of_jpegs_in_other_tools_shards(tmp_path: Path) -> None:
    shard, shown = tmp_path / "theirs-000000.tar", {}
    with tarfile.open(shard, "w") as tar:
        for value in SHOWN:
            stored = save_oriented(tmp_path / "x.jpg", photo((16, 16, 3), value), value, quality=95)
            shown[value] = SHOWN[value](stored)
            for name, data in ((f"s{value}.jpg", (tmp_path / "x.jpg").read_bytes()), (f"s{value}.cls", b"0")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    read = [image for image, _ in read_shard(str(shard), image_size=16, channels=3, on_error="raise")]
    for image, value in zip(read, SHOWN, strict=True):
        assert torch.equal(image, chw(shown[value])), f"orientation {value}"


@pytest.mark.parametrize(
    ("suffix", "mode", "orientation", "options"),
    [
        (".png", "I;16", 6, {}),
        (".png", "RGBA", 3, {}),
        (".tif", "RGB", 8, {}),  # Pillow turns a TIFF itself: turned once, not twice
        (".webp", "RGB", 5, {"lossless": True}),
        (".png", "L", 1, {}),
    ],
    ids=["png16-6", "png-rgba-3", "tiff-8", "webp-5", "png-1"],
)
def test_other_formats_and_modes_are_read_upright(tmp_path: Path, suffix, mode, orientation, options) -> None:
    """16-bit grey (scaled), transparency (onto white), TIFF's own tag, WebP; a PNG with orientation 1 as stored."""
    rng, path = np.random.default_rng(1), tmp_path / f"image{suffix}"
    array = {"I;16": rng.integers(0, 65536, (8, 12), dtype=np.uint16), "RGBA": photo((8, 12, 4)),
             "RGB": photo((8, 12, 3)), "L": photo((8, 12))}[mode]  # fmt: skip
    stored = save_oriented(path, array, orientation, **options)
    if mode == "I;16":
        stored = np.round(stored.astype(np.float64) * 255 / 65535).astype(np.uint8)
    elif mode == "RGBA":  # composited onto white: c * a + 255 * (1 - a)
        alpha = stored[..., 3:].astype(np.float64) / 255
        stored = np.round(stored[..., :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)
    image = open_image(path, None, name=path.name, max_pixels=None, setting="data.source.max_pixels")
    expected = SHOWN[orientation](stored)
    got = np.asarray(image)
    assert got.shape == expected.shape
    assert np.abs(got.astype(int) - expected).max() <= (1 if mode == "RGBA" else 0)  # compositing rounds


# --- Inception weights in torch hub's cache ---------------------------------------------------------------------


@pytest.fixture
def hub_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where torch hub keeps the weights under TORCH_HOME (<TORCH_HOME>/hub/checkpoints/<file of the URL>), with
    downloads made a test failure: what is read there is the file the test writes."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda *a, **k: pytest.fail("tried to download"))
    path = tmp_path / "torch" / "hub" / "checkpoints" / INCEPTION_FILE
    path.parent.mkdir(parents=True)
    return path


def torch_file(payload: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


TORN = {
    "cut-before-central-directory": lambda: torch_file({"w": torch.zeros(50_000)})[:-300],
    "cut-halfway": lambda: torch_file({"w": torch.zeros(50_000)})[:100_000],
    "garbage": lambda: b"<html>rate limited</html>" * 40,
    "empty": lambda: b"",
    "another-network": lambda: torch_file({"conv.weight": torch.zeros(3, 3)}),
}


@pytest.mark.parametrize("kind", list(TORN))
def test_a_torn_inception_weights_file_is_named_with_the_fix(hub_file: Path, kind: str) -> None:
    hub_file.write_bytes(TORN[kind]())
    with pytest.raises(InceptionWeightsCorrupt) as error:
        features.build_extractor("inception")
    message = str(error.value)
    assert str(hub_file) in message and f"rm {hub_file}" in message and INCEPTION_URL in message, message
    assert "metrics.features=" in message and hub_file.exists()  # the user's file is named, not deleted
    with pytest.raises(InceptionWeightsCorrupt) as error:  # the FID callback's setting, in train.py's words
        features.build_extractor("inception", key="callbacks.fid.features")
    assert "callbacks.fid.features=<path" in str(error.value) and "metrics.features" not in str(error.value)


def test_a_genuine_inception_file_that_fails_is_not_called_torn(
    hub_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose sha256 begins as torch hub's name says is the real one: its error passes through untouched."""
    hub_file.write_bytes(b"garbage")
    monkeypatch.setattr(features, "file_digest", lambda path: features.INCEPTION_SHA256_PREFIX + "0000")
    with pytest.raises(Exception) as error:
        features.build_extractor("inception")
    assert not isinstance(error.value, InceptionWeightsCorrupt)


# --- other files the metrics read -------------------------------------------------------------------------------


class MeanPool(torch.nn.Module):
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().mean((2, 3))


@pytest.mark.parametrize("damage", ["cut", "garbage", "not-a-dict", "a-field-missing"])
def test_a_torn_reference_cache_is_named_computed_again_and_replaced(tmp_path: Path, damage: str) -> None:
    extractor, source = FeatureExtractor(net=MeanPool(), name="meanpool", kind="classifier"), DigitsSource()
    first = reference_stats(source, image_size=8, channels=1, extractor=extractor, cache_dir=tmp_path)
    (path,) = tmp_path.iterdir()
    good = torch.load(path, weights_only=True)
    damaged = {
        "cut": path.read_bytes()[: path.stat().st_size // 2],
        "garbage": b"\x00junk" * 100,
        "not-a-dict": torch_file([1, 2, 3]),
        "a-field-missing": torch_file({k: v for k, v in good.items() if k != "cov_sum"}),
    }
    path.write_bytes(damaged[damage])
    with pytest.warns(UserWarning, match="computing the statistics again") as warned:
        again = reference_stats(source, image_size=8, channels=1, extractor=extractor, cache_dir=tmp_path)
    assert any(str(path) in str(w.message) for w in warned)
    assert again.num == first.num == 1797 and torch.equal(again.cov_sum, first.cov_sum)
    assert torch.equal(torch.load(path, weights_only=True)["cov_sum"], good["cov_sum"])  # the file is whole again


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_a_torn_classifier_file_is_named_with_the_fix(tmp_path: Path, damage: str) -> None:
    path = save_torchscript(SmallClassifier(in_channels=1, num_classes=10).eval(), tmp_path / "clf.pt", image_size=32)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if damage == "cut" else b"garbage" * 50)
    with pytest.raises(ValueError, match="cannot be read") as error:
        features.build_extractor(str(path))
    assert f"metrics.features={path}" in str(error.value) and "--save-classifier" in str(error.value)


# --- the soak benchmark -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_soak_smoke_reads_the_training_memory_and_writes_its_record(tmp_path: Path) -> None:
    """A real train.py (60 steps, logged every 5) watched: readings of a live torch process, the growth between the
    medians of steps 6-9 and 56-59 of what was read during training, and the provenance."""
    out = tmp_path / "soak.json"
    result = run("python", "benchmarks/soak.py", "--smoke", "--out", out, timeout=300)
    record = json.loads(out.read_text())
    readings = record["readings"]
    assert [r["step"] for r in readings] == sorted(r["step"] for r in readings) and readings[-1]["step"] == 59
    assert all(300 < r["rss_mb"] < 20_000 and r["processes"] >= 1 for r in readings)  # a torch process, in MB
    warm, end = record["warm"], record["end"]
    training = readings[: [r["step"] for r in readings].index(59) + 1]  # the readings after are of the export
    for part, (low, high) in ((warm, (6, 9)), (end, (56, 59))):
        inside = [r for r in training if low <= r["step"] <= high] or [next(r for r in training if r["step"] >= low)]
        assert part["rss_mb"] == round(float(np.median([r["rss_mb"] for r in inside])), 1), (part, inside)
        assert part["step"] == np.median([r["step"] for r in inside])
    assert record["growth_mb"] == round(end["rss_mb"] - warm["rss_mb"], 1)
    per_1000 = (end["rss_mb"] - warm["rss_mb"]) / (end["step"] - warm["step"]) * 1000
    assert record["growth_mb_per_1000_steps"] == pytest.approx(per_1000, abs=0.01)
    provenance = record["provenance"]
    assert provenance["cpu"] and provenance["torch"] == torch.__version__ and provenance["smoke"] is True
    assert provenance["commit"] and "| step | RSS MB |" in result.stdout and "MB per 1,000 steps" in result.stdout
