"""numpy-compatible functions that work on traced values and on plain arrays alike.

Broadcasting and dtype promotion follow numpy, with two deliberate ML-friendly differences (as in
JAX): Python scalars are *weak* (`float32 * 2.0` stays float32), and a lone Python float becomes
float32 (a lone int becomes int64, as in numpy). On plain numpy arrays these functions compute with
flowjit's reference implementations, so results match what compiled code returns.
"""

from __future__ import annotations

import builtins
import math
import string
from collections.abc import Sequence

import numpy as np

from flowjit.errors import FlowjitError, FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer, bind, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location

ndarray = np.ndarray
pi, e, inf, nan, newaxis = np.pi, np.e, np.inf, np.nan, None
float16, float32, float64, int32, int64 = np.float16, np.float32, np.float64, np.int32, np.int64
bool_ = np.bool_
bfloat16 = dt.bfloat16.np_dtype.type

_SCALARS = (bool, int, float)


def _is_python_scalar(x) -> bool:
    """A weak Python scalar. np.float64 subclasses float but is a typed numpy scalar (strong, NEP 50)."""
    return isinstance(x, _SCALARS) and not isinstance(x, np.generic)


# --- conversion, promotion and broadcasting ---------------------------------------------------------


def _is_array(x) -> bool:
    return isinstance(x, Tracer | np.ndarray | np.generic)


def _dtype_of(x) -> dt.DType:
    if isinstance(x, Tracer):
        return x.value.type.dtype
    if _is_python_scalar(x):
        return dt.default_for_kind(_scalar_kind(x))
    array = np.asarray(x)  # unsupported dtypes (uint8, int16) take asarray's conversion; complex is an error
    return dt.dtype(array.dtype) if dt.is_supported_numpy_dtype(array.dtype) else dt.dtype(asarray(x).dtype)


def _scalar_kind(x) -> str:
    return "b" if isinstance(x, bool) else "i" if isinstance(x, int) else "f"


def asarray(x, dtype=None):
    """`x` as a Tracer or numpy array of a flowjit dtype (lists, scalars and arrays accepted)."""
    if isinstance(x, Tracer):
        return x if dtype is None else astype(x, dtype)
    if _is_python_scalar(x) and dtype is None:
        return np.asarray(x, dt.default_for_kind(_scalar_kind(x)).np_dtype)
    if isinstance(x, (list, tuple)) and builtins.any(isinstance(v, Tracer) for v in _flat(x)):
        return stack([asarray(v, dtype) for v in x])
    array = np.asarray(x)
    if dtype is not None:
        return array.astype(dt.dtype(dtype).np_dtype)
    if array.dtype == np.float64 and not isinstance(x, np.ndarray | np.generic):
        array = array.astype(np.float32)  # Python float literals in lists follow the float32 default
    if not dt.is_supported_numpy_dtype(array.dtype):
        array = array.astype(dt.dtype(array.dtype.kind == "f" and "f32" or _np_fallback(array.dtype)).np_dtype)
    return array


array = asarray


def _np_fallback(np_dt) -> str:
    kind = np.dtype(np_dt).kind
    if kind == "b":
        return "bool"
    if kind in "iu":
        return "i64"
    raise FlowjitTypeError(f"{user_location()}: arrays of dtype {np_dt} are not supported")


def _flat(x):
    for v in x:
        if isinstance(v, (list, tuple)):
            yield from _flat(v)
        else:
            yield v


def result_type(*xs) -> dt.DType:
    """The promoted dtype of operands, treating Python scalars as weak."""
    strong = [_dtype_of(x) for x in xs if not _is_python_scalar(x)]
    weak = [_scalar_kind(x) for x in xs if _is_python_scalar(x)]
    if not strong:
        rank = {"b": 0, "i": 1, "f": 2}
        return dt.default_for_kind(builtins.max(weak, key=rank.__getitem__))
    out = strong[0]
    for d in strong[1:]:
        out = dt.promote(out, d)
    for kind in weak:
        out = dt.promote_weak(out, kind)
    return out


def astype(x, dtype):
    """Convert to `dtype` (float -> int truncates and saturates; nan -> 0)."""
    target = dt.dtype(dtype)
    x = asarray(x)
    if _dtype_of(x) is target:
        return x
    return bind("convert", [x], {"dtype": target})


