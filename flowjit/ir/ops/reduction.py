"""Reductions over axes (sum, max, min, prod), argmax/argmin, running sums (cumsum) and windowed
reductions (pooling).

Reduced axes are removed from the result (the frontend reshapes for `keepdims`). Empty reductions
give the identity: 0 for sum, 1 for prod, -inf/+inf (or the integer extremes) for max/min.
"""

from __future__ import annotations

import numpy as np

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import REDUCTION, WINDOW, defop
from flowjit.ir.ops.rules import check_axes, check_axis, check_dtype, int_tuple
from flowjit.ir.types import TensorType


def _reduce_rule(types, attrs):
    (x,) = types
    check_dtype(x, dt.NUMERIC_DTYPES)
    axes = check_axes(int_tuple(attrs["axes"], "axes"), x.rank)
    return [x.with_shape(tuple(d for i, d in enumerate(x.shape) if i not in axes))]


def reduction_identity(kind: str, dtype: dt.DType):
    """The value an empty reduction of `kind` returns (also the accumulator's initial value)."""
    if kind == "sum":
        return 0
    if kind == "prod":
        return 1
    if dtype.is_float:
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dtype.np_dtype)
    return info.min if kind == "max" else info.max


def _reducer(kind, fn):
    def impl(x, *, axes):
        axes = tuple(axes)
        if x.size == 0 or not axes:
            if not axes:
                return x.copy()
            shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
            return np.full(shape, reduction_identity(kind, dt.dtype(x.dtype)), x.dtype)
        acc = x.astype(np.float32) if x.dtype in (dt.float16.np_dtype, dt.bfloat16.np_dtype) else x
        return np.asarray(fn(acc, axis=axes)).astype(x.dtype)

    return impl


for _kind, _fn in (("sum", np.sum), ("max", np.max), ("min", np.min), ("prod", np.prod)):
    defop(
        f"reduce_{_kind}",
        REDUCTION,
        _reduce_rule,
        _reducer(_kind, _fn),
        1,
        attrs=("axes",),
        doc=f"{_kind} over `axes` (removed from the result); half types accumulate in f32",
    )


def _arg_rule(types, attrs):
    (x,) = types
    check_dtype(x, dt.NUMERIC_DTYPES)
    if x.rank == 0:
        raise ShapeError("needs an operand of rank >= 1")
    axis = check_axis(attrs["axis"], x.rank)
    if x.shape[axis] == 0:
        raise ShapeError(f"axis {axis} has size 0: an empty argmax/argmin has no answer")
    index_dtype = dt.dtype(attrs["index_dtype"])
    if not index_dtype.is_int:
        raise ShapeError(f"index_dtype must be an integer dtype; found {index_dtype}")
    return [TensorType(x.shape[:axis] + x.shape[axis + 1 :], index_dtype)]


for _name, _fn in (("argmax", np.argmax), ("argmin", np.argmin)):
    defop(
        _name,
        REDUCTION,
        _arg_rule,
        (lambda fn: lambda x, *, axis, index_dtype: fn(x, axis=axis).astype(dt.dtype(index_dtype).np_dtype))(_fn),
        1,
        attrs=("axis", "index_dtype"),
        doc="index of the first extreme along `axis` (a nan counts as the extreme, as in numpy)",
    )


# --- running sums ---------------------------------------------------------------------------------

# The dtypes `cumsum` takes: the frontend (`flowjit.numpy.cumsum`) sums bools as int64 and half
# types in float32, rounding each running sum once, as half-type reductions accumulate.
CUMSUM_DTYPES = (dt.int32, dt.int64, dt.float32, dt.float64)


def _cumsum_rule(types, attrs):
    (x,) = types
    check_dtype(x, CUMSUM_DTYPES)
    if x.rank == 0:
        raise ShapeError("needs an operand of rank >= 1 (reshape a scalar to (1,) first)")
    check_axis(attrs["axis"], x.rank)
    if not isinstance(attrs["reverse"], (bool, np.bool_)):
        raise ShapeError(f"'reverse' must be true or false; found {attrs['reverse']!r}")
    return [x]


