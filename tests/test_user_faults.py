"""Round 3 of ordinary mistakes and machine faults (config keys, numbers, failed writes, NaN weights): each ends in a
clear stop that names the key or file and the fix, or in a correct run. docs/reliability.md lists them."""

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CONF, PYTHON, REPO, TINY_RUN, compose, denoiser, env, sample, train
from omegaconf import OmegaConf

from ddpm.atomic import WriteError, atomic_save
from ddpm.config import UnknownKeyError, validate_config
from ddpm.config.overrides import misspelled
from ddpm.config.validate import ConfigValueError
from ddpm.diffusion.generate import NonFiniteSamplesError, generate
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.schedule import linear_betas
from ddpm.run_dir import follow_output_dir
from ddpm.weights import CheckpointError, load_model
from ddpm.weights.lightning_io import AtomicCheckpointIO
from ddpm.weights.model import CHECKPOINT_KEY
from ddpm.weights.safetensors_file import save_ema_safetensors
from ddpm.weights.torch_file import export_ema


def composed(*overrides: str, name: str = "train"):
    return compose(name, [*overrides, "paths.output_dir=/tmp/x" if name == "train" else "output_dir=/tmp/x"])


# --- 1. keys no part of the run reads are refused, naming the closest known key ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "refusal"),
    [
        ("+lr=3e-4", "lr: did you mean optim.lr?"),  # validate.py's
        ("lr=3e-4", "lr: no such key; did you mean optim.lr?"),  # after Hydra's "use +lr=3e-4"
    ],
)
def test_train_py_refuses_lr_naming_optim_lr(override: str, refusal: str, tmp_path: Path) -> None:
    result = train(override, *TINY_RUN, f"hydra.run.dir={tmp_path}", check=False)
    assert result.returncode != 0
    assert refusal in result.stderr, result.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "ema.pt").exists()


def test_misspelled_overrides_are_named_with_the_key_meant() -> None:
    """Hydra's refusal of `optim.lrr=1e-3` advises `+optim.lrr=1e-3`; misspelled() names optim.lr instead, for every
    misspelled key, in the config the other overrides compose (a sweep by its first value)."""
    found = misspelled("train", ["experiment=mnist", "optim.lrr=1e-3,2e-3", "model.base_chanels=64", "seed=3"])
    assert list(found) == ["optim.lrr", "model.base_chanels"]
    assert "did you mean optim.lr?" in found["optim.lrr"]
    assert "did you mean model.base_channels?" in found["model.base_chanels"]
    assert misspelled("sample", ["guidnace=3"]) == {"guidnace": "did you mean guidance? (set it with guidance=...)"}
    # a misspelled section (Hydra names only `trainr`), group or hydra key
    assert misspelled("train", ["trainr.max_steps=1", "experimnt=mnist", "hydra.run.dri=x"]) == {
        "trainr.max_steps": "did you mean trainer.max_steps? (set it with trainer.max_steps=...)",
        "experimnt": "did you mean experiment? (set it with experiment=...)",
        "hydra.run.dri": "did you mean hydra.run.dir? (set it with hydra.run.dir=...)"}  # fmt: skip
    assert misspelled("train", ["experiment=mnist", "optim.lr=1e-3,2e-3", "+optim.lrr=1"]) == {}  # composes
    assert misspelled("train", ["model=unet_mnst", "optim.lrr=1"]) == {}  # a missing option: Hydra lists the options
    # an argument the config does not list: how to set it, not the nearest listed key (the run's seed)
    assert misspelled("train", ["callbacks.sample_grid.seed=1"]) == {"callbacks.sample_grid.seed": (
        "an argument of ddpm.callbacks.sample_grid.SampleGrid that this config does not list; set it with "
        "+callbacks.sample_grid.seed=...")}  # fmt: skip
    # a typo of such an argument: that argument, not the closest listed key (trainer.limit_val_batches, max_steps)
    assert misspelled("train", ["trainer.limit_train_batchs=10", "trainer.max_tim=00:01:00:00"]) == {
        "trainer.limit_train_batchs": "did you mean trainer.limit_train_batches? (an argument this config does not "
        "list: +trainer.limit_train_batches=...)", "trainer.max_tim": "did you mean trainer.max_time? (an argument "
        "this config does not list: +trainer.max_time=...)"}  # fmt: skip
    assert (
        "every_n_train_steps"
        in misspelled("train", ["callbacks.checkpoint.every_n_step=5"])["callbacks.checkpoint.every_n_step"]
    )  # a listed key as close as an unlisted argument (every_n_epochs) wins


