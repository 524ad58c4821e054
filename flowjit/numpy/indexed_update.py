"""Functional indexed updates, JAX's `x.at[index]` API: a new array, `x` unchanged.

    y = x.at[2].set(0.0)                 # numpy indexing: ints, slices, None, ..., integer arrays
    y = x.at[idx, ::2].add(v)            # v broadcasts to the shape of x[idx, ::2]; duplicates accumulate
    y = x.at[rows].multiply(v)  .min(v)  .max(v)  .subtract(v)  .set(v)  .get()
    y = fnp.at(a)[1:].set(5)             # the same on a numpy array (numpy arrays have no `.at`)

Semantics (JAX's): values are cast to x's dtype; with repeated indices `set` keeps the last update
(numpy's `x[idx] = v`), `add`/`multiply`/`min`/`max` combine them all. A traced index out of range
is dropped from an update (mode='drop', the default; mode='clip' clamps it) and clamped by `get`
(mode='fill' gives `fill_value` instead). A static index out of range is an error, as in numpy. A
boolean mask of x's shape (traced or not) updates where it is true, with a scalar or an array of
x's shape as the values (`fnp.where`); numpy masks of other shapes select their `nonzero()` indices.

Algorithm (one path for every index kind, built from gather/scatter_add, whose gradients exist):
  1. positions: x[index] of an array holding each element's flat position (`iota`s under a trace),
     after mapping out-of-range traced indices to one extra "sink" position past the end.
  2. add: one scatter_add of the values into x (plus the sink) at those positions.
  3. the others: with array indices, a stable argsort groups equal positions; a segmented scan
     (log2 steps) combines each group (multiply/min/max) or keeps its last update (set).
     One scatter_add of each group's result, and one of ones (the mask of updated elements), then
     `where(updated, combine(x, update), x)`.
"""

from __future__ import annotations

import builtins
import math

import numpy as np

from flowjit.errors import FlowjitError, FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer, bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.creation import iota
from flowjit.numpy.elementwise import (
    add,
    equal,
    greater_equal,
    less,
    logical_and,
    maximum,
    minimum,
    multiply,
    negative,
    not_equal,
    where,
)
from flowjit.numpy.indexing import _index_entries, _wrap_index, getitem
from flowjit.numpy.promotion import _dtype_of, asarray, astype, broadcast_to
from flowjit.numpy.shapes import concatenate, ravel, reshape, shape, size
from flowjit.numpy.sorting import argsort

_MODES = (None, "drop", "clip", "fill", "promise_in_bounds")

# combine(x, update) for the elements an update reaches; and how a group of updates to one element
# combines (None: the last one wins).
_COMBINE = {
    "set": (lambda x, u: u, None),
    "multiply": (multiply, multiply),
    "min": (minimum, minimum),
    "max": (maximum, maximum),
}


