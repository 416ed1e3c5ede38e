"""Training a VAE here (issue 38): `python train.py experiment=mnist_vae`, shrunk, through the project's Trainer and
callbacks; its resume; the diffusers folder <run>/vae/ it writes (diffusers alone loads it, ddpm.models.vae.VAE reads
its scaling), checked against independent computations."""

import csv
import json
import re
import shutil
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import train
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from ddpm.callbacks.sample_grid import SampleGrid
from ddpm.data.ram import RAMDataModule
from ddpm.data.sources import DigitsSource
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.models.autoencoder import autoencoder_kl, vae_loss
from ddpm.models.unet import UNet
from ddpm.models.vae import VAE
from ddpm.module import DiffusionModule
from ddpm.optim import AdamW
from ddpm.vae_module import VAEModule, training_images
from ddpm.weights.model import CHECKPOINT_KEY

diffusers = pytest.importorskip("diffusers", reason="the VAE is diffusers' AutoencoderKL (the diffusers extra)")

TINY = dict(in_channels=1, image_size=8, block_out_channels=[8, 8], norm_num_groups=4)  # 8x8 -> 4x4x4 latents
SHRUNK = [  # experiment=mnist_vae in seconds: the bundled digits at 8x8, a 2-level VAE, a checkpoint every 2 steps
    "experiment=mnist_vae",
    "data=digits",
    "data.limit=128",
    "data.batch_size=16",
    "data.val_size=16",
    "model.image_size=8",
    "model.block_out_channels=[8,8]",
    "model.norm_num_groups=4",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint.every_n_train_steps=2",
    "callbacks.vae_grid.every_n_steps=2",
    "callbacks.vae_grid.num_images=4",
    "callbacks.progress_bar=null",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps in bf16-mixed, then resumed in place to step 6 in float32 with the loss compiled (eager backend),
    returning the reconstruction error as its objective."""
    folder = tmp_path_factory.mktemp("vae") / "run"
    train(*SHRUNK, "trainer.max_steps=4", "trainer.precision=bf16-mixed", f"hydra.run.dir={folder}")
    first = json.loads((folder / "vae" / "config.json").read_text())
    (folder / "first_vae_config.json").write_text(json.dumps(first))
    train(*SHRUNK, "trainer.max_steps=6", "trainer.precision=32-true", "compile=true", "module.compile_backend=eager",
          "objective=val/rec", f"ckpt_path={folder}", f"hydra.run.dir={folder}")  # fmt: skip
    return folder


def training_split(folder: Path) -> torch.Tensor:
    """The run's training split (uint8), rebuilt from its saved config."""
    data = instantiate(OmegaConf.load(folder / "config.yaml").data)
    data.setup("validate")
    return data.train_set.images[data.train_set.index]


def metrics(folder: Path) -> list[dict[str, str]]:
    """The rows of every metrics*.csv of the run (a resume in place keeps the first part as metrics-<time>.csv)."""
    rows = []
    for path in sorted((folder / "csv").glob("metrics*.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


@pytest.mark.slow
def test_trains_resumes_and_logs_through_the_project_callbacks(run: Path) -> None:
    rows = metrics(run)
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"val/loss", "val/rec", "val/kl", "train/loss", "train/rec", "train/kl"} <= logged
    assert {"train/grad_norm", "train/images_per_sec", "train/skipped_steps"} <= logged  # monitor, NaN guard
    assert sorted(int(r["step"]) for r in rows if r.get("val/loss")) == [1, 3, 5]  # val at steps 2, 4, 6
    assert all(float(r["val/loss"]) > float(r["val/rec"]) for r in rows if r.get("val/loss"))  # + the KL term
    result = json.loads((run / "result.json").read_text())  # objective=val/rec (was refused: "not a metric")
    assert result["val/rec"] == pytest.approx(float([r["val/rec"] for r in rows if r.get("val/rec")][-1]), rel=1e-6)
    resumed = (run / "resume_diff.yaml").read_text()
    assert "global_step: 4" in resumed and "trainer.precision" in resumed and "compile" in resumed
    assert {p.name for p in (run / "checkpoints").glob("*.ckpt")} >= {"step_0000004.ckpt", "step_0000006.ckpt"}
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    config = OmegaConf.load(run / "config.yaml")
    assert config.module._target_ == "ddpm.vae_module.VAEModule" and "diffusion" not in config
    assert not (run / "ema.pt").exists()  # a VAE run exports <run>/vae/ only


@pytest.mark.slow
def test_grid_rows_are_originals_reconstructions_and_decoded_noise(run: Path) -> None:
    grids = sorted((run / "samples").glob("step_*.png"))
    assert [g.name for g in grids] == [f"step_{s:07d}.png" for s in (2, 4, 6)]
    image = Image.open(grids[-1])
    pad, size = 2, 8  # write_grid's border, the images' side
    assert image.size == (4 * (size + pad) + pad, 3 * (size + pad) + pad)  # 4 images per row, 3 rows
    held_out = instantiate(OmegaConf.load(run / "config.yaml").data)
    held_out.setup("validate")
    first = held_out.val_set.images[held_out.val_set.index[0]][0]  # (8, 8) uint8: the grid's first original
    grey = torch.from_numpy(np.array(image.convert("L")))
    assert torch.equal(grey[pad : pad + size, pad : pad + size], first)


@pytest.mark.slow
def test_vae_folder_holds_the_ema_weights_and_diffusers_loads_it_alone(run: Path) -> None:
    autoencoder = diffusers.AutoencoderKL.from_pretrained(str(run / "vae"))
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    ema, live = checkpoint[CHECKPOINT_KEY], checkpoint["state_dict"]
    saved = autoencoder.state_dict()
    assert saved.keys() == ema.keys()
    for key, value in saved.items():
        torch.testing.assert_close(value, ema[key], rtol=0, atol=0)
    assert any(not torch.equal(saved[k], live[f"net.{k}"]) for k in saved)  # the average, not the last weights
    first = json.loads((run / "first_vae_config.json").read_text())
    assert first["scaling_factor"] != autoencoder.config.scaling_factor  # the resumed run wrote it again
    from ddpm.weights import load_model
    from ddpm.weights.model import CheckpointError

    for path, said in ((run / "checkpoints" / "last.ckpt", "a VAE run's (module=vae)"),  # sample.py's loader
                       (run / "vae", "holds one diffusers model")):  # fmt: skip  # before: "no run config"
        with pytest.raises(CheckpointError, match=r".*".join(map(re.escape, (said, "python -m ddpm.data.encode")))):
            load_model(path)


@pytest.mark.slow
def test_scaling_is_one_over_the_std_of_the_training_latents(run: Path) -> None:
    autoencoder = diffusers.AutoencoderKL.from_pretrained(str(run / "vae")).eval()
    images = training_split(run)
    with torch.no_grad():  # independently of ddpm: diffusers' encoder on the scaled images, torch's std
        means = autoencoder.encode(images.float() / 127.5 - 1).latent_dist.mean.double()
    config = autoencoder.config
    assert config.scaling_factor == pytest.approx(1 / means.std(unbiased=False).item(), rel=1e-5)
    assert config.shift_factor == pytest.approx(means.mean().item(), rel=1e-5, abs=1e-7)
    vae = VAE.load(run / "vae")
    assert (vae.scale, vae.shift) == (config.scaling_factor, config.shift_factor)
    z = vae.to_diffusion(*vae.encode(images)).double()  # the posterior means as the diffusion model sees them
    assert z.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert z.std(correction=0).item() == pytest.approx(1.0, rel=1e-5)
    assert vae.latent_shape(8) == (4, 4, 4) and vae.decode(z[:2].float()).shape == (2, 1, 8, 8)


def test_loss_is_the_reconstruction_error_plus_the_weighted_kl() -> None:
    torch.manual_seed(0)
    net = autoencoder_kl(**TINY)
    x, noise = torch.rand(3, 1, 8, 8) * 2 - 1, torch.randn(3, 4, 4, 4)
    loss, rec, kl = vae_loss(net, x, noise, kl_weight=0.5, reconstruction="l2")
    posterior = net.encode(x).latent_dist
    q = torch.distributions.Normal(posterior.mean, posterior.std)
    expected_kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0)).sum((1, 2, 3)).mean()
    x_hat = net.decode(posterior.mean + posterior.std * noise).sample
    expected_rec = torch.nn.functional.mse_loss(x_hat, x)
    torch.testing.assert_close(kl, expected_kl.detach())
    torch.testing.assert_close(rec, expected_rec.detach())
    torch.testing.assert_close(loss, (expected_rec + 0.5 * expected_kl / 64).detach())  # per pixel value: 1 x 8 x 8
    l1 = vae_loss(net, x, noise, kl_weight=0.0, reconstruction="l1")
    torch.testing.assert_close(l1[0], torch.nn.functional.l1_loss(x_hat, x).detach())


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"image_size=10 is not divisible by 4 .*block_out_channels"):
        autoencoder_kl(**(TINY | {"image_size": 10, "block_out_channels": [8, 8, 8]}))
    with pytest.raises(ValueError, match=r"norm_num_groups=3 must divide every width"):
        autoencoder_kl(**(TINY | {"norm_num_groups": 3}))
    optim = AdamW(lr=1e-3, warmup_steps=0)
    with pytest.raises(ValueError, match=r"diffusion=null"):
        VAEModule(net=autoencoder_kl(**TINY), optim=optim, diffusion=object())
    with pytest.raises(ValueError, match=r"model builds UNet; use a VAE model config \(model=vae_mnist\)"):
        unet = UNet(
            in_channels=1, image_size=8, base_channels=8, channel_mult=(1,), attention_resolutions=(), norm_groups=4
        )
        VAEModule(net=unet, optim=optim)
    for parts in [dict(net=autoencoder_kl(**TINY), diffusion=GaussianDiffusion(num_timesteps=100)), dict(net=unet)]:
        with pytest.raises(ValueError, match=r"model (AutoencoderKL|UNet) and diffusion (GaussianDiffusion|NoneType): "
                           r"train a VAE with module=vae \(experiment=mnist_vae\)"):  # fmt: skip
            DiffusionModule(**parts, optim=optim)  # model=vae_mnist alone; experiment=mnist_vae module=diffusion


