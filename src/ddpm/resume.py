"""Start-up checks of train.py: config types, which checkpoint `ckpt_path` names, and whether a resume is safe.

`ckpt_path` accepts a checkpoint file, a run directory (its `checkpoints/last.ckpt`), or `last`:
`<resume_dir>/checkpoints/last.ckpt` when `resume_dir` is set, else the newest
`outputs/*/*/checkpoints/last.ckpt` under the launch directory (by modification time, this run's
own folder excluded). The resumed run writes into its own (new) run directory, with
`resume_diff.yaml` recording where it came from and every config value that changed.
"""

import inspect
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

from ddpm.checkpoint import CheckpointError, load_checkpoint, run_config

# Changes that make the checkpoint's weights or training target meaningless: refused on resume.
BREAKING = ("model.", "diffusion.num_timesteps", "diffusion.schedule", "diffusion.prediction", "data.image_size",
            "data.channels")  # fmt: skip
SAFE_MODEL_KEYS = ("model.dropout",)  # model keys that change no shape
RUN_GLOB = "outputs/*/*/checkpoints/last.ckpt"  # where `ckpt_path=last` looks when resume_dir is null


def resolve_ckpt_path(ckpt_path: str | None, *, resume_dir: str | None, output_dir: Path) -> Path | None:
    """The checkpoint file `ckpt_path` names (see the module docstring); None for a fresh run."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        if resume_dir is not None:
            return Path(resume_dir) / "checkpoints" / "last.ckpt"
        own = output_dir.resolve()
        found = [p for p in Path.cwd().glob(RUN_GLOB) if p.parents[1].resolve() != own]
        if not found:
            raise CheckpointError(
                f"ckpt_path=last found no {RUN_GLOB} under {Path.cwd()}; set resume_dir=<run dir> "
                "or ckpt_path=<path to a .ckpt>"
            )
        return max(found, key=lambda p: p.stat().st_mtime)
    path = Path(ckpt_path).expanduser()
    return path / "checkpoints" / "last.ckpt" if path.is_dir() else path


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (checkpoint value, this run's value)} for every key whose value differs (paths excluded)."""
    a, b = flatten(old), flatten(new)
    keys = sorted((a.keys() | b.keys()) - {"ckpt_path", "resume_dir", "paths.output_dir"})
    missing = "<absent>"
    return {k: (a.get(k, missing), b.get(k, missing)) for k in keys if a.get(k, missing) != b.get(k, missing)}


def is_breaking(key: str) -> bool:
    return key.startswith(BREAKING) and key not in SAFE_MODEL_KEYS


def check_resume(path: Path, config: Mapping[str, Any], output_dir: Path) -> dict[str, tuple[Any, Any]]:
    """Load `path` safely, refuse config changes that break the run, record the others in resume_diff.yaml."""
    checkpoint = load_checkpoint(path)  # missing, truncated, foreign or pickled-code files fail here, clearly
    for key in ("state_dict", "optimizer_states", "loops", "global_step"):
        if key not in checkpoint:
            raise CheckpointError(
                f"{path} has no {key!r}: it is an EMA export or a weights-only file, not a training checkpoint; "
                "resume from <run dir>/checkpoints/last.ckpt"
            )
    diff = config_diff(run_config(checkpoint), config)
    breaking = {k: v for k, v in diff.items() if is_breaking(k)}
    if breaking:
        lines = "\n".join(f"  {k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in breaking.items())
        raise CheckpointError(
            f"cannot resume {path}: these settings differ from the run that wrote it and change the model or its "
            f"training target:\n{lines}\nresume with the checkpoint's values (see its run's config.yaml) or start a "
            "new run without ckpt_path"
        )
    record = {
        "resumed_from": str(path),
        "global_step": int(checkpoint["global_step"]),
        "changed": {k: {"checkpoint": a, "now": b} for k, (a, b) in diff.items()},
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "resume_diff.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()) or "none"
    print(f"Resuming {path} at step {record['global_step']}; config changes: {changes}")
    return diff


# --- config types, checked against the constructors' annotations before any work is done --------------

_STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)  # "64" is not an int, 1.5 is not an int
_ADAPTERS: dict[str, TypeAdapter | None] = {}


def _adapter(hint: Any) -> TypeAdapter | None:
    """pydantic's strict validator for `hint`, or None where pydantic cannot describe it (left unchecked)."""
    key = repr(hint)
    if key not in _ADAPTERS:
        try:
            _ADAPTERS[key] = TypeAdapter(hint, config=_STRICT)
        except Exception:  # an unresolvable forward reference or an exotic class: that key is not checked
            _ADAPTERS[key] = None
    return _ADAPTERS[key]


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value, as Hydra hands it to a constructor, fits the constructor's type hint.

    pydantic validates strictly (Literal, Union, Optional, nested containers, no "64" -> 64 coercion);
    a YAML list also stands for a tuple and a string for a path, which is how Hydra passes them."""
    adapter = _adapter(hint)
    if adapter is None:
        return True
    candidates = [value, _as_tuples(value)] + ([Path(value)] if isinstance(value, str) else [])
    for candidate in candidates:
        try:
            adapter.validate_python(candidate)
            return True
        except ValidationError:
            continue
    return False


def _hints(target: str) -> dict[str, Any]:
    from hydra.utils import get_object

    try:
        cls = get_object(target)
        hints = typing.get_type_hints(cls.__init__ if inspect.isclass(cls) else cls)
    except Exception:  # not importable here, or annotations that do not resolve: nothing to check
        return {}
    hints.pop("return", None)
    return hints


def config_type_errors(config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """'key=value is not <type>' for every `_target_` argument whose value does not fit its annotation."""
    errors: list[str] = []
    hints = _hints(str(config["_target_"])) if "_target_" in config else {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            errors += config_type_errors(value, f"{prefix}{key}.")
        elif key in hints and not matches(value, hints[key]):
            expected = _describe(hints[key])
            errors.append(f"{prefix}{key}={value!r} is not {expected}")
    return errors


def _describe(hint: Any) -> str:
    """A readable form of a hint: `Literal['eps', 'v']`, `int | None`, Lightning's precision values spelled out."""
    text = str(hint) if typing.get_origin(hint) is not None else getattr(hint, "__name__", str(hint))
    return text.replace("typing.", "").replace("NoneType", "None")


def check_config_types(config: Mapping[str, Any]) -> None:
    """Raise one TypeError naming every wrong-typed value, before any data is read or model built."""
    errors = config_type_errors({k: v for k, v in config.items() if k != "hydra"})
    if errors:
        raise TypeError("config values of the wrong type:\n  " + "\n  ".join(errors))


@contextmanager
def explain_oom(*, batch_size: Any, precision: Any) -> Iterator[None]:
    """Re-raise CUDA out-of-memory errors with the settings that reduce memory."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"out of device memory ({str(error).splitlines()[0][:200]}). The batch does not fit: lower "
            f"data.batch_size={batch_size} (and raise trainer.accumulate_grad_batches to keep the global batch), use "
            f"trainer.precision=bf16-mixed (now {precision}), or turn on activation checkpointing in the model"
        ) from error
