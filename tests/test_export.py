"""Interoperability: the adapter diffusers folder, the export command and ema.safetensors, checked against diffusers.

python -m ddpm.export writes diffusers' own UNet2DModel where it can (tests/test_diffusers_native.py) and falls back
to the adapter folder (our UNet in a diffusers ModelMixin) where it cannot; here the adapter folder
(export_diffusers(adapter=True)) is loaded by diffusers' own from_pretrained and sampled by its own pipelines and
schedulers; from the same initial noise (the same torch.Generator seed as our generate()) the images equal ours:

- DDIMPipeline (S=10 dividing T=1000, eta=0, use_clipped_model_output=True, trailing) and a hand-written
  DDIMScheduler loop against our sampler=ddim; DDPMPipeline on all T=50 timesteps against our sampler=ddpm
  (the same generator, so the same per-step noise); eps and v models; a guided loop against guidance=2.
  diffusers keeps alpha_bar in float32, ours float64: the floats differ by up to ~7e-6 (asserted: 1e-4), so
  a uint8 pixel near a rounding boundary could flip: asserted at most 1 level on at most 0.5% of pixels
  (MAX_LEVELS / MAX_DIFFERING); measured 0 levels on every pixel. With our float64 alpha_bar swapped into
  DDIMScheduler the final x agrees to 1e-5 (the difference is the table, nothing else).
- The folder round-trips through save_pretrained / from_pretrained with equal weights and scheduler config.
- ema.safetensors round-trips; foreign or damaged files raise CheckpointError naming the file.

The network is the tests' tiny UNet with every weight drawn from N(0, 0.25) and the output conv scaled so that
eps / v are O(1): samples depend on every tensor, and clipping of x0 matters.
"""

import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import TINY_RUN, run, sample, tiny_unet, tiny_unet_config, train
from safetensors.torch import save_file

from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.diffusion.generate import batch_seed, denoiser_for, generate, to_uint8
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.export import main
from ddpm.weights import CheckpointError, load_model
from ddpm.weights.diffusers_folder import export_diffusers, load_export, scheduler_config
from ddpm.weights.safetensors_file import (
    CONFIG_KEY,
    FORMAT,
    load_ema_safetensors,
    load_safetensors_model,
    read_metadata,
    save_ema_safetensors,
)
from ddpm.weights.torch_file import export_ema

diffusers = pytest.importorskip("diffusers")
import ddpm.weights.diffusers_adapter  # noqa: E402  (diffusers finds DDPMUNet2DModel only once this is imported)

MAX_LEVELS = 1  # uint8 levels between our images and diffusers'
MAX_DIFFERING = 0.005  # fraction of pixels that may differ at all
SEED, BATCH = 3, 16


def perturbed_unet(**changes: Any) -> torch.nn.Module:
    net = tiny_unet(**changes)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        net.conv_out.weight /= 2.5  # outputs of std ~1
        net.conv_out.bias /= 2.5
    return net.eval()


