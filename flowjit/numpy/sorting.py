"""Sorting, searching and counting: sort, argsort, searchsorted, nonzero, unique, count_nonzero.

`sort` and `argsort` are the IR's `sort` op (stable, nans last, as numpy's `kind="stable"`).
Functions whose result shape depends on the data (`nonzero`, `argwhere`, `flatnonzero`,
`unique`) run with numpy on plain arrays; on traced values they need `size=` (as in JAX): the
result has exactly `size` entries, cut or padded with `fill_value`.
"""

from __future__ import annotations

import builtins
import math

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer, bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.creation import full, iota
from flowjit.numpy.elementwise import (
    add,
    divide,
    equal,
    greater,
    greater_equal,
    isnan,
    less,
    less_equal,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    minimum,
    multiply,
    not_equal,
    subtract,
    where,
)
from flowjit.numpy.indexing import scatter_add, take, take_along_axis
from flowjit.numpy.promotion import _cast_all, _dtype_of, _float_operand, asarray, astype, broadcast_to, result_type
from flowjit.numpy.reductions import any as _any
from flowjit.numpy.reductions import cumsum, sum
from flowjit.numpy.shapes import _norm_axis, _slice_axis, concatenate, ndim, ravel, reshape, shape, size


def _sort_operands(x, axis):
    x = asarray(x)
    if axis is None:
        return ravel(x), 0
    if ndim(x) == 0:
        raise op_error(
            FlowjitValueError, user_location(), "sort", "cannot sort a 0-d array along an axis; use axis=None"
        )
    return x, _norm_axis(axis, ndim(x), "sort")


def _check_kind(kind, order):
    if order is not None:
        raise FlowjitValueError(f"{user_location()}: sort's `order` (structured arrays) is not supported")
    if kind not in (None, "stable", "mergesort", "quicksort", "heapsort"):
        raise FlowjitValueError(f"{user_location()}: unknown sort kind {kind!r}")


def sort(x, axis=-1, kind=None, order=None, stable=None):
    """numpy.sort: ascending along `axis` (the flattened array when None), nans last. Always
    stable, whatever `kind` says (as JAX)."""
    _check_kind(kind, order)
    x, axis = _sort_operands(x, axis)
    if size(x) == 0:
        return x
    if isinstance(x, Tracer) and _under_differentiation():
        # Carry the positions along: the gradient needs the permutation, and finds it here.
        return bind("sort", [x, iota(shape(x), axis)], {"axis": axis})[0]
    return bind("sort", [x], {"axis": axis})


def _under_differentiation() -> bool:
    from flowjit.frontend.autodiff import under_differentiation

    return under_differentiation()


def argsort(x, axis=-1, kind=None, order=None, stable=None):
    """numpy.argsort: the int64 indices that sort `x` along `axis` (stable: ties keep their order,
    which numpy's default quicksort does not promise)."""
    _check_kind(kind, order)
    x, axis = _sort_operands(x, axis)
    positions = iota(shape(x), axis)
    if size(x) == 0:
        return positions
    return bind("sort", [x, positions], {"axis": axis})[1]


def partition(x, kth, axis=-1):
    """numpy.partition: element `kth` in its sorted place, smaller ones before, larger after. The
    result is the full sort along `axis`, which is one valid partition (numpy leaves the order
    inside each side unspecified)."""
    return sort(x, axis)


def argpartition(x, kth, axis=-1):
    """numpy.argpartition: the indices of `partition` (the stable argsort, one valid answer)."""
    return argsort(x, axis)


def lexsort(keys, axis=-1):
    """numpy.lexsort: indices sorting by the last key, ties broken by the one before, and so on
    (one stable argsort per key, least significant first)."""
    keys = [asarray(k) for k in keys]
    if not keys:
        raise op_error(FlowjitValueError, user_location(), "lexsort", "needs at least one key")
    order = argsort(keys[0], axis)
    for key in keys[1:]:
        order = take_along_axis(order, argsort(take_along_axis(key, order, axis), axis), axis)
    return order


def digitize(x, bins, right=False):
    """numpy.digitize for increasing `bins`: the index of the bin each x falls in (0 below the
    first edge, len(bins) above the last)."""
    return searchsorted(bins, x, side="left" if right else "right")