def _cast_all(xs, dtype: dt.DType):
    return [_weak_scalar(x, dtype) if _is_python_scalar(x) else astype(x, dtype) for x in xs]


def _weak_scalar(x, dtype: dt.DType) -> np.ndarray:
    """A Python scalar in the dtype of the array it meets; an int that does not fit is an error,
    as in numpy (`int32_array + 2**40` raises rather than wrapping)."""
    if dtype.is_int and isinstance(x, int) and not isinstance(x, bool):
        info = np.iinfo(dtype.np_dtype)
        if not info.min <= x <= info.max:
            raise op_error(
                FlowjitValueError,
                user_location(),
                "convert",
                f"Python integer {x} is out of bounds for {dtype.np_dtype.name}; convert the array to a wider "
                "dtype first (x.astype('int64'))",
            )
    return asarray(x, dtype)


def broadcast_shapes(*shapes, op: str = "broadcast") -> tuple[int, ...]:
    rank = builtins.max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(sizes) > 1:
            found = " and ".join(str(tuple(s)) for s in shapes)
            raise op_error(
                FlowjitTypeError, user_location(), op, f"operands could not be broadcast together: shapes {found}"
            )
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def broadcast_to(x, shape):
    """numpy.broadcast_to: new dims on the left, size-1 dims stretched."""
    x = asarray(x)
    shape = tuple(int(d) for d in shape)
    if tuple(x.shape) == shape:
        return x
    if len(x.shape) > len(shape):
        raise op_error(
            FlowjitTypeError, user_location(), "broadcast", f"cannot broadcast shape {tuple(x.shape)} to {shape}"
        )
    dims = tuple(range(len(shape) - len(x.shape), len(shape)))
    trace = current_trace()
    if trace is not None and not isinstance(x, Tracer):
        # Keep literals small: broadcast a traced constant rather than baking a full-size literal.
        x = Tracer(trace.lift(x), trace)
    return bind("broadcast", [x], {"shape": shape, "dims": dims})


# numpy's arithmetic on bools is logic: True + True is True, True * False is False.
_BOOL_ARITHMETIC = {"add": "logical_or", "mul": "logical_and", "max": "logical_or", "min": "logical_and"}


def _elementwise(name: str, *xs, dtype: dt.DType | None = None):
    """Promote to a common dtype (or `dtype`), broadcast, and apply op `name`."""
    target = dtype or result_type(*xs)
    if target.is_bool:
        name = _BOOL_ARITHMETIC.get(name, name)
    arrays = _cast_all(xs, target)
    shape = broadcast_shapes(*(np.shape(a) if not isinstance(a, Tracer) else a.shape for a in arrays), op=name)
    return bind(name, [broadcast_to(a, shape) for a in arrays])


def _float_operand(x):
    """Integers and bools become float32 before float math (numpy would use float64)."""
    x = asarray(x)
    return x if _dtype_of(x).is_float else astype(x, dt.float32)


# --- elementwise math -------------------------------------------------------------------------------


def _unary_float(name):
    def fn(x):
        return bind(name, [_float_operand(x)])

    fn.__name__ = name
    fn.__doc__ = f"Elementwise {name} (ints and bools are converted to float32 first)."
    return fn


exp, log, log1p, expm1, tanh, sqrt, sin, cos, floor, ceil = (
    _unary_float(n) for n in ("exp", "log", "log1p", "expm1", "tanh", "sqrt", "sin", "cos", "floor", "ceil")
)
erf = _unary_float("erf")
rsqrt = _unary_float("rsqrt")
logistic = _unary_float("logistic")


def round(x, decimals: int = 0):  # noqa: A001
    """Round half to even (numpy.round); `decimals` scales by 10**decimals. Integers round to
    multiples of 10**-decimals when `decimals` is negative, as in numpy."""
    x = asarray(x)
    kind = _dtype_of(x)
    if not kind.is_float:
        if decimals >= 0:
            return x
        scale = 10.0**-decimals  # numpy divides in float64, rounds, multiplies, casts back
        return astype(multiply(bind("round", [divide(astype(x, dt.float64), scale)]), scale), kind)
    if decimals == 0:
        return bind("round", [x])
    scale = 10.0**decimals
    return divide(bind("round", [multiply(x, scale)]), scale)


around = round


def negative(x):
    x = asarray(x)
    return bind("logical_not", [x]) if _dtype_of(x).is_bool else bind("neg", [x])


