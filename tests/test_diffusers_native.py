"""The native diffusers export: our UNet as diffusers' own UNet2DModel, checked against diffusers alone.

- The mapping (ddpm.weights.unet2d_mapping): UNet2DModel with unet2d_config and the mapped weights gives our UNet's
  output for random weights, inputs, timesteps and labels (the presets unet_tiny, unet_mnist, ddpm_cifar10 and a
  native variant of unet64 at small widths; FiLM, heads, emb_dim, one level), and so does model=diffusers_unet2d.
  Configurations UNet2DModel cannot express (seed_mnist, unet64) are named; so are UNet2DModel configs outside
  our UNet's family.
- Sampling: a subprocess in which `import ddpm` fails (a meta-path finder refuses it; the script proves it) loads
  each exported folder with diffusers alone and samples with DDIMPipeline / DDPMPipeline (unconditional models)
  and the guided loop of ddpm/export.py's docstring (conditional ones); the images equal our samplers' from the
  same noise, within tests/test_export.py's bound (MAX_LEVELS, MAX_DIFFERING), for eps and v.
- The reverse: a folder made by diffusers itself (save_pretrained of a random UNet2DModel and a DDPMScheduler)
  samples through load_model + generate and loads through load_init; what we cannot read is refused by name.
"""

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from helpers import CONF, PYTHON, env, run, sample, train

from ddpm.diffusion.generate import batch_seed, denoiser_for, generate, to_uint8
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.export import main
from ddpm.models.diffusers_unet import DiffusersUNet2D, NotUNet2D, unet2d_config
from ddpm.models.unet import UNet
from ddpm.weights import CheckpointError, load_model
from ddpm.weights.diffusers_folder import export_diffusers
from ddpm.weights.init import load_init
from ddpm.weights.torch_file import export_ema
from ddpm.weights.unet2d_mapping import arguments_from_unet2d, tensor_table, to_unet2d_state

diffusers = pytest.importorskip("diffusers")

MAX_LEVELS, MAX_DIFFERING = 1, 0.005  # as tests/test_export.py
SEED = 3
PRESETS = {  # conf/model presets, the big ones at small widths (UNet2DModel's layout is the preset's)
    "unet_tiny": {},
    "unet_mnist": {},
    "ddpm_cifar10": {"base_channels": 32},
    "unet64_one_head": {"base_channels": 32, "num_heads": 1},  # unet64 itself: 4 heads at widths 128 and 256
}


def preset(name: str, **changes: Any) -> dict[str, Any]:
    """conf/model/<name>.yaml (unet64_one_head: unet64) with `changes`, as a run config's model node."""
    return yaml.safe_load((CONF / "model" / f"{name.removesuffix('_one_head')}.yaml").read_text()) | changes


def arguments(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k != "_target_"}


