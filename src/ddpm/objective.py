"""The objective a run returns to sweeps and Optuna (top-level `objective`, `val/loss` by default): the metrics a run
logs (its module's `LOGGED_METRICS`, each FID callback's), an objective none of them is refused before the first
step (train() calls `check_objective`; in a sweep also one logged at validation when no validation will run), and
its value read after fit (`objective_value`).
"""

import difflib
import inspect
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class

FID_NAMES = {"fid": ("fid",), "kid": ("kid", "kid_std"), "is": ("is", "is_std")}  # ddpm.metrics.fid.compute_metrics
MODULE = "ddpm.module.DiffusionModule"  # module=diffusion, the default


def check_objective(resolved: dict[str, Any]) -> None:
    """Refuse a top-level `objective` that no part of the run logs, before any data is read or step taken (in a
    sweep every job would otherwise train in full, then fail); objective_value checks the value
    after fit, as the guard of last resort."""
    objective = resolved.get("objective") or "val/loss"
    keys = logged_metrics(resolved)
    if objective in keys:
        if in_sweep() and (why := never_logged(objective, resolved)):
            raise ValueError(f"objective={objective!r} {why}")
        return
    closest = difflib.get_close_matches(objective, keys, n=1, cutoff=0.0)[0]
    raise ValueError(
        f"objective={objective!r} is not a metric this run logs, so it would train to the end and then fail; it "
        f"logs {keys}: did you mean objective={closest}? (val/fid@K and val/cfid@K need the FID callback, "
        "+callbacks/fid=inception or +callbacks/fid=classifier; K is callbacks.fid.num_samples as logged: 500, 1k)"
    )


def in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def never_logged(objective: str, resolved: dict[str, Any]) -> str | None:
    """Why no job of a sweep with this config would log `objective` (each would return no value), else None: the
    FID callback's metrics come every callbacks.<name>.every_n_steps optimizer steps, val/loss at validation."""
    trainer, conditional = resolved.get("trainer") or {}, (resolved.get("model") or {}).get("num_classes") is not None
    steps = trainer.get("max_steps", -1)
    for name, node in (resolved.get("callbacks") or {}).items():
        if _is_fid(node) and objective in fid_metrics(node, conditional=conditional):
            every = fid_settings(node)["every_n_steps"]
            if steps not in (None, -1) and steps < every:
                return (f"is logged by callbacks.{name} every callbacks.{name}.every_n_steps={every} optimizer steps, "
                        f"and no job of this sweep would get there (trainer.max_steps={steps}): set "
                        f"callbacks.{name}.every_n_steps={steps} or lower, or raise trainer.max_steps")  # fmt: skip
            return None
    if objective.startswith("val/") and (why := never_validates(trainer)):
        return f"is logged at validation, and no job of this sweep would validate (each would return no value): {why}"
    return None


def never_validates(trainer: dict[str, Any]) -> str | None:
    """Why a run with these Lightning Trainer settings would end before its first validation, else None (a
    fractional val_check_interval or check_val_every_n_epoch: validation at epoch ends, assumed to come)."""
    interval, steps = trainer.get("val_check_interval", 1.0), trainer.get("max_steps", -1)
    batches = None if steps in (None, -1) else steps * (trainer.get("accumulate_grad_batches") or 1)
    if trainer.get("limit_val_batches") == 0:
        return "trainer.limit_val_batches=0 turns validation off"
    if type(interval) is int and trainer.get("check_val_every_n_epoch") is None and batches and batches < interval:
        return (f"the first validation comes after trainer.val_check_interval={interval} training batches and the "
                f"run stops after {batches} at most (an epoch's last step may take fewer than accumulate_grad_batches):"
                f" set trainer.val_check_interval={steps} or lower, or raise trainer.max_steps")  # fmt: skip
    return None


def logged_metrics(resolved: dict[str, Any]) -> list[str]:
    """The metrics an objective may name: the module's (DiffusionModule: val/loss, train/loss; VAEModule adds the
    reconstruction and KL terms) and each FID callback's."""
    conditional = (resolved.get("model") or {}).get("num_classes") is not None
    nodes = [node for node in (resolved.get("callbacks") or {}).values() if _is_fid(node)]
    module = get_class((resolved.get("module") or {}).get("_target_") or MODULE).LOGGED_METRICS
    return [*module, *(key for node in nodes for key in fid_metrics(node, conditional=conditional))]


def fid_metrics(node: dict[str, Any], *, conditional: bool) -> list[str]:
    """What a `ddpm.callbacks.fid.FID` config logs: `val/<c><metric>@<K>` as compute_metrics names them (c for a
    classifier's features; K by count_tag: 500, 1k, 10k), and `val/accuracy@K` for a classifier with logits on a
    conditional model."""
    from ddpm.metrics.fid import count_tag

    settings = fid_settings(node)
    tag, classifier = count_tag(int(settings["num_samples"])), settings["features"] != "inception"
    prefix = "c" if classifier else ""
    keys = [f"val/{prefix}{name}@{tag}" for metric in settings["metrics"] for name in FID_NAMES.get(metric, ())]
    logits = classifier and conditional and gives_logits(str(settings["features"]))
    return keys + ([f"val/accuracy@{tag}"] if logits else [])


def gives_logits(features: str) -> bool:
    """Whether the classifier file has logits (the accuracy's); True for a file that cannot be read: the callback
    refuses it at fit start, naming its key."""
    from ddpm.metrics.features import classifier_extractor

    try:
        return classifier_extractor(features).has_logits
    except (OSError, ValueError):
        return True


def fid_settings(node: dict[str, Any]) -> dict[str, Any]:
    """A `ddpm.callbacks.fid.FID` config node over the callback's defaults."""
    from ddpm.callbacks.fid import FID

    return {name: p.default for name, p in inspect.signature(FID).parameters.items()} | node


def _is_fid(node: Any) -> bool:
    from ddpm.callbacks.fid import FID

    target = node.get("_target_") if isinstance(node, dict) else None
    try:
        return isinstance(target, str) and issubclass(get_class(target), FID)
    except (ImportError, ValueError, TypeError):
        return False


def objective_value(trainer: pl.Trainer, key: str) -> float | None:
    """The logged metric `key` after fit (the sweep objective); an error naming the logged keys if it is unknown."""
    value = trainer.callback_metrics.get(key)
    if value is None:
        logged = sorted(k for k in trainer.callback_metrics if k.startswith("val/"))
        if not logged:
            return None  # no validation ran (e.g. max_steps below val_check_interval)
        raise ValueError(
            f"objective={key!r} was never logged; this run logged {logged}. Set objective to one of them "
            "(val/fid@K needs the FID callback: +callbacks/fid=inception or +callbacks/fid=classifier)"
        )
    return float(value)