def abs(x):  # noqa: A001
    x = asarray(x)
    return x if _dtype_of(x).is_bool else bind("abs", [x])


absolute = abs


def sign(x):
    return bind("sign", [asarray(x)])


def exp2(x):
    return exp(_float_operand(x) * math.log(2.0))


def log2(x):
    return log(x) * (1.0 / math.log(2.0))


def log10(x):
    return log(x) * (1.0 / math.log(10.0))


def square(x):
    return multiply(x, x)


def reciprocal(x):
    return divide(1.0, x)


def tan(x):
    x = _float_operand(x)
    return sin(x) / cos(x)


def sinh(x):
    x = _float_operand(x)
    return (exp(x) - exp(-x)) * 0.5


def cosh(x):
    x = _float_operand(x)
    return (exp(x) + exp(-x)) * 0.5


def add(x, y):
    return _elementwise("add", x, y)


def subtract(x, y):
    return _elementwise("sub", x, y)


def multiply(x, y):
    return _elementwise("mul", x, y)


def true_divide(x, y):
    """x / y in floating point (ints and bools become float32, as numpy's true division)."""
    target = result_type(x, y)
    if not target.is_float:
        target = dt.float32
    return _elementwise("div", x, y, dtype=target)


divide = true_divide


def floor_divide(x, y):
    """x // y rounding toward -inf, exactly as numpy (`1.0 // 0.1 == 9.0`); integer x // 0 is 0,
    float x // 0 is x / 0."""
    target = result_type(x, y)
    x, y = _cast_all([x, y], target)
    r = _elementwise("rem", x, y)
    if not target.is_float:
        q = _elementwise("div", x, y)
        return where(_needs_sign_fix(r, y), subtract(q, 1), q)
    # numpy's npy_divmod: divide the exact multiple, fix the sign, round the quotient to nearest.
    q = divide(subtract(x, r), y)
    q = where(_needs_sign_fix(r, y), subtract(q, 1), q)
    whole = floor(q)
    whole = where(greater(subtract(q, whole), 0.5), add(whole, 1), whole)
    ratio = divide(x, y)
    whole = where(equal(q, 0), multiply(ratio, 0), whole)  # zero with the sign of x / y
    return where(equal(y, 0), ratio, whole)


def _needs_sign_fix(r, y):
    """Where a truncated remainder `r` and the divisor disagree in sign (numpy's floor rule)."""
    return logical_and(not_equal(r, 0), not_equal(less(r, 0), less(y, 0)))


def remainder(x, y):
    """x % y with the sign of y, as numpy; integer x % 0 is 0."""
    target = result_type(x, y)
    x, y = _cast_all([x, y], target)
    r = _elementwise("rem", x, y)
    r = where(_needs_sign_fix(r, y), add(r, y), r)
    if target.is_float:
        # A zero remainder takes the divisor's sign, as in numpy: -3.0 % 3.0 is +0.0, not -0.0.
        r = where(equal(r, 0), multiply(abs(r), sign(y)), r)
    return r


mod = remainder


def fmod(x, y):
    return _elementwise("rem", x, y)


def power(x, y):
    return _elementwise("pow", x, y)


def maximum(x, y):
    return _elementwise("max", x, y)


def minimum(x, y):
    return _elementwise("min", x, y)


def arctan2(y, x):
    target = result_type(y, x)
    return _elementwise("atan2", y, x, dtype=target if target.is_float else dt.float32)


def _compare(name):
    def fn(x, y):
        return _elementwise(name, x, y)

    fn.__name__ = name
    return fn


equal, not_equal, less, less_equal, greater, greater_equal = (_compare(n) for n in ("eq", "ne", "lt", "le", "gt", "ge"))


def logical_and(x, y):
    return _elementwise("logical_and", x, y, dtype=dt.bool_)


def logical_or(x, y):
    return _elementwise("logical_or", x, y, dtype=dt.bool_)


def logical_xor(x, y):
    return _elementwise("logical_xor", x, y, dtype=dt.bool_)


def logical_not(x):
    return bind("logical_not", [astype(x, dt.bool_)])


