"""`sort`: a stable sort along one axis, carrying payloads along (XLA's variadic sort).

`sort(keys, *payloads) {axis}` orders each 1-D slice of `keys` along `axis` ascending, stable (equal
keys keep their order), nans last as numpy does (-0.0 and 0.0 compare equal); every payload, of the
keys' shape, is permuted the same way. One result per operand. `argsort` is the payload of an
`iota` along the axis; `take_along_axis`, `median` and `unique` build on it in the frontend.
"""

from __future__ import annotations

import numpy as np

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import MOVEMENT, defop
from flowjit.ir.ops.rules import check_axis, fmt_shape


def _sort_rule(types, attrs):
    if not types:
        raise ShapeError("needs at least one operand (the keys)")
    keys = types[0]
    if keys.rank == 0:
        raise ShapeError("needs operands of rank >= 1 (reshape a scalar to (1,) first)")
    check_axis(attrs["axis"], keys.rank)
    for i, t in enumerate(types[1:], 1):
        if t.shape != keys.shape:
            raise ShapeError(
                f"payload {i} must have the keys' shape {fmt_shape(keys.shape)}; found {fmt_shape(t.shape)}"
            )
    return list(types)


def _sort(*xs, axis):
    keys = xs[0]
    if keys.dtype in (dt.float16.np_dtype, dt.bfloat16.np_dtype):
        keys = keys.astype(np.float32)  # exact, and numpy's own ordering (nans last)
    order = np.argsort(keys, axis=axis, kind="stable")
    return tuple(np.take_along_axis(x, order, axis=axis) for x in xs)


defop(
    "sort",
    MOVEMENT,
    _sort_rule,
    _sort,
    None,
    attrs=("axis",),
    doc="stable ascending sort along `axis` by the first operand (nans last); the others are permuted alike",
)
