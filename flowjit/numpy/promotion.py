"""Conversion to arrays, dtype promotion (numpy's, with weak Python scalars) and broadcasting."""

from __future__ import annotations

import builtins

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer, bind, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location

_SCALARS = (bool, int, float)


def _is_python_scalar(x) -> bool:
    """A weak Python scalar. np.float64 subclasses float but is a typed numpy scalar (strong, NEP 50)."""
    return isinstance(x, _SCALARS) and not isinstance(x, np.generic)


# --- conversion, promotion and broadcasting ---------------------------------------------------------


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
        from flowjit.numpy.shapes import stack  # shapes builds on this module

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