def where(condition, x, y):
    """Elementwise `x if condition else y`, broadcasting all three."""
    cond = astype(condition, dt.bool_)
    target = result_type(x, y)
    xs = _cast_all([x, y], target)
    shape = broadcast_shapes(
        np.shape(cond) if not isinstance(cond, Tracer) else cond.shape, *(a.shape for a in xs), op="select"
    )
    return bind("select", [broadcast_to(cond, shape)] + [broadcast_to(a, shape) for a in xs])


def clip(x, a_min=None, a_max=None):
    if a_min is not None:
        x = maximum(x, a_min)
    if a_max is not None:
        x = minimum(x, a_max)
    return x


def isnan(x):
    x = asarray(x)
    return not_equal(x, x) if _dtype_of(x).is_float else zeros_like(x, dtype=bool)


def isinf(x):
    x = asarray(x)
    return equal(abs(x), inf) if _dtype_of(x).is_float else zeros_like(x, dtype=bool)


def isfinite(x):
    return logical_not(logical_or(isnan(x), isinf(x)))


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


def iota(shape, dimension=0, dtype="i64"):
    """0, 1, 2, ... along `dimension` of a new array of `shape` (as an op, never a big constant)."""
    return bind("iota", [], {"shape": _shape_tuple(shape), "dimension": dimension, "dtype": dt.dtype(dtype)})


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


def pad(x, pad_width, mode="constant", constant_values=0):
    if mode != "constant":
        raise FlowjitValueError(f"{user_location()}: pad supports mode='constant' only; found {mode!r}")
    x = asarray(x)
    rank = ndim(x)
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (rank, 2))  # numpy's pad_width rule
    value = (
        asarray(constant_values, _dtype_of(x))
        if not isinstance(constant_values, Tracer)
        else astype(constant_values, _dtype_of(x))
    )
    return bind(
        "pad",
        [x, value],
        {
            "low": tuple(int(w) for w in widths[:, 0]),
            "high": tuple(int(w) for w in widths[:, 1]),
            "interior": (0,) * rank,
        },
    )


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


def _index_error(message: str) -> FlowjitError:
    return op_error(FlowjitTypeError, user_location(), "getitem", message)


def _index_entries(key, rank: int) -> list:
    """`key` as a list of entries, one per axis plus `None`s: `...` expanded, full slices appended,
    lists as numpy arrays, static integer scalars (numpy's too) as ints."""
    key = list(key) if isinstance(key, tuple) else [key]
    entries = []
    for k in key:
        if isinstance(k, list):
            k = np.asarray(k)
        if isinstance(k, Tracer | np.ndarray) and _dtype_of(k).is_bool:
            raise _index_error("boolean mask indexing gives a data-dependent shape; use fnp.where(mask, x, 0) instead")
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
    used = builtins.sum(1 for k in entries if k is not None and k is not Ellipsis)
    if used > rank:
        raise _index_error(f"too many indices for an array of rank {rank}: {used}")
    fill = [slice(None)] * (rank - used)
    if ellipses:
        return entries[: ellipses[0]] + fill + entries[ellipses[0] + 1 :]
    return entries + fill


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
    entries = _index_entries(key, ndim(x))
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
    return moveaxis(matmul(moved, tri), -1, axis)


# --- contractions -----------------------------------------------------------------------------------


def matmul(a, b):
    """numpy.matmul: 1-D operands are promoted to matrices; batch dims broadcast."""
    target = result_type(a, b)
    a, b = _cast_all([a, b], target)
    if target.is_bool:  # numpy: a logical or of ands
        return not_equal(matmul(astype(a, dt.int32), astype(b, dt.int32)), 0)
    sa, sb = shape(a), shape(b)
    if not sa or not sb:
        raise op_error(
            FlowjitTypeError,
            user_location(),
            "matmul",
            f"operands must have rank >= 1; found shapes {sa} and {sb} (use * for scalars)",
        )
    a2 = reshape(a, (1,) + sa) if len(sa) == 1 else a
    b2 = reshape(b, sb + (1,)) if len(sb) == 1 else b
    sa2, sb2 = shape(a2), shape(b2)
    if sa2[-1] != sb2[-2]:
        raise op_error(
            FlowjitTypeError,
            user_location(),
            "matmul",
            f"contracting dimension mismatch: {sa} @ {sb}: {sa2[-1]} != {sb2[-2]}",
        )
    batch = broadcast_shapes(sa2[:-2], sb2[:-2], op="matmul")
    a3 = broadcast_to(a2, batch + sa2[-2:])
    b3 = broadcast_to(b2, batch + sb2[-2:])
    nb = len(batch)
    out = bind(
        "dot_general",
        [a3, b3],
        {
            "lhs_contract": (nb + 1,),
            "rhs_contract": (nb,),
            "lhs_batch": tuple(range(nb)),
            "rhs_batch": tuple(range(nb)),
        },
    )
    final = batch + ((sa2[-2],) if len(sa) > 1 else ()) + ((sb2[-1],) if len(sb) > 1 else ())
    return reshape(out, final) if final != shape(out) else out


