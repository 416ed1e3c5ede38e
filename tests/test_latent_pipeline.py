"""Latent diffusion end to end, as a user runs it (issue 38): a tiny random AutoencoderKL saved to a folder; digits
encoded with `python -m ddpm.data.encode`; `python train.py data=latents` on them; `python sample.py` draws decoded
images; `python -m ddpm.export` writes unet, scheduler and VAE in one folder, and diffusers alone samples it in a
process where `import ddpm` fails. The decoder's images equal diffusers' own decode of the same latents, and a model
is never decoded with another VAE than its latents were encoded with."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, env, run, sample, train
from PIL import Image

from ddpm.models.vae import VAE

pytest.importorskip("diffusers")
pytestmark = pytest.mark.slow

TINY_VAE = dict(in_channels=1, out_channels=1, down_block_types=["DownEncoderBlock2D"] * 2,
                up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                latent_channels=2, norm_num_groups=4, sample_size=16)  # fmt: skip  # 1x16x16 -> 2x8x8
LATENT_MODEL = ["model=unet_tiny", "model.in_channels=2", "model.image_size=8", "model.num_classes=10",
                "model.attention_resolutions=[4]", "diffusion=linear", "diffusion.num_timesteps=100"]  # fmt: skip
SHORT = ["data.batch_size=16", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "callbacks.checkpoint.every_n_train_steps=2", "callbacks.sample_grid.every_n_steps=4",
         "callbacks.sample_grid.num_samples=4", "callbacks.sample_grid.sampler.steps=2"]  # fmt: skip


def save_vae(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    VAE.from_config(TINY_VAE).autoencoder.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Encode 160 digits with a tiny VAE, train a latent model on them for 4 steps: its run folder."""
    root = tmp_path_factory.mktemp("latent")
    vae = save_vae(root / "vae", seed=0)
    run("python", "-m", "ddpm.data.encode", f"vae={vae}", f"out={root / 'latents'}", "data.image_size=16",
        "data.limit=160", "samples_per_shard=64")  # fmt: skip
    train("data=latents", f"data.root={root / 'latents'}", *LATENT_MODEL, *SHORT, f"hydra.run.dir={root / 'run'}")
    return root / "run"


def test_a_run_on_latents_records_its_vae_and_its_grids_are_decoded(run_dir: Path) -> None:
    config = torch.load(run_dir / "ema.pt", weights_only=True)["config"]
    latent = config["latent"]
    assert latent["vae_identity"] == VAE.load(latent["vae"]).identity and latent["latent_shape"] == [2, 8, 8]
    grid = np.asarray(Image.open(run_dir / "samples" / "step_0000004.png"))
    assert grid.shape[:2] == (16 + 2 * 2, 4 * (16 + 2) + 2)  # 4 decoded 16x16 images in a row, 2-pixel borders


def test_the_metrics_reference_of_a_latent_run_is_the_pixel_source_its_latents_were_encoded_from(run_dir: Path) -> None:
    """sample.py metrics=[...] compare with the run's training images: a latent run's are the encoded pixels, whose
    source the run config's latent record keeps (before: the record had none, and every latent run's metrics failed
    after the images were drawn). A run config without one is refused (sample.py: before any image is drawn)."""
    from ddpm.sampling.run import training_source

    config = torch.load(run_dir / "ema.pt", weights_only=True)["config"]
    assert training_source(config)["_target_"] == "ddpm.data.sources.DigitsSource"
    del config["latent"]["data"]  # a latent run of an older version
    with pytest.raises(ValueError, match=r"no `source` reader .*a latent run"):
        training_source(config)


def test_the_lr_range_test_runs_on_latents(tmp_path: Path) -> None:
    """tune=lr_find on data=latents checks its batches as latents (before: as pixels, and latents beyond [-1, 1],
    here with a scaling factor of 20, were refused: 'a batch after scaling spans [...], not [-1, 1]')."""
    vae = save_vae(tmp_path / "vae", seed=0)
    config = json.loads((vae / "config.json").read_text())
    (vae / "config.json").write_text(json.dumps(config | {"scaling_factor": 20.0}))
    run("python", "-m", "ddpm.data.encode", f"vae={vae}", f"out={tmp_path / 'latents'}", "data.image_size=16",
        "data.limit=64")  # fmt: skip
    train("data=latents", f"data.root={tmp_path / 'latents'}", *LATENT_MODEL, "data.batch_size=16", "tune=lr_find",
          "tune.lr_find.num_steps=5", f"hydra.run.dir={tmp_path / 'lr'}")  # fmt: skip
    assert (tmp_path / "lr" / "lr_find.json").is_file()


