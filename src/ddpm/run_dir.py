"""A run never overwrites another run's results: who may write into a run folder.

A folder holds a run when it has any of RUN_FILES (Hydra's own `.hydra/` and `<job>.log` do not count: Hydra
writes them before `train()` starts). Starting into such a folder is refused before anything is written, naming the
resume (`ckpt_path=<folder>/checkpoints/last.ckpt`) and a new `hydra.run.dir`, unless

- the run resumes in place: its checkpoint lies inside that folder (`ckpt_path=<folder>/...`, `resume_dir`, a
  requeued SLURM job's `hpc_ckpt_*.ckpt`); it then continues the run, reusing the checkpoint names;
- `overwrite=true`: the old run's files first move into `<folder>/replaced-<time>/` (nothing is deleted); so do a
  failed run's when it left no work (`failed_start`: refused at start-up, or failed before its first checkpoint).

`RunFolderGuard` (a Hydra callback, conf/train.yaml) applies the rule before Hydra writes `.hydra/` into the
folder (Hydra turns a callback's exception into a warning, so a refusal there is a SystemExit); `train()` applies
it again, to runs started without Hydra, to multirun jobs, and to checkpoint folders outside the run folder. A
sweep folder (`hydra.sweep.dir`) that holds an earlier sweep is refused, or moved aside, the same way, except an
Optuna study's own folder, which the same command continues (`continues_study`).
Only the first process claims a folder: the other ranks of a DDP run write into the folder rank 0 claimed. A
claimed folder holds `.running` (host and pid, created exclusively, removed when train() or sample() ends) while
its process writes there: two calls started in the same second (the default folders' time stamp) or given the same
folder both passed the result check before either had written, and the later one's files replaced the earlier's.
"""

import atexit
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Literal

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddpm.atomic import process_alive
from ddpm.ranks import first_process

RUN_FILES = ("config.yaml", "resume_diff.yaml", "result.json", "ema.pt", "ema.safetensors", "checkpoints", "samples",
             "csv", "tensorboard", "wandb", "lr_find.*", "hpc_ckpt_*.ckpt")  # fmt: skip
SWEEP_FILES = ("summary.csv", "*/" + "result.json", *(f"*/{name}" for name in RUN_FILES))  # job folders inside
CHECKPOINT_FILES = ("*.ckpt",)  # a checkpoint folder outside the run folder
SAMPLE_FILES = ("grid.png", "samples.npz", "metrics.json")  # what a sample.py call writes into output_dir
SAMPLE_COMPANIONS = (".hydra", "sample.log")  # Hydra's files of that call, moved aside with its samples
# What only a train.py run writes (an ema.pt or config.yaml alone may be a model a user keeps beside its samples)
TRAINING_RUN = ("train.log", "checkpoints", "result.json", "resume_diff.yaml", "hpc_ckpt_*.ckpt")
RUNNING = ".running"  # "<host> <pid>" of the process writing into a claimed folder
REPLACED = "replaced-"  # prefix of the folders that old runs move into
WORK = ("checkpoints", "ema.pt", "ema.safetensors", "samples", "hpc_ckpt_*.ckpt", "lr_find.*")  # a run's own work


class RunFolderTaken(FileExistsError):
    """The run folder holds another run's results, and this run neither resumes it nor may replace it."""


def held(folder: Path, patterns: tuple[str, ...] = RUN_FILES) -> list[str]:
    """The names in `folder` (relative) matching `patterns`, outside the replaced-* folders."""
    if not folder.is_dir():
        return []
    found = {str(p.relative_to(folder)) for pattern in patterns for p in folder.glob(pattern)}
    return sorted(name for name in found if not name.startswith(REPLACED))


def inside(path: Path | None, folder: Path) -> bool:
    return path is not None and path.resolve().is_relative_to(folder.resolve())


def claim(
    folder: Path,
    *,
    ckpt_path: Path | None,  # the checkpoint this run resumes from (resolved), or None
    overwrite: bool,  # move an old run's files aside instead of refusing
    patterns: tuple[str, ...] = RUN_FILES,
    key: str = "hydra.run.dir",  # the setting that named `folder`
    everything: bool = False,  # move every entry (Hydra has not written into the folder yet)
    companions: tuple[str, ...] = (),  # entries moved along with the results, where present
    mark: bool = True,  # hold the folder while this process runs (not a checkpoint folder: Lightning's, not ours)
) -> Path | None:
    """Refuse, or move aside, another run's results in `folder`; the replaced-* folder if files moved."""
    resumes = inside(ckpt_path, folder)
    if mark and not hold(folder, key, replace=resumes):
        return None  # this process claimed it already (Hydra's RunFolderGuard, then train() or sample())
    found = held(folder, patterns)
    if not found or resumes:
        return None
    failed = failed_start(folder, found) and not overwrite
    if not overwrite and not failed:
        release(keep=len(_HELD) - 1 if mark else len(_HELD))  # its mark, taken above: a refused run holds nothing
        raise RunFolderTaken(taken_message(folder, found, key))
    if failed:  # only the failed run's own files (a folder may hold the user's: hydra.run.dir=.)
        names = [*found, *(name for name in (".hydra", "train.log") if (folder / name).exists())]
    elif everything:
        names = [p.name for p in folder.iterdir() if not p.name.startswith(REPLACED) and p.name != RUNNING]
    else:
        names = found
    names += [name for name in companions if (folder / name).exists()]
    why = "a run that failed before its first checkpoint" if failed else "overwrite=true"
    return move_aside(folder, sorted({name.split("/")[0] for name in names}), why)