def test_encode_refuses_a_misspelled_key_in_two_lines_naming_the_key_meant(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, "-m", "ddpm.data.encode", "vea=vaes/mine", f"out={tmp_path}"], cwd=REPO,
                            env=env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: Could not override 'vea'" in result.stderr
    assert "vea: no such key; did you mean vae?" in result.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    ("override", "named", "closest"),
    [
        ("+lr=3e-4", "lr", "optim.lr"),
        (
            "+optim.learning_rate=3e-4",
            "optim.learning_rate",
            " lr, ",
        ),  # a synonym: no close spelling, optim's keys listed
        ("+data.batchsize=32", "data.batchsize", "data.batch_size"),  # a typo inside a _target_ node
        ("+seeed=1", "seeed", "seed"),  # a typo of a top-level key
        ("+trainer.max_step=10", "trainer.max_step", "trainer.max_steps"),  # Lightning's own arguments
        ("+callbacks.checkpoint.every_n_steps=5", "callbacks.checkpoint.every_n_steps", "every_n_train_steps"),
        ("+ema.decay_rate=0.9", "ema.decay_rate", "ema.decay"),
        ("+paths.outptu_dir=x", "paths.outptu_dir", "paths.output_dir"),  # entry sections (typing_extensions'
        ("+tune.aply=true", "tune.aply", "tune.apply"),  # TypedDict, which typing.is_typeddict did not see)
    ],
)
def test_unknown_keys_are_refused_with_the_closest_known_key(override: str, named: str, closest: str) -> None:
    with pytest.raises(UnknownKeyError, match="no part of the run reads") as info:
        validate_config(composed(override), entry="train")
    line = next(line for line in str(info.value).splitlines() if line.strip().startswith(f"{named}:"))
    assert closest in line, line


def test_an_unknown_key_near_an_unlisted_argument_is_told_to_add_it_with_plus() -> None:
    """`+trainer.max_tim=`: trainer.max_time is Trainer's argument, not in the config, so setting it needs `+` (without
    it Hydra refuses again); a key the config lists (trainer.max_steps) is set without `+`."""
    with pytest.raises(UnknownKeyError) as info:
        validate_config(composed("+trainer.max_tim=00:00:01:00", "+trainer.max_step=3"), entry="train")
    lines = str(info.value).splitlines()
    assert "trainer.max_tim: did you mean trainer.max_time? (set it with +trainer.max_time=...)" in lines[1]
    assert "trainer.max_step: did you mean trainer.max_steps? (set it with trainer.max_steps=...)" in lines[2]


def test_sample_py_keys_are_checked_the_same_way() -> None:
    with pytest.raises(ConfigValueError, match=r"metrics\.batch_size=0 is not valid"):  # named, not "metrics={...}"
        validate_config(composed("metrics.batch_size=0", name="sample"), entry="sample")
    with pytest.raises(UnknownKeyError, match=r"guidance_scale: did you mean guidance\?"):
        validate_config(composed("+guidance_scale=3", name="sample"), entry="sample")
    with pytest.raises(UnknownKeyError, match=r"sampler\.stepz: did you mean sampler\.steps\?"):
        validate_config(composed("+sampler.stepz=3", name="sample"), entry="sample")


def test_free_form_keys_stay_allowed() -> None:
    """Names under callbacks/logger, keys referenced by interpolation and **kwargs targets are free-form."""
    validate_config(
        composed(
            "logger=[csv,wandb]",
            "+logger.wandb.notes=a note for wandb.init",  # WandbLogger(**kwargs) passes it to wandb.init
            "+callbacks.extra={_target_: lightning.pytorch.callbacks.LearningRateMonitor}",
            "data=mnist",  # data.root is read by ${data.root} in data.source.root
        ),
        entry="train",
    )