@pytest.mark.slow
def test_the_lr_range_test_runs_on_a_vae_and_the_memory_estimate_says_it_has_no_diffusion(tmp_path: Path) -> None:
    """tune=lr_find and python -m ddpm.memory with experiment=mnist_vae (diffusion: null): before, both failed with
    "Key 'diffusion' is not in struct"."""
    from ddpm.memory import main as memory

    train("experiment=mnist_vae", "data=digits", "data.image_size=16", "data.channels=1", "data.limit=64",
          "data.batch_size=16", "tune=lr_find", "tune.lr_find.num_steps=5", f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert json.loads((tmp_path / "lr_find.json").read_text())["suggested_lr"] > 0
    with pytest.raises(SystemExit, match="diffusion=null"):
        memory(["experiment=mnist_vae"])


def test_a_diffusion_sample_grid_is_refused_before_the_first_step(tmp_path: Path) -> None:
    module = VAEModule(net=autoencoder_kl(**TINY), optim=AdamW(lr=1e-3, warmup_steps=0))
    data = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, limit=64, batch_size=16)
    grid = SampleGrid(sampler=DDPMSampler(steps=2))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, callbacks=[grid], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"\['SampleGrid'\] sample a diffusion model.*callbacks=vae"):
        trainer.fit(module, datamodule=data)


