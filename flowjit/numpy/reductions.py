"""Reductions (sum, mean, var, argmax, cumsum, ...)."""

from __future__ import annotations

import builtins
import math

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.frontend.trace import bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.elementwise import divide, greater, multiply, sqrt, subtract
from flowjit.numpy.promotion import _dtype_of, _float_operand, asarray, astype
from flowjit.numpy.shapes import _norm_axis, moveaxis, ndim, ravel, reshape, shape

# --- reductions -------------------------------------------------------------------------------------


def _reduce_axes(x, axis):
    rank = ndim(x)
    if axis is None:
        return tuple(range(rank))
    axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    return tuple(sorted(_norm_axis(a, rank, "reduce") for a in axes))


def _keep(x, out, axes, keepdims):
    if not keepdims:
        return out
    return reshape(out, [1 if i in axes else d for i, d in enumerate(shape(x))])


def _reduction(kind):
    def fn(x, axis=None, keepdims=False, dtype=None):
        x = asarray(x)
        if dtype is not None:
            x = astype(x, dtype)
        elif kind in ("sum", "prod") and _dtype_of(x).is_bool:
            x = astype(x, dt.int64)
        elif _dtype_of(x).is_bool:
            return astype(fn(astype(x, dt.int32), axis, keepdims), dt.bool_)
        axes = _reduce_axes(x, axis)
        if kind in ("max", "min") and builtins.any(shape(x)[a] == 0 for a in axes):
            raise op_error(
                FlowjitValueError,
                user_location(),
                f"reduce_{kind}",
                f"zero-size array to reduction operation {kind} which has no identity",
            )
        out = bind(f"reduce_{kind}", [x], {"axes": axes})
        return _keep(x, out, axes, keepdims)

    fn.__name__ = kind
    fn.__doc__ = f"numpy.{kind}: reduce over `axis` (all axes when None)."
    return fn


sum = _reduction("sum")  # noqa: A001
prod = _reduction("prod")
max = _reduction("max")  # noqa: A001
min = _reduction("min")  # noqa: A001
amax, amin = max, min


def mean(x, axis=None, keepdims=False, dtype=None):
    x = asarray(x)
    if dtype is not None or not _dtype_of(x).is_float:
        x = astype(x, dtype or dt.float32)
    axes = _reduce_axes(x, axis)
    count = math.prod(shape(x)[a] for a in axes)
    return divide(sum(x, axis, keepdims), builtins.max(count, 1) if count else float("nan"))


def var(x, axis=None, keepdims=False, ddof=0):
    x = _float_operand(x)
    axes = _reduce_axes(x, axis)
    count = math.prod(shape(x)[a] for a in axes)
    centered = subtract(x, mean(x, axis, keepdims=True))
    return divide(sum(multiply(centered, centered), axis, keepdims), builtins.max(count - ddof, 0))


def std(x, axis=None, keepdims=False, ddof=0):
    return sqrt(var(x, axis, keepdims, ddof))


def _arg_reduction(name):
    def fn(x, axis=None, keepdims=False):
        x = asarray(x)
        if _dtype_of(x).is_bool:
            x = astype(x, dt.int32)
        if axis is None:
            out = bind(name, [ravel(x)], {"axis": 0, "index_dtype": dt.int64})
            return reshape(out, [1] * ndim(x)) if keepdims else out
        axis = _norm_axis(axis, ndim(x), name)
        out = bind(name, [x], {"axis": axis, "index_dtype": dt.int64})
        return reshape(out, [1 if i == axis else d for i, d in enumerate(shape(x))]) if keepdims else out

    fn.__name__ = name
    fn.__doc__ = f"numpy.{name}: the first index of the extreme along `axis` (of the flattened array when None)."
    return fn


argmax = _arg_reduction("argmax")
argmin = _arg_reduction("argmin")


def any(x, axis=None, keepdims=False):  # noqa: A001
    """numpy.any: whether some element is nonzero (nan counts as nonzero); False when empty."""
    return _logical_reduction("reduce_max", x, axis, keepdims)


def all(x, axis=None, keepdims=False):  # noqa: A001
    """numpy.all: whether every element is nonzero (nan counts as nonzero); True when empty."""
    return _logical_reduction("reduce_min", x, axis, keepdims)


def _logical_reduction(op, x, axis, keepdims):
    # Over 0/1 int32 values; an empty reduction gives INT_MIN (any: False) or INT_MAX (all: True).
    x = astype(astype(x, dt.bool_), dt.int32)
    axes = _reduce_axes(x, axis)
    return _keep(x, greater(bind(op, [x], {"axes": axes}), 0), axes, keepdims)


def cumsum(x, axis=None):
    """Inclusive prefix sum, computed as a matmul with a triangular constant (O(n^2) per axis)."""
    x = asarray(x)
    if _dtype_of(x).is_bool:
        x = astype(x, dt.int64)  # as numpy's sum of bools
    if axis is None:
        x, axis = ravel(x), 0
    axis = _norm_axis(axis, ndim(x), "cumsum")
    n = shape(x)[axis]
    tri = np.triu(np.ones((n, n), _dtype_of(x).np_dtype))
    moved = moveaxis(x, axis, -1)
    from flowjit.numpy.linalg import matmul  # linalg builds on this module

    return moveaxis(matmul(moved, tri), -1, axis)
