"""Reductions (sum, mean, var, argmax, cumsum, ...)."""

from __future__ import annotations

import builtins
import math

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.frontend.trace import bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.creation import iota
from flowjit.numpy.elementwise import (
    add,
    divide,
    equal,
    greater,
    isclose,
    isnan,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    minimum,
    multiply,
    not_equal,
    sqrt,
    subtract,
)
from flowjit.numpy.elementwise import where as _where
from flowjit.numpy.promotion import _dtype_of, _float_operand, asarray, astype, broadcast_to
from flowjit.numpy.shapes import _norm_axis, _slice_axis, concatenate, ndim, ravel, reshape, shape, size

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
    def fn(x, axis=None, keepdims=False, dtype=None, initial=None, where=None):
        x = asarray(x)
        if dtype is not None:
            x = astype(x, dtype)
        elif kind in ("sum", "prod") and _dtype_of(x).is_bool:
            x = astype(x, dt.int64)
        elif _dtype_of(x).is_bool:
            out = fn(astype(x, dt.int32), axis, keepdims, initial=initial, where=where)
            return astype(out, dt.bool_)
        axes = _reduce_axes(x, axis)
        if where is not None:
            x = _masked_operand(kind, x, where, initial)
        if kind in ("max", "min") and initial is None and builtins.any(shape(x)[a] == 0 for a in axes):
            raise op_error(
                FlowjitValueError,
                user_location(),
                f"reduce_{kind}",
                f"zero-size array to reduction operation {kind} which has no identity; pass initial=",
            )
        out = bind(f"reduce_{kind}", [x], {"axes": axes})
        if initial is not None:
            out = _COMBINE[kind](out, initial)
        return _keep(x, out, axes, keepdims)

    fn.__name__ = kind
    fn.__doc__ = (
        f"numpy.{kind}: reduce over `axis` (all axes when None); `initial` joins the reduction, "
        "`where` (a boolean mask broadcast to x) leaves elements out."
    )
    return fn


def _masked_operand(kind, x, mask, initial):
    """x with the elements outside `mask` replaced by the reduction's identity (or `initial`)."""
    if kind in ("max", "min") and initial is None:
        raise op_error(
            FlowjitValueError,
            user_location(),
            f"reduce_{kind}",
            f"{kind} with where= needs initial= (the value of an empty reduction), as numpy",
        )
    identity = {"sum": 0, "prod": 1}.get(kind, initial)
    return _where(mask, x, np.asarray(identity).astype(_dtype_of(x).np_dtype))


_COMBINE = {"sum": add, "prod": multiply, "max": maximum, "min": minimum}

sum = _reduction("sum")  # noqa: A001
prod = _reduction("prod")
max = _reduction("max")  # noqa: A001
min = _reduction("min")  # noqa: A001
amax, amin = max, min


def _half(x) -> bool:
    return _dtype_of(x) in (dt.float16, dt.bfloat16)


def _in_float32(statistic, x, *args, **kwargs):
    """`statistic` of a float16/bfloat16 `x` computed in float32 and rounded once, as numpy computes
    float16 means and variances: in float16 the element count alone is inf past 65504 (the mean of
    100,000 ones was nan) and a sum of ones stops growing at 2048."""
    return astype(statistic(astype(x, dt.float32), *args, **kwargs), _dtype_of(x))


def mean(x, axis=None, keepdims=False, dtype=None, where=None):
    """numpy.mean (ints and bools average in float32, float16/bfloat16 with float32 intermediates);
    `where` averages the masked elements only."""
    x = asarray(x)
    if dtype is None and _half(x):
        return _in_float32(mean, x, axis, keepdims, where=where)
    if dtype is not None or not _dtype_of(x).is_float:
        x = astype(x, dtype or dt.float32)
    axes = _reduce_axes(x, axis)
    if where is not None:
        count = sum(astype(broadcast_to(where, shape(x)), _dtype_of(x)), axis, keepdims)
        return divide(sum(x, axis, keepdims, where=where), count)
    count = math.prod(shape(x)[a] for a in axes)
    return divide(sum(x, axis, keepdims), builtins.max(count, 1) if count else float("nan"))


def var(x, axis=None, keepdims=False, ddof=0):
    x = _float_operand(x)
    if _half(x):
        return _in_float32(var, x, axis, keepdims, ddof)
    axes = _reduce_axes(x, axis)
    count = math.prod(shape(x)[a] for a in axes)
    centered = subtract(x, mean(x, axis, keepdims=True))
    return divide(sum(multiply(centered, centered), axis, keepdims), builtins.max(count - ddof, 0))


def std(x, axis=None, keepdims=False, ddof=0):
    x = _float_operand(x)
    if _half(x):
        return _in_float32(std, x, axis, keepdims, ddof)
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


