"""The prepared GPU command (issue 35): our Trainer against the bare loop and diffusers' UNet2DModel on every GPU
preset (loops.py's rows, group by group), sample.py's sampling rate (sampling.py), one profiled training step and
issue 35's goals, in under 8 minutes of a lent H100 or H200; OUT/gpu.json after every part (docs/benchmarks.md).

    make gpu-wheels               # here, once: the packages the GPU machine lacks, into .whl/
    bash benchmarks/gpu.sh OUT    # there (carry .whl): installs them, runs python benchmarks/gpu.py OUT --allow-dirty
"""

import argparse
import contextlib
import gc
import logging
import math
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import common
import loops
import sampling
import torch
from hydra.utils import instantiate
from loops import Row
from omegaconf import OmegaConf

from ddpm.precision import compile_mode

PLAN = {  # group (preset@batch) -> its rows (runner:setting), built in this order; groups most wanted first. One
    # compile mode fits: `default`, auto's choice on CUDA (a cold compile is 1-2 min; reduce-overhead: --group)
    "ddpm_cifar10@128": "ours:fp32 bare:fp32 ours:bf16 bare:bf16 diffusers:bf16",
    "ddpm_cifar10@512": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16 ours:bf16+default bare:bf16+default",
    "seed_mnist@64": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16",
    "unet64@64": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16",
    "seed_mnist@512": "ours:fp32 ours:bf16 bare:bf16 diffusers:bf16",
}
IMAGES = {"ddpm_cifar10": 50_000, "seed_mnist": 60_000, "unet64": 20_000}  # in RAM: CIFAR-10's, MNIST's, 245 MB
ESTIMATE = {"start": 30, "prepare": 5, "compile": 150, "compile_shared": 5, "fit": 1.5, "warmup": 0.3, "profile": 10,
            "sampling": 30}  # fmt: skip  # seconds on an H100: the plan and the deadline (docs/benchmarks.md)
PRESETS = {"ddpm_cifar10": ["experiment=cifar10"], "unet64": ["experiment=imagenet64"],
           "seed_mnist": ["model=seed_mnist", "data=mnist", "trainer=gpu"]}  # fmt: skip  # as a user trains each
TIMING = ["data.root=in-memory", "callbacks.checkpoint=null", "callbacks.sample_grid=null",
          "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=50"]  # fmt: skip  # what differs from train.py
SMALL = ["model.base_channels=8", "model.channel_mult=[1,2]", "model.num_res_blocks=1", "model.norm_groups=4",
         "model.image_size=8", "data.val_size=0.25", "data.num_workers=0"]  # fmt: skip
SMOKE_MODELS = {"ddpm_cifar10": ["model.attention_resolutions=[4]"],  # --smoke: each preset's kind of network at
                "unet64": ["model.attention_resolutions=[8,4]", "model.num_heads=2"],  # 8x8, a UNet2DModel twin
                "seed_mnist": ["model.downsample=[false]", "model.attention_resolutions=[8]", "model.num_heads=2",
                               "model.emb_dim=16"]}  # fmt: skip  # exactly where the preset has one
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
LAYOUTS = {"nchw": False, "nhwc": True}  # a setting's layout word -> module.channels_last
RUNNERS = {"ours": {"runner": "product"}, "bare": {"runner": "bare", "ema": True},
           "diffusers": {"runner": "bare", "ema": True, "net": "diffusers"}}  # fmt: skip


def parse_plan(groups: list[str] | None) -> list[tuple[str, int, dict[str, Row]]]:
    """PLAN, or --group "MODEL@BATCH=RUNNER:SETTING,..." options (SETTING: see `setting`):
    [(model, batch, {"runner:setting": loops.Row})], the rows with train.py's TF32."""
    plan = []
    for text in groups or [f"{g}={r.replace(' ', ',')}" for g, r in PLAN.items()]:
        name, _, rows = text.partition("=")
        model, _, batch = name.partition("@")
        pairs = [row.split(":") for row in rows.split(",") if row]
        if model not in IMAGES or not batch.isdigit() or any(len(p) != 2 for p in pairs) or not pairs:
            raise ValueError(f"--group {text!r}: MODEL@BATCH=RUNNER:SETTING,... with MODEL one of {list(IMAGES)}")
        if any(kind not in RUNNERS for kind, _ in pairs):
            raise ValueError(f"--group {text!r}: runners are ours, bare and diffusers")
        plan.append((model, int(batch), {f"{k}:{s}": Row(**RUNNERS[k], **setting(s), tf32=None) for k, s in pairs}))
    return plan