def randomise(net: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every tensor drawn at random (fan-in scaled; norms around 1), so every mapped tensor matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.ndim > 1:
                p.copy_(noise / math.sqrt(p[0].numel()))
            else:
                p.copy_(noise * 0.3 + float("norm" in name and name.endswith("weight")))
    return net.eval()


def inputs(model: dict[str, Any], batch: int = 3):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(batch, model["in_channels"], model["image_size"], model["image_size"], generator=generator)
    t = torch.randint(0, 1000, (batch,), generator=generator)
    y = torch.randint(0, model["num_classes"] + 1, (batch,), generator=generator) if model.get("num_classes") else None
    return x, t, y


def assert_same_output(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.abs().mean() > 0.05, "outputs near 0: the comparison would be vacuous"
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())


# --- the mapping -------------------------------------------------------------------------------------

VARIANTS = {
    **{name: preset(name, **changes) for name, changes in PRESETS.items()},
    "tiny_film_heads_emb": preset("unet_tiny", scale_shift=True, num_heads=4, emb_dim=48, num_classes=3),
    "one_level": preset("unet_tiny", channel_mult=[1], attention_resolutions=[16], num_res_blocks=2),
    "cifar_conditional_v_film": preset("ddpm_cifar10", base_channels=32, num_classes=10, scale_shift=True),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_unet2d_model_with_mapped_weights_is_our_unet(name):
    """UNet2DModel(**unet2d_config(args)) with to_unet2d_state(our weights) gives our output; model=diffusers_unet2d
    (DiffusersUNet2D) with the same arguments too; the config maps back to the same arguments."""
    model = VARIANTS[name]
    ours = randomise(UNet(**arguments(model)))
    theirs = diffusers.UNet2DModel(**unet2d_config(arguments(model))).eval()
    theirs.load_state_dict(to_unet2d_state(ours.state_dict(), arguments(model)), strict=True)
    wrapper = DiffusersUNet2D(**arguments(model)).eval()
    wrapper.unet.load_state_dict(theirs.state_dict())
    x, t, y = inputs(model)
    with torch.no_grad():
        expected = ours(x, t, y)
        assert_same_output(expected, theirs(x, t, class_labels=y).sample)
        assert_same_output(expected, wrapper(x, t, y))
    back = arguments_from_unet2d(dict(theirs.config))
    assert {k: v for k, v in back.items() if v is not None} == {
        k: list(v) if isinstance(v, list | tuple) else v
        for k, v in (arguments(model) | {"dropout": back["dropout"]}).items()
        if k != "checkpoint_activations" and v is not None
    }


def test_table_maps_every_tensor_once_with_matching_shapes():
    """Each of our tensors appears once, each UNet2DModel tensor once, and the shapes agree (split: a third)."""
    model = VARIANTS["tiny_film_heads_emb"]
    ours = UNet(**arguments(model)).state_dict()
    theirs = diffusers.UNet2DModel(**unet2d_config(arguments(model))).state_dict()
    table = tensor_table(arguments(model))
    assert sorted(o for o, _, _ in table) == sorted(ours)
    assert sorted(t for _, ts, _ in table for t in ts) == sorted(theirs)
    for o, ts, _ in table:
        rows = sum(theirs[t].shape[0] for t in ts)
        assert rows == ours[o].shape[0] and all(theirs[t].numel() * len(ts) == ours[o].numel() for t in ts), o


@pytest.mark.parametrize(
    ("name", "changes", "named"),
    [
        ("seed_mnist", {}, r"downsample=\[True, True, False\]: UNet2DModel halves the size after every level"),
        ("unet64", {}, r"num_heads=4 at the attention widths \[256, 512\] .* gives head widths \[64, 128\]"),
        ("unet_tiny", {"channel_mult": [2, 4]}, r"channel_mult=\[2, 4\] starts at 2, not 1"),
    ],
)
def test_configurations_unet2d_cannot_express_are_named(name, changes, named):
    """unet2d_config names the UNet argument UNet2DModel cannot express, and why."""
    with pytest.raises(NotUNet2D, match=f"^{named}"):
        unet2d_config(arguments(preset(name, **changes)))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"norm_eps": 1e-6}, "norm_eps"),
        ({"flip_sin_to_cos": False, "freq_shift": 1}, "flip_sin_to_cos"),
        (
            {
                "attention_head_dim": 8,
                "down_block_types": ["AttnDownBlock2D"] * 2,
                "up_block_types": ["AttnUpBlock2D"] * 2,
            },
            "attention_head_dim",
        ),  # heads 4 at width 32, 8 at 64
        ({"resnet_time_scale_shift": "scale_shift", "attn_norm_num_groups": None}, "attn_norm_num_groups"),
        ({"down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"]}, "down_block_types"),
        ({"class_embed_type": "timestep"}, "class_embed_type"),
        ({"sample_size": [16, 32]}, "sample_size"),
        ({"brand_new_option": 1}, "brand_new_option"),
    ],
)
def test_unet2d_configs_outside_our_family_are_refused_by_name(change, named):
    config = unet2d_config(arguments(preset("unet_tiny", num_heads=2))) | {"_class_name": "UNet2DModel"}
    assert arguments_from_unet2d(config)["num_heads"] == 2
    with pytest.raises(NotUNet2D, match=named):
        arguments_from_unet2d(config | change)


# --- exports sampled by diffusers alone --------------------------------------------------------------