def test_sample_py_decodes_through_the_recorded_vae_and_refuses_another(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "samples"
    result = sample(f"ckpt={run_dir / 'ema.pt'}", "num_samples=4", "sampler.steps=3", f"output_dir={out}")
    images = np.load(out / "samples.npz")["images"]
    assert images.shape == (4, 16, 16, 1) and images.dtype == np.uint8, result.stdout[-500:]
    other = save_vae(tmp_path / "other_vae", seed=1)
    refused = sample(f"ckpt={run_dir / 'ema.pt'}", "num_samples=4", f"vae={other}", f"output_dir={tmp_path / 'x'}",
                     check=False)  # fmt: skip
    assert refused.returncode != 0 and f"vae={other} holds the VAE" in refused.stderr
    assert not (tmp_path / "x" / "samples.npz").exists()


def test_our_decoder_equals_diffusers_own_decode(run_dir: Path) -> None:
    """z_d -> pixels through ddpm's VAE.decode and through diffusers' AutoencoderKL alone, z = z_d / scale + shift."""
    from diffusers import AutoencoderKL

    folder = torch.load(run_dir / "ema.pt", weights_only=True)["config"]["latent"]["vae"]
    ours = VAE.load(folder)
    theirs = AutoencoderKL.from_pretrained(folder).eval()
    z_d = torch.randn(3, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs.decode(z_d / theirs.config.scaling_factor + (theirs.config.shift_factor or 0)).sample
    torch.testing.assert_close(ours.decode(z_d), expected.clamp(-1, 1))


def readme_loop() -> str:
    """README's diffusers-only loop for a latent export (the python block after its "decodes latents" paragraph),
    on the folder in argv[1], in a process where `import ddpm` fails; it prints the images' shape."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"decodes latents.*?```python\n(.*?)```", readme, flags=re.S)
    assert block, "README.md lost its diffusers-only loop for latent exports"
    code = block.group(1).replace('folder = "exports/latent"', "folder = sys.argv[1]")
    assert "sys.argv[1]" in code, code
    return 'import sys\nsys.modules["ddpm"] = None\n' + code + "print(tuple(images.shape))\n"


def test_export_holds_unet_scheduler_and_vae_and_diffusers_alone_samples_it(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    said = run("python", "-m", "ddpm.export", f"ckpt={run_dir / 'ema.pt'}", f"out={out}").stdout
    assert "DDPMPipeline would return latents" in said and "README.md's 'Latent diffusion' loop" in said
    index = json.loads((out / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"] and index["unet"] == ["diffusers", "UNet2DModel"]
    assert json.loads((out / "scheduler" / "scheduler_config.json").read_text())["clip_sample"] is False  # latents
    assert VAE.load(out / "vae").identity == torch.load(run_dir / "ema.pt", weights_only=True)["config"]["latent"][
        "vae_identity"]  # fmt: skip
    result = subprocess.run([sys.executable, "-c", readme_loop(), str(out)], env=env(), capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "(4, 1, 16, 16)"
    drawn = sample(f"ckpt={out}", "num_samples=2", "sampler.steps=2", f"output_dir={tmp_path / 's'}")
    assert np.load(tmp_path / "s" / "samples.npz")["images"].shape == (2, 16, 16, 1), drawn.stdout[-300:]


def test_a_run_whose_vae_moved_is_refused_before_its_first_step(tmp_path: Path) -> None:
    """The sample grid and FID decode through meta.json's VAE folder. Moved or replaced, that was found at the first
    grid (for mnist_latent the last step), losing the steps since the last checkpoint and ema.pt."""
    from ddpm.data.latents import check_decoder_folder, latent_record

    vae = save_vae(tmp_path / "vae", seed=0)
    run("python", "-m", "ddpm.data.encode", f"vae={vae}", f"out={tmp_path / 'latents'}", "data.image_size=16",
        "data.limit=64")  # fmt: skip
    record = latent_record({"_target_": "ddpm.data.latents.LatentDataModule", "root": str(tmp_path / "latents")})
    grid = {"sample_grid": {"_target_": "ddpm.callbacks.sample_grid.SampleGrid"}, "fid": None}
    check_decoder_folder(record, grid)
    save_vae(tmp_path / "vae", seed=1)  # another VAE in its place
    with pytest.raises(
        ValueError, match=r"callbacks.sample_grid decode .* now holds the VAE \w+, not " + record["vae_identity"]
    ):
        check_decoder_folder(record, grid)
    check_decoder_folder(record, {"sample_grid": None})  # nothing decodes: nothing to check
    shutil.rmtree(tmp_path / "vae")
    refused = train("data=latents", f"data.root={tmp_path / 'latents'}", *LATENT_MODEL, *SHORT,
                    f"hydra.run.dir={tmp_path / 'run'}", check=False)  # fmt: skip
    assert refused.returncode != 0 and "holds no config.json: put that VAE folder back" in refused.stderr
    assert "callbacks.sample_grid=null" in refused.stderr and not (tmp_path / "run" / "checkpoints").exists()
