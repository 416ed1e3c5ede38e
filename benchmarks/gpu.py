"""The prepared GPU command (issue 35): our Trainer against a bare loop and diffusers' UNet2DModel on every GPU preset,
sample.py's sampling rate and a profile of one training step, in under 8 minutes of a lent H100 or H200.

    make gpu-wheels               # here, once: the packages the GPU machine lacks, into .whl/
    bash benchmarks/gpu.sh OUT    # there (carry .whl): installs them, runs python benchmarks/gpu.py OUT --allow-dirty

1. Training, group by group (PLAN, or --group MODEL@BATCH=RUNNER:SETTING,...): each row built and --prepare-steps
   steps taken (a cold compile happens there), then the rows' windows of about --window-s interleaved (--repeats).
   `ours`: loops.Fit, train.py's Trainer minus TIMING; `bare`: loops.Bare on the same objects; `diffusers`: its
   UNet2DModel twin in that loop. The fastest `ours` row of --profile-group: one step under torch.profiler.
2. Sampling (after --profile-group): ddpm.sampling.sample with sample.py's defaults on a fresh ddpm_cifar10.
3. Issue 35's goals against the figures. OUT/gpu.json is written after every part (`complete`, `skipped`); a part
   whose ESTIMATE does not fit before --deadline-s is skipped. docs/benchmarks.md describes every column.
"""

import argparse
import contextlib
import gc
import logging
import math
import os
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl
import loops
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

PLAN = {  # group (preset@batch) -> its rows (runner:setting), built in this order; groups most wanted first. One
    # compile mode fits: `default`, auto's choice on CUDA (a cold compile is 1-2 min; reduce-overhead: --group)
    "ddpm_cifar10@128": "ours:fp32 bare:fp32 ours:bf16 bare:bf16 diffusers:bf16",
    "ddpm_cifar10@512": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16 ours:bf16+default bare:bf16+default",
    "seed_mnist@64": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16",
    "unet64@64": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16",
    "seed_mnist@512": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16",
}
IMAGES = {"ddpm_cifar10": 50_000, "seed_mnist": 60_000, "unet64": 20_000}  # in RAM: CIFAR-10's, MNIST's, 245 MB
ESTIMATE = {  # seconds on an H100, to plan and to guard the deadline (each part's real time is printed and kept)
    "start": 30,  # imports, CUDA, images, FLOP counts
    "prepare": 5,  # build an eager row and take its first steps
    "compile": 150,  # a cold inductor compile of a preset's loss (issue 35: 1-2 min; seed_mnist on the H200: 110 s)
    "compile_mode": 75,  # the same graph in another mode (Triton kernels cached; lowered again)
    "compile_shared": 5,  # a bare row in a mode its Trainer row compiled: the same function, no second compile
    "fit": 1.5,  # a Trainer fit's own start and end, per window of an `ours` row
    "warmup": 0.3,  # a window's untimed steps
    "profile": 10,
    "sampling": 30,
}
PRESETS = {  # the overrides a user trains each preset with (the preset's experiment where there is one)
    "ddpm_cifar10": ["experiment=cifar10"],
    "unet64": ["experiment=imagenet64"],
    "seed_mnist": ["model=seed_mnist", "data=mnist", "trainer=gpu"],  # the preset as written, linear DDPM
}
TIMING = ["data.root=in-memory", "callbacks.checkpoint=null", "callbacks.sample_grid=null",
          "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=50"]  # fmt: skip  # what differs from train.py
SMOKE_MODELS = {  # --smoke: each preset's kind of network at 8x8 (a UNet2DModel twin exactly where the preset has one)
    "ddpm_cifar10": ["model.base_channels=8", "model.channel_mult=[1,2]", "model.num_res_blocks=1",
                     "model.attention_resolutions=[4]", "model.norm_groups=4", "model.image_size=8"],
    "unet64": ["model.base_channels=8", "model.channel_mult=[1,2]", "model.num_res_blocks=1",
               "model.attention_resolutions=[8,4]", "model.num_heads=2", "model.norm_groups=4", "model.image_size=8"],
    "seed_mnist": ["model.base_channels=8", "model.channel_mult=[1,2]", "model.downsample=[false]",
                   "model.num_res_blocks=1", "model.attention_resolutions=[8]", "model.num_heads=2",
                   "model.emb_dim=16", "model.norm_groups=4", "model.image_size=8"],
}  # fmt: skip
SMOKE = {"window_s": 0.0, "min_steps": 1, "max_steps": 1, "warmup": 1, "prepare_steps": 2, "sample_count": 4,
         "sample_batch": 2, "compile_backend": "eager", "images": 64, "batch_scale": 1 / 64}  # fmt: skip
