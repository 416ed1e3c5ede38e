"""The benchmark library: arguments, device, interleaved repeats, statistics, the one timer and table printer,
provenance and JSON, and the project's objects as its commands build them (sampler presets composed from
conf/sampler/, sample.py's draw, train.py's config). Every script: `run = start(__file__, parser, argv, rows=ROWS,
smoke=SMOKE)`, measure, `run.write(report, name)`; docs/benchmarks.md says what each rule is for.
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
import time
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
SAMPLERS = {  # preset -> a conf/sampler/ group and its overrides (the one source: the group's yaml)
    "ddpm1000": "ddpm steps=null", "ddpm250": "ddpm", "ddim100": "ddim steps=100", "ddim50": "ddim",
    "ddim20": "ddim steps=20", "ddim4": "ddim steps=4", "dpm++20": "dpm_solver", "dpm++10": "dpm_solver steps=10",
    "dpm++sde15": "dpm_solver_sde steps=15", "dpm++sde20": "dpm_solver_sde", "dpm++sde25": "dpm_solver_sde steps=25",
    "dpm++sde25_logsnr": "dpm_solver_sde steps=25 spacing=logsnr",  # uniform in log sigma
    "edm13": "edm churn=0", "edm13_churn": "edm", "restart": "restart",  # Heun (13 steps) and restart: 25 calls
}  # fmt: skip
T = TypeVar("T")


def stats(values: Iterable[float]) -> dict[str, Any]:
    """The true median (mean of the two middle values for an even count), min, max and every value."""
    runs = [float(v) for v in values]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def paired_ratios(runs: Mapping[str, Sequence[float]], baseline: str) -> dict[str, dict[str, Any]]:
    """Per row, each repeat's figure over `baseline`'s in the same repeat, and their stats."""
    return {name: stats(v / b for v, b in zip(values, runs[baseline], strict=True)) for name, values in runs.items()}


def rate(values: Iterable[float], key: str = "images_per_s") -> dict[str, Any]:
    """stats() as a row's JSON keeps them: key (the median), key_min, key_max, key_runs."""
    s = stats(values)
    return {key: s["median"], f"{key}_min": s["min"], f"{key}_max": s["max"], f"{key}_runs": s["runs"]}


def interleaved(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, row) in the order rows run: ABC CBA ABC ..., so slow drift of the machine hits every row alike."""
    return [(r, name) for r in range(repeats) for name in (names if r % 2 == 0 else list(reversed(names)))]


def run_interleaved(names: Sequence[str], repeats: int, measure: Callable[[str, int], T],
                    describe: Callable[[T], str] = str) -> dict[str, list[T]]:  # fmt: skip
    """measure(row, repeat) for every row and repeat, interleaved; {row: [result per repeat]}."""
    runs: dict[str, list[T]] = {name: [] for name in names}
    for repeat, name in interleaved(names, repeats):
        runs[name].append(measure(name, repeat))
        print(f"done {name} ({repeat + 1}/{repeats}): {describe(runs[name][-1])}", flush=True)
    return runs


def figure(s: Mapping[str, Any] | None, spec: str = ".2f", key: str | None = None) -> str:
    """'median [min-max]' of a stats() dict, or of a row's rate() keys `key` ('n/a' for None)."""
    if key is not None and s is not None:
        s = None if s.get(key) is None else {"median": s[key], "min": s[f"{key}_min"], "max": s[f"{key}_max"]}
    return "n/a" if not s else f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """fn()'s result and its seconds, the device synchronised before and after (the one timer of the scripts)."""
    sync(device)
    began = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - began


def table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (the one table printer): None as n/a, a float with 3 significant digits (from 1,000 on:
    whole, with commas)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return "n/a" if v is None else str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def parse_rows(text: str, known: Iterable[str], *, flag: str = "--rows") -> list[str]:
    """'a,b' -> ['a', 'b'], every name one of `known` (ValueError naming the unknown ones and the choices)."""
    names, known = [n.strip() for n in text.split(",") if n.strip()], list(known)
    if (unknown := [n for n in names if n not in known]) or not names:
        raise ValueError(f"{flag} {text!r}: unknown {unknown or 'empty'}; choose from {', '.join(known)}")
    return names