def bincount(x, weights=None, minlength=0, length=None):
    """numpy.bincount of non-negative ints: how often each value occurs (or the sum of its
    weights). The result's length is max(x) + 1 (at least `minlength`); under jit pass `length`
    (as JAX), and values at or past it are dropped."""
    x = asarray(x)
    if not _dtype_of(x).is_int and not _dtype_of(x).is_bool:
        raise op_error(FlowjitValueError, user_location(), "bincount", f"needs integers; found {_dtype_of(x)}")
    if length is None:
        if isinstance(x, Tracer) or isinstance(weights, Tracer):
            raise op_error(
                FlowjitValueError,
                user_location(),
                "bincount",
                "the result's length depends on the values, which are not known while tracing; pass "
                "length=N (fnp.bincount(x, length=N)), or call it outside jit",
            )
        length = builtins.max(int(np.max(x)) + 1 if np.size(x) else 0, minlength)
    x = ravel(x)
    slot = where(logical_and(greater_equal(x, 0), less(x, length)), x, length)
    w = broadcast_to(np.ones((), np.int64), shape(x)) if weights is None else ravel(_float_operand(weights))
    totals = scatter_add(broadcast_to(np.zeros((), _dtype_of(w).np_dtype), (length + 1,)), slot, w)
    return _slice_axis(totals, 0, 0, length)


def isin(element, test_elements, invert=False):
    """numpy.isin: whether each element occurs in `test_elements` (compared against all of them)."""
    element = asarray(element)
    tests = ravel(asarray(test_elements))
    found = _any(equal(reshape(element, (*shape(element), 1)), tests), axis=-1)
    return logical_not(found) if invert else found


def searchsorted(a, v, side="left", sorter=None):
    """numpy.searchsorted on a sorted 1-D `a` (nans last): for each v, the index where inserting it
    keeps `a` sorted (before equal elements for side='left', after them for 'right'). A binary
    search of ceil(log2(len(a) + 1)) steps, each a gather and a compare."""
    if side not in ("left", "right"):
        raise FlowjitValueError(f"{user_location()}: searchsorted side must be 'left' or 'right'; found {side!r}")
    a = asarray(a)
    if sorter is not None:
        a = take(a, sorter)
    if ndim(a) != 1:
        raise op_error(FlowjitValueError, user_location(), "searchsorted", f"needs a 1-D array; found shape {shape(a)}")
    target = result_type(a, v)
    a, v = _cast_all([a, v], target)
    n = size(a)
    lo = broadcast_to(np.zeros((), np.int64), shape(v))
    hi = broadcast_to(np.asarray(n, np.int64), shape(v))
    for _ in range(math.ceil(math.log2(n + 1))):
        mid = (lo + hi) // 2
        pivot = take(a, minimum(mid, builtins.max(n - 1, 0)))
        # go right while pivot < v ('left') or pivot <= v ('right'), in the nans-last order
        right = _before(pivot, v, strict=side == "left")
        active = less(lo, hi)
        lo = where(logical_and(active, right), add(mid, 1), lo)
        hi = where(logical_and(active, logical_not(right)), mid, hi)
    return lo


def _before(a, b, strict: bool):
    """a < b (strict) or a <= b in the total order that puts nans last."""
    if not _dtype_of(a).is_float:
        return less(a, b) if strict else less_equal(a, b)
    if strict:
        return logical_or(less(a, b), logical_and(isnan(b), logical_not(isnan(a))))
    return logical_or(less_equal(a, b), isnan(b))


def count_nonzero(x, axis=None, keepdims=False):
    """numpy.count_nonzero: the number of nonzero (True, nan) elements, as int64."""
    x = asarray(x)
    return sum(astype(not_equal(x, np.zeros((), _dtype_of(x).np_dtype)), dt.int64), axis, keepdims)


def _data_dependent(name: str, x, size_):
    if isinstance(x, Tracer) and size_ is None:
        raise op_error(
            FlowjitValueError,
            user_location(),
            name,
            "the result's shape depends on the values, which are not known while tracing; pass "
            f"size=N (fnp.{name}(x, size=N, fill_value=...)) for a fixed-size result, or call it outside jit",
        )
    return isinstance(x, Tracer) or size_ is not None


