"""The diffusers pipeline folder of a run's EMA model: `export_diffusers` writes it; `load_export` reads back the
adapter kind (diffusers_native.py the native kind).

Two kinds of folder, both a DDPMPipeline with exactly our schedule (diffusers_files.scheduler_config):

- native (diffusers_native.py): the unet is diffusers' own UNet2DModel, with our weights mapped onto it; diffusers
  alone loads it. Written for every model UNet2DModel expresses (ddpm.models.diffusers_unet.unet2d_config).
- adapter (this file): the unet is `ddpm.weights.diffusers_adapter.DDPMUNet2DModel`, our UNet inside a
  diffusers ModelMixin; loading it needs lightning-ddpm imported. Written where the model is not expressible
  (`fallback_reason` says why), or with adapter=True.

Writing needs diffusers (its own `DDPMPipeline.save_pretrained`); reading needs only JSON and safetensors, so
sample.py takes ckpt=<folder> without diffusers. How to use a folder in diffusers: `python -m ddpm.export --help`.
"""

import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ddpm.atomic import atomic_folder, tensor_bytes
from ddpm.models.diffusers_unet import UNET_DEFAULTS, NotUNet2D
from ddpm.models.unet import UNet
from ddpm.weights.diffusers_files import (
    RUN_CONFIG,
    WEIGHTS,
    diffusion_from_scheduler,
    read_json,
    read_weights,
    rebuild,
    scheduler_config,
)
from ddpm.weights.diffusers_native import (
    NATIVE_UNET,
    UNET_TARGET,
    WRAPPER_TARGET,
    native_unet2d_config,
    network_state,
    unet2d_state,
    write_native,
)
from ddpm.weights.model import CheckpointError, LoadedModel

ADAPTER = ["ddpm.weights.diffusers_adapter", "DDPMUNet2DModel"]
EDM_TARGET = "ddpm.diffusion.edm.EDMDiffusion"
LEGACY_ADAPTERS = (ADAPTER, ["ddpm.diffusers_adapter", "DDPMUNet2DModel"])  # folders exported before the move
# Every file an export writes, in order (diffusers' save_pretrained: each component, then model_index.json; then
# ddpm_config.json); a folder holding any other is not ours to replace.
EXPORT_FILES = (
    "unet/config.json",
    f"unet/{WEIGHTS}",
    "scheduler/scheduler_config.json",
    "model_index.json",
    RUN_CONFIG,
    "vae/config.json",  # a latent model's VAE (diffusers' AutoencoderKL): its decoder turns samples into images
    f"vae/{WEIGHTS}",  # its weights: this name, or whatever the VAE folder holds (vae_weights)
)
# UNet arguments that describe the network (checkpoint_activations is a training-time switch, left out).
UNET_ARGS = [p for p in inspect.signature(UNet.__init__).parameters if p not in ("self", "checkpoint_activations")]


def unet_arguments(model_config: dict[str, Any]) -> dict[str, Any]:
    """The adapter's config from the run's model node; only our UNet (or model=diffusers_unet2d, the same network
    under UNet2DModel's names) can be exported as the adapter."""
    if model_config.get("_target_") not in (UNET_TARGET, WRAPPER_TARGET):
        raise ValueError(
            f"model._target_={model_config.get('_target_')!r}: only {UNET_TARGET} and {WRAPPER_TARGET} can be "
            "exported as the adapter"
        )
    unknown = sorted(set(model_config) - {*UNET_ARGS, "_target_", "checkpoint_activations"})
    if unknown:
        raise ValueError(f"model config keys {unknown} are not UNet arguments; cannot export")
    return {k: model_config[k] for k in UNET_ARGS if k in model_config}


EDM_REASON = (
    "an EDM model (diffusion=edm): its preconditioning around the network (c_in, c_skip, c_out) is not part of "
    "UNet2DModel; the adapter applies it and returns eps"
)


def edm_arguments(diffusion: Any) -> dict[str, Any]:
    """The adapter's EDM preconditioning of `diffusion` (none for the DDPM family)."""
    if diffusion.sigma_data is None:
        return {}
    return {"edm_sigma_data": diffusion.sigma_data, "edm_sigmas": diffusion.sigmas64().tolist()}