def write_run(
    folder: Path, *, prediction: str = "eps", num_classes: int | None = None, num_timesteps: int = 1000, **diffusion
) -> tuple[Path, dict[str, Any]]:
    """An ema.pt as train.py writes it (EMA weights + resolved config) of a perturbed tiny UNet."""
    config = {
        "model": tiny_unet_config(num_classes),
        "diffusion": {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": num_timesteps,
                      "schedule": "linear", "prediction": prediction, "p_uncond": 0.1, **diffusion},
    }  # fmt: skip
    net = perturbed_unet(num_classes=num_classes)
    return export_ema(folder / "ema.pt", net.state_dict(), config), config


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Export folders: eps (unconditional), v (conditional: the pipelines use its null class), eps conditional
    at T=50 (for the full DDPM chain and guidance)."""
    root = tmp_path_factory.mktemp("exports")
    kinds = {"eps": {}, "v": {"prediction": "v", "num_classes": 3}, "cond50": {"num_classes": 3, "num_timesteps": 50}}
    folders = {}
    for name, options in kinds.items():
        (root / name).mkdir()
        ema, _ = write_run(root / name, **options)
        folders[name] = export_diffusers(load_model(ema), root / name / "export", adapter=True)
    return folders


def ours(folder: Path, sampler, *, labels=None, guidance: float = 0.0) -> np.ndarray:
    """Our generate() on the exported model, as sample.py would: (B, H, W, C) uint8."""
    loaded = load_export(folder)
    net = loaded.net
    shape = (BATCH, net.in_channels, net.image_size, net.image_size)
    denoiser = denoiser_for(net, loaded.diffusion, guidance=guidance)
    out = generate(denoiser, sampler, shape, labels=labels, seed=SEED, batch_size=BATCH)
    return out.images.permute(0, 2, 3, 1).numpy()


def generator() -> torch.Generator:
    """The generator of our first batch: the same x_T (and the same later draws) as generate(seed=SEED)."""
    return torch.Generator().manual_seed(batch_seed(SEED, 0))


def pipeline_uint8(images: np.ndarray) -> np.ndarray:
    """A pipeline's output_type="np" images in [0, 1] as diffusers' numpy_to_pil saves them."""
    return (images * 255).round().astype(np.uint8)


def assert_same_images(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    diff = np.abs(a.astype(int) - b.astype(int))
    assert diff.max() <= MAX_LEVELS, f"max difference {diff.max()} levels"
    assert (diff > 0).mean() <= MAX_DIFFERING, f"{(diff > 0).mean():.2%} of pixels differ"
    assert ((a > 0) & (a < 255)).mean() > 0.1, "images are saturated: the comparison would be vacuous"


@pytest.fixture(autouse=True, scope="module")
def _diffusers_errors_only():
    """Keep diffusers' load-time warnings (no accelerate; "Expected types for unet" UNet2DModel) out of the log."""
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    yield
    diffusers.utils.logging.set_verbosity(verbosity)


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --- the scheduler is our schedule -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_scheduler_config_is_exactly_our_schedule(schedule, prediction):
    """trained_betas are our float64 betas, exact through JSON; diffusers' DDPM and DDIM schedulers use them."""
    diffusion = GaussianDiffusion(num_timesteps=1000, schedule=schedule, prediction=prediction)
    config = json.loads(json.dumps(scheduler_config(diffusion)))
    assert torch.equal(torch.tensor(config["trained_betas"], dtype=torch.float64), diffusion.betas64())
    assert config["prediction_type"] == {"eps": "epsilon", "v": "v_prediction"}[prediction]
    assert (config["clip_sample"], config["clip_sample_range"], config["variance_type"]) == (True, 1.0, "fixed_small")
    for scheduler in (diffusers.DDPMScheduler(**config), diffusers.DDIMScheduler.from_config(config)):
        assert torch.equal(scheduler.betas, diffusion.betas64().float())
        assert scheduler.config.num_train_timesteps == 1000 and scheduler.config.timestep_spacing == "trailing"
    assert diffusers.DDIMScheduler.from_config(config).config.set_alpha_to_one  # the last step goes to alpha_bar=1


# --- images equal ours -------------------------------------------------------------------------------


def our_x0(folder: Path, sampler) -> torch.Tensor:
    """Our sampler's float x0 in [-1, 1] from generate()'s first x_T: (B, C, H, W)."""
    loaded = load_export(folder)
    denoiser = loaded.diffusion.denoiser(loaded.net)
    shape = (loaded.net.in_channels, loaded.net.image_size, loaded.net.image_size)
    g = generator()
    return sampler.sample(denoiser, torch.randn(BATCH, *shape, generator=g), denoiser.sigmas, None, generator=g)