def setting(text: str) -> dict[str, Any]:
    """A row's SETTING, PRECISION[+COMPILE MODE][+nchw|+nhwc] (fp32, bf16, bf16+default, bf16+default+nhwc), as
    loops.Row's precision, compile and channels_last (without a layout: train.py's default, NCHW)."""
    precision, *rest = text.split("+")
    layout = [word for word in rest if word in LAYOUTS]
    modes = [word for word in rest if word not in LAYOUTS]
    if precision not in ("fp32", "bf16") or len(layout) > 1 or len(modes) > 1:
        raise ValueError(f"setting {text!r}: fp32 or bf16, then +<compile mode> and/or +nchw or +nhwc "
                         "(e.g. bf16+default+nchw)")  # fmt: skip
    return {"precision": precision, "compile": compile_mode(modes[0]) if modes else None,  # a typo refused here
            "channels_last": LAYOUTS[layout[0]] if layout else False}  # fmt: skip


def compose(model: str, batch: int, row: Row, args: argparse.Namespace, device: torch.device, folder: Path) -> Any:
    smoke = [*SMALL, *SMOKE_MODELS[model]] if args.smoke else []
    return loops.compose(row, batch, device, folder, [*PRESETS[model], *TIMING, *smoke], args.compile_backend)


def prepare_cost(row: Row, compiled: set[tuple[str, str]]) -> float:
    """ESTIMATE of building a row, `compiled` holding the (network, mode) pairs its group has compiled already."""
    return ESTIMATE["prepare" if row.compile is None else "compile_shared" if (row.net, row.compile) in compiled
                    else "compile"]  # fmt: skip


def show_plan(args: argparse.Namespace) -> tuple[list, dict[str, float]]:
    """The plan (--batch-scale applied to every group and to --profile-group) and its estimate per part, printed
    (a diffusers row of a preset without a UNet2DModel twin costs nothing)."""

    def scaled(batch: int | str) -> int:
        return max(1, round(int(batch) * args.batch_scale))

    plan = [(model, scaled(batch), rows) for model, batch, rows in parse_plan(args.group)]
    if len({(m, b) for m, b, _ in plan}) < len(plan):
        raise SystemExit(f"groups {[f'{m}@{b}' for m, b, _ in plan]}: each preset@batch once (merge their rows)")
    model, _, batch = args.profile_group.partition("@")
    args.profile_group = f"{model}@{scaled(batch)}" if batch.isdigit() else args.profile_group
    parts = {"start": ESTIMATE["start"]}
    for model, batch, rows in plan:
        twin = loops.twin_refusal(compose(model, batch, Row("bare"), args, torch.device("cpu"), Path("unused"))) is None
        kept, compiled, prepare = [r for r in rows.values() if r.net == "ours" or twin], set(), 0.0
        for row in kept:
            prepare += prepare_cost(row, compiled)
            compiled |= {(row.net, row.compile)} if row.compile else set()
        window = sum(args.window_s + ESTIMATE["warmup"] + ESTIMATE["fit"] * (r.runner == "product") for r in kept)
        parts[f"{model}@{batch}"] = prepare + args.repeats * window
    parts.update(profile=ESTIMATE["profile"], sampling=ESTIMATE["sampling"])
    parts["total"] = sum(parts.values())
    print("plan:", "; ".join(f"{m}@{b}: {' '.join(rows)}" for m, b, rows in plan))
    print("estimate (s):", ", ".join(f"{k} {v:.0f}" for k, v in parts.items()))
    return plan, parts