def add_arguments(parser: argparse.ArgumentParser, *, rows: Sequence[str] | None = None,
                  default_rows: Sequence[str] | None = None, repeats: int | None = 3, device: str = "auto",
                  out: bool = True) -> None:  # fmt: skip
    """The options every benchmark shares (rows and repeats where the script has rows)."""
    add = parser.add_argument
    if rows is not None:
        add("--rows", default=",".join(default_rows or rows), help=f"comma-separated: {', '.join(rows)}")
    if repeats is not None:
        add("--repeats", type=int, default=repeats, help=f"runs of every row, interleaved; >= {MIN_REPEATS}")
    add("--device", default=device, help="auto (cuda if there is one, else cpu), cpu, cuda, cuda:1 ...")
    add("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    if out:
        add("--out", default=None, help="JSON path (default: benchmarks/results/<name>.json)")
    add("--smoke", action="store_true", help="seconds-long run of every code path; JSON only to --out")
    add("--allow-dirty", action="store_true", help="measure a tree with uncommitted changes (recorded in the JSON)")


def sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """HEAD and the changes `git status --porcelain` lists. Dirty if any is outside benchmarks/results/ (outputs:
    listed apart), or if there is no commit (nothing names the code)."""

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


def refuse_dirty(state: Mapping[str, Any], allow_dirty: bool, when: str = "") -> None:
    if state["dirty"] and not allow_dirty:
        listed = "\n  ".join(state["changes"][:20])
        raise SystemExit(
            f"refusing to measure{when}: the tree has uncommitted changes, so no commit names the code that ran:\n"
            f"  {listed}\ncommit them and run again at a clean commit, or pass --allow-dirty (recorded in the JSON)"
        )


def cpu_info() -> dict[str, Any]:
    """CPU model, the vector flags that decide bf16 and vector speed, torch's CPU capability."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), platform.processor())
    flags = set(next((x.split(":", 1)[1].split() for x in info if x.startswith("flags")), []))
    return {"cpu": model, "cpu_flags": {name: flag in flags for name, flag in CPU_FLAGS.items()},
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpus_usable": len(os.sched_getaffinity(0))}  # fmt: skip


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
        script = self.script.relative_to(self.repo) if self.script.is_relative_to(self.repo) else self.script
        return {**{key: self.git.get(key) for key in ("commit", "dirty", "changes", "results_changed")},
                "changed_during_run": self.git.get("at_end"), "allow_dirty": self.args.allow_dirty,
                "smoke": self.args.smoke, "smoke_changes": self.smoke_changes, "script": str(script),
                "script_sha256": sha256(self.script), "common_sha256": sha256(__file__), **cpu_info(),
                "native_bf16": native_bf16(self.device.type), "threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch": torch.__version__,
                "python": platform.python_version(), "device": str(self.device),
                "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
                "command": [Path(sys.executable).name, *sys.argv],
                "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}  # fmt: skip

    def write(self, report: dict[str, Any], default_name: str) -> Path | None:
        """`report` with the provenance, as JSON to --out (else benchmarks/results/<default_name>; under --smoke
        nothing without --out). Refused if the tree changed during the run, unless --allow-dirty."""
        out = getattr(self.args, "out", None)
        if out is None and self.args.smoke:
            print("--smoke: no JSON written (pass --out PATH to write one)")
            return None
        path, now = Path(out or RESULTS / default_name), git_state(self.repo)
        if now["commit"] != self.git["commit"] or now["changes"] != self.git["changes"]:
            refuse_dirty({**now, "dirty": True}, self.args.allow_dirty, " (the tree changed during the run)")
            self.git = {**self.git, "at_end": now}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**report, "provenance": self.provenance()}, indent=1, default=str) + "\n")
        tmp.replace(path)
        print(f"wrote {path}")
        return path


def start(script: str | os.PathLike, parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, *,
          rows: Iterable[str] | None = None, smoke: Mapping[str, Any] | None = None,
          repo: Path = REPO) -> Run:  # fmt: skip
    """Parse the arguments; under --smoke shrink them (a number to at most SMOKE's, anything else to it; one repeat;
    --allow-dirty; cpu without CUDA); check --repeats and --rows, set the threads, decide the device, and refuse a
    dirty tree before anything is measured."""
    args, changes = parser.parse_args(argv), []
    has_repeats = hasattr(args, "repeats")
    for key, value in {**(smoke or {}), **({"repeats": 1} if has_repeats else {})}.items() if args.smoke else ():
        old = getattr(args, key, None)
        number = isinstance(value, int | float) and not isinstance(value, bool) and isinstance(old, int | float)
        small = min(old, value) if number else value
        if small != old:
            setattr(args, key, small)
            changes.append(f"{key}={small}")
    args.allow_dirty = args.allow_dirty or args.smoke
    if has_repeats and (args.repeats < 1 or (args.repeats < MIN_REPEATS and not args.smoke)):
        parser.error(f"--repeats {args.repeats}: at least {MIN_REPEATS} (one measures no noise; 1 only with --smoke)")
    try:
        names = parse_rows(args.rows, rows) if rows is not None else []
    except ValueError as error:
        parser.error(str(error))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.smoke and str(args.device).startswith("cuda") and not torch.cuda.is_available():
        changes.append(f"device=cpu (not {args.device})")
        args.device = "cpu"
    if changes:
        print(f"--smoke: {', '.join(changes)}")
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    refuse_dirty(state := git_state(repo), args.allow_dirty)
    return Run(args, Path(script).resolve(), device, names, state, Path(repo).resolve(), changes)


def sampler(name: str, steps: int | None = None) -> Any:
    """A preset of SAMPLERS, or a conf/sampler/ group, with `steps` if given: built as sample.py builds
    `sampler=<group> sampler.key=value` (ddpm.config.build: a refusal names the key)."""
    from omegaconf import OmegaConf

    from ddpm.config import build

    group, *overrides = SAMPLERS.get(name, name).split()
    if not (path := REPO / "conf" / "sampler" / f"{group}.yaml").is_file():
        groups = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"sampler {name!r}: a preset ({', '.join(SAMPLERS)}) or a group ({', '.join(groups)})")
    overrides += [f"steps={steps}"] if steps is not None else []
    node = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    return build(OmegaConf.create({"sampler": node}).sampler)  # under `sampler`: a refusal names sampler.<key>


def draw(net: Any, diffusion: Any, sampler_: Any, count: int, device: torch.device, *, guidance: float = 0.0,
         batch: int | None = None, decode: Callable | None = None, **options: Any) -> Any:  # fmt: skip
    """`count` images as sample.py draws them (labels 0..9 in turn for a conditional model, seed 0 unless given):
    generate()'s Generated. options: denoiser_for's (interval, precision, channels_last, compile, compile_backend),
    generate's (seed, labels). batch None: sample.py's batch_size=auto. decode: a latent model's VAE decoder."""
    from ddpm.diffusion.generate import class_cycle, denoiser_for, generate
    from ddpm.diffusion.samplers.base import decoded
    from ddpm.sampling.runtime import default_batch_size

    batch = batch or default_batch_size(device, guided=guidance != 0)
    classes, labels, seed = getattr(net, "num_classes", None), options.pop("labels", None), options.pop("seed", 0)
    labels = class_cycle(count, classes) if labels is None and classes is not None else labels
    denoiser = denoiser_for(net, diffusion, guidance=guidance, rows=min(batch, count), **options)
    return generate(denoiser, decoded(sampler_, decode), (count, net.in_channels, net.image_size, net.image_size),
                    labels=labels, seed=seed, batch_size=batch, device=device)  # fmt: skip


def compose(config: str, overrides: Sequence[str]) -> Any:
    """conf/<config>.yaml composed with `overrides`, as the command line would (train.py, sample.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config, overrides=list(overrides))


def entry_point(script: str, overrides: Sequence[str], threads: int | None = None) -> tuple[str, float]:
    """`python <script> overrides...` (train.py, sample.py) as a subprocess from the repository: its stdout and
    wall seconds; a failure stops the run with its stderr."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, script, *overrides], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script} {' '.join(overrides)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout, time.perf_counter() - began
