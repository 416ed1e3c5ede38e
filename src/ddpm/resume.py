"""Resuming a run: which checkpoint `ckpt_path` names, and whether resuming it with this config is safe.

`ckpt_path` accepts a checkpoint file, a run directory or its `checkpoints/` folder (its `last.ckpt`; a
folder without one is an error listing the `step_*.ckpt` it holds), or `last`:
`<resume_dir>/checkpoints/last.ckpt` when `resume_dir` is set, else the newest
`outputs/*/*/checkpoints/last.ckpt` under the launch directory (by modification time, this run's
own folder excluded). Every message about it gives a resume's advice (`ckpt_path=...`), never sample.py's.
The resumed run writes into its own (new) run directory, or into the checkpoint's own run directory (a resume
in place), with `resume_diff.yaml` recording where it came from, every config value that changed, and the
world size, global batch and learning rate before and after (`world`).
"""

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ddpm.distributed import restarted
from ddpm.logs import say
from ddpm.ranks import first_process
from ddpm.weights.init import architecture
from ddpm.weights.model import CheckpointError, run_config
from ddpm.weights.torch_file import load_checkpoint

# Changes that make the checkpoint's weights or training target meaningless: refused on resume.
BREAKING = ("model.", "diffusion._target_", "diffusion.num_timesteps", "diffusion.schedule", "diffusion.prediction",
            "diffusion.sigma_", "diffusion.rho", "data.image_size", "data.channels", "latent.vae_identity",
            "latent.scaling_factor", "latent.shift_factor", "latent.latent_shape")  # fmt: skip  # latent: the VAE's
RUN_GLOB = "outputs/*/*/checkpoints/last.ckpt"  # where `ckpt_path=last` looks when resume_dir is null
RESUME_FILE = "resume_diff.yaml"
WORLD_KEY = "world"  # {world_size, global_batch, lr} of the run that saved a checkpoint (DiffusionModule)


def resolve_ckpt_path(ckpt_path: str | None, *, resume_dir: str | None, output_dir: Path) -> Path | None:
    """The checkpoint file `ckpt_path` names (see the module docstring); None for a fresh run."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        if resume_dir is not None:
            folder = Path(resume_dir).expanduser()
            return checkpoint_in(folder) if folder.is_dir() else folder / "checkpoints" / "last.ckpt"
        own = output_dir.resolve()
        found = [p for p in Path.cwd().glob(RUN_GLOB) if p.parents[1].resolve() != own]
        if not found:
            raise CheckpointError(
                f"ckpt_path=last found no {RUN_GLOB} under {Path.cwd()}; set resume_dir=<run dir> "
                "or ckpt_path=<path to a .ckpt>"
            )
        return max(found, key=lambda p: p.stat().st_mtime)
    path = Path(ckpt_path).expanduser()
    return checkpoint_in(path) if path.is_dir() else path


def checkpoint_in(folder: Path) -> Path:
    """`last.ckpt` of a run folder (in its checkpoints/) or of a checkpoints/ folder itself."""
    checkpoints = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    last = checkpoints / "last.ckpt"
    if last.is_file():
        return last
    held = sorted(p.name for p in checkpoints.glob("*.ckpt"))
    if held:
        raise CheckpointError(
            f"ckpt_path={folder} has no {last.name} in {checkpoints}; it holds {', '.join(held[-6:])}: resume with "
            f"ckpt_path={checkpoints / held[-1]} (or another of them)"
        )
    raise CheckpointError(
        f"ckpt_path={folder} holds no training checkpoint (*.ckpt) in {checkpoints}; resume with ckpt_path=<run dir> "
        "(a folder with checkpoints/last.ckpt) or ckpt_path=<run dir>/checkpoints/step_*.ckpt"
    )


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


def breaking_changes(diff: Mapping[str, tuple[Any, Any]], old: Mapping[str, Any], new: Mapping[str, Any]) -> dict:
    """The changes of `diff` that break a run: model keys only where the network's shape changes (weights.init's
    architecture, defaults filled in: dropout, activation checkpointing, a default written out are safe)."""
    shapes = [architecture(config.get("model") or {}) for config in (old, new)]
    return {key: change for key, change in diff.items() if key.startswith(BREAKING) and not _same_shape(key, *shapes)}


def _same_shape(key: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    if not key.startswith("model.") or key == "model._target_":
        return False
    name = key.removeprefix("model.").split(".")[0]
    return old.get(name) == new.get(name)


def load_training_checkpoint(path: Path) -> dict[str, Any]:
    """`path` loaded safely (weights only), refused unless it is a training checkpoint (an EMA export is not)."""
    checkpoint = load_checkpoint(path, key="ckpt_path")  # missing, truncated, foreign or pickled-code files fail here
    for key in ("state_dict", "optimizer_states", "loops", "global_step"):
        if key not in checkpoint:
            last = path.parent / "checkpoints" / "last.ckpt"
            where = f"ckpt_path={last}" if last.is_file() else "ckpt_path=<run dir> (its checkpoints/last.ckpt)"
            raise CheckpointError(
                f"{path} has no {key!r}: it is an EMA export or a weights-only file, not a training checkpoint; "
                f"resume from a .ckpt written by train.py: {where}"
            )
    return checkpoint


def check_resume(
    path: Path,
    config: Mapping[str, Any],
    output_dir: Path,
    *,
    checkpoint: Mapping[str, Any] | None = None,  # `path` already loaded (load_training_checkpoint)
    write: bool = True,  # write resume_diff.yaml (rank 0 only under DDP)
) -> dict[str, tuple[Any, Any]]:
    """Load `path` safely, refuse config changes that break the run, record the others in resume_diff.yaml."""
    checkpoint = load_training_checkpoint(path) if checkpoint is None else checkpoint
    before = run_config(checkpoint, needs=("model",))
    diff = config_diff(before, config)
    breaking = breaking_changes(diff, before, config)
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
    if write:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RESUME_FILE).write_text(yaml.safe_dump(record, sort_keys=False))
    changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()) or "none"
    say(f"Resuming {path} at step {record['global_step']}; config changes: {changes}")
    return diff


def checkpoint_world(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """{world_size, global_batch, lr} of the run that wrote `checkpoint` (`world`, saved by DiffusionModule; for
    older checkpoints, from its config and its LR schedule; unknown values are None)."""
    world = dict(checkpoint.get(WORLD_KEY) or {})
    if not world:
        config = run_config(checkpoint, needs=("model",))
        trainer, data = config.get("trainer") or {}, config.get("data") or {}
        sizes = [trainer.get("devices"), trainer.get("num_nodes", 1), trainer.get("accumulate_grad_batches", 1)]
        if all(isinstance(n, int) and n > 0 for n in sizes):
            world["world_size"] = sizes[0] * sizes[1]
            if isinstance(data.get("batch_size"), int):
                world["global_batch"] = data["batch_size"] * sizes[0] * sizes[1] * sizes[2]
    schedulers = checkpoint.get("lr_schedulers") or [{}]
    if schedulers[0].get("base_lrs") and "lr" not in world:
        world["lr"] = float(schedulers[0]["base_lrs"][0])
    return {key: world.get(key) for key in ("world_size", "global_batch", "lr")}


def record_world(output_dir: Path, before: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Add `world: {checkpoint, now, changed}` to resume_diff.yaml; True if the world size or global batch changed."""
    changed = any(before.get(k) is not None and before.get(k) != now.get(k) for k in ("world_size", "global_batch"))
    path = output_dir / RESUME_FILE
    record = yaml.safe_load(path.read_text()) if path.is_file() else {}
    record["world"] = {"checkpoint": dict(before), "now": dict(now), "changed": changed}
    path.write_text(yaml.safe_dump(record, sort_keys=False))
    if changed:
        say(
            f"Resuming at another scale: world size {before.get('world_size')} -> {now['world_size']}, global batch "
            f"{before.get('global_batch')} -> {now['global_batch']}, LR {before.get('lr')} -> {now['lr']} "
            "(optim.scaling applied to the new global batch; recorded in resume_diff.yaml)"
        )
    return changed