def run_group(model: str, batch: int, rows: dict[str, Row], ctx: dict[str, Any]) -> dict[str, Any]:
    """Build every row of the group (a row that fails or would end after the deadline is skipped, saying why), time
    them interleaved, summarise; the profile if this is --profile-group."""
    args, device, clock = ctx["args"], ctx["device"], ctx["clock"]
    group, runners, info, out, compiled, data, dynamo = f"{model}@{batch}", {}, {}, {}, set(), None, dynamo_counts()
    for name, row in rows.items():
        cfg = compose(model, batch, row, args, device, ctx["scratch"] / group / name.replace(":", "_"))
        cost = prepare_cost(row, compiled)
        if row.net == "diffusers" and (reason := loops.twin_refusal(cfg)):
            out[name] = {"row": name, "skipped": reason}
        elif not clock.fits(cost):
            left = clock.deadline - clock.now()
            out[name] = {"row": name, "skipped": f"deadline: {left:.0f} s left, needs ~{cost} s"}
        else:
            try:
                began = time.perf_counter()
                data = data or loops.load_images(instantiate(cfg.model), args.images or IMAGES[model])
                runners[name] = loops.Runner(row, cfg, data, device, Path(cfg.paths.output_dir))
                info[name] = {**runners[name].prepare(args.prepare_steps), "prepare_s": time.perf_counter() - began}
                compiled |= {(row.net, row.compile)} if row.compile else set()
                clock.say(f"{group} {name}: built, first step {info[name]['first_step_s']:.1f} s, "
                          f"{runners[name].step_estimate * 1e3:.1f} ms/step after")  # fmt: skip
            except Exception as error:  # a row that fails is recorded; the others go on
                out[name] = failed(name, error)
    runs = time_rows(runners, group, ctx)
    for name, r in runners.items():
        kind, setting = name.split(":")
        out[name] = {"row": name, "runner": kind, "setting": setting, "precision": r.precision,
                     "compile": r.row.compile, "batch_size": batch, "warmup": args.warmup, **info[name],
                     "steps": [x["steps"] for x in runs[name]], **(loops.figures(
                         r, runs[name], info[name], loops.step_flops(r.net, batch, device), "bf16") if runs[name] else
                         {"error": "no window was measured (see errors)"})}  # fmt: skip
    result = {"group": group, "model": model, "batch_size": batch, "images_in_ram": len(data.images) if data else 0,
              "parameters": {r: sum(p.numel() for p in x.net.parameters()) for r, x in runners.items()},
              "rows": [out[name] for name in rows if name in out], "ratios": ratios(out),
              "dynamo": {k: v - dynamo[k] for k, v in dynamo_counts().items()}}  # fmt: skip
    if group == args.profile_group:
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


def time_rows(runners: dict[str, loops.Runner], group: str, ctx: dict[str, Any]) -> dict[str, list[dict]]:
    """Each row's windows (about --window-s of steps each), interleaved over --repeats; a repeat that does not fit
    before the deadline is skipped, a row that fails leaves the later repeats."""
    args, clock, runs = ctx["args"], ctx["clock"], {row: [] for row in runners}
    steps = {row: max(args.min_steps, min(args.max_steps, math.ceil(args.window_s / max(r.step_estimate, 1e-9))))
             for row, r in runners.items()}  # fmt: skip
    last = sum(args.window_s + ESTIMATE["warmup"] + ESTIMATE["fit"] * (r.fit is not None) for r in runners.values())
    for repeat in range(args.repeats if runners else 0):
        if not clock.fits(last):
            ctx["skipped"].append(f"{group}: repeats {repeat + 1}-{args.repeats} (deadline; one took {last:.0f} s)")
            break
        began = time.perf_counter()
        for _, row in [pair for pair in common.interleaved(list(runners), args.repeats) if pair[0] == repeat]:
            try:
                if len(runs[row]) == repeat:
                    runs[row].append(runners[row].measure(args.warmup, steps[row]))
            except Exception as error:
                ctx["errors"].append(failed(f"{group} {row} (repeat {repeat + 1})", error))
        last = time.perf_counter() - began
        clock.say(f"{group} repeat {repeat + 1}/{args.repeats} in {last:.1f} s")
    return runs


def ratios(rows: dict[str, dict]) -> dict[str, dict]:
    """ours / bare and ours / diffusers at each setting, each compiled ours row / ours bf16 eager, and each ours row
    with a layout word / the same setting without it (bf16+nhwc / bf16), paired per repeat (side by side in each)."""
    found = {}
    for row, r in rows.items():
        kind, _, text = row.partition(":")
        plain = "+".join(word for word in text.split("+") if word not in LAYOUTS)
        for other in [f"bare:{text}", f"diffusers:{text}"] + (["ours:bf16"] if setting(text)["compile"] else []) + (
                [f"ours:{plain}"] if plain != text else []):  # fmt: skip
            if kind == "ours" and "images_per_s_runs" in r and "images_per_s_runs" in rows.get(other, {}):
                a, b = r["images_per_s_runs"], rows[other]["images_per_s_runs"]
                found[f"{row} / {other}"] = common.paired_ratios({"a": a[: len(b)], "b": b[: len(a)]}, "b")["a"]
    return found


