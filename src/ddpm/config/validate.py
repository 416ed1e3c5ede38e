"""Validate a resolved run config before any work is done: types, unknown keys, whole numbers.

`validate_config(cfg, entry="train" | "sample")` checks every key against ddpm.config.schema and returns the
resolved config as plain data. It refuses, naming the key the user set (and never a downstream one):

- a value of the wrong type (`data.batch_size='64'`, `trainer.max_steps=1.5`): one TypeError listing all;
- a key that no part of the run reads (`+lr=3e-4`, `+optim.learning_rate=...`): one UnknownKeyError naming
  the closest known key (`+lr` -> `optim.lr`). A key counts as read when a schema declares it or another
  value refers to it (`${data.root}`). Free-form: the names under `callbacks` and `logger`, `hydra`, and the
  keys of a `_target_` whose constructor takes **kwargs (logger.wandb: passed on to wandb.init).

A whole number written as a float (`num_samples=2e1`, `20.0`, `1e3`) is accepted for an int key and written
back into `cfg` as an int, so every later reader sees 20; `20.5` is refused.
Where the check itself cannot run (a `_target_` that cannot be imported, a type hint pydantic cannot check),
it says so: an error when DDPM_STRICT_CONFIG=1 (the tests), otherwise a warning naming the key.
"""

import difflib
import os
import re
import typing
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue
from pydantic import ValidationError

from ddpm.config.entries import Node
from ddpm.config.schema import HYDRA_KEYS, entry_fields, entry_keys, entry_schema, target_schema
from ddpm.config.types import describe

Entry = Literal["train", "sample"]
STRICT_ENV = "DDPM_STRICT_CONFIG"  # "1": a check that cannot run is an error (tests), not a warning
REFERENCE = re.compile(r"\$\{(?!\w+:)([\w.]+)\}")  # ${data.root}; not resolvers like ${now:...}


class ConfigValueError(TypeError, ValueError):
    """A config value of the wrong type (`num_samples=abc`) or out of its range (`num_samples=0`)."""


class UnknownKeyError(ValueError):
    """Config keys that no part of the run reads (typos, keys added with `+` that nothing uses)."""


class ConfigCheckWarning(UserWarning):
    """Part of the config could not be checked (a target not importable, a type pydantic cannot describe)."""