def flatnonzero(x, size=None, fill_value=None):  # noqa: A002 (numpy's and JAX's name)
    """numpy.flatnonzero: int64 indices of the nonzero elements of the flattened array. With
    `size`, exactly `size` indices: the first ones, then `fill_value` (default 0)."""
    x = asarray(x)
    if not _data_dependent("flatnonzero", x, size):
        return np.flatnonzero(x).astype(np.int64)
    flat = not_equal(ravel(x), np.zeros((), _dtype_of(x).np_dtype))
    n = math.prod(shape(x))
    fill = 0 if fill_value is None else fill_value
    if n == 0:
        return full((size,), fill, dt.int64)
    # The k-th nonzero goes to slot k (slot `size` is a spill slot for the rest), then unused slots fill.
    slot = subtract(cumsum(astype(flat, dt.int64)), 1)
    slot = where(logical_and(flat, less(slot, size)), slot, size)
    positions = iota((n,), 0)
    out = scatter_add(broadcast_to(np.zeros((), np.int64), (size + 1,)), slot, positions)
    found = sum(astype(flat, dt.int64))
    return where(less(iota((size,), 0), found), _slice_axis(out, 0, 0, size), astype(asarray(fill), dt.int64))


def nonzero(x, size=None, fill_value=None):  # noqa: A002
    """numpy.nonzero: a tuple of int64 index arrays, one per axis. With `size` (required under
    jit), each has exactly `size` entries, padded with `fill_value` (default 0; a tuple gives one
    per axis)."""
    x = asarray(x)
    if ndim(x) == 0:
        raise op_error(FlowjitValueError, user_location(), "nonzero", "needs an array of rank >= 1 (use atleast_1d)")
    if not _data_dependent("nonzero", x, size):
        return tuple(i.astype(np.int64) for i in np.nonzero(x))
    fills = fill_value if isinstance(fill_value, tuple | list) else (fill_value,) * ndim(x)
    found = sum(astype(not_equal(x, np.zeros((), _dtype_of(x).np_dtype)), dt.int64))
    flat = flatnonzero(x, size=size, fill_value=0)
    out, stride = [], math.prod(shape(x))
    valid = less(iota((size,), 0), found)
    for d, fill in zip(shape(x), fills):
        stride //= builtins.max(d, 1)
        index = (flat // builtins.max(stride, 1)) % builtins.max(d, 1)
        out.append(where(valid, index, np.asarray(0 if fill is None else fill, np.int64)))
    return tuple(out)


def argwhere(x, size=None, fill_value=None):  # noqa: A002
    """numpy.argwhere: the (count, ndim) int64 indices of the nonzero elements (`size` as `nonzero`)."""
    from flowjit.numpy.shapes import stack  # one axis per column

    x = asarray(x)
    if not _data_dependent("argwhere", x, size):
        return np.argwhere(x).astype(np.int64)
    if ndim(x) == 0:
        raise op_error(FlowjitValueError, user_location(), "argwhere", "needs an array of rank >= 1")
    return stack(nonzero(x, size=size, fill_value=fill_value), axis=1)


def unique(x, return_counts=False, size=None, fill_value=None, equal_nan=True):  # noqa: A002
    """numpy.unique of the flattened array: sorted distinct values (nans counted once with
    `equal_nan`). With `size` (required under jit), exactly `size` values, padded with
    `fill_value` (default: the smallest value, as JAX). `return_counts` adds the counts (int64)."""
    x = asarray(x)
    if not _data_dependent("unique", x, size):
        values, counts = np.unique(x, return_counts=True, equal_nan=equal_nan)
        return (values, counts.astype(np.int64)) if return_counts else values
    if _dtype_of(x).is_bool:  # scatter_add does not take bools
        out = unique(astype(x, dt.int32), return_counts, size, fill_value, equal_nan)
        return (astype(out[0], dt.bool_), out[1]) if return_counts else astype(out, dt.bool_)
    values = sort(ravel(x))
    n = math.prod(shape(x))
    if n == 0:
        out = full((size,), 0 if fill_value is None else fill_value, _dtype_of(x))
        return (out, full((size,), 0, dt.int64)) if return_counts else out
    later, earlier = _slice_axis(values, 0, 1, n), _slice_axis(values, 0, 0, n - 1)
    differs = not_equal(later, earlier)
    if equal_nan and _dtype_of(x).is_float:
        differs = logical_and(differs, logical_not(logical_and(isnan(later), isnan(earlier))))
    first = concatenate([np.ones((1,), np.bool_), differs])  # where a new value starts
    group = subtract(cumsum(astype(first, dt.int64)), 1)  # its group number
    # The first element of group g lands in slot g; the others, and groups past `size`, spill into
    # slot `size`. Each kept slot gets one addition to -0.0, which leaves any value (-0.0 too) as it is.
    slot = where(logical_and(first, less(group, size)), group, size)
    zero = np.asarray(-0.0 if _dtype_of(x).is_float else 0, _dtype_of(x).np_dtype)
    out = scatter_add(broadcast_to(zero, (size + 1,)), slot, values)
    groups = add(_slice_axis(group, 0, n - 1, n), 1)
    valid = less(iota((size,), 0), reshape(groups, ()))
    fill = _slice_axis(values, 0, 0, 1) if fill_value is None else asarray(fill_value, _dtype_of(x))
    result = where(valid, _slice_axis(out, 0, 0, size), reshape(fill, ()))
    if not return_counts:
        return result
    ones = broadcast_to(np.ones((), np.int64), (n,))
    counts = scatter_add(broadcast_to(np.zeros((), np.int64), (size + 1,)), where(less(group, size), group, size), ones)
    return result, where(valid, _slice_axis(counts, 0, 0, size), np.zeros((), np.int64))


def interp(x, xp, fp, left=None, right=None):
    """numpy.interp: piecewise-linear interpolation of the points (xp, fp), xp increasing; `left`
    and `right` (default fp[0], fp[-1]) outside [xp[0], xp[-1]]."""
    xp, fp = _float_operand(xp), _float_operand(fp)
    x = astype(asarray(x), result_type(xp, fp, 0.0))
    xp, fp = astype(xp, _dtype_of(x)), astype(fp, _dtype_of(x))
    n = size(xp)
    if ndim(xp) != 1 or shape(fp) != shape(xp) or n == 0:
        raise op_error(
            FlowjitValueError,
            user_location(),
            "interp",
            f"xp and fp must be 1-D of one non-zero length; found {shape(xp)}, {shape(fp)}",
        )
    first, last = take(fp, 0), take(fp, n - 1)
    if n == 1:
        inside = broadcast_to(first, shape(x))
    else:
        j = minimum(maximum(subtract(searchsorted(xp, x, side="right"), 1), 0), n - 2)
        x0, x1, y0, y1 = take(xp, j), take(xp, add(j, 1)), take(fp, j), take(fp, add(j, 1))
        slope = divide(subtract(y1, y0), subtract(x1, x0))
        inside = add(multiply(slope, subtract(x, x0)), y0)
        inside = where(equal(x, take(xp, n - 1)), last, inside)  # the right end exactly, as numpy
    out = where(less(x, take(xp, 0)), first if left is None else left, inside)
    out = where(greater(x, take(xp, n - 1)), last if right is None else right, out)
    return where(isnan(x), x, out)


def histogram(x, bins=10, range=None, weights=None, density=False):  # noqa: A002 (numpy's name)
    """numpy.histogram of the flattened array: (counts, edges). `bins` is a count (edges spaced
    evenly over `range`, default [min, max]) or the edges; the last bin includes its right edge.
    Counts are int64 (float with `weights` or `density`)."""
    x = _float_operand(ravel(asarray(x)))
    kind = _dtype_of(x)
    if isinstance(bins, int | np.integer):
        if range is not None:
            lo, hi = (np.asarray(v, kind.np_dtype) for v in range)
        else:
            from flowjit.numpy.reductions import max, min

            lo, hi = (min(x), max(x)) if size(x) else (np.asarray(0, kind.np_dtype), np.asarray(1, kind.np_dtype))
        same = equal(lo, hi)
        lo, hi = where(same, subtract(lo, 0.5), lo), where(same, add(hi, 0.5), hi)
        steps = divide(iota((int(bins) + 1,), 0, kind), float(bins))
        edges = add(lo, multiply(subtract(hi, lo), steps))
        edges = concatenate([_slice_axis(edges, 0, 0, int(bins)), reshape(hi, (1,))])  # the last edge exactly
    else:
        edges = astype(asarray(bins), kind)
    count = size(edges) - 1
    index = subtract(searchsorted(edges, x, side="right"), 1)
    last = take(edges, count)
    index = where(equal(x, last), count - 1, index)
    valid = logical_and(greater_equal(x, take(edges, 0)), less_equal(x, last))
    slot = where(valid, index, count)
    w = broadcast_to(np.ones((), np.int64), (size(x),)) if weights is None else astype(ravel(asarray(weights)), kind)
    totals = scatter_add(broadcast_to(np.zeros((), _dtype_of(w).np_dtype), (count + 1,)), slot, w)
    counts = _slice_axis(totals, 0, 0, count)
    if density:
        widths = subtract(_slice_axis(edges, 0, 1, count + 1), _slice_axis(edges, 0, 0, count))
        counts = astype(counts, kind)
        counts = divide(divide(counts, sum(counts)), widths)
    return counts, edges