def fallback_reason(model_config: dict[str, Any], diffusion_config: dict[str, Any] | None = None) -> str | None:
    """Why the model cannot be written as diffusers' UNet2DModel (None: it can); ValueError for a model that
    cannot be exported at all."""
    if diffusion_config is not None and diffusion_config.get("_target_") == EDM_TARGET:
        unet_arguments(model_config)  # only our UNet has the adapter
        return EDM_REASON
    try:
        native_unet2d_config(model_config)
    except NotUNet2D as error:
        return str(error)
    return None


def export_diffusers(loaded: LoadedModel, out: str | os.PathLike, *, adapter: bool = False) -> Path:
    """Write the diffusers pipeline folder of `loaded` (a run's EMA model) at `out`: native UNet2DModel where
    `fallback_reason` is None and not `adapter`, else the adapter folder. Whole or not at all (atomic_folder: a
    hidden folder beside `out`, swapped in when complete); a previous export at `out` is replaced, any other
    folder refused (check_replaceable)."""
    out = Path(out).expanduser()
    check_replaceable(out)
    model_config = dict(loaded.config["model"])
    native = not adapter and fallback_reason(model_config, dict(loaded.config["diffusion"])) is None
    size = tensor_bytes(loaded.net.state_dict()) + 2 * len(json.dumps(scheduler_config(loaded.diffusion)))
    fix = "Free disk space, or pass another out=<folder> (on a disk with room)"
    write = write_native if native else write_adapter
    vae = (loaded.config.get("latent") or {}).get("vae")
    size += vae_bytes(Path(vae)) if vae else 0

    def write_all(folder: Path) -> Path:
        write(loaded, folder)
        return add_vae(folder, loaded.config["latent"]) if vae else folder

    return atomic_folder(out, write_all, size=size, fix=fix, files=EXPORT_FILES)


def vae_weights(name: str) -> bool:
    """A latent export's VAE weights file (any name: add_vae copies the VAE folder's weights as they are)."""
    return name.startswith("vae/") and "/" not in name[4:] and name.endswith((".safetensors", ".bin", ".index.json"))


def vae_bytes(source: Path) -> int:
    """The size of what add_vae copies (0 where the folder is gone: add_vae refuses it)."""
    from ddpm.models.vae import weight_files

    files = [source / "config.json", *weight_files(source)] if (source / "config.json").is_file() else []
    return sum(f.stat().st_size for f in files)


def add_vae(folder: Path, latent: dict[str, Any]) -> Path:
    """A latent model's VAE into the export, as `vae/` (its config and weights, byte for byte: the same identity),
    named in model_index.json (diffusers' AutoencoderKL), the scheduler's clip_sample off; refused if the folder no
    longer holds the VAE the latents were encoded with."""
    from ddpm.models.vae import folder_identity, weight_files

    source = Path(latent["vae"])
    weights = weight_files(source) if (source / "config.json").is_file() else []
    if not weights or folder_identity(source) != latent["vae_identity"]:
        raise CheckpointError(
            f"the model was trained on latents of the VAE {latent['vae_identity']} in {source}, which no longer "
            "holds it; restore that folder to export the model with its decoder"
        )
    (folder / "vae").mkdir()
    indexes = sorted(source.glob("*.index.json"))  # sharded weights: diffusers reads the shards through it
    for path in (source / "config.json", *weights, *indexes):  # what the identity is of: the same identity there
        shutil.copyfile(path, folder / "vae" / path.name)
    index = read_json(folder / "model_index.json", folder)
    (folder / "model_index.json").write_text(json.dumps(index | {"vae": ["diffusers", "AutoencoderKL"]}, indent=2))
    scheduler = folder / "scheduler" / "scheduler_config.json"  # [-1, 1] is the pixels' range: latents keep theirs
    scheduler.write_text(json.dumps(read_json(scheduler, folder) | {"clip_sample": False}, indent=2))
    return folder


def write_adapter(loaded: LoadedModel, out: Path) -> Path:
    """The adapter folder of `loaded` at `out` (diffusers' save_pretrained, plus ddpm_config.json)."""
    from diffusers import DDPMPipeline, DDPMScheduler

    from ddpm.weights.diffusers_adapter import DDPMUNet2DModel

    model, state = dict(loaded.config["model"]), loaded.net.state_dict()
    if model["_target_"] == WRAPPER_TARGET:  # the adapter holds our UNet: the same network under our names
        state = network_state(unet2d_state(loaded.net, model), model | {"_target_": UNET_TARGET})
        model["_target_"] = UNET_TARGET
    unet = DDPMUNet2DModel(**unet_arguments(model), **edm_arguments(loaded.diffusion))
    unet.net.load_state_dict(state)
    scheduler = DDPMScheduler(**scheduler_config(loaded.diffusion))
    DDPMPipeline(unet=unet.eval(), scheduler=scheduler).save_pretrained(out, safe_serialization=True)
    (out / RUN_CONFIG).write_text(json.dumps(loaded.config | {"model": model}, indent=2) + "\n")
    return out