# (model, prediction, T, what to draw): pipelines for unconditional models, the docs' guided loop for conditional
CASES = {
    "tiny_eps": (preset("unet_tiny", image_size=8, base_channels=16, norm_groups=4, attention_resolutions=[4]),
                 "eps", 50, ["ddim", "ddpm"]),
    "tiny_v": (preset("unet_tiny", image_size=8, base_channels=16, norm_groups=4, attention_resolutions=[4]),
               "v", 50, ["ddim", "ddpm"]),
    "tiny_cond_eps_film": (preset("unet_tiny", image_size=8, base_channels=16, norm_groups=4, attention_resolutions=[4],
                                  num_classes=3, scale_shift=True), "eps", 50, ["guided", "labels"]),
    "tiny_cond_v": (preset("unet_tiny", image_size=8, base_channels=16, norm_groups=4, attention_resolutions=[4],
                           num_classes=3, num_heads=2), "v", 50, ["guided"]),
    "unet_mnist": (preset("unet_mnist"), "eps", 1000, ["guided"]),
    "ddpm_cifar10": (preset("ddpm_cifar10", base_channels=32), "eps", 1000, ["ddim"]),
    "unet64_one_head": (preset("unet64", base_channels=32, num_heads=1), "v", 1000, ["ddim"]),
}  # fmt: skip
BATCH = {"unet64_one_head": 2, "ddpm_cifar10": 8}  # else 16
STEPS, GUIDANCE = 10, 2.0

BLOCK_DDPM = """
import importlib.abc, sys
class NoDdpm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ddpm" or name.startswith("ddpm."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, NoDdpm())
try:
    import ddpm
    raise SystemExit("ddpm was importable")
except ModuleNotFoundError:
    pass
"""

DIFFUSERS_ONLY = (
    BLOCK_DDPM
    + """
import json, numpy as np, torch
from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline, UNet2DModel
from diffusers.utils import logging
logging.set_verbosity_error()
out = {}
for job in json.loads(sys.argv[1]):
    folder, name, batch, seed = job["folder"], job["name"], job["batch"], job["seed"]
    if job["kind"] in ("ddim", "ddpm"):
        pipe = (DDIMPipeline if job["kind"] == "ddim" else DDPMPipeline).from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        kwargs = {"eta": 0.0, "use_clipped_model_output": True} if job["kind"] == "ddim" else {}
        images = pipe(batch_size=batch, generator=torch.Generator().manual_seed(seed),
                      num_inference_steps=job["steps"], output_type="np", **kwargs).images
        out[name] = (images * 255).round().astype(np.uint8)
        continue
    try:  # a class-conditional UNet2DModel refuses the pipelines' call without class labels
        DDPMPipeline.from_pretrained(folder)(batch_size=1, num_inference_steps=1)
        raise SystemExit("DDPMPipeline ran a class-conditional UNet2DModel without labels")
    except ValueError as error:
        assert "class_labels" in str(error), error
    # the guided loop of ddpm/export.py's docstring, with the test's w, labels, steps and generator
    unet = UNet2DModel.from_pretrained(folder, subfolder="unet").eval()
    scheduler = DDIMScheduler.from_pretrained(folder, subfolder="scheduler")
    scheduler.set_timesteps(job["steps"])
    w, y = job["w"], torch.tensor(job["labels"])
    null = torch.full_like(y, unet.config.num_class_embeds - 1)
    size = unet.config.sample_size
    x = torch.randn(len(y), unet.config.in_channels, size, size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for t in scheduler.timesteps:
            cond, uncond = unet(torch.cat([x, x]), t, class_labels=torch.cat([y, null])).sample.chunk(2)
            out_ = (1 + w) * cond - w * uncond
            x = scheduler.step(out_, t, x, eta=0.0, use_clipped_model_output=True).prev_sample
    images = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    out[name] = images.permute(0, 2, 3, 1).numpy()
assert not [m for m in sys.modules if m == "ddpm" or m.startswith("ddpm.")], "ddpm got imported"
np.savez(sys.argv[2], **out)
"""
)


def write_run(folder: Path, model: dict[str, Any], prediction: str, num_timesteps: int) -> Path:
    """An ema.pt as train.py writes it, of a randomised network of `model`."""
    folder.mkdir(parents=True, exist_ok=True)
    diffusion = {"_target_": "ddpm.diffusion.gaussian.GaussianDiffusion", "num_timesteps": num_timesteps,
                 "schedule": "linear", "prediction": prediction, "p_uncond": 0.1}  # fmt: skip
    config = {"model": model, "diffusion": diffusion}
    net = randomise(UNet(**arguments(model)))
    if prediction == "eps":  # eps of std ~1, so x0 is not clipped everywhere (saturated images compare vacuously)
        with torch.no_grad():
            net.conv_out.weight *= 3
            net.conv_out.bias *= 3
    return export_ema(folder / "ema.pt", net.state_dict(), config)


