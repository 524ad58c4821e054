"""Movement and layout ops: broadcast, reshape, transpose, slice, dynamic_slice, pad, concatenate,
gather and scatter_add.

Out-of-range indices never read or write outside a buffer: `dynamic_slice` clamps its start so the
whole window fits (as XLA does), and `gather`/`scatter_add` clamp each index into `[0, dim-1]`.
Negative indices in numpy's sense are the frontend's business (it adds the dimension first).
"""

from __future__ import annotations

import math

import numpy as np

from flowjit.errors import ShapeError
from flowjit.ir.ops.registry import MOVEMENT, defop
from flowjit.ir.ops.rules import check_axis, fmt_shape, int_tuple


def _broadcast_rule(types, attrs):
    (x,) = types
    shape = int_tuple(attrs["shape"], "shape")
    dims = int_tuple(attrs["dims"], "dims", x.rank)
    if any(not 0 <= d < len(shape) for d in dims) or list(dims) != sorted(set(dims)):
        raise ShapeError(f"'dims' {dims} must be increasing positions in the result shape {fmt_shape(shape)}")
    for i, d in enumerate(dims):
        if x.shape[i] not in (1, shape[d]):
            raise ShapeError(
                f"cannot broadcast shape {fmt_shape(x.shape)} to {fmt_shape(shape)}: "
                f"dimension {i} has size {x.shape[i]}, expected 1 or {shape[d]}"
            )
    return [x.with_shape(shape)]


def _broadcast(x, *, shape, dims):
    view = [1] * len(shape)
    for i, d in enumerate(dims):
        view[d] = x.shape[i]
    return np.broadcast_to(x.reshape(view), tuple(shape)).copy()


defop(
    "broadcast",
    MOVEMENT,
    _broadcast_rule,
    _broadcast,
    1,
    attrs=("shape", "dims"),
    doc="operand dim i maps to result dim dims[i] (size 1 or equal); other dims are new",
)


def _reshape_rule(types, attrs):
    (x,) = types
    shape = int_tuple(attrs["shape"], "shape")
    if math.prod(shape) != x.size:
        raise ShapeError(f"cannot reshape {fmt_shape(x.shape)} ({x.size} elements) to {fmt_shape(shape)}")
    return [x.with_shape(shape)]


defop(
    "reshape",
    MOVEMENT,
    _reshape_rule,
    lambda x, *, shape: x.reshape(tuple(shape)).copy(),
    1,
    attrs=("shape",),
    doc="row-major reshape to `shape`",
)


def _transpose_rule(types, attrs):
    (x,) = types
    perm = int_tuple(attrs["perm"], "perm", x.rank)
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"'perm' {perm} is not a permutation of {tuple(range(x.rank))}")
    return [x.with_shape(tuple(x.shape[p] for p in perm))]


defop(
    "transpose",
    MOVEMENT,
    _transpose_rule,
    lambda x, *, perm: np.transpose(x, perm).copy(),
    1,
    attrs=("perm",),
    doc="result dim i is operand dim perm[i]",
)


