"""numpy-compatible functions that work on traced values and on plain arrays alike.

Broadcasting and dtype promotion follow numpy, with two deliberate ML-friendly differences (as in
JAX): Python scalars are *weak* (`float32 * 2.0` stays float32), and a lone Python float becomes
float32 (a lone int becomes int64, as in numpy). On plain numpy arrays these functions compute with
flowjit's reference implementations, so results match what compiled code returns.
"""

from __future__ import annotations

import numpy as np

from flowjit.frontend.trace import Tracer
from flowjit.ir import dtypes as dt
from flowjit.numpy.elementwise import (  # noqa: F401 (the public namespace)
    abs,
    absolute,
    add,
    arctan2,
    around,
    bitwise_and,
    bitwise_not,
    bitwise_or,
    bitwise_xor,
    ceil,
    clip,
    cos,
    cosh,
    divide,
    equal,
    erf,
    exp,
    exp2,
    expm1,
    floor,
    floor_divide,
    fmod,
    greater,
    greater_equal,
    invert,
    isfinite,
    isinf,
    isnan,
    left_shift,
    less,
    less_equal,
    log,
    log1p,
    log2,
    log10,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    logistic,
    maximum,
    minimum,
    mod,
    multiply,
    negative,
    not_equal,
    power,
    reciprocal,
    remainder,
    right_shift,
    right_shift_logical,
    round,
    rsqrt,
    sign,
    sin,
    sinh,
    sqrt,
    square,
    subtract,
    tan,
    tanh,
    true_divide,
    where,
)
from flowjit.numpy.linalg import (  # noqa: F401 (the public namespace)
    dot,
    einsum,
    inner,
    matmul,
    outer,
    tensordot,
    vdot,
)
from flowjit.numpy.promotion import (  # noqa: F401 (the public namespace)
    array,
    asarray,
    astype,
    broadcast_shapes,
    broadcast_to,
    result_type,
)
from flowjit.numpy.reductions import (  # noqa: F401 (the public namespace)
    all,
    amax,
    amin,
    any,
    argmax,
    argmin,
    cumsum,
    max,
    mean,
    min,
    prod,
    std,
    sum,
    var,
)
from flowjit.numpy.shapes import (  # noqa: F401 (the public namespace)
    arange,
    concatenate,
    dynamic_slice,
    expand_dims,
    eye,
    flip,
    full,
    full_like,
    getitem,
    iota,
    linspace,
    moveaxis,
    ndim,
    ones,
    ones_like,
    pad,
    ravel,
    repeat,
    reshape,
    scatter_add,
    shape,
    size,
    split,
    squeeze,
    stack,
    swapaxes,
    take,
    tile,
    transpose,
    zeros,
    zeros_like,
)

ndarray = np.ndarray
pi, e, inf, nan, newaxis = np.pi, np.e, np.inf, np.nan, None
float16, float32, float64, int32, int64 = np.float16, np.float32, np.float64, np.int32, np.int64
bool_ = np.bool_
bfloat16 = dt.bfloat16.np_dtype.type

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
