"""Sampling from a trained run: `sample(cfg)` is sample.py (run.py); run-time policy, what `auto` means on this
device and guidance checks naming config keys, is runtime.py."""

from ddpm.sampling.run import sample
from ddpm.sampling.runtime import resolve_device

__all__ = ["resolve_device", "sample"]