def jobs(name: str, folder: Path) -> list[dict[str, Any]]:
    model, _, num_timesteps, kinds = CASES[name]
    batch = BATCH.get(name, 16)
    labels = [i % model["num_classes"] for i in range(batch)] if model.get("num_classes") else None
    made = []
    for kind in kinds:
        steps = num_timesteps if kind == "ddpm" else STEPS
        w = 0.0 if kind == "labels" else GUIDANCE
        made.append({"name": f"{name}-{kind}", "folder": str(folder), "kind": kind, "steps": steps, "batch": batch,
                     "seed": batch_seed(SEED, 0), "labels": labels, "w": w})  # fmt: skip
    return made


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> dict[str, Any]:
    """Every case exported (native), then sampled by diffusers in one subprocess that cannot import ddpm."""
    root = tmp_path_factory.mktemp("native")
    all_jobs, runs = [], {}
    for name, (model, prediction, num_timesteps, _) in CASES.items():
        runs[name] = write_run(root / name, model, prediction, num_timesteps)
        folder = export_diffusers(load_model(runs[name]), root / name / "export")
        assert json.loads((folder / "model_index.json").read_text())["unet"] == ["diffusers", "UNet2DModel"]
        all_jobs += jobs(name, folder)
    result = subprocess.run(
        [PYTHON, "-I", "-c", DIFFUSERS_ONLY, json.dumps(all_jobs), str(root / "theirs.npz")],
        cwd=root, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return {"runs": runs, "jobs": {j["name"]: j for j in all_jobs}, "theirs": dict(np.load(root / "theirs.npz"))}


def ours(ema: Path, job: dict[str, Any]) -> np.ndarray:
    """Our generate() on the run's own ema.pt (our UNet, not the folder read back): (B, H, W, C) uint8."""
    loaded = load_model(ema)
    net, diffusion = loaded.net, loaded.diffusion
    sampler = (
        DDPMSampler()
        if job["kind"] == "ddpm"
        else DDIMSampler(steps=job["steps"], eta=0.0, spacing=job.get("spacing", "trailing"))
    )
    labels = torch.tensor(job["labels"]) if job["labels"] is not None else None
    denoiser = denoiser_for(net, diffusion, guidance=job["w"] if labels is not None else 0.0)
    shape = (job["batch"], net.in_channels, net.image_size, net.image_size)
    out = generate(denoiser, sampler, shape, labels=labels, seed=SEED, batch_size=job["batch"])
    return out.images.permute(0, 2, 3, 1).numpy()


def assert_same_images(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    diff = np.abs(a.astype(int) - b.astype(int))
    assert diff.max() <= MAX_LEVELS, f"max difference {diff.max()} levels"
    assert (diff > 0).mean() <= MAX_DIFFERING, f"{(diff > 0).mean():.2%} of pixels differ"
    assert ((a > 0) & (a < 255)).mean() > 0.1, "images are saturated: the comparison would be vacuous"


@pytest.mark.slow
@pytest.mark.parametrize("job", [j["name"] for name in CASES for j in jobs(name, Path("."))])
def test_diffusers_alone_samples_our_images(sampled, job):
    """DDIMPipeline (S=10, eta=0, clipped), DDPMPipeline (all T=50) and the docs' guided loop (w=2, or w=0 with
    labels), run where ddpm cannot be imported, draw our sampler's images from the same noise."""
    name = job.rsplit("-", 1)[0]
    assert_same_images(sampled["theirs"][job], ours(sampled["runs"][name], sampled["jobs"][job]))


# --- a folder made by diffusers itself ---------------------------------------------------------------

THEIR_UNET = dict(  # written in diffusers' own terms: our family (unet_tiny-like, 3 classes, FiLM, 8-wide heads)
    sample_size=8, in_channels=1, out_channels=1, block_out_channels=(16, 32), layers_per_block=1,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    norm_num_groups=4, attn_norm_num_groups=4, attention_head_dim=8, resnet_time_scale_shift="scale_shift",
    num_class_embeds=4,
)  # fmt: skip
OUR_EQUIVALENT = dict(in_channels=1, image_size=8, base_channels=16, channel_mult=[1, 2], num_res_blocks=1,
                      attention_resolutions=[4], num_heads=4, dropout=0.0, num_classes=3, norm_groups=4,
                      scale_shift=True, emb_dim=None)  # fmt: skip


def diffusers_folder(path: Path, scheduler: Any = None, **unet_changes: Any) -> Path:
    """save_pretrained of a random UNet2DModel (every tensor drawn) and a DDPMScheduler, as diffusers users do."""
    unet = randomise(diffusers.UNet2DModel(**(THEIR_UNET | unet_changes)), seed=5)
    scheduler = scheduler or diffusers.DDPMScheduler(num_train_timesteps=1000, prediction_type="v_prediction")
    diffusers.DDPMPipeline(unet=unet, scheduler=scheduler).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def made_by_diffusers(tmp_path_factory) -> Path:
    return diffusers_folder(tmp_path_factory.mktemp("hub") / "pipe")


def test_diffusers_made_folder_loads_and_samples_through_load_model(made_by_diffusers):
    """load_model maps the UNet2DModel weights back onto our UNet (same output) with our linear schedule and v;
    our generate (sampler=ddim sampler.spacing=leading: DDPMScheduler's default spacing) draws what diffusers' own
    DDIMScheduler loop draws from the same noise (guided)."""
    loaded = load_model(made_by_diffusers)
    assert isinstance(loaded.net, UNet)
    assert arguments(loaded.config["model"]) == OUR_EQUIVALENT
    assert (loaded.diffusion.schedule, loaded.diffusion.prediction, loaded.diffusion.p_uncond) == ("linear", "v", None)
    unet = diffusers.UNet2DModel.from_pretrained(made_by_diffusers, subfolder="unet").eval()
    x, t, y = inputs(OUR_EQUIVALENT)
    with torch.no_grad():
        assert_same_output(unet(x, t, class_labels=y).sample, loaded.net(x, t, y))
    labels = torch.arange(16) % 3
    job = {
        "kind": "guided",
        "steps": STEPS,
        "batch": 16,
        "labels": labels.tolist(),
        "w": GUIDANCE,
        "spacing": "leading",
    }
    expected = ours(made_by_diffusers, job)
    scheduler = diffusers.DDIMScheduler.from_pretrained(made_by_diffusers, subfolder="scheduler")
    scheduler.set_timesteps(STEPS)
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(batch_seed(SEED, 0)))
    null = torch.full_like(labels, 3)
    with torch.no_grad():
        for step in scheduler.timesteps:
            cond, uncond = unet(torch.cat([x, x]), step, class_labels=torch.cat([labels, null])).sample.chunk(2)
            guided = (1 + GUIDANCE) * cond - GUIDANCE * uncond
            x = scheduler.step(guided, step, x, eta=0.0, use_clipped_model_output=True).prev_sample
    assert_same_images(to_uint8(x).permute(0, 2, 3, 1).numpy(), expected)


def test_diffusers_made_folder_initialises_our_unet_and_the_diffusers_backbone(made_by_diffusers):
    """load_init puts its weights into a fresh UNet and a fresh model=diffusers_unet2d network (same outputs);
    a run whose model differs is refused naming each model.* key."""
    reference = load_model(made_by_diffusers).net
    x, t, y = inputs(OUR_EQUIVALENT)
    for target, cls in (
        ("ddpm.models.unet.UNet", UNet),
        ("ddpm.models.diffusers_unet.DiffusersUNet2D", DiffusersUNet2D),
    ):
        net = cls(**OUR_EQUIVALENT).eval()
        config = load_init(made_by_diffusers, net, {"_target_": target, **OUR_EQUIVALENT, "dropout": 0.1})
        assert config["model"]["_target_"] == "ddpm.models.unet.UNet"
        with torch.no_grad():
            assert_same_output(reference(x, t, y), net(x, t, y))
    spelled = {"_target_": "ddpm.models.unet.UNet", **OUR_EQUIVALENT, "emb_dim": 4 * OUR_EQUIVALENT["base_channels"]}
    load_init(made_by_diffusers, UNet(**arguments(spelled)), spelled)  # the default spelled out: refused before
    other = {"_target_": "ddpm.models.unet.UNet", **OUR_EQUIVALENT, "base_channels": 8, "num_classes": None}
    with pytest.raises(CheckpointError, match=r"model\.base_channels \(file 16, run 8\).*model\.num_classes"):
        load_init(made_by_diffusers, UNet(**arguments(other)), other)


def test_load_init_takes_every_format_and_crosses_to_the_diffusers_backbone(tmp_path):
    """ema.pt, ema.safetensors and the export folder give the same weights; our UNet's go into DiffusersUNet2D."""
    from ddpm.weights.safetensors_file import save_ema_safetensors

    model, prediction, num_timesteps, _ = CASES["tiny_cond_v"]
    ema = write_run(tmp_path, model, prediction, num_timesteps)
    reference = load_model(ema)
    safe = save_ema_safetensors(tmp_path / "ema.safetensors", reference.net.state_dict(), reference.config)
    folder = export_diffusers(reference, tmp_path / "export")
    x, t, y = inputs(model)
    for path in (ema, safe, folder):
        net = DiffusersUNet2D(**arguments(model)).eval()
        load_init(path, net, {**model, "_target_": "ddpm.models.diffusers_unet.DiffusersUNet2D"})
        with torch.no_grad():
            assert_same_output(reference.net(x, t, y), net(x, t, y))


def test_our_schedules_given_as_trained_betas_to_float_rounding_are_read_as_ours(tmp_path):
    """A diffusers user's `trained_betas=np.linspace(1e-4, 0.02, 1000)` (one ulp from ours) or betas copied from a
    scheduler in float32 were refused as "none of our schedules"; equal to 1e-6 relative, as beta_start/beta_end."""
    import numpy as np

    from ddpm.diffusion.schedule import make_betas

    for name, betas in (("linear", np.linspace(1e-4, 0.02, 1000)), ("linear", make_betas("linear", 1000).float()),
                        ("cosine", make_betas("cosine", 1000).float())):  # fmt: skip
        folder = diffusers_folder(tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}", diffusers.DDPMScheduler(
            trained_betas=np.asarray(betas), prediction_type="v_prediction"))  # fmt: skip
        assert load_model(folder).diffusion.schedule == name
    other = diffusers_folder(tmp_path / "other", diffusers.DDPMScheduler(trained_betas=np.linspace(1e-4, 0.021, 1000)))
    with pytest.raises(CheckpointError, match="trained_betas at T=1000 is none of our schedules"):
        load_model(other)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda p: diffusers_folder(p, norm_eps=1e-6, flip_sin_to_cos=False, freq_shift=1), "norm_eps=1e-06"),
        (lambda p: diffusers_folder(p, diffusers.DDPMScheduler(beta_schedule="scaled_linear")), "scaled_linear"),
        (lambda p: diffusers_folder(p, diffusers.DDPMScheduler(prediction_type="sample")), "prediction_type 'sample'"),
        (lambda p: diffusers_folder(p, diffusers.PNDMScheduler()), "PNDMScheduler"),
        (lambda p: diffusers_folder(p, diffusers.DDPMScheduler(beta_start=0.001)), "beta_start=0.001"),
    ],
)
def test_diffusers_folders_we_cannot_express_are_refused_by_name(tmp_path, make, named):
    folder = make(tmp_path / "pipe")
    with pytest.raises(CheckpointError, match=named) as error:
        load_model(folder)
    assert str(folder) in str(error.value)