def check_replaceable(out: Path) -> None:
    """FileExistsError unless `out` is missing, empty, or one of our exports, whole or cut short by a kill (every
    file one an export writes; its model_index.json, where there is one, names our unet beside ddpm_config.json).
    Another project's diffusers pipeline, or any other file, is never replaced."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise FileExistsError(
            f"out={out} exists and is not an export folder (a file or link); nothing was written. Pass a new folder"
        )
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir()) if out.exists() else []
    others = [name for name in files if name not in EXPORT_FILES and not vae_weights(name)]
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise FileExistsError(
            f"out={out} exists and is not an export folder: it holds {shown}, which python -m ddpm.export does "
            "not write; nothing was written. Pass a new or empty folder (or delete that one first)"
        )
    if "model_index.json" not in files:
        return  # empty, or an export killed before it wrote model_index.json (diffusers writes it last)
    try:
        unet = json.loads((out / "model_index.json").read_text()).get("unet")
    except (OSError, ValueError, AttributeError):
        unet = "unreadable"
    if RUN_CONFIG not in files or unet not in (NATIVE_UNET, *LEGACY_ADAPTERS):
        raise FileExistsError(
            f"out={out} holds a diffusers pipeline that python -m ddpm.export did not write (model_index.json's unet "
            f"{unet}{'' if RUN_CONFIG in files else f', no {RUN_CONFIG}'}): it is not replaced and nothing was "
            "written. Pass a new or empty folder (or delete that one first)"
        )


def load_export(folder: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedModel:
    """Rebuild the UNet and schedule of an adapter folder written by export_diffusers (no diffusers, no
    unpickling)."""
    folder = Path(folder).expanduser()
    index = read_json(folder / "model_index.json", folder)
    if index.get("unet") not in LEGACY_ADAPTERS:
        raise CheckpointError(
            f"{folder} is a diffusers folder whose unet is {index.get('unet')}, not lightning-ddpm's {ADAPTER}; "
            "load it with ddpm.weights.load_model, or pass a folder written by python -m ddpm.export"
        )
    unet_config = read_json(folder / "unet" / "config.json", folder)
    scheduler = read_json(folder / "scheduler" / "scheduler_config.json", folder)
    arguments = {k: unet_config[k] for k in UNET_ARGS if k in unet_config}
    if (folder / RUN_CONFIG).is_file():
        config = read_json(folder / RUN_CONFIG, folder)
        if not isinstance(config, dict):
            raise CheckpointError(f"{folder / RUN_CONFIG} has no diffusion section; re-export")
        try:
            expected = json.loads(json.dumps(unet_arguments(dict(config.get("model") or {}))))
        except ValueError as error:
            raise CheckpointError(f"{folder / RUN_CONFIG}: {error}; re-export with python -m ddpm.export") from error
        defaults = json.loads(json.dumps({k: v for k, v in UNET_DEFAULTS.items() if k in UNET_ARGS}))
        expected, found = {**defaults, **expected}, {**defaults, **arguments}  # export fills in the defaults
        differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        if differ:  # the network is built from unet/config.json, the run config reported from ddpm_config.json
            raise CheckpointError(
                f"{folder}: unet/config.json's {differ} disagree with {RUN_CONFIG}'s model; the folder was edited; "
                "re-export with python -m ddpm.export"
            )
    elif unet_config.get("edm_sigma_data") is not None:
        raise CheckpointError(
            f"{folder} holds an EDM model (unet/config.json: edm_sigma_data) but lacks {RUN_CONFIG}, which names its "
            "noise levels and training settings; re-export it with python -m ddpm.export"
        )
    else:
        diffusion = diffusion_from_scheduler(scheduler, folder)
        config = {"model": {"_target_": UNET_TARGET, **arguments}, "diffusion": diffusion}
    state = {k.removeprefix("net."): v for k, v in read_weights(folder).items()}
    loaded = rebuild(folder, {**config, "model": {"_target_": UNET_TARGET, **arguments}}, state, scheduler, device)
    return LoadedModel(net=loaded.net, diffusion=loaded.diffusion, config=config)
