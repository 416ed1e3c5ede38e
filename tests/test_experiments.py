"""Every conf/experiment/*.yaml through the real entry points: train 2 steps, resume 1, sample from ema.pt.

Each experiment trains with its own precision, schedule, model family and data reader; only sizes shrink
(steps, intervals, image counts, grid size, and the width of the models too big for 2 CPU cores). Experiments
are found by glob, so a new one is covered as soon as its data source has a writer below (DATA_WRITERS).
"""

import csv
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import CONF, compose, run, sample, train
from omegaconf import DictConfig, OmegaConf

from ddpm.precision import resolve_precision

pytestmark = pytest.mark.slow

VAE_RUNS = {"mnist_vae"}  # train a VAE, not a diffusion model (no ema.pt to sample): tests/test_vae_training.py
EXPERIMENTS = sorted(path.stem for path in (CONF / "experiment").glob("*.yaml") if path.stem not in VAE_RUNS)

# Sizes only: 2 steps of 8 images (val and a checkpoint at step 2), a 4-image grid of 4 sampler steps.
SIZE = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "callbacks.checkpoint.every_n_train_steps=2",
    "data.limit=64",
    "data.batch_size=8",
    "data.val_size=8",
    "callbacks.sample_grid.num_samples=4",
    "callbacks.sample_grid.sampler.steps=4",
    "module.compile_backend=aot_eager",  # an experiment's compile (mnist: auto) traced, not inductor-built (minutes)
]
# Models too big for 2 CPU cores, by model config name: narrower, same levels, attention and norms.
SHRINK_MODEL = {
    "ddpm_cifar10": ["model.base_channels=32"],  # the paper's 35.7M UNet -> 2.2M (widths 32-64-64-64)
    "unet64": ["model.base_channels=32", "model.channel_mult=[1,1,2,2]"],  # 64.6M -> ~2M, still 64->8 with attn 16, 8
}
# No GPU here: experiments that pick trainer=gpu / ddp / devices > 1 train on one CPU process instead.
# Precision is left alone (gpu.yaml's bf16-mixed runs on CPU autocast as it is).
NO_GPU = ["trainer.accelerator=cpu", "trainer.devices=1", "trainer.strategy=auto"]


def write_digit_images(root: Path, per_class: int = 12, classes: int = 3) -> Path:
    """root/class_<k>/<i>.png|jpg: scikit-learn's real digits, coloured and upscaled to non-square 48x40."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for k in range(classes):
        folder = root / f"class_{k}"
        folder.mkdir(parents=True, exist_ok=True)
        for i, index in enumerate(np.flatnonzero(digits.target == k)[:per_class]):
            grey = (digits.images[index] * (255 / 16)).astype(np.uint8)
            rgb = np.stack([grey, grey[::-1], 255 - grey], axis=-1)  # three different planes
            image = Image.fromarray(rgb).resize((48, 40), Image.Resampling.BILINEAR)
            image.save(folder / f"{i:03d}.{'png' if i % 2 else 'jpg'}")
    return root


def cifar_batches(images_per_batch: int = 24) -> dict[str, tuple[np.ndarray, list[int]]]:
    """data_batch_1..5 and test_batch of real digits as 32x32 RGB rows (1024 R, 1024 G, 1024 B bytes)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    planes = torch.from_numpy(digits.images).float().mul(255 / 16)[:, None]  # (1797, 1, 8, 8)
    big = torch.nn.functional.interpolate(planes, size=(32, 32), mode="bilinear").round().clamp(0, 255)
    rgb = torch.cat([big, big.flip(-1), 255 - big], dim=1).to(torch.uint8).numpy()  # (1797, 3, 32, 32)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    batches = {}
    for j, name in enumerate(names):
        rows = slice(j * images_per_batch, (j + 1) * images_per_batch)
        batches[name] = (rgb[rows].reshape(-1, 3072), digits.target[rows].tolist())
    return batches


# The pixels a latent experiment's VAE encodes (channels, side), by experiment: its latents are model.in_channels x
# model.image_size, so the VAE downsamples side / model.image_size times.
LATENT_PIXELS = {"mnist_latent": (1, 32), "imagenet256_latent": (3, 256)}


