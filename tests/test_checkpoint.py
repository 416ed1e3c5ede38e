"""ddpm.weights (torch files): safe loading with errors that say what to do, the _target_ allow-list, atomic
saves, EMA export."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import CONF
from safetensors.torch import save_file

from ddpm import atomic
from ddpm.atomic import atomic_save
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.models.unet import UNet
from ddpm.weights import CheckpointError, load_model
from ddpm.weights.model import CHECKPOINT_KEY, instantiate_local
from ddpm.weights.torch_file import EXPORT_FORMAT, export_ema, load_checkpoint


def run_config() -> dict:
    """A run config as train.py stores it: the tiny UNet preset and the linear schedule, read from conf/."""
    model = yaml.safe_load((CONF / "model" / "unet_tiny.yaml").read_text())
    diffusion = yaml.safe_load((CONF / "diffusion" / "linear.yaml").read_text())
    return {"model": model | {"num_classes": 10}, "diffusion": diffusion, "seed": 0}


def trained_like_net(config: dict) -> UNet:
    """The preset's UNet with every weight moved off its initial value (so a fresh model would not match)."""
    kwargs = {k: v for k, v in config["model"].items() if k != "_target_"}
    net = UNet(**kwargs)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=generator))
    return net


@pytest.fixture
def ema_file(tmp_path: Path) -> tuple[Path, UNet, dict]:
    config = run_config()
    net = trained_like_net(config)
    return export_ema(tmp_path / "run" / "ema.pt", net.state_dict(), config), net, config


# --- load_checkpoint: every failure is a CheckpointError naming the file and the fix -------------------


def raises_naming(path: Path, *phrases: str):
    return pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*" + ".*".join(map(re.escape, phrases)))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "last.ckpt"
    with raises_naming(path, "does not exist", "pass ckpt="):
        load_checkpoint(path)
    with raises_naming(tmp_path, "does not exist"):  # a folder is not a checkpoint either
        load_checkpoint(tmp_path)


# (seed, length) of random bytes; (17, 1), (21, 1) and (172, 2) once escaped as IndexError, struct.error, KeyError.
@pytest.mark.parametrize(("seed", "length"), [(17, 1), (21, 1), (172, 2), (62, 16), (0, 4096), (1, 100_000)])
def test_random_bytes(tmp_path: Path, seed: int, length: int) -> None:
    path = tmp_path / "noise.ckpt"
    path.write_bytes(np.random.default_rng(seed).bytes(length))
    with raises_naming(path) as info:
        load_checkpoint(path)
    assert "lightning-ddpm" in str(info.value) or "another checkpoint" in str(info.value)


def test_text_and_empty_files(tmp_path: Path) -> None:
    for name, content in {"notes.ckpt": b"step 1000: loss 0.03\n", "empty.ckpt": b""}.items():
        (tmp_path / name).write_bytes(content)
        with raises_naming(tmp_path / name):
            load_checkpoint(tmp_path / name)


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_checkpoint(ema_file: tuple[Path, UNet, dict], keep: float) -> None:
    path, _, _ = ema_file
    content = path.read_bytes()
    path.write_bytes(content[: int(len(content) * keep)])
    with raises_naming(path, "truncated or corrupt", "use another checkpoint") as info:
        load_checkpoint(path)
    cause = re.search(r"truncated or corrupt: (.*)\); use another", str(info.value)).group(1)
    assert cause and ". " not in cause and "..." not in cause, cause  # torch's first sentence, whole


def test_torch_file_of_another_project(tmp_path: Path) -> None:
    path = tmp_path / "resnet.pt"
    torch.save({"state_dict": {"fc.weight": torch.zeros(2, 2)}, "epoch": 3}, path)
    with raises_naming(path, "not a lightning-ddpm checkpoint", "ema_state_dict", "train.py"):
        load_checkpoint(path)
    torch.save([torch.zeros(1)], path)  # not even a dict
    with raises_naming(path, "not a lightning-ddpm checkpoint"):
        load_checkpoint(path)