GOALS = {  # issue 35's goals: (what, target, the better direction)
    "cifar10_trainer_bf16_images_per_s": ("ddpm_cifar10 through our Trainer in bf16, images/s", 8000, "higher"),
    "trainer_vs_bare": ("our Trainer / the bare loop at the same settings (the lowest median)", 0.97, "higher"),
    "trainer_vs_diffusers": ("our Trainer / diffusers' UNet2DModel at equal config (the lowest median)", 1.5, "higher"),
    "seed_mnist_epoch_s": ("seed_mnist: seconds per 60,000-image epoch through our Trainer", 3.0, "lower"),
    "sampling_50k_s": ("50,000 unguided CIFAR-10-shaped samples, default sampler, seconds", 60.0, "lower"),
}
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}  # one kernel each
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}  # a CUDA graph: many kernels, one call


@dataclass(frozen=True)
class Setting:
    """A row's precision and compile mode: fp32, bf16 or bf16+<mode>."""

    precision: str  # fp32 | bf16
    mode: str | None = None  # torch.compile mode of the training loss; None: eager

    @classmethod
    def parse(cls, text: str) -> "Setting":
        precision, _, mode = text.partition("+")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"setting {text!r}: fp32, bf16 or bf16+<compile mode> (e.g. bf16+default)")
        return cls(precision, mode or None)

    def __str__(self) -> str:
        return self.precision + (f"+{self.mode}" if self.mode else "")


def compose_run(model: str, batch: int, setting: Setting, *, device: torch.device, backend: str, folder: Path,
                smoke: bool) -> Any:  # fmt: skip
    """train.py's config of `model` at `batch` and `setting` (conf/ composed by Hydra, as the command line would)."""
    return common.compose("train", [
        *PRESETS[model], f"data.batch_size={batch}", f"compile={setting.mode or 'false'}",
        f"trainer.precision={'bf16-mixed' if setting.precision == 'bf16' else '32-true'}",
        f"module.compile_backend={backend}", f"trainer.accelerator={'gpu' if device.type == 'cuda' else 'cpu'}",
        f"paths.output_dir={folder}", *TIMING,
        *((SMOKE_MODELS[model] + ["data.val_size=0.25", "data.num_workers=0"]) if smoke else [])])  # fmt: skip


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Runner:
    """A row: built once (`ours`: loops.Fit, else loops.Bare), `prepare` takes its first steps (a cold compile happens
    there), then `window` times steps as often as the group interleaves it."""

    def __init__(self, kind: str, cfg: Any, source: Any, device: torch.device, folder: Path) -> None:
        self.kind, self.device, before, self.step_estimate = kind, device, allocated(device), 0.0
        if kind == "ours":
            self.fit = loops.Fit(cfg, source, device, folder)
            self.net, self.precision = self.fit.net, self.fit.precision
        else:
            torch.manual_seed(cfg.seed)
            net = instantiate(cfg.model)
            net = loops.make_twin(net, loops.model_arguments(cfg)) if kind == "diffusers" else net
            self.bare = loops.Bare(cfg, source, device, net=net)
            self.net, self.precision = self.bare.net, self.bare.precision
        self.resident = allocated(device) - before  # what the row keeps on the device between windows

    def prepare(self, steps: int) -> dict[str, Any]:
        before = allocated(self.device)
        if self.kind == "ours":
            probe = loops.Steps(self.device)
            self.fit.fit(steps, probe)
            times = [probe.ends[i + 1] - probe.starts[i] for i in range(steps)]
        else:
            batches = loops.endless(self.bare.loader)
            times = [self.bare.steps(1, batches) for _ in range(steps)]
        self.resident += allocated(self.device) - before  # the optimizer's state, graph pools
        self.step_estimate = statistics.median(times[1:] or times)
        return {"first_step_s": times[0], "prepare_steps_s": times}

    def window(self, warmup: int, steps: int) -> float:
        """Seconds per step over `steps` steps after `warmup` untimed ones (a Trainer row: a new fit)."""
        if self.kind == "ours":
            first = max(warmup, 1)
            timer = loops.Steps(self.device, at=(first, first + steps))
            self.fit.fit(first + steps, timer)
            return timer.window / steps
        batches = loops.endless(self.bare.loader)  # a new epoch, as each fit of the Trainer rows starts one
        self.bare.steps(warmup, batches)
        return self.bare.steps(steps, batches) / steps