def goals(report: dict[str, Any]) -> dict[str, dict]:
    """Issue 35's goals against the run's figures (None where the run has none)."""
    rows = [(g["group"], r) for g in report["groups"] for r in g["rows"] if r.get("images_per_s")]
    ratio_rows = [(v["median"], f"{g['group']} {k}", k.split(" / ")[1]) for g in report["groups"]
                  for k, v in g["ratios"].items()]  # fmt: skip

    def best(model: str, precision: str | None = None) -> tuple[float | None, str | None]:
        return max(((r["images_per_s"], f"{g} {r['row']}") for g, r in rows if g.startswith(model + "@")
                    and r["runner"] == "ours" and precision in (None, r["precision"])),
                   default=(None, None))  # fmt: skip

    def lowest(peer: str) -> tuple[float | None, str | None]:
        return min(((v, k) for v, k, other in ratio_rows if other.startswith(peer + ":")), default=(None, None))

    seed, rate = best("seed_mnist"), (report.get("sampling") or {}).get("images_per_s")
    found = {"cifar10_trainer_bf16_images_per_s": best("ddpm_cifar10", "bf16-mixed"),
             "trainer_vs_bare": lowest("bare"), "trainer_vs_diffusers": lowest("diffusers"),
             "seed_mnist_epoch_s": (seed[0] and 60_000 / seed[0], seed[1]),
             "sampling_50k_s": (rate and 50_000 / rate, rate and "sampling")}  # fmt: skip
    out = {}
    for key, (value, source) in found.items():
        what, target, better = GOALS[key]
        met = None if value is None else (value >= target if better == "higher" else value <= target)
        out[key] = {"goal": what, "target": target, "value": value, "met": met, "from": source}
    return out


def busy_seconds(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of (start_ns, end_ns) intervals."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        total += stop - start if end is None or start > end else max(0, stop - end)
        end = stop if end is None or stop > end else end
    return total / 1e9


def kernel_summary(events: list[Any], top: int = 15) -> dict[str, Any]:
    """Kineto events of one step -> the `top` GPU kernels by time, kernel launches, and the share of the step's span
    the GPU is idle (no kernel, copy or memset running: the union of their intervals; sync events are waits; a
    record_function range such as Optimizer.step's spans the whole step and is no kernel)."""
    cpu = torch.autograd.DeviceType.CPU
    device = [e for e in events if e.device_type() != cpu and "Sync" not in e.name() and not e.is_user_annotation()]
    by_name: dict[str, list[float]] = {}
    for e in device:
        if not e.name().startswith(("Memcpy", "Memset")):
            by_name.setdefault(e.name(), []).append((e.end_ns() - e.start_ns()) / 1e3)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    span = (max(e.end_ns() for e in events) - min(e.start_ns() for e in events)) / 1e9 if events else 0.0
    busy, host = busy_seconds([(e.start_ns(), e.end_ns()) for e in device]), [e.name() for e in events if
                                                                               e.device_type() == cpu]  # fmt: skip
    return {"kind": "cuda kernels", "kernels_run": sum(map(len, by_name.values())), "span_s": span, "gpu_busy_s": busy,
            "top": [{"name": n, "calls": len(t), "total_us": sum(t), "mean_us": sum(t) / len(t)} for n, t in ranked],
            "kernel_launches": sum(name in LAUNCHES for name in host),
            "graph_launches": sum(name in GRAPH_LAUNCHES for name in host),
            "gpu_idle_share": None if span <= 0 else max(0.0, 1 - busy / span)}  # fmt: skip


def profile_best(runners: dict[str, loops.Runner], out: dict[str, dict], ctx: dict[str, Any]) -> dict[str, Any]:
    """torch.profiler over one steady step of this group's fastest `ours` row, from the end of batch --warmup to the
    next's (without a GPU: the top operators by self CPU time; no kernels, launches or idle share); the chrome trace to
    OUT/profile_trace.json.gz."""
    measured = [r for r, x in out.items() if r.startswith("ours:") and x.get("images_per_s") and r in runners]
    if not measured or not ctx["clock"].fits(ESTIMATE["profile"]):
        return {"skipped": "deadline" if measured else "no ours row of this group was measured"}
    best = max(measured, key=lambda r: out[r]["images_per_s"])
    try:
        runner, trace = runners[best], ctx["folder"] / "profile_trace.json.gz"
        cuda, first = runner.device.type == "cuda", max(ctx["args"].warmup, 1)
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + ([
            torch.profiler.ProfilerActivity.CUDA] if cuda else []))  # fmt: skip
        toggle = {first: profiler.start, first + 1: profiler.stop}  # after batch first's hooks to batch first+1's
        timer = loops.Steps(runner.device, between=lambda: toggle.get(len(timer.resumed), lambda: None)())
        runner.fit.fit(first + 2, timer)  # Steps syncs at every batch's end
        profiler.export_chrome_trace(str(trace))
        events = list(profiler.profiler.kineto_results.events())
        ranked = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        summary = kernel_summary(events) if cuda else {
            "kind": "cpu operators (no GPU)", "kernels_run": 0, "kernel_launches": 0, "graph_launches": 0,
            "span_s": None, "gpu_busy_s": None, "gpu_idle_share": None,
            "top": [{"name": e.key, "calls": e.count, "total_us": e.self_cpu_time_total,
                     "mean_us": e.self_cpu_time_total / max(e.count, 1)} for e in ranked]}  # fmt: skip
        host = timer.spans(first - 1)[0][0]  # the profiled step's span
        return {"row": best, **summary, "events": len(events), "step_host_s": host, "trace": trace.name}
    except Exception as error:
        return failed(f"profile of {best}", error)