def hold(folder: Path, key: str, *, replace: bool = False) -> bool:
    """Mark `folder` as this process's until `release()` (the entry points' end, or exit) with `RUNNING`, created
    exclusively, or refuse it while another live process holds it. A mark of a process that is gone (this host) is
    taken over; `replace` (a resume in place: a requeued job) also takes over another host's, whose process this
    one cannot see. False: this process holds it already (its own list, not the file: a restarted container may
    run again under the host name and pid of the killed process that left it)."""
    mark, me = folder / RUNNING, f"{socket.gethostname()} {os.getpid()}"
    if any(held_mark == mark for held_mark, _ in _HELD):
        return False
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return True  # not a folder (a path under a file): the writer's own check names it
    for _ in range(2):
        try:
            with open(mark, "x") as f:
                f.write(me)
        except FileExistsError:
            host, _, pid = (mark.read_text(errors="replace") if mark.is_file() else "").partition(" ")
            here = host == socket.gethostname()
            alive = pid.isdigit() and process_alive(int(pid)) if here else not replace
            if alive:
                raise RunFolderTaken(
                    f"{key}={folder} is being written by another process (pid {pid or '?'} on {host or '?'}, started "
                    f"at the same time or given the same folder): give each call its own {key}. If that process is "
                    f"gone, delete {mark}"
                ) from None
            mark.unlink(missing_ok=True)  # a killed process's mark
            continue
        if not _HELD:
            atexit.register(release)
        _HELD.append((mark, me))
        return True
    return True


_HELD: list[tuple[Path, str]] = []  # this process's marks


@contextmanager
def holding() -> Iterator[None]:
    """An entry point's body (train(), sample(); as their decorator): the folder marks taken within go when it ends
    (a multirun's sweep folder stays marked across its jobs)."""
    before = len(_HELD)
    try:
        yield
    finally:
        release(keep=before)


def release(keep: int = 0) -> None:
    """Remove this process's marks but the first `keep` (each where it is still this process's)."""
    while len(_HELD) > keep:
        mark, me = _HELD.pop()
        try:
            if mark.read_text() == me:
                mark.unlink()
        except OSError:
            pass


def failed_start(folder: Path, found: list[str]) -> bool:
    """Whether the folder holds a FAILED (or RUNNING: killed, its mark gone) result.json and no trained work (WORK:
    checkpoints, EMA weights, grids, an LR range test): a run refused at start-up (a typo in data.root) or failed
    before its first checkpoint. Its files move aside instead of refusing the corrected command."""
    if "result.json" not in found or any(fnmatch(name.split("/")[0], pattern) for name in found for pattern in WORK):
        return False
    try:
        return json.loads((folder / "result.json").read_text()).get("status") in ("FAILED", "RUNNING")  # killed
    except (OSError, ValueError, AttributeError):
        return False


def refuse_training_run(folder: Path, key: str = "output_dir") -> None:
    """sample.py's folder must not be a training run's: its grid.png, .hydra/ and (with overwrite=true) the moving
    aside of earlier samples would land among the run's checkpoints and config."""
    if found := held(folder, TRAINING_RUN):
        raise RunFolderTaken(
            f"{key}={folder} holds a training run ({', '.join(found[:6])}); sample.py writes grid.png, samples.npz "
            f"and Hydra's .hydra/ into {key}, which would replace the run's own. Sample into a folder of its own: "
            f"{key}={folder / 'samples' / 'sample_py'} (or leave it unset for outputs/samples/<date>/<time>)"
        )


def taken_message(folder: Path, found: list[str], key: str) -> str:
    last = next((folder / name for name in ("checkpoints/last.ckpt", "last.ckpt") if (folder / name).is_file()), None)
    if last is None:
        held_ckpts = sorted(
            p for p in folder.glob("**/*.ckpt") if not p.relative_to(folder).parts[0].startswith(REPLACED)
        )
        last = held_ckpts[-1] if held_ckpts else None
    resume = f"To continue it: ckpt_path={last} (same {key}); " if last else ""
    shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "")
    return (
        f"{key}={folder} already holds another run's results ({shown}); this run would overwrite them, so nothing "
        f"was written. {resume}For a new run: another {key} (or leave it unset for a new timestamped folder); "
        f"to replace it: overwrite=true (its files move to {folder}/{REPLACED}<time>/, nothing is deleted)"
    )