def test_a_target_that_cannot_be_imported_is_an_error_in_tests_and_a_warning_for_users(monkeypatch) -> None:
    cfg = composed("+callbacks.bad={_target_: ddpm.callbacks.nowhere.Missing}")
    with pytest.raises(TypeError, match=r"callbacks\.bad\._target_: ddpm\.callbacks\.nowhere\.Missing cannot be"):
        validate_config(cfg, entry="train")  # DDPM_STRICT_CONFIG=1 in the tests (conftest.py)
    monkeypatch.setenv("DDPM_STRICT_CONFIG", "0")
    with pytest.warns(UserWarning, match=r"callbacks\.bad\._target_.*cannot be imported"):
        validate_config(cfg, entry="train")


# --- 9. whole numbers written as floats: accepted for int keys, else refused naming the key ---------------------


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [("num_samples=2e1", "num_samples", 20), ("num_samples=20.0", "num_samples", 20),
     ("batch_size=1e1", "batch_size", 10), ("labels=[1.0,2e0]", "labels", [1, 2]), ("seed=1e3", "seed", 1000)],
)  # fmt: skip
def test_sample_config_reads_whole_floats_as_ints(override: str, key: str, expected) -> None:
    cfg = composed(override, name="sample")
    checked = validate_config(cfg, entry="sample")
    assert checked[key] == expected and OmegaConf.to_container(cfg)[key] == expected  # written back for later readers
    assert OmegaConf.to_container(cfg)[key] == expected and repr(OmegaConf.to_container(cfg)[key]) == repr(expected)