class Clock:
    """Seconds since the process started (the imports count), and whether a part of `seconds` ends in time."""

    def __init__(self, deadline_s: float) -> None:
        try:  # the process's start: /proc (Linux); elsewhere now
            ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
            age = float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            age = 0.0
        self.start, self.deadline = time.perf_counter() - age, deadline_s

    def now(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, seconds: float) -> bool:
        return self.now() + seconds <= self.deadline

    def say(self, text: str) -> None:
        print(f"[{self.now():6.1f} s] {text}", flush=True)


def parse_plan(groups: list[str] | None) -> list[tuple[str, int, list[tuple[str, Setting]]]]:
    """PLAN, or --group "MODEL@BATCH=RUNNER:SETTING,..." options: [(model, batch, [(runner, setting)])]."""
    plan = []
    for text in groups or [f"{g}={r.replace(' ', ',')}" for g, r in PLAN.items()]:
        name, _, rows = text.partition("=")
        model, _, batch = name.partition("@")
        pairs = [row.split(":") for row in rows.split(",") if row]
        if model not in IMAGES or not batch.isdigit() or any(len(p) != 2 for p in pairs) or not pairs:
            raise ValueError(f"--group {text!r}: MODEL@BATCH=RUNNER:SETTING,... with MODEL one of {list(IMAGES)}")
        if any(kind not in ("ours", "bare", "diffusers") for kind, _ in pairs):
            raise ValueError(f"--group {text!r}: runners are ours, bare and diffusers")
        plan.append((model, int(batch), [(kind, Setting.parse(setting)) for kind, setting in pairs]))
    return plan


def network(kind: str) -> str:
    return "diffusers" if kind == "diffusers" else "ours"  # bare and ours share the network (and its graphs)


def prepare_cost(kind: str, setting: Setting, compiled: set[tuple[str, str]]) -> float:
    """ESTIMATE of building a row, `compiled` holding the (network, mode) pairs its group has compiled already."""
    if setting.mode is None:
        return ESTIMATE["prepare"]
    if (network(kind), setting.mode) in compiled:
        return ESTIMATE["compile_shared"]
    return ESTIMATE["compile_mode" if any(n == network(kind) for n, _ in compiled) else "compile"]


def show_plan(args: argparse.Namespace) -> tuple[list, dict[str, float]]:
    """The plan (--batch-scale applied to every group and to --profile-group) and its estimate per part, printed
    (a diffusers row of a preset without a UNet2DModel twin costs nothing)."""
    scaled = lambda batch: max(1, round(int(batch) * args.batch_scale))  # noqa: E731
    plan = [(model, scaled(batch), rows) for model, batch, rows in parse_plan(args.group)]
    if len({(m, b) for m, b, _ in plan}) < len(plan):
        raise SystemExit(f"groups {[f'{m}@{b}' for m, b, _ in plan]}: each preset@batch once (merge their rows)")
    model, _, batch = args.profile_group.partition("@")
    args.profile_group = f"{model}@{scaled(batch)}" if batch.isdigit() else args.profile_group
    parts = {"start": ESTIMATE["start"]}
    for model, batch, rows in plan:
        cfg = compose_run(model, batch, Setting("fp32"), device=torch.device("cpu"), backend="eager",
                          folder=Path("unused"), smoke=args.smoke)  # fmt: skip
        twin = loops.twin_refusal(loops.model_arguments(cfg)) is None
        rows = [(k, s) for k, s in rows if k != "diffusers" or twin]
        compiled, prepare = set(), 0.0
        for kind, setting in rows:
            prepare += prepare_cost(kind, setting, compiled)
            compiled |= {(network(kind), setting.mode)} if setting.mode else set()
        windows = sum(args.window_s + ESTIMATE["warmup"] + (ESTIMATE["fit"] if k == "ours" else 0) for k, _ in rows)
        parts[f"{model}@{batch}"] = prepare + args.repeats * windows
    parts.update(profile=ESTIMATE["profile"], sampling=ESTIMATE["sampling"])
    parts["total"] = sum(parts.values())
    print("plan:", "; ".join(f"{m}@{b}: {' '.join(f'{k}:{s}' for k, s in rows)}" for m, b, rows in plan))
    print("estimate (s):", ", ".join(f"{k} {v:.0f}" for k, v in parts.items()))
    return plan, parts


