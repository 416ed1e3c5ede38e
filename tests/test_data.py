"""Dataset readers and the RAM datamodule, against real files and hand-made references."""

import gzip
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import tiny_unet
from PIL import Image

from ddpm.data import ram
from ddpm.data.idx import read_idx
from ddpm.data.image_folder import ImageFolderSource
from ddpm.data.ram import RAMDataModule
from ddpm.data.sources import CIFAR10Source, DigitsSource, ImageSet, MNISTSource
from ddpm.models.unet import UNet
from ddpm.module import check_batch

IMAGES, LABELS = "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"
# The MNIST test set's class counts and first ten labels (LeCun et al.; the same in every copy of the set).
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
MNIST_TEST_FIRST_LABELS = [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]


def raw_idx(path: Path, header_ints: int) -> tuple[tuple[int, ...], np.ndarray]:
    """A hand-written IDX reader (big-endian int32 header, then unsigned bytes) as the reference."""
    data = gzip.decompress(path.read_bytes())
    header = tuple(int.from_bytes(data[4 * i : 4 * i + 4], "big") for i in range(header_ints))
    return header, np.frombuffer(data, dtype=np.uint8, offset=4 * header_ints)


@pytest.fixture(scope="module")
def mnist_raw(mnist_root: Path) -> tuple[np.ndarray, np.ndarray]:
    (magic, n, rows, cols), pixels = raw_idx(mnist_root / f"{IMAGES}.gz", 4)
    (label_magic, n_labels), labels = raw_idx(mnist_root / f"{LABELS}.gz", 2)
    assert (magic, label_magic, n, n_labels, rows, cols) == (0x803, 0x801, 10000, 10000, 28, 28)
    return pixels.reshape(n, rows, cols), labels


# --- read_idx ----------------------------------------------------------------------------------------


def test_read_idx_reads_the_real_mnist_test_set(mnist_root: Path, mnist_raw: tuple[np.ndarray, np.ndarray]) -> None:
    images = read_idx(mnist_root / f"{IMAGES}.gz")
    labels = read_idx(mnist_root / f"{LABELS}.gz")
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10000,) and labels.dtype == np.uint8
    assert np.bincount(labels, minlength=10).tolist() == MNIST_TEST_COUNTS
    assert labels[:10].tolist() == MNIST_TEST_FIRST_LABELS
    assert images.min() == 0 and images.max() == 255
    np.testing.assert_array_equal(images, mnist_raw[0])
    np.testing.assert_array_equal(labels, mnist_raw[1])


def test_read_idx_reads_a_plain_copy_the_same(mnist_root: Path, tmp_path: Path) -> None:
    for stem in (IMAGES, LABELS):
        (tmp_path / stem).write_bytes(gzip.decompress((mnist_root / f"{stem}.gz").read_bytes()))
        np.testing.assert_array_equal(read_idx(tmp_path / stem), read_idx(mnist_root / f"{stem}.gz"))


