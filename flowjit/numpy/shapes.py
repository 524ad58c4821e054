"""Array creation, shape manipulation and indexing."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import numpy as np

from flowjit.errors import FlowjitError, FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer, bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.elementwise import (
    add,
    equal,
    less,
    less_equal,
    logical_not,
    maximum,
    minimum,
    multiply,
    subtract,
    where,
)
from flowjit.numpy.promotion import (
    _cast_all,
    _dtype_of,
    _is_python_scalar,
    asarray,
    astype,
    broadcast_shapes,
    broadcast_to,
    result_type,
)

# --- creation ---------------------------------------------------------------------------------------


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


def diagonal(x, offset=0, axis1=0, axis2=1):
    """numpy.diagonal: the `offset` diagonal of the (axis1, axis2) planes, as the last axis."""
    x = asarray(x)
    rank = ndim(x)
    a1, a2 = _norm_axis(axis1, rank, "diagonal"), _norm_axis(axis2, rank, "diagonal")
    if a1 == a2:
        raise op_error(FlowjitValueError, user_location(), "diagonal", "axis1 and axis2 cannot be the same")
    x = transpose(x, [a for a in range(rank) if a not in (a1, a2)] + [a1, a2])
    n, m = shape(x)[-2:]
    length = builtins.max(0, builtins.min(n + builtins.min(offset, 0), m - builtins.max(offset, 0)))
    rows = np.arange(length) - builtins.min(offset, 0)
    return getitem(x, (Ellipsis, rows, rows + offset))


def diag(v, k=0):
    """numpy.diag: the k-th diagonal of a matrix, or a square matrix with `v` on its k-th diagonal."""
    v = asarray(v)
    if ndim(v) == 2:
        return diagonal(v, k)
    if ndim(v) != 1:
        raise op_error(FlowjitValueError, user_location(), "diag", f"needs a 1-D or 2-D input; found shape {shape(v)}")
    n = shape(v)[0] + builtins.abs(k)
    row_values = pad(v, ((builtins.max(-k, 0), builtins.max(k, 0)),))  # row r holds v[r - max(-k, 0)]
    on_diagonal = equal(subtract(iota((n, n), 1), iota((n, n), 0)), k)
    return _masked(broadcast_to(reshape(row_values, (n, 1)), (n, n)), on_diagonal)


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


# --- shape manipulation -----------------------------------------------------------------------------


def shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, Tracer) else np.shape(x)


def ndim(x) -> int:
    return len(shape(x))


def size(x) -> int:
    return math.prod(shape(x))


def reshape(x, *newshape, order="C"):
    if order != "C":
        raise FlowjitValueError(f"{user_location()}: reshape supports order='C' only; found {order!r}")
    x = asarray(x)
    if len(newshape) == 1 and not isinstance(newshape[0], int | np.integer):
        newshape = tuple(newshape[0])
    newshape = [int(d) for d in newshape]
    total = size(x)
    if newshape.count(-1) > 1:
        raise op_error(FlowjitValueError, user_location(), "reshape", "can only specify one unknown dimension")
    if -1 in newshape:
        known = math.prod(d for d in newshape if d != -1)
        if known == 0 or total % known:
            raise op_error(
                FlowjitTypeError,
                user_location(),
                "reshape",
                f"cannot reshape {shape(x)} ({total} elements) to {tuple(newshape)}",
            )
        newshape[newshape.index(-1)] = total // known
    if tuple(newshape) == shape(x):
        return x
    return bind("reshape", [x], {"shape": tuple(newshape)})


def ravel(x):
    return reshape(x, (-1,))


def _norm_axis(axis: int, rank: int, op: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise op_error(
            FlowjitValueError, user_location(), op, f"axis {axis} is out of bounds for an array of rank {rank}"
        )
    return axis % rank


def transpose(x, axes=None):
    x = asarray(x)
    rank = ndim(x)
    perm = tuple(reversed(range(rank))) if axes is None else tuple(_norm_axis(a, rank, "transpose") for a in axes)
    if perm == tuple(range(rank)):
        return x
    return bind("transpose", [x], {"perm": perm})


def swapaxes(x, axis1, axis2):
    rank = ndim(x)
    perm = list(range(rank))
    a, b = _norm_axis(axis1, rank), _norm_axis(axis2, rank)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


def moveaxis(x, source, destination):
    rank = ndim(x)
    src, dst = _norm_axis(source, rank), _norm_axis(destination, rank)
    perm = [i for i in range(rank) if i != src]
    perm.insert(dst, src)
    return transpose(x, perm)


def expand_dims(x, axis):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    rank = ndim(x) + len(axes)
    axes = sorted(_norm_axis(a, rank, "expand_dims") for a in axes)
    out_shape = list(shape(x))
    for a in axes:
        out_shape.insert(a, 1)
    return reshape(x, out_shape)


def squeeze(x, axis=None):
    s = shape(x)
    if axis is None:
        axes = [i for i, d in enumerate(s) if d == 1]
    else:
        axes = [_norm_axis(a, len(s), "squeeze") for a in ((axis,) if isinstance(axis, int) else axis)]
        for a in axes:
            if s[a] != 1:
                raise op_error(
                    FlowjitValueError, user_location(), "squeeze", f"cannot squeeze axis {a} of size {s[a]} (shape {s})"
                )
    return reshape(x, [d for i, d in enumerate(s) if i not in axes])


def concatenate(arrays: Sequence, axis: int | None = 0):
    """numpy.concatenate with promotion; `axis=None` joins the flattened arrays."""
    arrays = list(arrays)
    if not arrays:
        raise op_error(FlowjitValueError, user_location(), "concatenate", "needs at least one array")
    target = result_type(*arrays)
    arrays = _cast_all(arrays, target)
    if axis is None:
        arrays, axis = [ravel(a) for a in arrays], 0
    arrays = [a if ndim(a) else reshape(a, (1,)) for a in arrays]
    axis = _norm_axis(axis, ndim(arrays[0]), "concatenate")
    if len(arrays) == 1:
        return arrays[0]
    return bind("concatenate", arrays, {"axis": axis})


def stack(arrays: Sequence, axis: int = 0):
    arrays = [asarray(a) for a in arrays]
    if not arrays:
        raise op_error(FlowjitValueError, user_location(), "stack", "needs at least one array")
    axis = _norm_axis(axis, ndim(arrays[0]) + 1, "stack")
    return concatenate([expand_dims(a, axis) for a in arrays], axis)


def split(x, indices_or_sections, axis=0):
    x = asarray(x)
    axis = _norm_axis(axis, ndim(x), "split")
    n = shape(x)[axis]
    if isinstance(indices_or_sections, int):
        if n % indices_or_sections:
            raise op_error(
                FlowjitValueError,
                user_location(),
                "split",
                f"axis {axis} of size {n} does not divide into {indices_or_sections} equal parts",
            )
        step = n // indices_or_sections
        bounds = [i * step for i in range(indices_or_sections + 1)]
    else:
        bounds = [0, *indices_or_sections, n]
    # Each part is x[lo:hi] with Python's slice rules (negative and out-of-range bounds), as numpy.
    parts = [slice(lo, hi).indices(n)[:2] for lo, hi in zip(bounds[:-1], bounds[1:])]
    return [_slice_axis(x, axis, lo, hi) for lo, hi in parts]


def _slice_axis(x, axis, lo, hi, step=1):
    rank = ndim(x)
    start = [0] * rank
    limit = list(shape(x))
    stride = [1] * rank
    start[axis], limit[axis], stride[axis] = lo, builtins.max(lo, hi), step
    return bind("slice", [x], {"start": start, "limit": limit, "stride": stride})


# numpy.pad's modes that take elements of the array itself (`_pad_from_indices`).
_INDEX_PAD_MODES = ("edge", "reflect", "symmetric", "wrap")


def pad(x, pad_width, mode="constant", constant_values=0):
    """numpy.pad in modes 'constant' (a scalar, traced or not, or numpy's per-axis (before, after)
    values), 'edge', 'reflect', 'symmetric' and 'wrap' (numpy's default even reflection, widths
    beyond the axis included)."""
    x = asarray(x)
    rank = ndim(x)
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (rank, 2))  # numpy's pad_width rule
    if (widths < 0).any():
        raise FlowjitValueError(f"{user_location()}: pad widths must be >= 0; found {pad_width!r}")
    if mode in _INDEX_PAD_MODES:
        for axis in range(rank):
            x = _pad_from_indices(x, axis, mode, int(widths[axis, 0]), int(widths[axis, 1]))
        return x
    if mode not in ("constant", "empty"):  # numpy leaves 'empty' padding undefined: zeros here
        supported = ", ".join(repr(m) for m in ("constant", *_INDEX_PAD_MODES))
        raise FlowjitValueError(f"{user_location()}: pad supports modes {supported}; found {mode!r}")
    if mode == "empty":
        constant_values = 0
    if isinstance(constant_values, Tracer) or np.ndim(constant_values) == 0:
        return _pad_constant(x, constant_values, widths[:, 0], widths[:, 1])
    values = np.broadcast_to(np.asarray(constant_values), (rank, 2))  # per axis, as numpy: axis by axis
    for axis in range(rank):
        for side, value in enumerate(values[axis]):
            low = [0] * rank
            high = [0] * rank
            (low if side == 0 else high)[axis] = widths[axis, side]
            x = _pad_constant(x, value, low, high)
    return x


def _pad_constant(x, value, low, high):
    value = asarray(value, _dtype_of(x)) if not isinstance(value, Tracer) else astype(value, _dtype_of(x))
    rank = ndim(x)
    return bind(
        "pad",
        [x, value],
        {"low": tuple(int(w) for w in low), "high": tuple(int(w) for w in high), "interior": (0,) * rank},
    )


def _pad_from_indices(x, axis: int, mode: str, before: int, after: int):
    """Pad `axis` with elements of x itself: the positions numpy's pad gives the axis's indices in
    `mode`, read as runs (ascending: a slice, descending: a reversed slice, repeated: a broadcast
    of one), joined by one concatenation; a reflection's turning point or an edge's last repeat
    starts the ascending run, so the middle piece is the whole axis, x itself rather than a copied
    slice (NCHW reflect by 1: 1.9 -> 0.65 ms)."""
    n = shape(x)[axis]
    if before == 0 and after == 0:
        return x
    if n == 0:
        raise FlowjitValueError(f"{user_location()}: pad cannot extend an empty axis ({axis}) in mode {mode!r}")
    index = np.pad(np.arange(n), (before, after), mode=mode)
    pieces, start = [], 0
    while start < len(index):
        step = int(index[start + 1] - index[start]) if start + 1 < len(index) else 1
        step = step if step in (-1, 0, 1) else 1
        end = start + 1
        while end < len(index) and index[end] - index[end - 1] == step:
            if step != 1 and end + 1 < len(index) and index[end + 1] - index[end] == 1:
                break  # the turning point (reflect) or the last repeat (edge) starts the ascending run
            end += 1
        first, count = int(index[start]), end - start
        if step == 1:
            pieces.append(_slice_axis(x, axis, first, first + count))
        elif step == -1:
            pieces.append(flip(_slice_axis(x, axis, first - count + 1, first + 1), axis))
        else:
            one = _slice_axis(x, axis, first, first + 1)
            pieces.append(broadcast_to(one, shape(one)[:axis] + (count,) + shape(one)[axis + 1 :]))
        start = end
    return pieces[0] if len(pieces) == 1 else concatenate(pieces, axis=axis)


def tile(x, reps):
    x = asarray(x)
    reps = (reps,) if isinstance(reps, int) else tuple(reps)
    s = (1,) * (len(reps) - ndim(x)) + shape(x)
    reps = (1,) * (len(s) - len(reps)) + reps
    x = reshape(x, s)
    expanded = [d for pair in zip(reps, s) for d in pair]
    out = broadcast_to(reshape(x, [d for dd in s for d in (1, dd)]), expanded)
    return reshape(out, [r * d for r, d in zip(reps, s)])


def repeat(x, repeats: int, axis=None):
    x = asarray(x)
    if axis is None:
        x, axis = ravel(x), 0
    axis = _norm_axis(axis, ndim(x), "repeat")
    s = shape(x)
    expanded = expand_dims(x, axis + 1)
    target = s[: axis + 1] + (repeats,) + s[axis + 1 :]
    return reshape(broadcast_to(expanded, target), s[:axis] + (s[axis] * repeats,) + s[axis + 1 :])


def flip(x, axis=None):
    x = asarray(x)
    axes = range(ndim(x)) if axis is None else ((axis,) if isinstance(axis, int) else axis)
    for a in axes:
        a = _norm_axis(a, ndim(x), "flip")
        x = take(x, np.arange(shape(x)[a] - 1, -1, -1), axis=a)
    return x


def rot90(x, k=1, axes=(0, 1)):
    """numpy.rot90: rotate by 90 degrees k times in the plane of `axes` (from the first toward the second)."""
    x = asarray(x)
    a, b = (_norm_axis(axis, ndim(x), "rot90") for axis in axes)
    k %= 4
    if k == 0:
        return x
    if k == 2:
        return flip(flip(x, a), b)
    perm = list(range(ndim(x)))
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(flip(x, b), perm) if k == 1 else flip(transpose(x, perm), b)


def broadcast_arrays(*xs):
    """numpy.broadcast_arrays: every input broadcast to their common shape (a tuple)."""
    xs = [asarray(x) for x in xs]
    common = broadcast_shapes(*(shape(x) for x in xs))
    return tuple(broadcast_to(x, common) for x in xs)


def append(x, values, axis=None):
    """numpy.append: `values` after `x` along `axis` (both flattened when None)."""
    if axis is None:
        return concatenate([ravel(x), ravel(values)], axis=0)
    return concatenate([x, values], axis=axis)


def flipud(x):
    """numpy.flipud: reverse axis 0."""
    return flip(x, 0)


def fliplr(x):
    """numpy.fliplr: reverse axis 1."""
    return flip(x, 1)


def _atleast(rank: int, xs, expand):
    out = [asarray(x) for x in xs]
    out = [x if ndim(x) >= rank else reshape(x, expand(shape(x))) for x in out]
    return out[0] if len(out) == 1 else tuple(out)


def atleast_1d(*xs):
    """numpy.atleast_1d: scalars become shape (1,); one array in, one out, else a tuple."""
    return _atleast(1, xs, lambda s: (1,))


def atleast_2d(*xs):
    """numpy.atleast_2d: (n,) becomes (1, n)."""
    return _atleast(2, xs, lambda s: (1,) * (2 - len(s)) + s)


def atleast_3d(*xs):
    """numpy.atleast_3d: (n,) becomes (1, n, 1), (m, n) becomes (m, n, 1)."""
    return _atleast(3, xs, lambda s: {0: (1, 1, 1), 1: (1, *s, 1), 2: (*s, 1)}[len(s)])


def _as_list(xs):
    return [xs] if isinstance(xs, Tracer | np.ndarray) else list(xs)


def vstack(arrays):
    """numpy.vstack: concatenate along axis 0 after atleast_2d."""
    return concatenate([atleast_2d(a) for a in _as_list(arrays)], axis=0)


def hstack(arrays):
    """numpy.hstack: concatenate along axis 1 (axis 0 for 1-D arrays)."""
    arrays = [atleast_1d(a) for a in _as_list(arrays)]
    return concatenate(arrays, axis=0 if ndim(arrays[0]) == 1 else 1)


def dstack(arrays):
    """numpy.dstack: concatenate along axis 2 after atleast_3d."""
    return concatenate([atleast_3d(a) for a in _as_list(arrays)], axis=2)


def column_stack(arrays):
    """numpy.column_stack: 1-D arrays become columns, then concatenate along axis 1."""
    arrays = [asarray(a) for a in _as_list(arrays)]
    return concatenate([reshape(a, (-1, 1)) if ndim(a) < 2 else a for a in arrays], axis=1)


def roll(x, shift, axis=None):
    """numpy.roll: elements shifted along `axis` wrap around (the flattened array when None)."""
    x = asarray(x)
    if axis is None:
        return reshape(roll(ravel(x), shift, 0), shape(x))
    shifts = (shift,) if isinstance(shift, int | np.integer) else tuple(shift)
    axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    if len(shifts) == 1:
        shifts = shifts * len(axes)
    if len(axes) == 1:
        axes = axes * len(shifts)
    if len(shifts) != len(axes):
        raise FlowjitValueError(f"{user_location()}: roll got {len(shifts)} shifts for {len(axes)} axes")
    for s, a in zip(shifts, axes):
        a = _norm_axis(a, ndim(x), "roll")
        n = shape(x)[a]
        if n == 0 or s % n == 0:
            continue
        cut = n - int(s) % n
        x = concatenate([_slice_axis(x, a, cut, n), _slice_axis(x, a, 0, cut)], axis=a)
    return x


def array_split(x, indices_or_sections, axis=0):
    """numpy.array_split: like `split`, but n sections need not divide the axis (the first
    `size % n` parts get one more element)."""
    if not isinstance(indices_or_sections, int | np.integer):
        return split(x, indices_or_sections, axis)
    sections = int(indices_or_sections)
    if sections <= 0:
        raise FlowjitValueError(f"{user_location()}: array_split needs a positive number of sections")
    n = shape(x)[_norm_axis(axis, ndim(x), "array_split")]
    each, extra = divmod(n, sections)
    bounds = np.cumsum([each + 1] * extra + [each] * (sections - extra))[:-1]
    return split(x, [int(b) for b in bounds], axis)


def hsplit(x, indices_or_sections):
    """numpy.hsplit: split along axis 1 (axis 0 for 1-D arrays)."""
    return split(x, indices_or_sections, axis=1 if ndim(x) > 1 else 0)


def vsplit(x, indices_or_sections):
    """numpy.vsplit: split along axis 0."""
    return split(x, indices_or_sections, axis=0)


def dsplit(x, indices_or_sections):
    """numpy.dsplit: split along axis 2."""
    return split(x, indices_or_sections, axis=2)


# --- indexing ---------------------------------------------------------------------------------------


def take(x, indices, axis=None):
    """numpy.take with in-range semantics: negative indices count from the end; out-of-range
    indices are clamped (never read outside the array)."""
    x = asarray(x)
    if axis is None:
        x, axis = ravel(x), 0
    axis = _norm_axis(axis, ndim(x), "take")
    idx = asarray(indices)
    if not _dtype_of(idx).is_int:
        raise op_error(FlowjitTypeError, user_location(), "gather", f"indices must be integers; found {_dtype_of(idx)}")
    n = shape(x)[axis]
    if isinstance(idx, Tracer):
        idx = where(less(idx, 0), add(idx, n), idx)
    else:
        idx = np.where(idx < 0, idx + n, idx)
    return bind("gather", [x, idx], {"axis": axis})


def scatter_add(x, indices, updates, axis: int = 0):
    """A copy of `x` with `updates` added at `indices` along `axis` (numpy's `np.add.at`, functional).
    Duplicate indices accumulate; negative indices count from the end; out-of-range ones clamp."""
    x = asarray(x)
    axis = _norm_axis(axis, ndim(x), "scatter_add")
    idx = asarray(indices)
    n = shape(x)[axis]
    idx = where(less(idx, 0), add(idx, n), idx) if isinstance(idx, Tracer) else np.where(idx < 0, idx + n, idx)
    target_shape = shape(x)[:axis] + shape(idx) + shape(x)[axis + 1 :]
    upd = broadcast_to(
        astype(updates, _dtype_of(x)) if not _is_python_scalar(updates) else asarray(updates, _dtype_of(x)),
        target_shape,
    )
    return bind("scatter_add", [x, idx, upd], {"axis": axis})


def _linear_along_axis(idx, full_shape, axis: int):
    """Row-major positions in an array of `full_shape` of the elements `idx` picks along `axis`
    (idx has full_shape's other dims): idx * stride[axis] + sum of iota(d) * stride[d]."""
    strides = [math.prod(full_shape[d + 1 :]) for d in range(len(full_shape))]
    linear = multiply(astype(idx, dt.int64), strides[axis])
    for d in range(len(full_shape)):
        if d != axis and full_shape[d] > 1:
            linear = add(linear, multiply(iota(shape(idx), d), strides[d]))
    return linear


def _along_axis_operands(x, indices, axis, op):
    """x and in-range indices broadcast against each other off `axis` (numpy's take_along_axis rule)."""
    x, idx = asarray(x), asarray(indices)
    if not _dtype_of(idx).is_int:
        raise op_error(FlowjitTypeError, user_location(), op, f"indices must be integers; found {_dtype_of(idx)}")
    if ndim(idx) != ndim(x):
        raise op_error(
            FlowjitValueError,
            user_location(),
            op,
            f"indices must have the array's rank {ndim(x)}; found shape {shape(idx)} for an array of shape {shape(x)}",
        )
    axis = _norm_axis(axis, ndim(x), op)
    n = shape(x)[axis]
    idx = _wrap_index(idx, n, axis)
    if isinstance(idx, Tracer):
        idx = minimum(maximum(idx, 0), builtins.max(n - 1, 0))  # clamped, as gather: never another row
    common = list(broadcast_shapes(*(s[:axis] + (1,) + s[axis + 1 :] for s in (shape(x), shape(idx))), op=op))
    x = broadcast_to(x, tuple(common[:axis] + [n] + common[axis + 1 :]))
    idx = broadcast_to(idx, tuple(common[:axis] + [shape(idx)[axis]] + common[axis + 1 :]))
    return x, idx, axis


def take_along_axis(x, indices, axis):
    """numpy.take_along_axis: out[..., i, ...] = x[..., indices[..., i, ...], ...] along `axis`
    (the flattened array when None). Traced indices out of range are clamped."""
    if axis is None:
        x, axis = ravel(x), 0
    x, idx, axis = _along_axis_operands(x, indices, axis, "take_along_axis")
    if size(idx) == 0:
        return zeros(shape(idx), _dtype_of(x))
    linear = _linear_along_axis(idx, shape(x), axis)
    return reshape(bind("gather", [ravel(x), ravel(linear)], {"axis": 0}), shape(idx))


def scatter_add_along_axis(x, indices, updates, axis):
    """A copy of `x` with `updates[..., i, ...]` added at `x[..., indices[..., i, ...], ...]` along
    `axis`: the transpose of `take_along_axis` (duplicates accumulate; traced indices clamp)."""
    target = asarray(x)
    x, idx, axis = _along_axis_operands(x, indices, axis, "scatter_add_along_axis")
    if shape(x) != shape(target):
        raise op_error(FlowjitValueError, user_location(), "scatter_add_along_axis", "indices must not broadcast x")
    upd = broadcast_to(_cast_all([updates], _dtype_of(x))[0], shape(idx))
    if size(idx) == 0:
        return x
    linear = _linear_along_axis(idx, shape(x), axis)
    flat = bind("scatter_add", [ravel(x), ravel(linear), ravel(upd)], {"axis": 0})
    return reshape(flat, shape(x))


def _index_error(message: str) -> FlowjitError:
    return op_error(FlowjitTypeError, user_location(), "getitem", message)


def _index_entries(key, shape_: tuple[int, ...]) -> list:
    """`key` as a list of entries, one per axis plus `None`s: `...` expanded, full slices appended,
    lists as numpy arrays, static integer scalars (numpy's too) as ints, static boolean masks as
    their nonzero() index arrays."""
    key = list(key) if isinstance(key, tuple) else [key]
    entries = []
    for k in key:
        if isinstance(k, list):
            k = np.asarray(k)
        if isinstance(k, Tracer) and _dtype_of(k).is_bool:
            raise _index_error(
                "boolean mask indexing with a traced mask gives a data-dependent shape; use "
                "fnp.where(mask, x, 0), or fnp.nonzero(mask, size=n) for indices of a fixed count, or a "
                "numpy (static) mask"
            )
        if isinstance(k, np.ndarray) and k.dtype == np.bool_:
            if k.ndim == 0:
                raise _index_error("0-d boolean indices are not supported; use x[None] or fnp.where")
            entries.append(_Mask(k))
            continue
        if isinstance(k, Tracer | np.ndarray | np.generic) and not _dtype_of(k).is_int:
            raise _index_error(f"array indices must be integers; found {_dtype_of(k)}")
        if isinstance(k, np.ndarray | np.generic) and np.ndim(k) == 0:
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, int | slice | np.ndarray | Tracer | type(None) | type(...)):
            raise _index_error(f"unsupported index {k!r}; use ints, slices, None, ... or integer arrays")
        entries.append(k)
    ellipses = [i for i, k in enumerate(entries) if k is Ellipsis]
    if len(ellipses) > 1:
        raise _index_error("an index can only have a single ellipsis ('...')")
    used = builtins.sum(
        k.mask.ndim if isinstance(k, _Mask) else 1 for k in entries if k is not None and k is not Ellipsis
    )
    if used > len(shape_):
        raise _index_error(f"too many indices for an array of rank {len(shape_)}: {used}")
    fill = [slice(None)] * (len(shape_) - used)
    if ellipses:
        entries = entries[: ellipses[0]] + fill + entries[ellipses[0] + 1 :]
    else:
        entries = entries + fill
    return _expand_masks(entries, shape_)


class _Mask:
    """A static (numpy) boolean index while the key is parsed: it stands for `mask.ndim` axes."""

    def __init__(self, mask: np.ndarray):
        self.mask = mask


def _expand_masks(entries: list, shape_: tuple[int, ...]) -> list:
    """Each static boolean mask becomes its `nonzero()` integer arrays, as numpy does."""
    out, axis = [], 0
    for k in entries:
        if not isinstance(k, _Mask):
            out.append(k)
            axis += k is not None
            continue
        covered = shape_[axis : axis + k.mask.ndim]
        if k.mask.shape != covered:
            raise _index_error(
                f"boolean index of shape {k.mask.shape} does not match the indexed axes {axis}.. of shape {covered}"
            )
        out.extend(k.mask.nonzero())
        axis += k.mask.ndim
    return out


def _wrap_index(idx, n: int, axis: int):
    """Negative indices count from the end. Static ones must be in range (numpy raises); traced
    ones are clamped into range by `gather`, never read outside the array."""
    if isinstance(idx, Tracer):
        return where(less(idx, 0), add(idx, n), idx)
    idx = np.asarray(idx, np.int64)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        bad = idx[(idx < -n) | (idx >= n)].flat[0]
        raise op_error(
            FlowjitValueError, user_location(), "getitem", f"index {bad} is out of bounds for axis {axis} with size {n}"
        )
    return np.where(idx < 0, idx + n, idx)


def getitem(x, key):
    """x[key] with numpy semantics: ints (negative count from the end), slices with any step,
    None, ... and integer arrays (advanced indexing, including traced indices; traced indices out
    of range are clamped). Ints combined with arrays are advanced indices, as in numpy.

    Algorithm:
      1. Apply every slice (a strided `slice`, or a `gather` of the positions for negative steps).
      2. Without array indices: ints become size-1 slices; one reshape drops them and adds Nones.
      3. With array indices (ints included): gather them as one linearized index over their axes,
         giving (broadcast index dims, remaining axes); when the array indices are adjacent in the
         key, the index dims move to where the first one was (numpy's rule); Nones are added last.
    """
    x = asarray(x)
    entries = _index_entries(key, shape(x))
    advanced = builtins.any(isinstance(k, np.ndarray | Tracer) for k in entries)
    axis_of = {}  # entry position -> axis of x
    start, limit, stride = [0] * ndim(x), list(shape(x)), [1] * ndim(x)
    reversed_axes = []
    for pos, k in enumerate(entries):
        if k is None:
            continue
        axis = axis_of[pos] = len(axis_of)
        n = shape(x)[axis]
        if isinstance(k, slice):
            lo, hi, st = k.indices(n)
            if st < 0:
                reversed_axes.append((axis, np.arange(lo, hi, st)))
            else:
                start[axis], limit[axis], stride[axis] = lo, builtins.max(lo, hi), st
        elif isinstance(k, int) and not advanced:
            k = int(_wrap_index(k, n, axis))
            start[axis], limit[axis] = k, k + 1
    if (start, limit, stride) != ([0] * ndim(x), list(shape(x)), [1] * ndim(x)):
        x = bind("slice", [x], {"start": start, "limit": limit, "stride": stride})
    for axis, positions in reversed_axes:
        x = bind("gather", [x, positions], {"axis": axis})
    if not advanced:
        out = [1 if k is None else shape(x)[axis_of[p]] for p, k in enumerate(entries) if not isinstance(k, int)]
        return reshape(x, out)
    return _advanced_index(x, entries, axis_of)


def _advanced_index(x, entries, axis_of):
    """Step 3 of `getitem`: `entries` holds Nones, slices (already applied) and array indices."""
    adv_positions = [p for p, k in enumerate(entries) if k is not None and not isinstance(k, slice)]
    adv_axes = [axis_of[p] for p in adv_positions]
    idxs = [_wrap_index(entries[p], shape(x)[axis_of[p]], axis_of[p]) for p in adv_positions]
    bshape = broadcast_shapes(*(shape(i) for i in idxs), op="getitem")
    adjacent = adv_positions == list(range(adv_positions[0], adv_positions[-1] + 1))
    if len(idxs) == 1:  # gather in place: (axes before, index dims, axes after)
        gathered = bind("gather", [x, idxs[0]], {"axis": adv_axes[0]})
    else:
        gathered = _gather_linearized(x, adv_axes, idxs, bshape)
    if len(idxs) > 1 and adjacent:  # move the index dims to where the first index was
        before = builtins.sum(1 for p in range(adv_positions[0]) if entries[p] is not None)
        nb = len(bshape)
        gathered = transpose(gathered, [*range(nb, nb + before), *range(nb), *range(nb + before, ndim(gathered))])
    out = []
    for p, k in enumerate(entries):
        if k is None:
            out.append(1)
        elif isinstance(k, slice):
            out.append(shape(x)[axis_of[p]])
        elif adjacent and p == adv_positions[0]:
            out.extend(bshape)
    return reshape(gathered, out if adjacent else list(bshape) + out)


def _gather_linearized(x, axes, idxs, bshape):
    """Gather by several index arrays at once: one row-major index over `axes` moved to the front
    and flattened. The result has dims (bshape, remaining axes of x in order)."""
    rest = [a for a in range(ndim(x)) if a not in axes]
    sizes = [shape(x)[a] for a in axes]
    if math.prod(bshape) and not math.prod(sizes):
        raise op_error(FlowjitValueError, user_location(), "getitem", "cannot index into an axis of size 0")
    linear = None
    for i, idx in enumerate(idxs):
        term, step = astype(idx, dt.int64), math.prod(sizes[i + 1 :])
        term = multiply(term, step) if step != 1 else term
        linear = term if linear is None else add(linear, term)
    flat = reshape(transpose(x, axes + rest), (math.prod(sizes),) + tuple(shape(x)[a] for a in rest))
    return bind("gather", [flat, broadcast_to(linear, bshape)], {"axis": 0})


def dynamic_slice(x, start_indices, sizes):
    """x[start:start+size] per dimension with runtime starts, clamped so the window fits."""
    x = asarray(x)
    starts = [astype(s, dt.int64) if not isinstance(s, int) else np.asarray(s, np.int64) for s in start_indices]
    return bind("dynamic_slice", [x, *starts], {"sizes": tuple(int(s) for s in sizes)})