def run_group(model: str, batch: int, rows: list, ctx: dict[str, Any]) -> dict[str, Any]:
    """Build every row of the group, time them interleaved, summarise; the profile if this is --profile-group."""
    args, device, clock, scratch = ctx["args"], ctx["device"], ctx["clock"], ctx["scratch"]
    name, runners, info, out, compiled, data = f"{model}@{batch}", {}, {}, {}, set(), None
    dynamo = dynamo_counts()
    for kind, setting in rows:
        row = f"{kind}:{setting}"
        cfg = compose_run(model, batch, setting, device=device, backend=args.compile_backend,
                          folder=scratch / name / row.replace(":", "_"), smoke=args.smoke)  # fmt: skip
        cost = prepare_cost(kind, setting, compiled)
        if kind == "diffusers" and (reason := loops.twin_refusal(loops.model_arguments(cfg))):
            out[row] = {"row": row, "skipped": reason}
        elif not clock.fits(cost):
            out[row] = {"row": row, "skipped": f"deadline: {clock.deadline - clock.now():.0f} s left, needs ~{cost} s"}
        else:
            try:
                began = time.perf_counter()
                if data is None:
                    data = loops.load_images(instantiate(cfg.model), args.images or IMAGES[model])
                runner = Runner(kind, cfg, loops.TensorSource(data), device, Path(cfg.paths.output_dir))
                prepared = runner.prepare(args.prepare_steps)
                runners[row], info[row] = runner, {**prepared, "prepare_s": time.perf_counter() - began}
                compiled |= {(network(kind), setting.mode)} if setting.mode else set()
                clock.say(f"{name} {row}: built, first step {prepared['first_step_s']:.1f} s, "
                          f"{runner.step_estimate * 1e3:.1f} ms/step after")  # fmt: skip
            except Exception as error:  # a row that fails is recorded; the others go on
                out[row] = failed(row, error)
    flops = {k: loops.step_flops(r.net, batch, device) for k, r in runners.items()}
    runs = time_rows(runners, name, ctx)
    for row, runner in runners.items():
        out[row] = row_result(row, runner, info[row], runs[row], batch, flops[row], args) | out.get(row, {})
    result = {"group": name, "model": model, "batch_size": batch, "images_in_ram": len(data.images) if data else 0,
              "parameters": {r: sum(p.numel() for p in x.net.parameters()) for r, x in runners.items()},
              "rows": [out[f"{k}:{s}"] for k, s in rows if f"{k}:{s}" in out], "ratios": ratios(out),
              "dynamo": {k: v - dynamo[k] for k, v in dynamo_counts().items()}}  # fmt: skip
    if name == args.profile_group:
        result["profile"] = profile_best(runners, out, ctx)
    runners.clear()
    gc.collect()
    torch._dynamo.reset()  # frees the group's compiled graphs and CUDA-graph pools
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def dynamo_counts() -> dict[str, int]:
    """Graphs dynamo compiled and graph breaks so far in this process (a group's: the difference)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def time_rows(runners: dict[str, Runner], name: str, ctx: dict[str, Any]) -> dict[str, list[dict]]:
    """Each row's windows, interleaved over --repeats; a repeat that does not fit before the deadline is skipped."""
    args, device, clock = ctx["args"], ctx["device"], ctx["clock"]
    runs: dict[str, list[dict]] = {row: [] for row in runners}
    steps = {row: max(args.min_steps, min(args.max_steps, math.ceil(args.window_s / max(r.step_estimate, 1e-9))))
             for row, r in runners.items()}  # fmt: skip
    last = sum(args.window_s + ESTIMATE["warmup"] + ESTIMATE["fit"] * (r.kind == "ours") for r in runners.values())
    for repeat in range(args.repeats if runners else 0):
        if not clock.fits(last):
            ctx["skipped"].append(f"{name}: repeats {repeat + 1}-{args.repeats} (deadline; one took {last:.0f} s)")
            break
        began = time.perf_counter()
        for _, row in [pair for pair in common.interleaved(list(runners), args.repeats) if pair[0] == repeat]:
            if len(runs[row]) < repeat:
                continue  # failed in an earlier repeat
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                base = allocated(device)
                step_s = runners[row].window(args.warmup, steps[row])
                peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
                runs[row].append({"step_s": step_s, "steps": steps[row], "peak_above_bytes": peak})
            except Exception as error:
                ctx["errors"].append(failed(f"{name} {row} (repeat {repeat + 1})", error))
        last = time.perf_counter() - began
        clock.say(f"{name} repeat {repeat + 1}/{args.repeats} in {last:.1f} s")
    return runs