def world_of(trainer: Any, batch_size: Any, lr_of: Any) -> dict[str, Any]:
    """{world_size, global_batch, lr} of this run: the data.batch_size per process x processes x accumulation."""
    global_batch = int(batch_size) * trainer.world_size * trainer.accumulate_grad_batches
    return {"world_size": trainer.world_size, "global_batch": global_batch, "lr": float(lr_of(global_batch))}


def hpc_checkpoint(folder: Path) -> Path | None:
    """The newest hpc_ckpt_<n>.ckpt Lightning's SLURM requeue saved in `folder` (it resumes from it by itself)."""
    found = [
        (int(m[1]), p) for p in folder.glob("hpc_ckpt_*.ckpt") if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", p.name))
    ]
    return max(found)[1] if found else None


def requeued_from(output_dir: Path, ckpt_path: Path | None, checkpoint_dirs: Sequence[Path] = ()) -> Path | None:
    """The checkpoint a run resumes from: the newest of `ckpt_path`, the run folder's hpc checkpoint and, in a job
    SLURM runs again (requeued after its warning signal's checkpoint, a preemption or a node failure: the same command,
    whose ckpt_path, if any, is older), the last.ckpt of its checkpoint folders."""
    missing = ckpt_path is not None and not Path(ckpt_path).is_file()  # refused by name later
    saved = [hpc_checkpoint(output_dir)]
    if restarted(output_dir):
        saved += [folder / "last.ckpt" for folder in [*checkpoint_dirs, output_dir / "checkpoints"]]
    found = [path for path in saved if path is not None and path.is_file()]
    if missing or not found:
        return ckpt_path
    newest = max(found, key=lambda path: path.stat().st_mtime)
    if ckpt_path is not None and newest.stat().st_mtime <= Path(ckpt_path).stat().st_mtime:
        return ckpt_path
    if ckpt_path is not None and first_process():
        say(f"Resuming from {newest}, which this SLURM job saved after ckpt_path={ckpt_path} (delete it to resume "
            "from ckpt_path)")  # fmt: skip
    return newest
