"""Elementwise math, comparisons and bitwise functions (numpy ufunc names)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from flowjit.errors import FlowjitTypeError, op_error
from flowjit.frontend.control_flow import while_loop
from flowjit.frontend.trace import Tracer, bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.promotion import (
    _cast_all,
    _dtype_of,
    _elementwise,
    _float_operand,
    _is_python_scalar,
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
    """numpy.exp2, as power(2, x): exact at integers and within an ulp elsewhere (exp(x ln 2) lost
    up to 32 ulps near the overflow: the rounding of x ln 2 grows with x)."""
    x = _float_operand(x)
    return power(np.asarray(2, _dtype_of(x).np_dtype), x)


def _exact_at_powers(x, base: int):
    """log_base(x) as log(x) / ln(base) (within 2 ulps), made exact where x is a power of the base
    that the float type holds exactly (numpy's log2(8) is 3; the quotient alone missed it for one
    power of two in six, and `floor(log2(x))` came out one short). The snap is invisible to
    differentiation: the gradient is 1 / (x ln base) everywhere."""
    from flowjit.frontend.grad import stop_gradient

    x = _float_operand(x)
    kind = _dtype_of(x).np_dtype
    r = multiply(log(x), 1.0 / math.log(base))
    k = round(r)
    exact = logical_and(isfinite(r), equal(power(np.asarray(base, kind), k), x))
    if base != 2:  # below the normal range 10^k rounds to a denormal far from it (1e-45 -> 1.4e-45)
        exact = logical_and(exact, greater_equal(x, np.asarray(ml_dtypes.finfo(kind).tiny, kind)))
    return add(r, stop_gradient(where(exact, subtract(k, r), np.zeros((), kind))))


def log2(x):
    """numpy.log2 (exact at powers of two)."""
    return _exact_at_powers(x, 2)


def log10(x):
    """numpy.log10 (exact at the powers of ten the type holds)."""
    return _exact_at_powers(x, 10)


def square(x):
    return multiply(x, x)


def reciprocal(x):
    return divide(1.0, x)


def tan(x):
    x = _float_operand(x)
    return sin(x) / cos(x)


def _sign_and_magnitude(x):
    """(s, s * x) with s = -1 where x's sign bit is set, else 1: |x| for functions computed on it and
    given their sign back, whose derivative at 0 must stay f'(0) (abs's derivative is 0 there)."""
    kind = _dtype_of(x).np_dtype
    s = where(signbit(x), np.asarray(-1, kind), np.asarray(1, kind))
    return s, multiply(s, x)


def _hyperbolic_split(x):
    """(s, near, a, far) for sinh and cosh: s = sign(x) as a constant (-1 where the sign bit is set),
    a = s x = |x| where |x| is below the point past which e^-|x| no longer changes e^|x| (10 for
    float32 and narrower, 20 for float64), else 0; far = e^|x| / 2 past that point, as
    (e^(|x|/2) / 2) e^(|x|/2), which stays finite up to the largest finite result (e^|x| alone
    overflows first). Each branch gets an operand it is finite on, so the other branch's gradient
    is never 0 * inf; and |x| as s x, not abs, keeps the derivative at 0 (abs has 0 there)."""
    kind = _dtype_of(x)
    zero = np.zeros((), kind.np_dtype)
    s, a = _sign_and_magnitude(x)
    split = np.asarray(20 if kind == dt.float64 else 10, kind.np_dtype)
    near = less(a, split)
    half = exp(multiply(0.5, where(near, split, a)))
    return s, near, where(near, a, zero), multiply(multiply(0.5, half), half)


def sinh(x):
    """numpy.sinh: sign(x) (t + t / (t + 1)) / 2 with t = expm1(|x|) below the split point (no
    cancellation for small x, where e^x - e^-x lost every digit), e^|x| / 2 past it."""
    x = _float_operand(x)
    s, near, a, far = _hyperbolic_split(x)
    t = expm1(a)
    return multiply(s, where(near, multiply(0.5, add(t, divide(t, add(t, 1)))), far))


def cosh(x):
    """numpy.cosh: (e + 1 / e) / 2 with e = e^|x| below the split point, e^|x| / 2 past it."""
    x = _float_operand(x)
    _, near, a, far = _hyperbolic_split(x)
    e = exp(a)
    return where(near, multiply(0.5, add(e, divide(1, e))), far)


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
    """x ** y elementwise. A Python scalar exponent of 2 is `x * x`, as numpy computes it (its fast
    scalar power): exact, where a general power costs a logarithm and an exponential per element
    (`sum((a - b) ** 2)` ran ~5x faster)."""
    if _is_python_scalar(y) and not _is_python_scalar(x) and not isinstance(y, bool) and y == 2:
        x = asarray(x)
        if result_type(x, y) == _dtype_of(x) and not _dtype_of(x).is_bool:
            return multiply(x, x)
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


def where(condition, x=None, y=None, *, size=None, fill_value=None):
    """Elementwise `x if condition else y`, broadcasting all three. With the condition alone it is
    `nonzero(condition)` (numpy's one-argument form; `size`/`fill_value` as there)."""
    if x is None and y is None:
        from flowjit.numpy.sorting import nonzero  # sorting builds on this module

        return nonzero(condition, size=size, fill_value=fill_value)
    if x is None or y is None:
        raise FlowjitTypeError(f"{user_location()}: where takes the condition alone or with both x and y")
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
    from flowjit.numpy.creation import zeros_like  # creation builds on this module

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


# --- more elementwise math (compositions of the ops above) -------------------------------------------


def _float_pair(x, y):
    """x and y in their promoted float dtype (ints and bools give float32)."""
    target = result_type(x, y)
    return _cast_all([x, y], target if target.is_float else dt.float32)


def arctan(x):
    """numpy.arctan, as atan2(x, 1)."""
    x = _float_operand(x)
    return arctan2(x, np.ones((), _dtype_of(x).np_dtype))


def arcsin(x):
    """numpy.arcsin, as atan2(x, sqrt((1 - x)(1 + x))) (nan outside [-1, 1]; 1 - x^2 would cancel
    near |x| = 1)."""
    x = _float_operand(x)
    return arctan2(x, sqrt(multiply(subtract(1, x), add(1, x))))


def arccos(x):
    """numpy.arccos, as atan2(sqrt((1 - x)(1 + x)), x) (nan outside [-1, 1]; 1 - x^2 lost up to
    380 ulps near x = 1, where the result is small)."""
    x = _float_operand(x)
    return arctan2(sqrt(multiply(subtract(1, x), add(1, x))), x)


_LN2 = math.log(2.0)


def arcsinh(x):
    """numpy.arcsinh: sign(x) * log1p(|x| + x^2 / (1 + sqrt(1 + x^2))), log(2|x|) for huge |x|."""
    x = _float_operand(x)
    a = abs(x)
    small = log1p(add(a, divide(multiply(a, a), add(1, sqrt(add(1, multiply(a, a)))))))
    huge = add(log(a), _LN2)
    r = where(greater(a, 1e9), huge, small)
    return where(less(x, 0), negative(r), r)


def arccosh(x):
    """numpy.arccosh: log1p((x - 1) + sqrt((x - 1)(x + 1))), log(2x) for huge x (nan below 1)."""
    x = _float_operand(x)
    t = subtract(x, 1)
    near = log1p(add(t, sqrt(multiply(t, add(x, 1)))))
    return where(greater(x, 1e9), add(log(x), _LN2), near)


def arctanh(x):
    """numpy.arctanh: sign(x) * 0.5 * log1p(2|x| / (1 - |x|)) (+-inf at +-1, nan outside). On |x|:
    for x near -1 the argument of log1p is near -1 and 2x / (1 - x) loses its digits."""
    x = _float_operand(x)
    s, a = _sign_and_magnitude(x)
    return multiply(s, multiply(0.5, log1p(divide(multiply(2, a), subtract(1, a)))))


def cbrt(x):
    """numpy.cbrt: the real cube root, |x|^(1/3) with x's sign, refined by one Newton step."""
    x = _float_operand(x)
    a = abs(x)
    y = power(a, 1.0 / 3.0)
    refined = subtract(y, divide(subtract(multiply(multiply(y, y), y), a), multiply(3, multiply(y, y))))
    y = where(logical_and(greater(y, 0), isfinite(y)), refined, y)
    return where(signbit(x), negative(y), y)


def hypot(x, y):
    """numpy.hypot: sqrt(x^2 + y^2) without overflow or underflow (scaled by the larger magnitude)."""
    x, y = _float_pair(x, y)
    ax, ay = abs(x), abs(y)
    big, small = maximum(ax, ay), minimum(ax, ay)
    ratio = divide(small, where(equal(big, 0), 1, big))
    out = multiply(big, sqrt(add(1, multiply(ratio, ratio))))
    return where(logical_or(isinf(x), isinf(y)), np.inf, out)  # inf beats nan, as numpy


def logaddexp(x, y):
    """numpy.logaddexp: log(exp(x) + exp(y)) without overflow."""
    x, y = _float_pair(x, y)
    big = maximum(x, y)
    out = add(big, log1p(exp(negative(abs(subtract(x, y))))))
    return where(equal(x, y), add(x, _LN2), out)  # equal infinities: inf - inf would be nan


def logaddexp2(x, y):
    """numpy.logaddexp2: log2(2^x + 2^y) without overflow."""
    x, y = _float_pair(x, y)
    big = maximum(x, y)
    out = add(big, multiply(log1p(exp(multiply(negative(abs(subtract(x, y))), _LN2))), 1.0 / _LN2))
    return where(equal(x, y), add(x, 1), out)


def deg2rad(x):
    """numpy.deg2rad: degrees to radians."""
    return multiply(_float_operand(x), math.pi / 180.0)


def rad2deg(x):
    """numpy.rad2deg: radians to degrees."""
    return multiply(_float_operand(x), 180.0 / math.pi)


radians, degrees = deg2rad, rad2deg


def signbit(x):
    """numpy.signbit: True where the sign bit is set (-0.0 included; nans count as positive)."""
    x = asarray(x)
    kind = _dtype_of(x)
    if kind.is_bool:
        return _all_false(x)
    if not kind.is_float:
        return less(x, 0)
    zero = np.zeros((), kind.np_dtype)
    return where(equal(x, zero), less(divide(1, x), zero), less(x, zero))  # 1 / -0.0 is -inf


def copysign(x, y):
    """numpy.copysign: |x| with the sign of y (-0.0 counts as negative)."""
    x, y = _float_pair(x, y)
    return where(signbit(y), negative(abs(x)), abs(x))


def heaviside(x, h0):
    """numpy.heaviside: 0 for x < 0, h0 at 0, 1 for x > 0 (nan stays nan)."""
    x, h0 = _float_pair(x, h0)
    zero = np.zeros((), _dtype_of(x).np_dtype)
    step = where(less(x, zero), zero, where(greater(x, zero), 1, h0))
    return where(isnan(x), x, step)


def sinc(x):
    """numpy.sinc: sin(pi x) / (pi x), 1 at 0."""
    x = _float_operand(x)
    px = multiply(x, math.pi)
    return where(equal(x, 0), 1, divide(sin(px), where(equal(x, 0), 1, px)))


def fmax(x, y):
    """numpy.fmax: the maximum, ignoring a nan when the other operand is not nan."""
    return where(isnan(y), x, where(isnan(x), y, maximum(x, y)))


def fmin(x, y):
    """numpy.fmin: the minimum, ignoring a nan when the other operand is not nan."""
    return where(isnan(y), x, where(isnan(x), y, minimum(x, y)))


def float_power(x, y):
    """numpy.float_power: x ** y computed in float64."""
    return power(astype(x, dt.float64), y if _is_python_scalar(y) else astype(y, dt.float64))


def trunc(x):
    """numpy.trunc: round toward zero."""
    x = asarray(x)
    if not _dtype_of(x).is_float:
        return x
    return where(less(x, 0), ceil(x), floor(x))


fix = trunc


def rint(x):
    """numpy.rint: round half to even."""
    return round(x)


def positive(x):
    """numpy.positive: +x (a copy)."""
    return asarray(x)


def isposinf(x):
    """numpy.isposinf."""
    x = asarray(x)
    return equal(x, np.inf) if _dtype_of(x).is_float else _all_false(x)


def isneginf(x):
    """numpy.isneginf."""
    x = asarray(x)
    return equal(x, -np.inf) if _dtype_of(x).is_float else _all_false(x)


def nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    """numpy.nan_to_num (copy=False ignored): nan -> `nan`, +-inf -> `posinf`/`neginf`, by default
    the largest finite values of the dtype."""
    x = asarray(x)
    kind = _dtype_of(x)
    if not kind.is_float:
        return x
    info = np.finfo(kind.np_dtype) if kind is not dt.bfloat16 else None
    largest = float(info.max) if info is not None else float(np.asarray(3.3895314e38, np.float32))
    x = where(isnan(x), asarray(nan, kind), x)
    x = where(equal(x, np.inf), asarray(largest if posinf is None else posinf, kind), x)
    return where(equal(x, -np.inf), asarray(-largest if neginf is None else neginf, kind), x)


def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """numpy.isclose: |a - b| <= atol + rtol * |b|; infinities are close only to themselves."""
    a, b = _float_pair(a, b)
    finite = logical_and(isfinite(a), isfinite(b))
    close = less_equal(abs(subtract(a, b)), add(atol, multiply(rtol, abs(b))))
    out = where(finite, close, equal(a, b))
    if equal_nan:
        out = logical_or(out, logical_and(isnan(a), isnan(b)))
    return out


def select(condlist, choicelist, default=0):
    """numpy.select: elementwise, the choice of the first true condition, else `default`."""
    if len(condlist) != len(choicelist):
        raise op_error(FlowjitTypeError, user_location(), "select", "condlist and choicelist need equal lengths")
    out = default
    for cond, choice in reversed(list(zip(condlist, choicelist))):
        out = where(cond, choice, out)
    return asarray(out)


def gcd(x1, x2):
    """numpy.gcd of integers: Euclid's algorithm, one `while` loop over the whole array (until every
    remainder is 0; reductions build on this module, hence the local import)."""
    from flowjit.numpy.reductions import any  # noqa: A004 (numpy's name)

    target = result_type(x1, x2)
    if not target.is_int:
        raise op_error(FlowjitTypeError, user_location(), "gcd", f"needs integer operands; found {target}")
    a, b = _cast_all([x1, x2], target)
    shape = broadcast_shapes(
        np.shape(a) if not isinstance(a, Tracer) else a.shape, np.shape(b) if not isinstance(b, Tracer) else b.shape
    )
    a, b = broadcast_to(abs(a), shape), broadcast_to(abs(b), shape)

    def step(pair):
        a, b = pair
        done = equal(b, 0)
        return where(done, a, b), where(done, b, remainder(a, where(done, 1, b)))

    return while_loop(lambda pair: any(not_equal(pair[1], 0)), step, (a, b))[0]


def lcm(x1, x2):
    """numpy.lcm of integers: |x1 / gcd * x2| (0 when either is 0)."""
    g = gcd(x1, x2)
    a, b = _cast_all([x1, x2], _dtype_of(g))
    return where(equal(g, 0), g, abs(multiply(floor_divide(a, where(equal(g, 0), 1, g)), b)))