def row_result(row: str, runner: Runner, info: dict, runs: list[dict], batch: int, flops: float, args) -> dict:
    """A row's figures over its windows: images/s median [min-max], ms/step, peak MiB, MFU, compile seconds."""
    kind, setting = row.split(":")
    out = {"row": row, "runner": kind, "setting": setting, "precision": runner.precision,
           "compile": setting.partition("+")[2] or None, "batch_size": batch, "warmup": args.warmup,
           "steps": [r["steps"] for r in runs], "flops_per_step": flops, "first_step_s": info["first_step_s"],
           "prepare_s": info["prepare_s"]}  # fmt: skip
    if not runs:
        return out | {"error": "no window was measured (see errors)"}
    ips, step_s = common.stats(batch / r["step_s"] for r in runs), statistics.median(r["step_s"] for r in runs)
    above = [r["peak_above_bytes"] for r in runs if r["peak_above_bytes"] is not None]
    peak = loops.peak_flops(runner.device, "bf16")
    return out | {"images_per_s": ips["median"], "images_per_s_min": ips["min"], "images_per_s_max": ips["max"],
                  "images_per_s_runs": ips["runs"], "ms_per_step": 1e3 * step_s, "s_per_60k": 60_000 / ips["median"],
                  "peak_memory_mib": (runner.resident + max(above)) / 2**20 if above else None,
                  "mfu": None if peak is None else flops * ips["median"] / batch / peak,
                  "compile_s": info["first_step_s"] - step_s if out["compile"] else None}  # fmt: skip


def ratios(rows: dict[str, dict]) -> dict[str, dict]:
    """ours / bare and ours / diffusers at each setting, and each compiled ours row / ours bf16 eager, paired per
    repeat (the two ran side by side in each)."""
    found = {}
    for row, r in rows.items():
        kind, _, setting = row.partition(":")
        if kind != "ours" or "images_per_s_runs" not in r:
            continue
        for other in [f"bare:{setting}", f"diffusers:{setting}"] + (["ours:bf16"] if "+" in setting else []):
            if "images_per_s_runs" in rows.get(other, {}):
                a, b = r["images_per_s_runs"], rows[other]["images_per_s_runs"]
                n = min(len(a), len(b))
                found[f"{row} / {other}"] = common.paired_ratios({"a": a[:n], "b": b[:n]}, "b")["a"]
    return found


def goals(report: dict[str, Any]) -> dict[str, dict]:
    """Issue 35's goals against the run's figures (None where the run has none)."""
    rows = [(g["group"], r) for g in report["groups"] for r in g["rows"] if r.get("images_per_s")]
    ratio_rows = [(v["median"], f"{g['group']} {k}", k.split(" / ")[1]) for g in report["groups"]
                  for k, v in g["ratios"].items()]  # fmt: skip

    def best(model: str, precision: str | None = None) -> tuple[float | None, str | None]:
        found = [(r["images_per_s"], f"{g} {r['row']}") for g, r in rows if g.startswith(model + "@")
                 and r["runner"] == "ours" and precision in (None, r["precision"])]  # fmt: skip
        return max(found) if found else (None, None)

    def lowest(peer: str) -> tuple[float | None, str | None]:
        return min(((v, k) for v, k, other in ratio_rows if other.startswith(peer + ":")), default=(None, None))

    def goal(key: str, value: float | None, source: str | None) -> dict[str, Any]:
        what, target, better = GOALS[key]
        met = None if value is None else (value >= target if better == "higher" else value <= target)
        return {"goal": what, "target": target, "value": value, "met": met, "from": source}

    seed, rate = best("seed_mnist"), (report.get("sampling") or {}).get("images_per_s")
    return {"cifar10_trainer_bf16_images_per_s": goal("cifar10_trainer_bf16_images_per_s",
                                                      *best("ddpm_cifar10", "bf16-mixed")),
            "trainer_vs_bare": goal("trainer_vs_bare", *lowest("bare")),
            "trainer_vs_diffusers": goal("trainer_vs_diffusers", *lowest("diffusers")),
            "seed_mnist_epoch_s": goal("seed_mnist_epoch_s", seed[0] and 60_000 / seed[0], seed[1]),
            "sampling_50k_s": goal("sampling_50k_s", rate and 50_000 / rate, rate and "sampling")}  # fmt: skip


