"""Arguments of the `flowjit.nn` functions that take two orders: the public API's (DESIGN.md) or
flowjit's own, and PyTorch's (`conv2d(x, w, stride, padding)` or `conv2d(x, w, b, stride, ...)`;
`layer_norm(x, gamma, ...)` or `layer_norm(x, normalized_shape, weight, ...)`). The caller picks
the order from the first argument (`whole`, `ints`), then `bind` matches the rest to names the way
Python would, with errors that name the user's line and the argument."""

from __future__ import annotations

import numpy as np

from flowjit.errors import FlowjitTypeError
from flowjit.ir.location import user_location


def whole(v) -> bool:
    """An integer (a Python or numpy int, not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def ints(v, lengths=None) -> bool:
    """An int, or a tuple/list of ints (of one of `lengths` when given): a stride or a shape, where
    the other order has an array."""
    if whole(v):
        return True
    return (
        isinstance(v, (tuple, list))
        and len(v) > 0
        and (lengths is None or len(v) in lengths)
        and all(whole(e) for e in v)
    )


def bind(what: str, after: str, args: tuple, kwargs: dict, names: list[str], defaults: dict, aliases=None) -> dict:
    """`defaults` updated with `args` (those after the inputs named by `after`, for messages) matched
    to `names` in order and with `kwargs` (each keyword renamed by `aliases` first); too many
    arguments, an unknown keyword or a value given twice is a FlowjitTypeError."""
    aliases = aliases or {}
    if len(args) > len(names):
        shown = [next((a for a, n in aliases.items() if n == name), name) for name in names]
        raise FlowjitTypeError(
            f"{user_location()}: {what} takes at most {len(names)} arguments after {after} "
            f"({', '.join(shown)}); found {len(args)}"
        )
    values, given = dict(defaults), set()
    for name, value in [*zip(names, args), *kwargs.items()]:
        key = aliases.get(name, name)
        if key not in values:
            raise FlowjitTypeError(f"{user_location()}: {what} got an unexpected keyword argument {name!r}")
        if key in given:
            raise FlowjitTypeError(f"{user_location()}: {what} got multiple values for {name!r}")
        given.add(key)
        values[key] = value
    return values