def assert_close_floats(images: np.ndarray, x0: torch.Tensor, atol: float) -> None:
    """A pipeline's [0, 1] (B, H, W, C) images against our x0 in [-1, 1]: the floats before rounding."""
    expected = (x0 / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(images, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", ["eps", "v"])
def test_ddim_pipeline_and_scheduler_loop_match_our_ddim(exports, kind):
    """DDIMPipeline.from_pretrained(folder) and a hand-written DDIMScheduler loop give our sampler=ddim images
    (uint8 within MAX_LEVELS; the floats within 1e-4 with diffusers' float32 alpha_bar, 1e-5 with ours)."""
    folder, sampler = exports[kind], DDIMSampler(steps=10, eta=0.0, spacing="trailing")
    expected, x0 = ours(folder, sampler), our_x0(folder, sampler)
    assert np.array_equal(to_uint8(x0).permute(0, 2, 3, 1).numpy(), expected)  # generate() started from this x_T
    pipe = quiet(diffusers.DDIMPipeline.from_pretrained(folder))
    assert isinstance(pipe.unet, ddpm.weights.diffusers_adapter.DDPMUNet2DModel)
    images = pipe(
        batch_size=BATCH, generator=generator(), num_inference_steps=10, eta=0.0,
        use_clipped_model_output=True, output_type="np",
    ).images  # fmt: skip
    assert_same_images(pipeline_uint8(images), expected)
    assert_close_floats(images, x0, atol=1e-4)

    unet, scheduler = pipe.unet, diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    size, channels = unet.config.sample_size, unet.config.in_channels
    x_T = torch.randn(BATCH, channels, size, size, generator=generator())

    def loop(scheduler) -> torch.Tensor:
        scheduler.set_timesteps(10)
        x = x_T.clone()
        with torch.no_grad():
            for t in scheduler.timesteps:
                x = scheduler.step(unet(x, t).sample, t, x, eta=0.0, use_clipped_model_output=True).prev_sample
        return x.clamp(-1, 1)

    x = loop(scheduler)
    assert_same_images(to_uint8(x).permute(0, 2, 3, 1).numpy(), expected)
    torch.testing.assert_close(x, x0, rtol=0, atol=2e-4)
    # With our float64 alpha_bar in place of diffusers' float32 one, the final x agrees to float32 precision.
    scheduler.alphas_cumprod = torch.cumprod(1 - torch.tensor(scheduler.config.trained_betas, dtype=torch.float64), 0)
    torch.testing.assert_close(loop(scheduler), x0, rtol=1e-5, atol=1e-5)


def test_ddpm_pipeline_matches_our_ddpm_on_all_timesteps(exports):
    """DDPMPipeline(num_inference_steps=T) draws the same noise from the same generator as our sampler=ddpm."""
    folder = exports["cond50"]
    expected, x0 = ours(folder, DDPMSampler()), our_x0(folder, DDPMSampler())
    pipe = quiet(diffusers.DDPMPipeline.from_pretrained(folder))
    images = pipe(batch_size=BATCH, generator=generator(), num_inference_steps=50, output_type="np").images
    assert_same_images(pipeline_uint8(images), expected)
    assert_close_floats(images, x0, atol=1e-4)


def test_guided_loop_of_the_docs_matches_our_guidance(exports):
    """The guidance loop of ddpm.export's docstring (eps = (1 + w) eps(x, y) - w eps(x, null), null = num_classes)
    gives our `sampler=ddim guidance=2` images for the same labels."""
    folder, w = exports["cond50"], 2.0
    labels = torch.arange(BATCH) % 3
    expected = ours(folder, DDIMSampler(steps=10), labels=labels, guidance=w)

    pipe = diffusers.DDPMPipeline.from_pretrained(folder)
    unet, scheduler = pipe.unet.eval(), diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(10)
    y = labels
    null = torch.full_like(y, unet.config.num_classes)
    size = unet.config.sample_size
    x = torch.randn(len(y), unet.config.in_channels, size, size, generator=generator())
    with torch.no_grad():
        for t in scheduler.timesteps:
            cond, uncond = unet(torch.cat([x, x]), t, class_labels=torch.cat([y, null])).sample.chunk(2)
            out = (1 + w) * cond - w * uncond
            x = scheduler.step(out, t, x, eta=0.0, use_clipped_model_output=True).prev_sample
    images = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    assert_same_images(images.permute(0, 2, 3, 1).numpy(), expected)


def test_adapter_takes_timesteps_and_labels_as_unet2d_does(exports):
    """A 0-dim, int or (B,) timestep give the same output; labels=None is the null class; return_dict=False a tuple."""
    unet = diffusers.DDPMPipeline.from_pretrained(exports["v"]).unet.eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        a = unet(x, torch.tensor(500)).sample
        torch.testing.assert_close(unet(x, 500).sample, a, rtol=0, atol=0)
        torch.testing.assert_close(unet(x, torch.tensor([500, 500]), return_dict=False)[0], a, rtol=0, atol=0)
        torch.testing.assert_close(unet(x, 500, class_labels=torch.tensor([3, 3])).sample, a, rtol=0, atol=0)
        assert not torch.allclose(unet(x, 500, class_labels=torch.tensor([0, 1])).sample, a)
    unconditional = diffusers.DDPMPipeline.from_pretrained(exports["eps"]).unet
    with pytest.raises(ValueError, match="unconditional"):
        unconditional(x, 500, class_labels=torch.tensor([0, 1]))


# --- the folder --------------------------------------------------------------------------------------


def test_folder_round_trips_through_save_pretrained(exports, tmp_path):
    """from_pretrained -> save_pretrained -> from_pretrained keeps every weight and the scheduler config; our own
    loader reads both folders (the re-saved one lacks ddpm_config.json: the schedule is recovered from the betas)."""
    folder = exports["v"]
    original = load_model(folder.parent / "ema.pt")
    pipe = diffusers.DDPMPipeline.from_pretrained(folder)
    pipe.save_pretrained(tmp_path / "resaved")
    again = diffusers.DDIMPipeline.from_pretrained(tmp_path / "resaved")
    assert (tmp_path / "resaved" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    theirs = {k.removeprefix("net."): v for k, v in again.unet.state_dict().items()}
    mine = original.net.state_dict()
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in mine)
    assert again.scheduler.config.trained_betas == pipe.scheduler.config.trained_betas
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    assert public(again.unet.config) == public(pipe.unet.config)
    for path in (folder, tmp_path / "resaved"):
        loaded = load_export(path)
        assert all(torch.equal(loaded.net.state_dict()[k], mine[k]) for k in mine)
        assert (loaded.diffusion.schedule, loaded.diffusion.prediction, loaded.diffusion.num_timesteps) == (
            "linear", "v", 1000,
        )  # fmt: skip
    assert (
        load_export(folder).diffusion.p_uncond == 0.1 and load_export(tmp_path / "resaved").diffusion.p_uncond is None
    )


def test_load_export_refuses_foreign_or_edited_folders(exports, tmp_path):
    import shutil

    foreign = shutil.copytree(exports["eps"], tmp_path / "foreign")
    index = json.loads((foreign / "model_index.json").read_text())
    (foreign / "model_index.json").write_text(json.dumps(index | {"unet": ["diffusers", "UNet2DModel"]}))
    with pytest.raises(CheckpointError, match=r"foreign.*not lightning-ddpm's"):
        load_export(foreign)
    edited = shutil.copytree(exports["eps"], tmp_path / "edited")
    config = json.loads((edited / "scheduler" / "scheduler_config.json").read_text())
    (edited / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(config | {"prediction_type": "v_prediction"})
    )
    with pytest.raises(CheckpointError, match=r"edited.*prediction_type"):
        load_export(edited)
    heads = shutil.copytree(exports["eps"], tmp_path / "heads")  # the network is built from unet/config.json
    config = json.loads((heads / "unet" / "config.json").read_text())
    (heads / "unet" / "config.json").write_text(json.dumps(config | {"num_heads": 2 * config["num_heads"]}))
    with pytest.raises(
        CheckpointError, match=r"\['num_heads'\] disagree with ddpm_config\.json's model; the folder was edited"
    ):
        load_export(heads)  # loaded before: a network other than the one its run config reports
    listed = shutil.copytree(exports["eps"], tmp_path / "listed")  # valid JSON, not an object: an AttributeError
    (listed / "scheduler" / "scheduler_config.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"scheduler_config.json holds a JSON list, not an object; re-export"):
        load_export(listed)


def test_export_cli_refuses_bad_arguments_and_foreign_folders(exports, tmp_path, capsys):
    ema = exports["eps"].parent / "ema.pt"
    with pytest.raises(SystemExit) as exit_info:
        main([f"ckpt={ema}", "output=x"])
    assert exit_info.value.code == 2 and "ckpt=<run>/ema.pt and out=<folder>" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([f"ckpt={ema}", f"out={tmp_path / 'busy'}"])
    assert exit_info.value.code == 1 and "not an export folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([f"ckpt={tmp_path / 'missing.pt'}", f"out={tmp_path / 'new'}"])
    assert "missing.pt" in capsys.readouterr().err and not (tmp_path / "new").exists()


# --- ema.safetensors ---------------------------------------------------------------------------------


def test_ema_safetensors_round_trips_and_rebuilds_the_model(tmp_path, monkeypatch):
    """Weights and config come back equal; the rebuilt model is the ema.pt one; nothing is unpickled."""
    ema, config = write_run(tmp_path, prediction="v", num_classes=3)
    reference = load_model(ema)
    path = save_ema_safetensors(tmp_path / "ema.safetensors", reference.net.state_dict(), config)
    assert read_metadata(path)["format"] == FORMAT and json.loads(read_metadata(path)[CONFIG_KEY]) == config
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    state, loaded_config = load_ema_safetensors(path)
    assert loaded_config == config
    assert state.keys() == reference.net.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in reference.net.state_dict().items())
    loaded = load_safetensors_model(path)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([10, 900])
    with torch.no_grad():
        torch.testing.assert_close(loaded.net(x, t, None), reference.net(x, t, None), rtol=0, atol=0)
    assert loaded.diffusion.prediction == "v" and loaded.config == config


def bad_file(kind: str, folder: Path) -> Path:
    """A .safetensors that must not load, of the given kind."""
    _, config = write_run(folder)
    state = perturbed_unet().state_dict()
    path = folder / f"{kind}.safetensors"
    if kind == "no_metadata":
        save_file(state, path)
    elif kind == "foreign_metadata":
        save_file(state, path, metadata={"format": "pt"})  # what diffusers / transformers write
    elif kind == "not_a_run_config":
        save_file(state, path, metadata={CONFIG_KEY: json.dumps({"unet": {}})})
    elif kind == "not_json":
        save_file(state, path, metadata={CONFIG_KEY: "model: {}"})
    elif kind == "foreign_target":
        save_ema_safetensors(path, state, config | {"model": {**config["model"], "_target_": "os.system"}})
    elif kind == "wrong_shapes":
        save_ema_safetensors(path, perturbed_unet(base_channels=32).state_dict(), config)
    elif kind == "truncated":
        save_ema_safetensors(path, state, config)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("no_metadata", "without lightning-ddpm's 'ddpm_config' metadata"),
        ("foreign_metadata", r"without lightning-ddpm's 'ddpm_config' metadata \(its metadata keys: \['format'\]\)"),
        ("not_a_run_config", "not a lightning-ddpm run config"),
        ("not_json", "is not JSON"),
        ("foreign_target", "outside lightning-ddpm"),
        ("wrong_shapes", "do not fit the model its config describes"),
        ("truncated", "truncated or corrupt"),
        ("missing", "does not exist"),
    ],
)
def test_bad_safetensors_raise_checkpoint_error_naming_the_file(tmp_path, kind, message):
    path = bad_file(kind, tmp_path) if kind != "missing" else tmp_path / "missing.safetensors"
    with pytest.raises(CheckpointError, match=message) as error:
        load_safetensors_model(path)
    assert path.name in str(error.value)


