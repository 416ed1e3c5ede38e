"""How a YAML value, as Hydra hands it to a constructor, is checked against the constructor's type hint.

pydantic validates strictly ("64" is not an int, 1.5 is not an int, "yes" is not a bool), with three
readings of what YAML and the command line cannot spell, applied wherever the hint asks for them:

- a whole number written as a float (`2e1`, `20.0`, `1e3`: how users type sample counts) is that int;
- a YAML list stands for a tuple;
- a string stands for a path.

`lenient(hint)` rewrites a hint into one that accepts exactly these (nested in unions, optionals and
containers too); `describe(hint)` spells a hint for an error message.
"""

import os
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator


def _whole_number(value: Any) -> Any:
    """20.0 -> 20; any other value is left for the strict int check to accept or refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _as_path(value: Any) -> Any:
    return Path(value) if isinstance(value, str) else value


def _with(hint: Any, before: Callable[[Any], Any]) -> Any:
    return Annotated[hint, BeforeValidator(before)]


def lenient(hint: Any) -> Any:
    """`hint` with ints accepting whole floats, tuples accepting lists and paths accepting strings."""
    if hint is int:
        return _with(int, _whole_number)
    if hint in (Path, os.PathLike) or hint == os.PathLike[str]:
        return _with(Path, _as_path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:  # a constrained type (PositiveInt): its base read leniently, its constraints kept
        return Annotated[(lenient(args[0]), *hint.__metadata__)]
    if origin in (Union, types.UnionType):
        return Union[tuple(lenient(a) for a in args)]  # noqa: UP007 (built from a tuple of hints)
    if origin is tuple:
        variadic = len(args) == 2 and args[1] is Ellipsis
        inner = tuple[lenient(args[0]), ...] if variadic else tuple[tuple(map(lenient, args))]
        return _with(inner if args else tuple, _as_tuple)
    if origin in (list, Sequence) and args:
        return origin[lenient(args[0])]
    if origin is dict and args:
        return dict[lenient(args[0]), lenient(args[1])]
    return hint


def describe(hint: Any) -> str:
    """A readable form of a hint: `Literal['eps', 'v']`, `int | None`, `tuple[int, ...]`."""
    if hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " | ".join(describe(a) for a in args)
    if origin is Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is Annotated:  # a constrained type: its base and its bounds (PositiveInt: int > 0)
        ops = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
        bounds = [f"{op} {getattr(m, name)}" for m in hint.__metadata__ for name, op in ops if hasattr(m, name)]
        return " ".join([describe(args[0]), *bounds])
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else describe(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else getattr(origin, "__name__", "")
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")