@pytest.mark.parametrize(
    ("override", "named"),
    [("num_samples=20.5", "num_samples=20.5 is not int"), ("trainer.max_steps=1e-1", "trainer.max_steps=0.1"),
     ("data.batch_size=6.4e1", None), ("optim.warmup_steps=1e2", None)],
)  # fmt: skip
def test_fractional_numbers_for_int_keys_are_refused_naming_the_key(override: str, named: str | None) -> None:
    name = "sample" if override.startswith("num_samples") else "train"
    cfg = composed(override, name=name)
    if named is None:  # a whole number: accepted, and an int afterwards
        validate_config(cfg, entry=name)
        assert isinstance(OmegaConf.select(cfg, override.split("=")[0]), int)
        return
    with pytest.raises(TypeError, match="config values of the wrong type") as info:
        validate_config(cfg, entry=name)
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [(None, 1.0), ("trainer.limit_val_batches=1.0", 1.0), ("trainer.val_check_interval=1.0", 1.0),
     ("trainer.limit_val_batches=0.5", 0.5), ("trainer.limit_val_batches=2.0", 2), ("trainer.max_steps=1e2", 100),
     ("data.val_size=1e2", 100), ("data.val_size=0.5", 0.5)],
)  # fmt: skip
def test_a_whole_float_of_an_int_or_float_setting_keeps_its_meaning(override: str | None, expected) -> None:
    """Lightning reads a float limit as a fraction and an int as a count: limit_val_batches=1.0 (the default) is
    every validation batch, 1 a single one (before: every run validated on one batch). A whole float above 1 can
    only be a count (data.val_size=1e2 was refused: its hint `float | int` kept 100.0 a float)."""
    cfg = composed(*([override] if override else []))
    validate_config(cfg, entry="train")
    key = override.split("=")[0] if override else "trainer.limit_val_batches"
    value = OmegaConf.select(cfg, key)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (["optim.decay=cosine", "trainer.max_steps=-1", "trainer.max_epochs=1"],
         r"optim.decay=cosine runs the LR down to trainer.max_steps, which is -1 .*optim.decay=none"),
        (["data.image_size=24"], r"data.image_size=24 but model.image_size=16: .*data.image_size=16 or model.image"),
        (["data.channels=3"], r"data.channels=3 but model.in_channels=1"),
        (["trainer.max_steps=0"], r"trainer.max_steps=0 trains nothing .*ema.pt"),  # exported untrained weights, rc 0
        (["trainer.max_epochs=0"], r"trainer.max_epochs=0 trains nothing"),
        (["trainer.precision=64-true"], r"trainer.precision=64-true: float64 .* 32-true"),
        (["+tune.apply=true"], r"tune holds \['apply'\] but no LR range test: choose it with tune=lr_find"),
        (["compile=true", "module.compile_backend=eagr"], r"module.compile_backend='eagr' is not a torch.compile"),
        (["callbacks.sample_grid.sampler.steps=2000"],
         r"callbacks.sample_grid.sampler.steps=2000 must be between 1 and the model's T=1000"),
        (["+sampler@callbacks.sample_grid.sampler=edm", "callbacks.sample_grid.sampler.sigma_min=500"],
         r"callbacks.sample_grid.sampler.sigma_min=500 and callbacks.sample_grid.sampler.sigma_max=157.* no grid"),
    ],
)  # fmt: skip
def test_keys_that_disagree_are_refused_before_any_data_is_read(overrides: list[str], refusal: str) -> None:
    """Each failed later: in configure_optimizers, at the first batch, in the sanity check (float64 against float32
    weights, naming no key), or at the first grid (after that many training steps)."""
    from ddpm.training import resolve_config

    with pytest.raises(ValueError, match=refusal):
        resolve_config(composed(*overrides))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [(["data=image_folder"], "data.root"), (["data=webdataset"], "data.urls"), (["data=latents"], "data.root"),
     (["+callbacks/fid=classifier"], "callbacks.fid.features")],
)  # fmt: skip
def test_a_value_left_unset_is_named_with_its_key(overrides: list[str], key: str) -> None:
    """data=image_folder without data.root: OmegaConf's InterpolationToMissingValueError and a trace of 20 frames (its
    root reached through an interpolation); data=latents: the string '???' taken for a folder."""
    from ddpm.training import resolve_config

    with pytest.raises(
        ConfigValueError, match=rf"^{re.escape(key)} has no value \(\?\?\? in its config file\): set it"
    ):
        resolve_config(composed(*overrides))


def test_sample_py_names_a_device_that_is_not_one() -> None:
    from ddpm.sampling.runtime import resolve_device

    with pytest.raises(ValueError, match=r"device='gpu' is not a device; use auto, cpu, cuda"):
        resolve_device("gpu")  # torch's own error listed its 20 device types


@pytest.mark.slow
def test_train_py_refuses_a_grid_sampler_the_model_cannot_take_before_a_step(tmp_path: Path) -> None:
    result = train(*TINY_RUN, "callbacks.sample_grid.sampler.steps=2000", f"hydra.run.dir={tmp_path}", check=False)
    assert result.returncode == 1 and "callbacks.sample_grid.sampler.steps=2000 must be" in result.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "csv").exists()


def test_a_fractional_val_check_interval_needs_validation_at_epoch_ends() -> None:
    """1.0 stays a fraction (above); under the default check_val_every_n_epoch=null Lightning refuses one without
    naming a fix (before the whole-float fix, 1.0 silently meant every batch)."""
    from ddpm.training import check_validation_schedule, checkpoint_options

    with pytest.raises(ValueError, match=r"trainer.check_val_every_n_epoch=1.*trainer.val_check_interval=500"):
        check_validation_schedule({"val_check_interval": 1.0, "check_val_every_n_epoch": None})
    check_validation_schedule({"val_check_interval": 1.0, "check_val_every_n_epoch": 1})
    check_validation_schedule({"val_check_interval": 500, "check_val_every_n_epoch": None})
    # checkpoints at their step while monitoring `step`; a validation metric keeps Lightning's save at validation
    node = {
        "_target_": "lightning.pytorch.callbacks.ModelCheckpoint",
        "monitor": "step",
        "save_on_train_epoch_end": None,
    }
    assert checkpoint_options(node)["save_on_train_epoch_end"] is True
    assert "save_on_train_epoch_end" not in checkpoint_options(node | {"monitor": "val/loss"})
    assert "save_on_train_epoch_end" not in checkpoint_options(node | {"save_on_train_epoch_end": False})


