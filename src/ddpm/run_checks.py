"""The run config's keys that must agree with each other, checked before any data is read or model built (train()
calls `check_agreement` from training.resolve_config); each refusal names the keys and the fix. A check of one key
alone lives with its key (ddpm.config.validate, the constructors); these need two or more:

- tune.* keys against the tune group's option (the LR range test's node); module.compile_backend when compiling;
- a callback's guidance weight against the model's classes and p_uncond (ddpm.sampling.runtime.check_guidance);
- a callback's sampler against the diffusion's levels (its steps beyond T, a grid end past the model's: refused at
  the first grid, after that many training steps), by running it up to its first network call;
- optim.decay against trainer.max_steps (a decay runs to the last step: without one, configure_optimizers failed
  after the data was loaded);
- the pixel data's image size and channels against a diffusion model's (refused at the first batch, after the
  preload);
- trainer.max_steps and max_epochs: neither 0 (a run that trains nothing).
"""

from typing import Any

from ddpm.config import build
from ddpm.config.build import keyed_errors
from ddpm.data.latents import TARGET as LATENT_DATA  # its shapes come from meta.json (checked there)
from ddpm.diffusion.generate import check_sampler
from ddpm.sampling.runtime import check_guidance

DIFFUSION_MODULE = "ddpm.module.DiffusionModule"  # module=diffusion: its network takes model.image_size only


def check_agreement(resolved: dict[str, Any]) -> None:
    check_tune(resolved)
    check_compile_backend(resolved)
    check_callback_guidance(resolved)
    check_callback_samplers(resolved)
    check_decay(resolved)
    check_shapes(resolved)
    check_length(resolved)


def check_callback_guidance(resolved: dict[str, Any]) -> None:
    """The sample grid's and FID callback's guidance weights: the one check of a callback's guidance
    (ddpm.diffusion.denoiser.Guided refuses what no model could take, without a key)."""
    model, diffusion = resolved.get("model") or {}, resolved.get("diffusion") or {}
    for name, node in (resolved.get("callbacks") or {}).items():
        if isinstance(node, dict) and node.get("guidance"):
            check_guidance(node["guidance"], num_classes=model.get("num_classes"), p_uncond=diffusion.get("p_uncond"),
                           key=f"callbacks.{name}.guidance")  # fmt: skip


def check_callback_samplers(resolved: dict[str, Any]) -> None:
    """Each callback's sampler made its grid on the run's diffusion, refusals naming callbacks.<name>.sampler.*."""
    nodes = {name: node["sampler"] for name, node in (resolved.get("callbacks") or {}).items()
             if isinstance(node, dict) and isinstance(node.get("sampler"), dict)}  # fmt: skip
    if not nodes or not isinstance(resolved.get("diffusion"), dict):
        return
    diffusion = build(resolved["diffusion"])
    for name, node in nodes.items():
        key = f"callbacks.{name}.sampler"
        with keyed_errors(key, node["_target_"]):
            check_sampler(build(node), diffusion)


def check_tune(resolved: dict[str, Any]) -> None:
    """tune.* keys without the group's option (+tune.apply=true alone): crashed in the LR range test's set-up."""
    tune = resolved.get("tune")
    if isinstance(tune, dict) and not isinstance(tune.get("lr_find"), dict):
        raise ValueError(f"tune holds {sorted(tune)} but no LR range test: choose it with tune=lr_find (python "
                         "train.py tune=lr_find tune.apply=true), then set its keys")  # fmt: skip


def check_compile_backend(resolved: dict[str, Any]) -> None:
    """module.compile_backend when the loss is compiled (a typo failed at the fit's start, naming no key)."""
    import torch._dynamo

    module = resolved.get("module") or {}
    backend = module.get("compile_backend")
    if module.get("compile") in (None, False) or backend is None:
        return
    if backend not in torch._dynamo.list_backends(exclude_tags=()):  # 0.3 s at its first call: compiled runs only
        raise ValueError(f"module.compile_backend={backend!r} is not a torch.compile backend; use inductor (or eager, "
                         "aot_eager to debug)")  # fmt: skip


def check_decay(resolved: dict[str, Any]) -> None:
    optim, steps = resolved.get("optim") or {}, (resolved.get("trainer") or {}).get("max_steps")
    if optim.get("decay", "none") != "none" and steps in (None, -1):
        raise ValueError(f"optim.decay={optim['decay']} runs the LR down to trainer.max_steps, which is {steps} "
                         "(no step limit); set trainer.max_steps=<the run's steps>, or optim.decay=none")  # fmt: skip


def check_shapes(resolved: dict[str, Any]) -> None:
    data, model = resolved.get("data") or {}, resolved.get("model") or {}
    if data.get("_target_") == LATENT_DATA or (resolved.get("module") or {}).get("_target_") != DIFFUSION_MODULE:
        return  # a VAE (module=vae) is convolutional: it trains at any size its factor divides
    for ours, theirs in (("image_size", "image_size"), ("channels", "in_channels")):
        a, b = data.get(ours), model.get(theirs)
        if a is not None and b is not None and a != b:
            raise ValueError(f"data.{ours}={a} but model.{theirs}={b}: the model takes the images the data module "
                             f"makes; set one to the other (data.{ours}={b} or model.{theirs}={a})")  # fmt: skip


def check_length(resolved: dict[str, Any]) -> None:
    """trainer.max_steps=0 or max_epochs=0: Lightning trains nothing and the run ended "successfully", its untrained
    weights exported as ema.pt."""
    trainer = resolved.get("trainer") or {}
    for key in ("max_steps", "max_epochs"):
        if trainer.get(key) == 0:
            raise ValueError(f"trainer.{key}=0 trains nothing (the run would export its untrained weights as ema.pt); "
                             f"set trainer.{key}=<how long to train>, or -1 for no limit of that kind")  # fmt: skip