def encoded_root(experiment: str, model: DictConfig, folder: Path) -> str:
    """64 of scikit-learn's digits encoded (python -m ddpm.data.encode) by a tiny random AutoencoderKL whose latents
    have the experiment's shape: the folder data=latents reads."""
    from ddpm.models.vae import VAE

    channels, side = LATENT_PIXELS[experiment]
    levels = int(math.log2(side // model.image_size)) + 1
    torch.manual_seed(0)
    VAE.from_config(dict(in_channels=channels, out_channels=channels, down_block_types=["DownEncoderBlock2D"] * levels,
                         up_block_types=["UpDecoderBlock2D"] * levels, block_out_channels=[8] * levels,
                         layers_per_block=1, latent_channels=model.in_channels, norm_num_groups=4, sample_size=side)
                    ).autoencoder.save_pretrained(folder / "vae")  # fmt: skip
    run("python", "-m", "ddpm.data.encode", f"vae={folder / 'vae'}", f"out={folder / 'latents'}", "data=digits",
        f"data.image_size={side}", "data.limit=64")  # fmt: skip
    return str(folder / "latents")


def data_root(source: str, request: pytest.FixtureRequest, folder: Path) -> str | None:
    """Write (or find) a tiny dataset in the on-disk format `source` reads; its data.root (None: no root)."""
    if source == "DigitsSource":
        return None  # bundled with scikit-learn
    if source == "MNISTSource":
        return str(request.getfixturevalue("mnist_root"))  # the real MNIST test set
    if source == "CIFAR10Source":
        return str(request.getfixturevalue("write_cifar")(cifar_batches(), root=folder / "cifar"))
    if source == "ImageFolderSource":
        return str(write_digit_images(folder / "images"))
    raise NotImplementedError(f"no tiny-dataset writer for data.source {source}: add one to data_root()")


@dataclass(frozen=True)
class Run:
    """An experiment's 2-step run: its directory, the overrides it used (all but run dir and max_steps)."""

    experiment: str
    dir: Path
    overrides: list[str]
    image_size: int
    channels: int
    conditional: bool
    precision: str  # the experiment's trainer.precision, resolved for this CPU (auto -> bf16-mixed or 32-true)
    config: dict  # the experiment's own optim, ema and diffusion settings, as composed
    pixels: tuple[int, int]  # what sample.py writes: (side, channels); a latent model's decoded by its VAE
    auto_precision: bool  # the experiment's trainer.precision is auto


def train_experiment(experiment: str, request: pytest.FixtureRequest, folder: Path) -> Run:
    composed = compose("train", [f"experiment={experiment}", "paths.output_dir=unused"], return_hydra_config=True)
    choices = composed.hydra.runtime.choices
    trainer = composed.trainer
    overrides = [f"experiment={experiment}", *SIZE, *SHRINK_MODEL.get(choices.model, [])]
    if trainer.accelerator in ("gpu", "cuda") or trainer.strategy != "auto" or trainer.devices not in (1, "auto"):
        overrides += NO_GPU
    if composed.data._target_ == "ddpm.data.latents.LatentDataModule":
        root = encoded_root(experiment, composed.model, folder / "data")
    else:
        root = data_root(composed.data.source._target_.rsplit(".", 1)[-1], request, folder / "data")
    if root is not None:
        overrides.append(f"data.root={root}")
    run_dir = folder / "run"
    train(*overrides, f"hydra.run.dir={run_dir}")
    return Run(
        experiment=experiment,
        dir=run_dir,
        overrides=overrides,
        image_size=composed.model.image_size,
        channels=composed.model.in_channels,
        conditional=composed.model.num_classes is not None,
        precision=resolve_precision(trainer.precision, "cpu"),
        config={key: OmegaConf.to_container(composed[key]) for key in ("optim", "ema", "diffusion")},
        pixels=LATENT_PIXELS[experiment][::-1]
        if experiment in LATENT_PIXELS
        else (composed.model.image_size, composed.model.in_channels),
        auto_precision=trainer.precision == "auto",
    )


@pytest.fixture(scope="module")
def trained_runs() -> dict[str, Run | Exception]:
    return {}


@pytest.fixture
def trained(
    experiment: str,
    request: pytest.FixtureRequest,
    trained_runs: dict[str, Run | Exception],
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    """The experiment's 2-step run, trained once per module by whichever test asks first (failures too)."""
    if experiment not in trained_runs:
        try:
            trained_runs[experiment] = train_experiment(experiment, request, tmp_path_factory.mktemp(experiment))
        except Exception as error:
            trained_runs[experiment] = error
            raise
    run = trained_runs[experiment]
    if isinstance(run, Exception):
        pytest.fail(f"experiment={experiment} failed to train (see the first test that trained it): {run}"[:2000])
    return run


def global_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def test_experiments_are_discovered() -> None:
    assert {"digits", "mnist", "cifar10", "imagenet64"} <= set(EXPERIMENTS), EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_trains_two_steps_with_its_own_settings(trained: Run) -> None:
    """2 steps at the experiment's own (resolved) precision, LR, EMA and diffusion: checkpoint, EMA export, grid."""
    saved = yaml.safe_load((trained.dir / "config.yaml").read_text())
    own = trained.config
    assert saved["trainer"]["precision"] == trained.precision
    assert (saved["optim"]["lr"], saved["ema"]["decay"]) == (own["optim"]["lr"], own["ema"]["decay"])
    assert saved["diffusion"] == own["diffusion"]  # family (_target_), schedule or noise levels, every setting
    assert (saved["model"]["image_size"], saved["model"]["in_channels"]) == (trained.image_size, trained.channels)
    assert global_step(trained.dir / "checkpoints" / "last.ckpt") == 2
    assert (trained.dir / "ema.pt").is_file()
    assert (trained.dir / "samples" / "step_0000002.png").is_file()
    with (trained.dir / "csv" / "metrics.csv").open() as f:
        val_losses = [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]
    assert val_losses and all(math.isfinite(v) for v in val_losses), val_losses
    if trained.auto_precision:  # what `auto` chose on this machine is said, as compile=auto's choice is
        assert f"trainer.precision=auto: {trained.precision} on this cpu" in (trained.dir / "train.log").read_text()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_resumes_from_last_ckpt(trained: Run, tmp_path: Path) -> None:
    """ckpt_path=<run>/checkpoints/last.ckpt trainer.max_steps=3: one more step, same settings otherwise."""
    resumed = tmp_path / "resumed"
    overrides = [o for o in trained.overrides if not o.startswith("trainer.max_steps=")]
    train(*overrides, "trainer.max_steps=3", f"ckpt_path={trained.dir / 'checkpoints' / 'last.ckpt'}",
          f"hydra.run.dir={resumed}")  # fmt: skip
    assert global_step(resumed / "checkpoints" / "last.ckpt") == 3
    record = yaml.safe_load((resumed / "resume_diff.yaml").read_text())
    assert record["global_step"] == 2
    # Only max_steps changed (besides paths inside the run directories).
    changed = {k for k, v in record["changed"].items() if not str(v["checkpoint"]).startswith(str(trained.dir))}
    assert changed == {"trainer.max_steps"}, record["changed"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_samples_from_ema_export(trained: Run, tmp_path: Path) -> None:
    """sample.py on <run>/ema.pt: 4 uint8 images (N, H, W, C) of the experiment's size and channels."""
    out = tmp_path / "samples"
    sample(f"ckpt={trained.dir / 'ema.pt'}", "num_samples=4", "sampler.steps=4", f"output_dir={out}",
           f"hydra.run.dir={out}")  # fmt: skip
    with np.load(out / "samples.npz") as saved:
        images, labels = saved["images"], saved["labels"]
    assert images.dtype == np.uint8
    assert images.shape == (4, trained.pixels[0], trained.pixels[0], trained.pixels[1])
    assert labels.tolist() == ([0, 1, 2, 3] if trained.conditional else [-1] * 4)
    assert (out / "grid.png").is_file()


def test_cifar_writer_matches_the_release_layout(write_cifar) -> None:
    """The CIFAR-10 folder above is what CIFAR10Source reads: 5 train batches, test_batch, RGB planes."""
    from ddpm.data.sources import CIFAR10Source

    batches = cifar_batches(images_per_batch=4)
    root = write_cifar(batches)
    loaded = CIFAR10Source(root=str(root), split="train").load(image_size=32, channels=3)
    assert loaded.images.shape == (20, 3, 32, 32)
    first = batches["data_batch_1"][0][0]
    np.testing.assert_array_equal(loaded.images[0].numpy().reshape(-1), first)
    with (root / "cifar-10-batches-py" / "test_batch").open("rb") as f:
        assert len(pickle.load(f, encoding="latin1")["labels"]) == 4
