"""The one framework of the benchmark scripts: arguments, device, interleaved repeats, statistics, provenance, JSON.

Every script under benchmarks/ builds its parser, then `run = start(__file__, parser, argv, rows=ROWS)`:
- arguments every script shares (`add_arguments`): --rows, --repeats, --device, --threads, --out, --smoke,
  --allow-dirty; `parse_rows` is the one --rows (and --configs) parser;
- the device: `resolve_device` of ddpm.sampling (auto: cuda if there is one, else cpu), as sample.py decides;
- the tree: a result from a tree with changes (`git status --porcelain`: tracked files, and untracked files
  outside ignored paths; changes under benchmarks/results/ are outputs, listed apart) is refused before anything
  is measured, and again at writing if the tree changed meanwhile, unless --allow-dirty (recorded);
- --smoke: the script's SMOKE sizes (seconds), one repeat allowed, --allow-dirty implied, no CUDA needed; the JSON
  is written only where --out says.
Rows are measured by `run_interleaved` (ABC CBA ABC ...), summarised by `stats` (the true median: for an even
count the mean of the two middle values; min, max) and compared with `paired_ratios` (each repeat's figure over
the baseline row's in the same repeat: the rows of one repeat saw the same state of the machine). `run.write`
writes the JSON with the provenance: commit, dirty flag, sha256 of the script and of this file, CPU model and
vector flags, native bf16, threads, torch version, GPU name.
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ddpm.precision import native_bf16
from ddpm.sampling.runtime import resolve_device

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MNIST_ROOT = str(REPO.parent / "shared" / "data" / "mnist")
RESULTS_PREFIX = "benchmarks/results/"  # outputs: a change there does not make the tree dirty
CPU_FLAGS = {"avx2": "avx2", "avx512": "avx512f", "avx512_bf16": "avx512_bf16", "amx": "amx_tile"}  # /proc/cpuinfo
MIN_REPEATS = 2  # below this a figure has no spread; 1 only under --smoke
T = TypeVar("T")


# ----------------------------------------------------------------------------------------------------- statistics


def stats(values: Iterable[float]) -> dict[str, Any]:
    """The true median (mean of the two middle values for an even count), min, max and every value."""
    runs = [float(v) for v in values]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def paired_ratios(runs: Mapping[str, Sequence[float]], baseline: str) -> dict[str, dict[str, Any]]:
    """Per row, each repeat's figure over `baseline`'s in the same repeat, and their stats."""
    base = runs[baseline]
    return {name: stats(v / b for v, b in zip(values, base, strict=True)) for name, values in runs.items()}


def interleaved(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, row) in the order rows run: ABC CBA ABC ..., so slow drift of the machine hits every row alike."""
    return [(r, name) for r in range(repeats) for name in (names if r % 2 == 0 else list(reversed(names)))]


def run_interleaved(
    names: Sequence[str], repeats: int, measure: Callable[[str, int], T], describe: Callable[[T], str] = str
) -> dict[str, list[T]]:
    """measure(row, repeat) for every row and repeat, interleaved; {row: [result per repeat]}."""
    runs: dict[str, list[T]] = {name: [] for name in names}
    for repeat, name in interleaved(names, repeats):
        runs[name].append(measure(name, repeat))
        print(f"done {name} ({repeat + 1}/{repeats}): {describe(runs[name][-1])}", flush=True)
    return runs


def figure(s: Mapping[str, Any], spec: str = ".2f") -> str:
    """'median [min-max]' of a stats() dict."""
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -------------------------------------------------------------------------------------------------------- arguments


def parse_rows(text: str, known: Iterable[str], *, flag: str = "--rows") -> list[str]:
    """'a,b' -> ['a', 'b'], every name one of `known` (ValueError naming the unknown ones and the choices)."""
    names, known = [n.strip() for n in text.split(",") if n.strip()], list(known)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{flag} {text!r}: unknown {unknown or 'empty'}; choose from {', '.join(known)}")
    return names


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    rows: Sequence[str] | None = None,
    default_rows: Sequence[str] | None = None,
    repeats: int | None = 3,
    device: str = "auto",
    out: bool = True,
) -> None:
    """The options every benchmark shares (rows and repeats where the script has rows)."""
    if rows is not None:
        parser.add_argument(
            "--rows", default=",".join(default_rows or rows), help=f"comma-separated: {', '.join(rows)}"
        )
    if repeats is not None:
        parser.add_argument(
            "--repeats",
            type=int,
            default=repeats,
            help=f"runs of every row, interleaved (ABC CBA ...); >= {MIN_REPEATS} (1 only with --smoke)",
        )
    parser.add_argument("--device", default=device, help="auto (cuda if there is one, else cpu), cpu, cuda, cuda:1 ...")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    if out:
        parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/<name>.json)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long run of every code path (tiny sizes, 1 repeat); implies --allow-dirty; "
        "writes JSON only to --out",
    )
    parser.add_argument(
        "--allow-dirty", action="store_true", help="measure a tree with uncommitted changes (recorded in the JSON)"
    )