def test_native_export_round_trips_and_refuses_edits(made_by_diffusers, tmp_path):
    """Our export of a diffusers-made model is the same folder again (re-saved by diffusers: still readable);
    a unet/config.json edited against ddpm_config.json is refused."""
    loaded = load_model(made_by_diffusers)
    folder = export_diffusers(loaded, tmp_path / "export")
    again = load_model(folder)
    assert all(torch.equal(again.net.state_dict()[k], v) for k, v in loaded.net.state_dict().items())
    theirs = diffusers.UNet2DModel.from_pretrained(made_by_diffusers, subfolder="unet").state_dict()
    mine = diffusers.UNet2DModel.from_pretrained(folder, subfolder="unet").state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    edited = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((edited / "unet" / "config.json").read_text())
    (edited / "unet" / "config.json").write_text(json.dumps(config | {"layers_per_block": 2}))
    with pytest.raises(CheckpointError, match=r"edited.*layers_per_block.*disagree"):
        load_model(edited)


# --- python -m ddpm.export ---------------------------------------------------------------------------


def test_export_cli_writes_native_or_says_why_it_falls_back(tmp_path, capsys):
    """unet_tiny: a UNet2DModel folder; unet64 (4 heads at widths 256 and 512; 128 and 256 here): the adapter folder,
    with the reason printed."""
    tiny = write_run(tmp_path / "tiny", preset("unet_tiny"), "eps", 50)
    main([f"ckpt={tiny}", f"out={tmp_path / 'tiny_export'}"])
    assert "UNet2DModel" in capsys.readouterr().out
    assert json.loads((tmp_path / "tiny_export" / "model_index.json").read_text())["unet"] == [
        "diffusers",
        "UNet2DModel",
    ]
    big = write_run(tmp_path / "unet64", preset("unet64", base_channels=32), "eps", 50)
    out = main([f"ckpt={big}", f"out={tmp_path / 'unet64_export'}"])
    printed = capsys.readouterr().out
    why = "adapter UNet: diffusers' UNet2DModel cannot hold this model (num_heads=4 at the attention widths [128, 256]"
    assert why in printed and "; import ddpm.weights.diffusers_adapter, then DDPMPipeline" in printed
    assert json.loads((out / "model_index.json").read_text())["unet"] == [
        "ddpm.weights.diffusers_adapter",
        "DDPMUNet2DModel",
    ]
    x, t, _ = inputs(preset("unet64", base_channels=32))
    with torch.no_grad():
        torch.testing.assert_close(load_model(out).net(x, t), load_model(big).net(x, t), rtol=0, atol=0)


