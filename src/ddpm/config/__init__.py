"""Run configs: validation against schemas made from the `_target_` signatures (validate.py, schema.py,
types.py) and docs/configuration.md generated from conf/ (doc.py: `python -m ddpm.config.doc`)."""

from ddpm.config.validate import UnknownKeyError, validate_config

__all__ = ["UnknownKeyError", "validate_config"]
