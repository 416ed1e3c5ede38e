"""Resuming a run: which checkpoint `ckpt_path` names, and whether resuming it with this config is safe.

`ckpt_path` accepts a checkpoint file, a run directory (its `checkpoints/last.ckpt`), or `last`:
`<resume_dir>/checkpoints/last.ckpt` when `resume_dir` is set, else the newest
`outputs/*/*/checkpoints/last.ckpt` under the launch directory (by modification time, this run's
own folder excluded). The resumed run writes into its own (new) run directory, with
`resume_diff.yaml` recording where it came from and every config value that changed.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ddpm.weights.model import CheckpointError, run_config
from ddpm.weights.torch_file import load_checkpoint

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
