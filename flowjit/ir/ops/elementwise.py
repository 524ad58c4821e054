"""Elementwise ops: unary math, binary arithmetic, comparisons, logical ops, select.

Operands of binary ops have equal shapes and dtypes: the frontend inserts `broadcast` and
`convert` (numpy broadcasting and promotion live there, not in the IR). Comparisons return bool.
Half-precision math is computed in float32 by the reference implementation and rounded back,
which is also what the backends do.
"""

from __future__ import annotations

import math

import numpy as np

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import (
    ELEMENTWISE_BINARY,
    ELEMENTWISE_TERNARY,
    ELEMENTWISE_UNARY,
    defop,
)
from flowjit.ir.ops.rules import check_dtype, same_types
from flowjit.ir.types import TensorType

_HALF = (dt.float16, dt.bfloat16)


def _in_f32(fn):
    """Run a numpy float function in float32 for half types (as the backends do), else natively."""

    def impl(*xs):
        dtype = xs[0].dtype
        if dtype in (dt.float16.np_dtype, dt.bfloat16.np_dtype):
            return np.asarray(fn(*(x.astype(np.float32) for x in xs))).astype(dtype)
        return np.asarray(fn(*xs)).astype(dtype, copy=False)

    return impl


_erf_scalar = np.frompyfunc(math.erf, 1, 1)


def _erf(x):
    return np.asarray(_erf_scalar(x.astype(np.float64)), np.float64)


def _logistic(x):
    return 1.0 / (1.0 + np.exp(-x))


def _round_half_even(x):
    return np.round(x)


def _unary_rule(allowed):
    def infer(types, attrs):
        check_dtype(types[0], allowed)
        return [types[0]]

    return infer


# name -> (numpy impl, allowed dtypes, doc). Float math runs in f32 for half types.
_FLOAT_MATH = {
    "exp": (np.exp, "e**x"),
    "log": (np.log, "natural logarithm; log(0) = -inf, log(x<0) = nan"),
    "log1p": (np.log1p, "log(1 + x), accurate near 0"),
    "expm1": (np.expm1, "e**x - 1, accurate near 0"),
    "tanh": (np.tanh, "hyperbolic tangent"),
    "logistic": (_logistic, "1 / (1 + e**-x), the sigmoid"),
    "sqrt": (np.sqrt, "square root; sqrt(x<0) = nan"),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), "1 / sqrt(x)"),
    "sin": (np.sin, "sine"),
    "cos": (np.cos, "cosine"),
    "erf": (_erf, "the error function"),
    "floor": (np.floor, "round toward -inf"),
    "ceil": (np.ceil, "round toward +inf"),
    "round": (_round_half_even, "round half to even, as numpy.round"),
}
for _name, (_fn, _doc) in _FLOAT_MATH.items():
    defop(_name, ELEMENTWISE_UNARY, _unary_rule(dt.FLOAT_DTYPES), _in_f32(_fn), 1, doc=_doc)

defop("neg", ELEMENTWISE_UNARY, _unary_rule(dt.NUMERIC_DTYPES), lambda x: np.negative(x), 1, doc="-x")
defop("abs", ELEMENTWISE_UNARY, _unary_rule(dt.NUMERIC_DTYPES), lambda x: np.abs(x), 1, doc="|x|")
defop(
    "sign",
    ELEMENTWISE_UNARY,
    _unary_rule(dt.NUMERIC_DTYPES),
    _in_f32(np.sign),
    1,
    doc="-1, 0 or 1 (nan for nan), as numpy.sign",
)
defop("logical_not", ELEMENTWISE_UNARY, _unary_rule((dt.bool_,)), np.logical_not, 1, doc="not x")


# --- binary -------------------------------------------------------------------------------------


def _binary_rule(allowed, result_dtype=None):
    def infer(types, attrs):
        t = same_types(types)
        check_dtype(t, allowed)
        return [t if result_dtype is None else t.with_dtype(result_dtype)]

    return infer


def _int_div(x, y):
    """C-style division truncating toward zero; x/0 = 0 and INT_MIN/-1 = INT_MIN (no trap)."""
    safe = np.where(y == 0, 1, y)
    q = np.abs(x) // np.abs(safe)
    q = np.where((x < 0) != (safe < 0), -q, q)
    return np.where(y == 0, 0, q).astype(x.dtype)