def _cumsum(x, *, axis, reverse):
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis=axis, dtype=x.dtype), axis)
    return np.cumsum(x, axis=axis, dtype=x.dtype)


defop(
    "cumsum",
    REDUCTION,
    _cumsum_rule,
    _cumsum,
    1,
    attrs=("axis", "reverse"),
    doc="running sum along `axis`, element by element in order (numpy's sequential sum: an inf or nan "
    "changes the sums from its position on); from the end of the axis when `reverse`",
)


def _recurrence_rule(types, attrs):
    a, b = types
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ShapeError(f"needs operands of one shape and dtype; found {a} and {b}")
    return _cumsum_rule([b], attrs)


def _recurrence(a, b, *, axis, reverse):
    """h[0] = b[0], h[i] = a[i] * h[i-1] + b[i] along `axis` (multiply, then add: two roundings)."""
    order = range(a.shape[axis] - 1, -1, -1) if reverse else range(a.shape[axis])
    out = np.empty_like(b)
    h = None
    for i in order:
        at = (slice(None),) * axis + (i,)
        h = b[at] if h is None else a[at] * h + b[at]
        out[at] = h
    return out


defop(
    "linear_recurrence",
    REDUCTION,
    _recurrence_rule,
    _recurrence,
    2,
    attrs=("axis", "reverse"),
    doc="h[0] = b[0], h[i] = a[i] * h[i-1] + b[i] along `axis` (from the end when `reverse`), a multiply "
    "then an add per element: cumprod is a = x, b = x at the first position and -0.0 after it (bit for "
    "bit numpy's), and the op's gradient is itself run the other way",
)


# --- windowed reductions --------------------------------------------------------------------------

WINDOW_KINDS = ("max", "sum", "avg")


def _window_rule(types, attrs):
    (x,) = types
    check_dtype(x, dt.NUMERIC_DTYPES)
    kind = attrs["kind"]
    if kind not in WINDOW_KINDS:
        raise ShapeError(f"kind must be one of {WINDOW_KINDS}; found {kind!r}")
    if kind == "avg" and not x.dtype.is_float:
        raise ShapeError(f"avg pooling needs a float operand; found {x.dtype}")
    window = int_tuple(attrs["window"], "window", x.rank)
    strides = int_tuple(attrs["strides"], "strides", x.rank)
    padding = attrs["padding"]
    if len(padding) != x.rank:
        raise ShapeError(f"'padding' needs {x.rank} (low, high) pairs; found {len(padding)}")
    shape = []
    for i, (d, w, s, (lo, hi)) in enumerate(zip(x.shape, window, strides, padding)):
        if w < 1 or s < 1 or lo < 0 or hi < 0:
            raise ShapeError(f"dimension {i}: window {w}, stride {s}, padding ({lo},{hi}) must be positive")
        span = d + lo + hi - w
        if span < 0:
            raise ShapeError(f"dimension {i}: window {w} is larger than the padded size {d + lo + hi}")
        shape.append(span // s + 1)
    return [x.with_shape(shape)]


def _reduce_window(x, *, kind, window, strides, padding):
    pad_value = reduction_identity("max", dt.dtype(x.dtype)) if kind == "max" else 0
    acc_dtype = np.float32 if x.dtype in (dt.float16.np_dtype, dt.bfloat16.np_dtype) else x.dtype
    padded = np.pad(x.astype(acc_dtype), [tuple(p) for p in padding], constant_values=pad_value)
    views = np.lib.stride_tricks.sliding_window_view(padded, tuple(window))
    views = views[tuple(slice(None, None, s) for s in strides)]
    axes = tuple(range(x.ndim, 2 * x.ndim))
    if kind == "max":
        out = views.max(axis=axes)
    else:
        out = views.sum(axis=axes)
        if kind == "avg":
            out = out / np.prod(window)
    return np.asarray(out).astype(x.dtype)


defop(
    "reduce_window",
    WINDOW,
    _window_rule,
    _reduce_window,
    1,
    attrs=("kind", "window", "strides", "padding"),
    doc="max/sum/avg over sliding windows; avg divides by the full window size (padding counts)",
)
