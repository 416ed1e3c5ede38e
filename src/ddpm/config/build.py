"""Building a config node: Hydra's `instantiate`, with a constructor's refusal named by the key the user sets.

Plain-torch classes check their own arguments and say `argument=value must be ...` in their own words (a UNet does
not know it is `model`). Which key set the argument is known where the node is built: `build` re-raises a
constructor's ValueError with each `argument=` of that constructor written as its full key, Hydra's full_key:
`callbacks.sample_grid.sampler.steps=0 must be >= 1`.
"""

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate

FAILED = re.compile(r"Error in call to target '([\w.]+)'.*full_key: ([\w.\[\]]+)", re.S)


def build(node: Any, /, **kwargs: Any) -> Any:
    """instantiate(node, **kwargs); a ValueError of a constructor comes back naming its keys (module docstring), an
    OSError as itself."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, OSError):  # a missing or unreadable file: its own message names the path
            raise error.__cause__ from None
        failed = FAILED.search(str(error))
        if not isinstance(error.__cause__, ValueError) or failed is None:
            raise
        raise ValueError(keyed(str(error.__cause__), failed[2], arguments(failed[1]))) from error.__cause__


def keyed(message: str, key: str, names: list[str]) -> str:
    """`message` with each `name=` of `names` written `key.name=` (the longest names first)."""
    for name in sorted(names, key=len, reverse=True):
        message = re.sub(rf"(?<![\w.]){re.escape(name)}=", f"{key}.{name}=", message)
    return message


def arguments(target: str) -> list[str]:
    """The keyword arguments of `target`'s constructor (empty if it cannot be imported)."""
    try:
        return list(inspect.signature(get_object(target)).parameters)
    except (ImportError, ValueError, TypeError):
        return []


@contextmanager
def keyed_errors(key: str, target: str) -> Iterator[None]:
    """A ValueError raised inside names `key`'s arguments as `build` does: for the checks a node's object makes
    when it is used, not built (a sampler's steps against the model's T)."""
    try:
        yield
    except ValueError as error:
        raise type(error)(keyed(str(error), key, arguments(target))) from error
