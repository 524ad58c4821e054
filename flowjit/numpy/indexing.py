"""Indexing: take and scatter_add (along an axis or by index arrays), take_along_axis, `x[key]`
(`getitem`: basic, advanced and boolean-mask indices), dynamic_slice, and diagonals (diagonal,
diag)."""

from __future__ import annotations

import builtins
import math

import numpy as np

from flowjit.errors import FlowjitError, FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer, bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.creation import _masked, iota, zeros
from flowjit.numpy.elementwise import (
    add,
    equal,
    less,
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
)
from flowjit.numpy.shapes import _norm_axis, ndim, pad, ravel, reshape, shape, size, transpose


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
