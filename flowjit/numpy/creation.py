"""Array creation: zeros, ones, full and their `_like` forms, ranges (arange, linspace, iota, ...),
eye and identity, triangles (tri, tril, triu) and meshgrid."""

from __future__ import annotations

import builtins

import numpy as np

from flowjit.errors import FlowjitValueError
from flowjit.frontend.trace import Tracer, bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.elementwise import (
    less_equal,
    logical_not,
    subtract,
    where,
)
from flowjit.numpy.promotion import (
    _dtype_of,
    asarray,
    astype,
    broadcast_to,
)
from flowjit.numpy.shapes import ndim, ravel, reshape, shape, size


def _shape_tuple(shape) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)


def zeros(shape, dtype=None):
    return np.zeros(_shape_tuple(shape), dt.dtype(dtype or "f32").np_dtype)


def ones(shape, dtype=None):
    return np.ones(_shape_tuple(shape), dt.dtype(dtype or "f32").np_dtype)


def full(shape, fill_value, dtype=None):
    if isinstance(fill_value, Tracer):
        return broadcast_to(astype(fill_value, dtype) if dtype else fill_value, _shape_tuple(shape))
    dtype = dt.dtype(dtype) if dtype is not None else _dtype_of(fill_value)
    return np.full(_shape_tuple(shape), fill_value, dtype.np_dtype)


def _like(x, dtype):
    return tuple(np.shape(x) if not isinstance(x, Tracer) else x.shape), (dtype or _dtype_of(asarray(x)))


def zeros_like(x, dtype=None):
    shape, d = _like(x, dtype)
    return zeros(shape, d)


def ones_like(x, dtype=None):
    shape, d = _like(x, dtype)
    return ones(shape, d)


def full_like(x, fill_value, dtype=None):
    shape, d = _like(x, dtype)
    return full(shape, fill_value, d)


def arange(start, stop=None, step=1, dtype=None):
    if stop is None:
        start, stop = 0, start
    if dtype is None:
        dtype = dt.float32 if builtins.any(isinstance(v, float) for v in (start, stop, step)) else dt.int64
    return np.arange(start, stop, step, dtype=dt.dtype(dtype).np_dtype)


def linspace(start, stop, num=50, endpoint=True, dtype=None):
    return np.linspace(start, stop, num, endpoint=endpoint).astype(dt.dtype(dtype or "f32").np_dtype)


def eye(n, m=None, k=0, dtype=None):
    return np.eye(n, m, k, dtype=dt.dtype(dtype or "f32").np_dtype)


def logspace(start, stop, num=50, endpoint=True, base=10.0, dtype=None):
    """numpy.logspace: `base ** linspace(start, stop, num)` (float32 by default)."""
    return np.logspace(start, stop, num, endpoint=endpoint, base=base).astype(dt.dtype(dtype or "f32").np_dtype)


def geomspace(start, stop, num=50, endpoint=True, dtype=None):
    """numpy.geomspace: a geometric progression from `start` to `stop` (float32 by default)."""
    return np.geomspace(start, stop, num, endpoint=endpoint).astype(dt.dtype(dtype or "f32").np_dtype)


def iota(shape, dimension=0, dtype="i64"):
    """0, 1, 2, ... along `dimension` of a new array of `shape` (as an op, never a big constant)."""
    return bind("iota", [], {"shape": _shape_tuple(shape), "dimension": dimension, "dtype": dt.dtype(dtype)})


def identity(n, dtype=None):
    """numpy.identity: the n x n identity matrix."""
    return eye(n, dtype=dtype)


def empty(shape, dtype=None):
    """numpy.empty, as zeros: flowjit never hands out uninitialized memory."""
    return zeros(shape, dtype)


def empty_like(x, dtype=None):
    """numpy.empty_like, as zeros (see `empty`)."""
    return zeros_like(x, dtype)


def tri(n, m=None, k=0, dtype=None):
    """numpy.tri: ones at and below the k-th diagonal of an n x m matrix."""
    return np.tri(n, m, k, dtype=dt.dtype(dtype or "f32").np_dtype)


def _tri_mask(n: int, m: int, k: int):
    """Where `col - row <= k` in an (n, m) matrix; built from iota ops under a trace, never a literal."""
    rows, cols = iota((n, m), 0), iota((n, m), 1)
    return less_equal(subtract(cols, rows), k)


def _masked(x, mask):
    """x where `mask` (broadcast over x's leading dims), zero elsewhere, in x's dtype."""
    x = asarray(x)
    return where(mask, x, np.zeros((), _dtype_of(x).np_dtype))


def tril(x, k=0):
    """numpy.tril: zero above the k-th diagonal of the last two axes (a 1-D x is a row, as numpy)."""
    x = asarray(x)
    if ndim(x) < 2:
        x = broadcast_to(x, (shape(x)[0], shape(x)[0]) if ndim(x) else (1, 1))
    return _masked(x, _tri_mask(*shape(x)[-2:], k))


def triu(x, k=0):
    """numpy.triu: zero below the k-th diagonal of the last two axes (a 1-D x is a row, as numpy)."""
    x = asarray(x)
    if ndim(x) < 2:
        x = broadcast_to(x, (shape(x)[0], shape(x)[0]) if ndim(x) else (1, 1))
    return _masked(x, logical_not(_tri_mask(*shape(x)[-2:], k - 1)))


def meshgrid(*xs, indexing="xy", sparse=False):
    """numpy.meshgrid: coordinate arrays from 1-D vectors ('xy' swaps the first two output axes)."""
    if indexing not in ("xy", "ij"):
        raise FlowjitValueError(f"{user_location()}: meshgrid indexing must be 'xy' or 'ij'; found {indexing!r}")
    xs = [ravel(x) for x in xs]
    sizes = [size(x) for x in xs]
    if indexing == "xy" and len(xs) >= 2:
        sizes[0], sizes[1] = sizes[1], sizes[0]
    out = []
    for i, x in enumerate(xs):
        position = {0: 1, 1: 0}.get(i, i) if indexing == "xy" and len(xs) >= 2 else i
        view = [1] * len(xs)
        view[position] = size(x)
        out.append(reshape(x, view) if sparse else broadcast_to(reshape(x, view), sizes))
    return tuple(out)