class Payload:
    """Unpickling this object would create `marker`: safe loading must refuse it without running it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_protocol_0_pickle_naming_os_system_is_refused_as_code_not_called_damaged(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    path.write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with raises_naming(path, "safe loading refuses", "could run code"):
        load_checkpoint(path)


def test_pickled_code_is_refused_not_run(tmp_path: Path) -> None:
    path, marker = tmp_path / "evil.ckpt", tmp_path / "pwned"
    torch.save({CHECKPOINT_KEY: {}, "config": Payload(marker)}, path)
    assert not marker.exists()
    with raises_naming(path, "safe loading refuses"):
        load_checkpoint(path)
    assert not marker.exists(), "loading the checkpoint ran code from it"


def test_a_file_that_is_no_checkpoint_is_named_so_and_an_export_folders_file_points_at_the_folder(
    tmp_path: Path,
) -> None:
    """Before: every non-pickle file (a JSON, a PNG, a config.yaml) was reported as 'Python objects that safe
    loading refuses ... could run code'."""
    export = tmp_path / "export"
    (export / "unet").mkdir(parents=True)
    (export / "model_index.json").write_text('{"_class_name": "DDPMPipeline"}')
    (export / "unet" / "config.json").write_text("{}")
    (tmp_path / "grid.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    cases = [(export / "model_index.json", f"pass ckpt={export}"), (export / "unet" / "config.json", f"ckpt={export}"),
             (tmp_path / "grid.png", "ema.pt")]  # fmt: skip
    for path, advice in cases:
        with raises_naming(path, "is not a PyTorch checkpoint at all") as error:
            load_checkpoint(path)
        assert advice in str(error.value) and "safe loading" not in str(error.value)
    # the unet's weights and the unet folder itself (advised a run's ema.safetensors, and a VAE, before)
    save_file({"w": torch.zeros(1)}, export / "unet" / "diffusion_pytorch_model.safetensors")
    for path in (export / "unet" / "diffusion_pytorch_model.safetensors", export / "unet"):
        with pytest.raises(CheckpointError, match=rf"of the diffusers folder {export}: pass the folder"):
            load_model(path)  # the same words for ckpt= and init_from=


# --- instantiate_local: only classes of this package ----------------------------------------------------


@pytest.mark.parametrize(
    "node",
    [
        {"_target_": "os.system", "_args_": ["echo pwned"]},
        {"_target_": "ddpm.atomic.os.system", "_args_": ["echo pwned"]},  # starts with "ddpm." but is os.system
        {"_target_": "ddpm_evil.Thing"},  # a look-alike package
        {"_target_": "ddpm.atomic.atomic_save", "obj": 1, "path": "/tmp/x"},  # a ddpm function, not a class
        {"_target_": "ddpm.models.unet.UNet", "extra": {"_target_": "subprocess.run", "args": ["true"]}},
        {"_target_": "ddpm.models.unet.UNet", "hooks": [{"_target_": "builtins.exec", "_args_": ["1"]}]},
        {"_target_": "ddpm.models.unet.DoesNotExist"},
    ],
    ids=["os.system", "ddpm-prefixed-os.system", "look-alike", "ddpm-function", "nested", "in-list", "missing"],
)
def test_instantiate_local_refuses_foreign_targets(node: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(args))
    monkeypatch.setattr(atomic, "atomic_save", lambda *args, **kwargs: calls.append(args))
    with pytest.raises(CheckpointError, match="outside lightning-ddpm"):
        instantiate_local(node)
    assert calls == []


def test_instantiate_local_builds_this_package_classes() -> None:
    config = run_config()
    net = instantiate_local(config["model"])
    assert isinstance(net, UNet) and net.num_classes == 10 and net.image_size == 16
    diffusion = instantiate_local(config["diffusion"])
    assert isinstance(diffusion, GaussianDiffusion) and diffusion.num_timesteps == 1000