@pytest.mark.slow
def test_sample_py_num_samples_2e1_draws_20_images(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(*TINY_RUN, "trainer.max_steps=2e0", f"hydra.run.dir={run}")  # max_steps=2e0 trains 2 steps
    assert OmegaConf.load(run / "config.yaml").trainer.max_steps == 2 and (run / "ema.pt").is_file()
    sample(f"ckpt={run}/ema.pt", "num_samples=2e1", "sampler.steps=2", f"output_dir={tmp_path / 's'}")
    with np.load(tmp_path / "s" / "samples.npz") as npz:
        assert npz["images"].shape[0] == 20
    refused = sample(f"ckpt={run}/ema.pt", "num_samples=2.5e1", "batch_size=2.5", f"output_dir={tmp_path}", check=False)
    assert refused.returncode != 0 and "batch_size=2.5 is not" in refused.stderr


# --- 6. a failed write names the path, the bytes needed and free, and what to do; nothing is lost ----------------


def test_torch_zip_writer_failure_is_one_clear_error(tmp_path: Path) -> None:
    """torch.save under a file-size limit raises RuntimeError('unexpected pos'), not OSError: caught the same way."""
    target = tmp_path / "big.pt"
    atomic_save({"w": torch.zeros(10)}, target)
    before = target.read_bytes()
    script = (
        "import resource, torch, sys; from ddpm.atomic import atomic_save;"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000));"
        f"atomic_save({{'w': torch.zeros(1_000_000)}}, {str(target)!r})"
    )
    result = subprocess.run([PYTHON, "-c", script], env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "WriteError" in result.stderr and f"could not write {target}" in result.stderr
    assert "needs about 4.0 MB" in result.stderr and "free on its disk" in result.stderr and "ulimit" in result.stderr
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["big.pt"]  # no temp file


@pytest.mark.slow
def test_a_file_size_limit_mid_run_stops_with_the_message_and_keeps_earlier_checkpoints(tmp_path: Path) -> None:
    """A real train.py run: after its first checkpoints are on disk, the process gets a 64 KB file-size limit (as
    `ulimit -f` would set; prlimit on the running process), so its next checkpoint cannot be written."""
    run = tmp_path / "run"
    argv = [PYTHON, "train.py", *TINY_RUN, "trainer.max_steps=400", "callbacks.checkpoint.every_n_train_steps=2",
            "callbacks.checkpoint.save_top_k=-1", "trainer.val_check_interval=1000",
            f"hydra.run.dir={run}"]  # fmt: skip
    process = subprocess.Popen(argv, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "step_0000004.ckpt").exists():
            assert process.poll() is None and time.monotonic() < deadline, "the run ended before its checkpoints"
            time.sleep(0.1)
        time.sleep(0.5)  # step 4's last.ckpt copy lands
        kept = {p.name: p.read_bytes() for p in (run / "checkpoints").glob("step_*.ckpt")}
        resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (64_000, 64_000))
        _, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
    assert process.returncode != 0
    assert "could not write" in stderr and "needs about" in stderr and "free on its disk" in stderr, stderr[-3000:]
    assert "callbacks.checkpoint.dirpath" in stderr and "ckpt_path=" in stderr
    for name, data in kept.items():  # earlier checkpoints intact
        assert (run / "checkpoints" / name).read_bytes() == data
        torch.load(run / "checkpoints" / name, weights_only=True)
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]  # no temp file left


# --- 10. weights holding NaN are refused at load; a sampler that produces NaN stops -----------------------------