def failed(what: str, error: BaseException) -> dict[str, Any]:
    """The error of a part, printed with its traceback; the run goes on (an out-of-memory error's cache freed)."""
    traceback.print_exc()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"row": what, "error": f"{type(error).__name__}: {str(error)[:2000]}"}


def sample_rate(ctx: dict[str, Any]) -> dict[str, Any]:
    """sampling.py's `now` row (`python sample.py` with the count and batch only) on a freshly initialised
    ddpm_cifar10 written as ema.pt, unguided: random weights, so the speed is a real one and the images are not."""
    from ddpm.training import resolve_config
    from ddpm.weights.torch_file import export_ema

    args, device, scratch = ctx["args"], ctx["device"], ctx["scratch"] / "sampling"
    if not ctx["clock"].fits(ESTIMATE["sampling"]):
        return {"skipped": "deadline"}
    try:
        cfg = compose("ddpm_cifar10", args.sample_batch, Row("bare", "bf16"), args, device, scratch / "run")
        torch.manual_seed(0)
        ckpt = export_ema(scratch / "ema.pt", instantiate(cfg.model).state_dict(), resolve_config(cfg))
        overrides = {"ckpt": ckpt, "num_samples": args.sample_count, "batch_size": args.sample_batch, "guidance": 0,
                     "device": device, "output_dir": scratch / "out",
                     **({"sampler.steps": 2} if args.smoke else {})}  # fmt: skip
        drawn = sampling.sample_py({**overrides, "hydra.run.dir": scratch}, args.threads)
        sampler = common.compose("sample", [f"{k}={v}" for k, v in overrides.items()]).sampler
        return {**drawn, "images": args.sample_count, "sampler": OmegaConf.to_container(sampler),
                "s_per_50k": 50_000 / drawn["images_per_s"]}  # fmt: skip
    except (Exception, SystemExit) as error:
        return failed("sampling", error)


def show(report: dict[str, Any]) -> str:
    """The short table printed last: every row, the paired ratios, sampling, the profile, the goals."""
    rows = []
    for g in report["groups"]:
        rows += [[g["group"], r["row"], common.figure(r, ".0f", "images_per_s") if r.get("images_per_s") else
                  r.get("skipped") or r.get("error", "")[:100], r.get("ms_per_step"), r.get("peak_memory_mib"),
                  r.get("mfu") and f"{r['mfu']:.1%}", r.get("compile_s")] for r in g["rows"]]  # fmt: skip
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
    values = {k: "None" if g["value"] is None else format(g["value"], ".3g") for k, g in report["goals"].items()}
    return "\n".join(lines + [f"goal: {g['goal']}: {values[k]} (target {g['target']}): {met[g['met']]}"
                              for k, g in report["goals"].items()])  # fmt: skip


class Clock:
    """Seconds since the process started (/proc: the imports count), and whether a part of `seconds` ends in time."""

    def __init__(self, deadline_s: float) -> None:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        self.start = time.perf_counter() - float(Path("/proc/uptime").read_text().split()[0]) + ticks
        self.deadline = deadline_s

    def now(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, seconds: float) -> bool:
        return self.now() + seconds <= self.deadline

    def say(self, text: str) -> None:
        print(f"[{self.now():6.1f} s] {text}", flush=True)


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
            report["sampling"] = sample_rate(ctx)
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
    # Lightning's per-fit banners off (each window is a short fit, into one folder per row), dynamo's recompile limit
    # raised (every group's rows compile DiffusionModule._loss's code); both restored after
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="gpu-bench-") as scratch:
        stack.enter_context(mock.patch.object(torch._dynamo.config, "recompile_limit", 64))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", ".*(smaller than the logging interval|exists and is not empty).*")
        for logger in loggers:
            stack.callback(logger.setLevel, logger.level)
            logger.setLevel(logging.WARNING)
        ctx = {"args": args, "device": device, "clock": Clock(args.deadline_s), "folder": folder,
               "scratch": Path(scratch), "skipped": [], "errors": []}  # fmt: skip
        report = measure(plan, parts, run, ctx)
    print(show(report))
    return report


if __name__ == "__main__":
    main()
