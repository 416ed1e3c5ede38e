"""Sampling from a trained run: `sample(cfg)` is sample.py (run.py); run-time policy, what `auto` means on this
device and guidance checks naming config keys, is runtime.py.

`sample` is imported on first use (PEP 562): run.py pulls in the metrics, config validation and Hydra's
instantiate, start-up the scripts that use only runtime.py (the benchmarks) need not pay."""

from typing import Any

from ddpm.sampling.runtime import resolve_device

__all__ = ["resolve_device", "sample"]


def __getattr__(name: str) -> Any:
    if name == "sample":
        from ddpm.sampling.run import sample

        return sample
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