def nan_run(folder: Path) -> dict[str, Path]:
    """An ema.pt, ema.safetensors and a Lightning-style .ckpt of the tiny preset with one NaN conv filter."""
    model = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "unet_tiny.yaml"))
    diffusion = OmegaConf.to_container(OmegaConf.load(CONF / "diffusion" / "linear.yaml"))
    config = {"model": model, "diffusion": diffusion}
    from hydra.utils import instantiate

    state = instantiate(model).state_dict()
    state["conv_in.weight"][0] = float("nan")
    ckpt = folder / "last.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in state.items()}, CHECKPOINT_KEY: state, "global_step": 3,
                "optimizer_states": [], "loops": {}, "hyper_parameters": {"config": config}}, ckpt)  # fmt: skip
    return {
        "pt": export_ema(folder / "ema.pt", state, config),
        "safetensors": save_ema_safetensors(folder / "ema.safetensors", state, config),
        "ckpt": ckpt,
    }


def test_nan_weights_are_refused_by_every_loader_naming_the_tensor(tmp_path: Path) -> None:
    files = nan_run(tmp_path)
    for kind in ("pt", "safetensors", "ckpt"):
        with pytest.raises(CheckpointError, match=r"conv_in\.weight.*NaN or inf.*earlier checkpoint"):
            load_model(files[kind])
    with pytest.raises(CheckpointError, match=r"conv_in\.weight.*NaN or inf.*ckpt_path="):
        AtomicCheckpointIO().load_checkpoint(files["ckpt"])  # a resume