def test_export_cli_points_a_class_conditional_model_at_the_guided_loop(tmp_path, capsys):
    """DDPMPipeline passes no class_labels: a conditional UNet2DModel raises in it, the adapter draws unconditional
    samples; the export named DDPMPipeline alone for both."""
    cond = write_run(tmp_path / "cond", preset("unet_tiny", num_classes=3), "eps", 50)
    out = main([f"ckpt={cond}", f"out={tmp_path / 'cond_export'}"])
    printed = capsys.readouterr().out
    assert "class-conditional" in printed and "README.md's guided loop" in printed
    with pytest.raises(ValueError, match="class_labels should be provided"):  # what the message had advised
        diffusers.DDPMPipeline.from_pretrained(out)(batch_size=1, num_inference_steps=1)
    adapter = write_run(tmp_path / "adapter", preset("unet64", base_channels=32, num_classes=3), "eps", 50)
    main([f"ckpt={adapter}", f"out={tmp_path / 'adapter_export'}"])
    printed = capsys.readouterr().out
    assert "draws it unconditionally" in printed and "README.md's guided loop" in printed


NO_DIFFUSERS = """
import importlib.abc, runpy, sys
class NoDiffusers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "diffusers" or name.startswith("diffusers."):
            raise ImportError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, NoDiffusers())
sys.argv = ["python -m ddpm.export", *sys.argv[1:]]
runpy.run_module("ddpm.export", run_name="__main__")
"""