class IndexUpdateHelper:
    """`x.at`: index it to get an `IndexUpdateRef`."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __getitem__(self, index) -> IndexUpdateRef:
        return IndexUpdateRef(self.array, index)

    def __repr__(self) -> str:
        return f"IndexUpdateHelper({self.array!r})"


class IndexUpdateRef:
    """`x.at[index]`: the methods return a new array (see the module docstring)."""

    __slots__ = ("array", "index")

    def __init__(self, array, index):
        self.array = array
        self.index = index

    def get(self, *, mode=None, fill_value=None, indices_are_sorted=False, unique_indices=False):
        """x[index]; with mode='fill', out-of-range traced indices give `fill_value` (nan for
        floats, the smallest int, True) instead of a clamped read."""
        _check_mode(mode, "get")
        if mode != "fill":
            return getitem(self.array, self.index)
        x = asarray(self.array)
        positions = _positions(x, self.index, drop=True)
        fill = _default_fill(_dtype_of(x)) if fill_value is None else fill_value
        padded = concatenate([ravel(x), astype(reshape(asarray(fill), (1,)), _dtype_of(x))])
        return bind("gather", [padded, positions], {"axis": 0})

    def set(self, values, *, mode=None, indices_are_sorted=False, unique_indices=False):
        """x with `values` written at `index` (the last of repeated indices wins)."""
        return _update(self.array, self.index, values, "set", mode, unique_indices)

    def add(self, values, *, mode=None, indices_are_sorted=False, unique_indices=False):
        """x with `values` added at `index` (repeated indices accumulate)."""
        return _update(self.array, self.index, values, "add", mode, unique_indices)

    def subtract(self, values, *, mode=None, indices_are_sorted=False, unique_indices=False):
        """x with `values` subtracted at `index`."""
        return _update(self.array, self.index, negative(asarray(values)), "add", mode, unique_indices)

    def multiply(self, values, *, mode=None, indices_are_sorted=False, unique_indices=False):
        """x multiplied by `values` at `index` (repeated indices multiply together)."""
        return _update(self.array, self.index, values, "multiply", mode, unique_indices)

    mul = multiply

    def min(self, values, *, mode=None, indices_are_sorted=False, unique_indices=False):
        """x with `minimum(x, values)` at `index`."""
        return _update(self.array, self.index, values, "min", mode, unique_indices)

    def max(self, values, *, mode=None, indices_are_sorted=False, unique_indices=False):
        """x with `maximum(x, values)` at `index`."""
        return _update(self.array, self.index, values, "max", mode, unique_indices)

    def __repr__(self) -> str:
        return f"IndexUpdateRef({self.array!r}, {self.index!r})"


def at(x) -> IndexUpdateHelper:
    """`fnp.at(x)[index].set(v)`: `.at` for any array, numpy arrays included."""
    return IndexUpdateHelper(asarray(x))


def _check_mode(mode, method: str) -> None:
    if mode not in _MODES:
        raise op_error(
            FlowjitValueError, user_location(), f"at[].{method}", f"unknown mode {mode!r}; use one of {_MODES[1:]}"
        )


def _default_fill(dtype: dt.DType):
    if dtype.is_float:
        return np.nan
    if dtype.is_bool:
        return True
    return np.iinfo(dtype.np_dtype).min


def _update(x, index, values, kind: str, mode, unique_indices: bool):
    _check_mode(mode, kind)
    if mode == "fill":
        raise op_error(FlowjitValueError, user_location(), f"at[].{kind}", "mode='fill' is for get(); use 'drop'")
    x = asarray(x)
    dtype = _dtype_of(x)
    values = astype(asarray(values), dtype)
    if dtype.is_bool:  # scatter_add takes no bools: update as int32 (add is a logical or, as numpy's)
        updated = _update(astype(x, dt.int32), index, astype(values, dt.int32), kind, mode, unique_indices)
        return not_equal(updated, 0)
    mask = _whole_mask(x, index)
    if mask is not None:
        combine = (lambda a, v: add(a, v)) if kind == "add" else _COMBINE[kind][0]
        return where(mask, combine(x, broadcast_to(values, shape(x))), x)
    positions = _positions(x, index, drop=mode != "clip")
    if size(positions) == 0 or size(x) == 0:
        return x
    flat_positions = ravel(positions)
    updates = ravel(_broadcast_values(values, shape(positions), kind))
    n = size(x)
    if kind == "add":
        grown = concatenate([ravel(x), np.zeros(1, dtype.np_dtype)])
        return reshape(_drop_sink(bind("scatter_add", [grown, flat_positions, updates], {"axis": 0}), n), shape(x))
    combine, reduce_group = _COMBINE[kind]
    targets = flat_positions
    if not (unique_indices or _basic(index)):
        targets, updates = _one_update_per_position(flat_positions, updates, reduce_group, n)
    zeros = np.zeros(n + 1, dtype.np_dtype)
    scattered = _drop_sink(bind("scatter_add", [zeros, targets, updates], {"axis": 0}), n)
    ones = broadcast_to(np.ones((), np.int32), shape(flat_positions))
    hits = _drop_sink(bind("scatter_add", [np.zeros(n + 1, np.int32), flat_positions, ones], {"axis": 0}), n)
    flat_x = ravel(x)
    return reshape(where(not_equal(hits, 0), combine(flat_x, scattered), flat_x), shape(x))


def _broadcast_values(values, target: tuple[int, ...], kind: str):
    try:
        return broadcast_to(values, target)
    except FlowjitError:
        raise op_error(
            FlowjitValueError,
            user_location(),
            f"at[].{kind}",
            f"values of shape {shape(values)} do not broadcast to the indexed shape {target}",
        ) from None


def _drop_sink(flat, n: int):
    return bind("slice", [flat], {"start": (0,), "limit": (n,), "stride": (1,)})


def _basic(index) -> bool:
    """Whether `index` has no array entries, so no position repeats."""
    entries = index if isinstance(index, tuple) else (index,)
    return not builtins.any(isinstance(k, list | np.ndarray | Tracer) and np.ndim(k) > 0 for k in entries)


def _whole_mask(x, index):
    """`index` when it is a traced boolean mask (which must have x's shape), else None: a numpy
    mask selects its nonzero() indices, as in numpy, so its values may be one per true element."""
    if not isinstance(index, Tracer) or not _dtype_of(index).is_bool:
        return None
    if tuple(shape(index)) != tuple(shape(x)):
        raise op_error(
            FlowjitTypeError,
            user_location(),
            "at[]",
            f"a traced boolean mask must have x's shape {shape(x)} (it updates where true, with a scalar or an "
            f"array of x's shape as the values); found {shape(index)}",
        )
    return index


def _one_update_per_position(positions, updates, reduce_group, n: int):
    """Group equal positions (a stable argsort keeps their order) and combine each group's updates
    into its last element (or keep the last update); the other elements go to the sink `n`."""
    order = argsort(positions)
    positions = bind("gather", [positions, order], {"axis": 0})
    updates = bind("gather", [updates, order], {"axis": 0})
    k = size(positions)
    step = 1
    while reduce_group is not None and step < k:  # Hillis-Steele inclusive scan within each group
        earlier = concatenate([_prefix(updates, step), _prefix(updates, k - step)])
        same = concatenate([np.zeros(step, np.bool_), equal(_suffix(positions, step), _prefix(positions, k - step))])
        updates = where(same, reduce_group(updates, earlier), updates)
        step *= 2
    last = concatenate([not_equal(_suffix(positions, 1), _prefix(positions, k - 1)), np.ones(1, np.bool_)])
    return where(last, positions, n), updates


def _prefix(x, length: int):
    return bind("slice", [x], {"start": (0,), "limit": (length,), "stride": (1,)})


def _suffix(x, start: int):
    return bind("slice", [x], {"start": (start,), "limit": (size(x),), "stride": (1,)})


def _positions(x, index, drop: bool):
    """The flat (row-major) position of every element of x[index], with the shape of x[index];
    traced indices out of range give the sink `size(x)` when `drop`, else clamp."""
    dims = tuple(shape(x))
    entries = _index_entries(index, dims)
    traced = [k for k in entries if isinstance(k, Tracer)]
    if not traced and not isinstance(x, Tracer):
        return getitem(np.arange(math.prod(dims), dtype=np.int64).reshape(dims), tuple(entries))
    key, axis = [], 0
    for k in entries:
        if k is None:
            key.append(k)
            continue
        d = dims[axis]
        if isinstance(k, slice):  # in terms of x's dims, not the padded ones
            lo, hi, st = k.indices(d)
            k = slice(lo, None if hi < 0 else hi, st)
        elif isinstance(k, Tracer):
            k = _wrap_index(k, d, axis)
            k = where(logical_and(greater_equal(k, 0), less(k, d)), k, d) if drop else minimum(maximum(k, 0), d - 1)
        else:
            k = _wrap_index(k, d, axis)  # a static index out of range is numpy's error
        key.append(k)
        axis += 1
    return getitem(_flat_positions(dims, sink=drop and bool(traced)), tuple(key))


def _flat_positions(dims: tuple[int, ...], sink: bool):
    """An int64 array of shape `dims` (one larger along every axis with `sink`) holding each
    element's flat position in an array of shape `dims`; the extra elements hold the sink,
    math.prod(dims). Built from iotas, never a big constant."""
    if not dims:
        return np.zeros((), np.int64)
    grown = tuple(d + 1 for d in dims) if sink else dims
    linear, inside = np.zeros((), np.int64), None
    for axis, d in enumerate(dims):
        coordinate = iota(grown, axis)
        stride = math.prod(dims[axis + 1 :])
        linear = add(linear, multiply(coordinate, np.int64(stride)) if stride != 1 else coordinate)
        if sink:
            in_range = less(coordinate, d)
            inside = in_range if inside is None else logical_and(inside, in_range)
    return where(inside, linear, np.int64(math.prod(dims))) if sink else linear