@pytest.mark.slow
def test_sample_py_on_nan_weights_writes_nothing_and_names_the_tensor(tmp_path: Path) -> None:
    files = nan_run(tmp_path)
    out = tmp_path / "samples"
    result = sample(f"ckpt={files['pt']}", "num_samples=4", "sampler.steps=2", f"output_dir={out}", check=False)
    assert result.returncode != 0 and "conv_in.weight" in result.stderr and "NaN or inf" in result.stderr
    assert not (out / "grid.png").exists() and not (out / "samples.npz").exists()
    export = subprocess.run([PYTHON, "-m", "ddpm.export", f"ckpt={files['safetensors']}", f"out={tmp_path / 'x'}"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert export.returncode == 1 and "conv_in.weight" in export.stderr and not (tmp_path / "x").exists()


def test_a_sampler_that_produces_nan_stops_instead_of_writing_black_images() -> None:
    calls = []

    def net(x, t, y):  # outputs that turn NaN on the third call (clipping would hide inf, not NaN)
        calls.append(1)
        return torch.full_like(x, float("nan") if len(calls) >= 3 else 0.1)

    with pytest.raises(NonFiniteSamplesError, match=r"NaN/inf images \(batch of samples 0\.\.3\).*not finite"):
        generate(denoiser(net, linear_betas(1000)), DDIMSampler(steps=4), (4, 1, 4, 4), batch_size=4)


def test_write_error_is_an_oserror_for_callers_that_catch_those() -> None:
    assert issubclass(WriteError, OSError) and os.strerror(28)


# --- 7 (sibling). sample.py never writes over another call's images -------------------------------------------


@pytest.mark.slow
def test_sample_py_into_a_folder_holding_samples_is_refused_unless_overwrite(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "samples"
    train(*TINY_RUN, "trainer.max_steps=2", f"hydra.run.dir={run}")
    out.mkdir()
    shutil.copy(run / "ema.pt", out / "ema.pt")  # a model kept beside its samples: not a training run
    sample(f"ckpt={out}/ema.pt", "num_samples=4", "sampler.steps=2", f"output_dir={out}")  # Hydra's folder too:
    assert "- 4 images in " in (out / "sample.log").read_text() and (out / ".hydra" / "overrides.yaml").is_file()
    first, record = (out / "samples.npz").read_bytes(), (out / ".hydra" / "overrides.yaml").read_text()
    refused = sample(f"ckpt={run}/ema.pt", "num_samples=8", "sampler.steps=2", f"output_dir={out}", check=False)
    assert refused.returncode != 0 and "output_dir=" in refused.stderr and "overwrite=true" in refused.stderr
    assert (out / "samples.npz").read_bytes() == first  # untouched, and the call's record (refused before Hydra):
    assert (out / ".hydra" / "overrides.yaml").read_text() == record and "num_samples=4" in record
    (out / "notes.txt").write_text("mine")  # a file of the user's: overwrite=true moves the call's files only
    sample(f"ckpt={run}/ema.pt", "num_samples=8", "sampler.steps=2", f"hydra.run.dir={out}", "overwrite=true")
    (moved,) = out.glob("replaced-*")
    assert (moved / "samples.npz").read_bytes() == first and (out / "samples.npz").read_bytes() != first
    assert sorted(p.name for p in moved.iterdir()) == [".hydra", "grid.png", "sample.log", "samples.npz"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "ema.pt").is_file()
    # into the training run's own folder: refused even with overwrite=true (before: Hydra's .hydra/ of the run was
    # replaced, and overwrite=true moved its checkpoints, config and ema.pt aside)
    kept = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    refused = sample(f"ckpt={run}/ema.pt", "num_samples=4", f"output_dir={run}", "overwrite=true", check=False)
    assert refused.returncode != 0 and f"output_dir={run} holds a training run" in refused.stderr, refused.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == kept
    assert not list(tmp_path.rglob(".running"))  # each call's mark went with it

    # Two calls into one folder at once (the same output_dir, or the default folder's second): both passed the
    # check before either wrote, both exited 0, and the later one's files replaced the other's.
    other, busy = tmp_path / "other", subprocess.Popen(["sleep", "60"])
    other.mkdir()
    (other / ".running").write_text(f"{socket.gethostname()} {busy.pid}")  # a live call that has not written yet
    try:
        refused = sample(f"ckpt={run}/ema.pt", "num_samples=4", "sampler.steps=2", f"output_dir={other}", check=False)
    finally:
        busy.kill(), busy.wait()
    assert refused.returncode != 0 and f"is being written by another process (pid {busy.pid}" in refused.stderr
    assert "give each call its own output_dir" in refused.stderr and not (other / "samples.npz").exists()
    sample(f"ckpt={run}/ema.pt", "num_samples=4", "sampler.steps=2", f"output_dir={other}")  # that one is gone
    assert (other / "samples.npz").is_file() and not (other / ".running").exists()


def test_output_dir_names_hydras_run_folder_unless_one_is_named() -> None:
    assert follow_output_dir(["sample.py", "ckpt=a", "output_dir=out/x"]) == [
        "sample.py", "ckpt=a", "output_dir=out/x", "hydra.run.dir=out/x"]  # fmt: skip
    for kept in (["sample.py", "output_dir=x", "hydra.run.dir=y"], ["sample.py", "-m", "output_dir=x"], ["sample.py"]):
        assert follow_output_dir(kept) == kept


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (["module=vae", "model=vae_mnist", "~diffusion", "callbacks=vae"],
         r"callbacks\.sample_grid=\{'every_n_steps': 1500, 'sampler': \{'steps': 100\}\} has no _target_"),
        (["ema=null"], r"ema=None: every run keeps an EMA .* ema\.decay=0 keeps the live weights"),
    ],
)  # fmt: skip
def test_a_node_without_its_config_is_refused_before_it_is_built(overrides: list[str], refusal: str) -> None:
    """The default experiment's sample-grid keys merged onto callbacks=vae's sample_grid: null made a dict without
    _target_, built into a DictConfig that Lightning took for a callback (crashing after setup); ema=null crashed
    inside Lightning. Both are refused by the validator, naming the key."""
    with pytest.raises(ConfigValueError, match=refusal):
        validate_config(composed(*overrides), entry="train")
    validate_config(composed(*overrides, "~experiment") if "~diffusion" in overrides else composed(), entry="train")


def test_a_study_that_maximizes_ranks_its_summary_best_first() -> None:
    for study in ("optuna", "mnist_quality"):
        cfg = compose(
            "train", [f"hparams_search={study}", "hydra.sweeper.direction=maximize"], return_hydra_config=True
        )
        assert OmegaConf.select(cfg, "hydra.callbacks.summary.direction") == "maximize"  # was minimize
