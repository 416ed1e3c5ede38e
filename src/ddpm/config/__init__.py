"""Run configs: validation against schemas made from the `_target_` signatures (validate.py, schema.py,
types.py), building nodes with refusals named by their keys (build.py) and docs/configuration.md generated from
conf/ (doc.py: `python -m ddpm.config.doc`)."""

from pathlib import Path

from ddpm.config.build import build
from ddpm.config.validate import UnknownKeyError, validate_config

CONF = Path(__file__).resolve().parents[3] / "conf"  # the repository's conf/, which train.py and sample.py compose

__all__ = ["CONF", "UnknownKeyError", "build", "validate_config"]