def dot(a, b):
    """numpy.dot for the common cases: scalars multiply, otherwise contract a's last axis with b's
    second-to-last (b's only axis when 1-D)."""
    if ndim(a) == 0 or ndim(b) == 0:
        return multiply(a, b)
    if ndim(b) <= 2:
        return matmul(a, b)
    return tensordot(a, b, axes=([ndim(a) - 1], [ndim(b) - 2]))


def tensordot(a, b, axes=2):
    target = result_type(a, b)
    a, b = _cast_all([a, b], target)
    if isinstance(axes, int):
        ax_a = list(range(ndim(a) - axes, ndim(a)))
        ax_b = list(range(axes))
    else:
        ax_a = [_norm_axis(x, ndim(a)) for x in (axes[0] if not isinstance(axes[0], int) else [axes[0]])]
        ax_b = [_norm_axis(x, ndim(b)) for x in (axes[1] if not isinstance(axes[1], int) else [axes[1]])]
    for x, y in zip(ax_a, ax_b):
        if shape(a)[x] != shape(b)[y]:
            raise op_error(
                FlowjitTypeError,
                user_location(),
                "tensordot",
                f"shape mismatch: {shape(a)} axis {x} vs {shape(b)} axis {y}",
            )
    return bind("dot_general", [a, b], {"lhs_contract": ax_a, "rhs_contract": ax_b, "lhs_batch": (), "rhs_batch": ()})


def inner(a, b):
    return tensordot(a, b, axes=([ndim(a) - 1], [ndim(b) - 1]))


def outer(a, b):
    return multiply(reshape(ravel(a), (-1, 1)), reshape(ravel(b), (1, -1)))


def vdot(a, b):
    return sum(multiply(ravel(a), ravel(b)))


def einsum(subscripts: str, *operands):
    """einsum for one or two operands without repeated indices inside one operand, e.g.
    'ij,jk->ik', 'bij,bjk->bik', 'ij->ji', 'ij->', 'i,i->', 'ij,j->i'."""
    spec = subscripts.replace(" ", "")
    if "->" in spec:
        inputs, output = spec.split("->")
    else:
        inputs = spec
        letters = [c for c in inputs.replace(",", "")]
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    terms = inputs.split(",")
    if len(terms) != len(operands) or len(terms) not in (1, 2):
        raise FlowjitValueError(f"{user_location()}: einsum supports one or two operands; got {subscripts!r}")
    for t, x in zip(terms, operands):
        if len(set(t)) != len(t) or len(t) != ndim(x) or not builtins.all(c in string.ascii_letters for c in t):
            raise FlowjitValueError(
                f"{user_location()}: einsum term {t!r} does not fit an operand of shape {shape(x)} "
                "(repeated or '...' indices are not supported)"
            )
    xs = [asarray(x) for x in operands]
    # Sum away indices that appear in one operand only and not in the output.
    for i, t in enumerate(terms):
        others = "".join(terms[:i] + terms[i + 1 :]) + output
        drop = [j for j, c in enumerate(t) if c not in others]
        if drop:
            xs[i] = sum(xs[i], axis=tuple(drop))
            terms[i] = "".join(c for c in t if c in others)
    if len(terms) == 1:
        return transpose(xs[0], [terms[0].index(c) for c in output])
    ta, tb = terms
    target = result_type(*xs)
    a, b = _cast_all(xs, target)
    batch = [c for c in ta if c in tb and c in output]
    contract = [c for c in ta if c in tb and c not in output]
    out = bind(
        "dot_general",
        [a, b],
        {
            "lhs_contract": [ta.index(c) for c in contract],
            "rhs_contract": [tb.index(c) for c in contract],
            "lhs_batch": [ta.index(c) for c in batch],
            "rhs_batch": [tb.index(c) for c in batch],
        },
    )
    produced = (
        batch
        + [c for c in ta if c not in batch and c not in contract]
        + [c for c in tb if c not in batch and c not in contract]
    )
    return transpose(out, [produced.index(c) for c in output])