class Profile(pl.Callback):
    """torch.profiler over one steady step: from after batch `first`'s hooks to after batch first+1's (synced)."""

    def __init__(self, device: torch.device, first: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.device, self.first, self.batches, self.profiler = device, first, 0, profile(activities=activities)
        self.host_s = 0.0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1
        if self.batches in (self.first, self.first + 1):
            common.sync(self.device)
        if self.batches == self.first:
            self.profiler.start()
            self.host_s = -time.perf_counter()
        elif self.batches == self.first + 1:
            self.host_s += time.perf_counter()
            self.profiler.stop()


def busy_seconds(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of (start_ns, end_ns) intervals."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        total += stop - start if end is None or start > end else max(0, stop - end)
        end = stop if end is None or stop > end else end
    return total / 1e9


def kernel_summary(events: list[Any], top: int = 15) -> dict[str, Any]:
    """Kineto events of one step -> the `top` GPU kernels by time, kernel launches, and the share of the step's span
    the GPU is idle (no kernel, copy or memset running: the union of their intervals; sync events are waits)."""
    cpu = torch.autograd.DeviceType.CPU
    device = [e for e in events if e.device_type() != cpu and "Sync" not in e.name()]
    kernels = [e for e in device if not e.name().startswith(("Memcpy", "Memset"))]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name(), []).append((e.end_ns() - e.start_ns()) / 1e3)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    span = (max(e.end_ns() for e in events) - min(e.start_ns() for e in events)) / 1e9 if events else 0.0
    busy, host = busy_seconds([(e.start_ns(), e.end_ns()) for e in device]), [e.name() for e in events if
                                                                               e.device_type() == cpu]  # fmt: skip
    return {"kind": "cuda kernels", "kernels_run": len(kernels), "span_s": span, "gpu_busy_s": busy,
            "top": [{"name": n, "calls": len(t), "total_us": sum(t), "mean_us": sum(t) / len(t)} for n, t in ranked],
            "kernel_launches": sum(name in LAUNCHES for name in host),
            "graph_launches": sum(name in GRAPH_LAUNCHES for name in host),
            "gpu_idle_share": None if span <= 0 else max(0.0, 1 - busy / span)}  # fmt: skip


def profile_best(runners: dict[str, Runner], out: dict[str, dict], ctx: dict[str, Any]) -> dict[str, Any]:
    """torch.profiler over one steady step of this group's fastest `ours` row (without a GPU: the top operators by
    self CPU time; no kernels, launches or idle share); the chrome trace to OUT/profile_trace.json.gz."""
    measured = [r for r, x in out.items() if r.startswith("ours:") and x.get("images_per_s") and r in runners]
    if not measured:
        return {"skipped": "no ours row of this group was measured"}
    if not ctx["clock"].fits(ESTIMATE["profile"]):
        return {"skipped": "deadline"}
    best = max(measured, key=lambda r: out[r]["images_per_s"])
    try:
        runner, trace = runners[best], ctx["folder"] / "profile_trace.json.gz"
        probe = Profile(runner.device, max(ctx["args"].warmup, 1))
        runner.fit.fit(probe.first + 2, probe)
        probe.profiler.export_chrome_trace(str(trace))
        events = list(probe.profiler.profiler.kineto_results.events())
        ranked = sorted(probe.profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        summary = kernel_summary(events) if runner.device.type == "cuda" else {
            "kind": "cpu operators (no GPU)", "kernels_run": 0, "kernel_launches": 0, "graph_launches": 0,
            "span_s": None, "gpu_busy_s": None, "gpu_idle_share": None,
            "top": [{"name": e.key, "calls": e.count, "total_us": e.self_cpu_time_total,
                     "mean_us": e.self_cpu_time_total / max(e.count, 1)} for e in ranked]}  # fmt: skip
        return {"row": best, **summary, "events": len(events), "step_host_s": probe.host_s, "trace": trace.name}
    except Exception as error:
        return failed(f"profile of {best}", error)


def failed(what: str, error: BaseException) -> dict[str, Any]:
    """The error of a part that failed, printed with its traceback; the run goes on (an out-of-memory error's
    cached blocks are released for the next part)."""
    traceback.print_exc()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"row": what, "error": f"{type(error).__name__}: {str(error)[:2000]}"}


def sampling(ctx: dict[str, Any]) -> dict[str, Any]:
    """sample.py's default sampler on a freshly initialised ddpm_cifar10 written as ema.pt: `ddpm.sampling.sample`
    with conf/sample.yaml, unguided, at --sample-batch; one batch first (warm-up), then --sample-count images timed.
    Random weights: the speed is a real one, the images are not."""
    from ddpm.sampling import sample
    from ddpm.training import resolve_config
    from ddpm.weights.torch_file import export_ema

    args, device, scratch = ctx["args"], ctx["device"], ctx["scratch"]
    if not ctx["clock"].fits(ESTIMATE["sampling"]):
        return {"skipped": "deadline"}
    try:
        cfg = compose_run("ddpm_cifar10", args.sample_batch, Setting("bf16"), device=device, backend="inductor",
                          folder=scratch / "sampling_run", smoke=args.smoke)  # fmt: skip
        torch.manual_seed(0)
        ckpt = export_ema(scratch / "sampling" / "ema.pt", instantiate(cfg.model).state_dict(), resolve_config(cfg))
        runs = {}
        for name, n in (("warmup", args.sample_batch), ("timed", args.sample_count)):
            sample_cfg = common.compose("sample", [
                f"ckpt={ckpt}", f"num_samples={n}", f"batch_size={args.sample_batch}", f"device={device}",
                f"output_dir={scratch / 'sampling' / name}", "guidance=0",
                *(["sampler.steps=2"] if args.smoke else [])])  # fmt: skip
            drawn, wall = common.timed(lambda c=sample_cfg: sample(c), device)
            runs[name] = {"wall_s": wall, "draw_s": getattr(drawn, "seconds", None)}
        seconds = runs["timed"]["draw_s"] or runs["timed"]["wall_s"]
        return {"images": args.sample_count, "batch_size": args.sample_batch,
                "sampler": OmegaConf.to_container(sample_cfg.sampler), "precision": str(sample_cfg.precision),
                "channels_last": bool(sample_cfg.channels_last), "compile": bool(sample_cfg.compile),
                "images_per_s": args.sample_count / seconds, "images_per_s_wall": args.sample_count / runs["timed"][
                    "wall_s"], "s_per_50k": 50_000 * seconds / args.sample_count, "runs": runs}  # fmt: skip
    except Exception as error:
        return failed("sampling", error)


def show(report: dict[str, Any]) -> str:
    """The short table printed last: every row, the paired ratios, sampling, the profile, the goals."""
    rows = []
    for g in report["groups"]:
        for r in g["rows"]:
            ips = r.get("images_per_s") and {"median": r["images_per_s"], "min": r["images_per_s_min"],
                                             "max": r["images_per_s_max"]}  # fmt: skip
            rows.append([g["group"], r["row"], common.figure(ips, ".0f") if ips else r.get("skipped") or
                         r.get("error", "")[:100], r.get("ms_per_step"), r.get("peak_memory_mib"),
                         r.get("mfu") and f"{r['mfu']:.1%}", r.get("compile_s")])  # fmt: skip
        rows += [[g["group"], k, f"x{common.figure(v, '.3f')}", None, None, None, None] for k, v in g["ratios"].items()]
        if "top" in (p := g.get("profile") or {}):
            rows.append([g["group"], f"profile of {p['row']}", f"{p['kernels_run']} kernels, {p['kernel_launches']} "
                         f"launches, {p['graph_launches']} graph launches, GPU idle {p['gpu_idle_share']}; top: " +
                         ", ".join(f"{k['name'][:40]} {k['total_us']:.0f} us" for k in p["top"][:3]), None, None,
                         None, None])  # fmt: skip
    lines = [common.table(["group", "row", "images/s [min-max]", "ms/step", "peak MiB", "MFU", "compile s"], rows)]
    if "images_per_s" in (s := report.get("sampling") or {}):
        lines.append(f"sampling: {s['images']} images, batch {s['batch_size']}: {s['images_per_s']:.0f} images/s "
                     f"({s['s_per_50k']:.0f} s per 50k)")  # fmt: skip
    lines += ["skipped: " + "; ".join(report["skipped"])] if report["skipped"] else []
    met = {True: "met", False: "not met", None: "not measured"}
    for g in report["goals"].values():
        value = "None" if g["value"] is None else format(g["value"], ".3g")
        lines.append(f"goal: {g['goal']}: {value} (target {g['target']}): {met[g['met']]}")
    return "\n".join(lines)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """For the run: Lightning's per-fit banners, tips and notes off (warnings stay), and dynamo's recompile limit
    raised (the rows of every group share DiffusionModule._loss's code); both restored after."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    config = torch._dynamo.config
    limits = {k: getattr(config, k) for k in ("recompile_limit", "cache_size_limit") if hasattr(config, k)}
    saved = [logger.level for logger in loggers], limits
    with warnings.catch_warnings():
        for message in (".*smaller than the logging interval.*", ".*exists and is not empty.*"):
            warnings.filterwarnings("ignore", message=message)  # windows are short fits, into one folder per row
        try:
            for logger in loggers:
                logger.setLevel(logging.WARNING)
            for key in saved[1]:
                setattr(config, key, 64)
            yield
        finally:
            for logger, level in zip(loggers, saved[0], strict=True):
                logger.setLevel(level)
            for key, value in saved[1].items():
                setattr(config, key, value)


def measure(plan: list, parts: dict[str, float], run: common.Run, ctx: dict[str, Any]) -> dict[str, Any]:
    """The groups in order, sampling after --profile-group (or the last group), the goals; JSON after each part."""
    args, clock = ctx["args"], ctx["clock"]
    report: dict[str, Any] = {"plan": [f"{m}@{b}" for m, b, _ in plan], "estimate_s": parts, "groups": [],
                              "sampling": None, "skipped": ctx["skipped"], "errors": ctx["errors"], "parts_s": {},
                              "peak_bf16_flops": loops.peak_flops(ctx["device"], "bf16"),
                              "complete": False}  # fmt: skip
    after = args.profile_group if args.profile_group in report["plan"] else report["plan"][-1]
    for model, batch, rows in plan:
        began = clock.now()
        report["groups"].append(run_group(model, batch, rows, ctx))
        report["parts_s"][f"{model}@{batch}"] = clock.now() - began
        run.write(report, "gpu.json")
        if f"{model}@{batch}" == after:
            began = clock.now()
            report["sampling"] = sampling(ctx)
            report["parts_s"]["sampling"] = clock.now() - began
            clock.say(f"sampling: {report['sampling'].get('images_per_s', 0):.0f} images/s")
            run.write(report, "gpu.json")
    report["goals"], report["complete"] = goals(report), True
    report["parts_s"]["total"] = clock.now()
    run.write(report, "gpu.json")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("folder", help="where gpu.json and profile_trace.json.gz go (created)")
    add("--group", action="append", help="MODEL@BATCH=RUNNER:SETTING,... (repeat it); replaces PLAN")
    add("--window-s", type=float, default=0.5, help="seconds of timed steps per window (about)")
    add("--min-steps", type=int, default=10, help="timed steps per window, at least")
    add("--max-steps", type=int, default=50, help="timed steps per window, at most")
    add("--warmup", type=int, default=3, help="untimed steps before each window")
    add("--prepare-steps", type=int, default=5, help="steps of each row before its windows")
    add("--images", type=int, default=None, help="images in RAM (default: IMAGES, per preset)")
    add("--batch-scale", type=float, default=1.0, help="every batch size times this (--smoke: 1/64)")
    add("--compile-backend", default="inductor", help="torch.compile backend of the compiled rows")
    add("--profile-group", default="ddpm_cifar10@512", help="the group whose best ours row is profiled")
    add("--sample-count", type=int, default=10_000, help="images drawn by the sampling part")
    add("--sample-batch", type=int, default=1024, help="sample.py's batch_size in the sampling part")
    add("--deadline-s", type=float, default=440, help="start no part that would end after this")
    add("--estimate", action="store_true", help="print the plan and its estimated seconds; run nothing")
    common.add_arguments(parser, out=False)
    if (early := parser.parse_args(argv)).estimate:  # before common.start: no tree check, nothing measured
        return {"estimate": show_plan(early)[1]}
    run = common.start(__file__, parser, argv, smoke=SMOKE)
    args, device = run.args, run.device
    plan, parts = show_plan(args)
    folder = Path(args.folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    args.out = str(folder / "gpu.json")
    with quiet(), tempfile.TemporaryDirectory(prefix="gpu-bench-") as scratch:  # run folders, ema.pt, samples
        ctx = {"args": args, "device": device, "clock": Clock(args.deadline_s), "folder": folder,
               "scratch": Path(scratch), "skipped": [], "errors": []}  # fmt: skip
        report = measure(plan, parts, run, ctx)
    print(show(report))
    return report


if __name__ == "__main__":
    main()