@pytest.mark.slow
def test_export_without_diffusers_is_one_line_naming_the_extra(tmp_path):
    ema = write_run(tmp_path, preset("unet_tiny"), "eps", 50)
    result = run("python", "-c", NO_DIFFUSERS, f"ckpt={ema}", f"out={tmp_path / 'out'}", check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "python -m ddpm.export needs diffusers, which is not installed: pip install -e '.[diffusers]'"
    ]
    assert not (tmp_path / "out").exists()
    # reading the folder needs no diffusers: sample.py's loader on an exported folder, diffusers blocked
    folder = export_diffusers(load_model(ema), tmp_path / "export")
    read = NO_DIFFUSERS.split("sys.argv")[0] + f"from ddpm.weights import load_model\nload_model({str(folder)!r})\n"
    run("python", "-c", read + "assert 'diffusers' not in sys.modules\n")


# --- model=diffusers_unet2d --------------------------------------------------------------------------


@pytest.mark.slow
def test_diffusers_backbone_compiles_and_guides():
    """DiffusersUNet2D compiles in place (eager backend: the same output), takes no labels as the null class,
    and ignores labels when unconditional, as our UNet."""
    model = VARIANTS["tiny_film_heads_emb"]
    net = randomise(DiffusersUNet2D(**arguments(model)))
    x, t, _ = inputs(model)
    with torch.no_grad():
        null = net(x, t, torch.full_like(t, 3))
        assert_same_output(null, net(x, t, None))
        net.compile(backend="eager")
        assert_same_output(null, net(x, t, None))
    plain = randomise(DiffusersUNet2D(**arguments(preset("unet_tiny", image_size=8, attention_resolutions=[4]))))
    with torch.no_grad():
        torch.testing.assert_close(plain(x, t, torch.zeros_like(t)), plain(x, t, None), rtol=0, atol=0)