# --- bitwise -----------------------------------------------------------------------------------------


def _bitwise(name: str, x, y):
    target = result_type(x, y)
    if target.is_float:
        raise op_error(FlowjitTypeError, user_location(), name, f"needs integer or bool operands; found {target}")
    return _elementwise(name, x, y, dtype=target)


def bitwise_and(x, y):
    """x & y (logical for bools)."""
    return _bitwise("bitwise_and", x, y)


def bitwise_or(x, y):
    """x | y (logical for bools)."""
    return _bitwise("bitwise_or", x, y)


def bitwise_xor(x, y):
    """x ^ y (logical for bools)."""
    return _bitwise("bitwise_xor", x, y)


def invert(x):
    """~x: bitwise not of integers, logical not of bools."""
    x = asarray(x)
    if _dtype_of(x).is_float:
        raise op_error(FlowjitTypeError, user_location(), "bitwise_not", "needs an integer or bool operand")
    return bind("bitwise_not", [x])


bitwise_not = invert


def left_shift(x, y):
    """x << y on integers (0 once y reaches the bit width)."""
    return _bitwise("shift_left", x, y)


def right_shift(x, y):
    """x >> y: arithmetic (sign-filling) for signed integers, as numpy."""
    return _bitwise("shift_right_arithmetic", x, y)


def right_shift_logical(x, y):
    """x >>> y on the unsigned bits of signed integers (numpy has no such function for signed types)."""
    return _bitwise("shift_right_logical", x, y)


# --- Tracer operators and methods ---------------------------------------------------------------------


def _reflected(fn):
    return lambda self, other: fn(other, self)


def _astype_method(self, dtype, copy=True):
    return astype(self, dtype)


def _reshape_method(self, *shape_, order="C"):
    return reshape(self, *shape_, order=order)


def _transpose_method(self, *axes):
    if len(axes) == 1 and not isinstance(axes[0], int):
        axes = tuple(axes[0])
    return transpose(self, axes or None)


TRACER_METHODS = {
    "__add__": add,
    "__radd__": _reflected(add),
    "__sub__": subtract,
    "__rsub__": _reflected(subtract),
    "__mul__": multiply,
    "__rmul__": _reflected(multiply),
    "__truediv__": true_divide,
    "__rtruediv__": _reflected(true_divide),
    "__floordiv__": floor_divide,
    "__rfloordiv__": _reflected(floor_divide),
    "__mod__": remainder,
    "__rmod__": _reflected(remainder),
    "__pow__": power,
    "__rpow__": _reflected(power),
    "__matmul__": matmul,
    "__rmatmul__": _reflected(matmul),
    "__neg__": negative,
    "__pos__": lambda self: self,
    "__abs__": abs,
    "__invert__": invert,
    "__and__": bitwise_and,
    "__rand__": _reflected(bitwise_and),
    "__or__": bitwise_or,
    "__ror__": _reflected(bitwise_or),
    "__xor__": bitwise_xor,
    "__rxor__": _reflected(bitwise_xor),
    "__lshift__": left_shift,
    "__rlshift__": _reflected(left_shift),
    "__rshift__": right_shift,
    "__rrshift__": _reflected(right_shift),
    "__eq__": equal,
    "__ne__": not_equal,
    "__lt__": less,
    "__le__": less_equal,
    "__gt__": greater,
    "__ge__": greater_equal,
    "__getitem__": getitem,
    "T": property(lambda self: transpose(self)),
    "mT": property(lambda self: swapaxes(self, -1, -2)),
    "reshape": _reshape_method,
    "transpose": _transpose_method,
    "astype": _astype_method,
    "sum": sum,
    "mean": mean,
    "max": max,
    "min": min,
    "prod": prod,
    "var": var,
    "std": std,
    "argmax": argmax,
    "argmin": argmin,
    "any": any,
    "all": all,
    "ravel": ravel,
    "flatten": ravel,
    "squeeze": squeeze,
    "swapaxes": swapaxes,
    "clip": clip,
    "dot": dot,
    "round": round,
    "cumsum": cumsum,
    "take": take,
}
for _name, _fn in TRACER_METHODS.items():
    setattr(Tracer, _name, _fn)