def _slice_rule(types, attrs):
    (x,) = types
    start = int_tuple(attrs["start"], "start", x.rank)
    limit = int_tuple(attrs["limit"], "limit", x.rank)
    stride = int_tuple(attrs["stride"], "stride", x.rank)
    shape = []
    for i, (s, l, st) in enumerate(zip(start, limit, stride)):
        if st < 1 or not 0 <= s <= l <= x.shape[i]:
            raise ShapeError(
                f"slice [{s}:{l}:{st}] of dimension {i} (size {x.shape[i]}) needs 0 <= start <= limit "
                "<= size and stride >= 1"
            )
        shape.append(max(0, -(-(l - s) // st)))
    return [x.with_shape(shape)]


def _slice(x, *, start, limit, stride):
    return x[tuple(slice(s, l, st) for s, l, st in zip(start, limit, stride))].copy()


defop(
    "slice",
    MOVEMENT,
    _slice_rule,
    _slice,
    1,
    attrs=("start", "limit", "stride"),
    doc="static strided slice x[start:limit:stride] per dimension",
)


def _dynamic_slice_rule(types, attrs):
    x, *starts = types
    sizes = int_tuple(attrs["sizes"], "sizes", x.rank)
    if len(starts) != x.rank:
        raise ShapeError(f"expected {x.rank} start indices (one per dimension); found {len(starts)}")
    for i, s in enumerate(starts):
        if s.shape != () or not s.dtype.is_int:
            raise ShapeError(f"start index {i} must be an integer scalar; found {s}")
    for i, (n, d) in enumerate(zip(sizes, x.shape)):
        if not 0 <= n <= d:
            raise ShapeError(f"slice size {n} of dimension {i} exceeds its size {d}")
    return [x.with_shape(sizes)]


def clamp_starts(starts, sizes, shape):
    return [int(min(max(int(s), 0), d - n)) for s, n, d in zip(starts, sizes, shape)]


def _dynamic_slice(x, *starts, sizes):
    starts = clamp_starts(starts, sizes, x.shape)
    return x[tuple(slice(s, s + n) for s, n in zip(starts, sizes))].copy()


defop(
    "dynamic_slice",
    MOVEMENT,
    _dynamic_slice_rule,
    _dynamic_slice,
    None,
    attrs=("sizes",),
    doc="window of `sizes` at runtime starts (scalars), clamped so the window fits",
)


def _pad_rule(types, attrs):
    x, value = types
    low = int_tuple(attrs["low"], "low", x.rank)
    high = int_tuple(attrs["high"], "high", x.rank)
    interior = int_tuple(attrs["interior"], "interior", x.rank)
    if value.shape != () or value.dtype != x.dtype:
        raise ShapeError(f"the padding value must be a {x.dtype} scalar; found {value}")
    if any(v < 0 for v in low + high + interior):
        raise ShapeError(f"padding amounts must be >= 0; found low={low} high={high} interior={interior}")
    shape = [lo + hi + d + max(d - 1, 0) * it for d, lo, hi, it in zip(x.shape, low, high, interior)]
    return [x.with_shape(shape)]


def _pad(x, value, *, low, high, interior):
    out_shape = [lo + hi + d + max(d - 1, 0) * it for d, lo, hi, it in zip(x.shape, low, high, interior)]
    out = np.full(out_shape, value, dtype=x.dtype)
    out[tuple(slice(lo, lo + max(d + max(d - 1, 0) * it, 0), it + 1) for d, lo, it in zip(x.shape, low, interior))] = x
    return out


defop(
    "pad",
    MOVEMENT,
    _pad_rule,
    _pad,
    2,
    attrs=("low", "high", "interior"),
    doc="pad with a scalar value: `low`/`high` at each edge, `interior` between elements",
)


def _concatenate_rule(types, attrs):
    if not types:
        raise ShapeError("needs at least one operand")
    first = types[0]
    axis = check_axis(attrs["axis"], first.rank)
    total = 0
    for t in types:
        if t.dtype != first.dtype or t.rank != first.rank:
            raise ShapeError(f"operands must share dtype and rank; found {first} and {t}")
        if any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis):
            raise ShapeError(f"shapes {fmt_shape(first.shape)} and {fmt_shape(t.shape)} differ off axis {axis}")
        total += t.shape[axis]
    shape = list(first.shape)
    shape[axis] = total
    return [first.with_shape(shape)]


defop(
    "concatenate",
    MOVEMENT,
    _concatenate_rule,
    lambda *xs, axis: np.concatenate(xs, axis=axis),
    None,
    attrs=("axis",),
    doc="join operands along `axis`",
)


def _gather_rule(types, attrs):
    x, idx = types
    axis = check_axis(attrs["axis"], x.rank)
    if not idx.dtype.is_int:
        raise ShapeError(f"indices must be integers; found {idx.dtype}")
    if x.shape[axis] == 0 and idx.size:
        raise ShapeError(f"cannot index axis {axis} of size 0 (operand {fmt_shape(x.shape)}) with {idx.size} indices")
    return [x.with_shape(x.shape[:axis] + idx.shape + x.shape[axis + 1 :])]


def _gather(x, idx, *, axis):
    return np.take(x, np.clip(idx, 0, x.shape[axis] - 1), axis=axis)


defop(
    "gather",
    MOVEMENT,
    _gather_rule,
    _gather,
    2,
    attrs=("axis",),
    doc="numpy.take(x, indices, axis) with each index clamped into [0, dim-1]",
)


def _scatter_add_rule(types, attrs):
    x, idx, updates = types
    (expected,) = _gather_rule([x, idx], attrs)
    if updates != expected:
        raise ShapeError(f"updates must have type {expected} (the gather of x by indices); found {updates}")
    return [x]


def _scatter_add(x, idx, updates, *, axis):
    out = x.copy()
    clamped = np.clip(idx, 0, x.shape[axis] - 1)
    moved = np.moveaxis(out, axis, 0)
    upd = np.moveaxis(updates.reshape(x.shape[:axis] + (idx.size,) + x.shape[axis + 1 :]), axis, 0)
    np.add.at(moved, clamped.reshape(-1), upd)
    return out


defop(
    "scatter_add",
    MOVEMENT,
    _scatter_add_rule,
    _scatter_add,
    3,
    attrs=("axis",),
    doc="x with updates added at indices along `axis` (clamped, duplicates accumulate)",
)