def shrink(args: argparse.Namespace, smoke: Mapping[str, Any]) -> list[str]:
    """--smoke: numbers become at most the SMOKE value, anything else becomes it; returns what changed."""
    changed = []
    for key, value in smoke.items():
        old = getattr(args, key, None)
        small = value
        if isinstance(value, int | float) and not isinstance(value, bool) and isinstance(old, int | float):
            small = min(old, value)
        if small != old:
            setattr(args, key, small)
            changed.append(f"{key}={small}")
    return changed


# ----------------------------------------------------------------------------------------------------- provenance


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """HEAD and the changes `git status --porcelain` lists (tracked files, untracked files outside ignored paths).
    Dirty if any is outside benchmarks/results/ (results are outputs: listed apart, so runs can follow each other
    at one commit), or if there is no git commit (nothing names the code)."""

    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True)

    head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=all")
    if head.returncode != 0 or status.returncode != 0:
        error = (head.stderr or status.stderr).strip()
        return {"commit": None, "dirty": True, "changes": [f"no git commit: {error}"], "results_changed": []}
    lines = status.stdout.splitlines()
    results = [c for c in lines if c[3:].strip('"').startswith(RESULTS_PREFIX)]
    changes = [c for c in lines if c not in results]
    return {"commit": head.stdout.strip(), "dirty": bool(changes), "changes": changes, "results_changed": results}


def sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cpu_info() -> dict[str, Any]:
    """CPU model, the vector flags that decide bf16 and vector speed, torch's CPU capability."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next(
        (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor()
    )
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    return {
        "cpu": model,
        "cpu_flags": {name: flag in flags for name, flag in CPU_FLAGS.items()},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def refuse_dirty(state: Mapping[str, Any], allow_dirty: bool, when: str = "") -> None:
    if state["dirty"] and not allow_dirty:
        listed = "\n  ".join(state["changes"][:20])
        raise SystemExit(
            f"refusing to measure{when}: the tree has uncommitted changes, so no commit names the code that ran:\n"
            f"  {listed}\ncommit them and run again at a clean commit, or pass --allow-dirty (recorded in the JSON)"
        )


@dataclass
class Run:
    """One benchmark run: its arguments, device and rows, the script and the tree it started from."""

    args: argparse.Namespace
    script: Path
    device: torch.device
    rows: list[str]
    git: dict[str, Any]
    repo: Path = REPO
    smoke_changes: list[str] = field(default_factory=list)

    def provenance(self) -> dict[str, Any]:
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        script = self.script.relative_to(self.repo) if self.script.is_relative_to(self.repo) else self.script
        return {
            **{key: self.git.get(key) for key in ("commit", "dirty", "changes", "results_changed")},
            "changed_during_run": self.git.get("at_end"),
            "allow_dirty": self.args.allow_dirty,
            "smoke": self.args.smoke,
            "smoke_changes": self.smoke_changes,
            "script": str(script),
            "script_sha256": sha256(self.script),
            "common_sha256": sha256(__file__),
            **cpu_info(),
            "native_bf16": native_bf16(self.device.type),
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "gpu": gpu,
            "device": str(self.device),
            "command": [Path(sys.executable).name, *sys.argv],
            "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }

    def write(self, report: dict[str, Any], default_name: str) -> Path | None:
        """`report` with the provenance, as JSON to --out (else benchmarks/results/<default_name>; under --smoke
        nothing without --out). Refused if the tree changed during the run, unless --allow-dirty."""
        out = getattr(self.args, "out", None)
        if out is None and self.args.smoke:
            print("--smoke: no JSON written (pass --out PATH to write one)")
            return None
        path = Path(out or RESULTS / default_name)
        now = git_state(self.repo)
        if now["commit"] != self.git["commit"] or now["changes"] != self.git["changes"]:
            refuse_dirty({**now, "dirty": True}, self.args.allow_dirty, " (the tree changed during the run)")
            self.git = {**self.git, "at_end": now}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**report, "provenance": self.provenance()}, indent=1, default=str) + "\n")
        tmp.replace(path)
        print(f"wrote {path}")
        return path


def start(
    script: str | os.PathLike,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    *,
    rows: Iterable[str] | None = None,
    smoke: Mapping[str, Any] | None = None,
    repo: Path = REPO,
) -> Run:
    """Parse the arguments, shrink them under --smoke, check --repeats and --rows, set the threads, decide the
    device, and refuse a dirty tree (unless --allow-dirty) before anything is measured."""
    args = parser.parse_args(argv)
    changes = (
        shrink(args, {**(smoke or {}), **({"repeats": 1} if hasattr(args, "repeats") else {})}) if args.smoke else []
    )
    args.allow_dirty = args.allow_dirty or args.smoke
    if hasattr(args, "repeats") and (args.repeats < 1 or (args.repeats < MIN_REPEATS and not args.smoke)):
        parser.error(
            f"--repeats {args.repeats}: at least {MIN_REPEATS} (one repeat measures no noise; 1 only with --smoke)"
        )
    names: list[str] = []
    if rows is not None:
        try:
            names = parse_rows(args.rows, rows)
        except ValueError as error:
            parser.error(str(error))
    if changes:
        print(f"--smoke: {', '.join(changes)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.smoke and str(args.device).startswith("cuda") and not torch.cuda.is_available():
        print(f"--smoke: no CUDA here, so cpu instead of --device {args.device}")
        changes.append(f"device=cpu (not {args.device})")
        args.device = "cpu"
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    state = git_state(repo)
    refuse_dirty(state, args.allow_dirty)
    return Run(args, Path(script).resolve(), device, names, state, Path(repo).resolve(), changes)


SMOKE_IMAGES = 1000  # --smoke: the reference statistics and quick classifiers see this many real images


@dataclass(frozen=True, kw_only=True)
class FirstImages:
    """A data source cut to its first `limit` images (--smoke: the same code path, a tenth of MNIST's cost)."""

    base: Any  # the source cut (a field named `source` would shadow the cache key's source name)
    limit: int

    def prepare(self) -> None:
        self.base.prepare()

    def count(self) -> int:
        return min(self.limit, self.base.count())

    def load(self, *, image_size: int, channels: int | None) -> Any:
        from ddpm.data.sources import ImageSet

        data = self.base.load(image_size=image_size, channels=channels)
        return ImageSet(images=data.images[: self.limit], labels=data.labels[: self.limit],
                        num_classes=data.num_classes)  # fmt: skip


def reference_cache(cache_dir: str, *, smoke: bool, tmp: str | Path) -> str | Path:
    """Where reference statistics are cached: `cache_dir`, but under --smoke the temp folder `tmp` unless a cache
    folder was named (smoke statistics belong to a throwaway classifier; they must not pile up in ~/.cache)."""
    from ddpm.metrics.fid import DEFAULT_CACHE_DIR

    return tmp if smoke and cache_dir == DEFAULT_CACHE_DIR else cache_dir


def mnist_or_digits(root: str, *, allow_digits: bool, limit: int | None = None) -> tuple[Any, str]:
    """The MNIST IDX files under `root` as a data source, or scikit-learn's digits where allowed (--smoke); with
    `limit`, only their first `limit` images (FirstImages)."""
    from ddpm.data.sources import DigitsSource, MNISTSource

    if Path(root).is_dir():
        source, name = MNISTSource(root=root), f"MNIST ({root})"
    elif not allow_digits:
        raise SystemExit(f"no MNIST under {root}: pass --data-root (a folder of MNIST IDX files), or --smoke")
    else:
        print(f"no MNIST under {root}: scikit-learn's digits instead (the same tensor shapes and cost)")
        source, name = DigitsSource(), "digits (MNIST missing)"
    if limit is None:
        return source, name
    return FirstImages(base=source, limit=limit), f"the first {limit} images of {name}"
