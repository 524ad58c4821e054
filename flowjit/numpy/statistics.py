"""Order statistics and correlations: median, percentile, quantile (and their nan- forms), cov,
corrcoef. Order statistics sort along the reduced axes (the IR's `sort`, nans last) and pick with
`take_along_axis`, so they trace, differentiate and compile like any other function."""

from __future__ import annotations

import math

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.elementwise import (
    add,
    divide,
    floor,
    greater_equal,
    isnan,
    logical_not,
    maximum,
    minimum,
    multiply,
    sqrt,
    subtract,
    where,
)
from flowjit.numpy.indexing import diagonal, take_along_axis
from flowjit.numpy.linalg import matmul
from flowjit.numpy.promotion import _dtype_of, _float_operand, asarray, astype
from flowjit.numpy.reductions import _reduce_axes, any, mean, sum
from flowjit.numpy.shapes import concatenate, moveaxis, ndim, reshape, shape, transpose
from flowjit.numpy.sorting import sort


def _lerp(a, b, t):
    """a + (b - a) t, computed from the nearer end as numpy does (exact at t = 0 and t = 1)."""
    diff = subtract(b, a)
    return where(greater_equal(t, 0.5), subtract(b, multiply(diff, subtract(1, t))), add(a, multiply(diff, t)))


def _quantile(x, q, axis, keepdims, ignore_nan: bool, name: str, method: str):
    if method != "linear":
        raise FlowjitValueError(f"{user_location()}: {name} supports method='linear' only; found {method!r}")
    x = _float_operand(x)
    kind = _dtype_of(x)
    q = asarray(q) if isinstance(q, Tracer) else np.asarray(q, np.float64)
    if not isinstance(q, Tracer) and q.size and (q.min() < 0 or q.max() > 1):
        raise op_error(
            FlowjitValueError, user_location(), name, "quantiles must be in [0, 1] (percentiles in [0, 100])"
        )
    axes = _reduce_axes(x, axis)
    kept = [a for a in range(ndim(x)) if a not in axes]
    n = math.prod(shape(x)[a] for a in axes)
    lead = tuple(shape(x)[a] for a in kept)
    rows = sort(reshape(transpose(x, kept + list(axes)), lead + (n,)), axis=-1)  # nans last
    q_row = reshape(astype(q, kind), (1,) * len(lead) + (math.prod(shape(q)),))
    if ignore_nan:
        count = sum(astype(logical_not(isnan(rows)), kind), axis=-1, keepdims=True)
    else:
        count = np.asarray(n, kind.np_dtype)
    position = multiply(q_row, maximum(subtract(count, 1), 0))
    below = floor(position)
    low = astype(below, dt.int64)
    high = minimum(add(low, 1), max(n - 1, 0))
    if n == 0:
        value = multiply(position, np.nan)
    else:
        value = _lerp(take_along_axis(rows, low, -1), take_along_axis(rows, high, -1), subtract(position, below))
    if ignore_nan:
        value = where(greater_equal(count, 1), value, np.asarray(np.nan, kind.np_dtype))
    elif n:
        value = where(any(isnan(rows), axis=-1, keepdims=True), np.asarray(np.nan, kind.np_dtype), value)
    if keepdims:
        value = reshape(value, [1 if a in axes else d for a, d in enumerate(shape(x))] + [shape(value)[-1]])
    value = moveaxis(value, -1, 0) if ndim(value) > 1 else value
    return reshape(value, shape(value)[1:]) if ndim(q) == 0 else reshape(value, shape(q) + shape(value)[1:])


def quantile(x, q, axis=None, keepdims=False, method="linear"):
    """numpy.quantile (method='linear'): q in [0, 1], scalar or array (its dims come first); nan
    when a slice holds a nan."""
    return _quantile(x, q, axis, keepdims, False, "quantile", method)


def percentile(x, q, axis=None, keepdims=False, method="linear"):
    """numpy.percentile (method='linear'): q in [0, 100]."""
    return _quantile(x, _scaled(q), axis, keepdims, False, "percentile", method)


def median(x, axis=None, keepdims=False):
    """numpy.median: the middle value (the mean of the two middle ones for an even count)."""
    return _quantile(x, 0.5, axis, keepdims, False, "median", "linear")


def nanquantile(x, q, axis=None, keepdims=False, method="linear"):
    """numpy.nanquantile: `quantile` of the non-nan elements (nan where a slice has none)."""
    return _quantile(x, q, axis, keepdims, True, "nanquantile", method)


def nanpercentile(x, q, axis=None, keepdims=False, method="linear"):
    """numpy.nanpercentile: `percentile` of the non-nan elements."""
    return _quantile(x, _scaled(q), axis, keepdims, True, "nanpercentile", method)


def nanmedian(x, axis=None, keepdims=False):
    """numpy.nanmedian: `median` of the non-nan elements."""
    return _quantile(x, 0.5, axis, keepdims, True, "nanmedian", "linear")


def _scaled(q):
    return divide(q, 100.0) if isinstance(q, Tracer) else np.asarray(q, np.float64) / 100.0


def cov(m, y=None, rowvar=True, bias=False, ddof=None):
    """numpy.cov: the covariance matrix of the variables in the rows (columns if not `rowvar`)."""
    x = _float_operand(m)
    x = reshape(x, (1, -1)) if ndim(x) < 2 else x
    if not rowvar:
        x = transpose(x)
    if y is not None:
        other = _float_operand(y)
        other = reshape(other, (1, -1)) if ndim(other) < 2 else other
        x = concatenate([x, transpose(other) if not rowvar else other], axis=0)
    observations = shape(x)[1]
    ddof = (0 if bias else 1) if ddof is None else ddof
    centered = subtract(x, mean(x, axis=1, keepdims=True))
    out = divide(matmul(centered, transpose(centered)), max(observations - ddof, 0))
    return reshape(out, ()) if shape(out) == (1, 1) else out


def corrcoef(x, y=None, rowvar=True):
    """numpy.corrcoef: Pearson correlation coefficients, clipped to [-1, 1]."""
    c = cov(x, y, rowvar)
    if ndim(c) == 0:
        return divide(c, c)
    d = sqrt(diagonal(c))
    out = divide(divide(c, reshape(d, (-1, 1))), reshape(d, (1, -1)))
    return minimum(maximum(out, -1), 1)
