"""Elementwise math, comparisons and bitwise functions (numpy ufunc names)."""

from __future__ import annotations

import math

import numpy as np

from flowjit.errors import FlowjitTypeError, op_error
from flowjit.frontend.trace import Tracer, bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.promotion import (
    _cast_all,
    _dtype_of,
    _elementwise,
    _float_operand,
    asarray,
    astype,
    broadcast_shapes,
    broadcast_to,
    result_type,
)

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


def _all_false(x):
    """False everywhere in x's shape: isnan/isinf of integers and bools."""
    from flowjit.numpy.shapes import zeros_like  # shapes builds on this module

    return zeros_like(x, dtype=bool)


def isnan(x):
    x = asarray(x)
    return not_equal(x, x) if _dtype_of(x).is_float else _all_false(x)


def isinf(x):
    x = asarray(x)
    return equal(abs(x), np.inf) if _dtype_of(x).is_float else _all_false(x)


def isfinite(x):
    return logical_not(logical_or(isnan(x), isinf(x)))


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