def _div(x, y):
    if x.dtype.kind in "iu":
        return _int_div(x, y)
    return _in_f32(np.true_divide)(x, y)


def _rem(x, y):
    """Remainder with the sign of the dividend (C fmod); x rem 0 = 0 for ints."""
    if x.dtype.kind in "iu":
        return np.where(y == 0, 0, x - _int_div(x, y) * y).astype(x.dtype)
    return _in_f32(np.fmod)(x, y)


def _int_pow(x, y):
    """Integer power; a negative exponent gives 0 unless |x| == 1 (no division)."""
    pos = np.power(x, np.maximum(y, 0))
    neg = np.where(x == 1, 1, np.where(x == -1, np.where(y % 2 == 0, 1, -1), 0))
    return np.where(y >= 0, pos, neg).astype(x.dtype)


def _pow(x, y):
    if x.dtype.kind in "iu":
        return _int_pow(x, y)
    return _in_f32(np.power)(x, y)


def _wrapping(fn):
    return lambda x, y: fn(x, y).astype(x.dtype, copy=False)


_BINARY = {
    "add": (_wrapping(np.add), dt.NUMERIC_DTYPES, "x + y (integers wrap)"),
    "sub": (_wrapping(np.subtract), dt.NUMERIC_DTYPES, "x - y (integers wrap)"),
    "mul": (_wrapping(np.multiply), dt.NUMERIC_DTYPES, "x * y (integers wrap)"),
    "div": (_div, dt.NUMERIC_DTYPES, "x / y; integers truncate toward zero, x/0 = 0"),
    "rem": (_rem, dt.NUMERIC_DTYPES, "remainder with the sign of x (C fmod); integer x rem 0 = 0"),
    "pow": (_pow, dt.NUMERIC_DTYPES, "x ** y"),
    "max": (np.maximum, dt.NUMERIC_DTYPES, "elementwise maximum; nan if either is nan"),
    "min": (np.minimum, dt.NUMERIC_DTYPES, "elementwise minimum; nan if either is nan"),
    "atan2": (_in_f32(np.arctan2), dt.FLOAT_DTYPES, "arctangent of y/x with quadrant"),
}
for _name, (_fn, _allowed, _doc) in _BINARY.items():
    defop(_name, ELEMENTWISE_BINARY, _binary_rule(_allowed), _fn, 2, doc=_doc)

_LOGICAL = {
    "logical_and": (np.logical_and, "x and y"),
    "logical_or": (np.logical_or, "x or y"),
    "logical_xor": (np.logical_xor, "x xor y"),
}
for _name, (_fn, _doc) in _LOGICAL.items():
    defop(_name, ELEMENTWISE_BINARY, _binary_rule((dt.bool_,)), _fn, 2, doc=_doc)

_COMPARE = {
    "eq": (np.equal, "x == y"),
    "ne": (np.not_equal, "x != y"),
    "lt": (np.less, "x < y"),
    "le": (np.less_equal, "x <= y"),
    "gt": (np.greater, "x > y"),
    "ge": (np.greater_equal, "x >= y"),
}
COMPARISONS = frozenset(_COMPARE)
for _name, (_fn, _doc) in _COMPARE.items():
    defop(_name, ELEMENTWISE_BINARY, _binary_rule(dt.ALL_DTYPES, dt.bool_), _fn, 2, doc=_doc)


def _select_rule(types, attrs):
    pred, on_true, on_false = types
    if pred.dtype != dt.bool_:
        raise ShapeError(f"the predicate must be bool; found {pred.dtype}")
    t = same_types([on_true, on_false], "branches")
    if pred.shape != t.shape:
        raise ShapeError(f"the predicate's shape {pred.shape} differs from the branches' {t.shape}")
    return [t]


defop(
    "select",
    ELEMENTWISE_TERNARY,
    _select_rule,
    lambda p, a, b: np.where(p, a, b).astype(a.dtype),
    3,
    doc="p ? a : b elementwise",
)

__all__ = ["COMPARISONS", "TensorType"]