def move_aside(folder: Path, names: list[str], why: str = "overwrite=true") -> Path:
    """Move `names` (entries of `folder`) into a new `folder/replaced-<time>/`; returns that folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = folder / f"{REPLACED}{stamp}", 1
    while target.exists():
        target, n = folder / f"{REPLACED}{stamp}-{n}", n + 1
    target.mkdir()
    for name in names:
        if (folder / name).exists():
            shutil.move(folder / name, target / name)
    print(f"{why}: moved the previous run's {', '.join(names)} into {target}", file=sys.stderr)
    return target


def claim_run(output_dir: Path, *, ckpt_path: Path | None, overwrite: bool, checkpoint_dirs: list[Path] = ()) -> None:
    """The rule for a `train()` run: its folder, and checkpoint folders outside it (first process only)."""
    if not first_process():
        return
    from ddpm.distributed import mark_slurm_job

    claim(output_dir, ckpt_path=ckpt_path, overwrite=overwrite)
    mark_slurm_job(output_dir)  # a requeue of this job resumes here
    for folder in checkpoint_dirs:
        if not inside(folder, output_dir):
            claim(folder, ckpt_path=ckpt_path, overwrite=overwrite, patterns=CHECKPOINT_FILES,
                  key="callbacks.checkpoint.dirpath", mark=False)  # fmt: skip


def continues_study(config: DictConfig) -> bool:
    """Whether this multirun continues an Optuna study stored in its sweep folder (`hparams_search=optuna`: the same
    command again adds trials, each in its own timestamped job folder, so nothing of the earlier trials is
    overwritten)."""
    storage = config.hydra.get("sweeper", {}).get("storage")
    if not (isinstance(storage, str) and storage.startswith("sqlite:///")):
        return False
    database = Path(storage.removeprefix("sqlite:///"))
    return database.is_file() and inside(database, Path(config.hydra.sweep.dir))


class RunFolderGuard(Callback):
    """Applies the rule before Hydra writes into the run or sweep folder (see the module docstring); `entry=sample`
    (conf/sample.yaml) guards sample.py's folder, whose results are SAMPLE_FILES and whose setting is output_dir."""

    def __init__(self, *, entry: Literal["train", "sample"] = "train") -> None:
        self.files, self.key = (RUN_FILES, "hydra.run.dir") if entry == "train" else (SAMPLE_FILES, "output_dir")
        self.entry = entry

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not first_process():
            return
        folder = Path(config.hydra.run.dir)
        if self.entry == "sample":  # the earlier call's samples and Hydra's files move, nothing else
            try:
                refuse_training_run(folder)  # output_dir: the run folder (conf/sample.yaml, follow_output_dir)
            except RunFolderTaken as refused:
                raise SystemExit(f"Error: {refused}") from None
            self._claim(folder, config, self.files, self.key, companions=SAMPLE_COMPANIONS)
        else:
            self._claim(folder, config, self.files, self.key, everything=True)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if first_process() and not continues_study(config):
            self._claim(Path(config.hydra.sweep.dir), config, SWEEP_FILES, "hydra.sweep.dir", everything=True)

    @staticmethod
    def _claim(folder: Path, config: DictConfig, patterns: tuple[str, ...], key: str, **moved: Any) -> None:
        from ddpm.resume import resolve_ckpt_path

        try:
            ckpt = resolve_ckpt_path(config.get("ckpt_path"), resume_dir=config.get("resume_dir"), output_dir=folder)
        except Exception:  # train() reports a bad ckpt_path; here it resumes nothing
            ckpt = None
        from ddpm.distributed import restarted

        ckpt = folder if restarted(folder) or held(folder, ("hpc_ckpt_*.ckpt",)) else ckpt  # a requeue: in place
        try:
            claim(folder, ckpt_path=ckpt, overwrite=bool(config.get("overwrite")), patterns=patterns, key=key, **moved)
        except RunFolderTaken as refused:
            raise SystemExit(f"Error: {refused}") from None  # Hydra would turn any Exception into a warning


def follow_output_dir(argv: list[str]) -> list[str]:
    """sample.py's command line, with `hydra.run.dir=X` added where it names `output_dir=X` but no run folder: Hydra's
    `.hydra/` and `sample.log` then sit with the samples, not in an otherwise empty outputs/samples/<date>/<time>/."""
    given = dict(arg.lstrip("+").split("=", 1) for arg in argv[1:] if "=" in arg and not arg.startswith("-"))
    if "output_dir" not in given or "hydra.run.dir" in given or {"-m", "--multirun"} & set(argv):
        return argv
    return [*argv, f"hydra.run.dir={given['output_dir']}"]