@pytest.mark.slow
def test_train_resume_export_and_sample_with_the_diffusers_backbone(tmp_path):
    """python train.py model=diffusers_unet2d (class-conditional) trains, resumes from its checkpoint, exports
    natively (the UNet2DModel as it is), and sample.py draws the same images from the export as from ema.pt."""
    from helpers import TINY_RUN, sample, train

    run_dir = tmp_path / "run"
    common = ["model=diffusers_unet2d", "model.num_classes=10", "diffusion.p_uncond=0.1", f"hydra.run.dir={run_dir}"]
    train(*TINY_RUN, *common)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    resumed = train(*TINY_RUN, *common, "trainer.max_steps=9", f"ckpt_path={run_dir}")
    assert "Restored all states" in resumed.stdout + resumed.stderr
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 9 and (run_dir / "checkpoints" / "step_0000009.ckpt").is_file()
    out = tmp_path / "export"
    printed = run("python", "-m", "ddpm.export", f"ckpt={run_dir / 'ema.pt'}", f"out={out}").stdout
    assert "UNet2DModel" in printed
    unet = diffusers.UNet2DModel.from_pretrained(out, subfolder="unet")
    net = load_model(run_dir / "ema.pt").net
    assert all(torch.equal(unet.state_dict()[k.removeprefix("unet.")], v) for k, v in net.state_dict().items())
    drawn = {}
    for name, ckpt in (("pt", run_dir / "ema.pt"), ("folder", out)):
        sample(f"ckpt={ckpt}", "num_samples=4", "sampler.steps=4", "guidance=2", f"output_dir={tmp_path / name}")
        drawn[name] = np.load(tmp_path / name / "samples.npz")["images"]
    np.testing.assert_array_equal(drawn["folder"], drawn["pt"])


@pytest.mark.slow
def test_train_py_fine_tunes_from_and_sample_py_samples_a_diffusers_made_folder(tmp_path):
    """`python train.py init_from=<diffusers folder>` starts from its weights (a fresh optimizer: one step at a tiny LR
    leaves them as they were), a run whose model differs is refused naming the key, and `python sample.py
    ckpt=<diffusers folder>` draws images from it."""
    folder = diffusers_folder(tmp_path / "hub10", num_class_embeds=11)  # digits: 10 classes + the null class
    model = [
        f"model.{k}={v}".replace(" ", "") for k, v in (OUR_EQUIVALENT | {"num_classes": 10}).items() if v is not None
    ]
    common = [*model, "diffusion.prediction=v", "data.limit=64", "data.batch_size=16", "trainer.max_steps=1",
              "callbacks.sample_grid=null", "trainer.val_check_interval=1", "optim.lr=1e-12"]  # fmt: skip
    run = tmp_path / "run"
    result = train(*common, f"init_from={folder}", f"hydra.run.dir={run}")
    assert f"init_from: the weights of {folder}" in result.stdout
    trained = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for key, value in load_model(folder).net.state_dict().items():
        torch.testing.assert_close(trained[f"net.{key}"], value, atol=1e-6, rtol=0)
    refused = train(*common, "model.base_channels=8", f"init_from={folder}",
                    f"hydra.run.dir={tmp_path / 'other'}", check=False)  # fmt: skip
    assert refused.returncode != 0 and "model.base_channels (file 16, run 8)" in refused.stderr
    drawn = sample(f"ckpt={folder}", "num_samples=4", "labels=[0,1,2]", "sampler=ddim", "sampler.steps=3",
                   f"output_dir={tmp_path / 'samples'}")  # fmt: skip
    assert drawn.returncode == 0 and (tmp_path / "samples" / "samples.npz").is_file()