def cumsum(x, axis=None, dtype=None):
    """Inclusive prefix sum, in `dtype` when given (numpy's; int32 stays int32 by default, see
    docs/design-notes.md): the `cumsum` op, which adds element by element in order as numpy does
    (an inf or nan changes the sums from its position on, never those before). Bools sum as int64
    (numpy's), half types in float32 with each running sum rounded once (as their reductions)."""
    x = _scan_input(x, dtype)
    if axis is None:
        x, axis = ravel(x), 0
    axis = _norm_axis(axis, ndim(x), "cumsum")
    if shape(x)[axis] == 0:
        return x
    half = _dtype_of(x) in (dt.float16, dt.bfloat16)
    summed = bind("cumsum", [astype(x, dt.float32) if half else x], {"axis": axis, "reverse": False})
    return astype(summed, _dtype_of(x)) if half else summed


def cumprod(x, axis=None, dtype=None):
    """Inclusive prefix product, in `dtype` when given: the `linear_recurrence` op with a = x and b =
    x at the axis's first position and -0.0 after it (h[i] = x[i] * h[i-1] + -0.0 is the product
    exactly, its sign kept), multiplying in numpy's order, so the result is numpy's bit for bit;
    its gradient is exact with zeros (no division). Half types multiply in float32, rounded once
    at the end; bools as int64 (numpy's)."""
    x = _scan_input(x, dtype)
    if axis is None:
        x, axis = ravel(x), 0
    axis = _norm_axis(axis, ndim(x), "cumprod")
    if shape(x)[axis] == 0:
        return x
    kind = _dtype_of(x)
    half = kind in (dt.float16, dt.bfloat16)
    a = astype(x, dt.float32) if half else x
    first = equal(iota(shape(a), axis, dt.int32), 0)
    b = _where(first, a, -0.0 if _dtype_of(a).is_float else 0)
    product = bind("linear_recurrence", [a, b], {"axis": axis, "reverse": False})
    return astype(product, kind) if half else product


def _scan_input(x, dtype):
    """A cumulative sum's or product's operand: in `dtype` when given, bools as int64 (numpy's)."""
    x = asarray(x) if dtype is None else astype(x, dtype)
    return astype(x, dt.int64) if _dtype_of(x).is_bool else x


def diff(x, n=1, axis=-1, prepend=None, append=None):
    """numpy.diff: the n-th discrete difference along `axis` (bools: not_equal, as numpy)."""
    x = asarray(x)
    axis = _norm_axis(axis, ndim(x), "diff")
    edges = []
    for extra in (prepend, append):
        if extra is None:
            edges.append([])
            continue
        extra = asarray(extra)
        edge_shape = shape(x)[:axis] + ((shape(extra)[axis] if ndim(extra) else 1),) + shape(x)[axis + 1 :]
        edges.append([broadcast_to(extra, edge_shape) if ndim(extra) == 0 else extra])
    if edges[0] or edges[1]:
        x = concatenate([*edges[0], x, *edges[1]], axis=axis)
    for _ in range(n):
        length = shape(x)[axis]
        later, earlier = (
            _slice_axis(x, axis, builtins.min(1, length), length),
            _slice_axis(x, axis, 0, builtins.max(length - 1, 0)),
        )
        x = not_equal(later, earlier) if _dtype_of(x).is_bool else subtract(later, earlier)
    return x


def trapezoid(y, x=None, dx=1.0, axis=-1):
    """numpy.trapezoid (numpy.trapz before numpy 2): the integral of `y` along `axis` by the
    trapezoidal rule, over sample points `x` (1-D along the axis, or y's shape) or a spacing `dx`."""
    y = _float_operand(y)
    axis = _norm_axis(axis, ndim(y), "trapezoid")
    n = shape(y)[axis]
    halves = multiply(add(_slice_axis(y, axis, 1, n), _slice_axis(y, axis, 0, builtins.max(n - 1, 0))), 0.5)
    if x is None:
        return multiply(sum(halves, axis), dx)
    x = _float_operand(x)
    widths = diff(x, axis=-1 if ndim(x) == 1 else axis)
    if ndim(x) == 1 and ndim(y) > 1:  # the sample points of the integrated axis
        widths = reshape(widths, tuple(-1 if d == axis else 1 for d in range(ndim(y))))
    return sum(multiply(halves, widths), axis)


trapz = trapezoid


def ptp(x, axis=None, keepdims=False):
    """numpy.ptp: max - min along `axis`."""
    return subtract(max(x, axis, keepdims), min(x, axis, keepdims))


def _nan_reduction(name, reduce, fill):
    def fn(x, axis=None, keepdims=False, **kwargs):
        x = asarray(x)
        if not _dtype_of(x).is_float:
            return reduce(x, axis, keepdims, **kwargs)
        return reduce(_where(isnan(x), np.asarray(fill, _dtype_of(x).np_dtype), x), axis, keepdims, **kwargs)

    fn.__name__ = name
    fn.__doc__ = f"numpy.{name}: {reduce.__name__} with nans treated as {fill}."
    return fn


nansum = _nan_reduction("nansum", sum, 0)
nanprod = _nan_reduction("nanprod", prod, 1)


def nancumsum(x, axis=None, dtype=None):
    """numpy.nancumsum: cumsum with nans counted as 0."""
    x = asarray(x)
    x = _where(isnan(x), np.zeros((), _dtype_of(x).np_dtype), x) if _dtype_of(x).is_float else x
    return cumsum(x, axis, dtype)