def test_scaling_images_are_the_training_split_in_order() -> None:
    data = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, limit=100, val_size=10, batch_size=16)
    data.setup("validate")
    split = data.train_set.images[data.train_set.index]  # 90 images, the held-out 10 excluded
    torch.testing.assert_close(torch.cat(list(training_images(data, None, batch_size=32))), split, rtol=0, atol=0)
    first = list(training_images(data, 40, batch_size=32))  # module.scaling_images=40
    assert [len(b) for b in first] == [32, 8] and torch.equal(torch.cat(first), split[:40])


@pytest.mark.slow
def test_a_vae_run_stopped_while_writing_its_folder_is_told_how_to_write_it(run: Path, tmp_path: Path) -> None:
    """Resumed at its last step, a run is refused (nothing to train). The refusal sent a VAE run to its ema.pt and
    python -m ddpm.export, which a VAE run has not and which does not read a VAE; the fix it names now writes vae/."""
    copy = shutil.copytree(run, tmp_path / "run")
    shutil.rmtree(copy / "vae")  # killed in write_exports
    refused = train(*SHRUNK, "trainer.max_steps=6", f"ckpt_path={copy}", f"hydra.run.dir={copy}", check=False)
    assert refused.returncode != 0 and "trainer.max_steps=7 trains one step and writes it" in refused.stderr
    train(*SHRUNK, "trainer.max_steps=7", f"ckpt_path={copy}", f"hydra.run.dir={copy}")
    assert json.loads((copy / "vae" / "config.json").read_text())["scaling_factor"] > 0


@pytest.mark.slow
def test_a_vae_run_fine_tunes_from_a_vae_folder_or_a_vae_runs_checkpoint(run: Path, tmp_path: Path) -> None:
    """init_from in a module=vae run (a pretrained AutoencoderKL folder, or a VAE run's): refused before, with
    advice about sampling. The weights are the folder's, or the checkpoint's EMA; a model that does not fit them
    is refused naming its keys."""
    from ddpm.weights.init import load_init
    from ddpm.weights.model import CheckpointError

    folder = diffusers.AutoencoderKL.from_pretrained(str(run / "vae"))
    ema = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]
    for source, expected in [(run / "vae", folder.state_dict()), (run / "checkpoints" / "last.ckpt", ema)]:
        net = autoencoder_kl(**TINY)
        load_init(source, net, {})
        assert all(torch.equal(net.state_dict()[k], v) for k, v in expected.items()), source
    wider = autoencoder_kl(**(TINY | {"block_out_channels": [8, 16]}))
    for source in (run / "vae", run / "checkpoints" / "last.ckpt"):
        with pytest.raises(CheckpointError, match=r"model.block_out_channels \(file \[8, 8\], run \[8, 16\]\);"):
            load_init(source, wider, {})
    train(*SHRUNK, "trainer.max_steps=1", f"init_from={run / 'vae'}", f"hydra.run.dir={tmp_path}")
    assert "init_from: the weights of" in (tmp_path / "train.log").read_text()
