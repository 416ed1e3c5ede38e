"""What every weights format shares: the loaded model, its error type, and rebuilding it from the run config.

A file names its model only through the resolved run config it carries (`model` and `diffusion` nodes with
`_target_`s). `instantiate_local` builds those nodes refusing any class outside this package, so a foreign
file cannot make this process import and call arbitrary code; `build_model` then loads the weights.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ddpm.diffusion.edm import EDMDiffusion
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.models.unet import UNet

CHECKPOINT_KEY = "ema_state_dict"  # where every file of this project keeps the EMA weights


class CheckpointError(ValueError):
    """A file that is missing, unreadable, or not a checkpoint of this project."""


@dataclass(frozen=True)
class LoadedModel:
    """The EMA network (eval mode, float32) and the schedule of a run, with its config."""

    net: UNet
    diffusion: GaussianDiffusion | EDMDiffusion
    config: dict[str, Any]


def run_config(checkpoint: Mapping[str, Any], *, needs: tuple[str, ...] = ("model", "diffusion")) -> dict[str, Any]:
    """The resolved config a checkpoint's run was trained with (`config`, or Lightning's hyper_parameters), holding
    the nodes `needs` (a resume needs the model only: a VAE run, module=vae, has no diffusion)."""
    config = checkpoint.get("config") or checkpoint.get("hyper_parameters", {}).get("config")
    vae_run = str((config or {}).get("module", {}).get("_target_", "")).endswith(".VAEModule")  # module=vae
    if vae_run and "diffusion" in needs:
        raise CheckpointError(
            "the checkpoint is a VAE run's (module=vae), not a diffusion model's: nothing to sample. Its VAE is "
            "the run's vae/ folder: encode a data set with python -m ddpm.data.encode vae=<run dir>/vae ... and "
            "train a latent model on it (docs/latent.md)"
        )
    if not config or any(key not in config for key in needs):
        raise CheckpointError(f"the checkpoint carries no run config ({', '.join(needs)}); it cannot be rebuilt")
    return config


def _targets(value: Any) -> list[str]:
    if isinstance(value, Mapping):
        found = [value["_target_"]] if "_target_" in value else []
        return found + [t for v in value.values() for t in _targets(v)]
    if isinstance(value, list):
        return [t for v in value for t in _targets(v)]
    return []


def _local_class(target: Any) -> bool:
    """Resolved, not by prefix: "ddpm.weights.model.torch.load" starts with ddpm. but is torch.load."""
    from hydra.utils import get_class

    if not str(target).startswith("ddpm."):
        return False
    try:
        return get_class(str(target)).__module__.startswith("ddpm.")
    except Exception:  # not importable, or not a class
        return False


def instantiate_local(node: Mapping[str, Any]) -> Any:
    """hydra.utils.instantiate, refusing any `_target_` outside the ddpm package."""
    from hydra.utils import instantiate

    foreign = [t for t in _targets(node) if not _local_class(t)]
    if foreign:
        raise CheckpointError(f"the checkpoint's config names classes outside lightning-ddpm: {foreign}")
    return instantiate(dict(node))


def non_finite_tensors(state: Mapping[str, Any]) -> list[str]:
    """Names of floating tensors in `state` that hold NaN or inf."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()]


def build_model(
    config: Mapping[str, Any], weights: Mapping[str, Tensor], *, source: str, device: torch.device | str = "cpu"
) -> LoadedModel:
    """The run's UNet and schedule from `config`, with `weights` loaded (eval, float32, on `device`).

    `source` names the file in every error: a config that does not build, weights that do not fit it, or
    weights that are not finite (a NaN filter draws black images; refused here for every format)."""
    try:
        net, diffusion = instantiate_local(config["model"]), instantiate_local(config["diffusion"])
    except CheckpointError as error:
        raise CheckpointError(f"{source}: {error}") from error
    except Exception as error:  # a value the constructors refuse
        raise CheckpointError(f"{source}: its config does not build a model ({str(error)[:300]})") from error
    bad = non_finite_tensors(weights)
    if bad:
        raise CheckpointError(
            f"{source}: weights {bad[:5]} hold NaN or inf, so every image drawn from them would be black or noise; "
            "use an earlier checkpoint of the run (checkpoints/step_*.ckpt) or retrain"
        )
    try:
        net.load_state_dict(dict(weights))
    except RuntimeError as error:
        raise CheckpointError(
            f"{source}: the weights do not fit the model its config describes ({str(error)[:600]}); "
            "the file was edited or mixed with another run's"
        ) from error
    return LoadedModel(net=net.float().eval().to(device), diffusion=diffusion.to(device), config=dict(config))