# --- atomic_save ---------------------------------------------------------------------------------------


def failing_save(obj: object, f) -> None:
    f.write(b"PK\x03\x04 half a checkpoint")
    raise OSError(28, "No space left on device")


def test_atomic_save_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "save", failing_save)
    target = tmp_path / "ckpts" / "ema.pt"
    with pytest.raises(OSError, match="No space left"):
        atomic_save({"a": torch.ones(2)}, target)
    assert list(target.parent.iterdir()) == []


def test_atomic_save_keeps_the_previous_file_when_a_save_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ema.pt"
    atomic_save({"v": torch.arange(3)}, target)
    before = target.read_bytes()
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        atomic_save({"v": torch.arange(5)}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ema.pt"]


def test_atomic_save_replaces_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "ema.pt"
    for n in (3, 5):
        assert atomic_save({"v": torch.arange(n)}, target) == target
        assert torch.equal(torch.load(target, weights_only=True)["v"], torch.arange(n))
    assert [p.name for p in tmp_path.iterdir()] == ["ema.pt"]  # no .ema.pt.tmp-<pid> left over


# --- export_ema + load_model ------------------------------------------------------------------------


def test_export_and_load_round_trip_exactly(ema_file: tuple[Path, UNet, dict]) -> None:
    path, net, config = ema_file
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == EXPORT_FORMAT and raw["config"] == config
    loaded = load_model(path)
    assert loaded.config == config
    original, restored = net.state_dict(), loaded.net.state_dict()
    assert original.keys() == restored.keys()
    for key, value in original.items():
        assert restored[key].dtype == value.dtype and torch.equal(restored[key], value), key
    assert not loaded.net.training and isinstance(loaded.diffusion, GaussianDiffusion)
    assert loaded.diffusion.schedule == "linear" and loaded.diffusion.num_timesteps == 1000
    x, t, y = torch.randn(2, 1, 16, 16), torch.tensor([10, 900]), torch.tensor([3, 10])  # 10: the null class
    with torch.no_grad():
        assert torch.equal(loaded.net(x, t, y), net.eval()(x, t, y))


def test_export_copies_the_weights(tmp_path: Path) -> None:
    config = run_config()
    net = trained_like_net(config)
    state = net.state_dict()
    path = export_ema(tmp_path / "ema.pt", state, config)
    first = next(iter(state))
    with torch.no_grad():
        state[first].add_(1.0)  # training goes on after the export
    assert not torch.equal(torch.load(path, weights_only=True)[CHECKPOINT_KEY][first], state[first])


def test_load_ema_model_from_a_lightning_style_checkpoint(tmp_path: Path) -> None:
    config = run_config()
    net = trained_like_net(config)
    path = tmp_path / "last.ckpt"
    lightning_like = {
        "epoch": 1,
        "global_step": 10,
        "state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
        "hyper_parameters": {"config": config},
        CHECKPOINT_KEY: net.state_dict(),
    }
    torch.save(lightning_like, path)
    loaded = load_model(path)
    assert all(torch.equal(loaded.net.state_dict()[k], v) for k, v in net.state_dict().items())


def test_load_ema_model_rejects_mismatched_or_configless_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "system", lambda *args: pytest.fail(f"os.system{args} was called"))
    config = run_config()
    state = trained_like_net(config).state_dict()
    wider = config | {"model": config["model"] | {"base_channels": 64}}
    path = export_ema(tmp_path / "wrong.pt", state, wider)
    with raises_naming(path, "do not fit"):
        load_model(path)
    torch.save({CHECKPOINT_KEY: state}, tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="no run config"):
        load_model(tmp_path / "bare.pt")
    evil = config | {"model": {"_target_": "ddpm.atomic.os.system", "_args_": ["echo pwned"]}}
    path = export_ema(tmp_path / "evil.pt", state, evil)
    with pytest.raises(CheckpointError, match="outside lightning-ddpm"):
        load_model(path)