def damaged_copies(mnist_root: Path, folder: Path) -> dict[str, Path]:
    plain = gzip.decompress((mnist_root / f"{LABELS}.gz").read_bytes())
    packed = (mnist_root / f"{LABELS}.gz").read_bytes()
    files = {
        "data cut short": (f"{LABELS}-short", plain[:-100]),
        "header cut short": (f"{LABELS}-header", plain[:6]),
        "gzip cut short": (f"{LABELS}-short.gz", packed[: len(packed) // 2]),
        "bad magic": (f"{LABELS}-magic", b"\x12\x34\x08\x01" + plain[4:]),
        "bad magic in gzip": (f"{LABELS}-magic.gz", gzip.compress(b"PK\x03\x04" + plain[4:])),
        "not gzip but .gz": (f"{LABELS}-plain.gz", plain),
        "empty": (f"{LABELS}-empty", b""),
        "data too long": (f"{LABELS}-long", plain + b"\x00" * 8),
    }
    paths = {}
    for what, (name, content) in files.items():
        (folder / name).write_bytes(content)
        paths[what] = folder / name
    return paths


@pytest.mark.parametrize(
    "what",
    [
        "data cut short",
        "header cut short",
        "gzip cut short",
        "bad magic",
        "bad magic in gzip",
        "not gzip but .gz",
        "empty",
        "data too long",
    ],
)
def test_read_idx_rejects_a_damaged_file_naming_it(mnist_root: Path, tmp_path: Path, what: str) -> None:
    path = damaged_copies(mnist_root, tmp_path)[what]
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        read_idx(path)
    assert "re-download" in str(info.value)
    if what == "data too long":
        assert "truncated" not in str(info.value) and "longer than its header says" in str(info.value)


# --- MNISTSource -------------------------------------------------------------------------------------


def test_mnist_source_test_pair_only_is_padded_to_32(
    mnist_root: Path, mnist_raw: tuple[np.ndarray, np.ndarray]
) -> None:
    source = MNISTSource(root=str(mnist_root), split="auto")
    assert source.count() == 10000
    data = source.load(image_size=32, channels=1)
    assert data.images.shape == (10000, 1, 32, 32) and data.images.dtype == torch.uint8
    assert data.num_classes == 10 and data.labels.dtype == torch.int64
    border = torch.ones(32, 32, dtype=torch.bool)
    border[2:30, 2:30] = False
    assert data.images[:, :, border].eq(0).all(), "the 2-pixel padding must be zero"
    np.testing.assert_array_equal(data.images[:, 0, 2:30, 2:30].numpy(), mnist_raw[0])
    np.testing.assert_array_equal(data.labels.numpy(), mnist_raw[1])


def test_mnist_source_reads_torchvision_layout_and_makes_rgb(mnist_root: Path, tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for stem in (IMAGES, LABELS):
        (raw / stem).write_bytes(gzip.decompress((mnist_root / f"{stem}.gz").read_bytes()))
    data = MNISTSource(root=str(tmp_path), split="test").load(image_size=32, channels=3)
    assert data.images.shape == (10000, 3, 32, 32)
    assert torch.equal(data.images[:, 0], data.images[:, 1]) and torch.equal(data.images[:, 0], data.images[:, 2])


def test_mnist_source_missing_or_empty_root_names_data_root(tmp_path: Path) -> None:
    for root in (None, str(tmp_path / "nowhere")):
        with pytest.raises(FileNotFoundError, match=r"data\.root"):
            MNISTSource(root=root).count()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data\.root=.*empty"):
        MNISTSource(root=str(tmp_path / "empty")).load(image_size=32, channels=1)


def test_mnist_source_without_mnist_files_names_them_and_download(tmp_path: Path, mnist_root: Path) -> None:
    (tmp_path / "readme.txt").write_text("not MNIST")
    with pytest.raises(FileNotFoundError, match=r"t10k-images-idx3-ubyte.*data\.source\.download"):
        MNISTSource(root=str(tmp_path)).load(image_size=32, channels=1)
    # only the test pair is present, but the train pair is asked for
    shutil.copy(mnist_root / f"{IMAGES}.gz", tmp_path)
    shutil.copy(mnist_root / f"{LABELS}.gz", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte.*data\.source\.download"):
        MNISTSource(root=str(tmp_path), split="train").count()
    with pytest.raises(FileNotFoundError, match=r"data\.source\.download"):
        MNISTSource(root=str(tmp_path), split="all").count()


def test_download_fetches_every_missing_split_and_data_root_as_a_file_is_named(
    tmp_path: Path, mnist_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """download=true with the test pair present fetched nothing (split=all then refused, naming download=true, which
    was set); a partly extracted CIFAR folder counted as there. A data.root that is a file "does not exist"."""
    import torchvision.datasets

    fetched = []
    monkeypatch.setattr(torchvision.datasets, "MNIST", lambda root, train, download: fetched.append(("mnist", train)))
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", lambda root, train, download: fetched.append(("cifar", root)))
    for name in (IMAGES, LABELS):
        shutil.copy(mnist_root / f"{name}.gz", tmp_path)
    MNISTSource(root=str(tmp_path / "new" / "mnist"), split="test", download=True).prepare()  # a folder to create
    assert fetched.pop() == ("mnist", False) and (tmp_path / "new" / "mnist").is_dir()
    MNISTSource(root=str(tmp_path), split="test", download=True).prepare()
    MNISTSource(root=str(tmp_path), split="all", download=True).prepare()
    (tmp_path / "cifar" / "cifar-10-batches-py").mkdir(parents=True)
    (tmp_path / "cifar" / "cifar-10-batches-py" / "test_batch").write_bytes(b"x")
    CIFAR10Source(root=str(tmp_path / "cifar"), download=True).prepare()
    assert fetched == [("mnist", True), ("cifar", str(tmp_path / "cifar"))]  # the train pair only; the archive
    for source in (
        MNISTSource(root=str(mnist_root / f"{IMAGES}.gz")),
        CIFAR10Source(root=str(mnist_root / f"{IMAGES}.gz")),
    ):
        with pytest.raises(FileNotFoundError, match=r"is a file, not a folder; point data\.root at the folder"):
            source.count()


# --- DigitsSource ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images * (255.0 / 16.0), digits.target  # (1797, 8, 8) in [0, 255]


@pytest.mark.parametrize("size", [8, 16, 32])
def test_digits_source_resizes_real_digits(size: int, sklearn_digits: tuple[np.ndarray, np.ndarray]) -> None:
    original, target = sklearn_digits
    data = DigitsSource().load(image_size=size, channels=1)
    assert data.images.shape == (1797, 1, size, size) and data.images.dtype == torch.uint8
    assert data.num_classes == 10 and sorted(data.labels.unique().tolist()) == list(range(10))
    np.testing.assert_array_equal(data.labels.numpy(), target)
    if size == 8:
        np.testing.assert_array_equal(data.images[:, 0].numpy(), np.round(original).astype(np.uint8))
    # Resampling keeps the mean intensity: overall, and per image within a few grey levels.
    assert data.images.float().mean().item() == pytest.approx(original.mean(), rel=0.02)
    per_image = data.images.float().mean(dim=(1, 2, 3)).numpy()
    assert np.abs(per_image - original.mean(axis=(1, 2))).max() < 6.0


# --- CIFAR10Source -----------------------------------------------------------------------------------


def cifar_rows() -> tuple[np.ndarray, list[int]]:
    """Three images in CIFAR's row layout: R plane (1024 bytes), G plane, B plane, each row-major 32x32."""
    data = np.zeros((3, 3072), dtype=np.uint8)
    data[0, :1024], data[0, 1024:2048], data[0, 2048:] = 200, 100, 50  # a flat colour
    data[1, 1 * 32 + 2] = 255  # red at row 1, column 2
    data[2, 2048 + 31 * 32 + 0] = 77  # blue at row 31, column 0
    return data, [3, 9, 0]


def test_cifar10_source_reads_chw_planes(write_cifar) -> None:
    root = write_cifar({"test_batch": cifar_rows()})
    data = CIFAR10Source(root=str(root), split="test").load(image_size=32, channels=None)
    assert data.images.shape == (3, 3, 32, 32) and data.images.dtype == torch.uint8
    assert data.labels.tolist() == [3, 9, 0] and data.num_classes == 10
    assert data.images[0, :, 5, 7].tolist() == [200, 100, 50]
    assert data.images[0].flatten(1).unique(dim=1).tolist() == [[200], [100], [50]]
    assert data.images[1, 0, 1, 2] == 255 and data.images[1].sum() == 255
    assert data.images[2, 2, 31, 0] == 77 and data.images[2].sum() == 77
    grey = CIFAR10Source(root=str(root), split="test").load(image_size=16, channels=1)
    assert grey.images.shape == (3, 1, 16, 16)
    assert grey.images[0].unique().tolist() == [round(0.299 * 200 + 0.587 * 100 + 0.114 * 50)]  # ITU-R 601 luma


def test_cifar10_source_all_splits_concatenate(write_cifar) -> None:
    data, _ = cifar_rows()
    batches = {f"data_batch_{i}": (data, [i] * 3) for i in range(1, 6)} | {"test_batch": (data, [0] * 3)}
    root = write_cifar(batches)
    train = CIFAR10Source(root=str(root), split="train").load(image_size=32, channels=None)
    assert train.labels.tolist() == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3 + [5] * 3
    both = CIFAR10Source(root=str(root), split="all").load(image_size=32, channels=None)
    assert len(both.images) == 18 and both.labels[-3:].tolist() == [0, 0, 0]


def test_cifar10_source_missing_batch_is_a_clear_error(write_cifar, tmp_path: Path) -> None:
    root = write_cifar({"test_batch": cifar_rows()})
    with pytest.raises(FileNotFoundError, match=r"data_batch_1.*data\.source\.download=true"):
        CIFAR10Source(root=str(root), split="train").load(image_size=32, channels=None)
    with pytest.raises(FileNotFoundError, match=r"data\.root"):
        CIFAR10Source(root=str(tmp_path / "nowhere")).count()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not a dict", "no labels"])
def test_cifar10_source_corrupt_batch_names_the_file(write_cifar, damage: str) -> None:
    root = write_cifar({"test_batch": cifar_rows()})
    path = root / "cifar-10-batches-py" / "test_batch"
    good = path.read_bytes()
    content = {
        "truncated": good[: len(good) // 2],
        "garbage": b"\x80\x02this is not a pickle at all" * 3,
        "not a dict": pickle.dumps([1, 2, 3]),
        "no labels": pickle.dumps({"data": np.zeros((1, 3072), np.uint8)}),
    }[damage]
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        CIFAR10Source(root=str(root), split="test").load(image_size=32, channels=None)


# --- ImageFolderSource -------------------------------------------------------------------------------


def save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


@pytest.fixture
def image_folder(tmp_path: Path) -> dict[str, np.ndarray]:
    """root/b_zebra/{wide,tall}.png and root/a_ant/flat.png; returns the expected 16x16 RGB crops."""
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 256, (16, 48, 3), dtype=np.uint8)  # H=16 W=48: short side already 16, crop cols 16..31
    tall = rng.integers(0, 256, (40, 16, 3), dtype=np.uint8)  # crop rows 12..27
    flat = np.zeros((64, 96, 3), dtype=np.uint8) + np.array([10, 120, 250], dtype=np.uint8)  # resized, stays flat
    save(tmp_path / "root" / "b_zebra" / "wide.png", wide)
    save(tmp_path / "root" / "b_zebra" / "tall.png", tall)
    save(tmp_path / "root" / "a_ant" / "flat.png", flat)
    (tmp_path / "root" / "a_ant" / "notes.txt").write_text("not an image")
    return {"flat": flat[:16, :16], "tall": tall[12:28], "wide": wide[:, 16:32]}


def test_image_folder_centre_crops_and_labels_by_sorted_folder(tmp_path: Path, image_folder) -> None:
    source = ImageFolderSource(root=str(tmp_path / "root"))
    assert source.count() == 3
    data = source.load(image_size=16, channels=3)
    assert data.images.shape == (3, 3, 16, 16) and data.images.dtype == torch.uint8
    # a_ant (label 0) first, then b_zebra (label 1) with its files in sorted order: tall, wide
    assert data.labels.tolist() == [0, 1, 1] and data.num_classes == 2
    for i, name in enumerate(["flat", "tall", "wide"]):
        np.testing.assert_array_equal(data.images[i].permute(1, 2, 0).numpy(), image_folder[name], err_msg=name)


def test_image_folder_grey_and_unconditional(tmp_path: Path, image_folder) -> None:
    data = ImageFolderSource(root=str(tmp_path / "root"), conditional=False).load(image_size=8, channels=1)
    assert data.images.shape == (3, 1, 8, 8)
    assert data.labels.tolist() == [0, 0, 0] and data.num_classes is None
    expected = round(0.299 * 10 + 0.587 * 120 + 0.114 * 250)  # PIL's "L" conversion of the flat colour
    assert (data.images[0].int() - expected).abs().max() <= 1


def test_image_folder_mixed_sizes_and_modes_become_data_channels(tmp_path: Path) -> None:
    """Grey (L), RGB and palette (P) files of different sizes in one folder: each is centre-cropped and resized
    to image_size, and converted to the requested channels (grey v -> (v, v, v); colour -> its luma)."""
    root = tmp_path / "mixed" / "cls"
    root.mkdir(parents=True)
    Image.new("L", (20, 12), 90).save(root / "a_grey.png")
    Image.new("RGB", (8, 30), (200, 40, 10)).save(root / "b_rgb.png")
    palette = Image.new("P", (16, 16), 0)
    palette.putpalette([0, 100, 250] + [0] * 765)
    palette.save(root / "c_palette.png")
    rgb = ImageFolderSource(root=str(tmp_path / "mixed")).load(image_size=8, channels=3)
    assert rgb.images.shape == (3, 3, 8, 8) and rgb.images.dtype == torch.uint8
    for i, colour in enumerate([(90, 90, 90), (200, 40, 10), (0, 100, 250)]):
        assert rgb.images[i].flatten(1).unique(dim=1).T.tolist() == [list(colour)]  # flat: crop/resize keep it
    grey = ImageFolderSource(root=str(tmp_path / "mixed")).load(image_size=8, channels=1)
    assert grey.images.shape == (3, 1, 8, 8)
    luma = [90, round(0.299 * 200 + 0.587 * 40 + 0.114 * 10), round(0.587 * 100 + 0.114 * 250)]
    for i, value in enumerate(luma):
        assert (grey.images[i].int() - value).abs().max() <= 1


def test_image_folder_empty_or_unreadable_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data\.root=.*empty"):
        ImageFolderSource(root=str(tmp_path / "empty")).count()
    (tmp_path / "flat" / "cls").mkdir(parents=True)
    (tmp_path / "flat" / "cls" / "readme.txt").write_text("no images here")
    with pytest.raises(FileNotFoundError, match=r"no images in class sub-folders"):
        ImageFolderSource(root=str(tmp_path / "flat")).count()
    broken = tmp_path / "broken" / "cls" / "x.png"
    save(tmp_path / "broken" / "cls" / "a.png", np.zeros((8, 8, 3), dtype=np.uint8))
    broken.write_bytes(b"\x89PNG\r\n\x1a\n but then nothing")
    with pytest.raises(ValueError, match=re.escape(str(broken))):
        ImageFolderSource(root=str(tmp_path / "broken")).load(image_size=8, channels=3)


def test_only_mnist_is_padded_other_small_images_are_resized() -> None:
    """CIFAR-10 at image_size 40 came out with a black 4-pixel border: the MNIST padding applied to any square
    image up to a quarter smaller. A uniform image resized stays uniform."""
    from ddpm.data.sources import finish

    grey = torch.full((2, 3, 32, 32), 200, dtype=torch.uint8)
    assert finish(grey, torch.zeros(2), 10, image_size=40, channels=3).images.eq(200).all()
    padded = finish(grey, torch.zeros(2), 10, image_size=40, channels=3, pad=True).images
    assert padded[:, :, :4].eq(0).all() and padded[:, :, 4:36, 4:36].eq(200).all()


def test_data_limit_decodes_only_the_images_it_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.limit=6 on a folder of 12 decoded all 12, then kept 6 (the RAM check had budgeted 6): a smoke run on a
    large folder decoded all of it, and could run out of memory after the check passed. The 6 were the first files,
    all of class c0 (the files are in class order): now a seeded sample of both classes."""
    from ddpm.data import image_folder as sources

    for i in range(12):
        save(tmp_path / "imgs" / f"c{i % 2}" / f"{i:02d}.png", np.full((8, 8, 3), i, dtype=np.uint8))
    opened = []
    monkeypatch.setattr(sources, "open_image", lambda path, *a, _open=sources.open_image, **k: opened.append(path)
                        or _open(path, *a, **k))  # fmt: skip
    dm = RAMDataModule(source=ImageFolderSource(root=str(tmp_path / "imgs")), image_size=8, channels=3, batch_size=1,
                       limit=6, val_size=1)  # fmt: skip
    dm.setup("fit")
    kept = dm.data.images[:, 0, 0, 0].tolist()
    assert len(opened) == 6 and len(set(kept)) == 6 and sorted(dm.data.labels.tolist()) == sorted(v % 2 for v in kept)
    assert set(dm.data.labels.tolist()) == {0, 1}  # the first 6 files were class c0 only
    assert dm.data.num_classes == 2 and dm._images(6) == "6 images (data.limit=6 of 12)"


def test_an_encode_with_data_limit_takes_the_images_the_pixel_run_trains_on(tmp_path: Path) -> None:
    """`python -m ddpm.data.encode data=image_folder data.limit=N` encoded the first N files (the first classes)
    after data.limit came to keep a seeded sample of every class: its latents were of other images."""
    from ddpm.data.encode_plan import FolderImages

    for i in range(15):
        save(tmp_path / "imgs" / f"c{i % 5}" / f"{i:02d}.png", np.full((8, 8, 3), i, dtype=np.uint8))
    source = ImageFolderSource(root=str(tmp_path / "imgs"))
    pixels = source.load(image_size=8, channels=3, limit=6)
    plan = FolderImages.of(source, 8, 3, 6)
    images, labels = plan.decode(plan.files)
    assert sorted(images[:, 0, 0, 0].tolist()) == sorted(pixels.images[:, 0, 0, 0].tolist())
    assert sorted(labels.tolist()) == sorted(pixels.labels.tolist())


def test_image_folder_refuses_an_empty_class_and_skips_hidden_files(tmp_path: Path) -> None:
    """An empty class folder was skipped, so every later folder took the label of the one before ('2' read as
    class 1) without a word; hidden files under a class folder (Jupyter's checkpoints, macOS's ._ files) were read
    as images of the class (a duplicate, or a load that failed on a file that is no image)."""
    for folder in ("0", "2"):
        save(tmp_path / "digits" / folder / "a.png", np.full((8, 8, 3), int(folder), dtype=np.uint8))
    (tmp_path / "digits" / "1").mkdir()
    (tmp_path / "digits" / "1" / "a.heic").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match=r"class folder\(s\) \['1'\] hold no images"):
        ImageFolderSource(root=str(tmp_path / "digits")).count()
    assert ImageFolderSource(root=str(tmp_path / "digits"), conditional=False).count() == 2  # no labels to shift
    save(tmp_path / "digits" / "1" / "a.png", np.full((8, 8, 3), 1, dtype=np.uint8))
    save(tmp_path / "digits" / "1" / ".ipynb_checkpoints" / "a-checkpoint.png", np.zeros((8, 8, 3), dtype=np.uint8))
    (tmp_path / "digits" / "2" / "._a.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    loaded = ImageFolderSource(root=str(tmp_path / "digits")).load(image_size=8, channels=3)
    assert loaded.labels.tolist() == [0, 1, 2] and loaded.images[:, 0, 0, 0].tolist() == [0, 1, 2]


# --- RAMDataModule -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSource:
    """N grey 4x4 images where image i is filled with the value i (so a batch names its rows); label i % 10."""

    n: int = 100
    dtype: torch.dtype = torch.uint8

    def prepare(self) -> None:
        pass

    def count(self) -> int:
        return self.n

    def load(self, *, image_size: int, channels: int | None, limit: int | None = None) -> ImageSet:
        n = self.n if limit is None else min(limit, self.n)
        images = torch.arange(n).to(self.dtype).view(-1, 1, 1, 1).expand(-1, 1, image_size, image_size)
        return ImageSet(images.contiguous(), torch.arange(n) % 10, 10)


def make_dm(**kwargs) -> RAMDataModule:
    args = {"source": RowSource(), "image_size": 4, "channels": 1, "batch_size": 16, "val_size": 0.1} | kwargs
    dm = RAMDataModule(**args)
    dm.setup("fit")
    return dm


def rows(images: torch.Tensor) -> list[int]:
    return images[:, 0, 0, 0].tolist()


def test_split_is_seeded_disjoint_and_complete() -> None:
    dm = make_dm()
    train, val = dm.train_set.index.tolist(), dm.val_set.index.tolist()
    assert len(val) == 10 and len(train) == 90
    assert set(train).isdisjoint(val) and sorted(train + val) == list(range(100))
    again = make_dm()
    assert again.val_set.index.tolist() == val
    other = make_dm(split_seed=1)
    assert other.val_set.index.tolist() != val
    assert len(make_dm(val_size=7).val_set) == 7
    assert len(make_dm(limit=50).train_set) + len(make_dm(limit=50).val_set) == 50


def test_loaders_drop_last_and_stay_uint8_on_the_host() -> None:
    dm = make_dm(batch_size=32)
    assert dm.num_classes == 10
    torch.manual_seed(0)
    batches = list(dm.train_dataloader())
    assert len(batches) == 2  # 90 training images, batch 32: the last 26 are dropped
    for images, labels in batches:
        assert images.shape == (32, 1, 4, 4) and images.dtype == torch.uint8 and images.device.type == "cpu"
        assert labels.dtype == torch.int64 and labels.tolist() == [r % 10 for r in rows(images)]
        assert set(rows(images)) <= set(dm.train_set.index.tolist())
    val = list(dm.val_dataloader())
    assert [len(images) for images, _ in val] == [10]
    assert rows(val[0][0]) == dm.val_set.index.tolist()  # not shuffled


def test_on_after_batch_transfer_scales_to_unit_range_exactly() -> None:
    dm = make_dm()
    images = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8).view(1, 1, 2, 3)
    labels = torch.tensor([4])
    scaled, same_labels = dm.on_after_batch_transfer((images, labels), 0)
    assert scaled.dtype == torch.float32 and same_labels is labels
    assert scaled[0, 0, 0, 0].item() == -1.0 and scaled[0, 0, 1, 2].item() == 1.0
    expected = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.float64) / 127.5 - 1
    torch.testing.assert_close(scaled.flatten().double(), expected, atol=1e-6, rtol=0)


def test_hflip_flips_only_while_training() -> None:
    dm = make_dm(hflip=True)
    images = torch.arange(64, dtype=torch.uint8).view(4, 1, 4, 4)
    unflipped, _ = dm.on_after_batch_transfer((images, torch.zeros(4)), 0)
    assert torch.equal(unflipped, images.float() / 127.5 - 1)  # no trainer: no flips
    dm.trainer = SimpleNamespace(training=True)
    torch.manual_seed(0)
    flips = []
    for _ in range(8):
        out, _ = dm.on_after_batch_transfer((images, torch.zeros(4)), 0)
        for i in range(4):
            plain, mirrored = images[i].float() / 127.5 - 1, images[i].flip(-1).float() / 127.5 - 1
            assert torch.equal(out[i], plain) or torch.equal(out[i], mirrored)
            flips.append(torch.equal(out[i], mirrored))
    assert 0 < sum(flips) < len(flips)


def test_getitems_equals_per_item_indexing_and_storage_is_shared_only_for_spawned_workers(monkeypatch) -> None:
    """The preloaded set moves to shared memory (/dev/shm) only where workers are spawned (the set is pickled to each):
    Docker's 64 MB /dev/shm could not hold CIFAR-10, and forked workers, or none, read the process's own pages."""
    dm = make_dm()
    dataset = dm.train_set
    indices = [3, 0, 7, 7, len(dataset) - 1]
    images, labels = dataset.__getitems__(indices)
    assert torch.equal(images, torch.stack([dataset[i][0] for i in indices]))
    assert torch.equal(labels, torch.stack([dataset[i][1] for i in indices]))
    assert not dm.data.images.is_shared()  # no workers
    monkeypatch.setattr("ddpm.data.ram.start_method", lambda: "fork")
    assert not make_dm(num_workers=2).data.images.is_shared()
    monkeypatch.setattr("ddpm.data.ram.start_method", lambda: "spawn")
    spawned = make_dm(num_workers=2)
    assert spawned.data.images.is_shared() and spawned.data.labels.is_shared()


def test_batch_size_larger_than_train_set_names_data_batch_size() -> None:
    with pytest.raises(ValueError, match=r"data\.batch_size=91"):
        make_dm(batch_size=91)
    make_dm(batch_size=90)  # exactly one batch is fine
    with pytest.raises(ValueError, match=r"data\.batch_size"):
        RAMDataModule(source=RowSource(), image_size=4, batch_size=0)
    with pytest.raises(ValueError, match=r"data\.val_size"):
        make_dm(val_size=100)


def test_ram_estimate_over_budget_is_a_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ram, "available_ram_bytes", lambda: 1000)
    dm = RAMDataModule(source=RowSource(), image_size=4, channels=1, batch_size=8)
    with pytest.raises(
        MemoryError, match=r"preloading 100 images.*data\.max_ram_fraction=0\.5 .*data\.image_size.*data\.limit"
    ):
        dm.setup("fit")
    assert dm.data is None
    # 100 images x 1 x 4 x 4 = 1600 bytes: fits once the budget allows it
    monkeypatch.setattr(ram, "available_ram_bytes", lambda: 3300)
    dm.setup("fit")
    assert len(dm.data.images) == 100


def test_source_returning_floats_is_rejected() -> None:
    with pytest.raises(ValueError, match="uint8"):
        make_dm(source=RowSource(dtype=torch.float32))


def test_worker_loader_matches_in_process_loader() -> None:
    in_process = make_dm(num_workers=0)
    torch.manual_seed(7)
    expected = [(images.clone(), labels.clone()) for images, labels in in_process.train_dataloader()]
    workers = make_dm(num_workers=2)
    loader = workers.train_dataloader()
    torch.manual_seed(7)
    got = list(loader)
    del loader
    assert len(got) == len(expected) == 5
    for (a, la), (b, lb) in zip(expected, got, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


# --- check_batch -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_net() -> UNet:
    return tiny_unet(image_size=16, base_channels=32, attention_resolutions=(8,), norm_groups=8, num_classes=10)


def test_check_batch_accepts_a_scaled_batch(tiny_net: UNet) -> None:
    images = torch.randint(0, 256, (4, 1, 16, 16), dtype=torch.uint8)
    check_batch((images.float() / 127.5 - 1, torch.tensor([0, 3, 9, 5])), tiny_net)


@pytest.mark.parametrize(
    ("images", "labels", "pattern"),
    [
        (torch.arange(256.0).view(1, 1, 16, 16).expand(2, -1, -1, -1), [0, 1], r"\[-1, 1\]"),  # forgot the scaling
        (torch.full((2, 1, 16, 16), float("nan")), [0, 1], r"\[-1, 1\]"),
        (torch.zeros(2, 3, 16, 16), [0, 1], r"model\.in_channels=1"),
        (torch.zeros(2, 16, 16), [0, 1], r"model\.in_channels"),
        (torch.zeros(2, 1, 32, 32), [0, 1], r"model\.image_size=16"),
        (torch.zeros(2, 1, 16, 16), [0, 10], r"model\.num_classes=10"),
        (torch.zeros(2, 1, 16, 16), [-1, 3], r"model\.num_classes=10"),
    ],
    ids=["0..255", "nan", "channels", "no-channel-dim", "size", "label-too-big", "label-negative"],
)
def test_check_batch_rejects_with_the_key_to_change(tiny_net: UNet, images, labels, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        check_batch((images, torch.tensor(labels)), tiny_net)


def test_check_batch_rejects_grey_data_for_an_rgb_model() -> None:
    net = tiny_unet(in_channels=3, num_classes=10)  # 8x8
    check_batch((torch.zeros(2, 3, 8, 8), torch.tensor([0, 1])), net)  # RGB is fine
    with pytest.raises(ValueError, match=r"model\.in_channels=3"):
        check_batch((torch.zeros(2, 1, 8, 8), torch.tensor([0, 1])), net)
