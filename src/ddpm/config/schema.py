"""The schemas a run config is validated against, on pydantic: one per `_target_` and one per entry point.

- A node with `_target_` (every config group: model, diffusion, data, optim, trainer, each callback and
  logger, the sampler, ...): a schema made from the target's constructor signature (`target_schema`), one
  field per keyword argument, its type hint read through `types.lenient`. Keys that are not arguments are
  refused, except where the constructor takes `**kwargs`: its keys are free-form (e.g. logger.wandb, whose
  extra keys go to `wandb.init`).
- An entry point's own keys: the fields of ddpm.config.entries.TrainKeys (conf/train.yaml) and SampleKeys
  (conf/sample.yaml), the typed views the entry points read. Under `callbacks` and `logger` the names are free-form
  (each entry is a `_target_` node or null).

Nothing is skipped silently: a target that cannot be imported, a hint that does not resolve and a hint pydantic
cannot check are listed in `TargetSchema.unchecked`; the validator raises them in tests and warns about them
otherwise, for the keys a config actually sets (ddpm.config.validate).
"""

import inspect
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import typing_extensions
from pydantic import ConfigDict, TypeAdapter
from typing_extensions import TypedDict

from ddpm.config.entries import ENTRIES
from ddpm.config.types import lenient

HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})  # instantiate's own
STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)


@dataclass(frozen=True)
class TargetSchema:
    """What a `_target_` node may hold: `adapter` validates its keys; `fields` are the known ones."""

    adapter: TypeAdapter | None  # None when the target cannot be imported
    hints: dict[str, Any]  # argument -> its type hint as written (for messages)
    free_form: bool  # the constructor takes **kwargs: other keys are allowed
    unchecked: dict[str, str]  # argument (or "_target_") -> why its values cannot be checked


def _typed_dict(name: str, fields: dict[str, Any], *, extra: Literal["forbid", "allow"]) -> TypeAdapter:
    schema = TypedDict(name, fields, total=False)  # every key optional: some are passed in code (module.net)
    schema.__pydantic_config__ = ConfigDict(**STRICT, extra=extra)  # type: ignore[attr-defined]
    return TypeAdapter(schema)


@cache
def target_schema(target: str, nested: frozenset[str] = frozenset()) -> TargetSchema:
    """The schema of a `_target_` node; `nested` names the keys holding `_target_` nodes (validated on their own)."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception as error:
        return TargetSchema(None, {}, True, {"_target_": f"{target} cannot be imported ({str(error)[:200]})"})
    function = obj.__init__ if inspect.isclass(obj) else obj
    fields, written, unchecked, free_form = {}, {}, {}, False
    for name, parameter in inspect.signature(obj).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            free_form = True
        elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
            hint, problem = (Any, None) if name in nested else _hint(function, parameter)
            if problem is None and (problem := _unbuildable(hint)) is not None:
                hint = Any
            if problem is not None:
                unchecked[name] = f"{target}: argument {name}'s type {problem}"
            written[name], fields[name] = hint, lenient(hint)
    adapter = _typed_dict(target.rsplit(".", 1)[-1], fields, extra="allow" if free_form else "forbid")
    return TargetSchema(adapter, written, free_form, unchecked)


def _hint(function: Any, parameter: inspect.Parameter) -> tuple[Any, str | None]:
    """The parameter's type hint, evaluated on its own (one unresolvable hint leaves the others checked)."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return Any, None  # unannotated: any value is what the constructor accepts
    try:  # a string, or a hint holding ForwardRefs: resolved in the function's module
        holder = type("Holder", (), {"__annotations__": {"x": annotation}, "__module__": function.__module__})
        return typing.get_type_hints(holder, globalns=getattr(function, "__globals__", None))["x"], None
    except Exception as error:  # a forward reference that does not resolve (imported under TYPE_CHECKING)
        return Any, f"{annotation!r} does not resolve ({str(error)[:120]})"


def _unbuildable(hint: Any) -> str | None:
    """Why pydantic cannot validate `hint` (inside a strict schema, as the node's fields are), or None."""
    try:
        _typed_dict("Probe", {"value": lenient(hint)}, extra="forbid").validate_python({})  # builds it now
        return None
    except Exception as error:
        return f"{hint!r} cannot be checked ({str(error)[:120]})"


def entry_keys(entry: str) -> dict[str, Any]:
    """An entry point's own keys and their types: the fields of ddpm.config.entries.TrainKeys / SampleKeys."""
    return typing.get_type_hints(ENTRIES[entry], include_extras=True)


@cache
def entry_schema(entry: str) -> TypeAdapter:
    """The schema of an entry point's own keys (`train` or `sample`)."""
    return _typed_dict(f"{entry}_config", {k: lenient(v) for k, v in entry_keys(entry).items()}, extra="forbid")


def entry_fields(entry: str, path: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Known keys of an entry point's own section at `path` (e.g. ("paths",) -> ("output_dir",))."""
    hint: Any = entry_keys(entry)
    for key in path:
        hint = _mapping_fields(hint).get(key)
    return tuple(_mapping_fields(hint))


def _mapping_fields(hint: Any) -> dict[str, Any]:
    if isinstance(hint, dict):
        return hint
    for option in typing.get_args(hint) or (hint,):
        if typing_extensions.is_typeddict(option):  # typing.is_typeddict is False for typing_extensions.TypedDict
            return typing.get_type_hints(option)
    return {}