def nancumprod(x, axis=None, dtype=None):
    """numpy.nancumprod: cumprod with nans counted as 1."""
    x = asarray(x)
    x = _where(isnan(x), np.ones((), _dtype_of(x).np_dtype), x) if _dtype_of(x).is_float else x
    return cumprod(x, axis, dtype)


def _nan_extreme(name, reduce, fill):
    def fn(x, axis=None, keepdims=False):
        x = asarray(x)
        if not _dtype_of(x).is_float:
            return reduce(x, axis, keepdims)
        nan_ = isnan(x)
        out = reduce(_where(nan_, np.asarray(fill, _dtype_of(x).np_dtype), x), axis, keepdims)
        return _where(all(nan_, axis, keepdims), np.asarray(np.nan, _dtype_of(x).np_dtype), out)  # all-nan: nan

    fn.__name__ = name
    fn.__doc__ = f"numpy.{name}: {reduce.__name__} ignoring nans (nan where a slice is all nan)."
    return fn


nanmax = _nan_extreme("nanmax", max, -np.inf)
nanmin = _nan_extreme("nanmin", min, np.inf)


def nanmean(x, axis=None, keepdims=False):
    """numpy.nanmean: the mean of the non-nan elements (nan where there are none)."""
    x = _float_operand(x)
    if _half(x):
        return _in_float32(nanmean, x, axis, keepdims)
    valid = logical_not(isnan(x))
    return divide(nansum(x, axis, keepdims), sum(astype(valid, _dtype_of(x)), axis, keepdims))


def nanvar(x, axis=None, keepdims=False, ddof=0):
    """numpy.nanvar: the variance of the non-nan elements."""
    x = _float_operand(x)
    if _half(x):
        return _in_float32(nanvar, x, axis, keepdims, ddof)
    valid = logical_not(isnan(x))
    count = sum(astype(valid, _dtype_of(x)), axis, keepdims)
    centered = _where(valid, subtract(x, nanmean(x, axis, keepdims=True)), np.zeros((), _dtype_of(x).np_dtype))
    return divide(sum(multiply(centered, centered), axis, keepdims), maximum(subtract(count, ddof), 0))


def nanstd(x, axis=None, keepdims=False, ddof=0):
    """numpy.nanstd: the standard deviation of the non-nan elements."""
    x = _float_operand(x)
    if _half(x):
        return _in_float32(nanstd, x, axis, keepdims, ddof)
    return sqrt(nanvar(x, axis, keepdims, ddof))


def nanargmax(x, axis=None, keepdims=False):
    """numpy.nanargmax: argmax ignoring nans (an all-nan slice gives 0; numpy raises)."""
    x = asarray(x)
    if _dtype_of(x).is_float:
        x = _where(isnan(x), np.asarray(-np.inf, _dtype_of(x).np_dtype), x)
    return argmax(x, axis, keepdims)


def nanargmin(x, axis=None, keepdims=False):
    """numpy.nanargmin: argmin ignoring nans (an all-nan slice gives 0; numpy raises)."""
    x = asarray(x)
    if _dtype_of(x).is_float:
        x = _where(isnan(x), np.asarray(np.inf, _dtype_of(x).np_dtype), x)
    return argmin(x, axis, keepdims)


def average(x, axis=None, weights=None, returned=False, keepdims=False):
    """numpy.average: the (weighted) mean along `axis`; `returned` adds the sum of the weights."""
    x = _float_operand(x)
    if weights is None:
        out = mean(x, axis, keepdims)
        total = broadcast_to(np.asarray(size(x) // builtins.max(size(out), 1), _dtype_of(out).np_dtype), shape(out))
        return (out, total) if returned else out
    w = asarray(weights)
    if shape(w) != shape(x):
        if axis is None or ndim(w) != 1:
            raise op_error(
                FlowjitValueError,
                user_location(),
                "average",
                f"weights of shape {shape(w)} need axis= and must be 1-D or x's shape {shape(x)}",
            )
        axis_ = _norm_axis(axis, ndim(x), "average")
        w = reshape(w, [shape(w)[0] if i == axis_ else 1 for i in range(ndim(x))])
    w = broadcast_to(astype(w, _dtype_of(x)), shape(x))
    total = sum(w, axis, keepdims)
    out = divide(sum(multiply(x, w), axis, keepdims), total)
    return (out, total) if returned else out


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """numpy.allclose: all(isclose(...)); a Python bool on plain arrays, a traced bool under jit."""
    out = all(isclose(a, b, rtol, atol, equal_nan))
    return bool(out) if isinstance(out, np.ndarray) else out


def array_equal(a, b, equal_nan=False):
    """numpy.array_equal: same shape and elements (a shape mismatch is a static False)."""
    a, b = asarray(a), asarray(b)
    if shape(a) != shape(b):
        return False
    same = equal(a, b)
    if equal_nan:
        same = logical_or(same, logical_and(isnan(a), isnan(b)))
    out = all(same)
    return bool(out) if isinstance(out, np.ndarray) else out