def validate_config(
    cfg: DictConfig | Mapping[str, Any], *, entry: Entry, decided: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The resolved config as plain data, every key checked; whole-number floats become ints (also in `cfg`).

    `decided`: {dotted key: value} set in the result before the check, not in `cfg` (an `auto` decided for
    this device, e.g. {"trainer.precision": "bf16-mixed"})."""
    if isinstance(cfg, DictConfig):
        resolved = _resolved(cfg)
        references = set(_references(OmegaConf.to_container(cfg, resolve=False)))
    else:
        resolved, references = _copy(cfg), set()
    for key, value in (decided or {}).items():
        _set(resolved, key, value)
    report = _Report(references)
    report.check(resolved, entry)
    report.raise_errors()
    for key, value in report.ints.items():
        _set(resolved, key, value)
        if isinstance(cfg, DictConfig):
            OmegaConf.update(cfg, key, value, merge=False)
    return resolved  # type: ignore[return-value]


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """`cfg` resolved; a `???` left unset (data=image_folder's root) refused naming its key, not OmegaConf's trace."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except (MissingMandatoryValue, InterpolationToMissingValueError) as error:
        named = re.search(r"Missing mandatory value: ([\w.\[\]]+)", str(error))  # through an interpolation
        key = named[1] if isinstance(error, InterpolationToMissingValueError) and named else error.full_key
        raise ConfigValueError(f"{key} has no value (??? in its config file): set it, e.g. {key}=<...>; "
                               "docs/configuration.md says what it takes") from None  # fmt: skip


class _Report:
    """Walks a resolved config and collects wrong types, unknown keys, whole numbers and unchecked parts."""

    def __init__(self, references: set[str]) -> None:
        self.references = references
        self.types: list[str] = []
        self.unknown: list[str] = []
        self.known: set[str] = set()
        self.unlisted: set[str] = set()  # arguments of a node's _target_ that the config leaves out (`+key=` sets)
        self.problems: list[str] = []
        self.ints: dict[str, Any] = {}

    def check(self, config: dict[str, Any], entry: Entry) -> None:
        sections = self._entry_sections(entry)
        self.known |= {k for k in entry_fields(entry) if k not in sections and k not in _GROUPS}
        self.known |= {f"{section}.{k}" for section, keys in sections.items() for k in keys}
        own = {k: v for k, v in config.items() if not _is_target(v)}
        self._validate(entry_schema(entry), own, "", entry_keys(entry), section_keys=sections)
        for path, value in _bare_nodes(config, entry_keys(entry)):
            self.types.append(
                f"{path}={value} has no _target_: keys were set on a node that is null (an experiment's settings "
                f"under a group set to null, or to a config without it); drop them, or give {path} its config"
            )
        if entry == "train" and "ema" in config and config["ema"] is None:  # train() builds it; null crashed there
            self.types.append("ema=None: every run keeps an EMA (validation, grids and exports read its weights); "
                              "ema.decay=0 keeps the live weights")  # fmt: skip
        for path, node in _target_nodes(config):
            self._check_target(path, node)

    def _entry_sections(self, entry: Entry) -> dict[str, tuple[str, ...]]:
        return {k: entry_fields(entry, (k,)) for k in ("paths", "tune", "metrics") if k in entry_keys(entry)}

    def _check_target(self, path: str, node: dict[str, Any]) -> None:
        nested = frozenset(k for k, v in node.items() if _is_target(v) or _holds_targets(v))
        schema = target_schema(str(node["_target_"]), nested)
        self.problems += [f"{path}.{k}: {why}" for k, why in schema.unchecked.items() if k in node]
        self.known |= {f"{path}.{k}" for k in schema.hints if k not in nested}
        self.unlisted |= {f"{path}.{k}" for k in schema.hints if k not in nested and k not in node}
        if schema.adapter is None:
            return
        values = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
        self._validate(schema.adapter, values, f"{path}.", schema.hints)

    def _validate(self, adapter, values: dict, prefix: str, hints: dict, section_keys: dict | None = None) -> None:
        try:
            validated = adapter.validate_python(values)
        except ValidationError as error:
            self._record(error, values, prefix, hints, section_keys or {})
            return
        for key, value in values.items():
            if _has_whole_float(value) and not _a_fraction(value, hints.get(key)):
                converted = _ints_where(value, validated[key])
                if converted != value or _types(converted) != _types(value):
                    self.ints[f"{prefix}{key}"] = converted

    def _record(self, error: ValidationError, values: dict, prefix: str, hints: dict, sections: dict) -> None:
        seen: set[str] = set()
        for item in error.errors():
            loc = [str(part) for part in item["loc"]]
            if item["type"] == "extra_forbidden":
                key = f"{prefix}{'.'.join(loc)}"
                if key not in self.references and not any(r.startswith(f"{key}.") for r in self.references):
                    self.unknown.append(key)
                continue
            field = loc[0]
            if field in sections and loc[-1] in sections[field]:  # a key inside paths / tune / metrics
                key, text = f"{prefix}{field}.{loc[-1]}", f"{item.get('input')!r} is not valid ({item['msg']})"
            else:
                key, text = f"{prefix}{field}", f"{values.get(field)!r} is not {describe(hints.get(field, Any))}"
            if key not in seen:
                seen.add(key)
                self.types.append(f"{key}={text}")

    def raise_errors(self) -> None:
        if self.problems:
            text = "parts of the config cannot be checked:\n  " + "\n  ".join(self.problems)
            if os.environ.get(STRICT_ENV) == "1":
                raise TypeError(text)
            warnings.warn(text, ConfigCheckWarning, stacklevel=3)
        if self.unknown:
            lines = [f"{key}: {self._suggestion(key)}" for key in self.unknown]
            raise UnknownKeyError(
                "config keys that no part of the run reads (a typo, or a `+key=` that nothing uses):\n  "
                + "\n  ".join(lines)
                + "\nFree-form keys, allowed anywhere: the names under callbacks and logger, hydra.*, and the keys of "
                "a _target_ whose constructor takes **kwargs"
            )
        if self.types:
            raise ConfigValueError("config values of the wrong type or out of range:\n  " + "\n  ".join(self.types))

    def _suggestion(self, key: str) -> str:
        return suggest(key, self.known, self.unlisted)


def suggest(key: str, known: Iterable[str], unlisted: Iterable[str] = ()) -> str:
    """The known key closest to `key`: in its own section first (the same name or a similar one, by difflib),
    then anywhere (lr -> optim.lr); else the section's known keys. One of `unlisted` is set with `+`."""
    section, _, leaf = key.rpartition(".")
    own = sorted(k for k in known if k.rpartition(".")[0] == section)
    names = _closest(leaf, own) or _closest(leaf, sorted(known), cutoff=1.2)
    if names:
        return f"did you mean {names[0]}? (set it with {'+' * (names[0] in unlisted)}{names[0]}=...)"
    listed = ", ".join(k.rpartition(".")[2] for k in own[:20]) if section and own else ""
    return f"{section} has: {listed}" if listed else "no similar key exists"


def _closest(leaf: str, keys: list[str], cutoff: float = 0.8) -> list[str]:
    """Keys whose last part is `leaf` (fewest dots first), else the one whose last part is most similar, if its
    similarity reaches `cutoff` (0..2): difflib's ratio plus the share of `_`-separated words in common
    (every_n_steps -> every_n_train_steps)."""
    same = sorted((k for k in keys if k.rsplit(".", 1)[-1] == leaf), key=lambda k: k.count("."))
    if same:
        return same
    scored = [(similarity(leaf, k.rsplit(".", 1)[-1]), k) for k in keys]
    best = max(scored, default=(0.0, ""))
    return [best[1]] if best[0] >= cutoff else []


def similarity(a: str, b: str) -> float:
    a, b = a.lower(), b.lower()
    if len(a) == len(b) and sorted(a) == sorted(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 2:
        return 1.5  # two letters swapped (vea -> vae), which difflib's ratio scores low on a short key
    words_a, words_b = set(a.split("_")), set(b.split("_"))
    return difflib.SequenceMatcher(None, a, b).ratio() + len(words_a & words_b) / len(words_a | words_b)


_GROUPS = {"model", "diffusion", "data", "optim", "trainer", "module", "ema", "callbacks", "logger", "sampler", "hydra"}


def _is_target(value: Any) -> bool:
    return isinstance(value, dict) and "_target_" in value


def _holds_targets(value: Any) -> bool:
    return isinstance(value, list) and any(_is_target(v) for v in value)


def _bare_nodes(config: dict[str, Any], keys: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, value) of the dicts without `_target_` where a `_target_` node or null belongs (the entry's node keys
    and the entries of `callbacks` / `logger`): built, such a dict became a DictConfig handed to Lightning."""
    for name, hint in keys.items():
        value = config.get(name)
        if hint == Node and isinstance(value, dict) and not _is_target(value):
            yield name, value
        elif hint == dict[str, Node] | None and isinstance(value, dict):
            yield from ((f"{name}.{k}", v) for k, v in value.items() if isinstance(v, dict) and not _is_target(v))


def _target_nodes(config: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, node) of every `_target_` node, outermost first; the hydra node is Hydra's own."""
    if isinstance(config, dict):
        if _is_target(config):
            yield path, config
        for key, value in config.items():
            if not (path == "" and key == "hydra"):
                yield from _target_nodes(value, f"{path}.{key}" if path else str(key))
    elif isinstance(config, list):
        for i, value in enumerate(config):
            yield from _target_nodes(value, f"{path}.{i}")


def _references(config: Any) -> Iterator[str]:
    if isinstance(config, dict):
        for value in config.values():
            yield from _references(value)
    elif isinstance(config, list):
        for value in config:
            yield from _references(value)
    elif isinstance(config, str):
        yield from REFERENCE.findall(config)


def _has_whole_float(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, list | tuple) and any(_has_whole_float(v) for v in value)


def _a_fraction(value: Any, hint: Any) -> bool:
    """Whether a whole-number float means a fraction: the setting takes floats as well as ints and the value is in
    [-1, 1] (Lightning's limit_val_batches=1.0 is every batch, 1 a single one; 2.0 can only be the count 2)."""
    return isinstance(value, float) and abs(value) <= 1 and _takes_float(hint)


def _takes_float(hint: Any) -> bool:
    return hint is float or any(_takes_float(arg) for arg in typing.get_args(hint))


def _ints_where(original: Any, validated: Any) -> Any:
    """`original` with each whole-number float that validated to an int replaced by that int (lists and tuples
    element by element; no other conversion of the validator, such as list -> tuple, is kept)."""
    if isinstance(original, float) and isinstance(validated, int) and not isinstance(validated, bool):
        return validated
    if isinstance(original, list | tuple) and isinstance(validated, list | tuple) and len(original) == len(validated):
        return type(original)(_ints_where(o, v) for o, v in zip(original, validated, strict=True))
    return original


def _types(value: Any) -> Any:
    return [_types(v) for v in value] if isinstance(value, list | tuple) else type(value)


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    return [_copy(v) for v in value] if isinstance(value, list | tuple) else value


def _set(config: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        config = config[int(part)] if isinstance(config, list) else config[part]
    config[leaf] = value
