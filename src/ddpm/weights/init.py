"""load_init(path, net, model_config): start a run from another run's weights (fine-tuning, `init_from`).

Weights only: the optimizer, the step count and the EMA start afresh (the EMA from these weights). `path` is
anything load_model reads (a .ckpt or ema.pt: the EMA weights; ema.safetensors; a python -m ddpm.export folder;
a diffusers-made UNet2DModel folder); in a module=vae run, a VAE run's .ckpt or an AutoencoderKL folder. The
file's model must be the run's: every model key that shapes the weights, defaults filled in, must agree (dropout
and checkpoint_activations may differ; a VAE's weights must fit its model keys). Our UNet and
model=diffusers_unet2d with the same arguments are the same network under other names: weights go across
through UNet2DModel's names (unet2d_mapping.py).
"""

import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ddpm.models.autoencoder import autoencoder_kl
from ddpm.models.diffusers_unet import UNET_DEFAULTS
from ddpm.models.vae import VAE, is_autoencoder
from ddpm.weights.diffusers_native import UNET_TARGET, WRAPPER_TARGET, network_state, unet2d_state
from ddpm.weights.loader import load_model
from ddpm.weights.model import CHECKPOINT_KEY, CheckpointError, run_config
from ddpm.weights.torch_file import load_checkpoint

FREE_KEYS = ("_target_", "dropout", "checkpoint_activations")  # model keys that change no weight
VAE_KEYS = {"in_channels": "in_channels", "latent_channels": "latent_channels", "layers_per_block": "layers_per_block",
            "block_out_channels": "block_out_channels", "norm_num_groups": "norm_num_groups",
            "mid_block_attention": "mid_block_add_attention"}  # fmt: skip  # model.* of a VAE -> AutoencoderKL's config


def architecture(model_config: Mapping[str, Any]) -> dict[str, Any]:
    """The model keys that shape the weights, with our UNet's defaults filled in (sequences as lists;
    downsample all true is null, emb_dim null is 4 x base_channels, attention resolutions sorted)."""
    arguments = {**UNET_DEFAULTS, **model_config}
    arguments = {k: plain(v) for k, v in arguments.items()}
    if arguments.get("downsample") is not None and all(arguments["downsample"]):
        arguments["downsample"] = None
    if arguments.get("emb_dim") is None and isinstance(arguments.get("base_channels"), int):
        arguments["emb_dim"] = 4 * arguments["base_channels"]  # the UNet's own default: the same weights
    if isinstance(arguments.get("attention_resolutions"), list):
        arguments["attention_resolutions"] = sorted(set(arguments["attention_resolutions"]))  # a set of sizes
    return {k: v for k, v in arguments.items() if k not in FREE_KEYS}


def load_init(path: str | os.PathLike, net: nn.Module, model_config: Mapping[str, Any]) -> dict[str, Any]:
    """Copy the (EMA) weights of `path` into `net`, built from the run's `model_config`; returns the file's run
    config. CheckpointError naming every model.* key that differs, or a file that load_model refuses."""
    if is_autoencoder(net):  # module=vae: an AutoencoderKL
        return load_vae_init(Path(path), net)
    loaded = load_model(path)
    source = dict(loaded.config["model"])
    ours, theirs = architecture(model_config), architecture(source)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        listed = ", ".join(f"model.{k} (file {theirs.get(k)!r}, run {ours.get(k)!r})" for k in differ)
        raise CheckpointError(
            f"init_from={path}: its model differs from this run's in {listed}; set those model keys to the file's "
            "values (or init from a run of this architecture)"
        )
    state = loaded.net.state_dict()
    targets = {source.get("_target_"), model_config.get("_target_")}
    if len(targets) > 1:
        if not targets <= {UNET_TARGET, WRAPPER_TARGET}:
            raise CheckpointError(f"init_from={path}: cannot carry weights from {source.get('_target_')} to "
                                  f"{model_config.get('_target_')}; use the same model._target_")  # fmt: skip
        state = network_state(unet2d_state(loaded.net, source), model_config)
    try:
        net.load_state_dict(state)
    except RuntimeError as error:
        raise CheckpointError(
            f"init_from={path}: the weights do not fit this run's model ({str(error)[:600]})"
        ) from error
    return loaded.config


def load_vae_init(path: Path, net: nn.Module) -> dict[str, Any]:
    """Copy an AutoencoderKL's weights into `net` (a module=vae run fine-tuning one): a diffusers folder (a
    downloaded pretrained VAE, or a VAE run's <run>/vae) or a VAE run's .ckpt (its EMA weights); returns the
    source's config (the folder's config.json, the run's config). CheckpointError naming the model.* keys that
    differ."""
    if path.is_dir():
        autoencoder = VAE.load(path).autoencoder
        state, config, theirs = autoencoder.state_dict(), dict(autoencoder.config), dict(autoencoder.config)
    else:
        checkpoint = load_checkpoint(path, key="init_from")
        state, config = checkpoint.get(CHECKPOINT_KEY), run_config(checkpoint, needs=("model",))
        if not str(config.get("module", {}).get("_target_", "")).endswith(".VAEModule") or state is None:
            raise CheckpointError(f"init_from={path}: a module=vae run starts from a VAE: a VAE run's .ckpt or a "
                                  "diffusers AutoencoderKL folder (a pretrained one, or <run>/vae)")  # fmt: skip
        defaults = {k: p.default for k, p in inspect.signature(autoencoder_kl).parameters.items()}
        theirs = {VAE_KEYS[k]: v for k, v in {**defaults, **config["model"]}.items() if k in VAE_KEYS}
    ours = dict(net.config)
    differ = [
        (k, theirs.get(d), ours.get(d)) for k, d in VAE_KEYS.items() if plain(theirs.get(d)) != plain(ours.get(d))
    ]
    if differ:
        listed = ", ".join(f"model.{k} (file {plain(a)!r}, run {plain(b)!r})" for k, a, b in differ)
        raise CheckpointError(f"init_from={path}: its VAE differs from this run's model in {listed}; set those "
                              "model keys to the file's values")  # fmt: skip
    net.load_state_dict(state)
    return config


def plain(value: Any) -> Any:
    """A config value comparable across JSON, YAML and Python (sequences as lists)."""
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