# --- one real run ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_export_and_diffusers_pipeline(tmp_path):
    """train.py (class-conditional) -> python -m ddpm.export (a UNet2DModel folder) -> diffusers draws images."""
    run_dir = tmp_path / "run"
    train(*TINY_RUN, "model.num_classes=10", "diffusion.p_uncond=0.1", f"hydra.run.dir={run_dir}")
    out = tmp_path / "export"
    result = run("python", "-m", "ddpm.export", f"ckpt={run_dir / 'ema.pt'}", f"out={out}")
    assert str(out) in result.stdout and "UNet2DModel" in result.stdout
    pipe = quiet(diffusers.DDPMPipeline.from_pretrained(out))
    assert type(pipe.unet) is diffusers.UNet2DModel
    assert pipe.unet.config.num_class_embeds == 11 and pipe.unet.config.sample_size == 16
    pipe.scheduler.set_timesteps(4)
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in pipe.scheduler.timesteps:
            x = pipe.scheduler.step(pipe.unet(x, t, class_labels=torch.tensor([3, 10])).sample, t, x).prev_sample
    assert np.isfinite(x.numpy()).all()
    loaded, original = load_model(out), load_model(run_dir / "ema.pt")
    assert all(torch.equal(loaded.net.state_dict()[k], v) for k, v in original.net.state_dict().items())
    state, config = load_ema_safetensors(run_dir / "ema.safetensors")  # train.py writes it beside ema.pt
    assert config == original.config and all(torch.equal(state[k], v) for k, v in original.net.state_dict().items())

    # sample.py takes each kind of file and draws the same images from the same weights and seed
    drawn = {}
    for name, ckpt in [("ckpt", run_dir / "checkpoints" / "last.ckpt"), ("pt", run_dir / "ema.pt"),
                       ("safetensors", run_dir / "ema.safetensors"), ("folder", out)]:  # fmt: skip
        sample(f"ckpt={ckpt}", "num_samples=4", "sampler.steps=4", "guidance=2", f"output_dir={tmp_path / name}")
        drawn[name] = np.load(tmp_path / name / "samples.npz")["images"]
    for name in ("pt", "safetensors", "folder"):
        np.testing.assert_array_equal(drawn[name], drawn["ckpt"], err_msg=name)

    # bad files of each kind: a clear error naming the file, not a traceback from deep inside
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "ema.safetensors").write_bytes((run_dir / "ema.safetensors").read_bytes()[:500])
    (broken / "last.ckpt").write_bytes((run_dir / "checkpoints" / "last.ckpt").read_bytes()[:500])
    (broken / "folder").mkdir()
    (broken / "folder" / "model_index.json").write_text("{}")
    result = sample(
        f"ckpt={broken / 'ema.safetensors'}", "num_samples=2", f"output_dir={tmp_path / 'bad'}", check=False
    )
    assert result.returncode != 0 and "CheckpointError" in result.stderr, result.stderr[-2000:]  # as sample.py says it
    assert str(broken / "ema.safetensors") in result.stderr, result.stderr[-2000:]
    for path in (broken / "last.ckpt", broken / "folder", broken):  # the same loader refuses the other kinds
        with pytest.raises(CheckpointError, match=re.escape(str(path))):
            load_model(path)
