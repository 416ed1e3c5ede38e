"""Shared by the benchmark scripts: the machine a figure was measured on, and the JSON report beside the table."""

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from ddpm.precision import native_bf16

REPO = Path(__file__).resolve().parents[1]
CPU_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}  # what decides CPU bf16 and vector speed


def machine(device: torch.device) -> dict[str, Any]:
    """CPU model and vector flags, GPU name, torch version, threads and git commit of this measurement."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
               platform.processor())  # fmt: skip
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": sorted(flags & CPU_FLAGS), "native_bf16": native_bf16(device.type), "gpu": gpu,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "commit": commit,
            "device": str(device)}  # fmt: skip


def write_report(report: dict[str, Any], out: str | Path | None, default_name: str) -> Path:
    """Write `report` as JSON to `out`, or to benchmarks/results/<default_name>; print and return the path."""
    path = Path(out or REPO / "benchmarks" / "results" / default_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return path
