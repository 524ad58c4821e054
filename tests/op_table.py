"""The op table: one place that says how every registered op is tested.

Each `Row` names an IR op, its attributes, the dtypes it runs in, an input generator that keeps
values in the op's numerically safe domain (or deliberately feeds nan/inf/negative values where the
semantics are defined) and an independent numpy reference. References compute in float64 (ints in
int64, exactly) with plain numpy functions, never with the op's own implementation, and are cast to
the result dtype at the end; edge-case rows spell their expected values out.

`cases()` expands the table into self-contained single-op graphs:

    for case_id, (graph, inputs, expected, tol) in cases(): ...

and `assert_close(actual, expected, tol)` compares results (dtype and shape exactly, values within
the tolerance, nan where nan). The numerics tests check the reference interpreter against this
table; backend tests compile the same graphs and compare with the interpreter. Graphs of the state
ops first assign their variable from an input, so any buffer will do: run every graph with
`variables=fresh_variables(graph)` (empty for graphs without state).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from flowjit.ir import dtypes as dt
from flowjit.ir.builder import emit
from flowjit.ir.graph import Graph, Value
from flowjit.ir.types import TensorType

BOOL, I32, I64 = dt.bool_, dt.int32, dt.int64
F16, BF16, F32, F64 = dt.float16, dt.bfloat16, dt.float32, dt.float64
FLOATS = dt.FLOAT_DTYPES
INTS = dt.INT_DTYPES
NUMERIC = dt.NUMERIC_DTYPES
ALL = dt.ALL_DTYPES

# Shapes every elementwise op runs on: a scalar, a size-1 dim, zero-size, ranks 1 to 3.
ELEMENTWISE_SHAPES = ((), (1,), (5,), (2, 3), (0, 3), (2, 1, 4))


class Tol(NamedTuple):
    """Allowed |actual - expected| <= atol + rtol * |expected| (both 0: exact)."""

    rtol: float
    atol: float


# One rounding of the result in the op's dtype, plus a few ulps of float32 intermediate error.
_BASE_TOL = {
    F16: Tol(2e-3, 2e-3),
    BF16: Tol(1.6e-2, 1.6e-2),
    F32: Tol(4e-6, 1e-6),
    F64: Tol(1e-12, 1e-13),
}
EXACT = Tol(0.0, 0.0)


def tolerance(dtype: dt.DType, scale: float = 1.0) -> Tol:
    """The tolerance for results of `dtype`. `scale` widens the absolute part, which covers the
    accumulated error of sums with cancellation (use the reduction's length)."""
    base = _BASE_TOL.get(dtype)
    if base is None:
        return EXACT
    return Tol(base.rtol, base.atol * scale)


class OpCase(NamedTuple):
    """One test case: a graph applying one op to its params, inputs, expected results, tolerance."""

    graph: Graph
    inputs: list[np.ndarray]
    expected: list[np.ndarray]
    tol: Tol


@dataclass(frozen=True)
class Row:
    """One op under one configuration, run once per dtype in `dtypes`.

    inputs(rng, dtype) -> the operand arrays.
    ref(*wide_inputs, dtype=...) -> expected result(s), from float64/int64 copies of the inputs.
    attrs: the op's attributes, or a function of the dtype returning them.
    out_dtype: the result dtype when it is not the operand dtype (a DType or a function of it).
    regions(dtype) -> the region graphs of a control-flow op.
    graph(inputs, attrs) -> the test graph, for ops that are not tested alone (state).
    """

    name: str
    op: str
    dtypes: tuple[dt.DType, ...]
    inputs: Callable
    ref: Callable
    attrs: dict | Callable = field(default_factory=dict)
    out_dtype: dt.DType | Callable | None = None
    tol_scale: float = 1.0
    regions: Callable | None = None
    graph: Callable | None = None


# --- input generators --------------------------------------------------------------------------------


def rand(rng: np.random.Generator, shape, dtype: dt.DType, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    """Uniform values in [lo, hi] of `dtype` (integers in [ceil(lo), floor(hi)], bools 50/50)."""
    if dtype.is_bool:
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.is_int:
        return np.asarray(rng.integers(math.ceil(lo), math.floor(hi) + 1, size=shape)).astype(dtype.np_dtype)
    return np.asarray(rng.uniform(lo, hi, size=shape)).astype(dtype.np_dtype)


def rand_nonzero(rng, shape, dtype, lo: float = 0.5, hi: float = 4.0) -> np.ndarray:
    """Magnitudes in [lo, hi] (at least 1 for ints) with a random sign: safe divisors."""
    magnitude = rand(rng, shape, dtype, max(lo, 1) if dtype.is_int else lo, hi)
    return magnitude * np.where(rng.random(shape) < 0.5, -1, 1).astype(dtype.np_dtype)


def small_ints(rng, shape, dtype, lo: int = -2, hi: int = 2) -> np.ndarray:
    """Integral values in [lo, hi] of any dtype: exact everywhere, and ties are frequent."""
    if dtype.is_bool:
        return rand(rng, shape, dtype)
    return np.asarray(rng.integers(lo, hi + 1, size=shape)).astype(dtype.np_dtype)


def literal(values, dtype) -> np.ndarray:
    """An input array with explicit values."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, np.float64 if dtype.is_float else None).astype(dtype.np_dtype)


def _wide(x: np.ndarray) -> np.ndarray:
    """The reference's working copy: floats in float64, ints in int64, bools as bools."""
    if x.dtype.kind == "f" or x.dtype == dt.bfloat16.np_dtype:
        return x.astype(np.float64)
    if x.dtype.kind in "iu":
        return x.astype(np.int64)
    return x.copy()


def _is_float_np(np_dtype) -> bool:
    return dt.dtype(np_dtype).is_float


# --- the rows ------------------------------------------------------------------------------------------

ROWS: list[Row] = []


def add_row(name, op, dtypes, inputs, ref, attrs=None, out_dtype=None, tol_scale=1.0, regions=None, graph=None):
    ROWS.append(Row(name, op, tuple(dtypes), inputs, ref, attrs or {}, out_dtype, tol_scale, regions, graph))


def _shape_id(shape) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


# Unary float math: (op, reference, safe domain).
_UNARY_FLOAT = (
    ("exp", np.exp, (-5.0, 5.0)),
    ("log", np.log, (0.1, 10.0)),
    ("log1p", np.log1p, (-0.9, 5.0)),
    ("expm1", np.expm1, (-3.0, 3.0)),
    ("tanh", np.tanh, (-4.0, 4.0)),
    ("logistic", lambda x: 1.0 / (1.0 + np.exp(-x)), (-6.0, 6.0)),
    ("sqrt", np.sqrt, (0.0, 10.0)),
    ("rsqrt", lambda x: 1.0 / np.sqrt(x), (0.1, 10.0)),
    ("sin", np.sin, (-3.0, 3.0)),
    ("cos", np.cos, (-3.0, 3.0)),
    ("erf", _erf, (-3.0, 3.0)),
    ("floor", np.floor, (-5.0, 5.0)),
    ("ceil", np.ceil, (-5.0, 5.0)),
    ("round", np.round, (-5.0, 5.0)),
)
for _op, _ref, (_lo, _hi) in _UNARY_FLOAT:
    for _shape in ELEMENTWISE_SHAPES:
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            FLOATS,
            lambda rng, d, s=_shape, lo=_lo, hi=_hi: [rand(rng, s, d, lo, hi)],
            lambda x, dtype, f=_ref: f(x),
        )

_UNARY_NUMERIC = (("neg", np.negative), ("abs", np.abs), ("sign", np.sign))
for _op, _ref in _UNARY_NUMERIC:
    for _shape in ELEMENTWISE_SHAPES:
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            NUMERIC,
            lambda rng, d, s=_shape: [rand(rng, s, d, -4, 4)],
            lambda x, dtype, f=_ref: f(x),
        )
for _shape in ELEMENTWISE_SHAPES:
    add_row(
        f"logical_not-{_shape_id(_shape)}",
        "logical_not",
        (BOOL,),
        lambda rng, d, s=_shape: [rand(rng, s, d)],
        lambda x, dtype: ~x,
    )

# Special values where the semantics are defined (numpy's).
_SPECIAL = np.array([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 0.5, 2.5, -2.5, -0.5, 1.5])
for _op, _ref, _ in _UNARY_FLOAT:
    add_row(
        f"{_op}-special",
        _op,
        FLOATS,
        lambda rng, d: [literal(_SPECIAL, d)],
        lambda x, dtype, f=_ref: f(x),
    )
for _op, _ref in _UNARY_NUMERIC:
    add_row(f"{_op}-special", _op, FLOATS, lambda rng, d: [literal(_SPECIAL, d)], lambda x, dtype, f=_ref: f(x))
# Rounding is half to even, spelled out.
add_row(
    "round-halves",
    "round",
    FLOATS,
    lambda rng, d: [literal([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.25, -3.75], d)],
    lambda x, dtype: np.array([0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 3.0, -4.0]),
)


def _int_div_ref(x, y):
    """Truncating division; x / 0 = 0."""
    safe = np.where(y == 0, 1, y)
    q = np.trunc(x.astype(np.float64) / safe)
    return np.where(y == 0, 0, q).astype(np.int64)


def _div_ref(x, y, dtype):
    return _int_div_ref(x, y) if dtype.is_int else x / y


def _rem_ref(x, y, dtype):
    if dtype.is_int:
        return x - _int_div_ref(x, y) * y
    return np.fmod(x, y)


def _pow_inputs(rng, shape, d):
    if d.is_int:
        return [rand(rng, shape, d, -3, 3), rand(rng, shape, d, 0, 4)]
    return [rand(rng, shape, d, 0.5, 2.0), rand(rng, shape, d, -2.0, 2.0)]


_BINARY_ARITH = (
    ("add", NUMERIC, lambda rng, s, d: [rand(rng, s, d, -50, 50), rand(rng, s, d, -50, 50)], lambda x, y, d: x + y),
    ("sub", NUMERIC, lambda rng, s, d: [rand(rng, s, d, -50, 50), rand(rng, s, d, -50, 50)], lambda x, y, d: x - y),
    ("mul", NUMERIC, lambda rng, s, d: [rand(rng, s, d, -20, 20), rand(rng, s, d, -20, 20)], lambda x, y, d: x * y),
    ("div", NUMERIC, lambda rng, s, d: [rand(rng, s, d, -50, 50), rand_nonzero(rng, s, d)], _div_ref),
    ("rem", NUMERIC, lambda rng, s, d: [rand(rng, s, d, -50, 50), rand_nonzero(rng, s, d)], _rem_ref),
    ("pow", NUMERIC, _pow_inputs, lambda x, y, d: np.power(x, y)),
    (
        "max",
        NUMERIC,
        lambda rng, s, d: [small_ints(rng, s, d), small_ints(rng, s, d)],
        lambda x, y, d: np.maximum(x, y),
    ),
    (
        "min",
        NUMERIC,
        lambda rng, s, d: [small_ints(rng, s, d), small_ints(rng, s, d)],
        lambda x, y, d: np.minimum(x, y),
    ),
    ("atan2", FLOATS, lambda rng, s, d: [rand(rng, s, d), rand(rng, s, d)], lambda x, y, d: np.arctan2(x, y)),
)
for _op, _dtypes, _gen, _ref in _BINARY_ARITH:
    for _shape in ELEMENTWISE_SHAPES:
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            _dtypes,
            lambda rng, d, s=_shape, g=_gen: g(rng, s, d),
            lambda x, y, dtype, f=_ref: f(x, y, dtype),
        )

_LOGICAL = (("logical_and", np.logical_and), ("logical_or", np.logical_or), ("logical_xor", np.logical_xor))
_COMPARE = (
    ("eq", np.equal),
    ("ne", np.not_equal),
    ("lt", np.less),
    ("le", np.less_equal),
    ("gt", np.greater),
    ("ge", np.greater_equal),
)
for _shape in ELEMENTWISE_SHAPES:
    for _op, _ref in _LOGICAL:
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            (BOOL,),
            lambda rng, d, s=_shape: [rand(rng, s, d), rand(rng, s, d)],
            lambda x, y, dtype, f=_ref: f(x, y),
        )
    for _op, _ref in _COMPARE:
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            ALL,
            lambda rng, d, s=_shape: [small_ints(rng, s, d, -1, 1), small_ints(rng, s, d, -1, 1)],
            lambda x, y, dtype, f=_ref: f(x, y),
            out_dtype=BOOL,
        )
    add_row(
        f"select-{_shape_id(_shape)}",
        "select",
        ALL,
        lambda rng, d, s=_shape: [rand(rng, s, BOOL), rand(rng, s, d), rand(rng, s, d)],
        lambda p, x, y, dtype: np.where(p, x, y),
    )

# Special values for binary ops: nan and inf, with numpy's semantics.
_SPECIAL_X = [np.nan, 1.0, np.inf, -np.inf, np.inf, 0.0, -0.0, 3.0, -3.0, 0.0, -8.0, 2.0]
_SPECIAL_Y = [1.0, np.nan, np.inf, 2.0, -np.inf, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0 / 3.0, np.inf]
for _op, _, _, _ref in _BINARY_ARITH:
    add_row(
        f"{_op}-special",
        _op,
        FLOATS,
        lambda rng, d: [literal(_SPECIAL_X, d), literal(_SPECIAL_Y, d)],
        lambda x, y, dtype, f=_ref: f(x, y, dtype),
    )
for _op, _ref in _COMPARE:
    add_row(
        f"{_op}-special",
        _op,
        FLOATS,
        lambda rng, d: [literal(_SPECIAL_X, d), literal(_SPECIAL_Y, d)],
        lambda x, y, dtype, f=_ref: f(x, y),
        out_dtype=BOOL,
    )

# Integer edge cases, spelled out: division truncates toward zero, x/0 = 0, INT_MIN/-1 = INT_MIN,
# remainders take the dividend's sign, arithmetic wraps, negative powers vanish unless |x| == 1.
for _d in INTS:
    _lo, _hi = int(np.iinfo(_d.np_dtype).min), int(np.iinfo(_d.np_dtype).max)
    add_row(
        "div-int-edges",
        "div",
        (_d,),
        lambda rng, d, lo=_lo: [literal([7, -7, 7, -7, 5, 0, lo, lo], d), literal([2, 2, -2, -2, 0, 0, -1, 1], d)],
        lambda x, y, dtype, lo=_lo: np.array([3, -3, -3, 3, 0, 0, lo, lo]),
    )
    add_row(
        "rem-int-edges",
        "rem",
        (_d,),
        lambda rng, d, lo=_lo: [literal([7, -7, 7, -7, 5, 0, lo, -1], d), literal([3, 3, -3, -3, 0, 0, -1, 5], d)],
        lambda x, y, dtype: np.array([1, -1, 1, -1, 0, 0, 0, -1]),
    )
    add_row(
        "add-int-wrap",
        "add",
        (_d,),
        lambda rng, d, lo=_lo, hi=_hi: [literal([hi, lo, hi], d), literal([1, -1, hi], d)],
        lambda x, y, dtype, lo=_lo, hi=_hi: np.array([lo, hi, -2]),
    )
    add_row(
        "sub-int-wrap",
        "sub",
        (_d,),
        lambda rng, d, lo=_lo: [literal([lo, 0], d), literal([1, lo], d)],
        lambda x, y, dtype, lo=_lo, hi=_hi: np.array([hi, lo]),
    )
    add_row(
        "mul-int-wrap",
        "mul",
        (_d,),
        lambda rng, d, lo=_lo, hi=_hi: [literal([hi, lo, lo], d), literal([2, -1, 2], d)],
        lambda x, y, dtype, lo=_lo: np.array([-2, lo, 0]),
    )
    add_row(
        "pow-int-negative-exponent",
        "pow",
        (_d,),
        lambda rng, d: [literal([1, -1, -1, 2, -2, 0, 3, 0], d), literal([-3, -3, -2, -1, -2, -1, 0, 0], d)],
        lambda x, y, dtype: np.array([1, -1, 1, 0, 0, 0, 1, 1]),
    )
    add_row("neg-int-min", "neg", (_d,), lambda rng, d, lo=_lo: [literal([lo], d)], lambda x, dtype: x.copy())
    add_row("abs-int-min", "abs", (_d,), lambda rng, d, lo=_lo: [literal([lo], d)], lambda x, dtype: x.copy())


# --- bitwise -----------------------------------------------------------------------------------------------


def _to_signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def _shift_ref(kind, x, y, dtype):
    """Shifts on Python ints: two's-complement bits, shifts >= the width give 0 or the sign fill."""
    bits = dtype.bits

    def one(a, n):
        a, n = int(a), int(n)
        if kind == "left":
            return 0 if n >= bits else _to_signed(a << n, bits)
        if kind == "right_logical":
            return 0 if n >= bits else _to_signed((a & ((1 << bits) - 1)) >> n, bits)
        return (-1 if a < 0 else 0) if n >= bits else a >> n

    return np.vectorize(one, otypes=[np.int64])(x, y) if x.size else x.copy()


for _shape in ELEMENTWISE_SHAPES:
    for _op, _ref in (("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or), ("bitwise_xor", np.bitwise_xor)):
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            (BOOL, *INTS),
            lambda rng, d, s=_shape: [rand(rng, s, d, -1000, 1000), rand(rng, s, d, -1000, 1000)],
            lambda x, y, dtype, f=_ref: f(x, y),
        )
    add_row(
        f"bitwise_not-{_shape_id(_shape)}",
        "bitwise_not",
        (BOOL, *INTS),
        lambda rng, d, s=_shape: [rand(rng, s, d, -1000, 1000)],
        lambda x, dtype: ~x,
    )
    for _kind in ("left", "right_logical", "right_arithmetic"):
        add_row(
            f"shift_{_kind}-{_shape_id(_shape)}",
            f"shift_{_kind}",
            INTS,
            lambda rng, d, s=_shape: [rand(rng, s, d, -1000, 1000), rand(rng, s, d, 0, d.bits + 3)],
            lambda x, y, dtype, k=_kind: _shift_ref(k, x, y, dtype),
        )
for _d in INTS:
    _lo, _hi = int(np.iinfo(_d.np_dtype).min), int(np.iinfo(_d.np_dtype).max)
    for _kind in ("left", "right_logical", "right_arithmetic"):
        add_row(
            f"shift_{_kind}-edges",
            f"shift_{_kind}",
            (_d,),
            lambda rng, d, lo=_lo, hi=_hi: [
                literal([lo, hi, -1, 1, -1, 5, lo, -7], d),
                literal([1, 1, d.bits - 1, d.bits - 1, d.bits, d.bits, 0, 2], d),
            ],
            lambda x, y, dtype, k=_kind: _shift_ref(k, x, y, dtype),
        )
    add_row(
        "bitwise-edges",
        "bitwise_xor",
        (_d,),
        lambda rng, d, lo=_lo, hi=_hi: [literal([lo, hi, -1, 0], d), literal([hi, hi, lo, -1], d)],
        lambda x, y, dtype: np.array([-1, 0, _to_signed(-1 ^ int(y[2]), dtype.bits), -1]),
    )


# --- convert -------------------------------------------------------------------------------------------


def _convert_ref(x, dtype, to):
    if to.is_bool:
        return x != 0
    if to.is_int and _is_float_np(x.dtype):
        return np.trunc(x)
    return x


for _to in ALL:
    for _shape in ((), (2, 3), (0, 2)):
        add_row(
            f"convert-to-{_to.name}-{_shape_id(_shape)}",
            "convert",
            ALL,
            lambda rng, d, s=_shape: [rand(rng, s, d, -100, 100) if not d.is_bool else rand(rng, s, d)],
            lambda x, dtype, to=_to: _convert_ref(x, dtype, to),
            attrs={"dtype": _to},
            out_dtype=_to,
        )
    add_row(
        f"convert-to-{_to.name}-halves",
        "convert",
        FLOATS,
        lambda rng, d: [literal([2.5, -2.5, 0.75, -0.75, 0.0, -0.0], d)],
        lambda x, dtype, to=_to: _convert_ref(x, dtype, to),
        attrs={"dtype": _to},
        out_dtype=_to,
    )
for _to in INTS:
    _info = np.iinfo(_to.np_dtype)
    # float -> int saturates at the integer range and maps nan to 0.
    add_row(
        f"convert-to-{_to.name}-saturate",
        "convert",
        (F32, F64),
        lambda rng, d: [literal([1e30, -1e30, np.nan, np.inf, -np.inf, 2.7, -2.7, 1e19, -1e19], d)],
        lambda x, dtype, i=_info: np.array([i.max, i.min, 0, i.max, i.min, 2, -2, i.max, i.min], np.int64),
        attrs={"dtype": _to},
        out_dtype=_to,
    )
    add_row(
        f"convert-to-{_to.name}-saturate-half",
        "convert",
        (F16, BF16),
        lambda rng, d: [literal([np.inf, -np.inf, np.nan, -7.5, 7.5], d)],
        lambda x, dtype, i=_info: np.array([i.max, i.min, 0, -7, 7], np.int64),
        attrs={"dtype": _to},
        out_dtype=_to,
    )
add_row(
    "convert-to-bool-special",
    "convert",
    FLOATS,
    lambda rng, d: [literal([0.0, -0.0, np.nan, 0.5, -np.inf], d)],
    lambda x, dtype: np.array([False, False, True, True, True]),
    attrs={"dtype": BOOL},
    out_dtype=BOOL,
)
add_row(
    "convert-i64-to-i32-wraps",
    "convert",
    (I64,),
    lambda rng, d: [literal([2**32 + 5, -(2**31) - 1, 2**31], d)],
    lambda x, dtype: np.array([5, 2**31 - 1, -(2**31)]),
    attrs={"dtype": I32},
    out_dtype=I32,
)
add_row(
    "convert-f64-to-f16-overflow",
    "convert",
    (F32, F64),
    lambda rng, d: [literal([1e6, -1e6, 65504.0, 1e-9, np.nan], d)],
    lambda x, dtype: np.array([np.inf, -np.inf, 65504.0, 0.0, np.nan]),
    attrs={"dtype": F16},
    out_dtype=F16,
)
add_row(
    "convert-f32-to-bf16-round-half-even",
    "convert",
    (F32, F64),
    lambda rng, d: [literal([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], d)],
    lambda x, dtype: np.array([1.0, 1 + 2**-6, -1.0]),
    attrs={"dtype": BF16},
    out_dtype=BF16,
)


# --- creation --------------------------------------------------------------------------------------------

for _shape, _dim in (((5,), 0), ((2, 3), 1), ((2, 3, 4), 0), ((2, 3, 4), 2), ((0, 3), 1), ((1,), 0)):
    add_row(
        f"iota-{_shape_id(_shape)}-dim{_dim}",
        "iota",
        NUMERIC,
        lambda rng, d: [],
        lambda dtype, s=_shape, k=_dim: np.broadcast_to(
            np.expand_dims(np.arange(s[k], dtype=np.float64), tuple(i for i in range(len(s)) if i != k)), s
        ),
        attrs=lambda d, s=_shape, k=_dim: {"shape": s, "dimension": k, "dtype": d},
    )

for _shape in ((), (1,), (2, 3), (0, 4)):
    add_row(
        f"constant-{_shape_id(_shape)}",
        "constant",
        ALL,
        lambda rng, d: [],
        lambda dtype, s=_shape: _constant_value(s, dtype),
        attrs=lambda d, s=_shape: {"value": _constant_value(s, d)},
    )


def _constant_value(shape, dtype) -> np.ndarray:
    """A deterministic payload, so the attribute and the reference agree without sharing an rng."""
    rng = np.random.default_rng(zlib.crc32(f"{shape}{dtype}".encode()))
    return rand(rng, shape, dtype, -10, 10)


# --- movement ---------------------------------------------------------------------------------------------


def _broadcast_ref(x, dtype, shape, dims):
    new = tuple(i for i in range(len(shape)) if i not in dims)
    return np.broadcast_to(np.expand_dims(x, new), shape)


for _in, _out, _dims in (
    ((3,), (2, 3), (1,)),
    ((1, 3), (4, 3), (0, 1)),
    ((), (2, 2), ()),
    ((3, 1), (2, 3, 4), (1, 2)),
    ((2,), (2, 3), (0,)),
    ((0,), (2, 0), (1,)),
    ((1,), (0, 3), (1,)),
    ((2, 3), (2, 3), (0, 1)),
):
    add_row(
        f"broadcast-{_shape_id(_in)}-to-{_shape_id(_out)}",
        "broadcast",
        ALL,
        lambda rng, d, s=_in: [rand(rng, s, d)],
        lambda x, dtype, s=_out, k=_dims: _broadcast_ref(x, dtype, s, k),
        attrs={"shape": _out, "dims": _dims},
    )

for _in, _out in (((2, 3), (3, 2)), ((), (1, 1)), ((2, 0), (0, 5)), ((4,), (2, 2)), ((2, 3, 4), (24,)), ((1,), ())):
    add_row(
        f"reshape-{_shape_id(_in)}-to-{_shape_id(_out)}",
        "reshape",
        ALL,
        lambda rng, d, s=_in: [rand(rng, s, d)],
        lambda x, dtype, s=_out: np.reshape(x, s),
        attrs={"shape": _out},
    )

for _in, _perm in (
    ((2, 3, 4), (2, 0, 1)),
    ((2, 3), (1, 0)),
    ((), ()),
    ((0, 3), (1, 0)),
    ((1, 2, 1, 3), (3, 1, 0, 2)),
    # Large enough for blocks, with output rows no multiple of the block side: whole blocks of rows,
    # then the rest in one tile (lower_layout._transposed_in_two), or the rest alone.
    ((2000, 10), (1, 0)),
    ((6000, 3), (1, 0)),
):
    add_row(
        f"transpose-{_shape_id(_in)}-{''.join(map(str, _perm)) or 'id'}",
        "transpose",
        ALL,
        lambda rng, d, s=_in: [rand(rng, s, d)],
        lambda x, dtype, p=_perm: np.transpose(x, p),
        attrs={"perm": _perm},
    )


def _slice_ref(x, dtype, start, limit, stride):
    for axis, (lo, hi, st) in enumerate(zip(start, limit, stride)):
        x = np.take(x, np.arange(lo, hi, st), axis=axis)
    return x


for _in, _start, _limit, _stride in (
    ((10,), (1,), (9,), (3,)),
    ((10,), (0,), (10,), (1,)),
    ((4, 6), (1, 0), (3, 6), (1, 2)),
    ((4, 6), (2, 5), (2, 6), (1, 4)),
    ((3, 4, 5), (0, 1, 4), (3, 4, 5), (2, 2, 1)),
    ((0, 3), (0, 1), (0, 3), (1, 1)),
    ((), (), (), ()),
):
    add_row(
        f"slice-{_shape_id(_in)}-{_start}-{_limit}-{_stride}",
        "slice",
        ALL,
        lambda rng, d, s=_in: [rand(rng, s, d)],
        lambda x, dtype, a=_start, b=_limit, c=_stride: _slice_ref(x, dtype, a, b, c),
        attrs={"start": _start, "limit": _limit, "stride": _stride},
    )


def _dynamic_slice_ref(x, *starts, dtype, sizes):
    for axis, (s, n) in enumerate(zip(starts, sizes)):
        first = min(max(int(s), 0), x.shape[axis] - n)  # clamped so the window fits
        x = np.take(x, np.arange(first, first + n), axis=axis)
    return x


for _in, _starts, _sizes, _idx in (
    ((10,), (3,), (4,), I64),
    ((10,), (-5,), (4,), I32),
    ((10,), (8,), (4,), I64),
    ((10,), (100,), (10,), I32),
    ((4, 5), (1, 2), (2, 3), I32),
    ((4, 5), (-1, 9), (2, 3), I64),
    ((4, 5), (2, 2), (0, 5), I64),
    ((), (), (), I64),
):
    add_row(
        f"dynamic_slice-{_shape_id(_in)}-{_starts}-{_sizes}-{_idx.name}",
        "dynamic_slice",
        ALL,
        lambda rng, d, s=_in, st=_starts, i=_idx: [rand(rng, s, d)] + [np.asarray(v, i.np_dtype) for v in st],
        lambda x, *starts, dtype, n=_sizes: _dynamic_slice_ref(x, *starts, dtype=dtype, sizes=n),
        attrs={"sizes": _sizes},
    )


def _pad_ref(x, value, dtype, low, high, interior):
    shape = [lo + hi + d + max(d - 1, 0) * it for d, lo, hi, it in zip(x.shape, low, high, interior)]
    out = np.full(shape, value, x.dtype)
    positions = [lo + np.arange(d) * (it + 1) for d, lo, it in zip(x.shape, low, interior)]
    out[np.ix_(*positions)] = x
    return out


for _in, _low, _high, _interior in (
    ((3,), (1,), (2,), (0,)),
    ((3,), (0,), (0,), (2,)),
    ((2, 3), (1, 0), (0, 2), (1, 1)),
    ((2, 3), (0, 0), (0, 0), (0, 0)),
    ((2, 5), (0, 3), (0, 1), (0, 0)),  # along one axis: rows of blocks on the CPU (`_pad_blocks`)
    ((2, 3, 4), (0, 2, 0), (0, 0, 0), (0, 0, 0)),
    ((2, 3, 4), (1, 0, 2), (0, 3, 1), (0, 0, 0)),  # along several: runs of blocks per inner row
    ((0, 2), (1, 1), (2, 0), (3, 0)),
    ((1, 2, 2), (0, 1, 0), (1, 0, 1), (0, 0, 1)),
    ((), (), (), ()),
):
    add_row(
        f"pad-{_shape_id(_in)}-{_low}-{_high}-{_interior}",
        "pad",
        ALL,
        lambda rng, d, s=_in: [rand(rng, s, d), rand(rng, (), d, 5, 9)],
        lambda x, v, dtype, a=_low, b=_high, c=_interior: _pad_ref(x, v, dtype, a, b, c),
        attrs={"low": _low, "high": _high, "interior": _interior},
    )

for _shapes, _axis in (
    (((2,), (3,)), 0),
    (((2, 3), (2, 1), (2, 2)), 1),
    (((1, 3), (2, 3)), 0),
    (((2, 3),), 0),
    (((0, 3), (2, 3), (0, 3)), 0),
    (((2, 1, 2), (2, 2, 2)), 1),
):
    add_row(
        f"concatenate-{'-'.join(_shape_id(s) for s in _shapes)}-axis{_axis}",
        "concatenate",
        ALL,
        lambda rng, d, ss=_shapes: [rand(rng, s, d) for s in ss],
        lambda *xs, dtype, a=_axis: np.concatenate(xs, axis=a),
        attrs={"axis": _axis},
    )


def _gather_ref(x, idx, dtype, axis):
    clamped = np.minimum(np.maximum(idx, 0), x.shape[axis] - 1)
    picked = np.moveaxis(x, axis, 0)[clamped]  # idx dims first, then x's other dims
    return np.moveaxis(picked, tuple(range(idx.ndim)), tuple(range(axis, axis + idx.ndim)))


def _scatter_add_ref(x, idx, updates, dtype, axis):
    out = np.moveaxis(x.copy(), axis, 0)
    upd = np.moveaxis(updates, tuple(range(axis, axis + idx.ndim)), tuple(range(idx.ndim)))
    for pos in np.ndindex(*idx.shape):
        out[min(max(int(idx[pos]), 0), x.shape[axis] - 1)] += upd[pos]
    return np.moveaxis(out, 0, axis)


for _in, _indices, _axis in (
    ((5,), [0, 4, 2], 0),
    ((5, 3), [[1, 0], [4, 4]], 0),
    ((2, 5, 3), [3, 0, 1, 3], 1),
    ((4, 3), [2], 1),
    ((4,), [-1, -7, 4, 9], 0),
    ((3, 4), [], 1),
    ((6,), 2, 0),
    ((3, 0), [1, 2], 0),
    ((0, 2), [], 0),
):
    add_row(
        f"gather-{_shape_id(_in)}-{np.asarray(_indices).tolist()}-axis{_axis}",
        "gather",
        ALL,
        lambda rng, d, s=_in, i=_indices: [rand(rng, s, d, -10, 10), np.asarray(i, np.int64).astype(np.int32)],
        lambda x, i, dtype, a=_axis: _gather_ref(x, i, dtype, a),
        attrs={"axis": _axis},
    )
    # Updates equal the gather's result shape; duplicate and out-of-range indices accumulate.
    _upd_shape = _in[:_axis] + np.shape(_indices) + _in[_axis + 1 :]
    add_row(
        f"scatter_add-{_shape_id(_in)}-{np.asarray(_indices).tolist()}-axis{_axis}",
        "scatter_add",
        NUMERIC,
        lambda rng, d, s=_in, i=_indices, u=_upd_shape: [
            rand(rng, s, d, -10, 10),
            np.asarray(i, np.int64),
            rand(rng, u, d, -10, 10),
        ],
        lambda x, i, u, dtype, a=_axis: _scatter_add_ref(x, i, u, dtype, a),
        attrs={"axis": _axis},
        tol_scale=4.0,
    )
add_row(
    "scatter_add-duplicates",
    "scatter_add",
    NUMERIC,
    lambda rng, d: [literal([0, 0, 0], d), np.array([1, 1, 1, -5, 2, 7]), literal([1, 2, 3, 4, 5, 6], d)],
    lambda x, i, u, dtype: np.array([4, 6, 11]),
    attrs={"axis": 0},
)


# --- sort ---------------------------------------------------------------------------------------------------


def _positions(shape, axis, dtype):
    """0, 1, 2, ... along `axis`: the payload that shows where each sorted element came from."""
    ramp = np.arange(shape[axis]).reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return np.broadcast_to(ramp, shape).astype(dtype.np_dtype)


def _sort_ref(keys, *payloads, dtype, axis):
    """Stable ascending order of the keys (numpy's argsort puts nans last), applied to every operand."""
    order = np.argsort(keys, axis=axis, kind="stable")
    out = [np.take_along_axis(x, order, axis=axis) for x in (keys, *payloads)]
    return out if payloads else out[0]


for _shape, _axis in (((5,), 0), ((3, 4), 1), ((3, 4), 0), ((2, 3, 4), 1), ((2, 37), 1), ((3, 1), 1), ((0, 3), 1)):
    # Few distinct keys: many ties, whose order the payloads (positions) reveal.
    add_row(
        f"sort-{_shape_id(_shape)}-axis{_axis}",
        "sort",
        ALL,
        lambda rng, d, s=_shape: [small_ints(rng, s, d, -3, 3)],
        lambda x, dtype, a=_axis: _sort_ref(x, dtype=dtype, axis=a),
        attrs={"axis": _axis},
    )
    add_row(
        f"sort-{_shape_id(_shape)}-axis{_axis}-payloads",
        "sort",
        NUMERIC,
        lambda rng, d, s=_shape, a=_axis: [
            small_ints(rng, s, d, -3, 3),
            _positions(s, a, d),
            rand(rng, s, d),
        ],
        lambda x, p, q, dtype, a=_axis: _sort_ref(x, p, q, dtype=dtype, axis=a),
        attrs={"axis": _axis},
    )
add_row(
    "sort-special",
    "sort",
    FLOATS,
    lambda rng, d: [literal([[np.nan, 1.0, -np.inf, 0.0, -0.0, np.inf, np.nan, -2.0, 1.0]], d)],
    lambda x, dtype: _sort_ref(x, dtype=dtype, axis=1),
    attrs={"axis": 1},
)
add_row(
    "sort-index-payload",
    "sort",
    FLOATS,
    lambda rng, d: [literal([[2.0, np.nan, 0.0, -0.0, 2.0, np.nan, -1.0]], d), np.arange(7, dtype=np.int64)[None]],
    lambda x, p, dtype: _sort_ref(x, p, dtype=dtype, axis=1),
    attrs={"axis": 1},
)
add_row(
    "sort-long",
    "sort",
    (F32, I32),
    lambda rng, d: [rand(rng, (3, 1000), d, -500, 500)],
    lambda x, dtype: _sort_ref(x, dtype=dtype, axis=1),
    attrs={"axis": 1},
)


# --- reductions --------------------------------------------------------------------------------------------


def _reduce_ref(kind, x, dtype, axes):
    axes = tuple(axes)
    if kind == "sum":
        return np.sum(x, axis=axes)
    if kind == "prod":
        return np.prod(x, axis=axes)
    if dtype.is_float:
        init = -np.inf if kind == "max" else np.inf
    else:
        info = np.iinfo(dtype.np_dtype)
        init = int(info.min) if kind == "max" else int(info.max)
    fn = np.max if kind == "max" else np.min
    return fn(x, axis=axes, initial=init)


def _reduce_input(rng, shape, dtype, kind):
    if kind == "prod":  # products of 24 values stay in range for f16 and i32
        return rand(rng, shape, dtype, 0.5, 1.5) if dtype.is_float else small_ints(rng, shape, dtype)
    return rand(rng, shape, dtype, -9, 9)


_REDUCE_SHAPES = (
    ((5,), (0,)),
    ((2, 3, 4), (1,)),
    ((2, 3, 4), (0, 2)),
    ((2, 3, 4), (0, 1, 2)),
    ((2, 3, 4), ()),
    ((), ()),
    ((1, 7), (1,)),
    ((37, 5), (1,)),  # short rows: tiles of whole rows, a partial last one
    ((2, 19, 3), (2,)),
    ((0, 3), (0,)),
    ((0, 3), (1,)),
    ((3, 0), (0, 1)),
    ((300, 1100), (0, 1)),  # whole and large: f32/f64 call the reduction library, in pieces over the cores
)
for _kind in ("sum", "max", "min", "prod"):
    for _shape, _axes in _REDUCE_SHAPES:
        _count = math.prod(_shape[a] for a in _axes)
        add_row(
            f"reduce_{_kind}-{_shape_id(_shape)}-axes{''.join(map(str, _axes))}",
            f"reduce_{_kind}",
            NUMERIC,
            lambda rng, d, s=_shape, k=_kind: [_reduce_input(rng, s, d, k)],
            lambda x, dtype, k=_kind, a=_axes: _reduce_ref(k, x, dtype, a),
            attrs={"axes": _axes},
            tol_scale=max(_count, 1),
        )
    add_row(
        f"reduce_{_kind}-special",
        f"reduce_{_kind}",
        FLOATS,
        lambda rng, d: [literal([[1.0, np.nan, 2.0], [np.inf, 1.0, 2.0], [-np.inf, np.inf, 0.5]], d)],
        lambda x, dtype, k=_kind: _reduce_ref(k, x, dtype, (1,)),
        attrs={"axes": (1,)},
    )


def _cumsum_ref(x, dtype, axis, reverse):
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis=axis), axis)
    return np.cumsum(x, axis=axis)


_CUMSUM_DTYPES = (I32, I64, F32, F64)  # the frontend sums bools as int64, half types in float32
# (shape, axis) of the scans (cumsum, linear_recurrence): each kind of block of `lower_scan`.
_SCAN_SHAPES = (
    ((5,), 0),
    ((3, 4), 1),
    ((3, 4), 0),
    ((2, 3, 4), 1),
    ((2, 3, 4), 2),
    ((37, 5), 0),  # columns narrower than a vector, rows not a whole number of groups
    ((19, 70), 1),  # the last axis: groups of rows, a partial last group
    ((3, 40, 24), 1),  # a block of one vector's columns and a narrower one
    ((1, 1), 0),
    ((0, 3), 1),
)


def _recurrence_ref(a, b, dtype, axis, reverse):
    """h[0] = b[0], h[i] = a[i] * h[i-1] + b[i] along `axis` (from the end when `reverse`), in float64."""
    a, b = np.moveaxis(np.asarray(a, np.float64), axis, 0), np.moveaxis(np.asarray(b, np.float64), axis, 0)
    order = range(len(a) - 1, -1, -1) if reverse else range(len(a))
    out, h = np.empty_like(b), None
    for i in order:
        h = b[i] if h is None else a[i] * h + b[i]
        out[i] = h
    return np.moveaxis(out, 0, axis)


for _shape, _axis in _SCAN_SHAPES:
    for _reverse in (False, True):
        _case = f"{_shape_id(_shape)}-axis{_axis}{'-reverse' if _reverse else ''}"
        _scan_attrs = {"axis": _axis, "reverse": _reverse}
        add_row(
            f"cumsum-{_case}",
            "cumsum",
            _CUMSUM_DTYPES,
            lambda rng, d, s=_shape: [rand(rng, s, d, -9, 9)],
            lambda x, dtype, a=_axis, r=_reverse: _cumsum_ref(x, dtype, a, r),
            attrs=_scan_attrs,
            tol_scale=max(_shape[_axis], 1),
        )
        add_row(
            f"linear_recurrence-{_case}",
            "linear_recurrence",
            _CUMSUM_DTYPES,
            lambda rng, d, s=_shape: [
                rand(rng, s, d, 0.5, 1.5) if d.is_float else small_ints(rng, s, d),
                rand(rng, s, d, -2, 2) if d.is_float else small_ints(rng, s, d),
            ],
            lambda a, b, dtype, x=_axis, r=_reverse: _recurrence_ref(a, b, dtype, x, r),
            attrs=_scan_attrs,
            tol_scale=max(_shape[_axis], 1) * 4,
        )
add_row(
    "cumsum-special",
    "cumsum",
    (F32, F64),
    lambda rng, d: [literal([[1.0, np.inf, 2.0, np.nan, 3.0], [-np.inf, 1.0, np.inf, 1.0, 1.0]], d)],
    lambda x, dtype: _cumsum_ref(x, dtype, 1, False),
    attrs={"axis": 1, "reverse": False},
)


def _arg_ref(kind, x, dtype, axis):
    """Index of the first extreme along `axis`, found by masking (not numpy.argmax)."""
    extreme = np.max(x, axis=axis, keepdims=True) if kind == "argmax" else np.min(x, axis=axis, keepdims=True)
    n = x.shape[axis]
    positions = np.arange(n).reshape([n if i == axis else 1 for i in range(x.ndim)])
    return np.min(np.where(x == extreme, positions, n), axis=axis)


for _kind in ("argmax", "argmin"):
    for _shape, _axis, _idx in (
        ((5,), 0, I64),
        ((3, 4), 0, I32),
        ((3, 4), 1, I64),
        ((2, 3, 4), 2, I32),
        ((37, 5), 1, I64),  # short rows: a vector of rows per step, a partial last tile
        ((0, 2), 1, I64),
    ):
        add_row(
            f"{_kind}-{_shape_id(_shape)}-axis{_axis}-{_idx.name}",
            _kind,
            NUMERIC,
            lambda rng, d, s=_shape: [small_ints(rng, s, d, -1, 1)],  # many ties: the first index wins
            lambda x, dtype, k=_kind, a=_axis: _arg_ref(k, x, dtype, a),
            attrs={"axis": _axis, "index_dtype": _idx},
            out_dtype=_idx,
        )
    add_row(
        f"{_kind}-nan",
        _kind,
        FLOATS,
        lambda rng, d: [literal([[1.0, np.nan, 3.0, np.nan], [np.inf, 1.0, -np.inf, np.inf]], d)],
        lambda x, dtype, k=_kind: np.array([1, 0 if k == "argmax" else 2]),
        attrs={"axis": 1, "index_dtype": I64},
        out_dtype=I64,
    )


# --- contractions -------------------------------------------------------------------------------------------


def _dot_general_ref(a, b, dtype, lhs_contract, rhs_contract, lhs_batch, rhs_batch):
    """Move dims to (batch, free, contract) x (batch, contract, free) and use matmul."""
    lf = [i for i in range(a.ndim) if i not in lhs_contract and i not in lhs_batch]
    rf = [i for i in range(b.ndim) if i not in rhs_contract and i not in rhs_batch]
    batch = [a.shape[i] for i in lhs_batch]
    a3 = np.transpose(a, list(lhs_batch) + lf + list(lhs_contract))
    b3 = np.transpose(b, list(rhs_batch) + list(rhs_contract) + rf)
    k = math.prod(a.shape[i] for i in lhs_contract)
    m = math.prod(a.shape[i] for i in lf)
    n = math.prod(b.shape[i] for i in rf)
    out = np.matmul(a3.reshape(batch + [m, k]).astype(np.float64), b3.reshape(batch + [k, n]).astype(np.float64))
    return out.reshape(batch + [a.shape[i] for i in lf] + [b.shape[i] for i in rf])


for _name, _sa, _sb, _dims in (
    ("matmul", (3, 4), (4, 5), ((1,), (0,), (), ())),
    ("vector", (4,), (4,), ((0,), (0,), (), ())),
    ("matvec", (3, 4), (4,), ((1,), (0,), (), ())),
    ("batched", (2, 3, 4), (2, 4, 5), ((2,), (1,), (0,), (0,))),
    ("two-contracting", (2, 3, 4), (3, 4, 5), ((1, 2), (0, 1), (), ())),
    ("batch-in-middle", (3, 2, 4), (4, 2, 5), ((2,), (0,), (1,), (1,))),
    ("transposed-operands", (4, 3), (5, 4), ((0,), (1,), (), ())),
    ("outer", (3,), (2,), ((), (), (), ())),
    ("empty-contraction", (3, 0), (0, 2), ((1,), (0,), (), ())),
    ("size-1", (1, 1), (1, 1), ((1,), (0,), (), ())),
    # Large enough (on two or more cores) for the matmul library's calls (matmul_library.py) in
    # f32/f64: columns split with a partial panel and leftover rows, B given as (N, K), A given as
    # (K, M), and a narrow product split by rows.
    ("library", (150, 96), (96, 300), ((1,), (0,), (), ())),
    ("library-rhs-rows", (150, 96), (300, 96), ((1,), (1,), (), ())),
    ("library-lhs-columns", (96, 150), (96, 300), ((0,), (0,), (), ())),
    ("library-narrow", (600, 256), (256, 20), ((1,), (0,), (), ())),
    # Fewer columns than a vector (lower_dot._lower_with_dot_blocks in f32/f64): blocks of
    # rows with a last block of the rows left over, a masked last step of K, B given as (N, K).
    ("few-columns", (37, 300), (300, 10), ((1,), (0,), (), ())),
    ("few-columns-rhs-rows", (37, 300), (6, 300), ((1,), (1,), (), ())),
):
    add_row(
        f"dot_general-{_name}",
        "dot_general",
        NUMERIC,
        lambda rng, d, a=_sa, b=_sb: [small_ints(rng, a, d, -3, 3), rand(rng, b, d)],
        lambda a, b, dtype, k=_dims: _dot_general_ref(a, b, dtype, *k),
        attrs=dict(zip(("lhs_contract", "rhs_contract", "lhs_batch", "rhs_batch"), _dims)),
        # sums of K products of up to 3 in magnitude: the absolute part grows with K
        tol_scale=max(12.0, 3.0 * math.prod(_sa[i] for i in _dims[0])),
    )


def _conv2d_ref(x, w, dtype, stride, padding, dilation):
    xp = np.pad(x, ((0, 0), (0, 0), tuple(padding[0]), tuple(padding[1])))
    kh, kw = w.shape[2:]
    oh = (xp.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (xp.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for r in range(oh):
        for c in range(ow):
            r0, c0 = r * stride[0], c * stride[1]
            window = xp[
                :,
                :,
                r0 : r0 + dilation[0] * (kh - 1) + 1 : dilation[0],
                c0 : c0 + dilation[1] * (kw - 1) + 1 : dilation[1],
            ]
            out[:, :, r, c] = np.tensordot(window, w, axes=([1, 2, 3], [1, 2, 3]))
    return out


for _name, _xs, _ws, _stride, _padding, _dilation in (
    ("plain", (1, 2, 5, 5), (3, 2, 3, 3), (1, 1), ((0, 0), (0, 0)), (1, 1)),
    ("stride2-pad1", (2, 2, 6, 5), (3, 2, 3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1)),
    ("dilation2", (1, 1, 7, 7), (2, 1, 3, 3), (1, 1), ((0, 0), (0, 0)), (2, 2)),
    ("asymmetric", (1, 3, 4, 6), (2, 3, 2, 3), (1, 2), ((0, 1), (2, 0)), (2, 1)),
    ("1x1", (2, 4, 3, 3), (5, 4, 1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1)),
):
    add_row(
        f"conv2d-{_name}",
        "conv2d",
        FLOATS,
        lambda rng, d, a=_xs, b=_ws: [rand(rng, a, d, -1, 1), rand(rng, b, d, -1, 1)],
        lambda x, w, dtype, s=_stride, p=_padding, di=_dilation: _conv2d_ref(x, w, dtype, s, p, di),
        attrs={"stride": _stride, "padding": _padding, "dilation": _dilation},
        tol_scale=16.0,
    )


def _reduce_window_ref(x, dtype, kind, window, strides, padding):
    if kind == "max":
        fill = -np.inf if dtype.is_float else int(np.iinfo(dtype.np_dtype).min)
    else:
        fill = 0
    xp = np.pad(x, [tuple(p) for p in padding], constant_values=fill)
    out_shape = [(d - w) // s + 1 for d, w, s in zip(xp.shape, window, strides)]
    out = np.zeros(out_shape, xp.dtype)
    for pos in np.ndindex(*out_shape):
        block = xp[tuple(slice(p * s, p * s + w) for p, s, w in zip(pos, strides, window))]
        out[pos] = block.max() if kind == "max" else block.sum()
    return out / math.prod(window) if kind == "avg" else out


for _name, _in, _window, _strides, _padding in (
    ("pool2x2", (1, 2, 4, 4), (1, 1, 2, 2), (1, 1, 2, 2), ((0, 0), (0, 0), (0, 0), (0, 0))),
    ("3x3-same", (1, 1, 4, 5), (1, 1, 3, 3), (1, 1, 1, 1), ((0, 0), (0, 0), (1, 1), (1, 1))),
    ("1d-stride2", (7,), (3,), (2,), ((1, 1),)),
    ("asymmetric", (2, 5), (2, 3), (1, 2), ((1, 0), (0, 2))),
):
    for _kind in ("max", "sum", "avg"):
        add_row(
            f"reduce_window-{_kind}-{_name}",
            "reduce_window",
            FLOATS if _kind == "avg" else NUMERIC,
            lambda rng, d, s=_in: [rand(rng, s, d, -9, 9)],
            lambda x, dtype, k=_kind, w=_window, st=_strides, p=_padding: _reduce_window_ref(x, dtype, k, w, st, p),
            attrs={"kind": _kind, "window": _window, "strides": _strides, "padding": _padding},
            tol_scale=math.prod(_window),
        )


# --- control flow ---------------------------------------------------------------------------------------


def region(name: str, param_types, body: Callable) -> Graph:
    """A region graph: `body(graph, *params)` emits its ops and returns the yielded values."""
    graph = Graph(name)
    params = [graph.add_param(t, f"a{i}") for i, t in enumerate(param_types)]
    graph.results = list(body(graph, *params))
    return graph


def _op1(graph, name, *operands, **attrs):
    return emit(graph, name, list(operands), attrs).result


def _const(graph, value, dtype):
    return _op1(graph, "constant", value=np.asarray(value, dtype.np_dtype))


def _cond_regions(dtype):
    t = TensorType((2, 3), dtype)
    # true: (x + y, x); false: (y, x): two operands, two results.
    true = region("true", [t, t], lambda g, x, y: [_op1(g, "add", x, y), x])
    false = region("false", [t, t], lambda g, x, y: [y, x])
    return [true, false]


for _pred in (True, False):
    add_row(
        f"cond-{str(_pred).lower()}",
        "cond",
        NUMERIC,
        lambda rng, d, p=_pred: [np.asarray(p), rand(rng, (2, 3), d, -9, 9), rand(rng, (2, 3), d, -9, 9)],
        lambda p, x, y, dtype: [x + y, x] if p else [y, x],
        regions=_cond_regions,
    )


# Loop rows use small integral values, so every dtype computes them exactly.
def _while_regions(dtype):
    types = [TensorType((), I32), TensorType((3,), dtype), TensorType((3,), dtype)]  # i, acc | step
    cond = region("cond", types, lambda g, i, acc, step: [_op1(g, "lt", i, _const(g, 5, I32))])
    body = region(
        "body", types, lambda g, i, acc, step: [_op1(g, "add", i, _const(g, 1, I32)), _op1(g, "add", acc, step)]
    )
    return [cond, body]


for _start in (0, 3, 7):  # five, two and zero iterations
    add_row(
        f"while-from{_start}",
        "while",
        NUMERIC,
        lambda rng, d, s=_start: [
            np.asarray(s, np.int32),
            small_ints(rng, (3,), d, -9, 9),
            small_ints(rng, (3,), d, -3, 3),
        ],
        lambda i, acc, step, dtype: [np.maximum(i, 5), acc + max(5 - int(i), 0) * step],
        attrs={"num_carry": 2},
        regions=_while_regions,
    )


def _for_regions(dtype):
    types = [TensorType((), I64), TensorType((2,), dtype), TensorType((2,), dtype)]  # i, acc | scale
    body = region(
        "body",
        types,
        lambda g, i, acc, scale: [
            _op1(
                g,
                "add",
                acc,
                _op1(g, "mul", scale, _op1(g, "broadcast", _op1(g, "convert", i, dtype=dtype), shape=(2,), dims=())),
            ),
        ],
    )
    return [body]


for _lo, _hi in ((0, 4), (-2, 3), (5, 5), (6, 2)):
    add_row(
        f"for-{_lo}-to-{_hi}",
        "for",
        NUMERIC,
        lambda rng, d, lo=_lo, hi=_hi: [
            np.asarray(lo),
            np.asarray(hi),
            small_ints(rng, (2,), d, -9, 9),
            small_ints(rng, (2,), d, -2, 2),
        ],
        lambda lo, hi, acc, scale, dtype: acc + scale * sum(range(int(lo), int(hi))),
        attrs={"num_carry": 1},
        regions=_for_regions,
    )


def _fusion_loop_regions(dtype):
    t = TensorType((3, 4), dtype)
    # (x * y + x, max(x, y)): an elementwise group with two outputs.
    body = region("fused", [t, t], lambda g, x, y: [_op1(g, "add", _op1(g, "mul", x, y), x), _op1(g, "max", x, y)])
    return [body]


add_row(
    "fusion-loop",
    "fusion",
    FLOATS,
    lambda rng, d: [rand(rng, (3, 4), d, -2, 2), rand(rng, (3, 4), d, -2, 2)],
    lambda x, y, dtype: [x * y + x, np.maximum(x, y)],
    attrs={"kind": "loop"},
    regions=_fusion_loop_regions,
)


def _fusion_reduction_regions(dtype):
    t = TensorType((3, 4), dtype)

    def body(g, x):
        peak = _op1(g, "reduce_max", x, axes=(1,))
        shifted = _op1(g, "sub", x, _op1(g, "broadcast", peak, shape=(3, 4), dims=(0,)))
        return [_op1(g, "reduce_sum", _op1(g, "exp", shifted), axes=(1,))]

    return [region("fused", [t], body)]


add_row(
    "fusion-reduction",
    "fusion",
    FLOATS,
    lambda rng, d: [rand(rng, (3, 4), d, -2, 2)],
    lambda x, dtype: np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1),
    attrs={"kind": "reduction"},
    regions=_fusion_reduction_regions,
)


def _fusion_rows_regions(dtype):
    # Two dependent row reductions, a per-column input and two outputs (full, per row): the CPU
    # backend runs it as a loop over tiles of rows (37 is no multiple of the tile: a last, larger tile).
    t, column = TensorType((37, 1000), dtype), TensorType((1000,), dtype)

    def body(g, x, gamma):
        count = _op1(g, "broadcast", _const(g, 1000.0, dtype), shape=(37,), dims=())
        mean = _op1(g, "div", _op1(g, "reduce_sum", x, axes=(1,)), count)
        centered = _op1(g, "sub", x, _op1(g, "broadcast", mean, shape=(37, 1000), dims=(0,)))
        spread = _op1(g, "reduce_max", _op1(g, "abs", centered), axes=(1,))
        scaled = _op1(g, "div", centered, _op1(g, "broadcast", spread, shape=(37, 1000), dims=(0,)))
        return [_op1(g, "mul", scaled, _op1(g, "broadcast", gamma, shape=(37, 1000), dims=(1,))), mean]

    return [region("fused", [t, column], body)]


def _fusion_rows_reference(x, gamma, dtype):
    mean = x.sum(axis=1) / 1000
    centered = x - mean[:, None]
    return [centered / np.abs(centered).max(axis=1, keepdims=True) * gamma, mean]


add_row(
    "fusion-rows",
    "fusion",
    FLOATS,
    lambda rng, d: [rand(rng, (37, 1000), d, -2, 2), rand(rng, (1000,), d, 0.5, 2)],
    _fusion_rows_reference,
    attrs={"kind": "reduction"},
    regions=_fusion_rows_regions,
)


def _nn_graph(fn):
    """The optimized graph of `flowjit.nn`'s `fn` for the row's inputs: one fusion region that the
    CPU backend runs as a row library call (f32/f64 rows of 512 floats or more, or shorter ones in
    small inputs: row_library.py)."""

    def build(inputs, attrs):
        from flowjit.frontend.jit import optimized_graph
        from flowjit.frontend.signature import ShapeDtype

        return optimized_graph(fn, *[ShapeDtype(a.shape, a.dtype) for a in inputs])

    return build


def _softmax_ref(x, dtype):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _layer_norm_ref(x, gamma, beta, dtype):
    centered = x - x.mean(axis=-1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(axis=-1, keepdims=True) + 1e-5) * gamma + beta


def _rms_norm_ref(x, gamma, dtype):
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + 1e-6) * gamma


def _nn(name):
    def call(*args):
        import flowjit.nn as nn

        return getattr(nn, name)(*args)

    return call


_ROW_INPUTS = lambda rng, d: [rand(rng, (37, 1040), d, -4, 4)]  # noqa: E731 (a partial last chunk)
_NORM_INPUTS = lambda rng, d: [
    rand(rng, (37, 1040), d, -2, 2),
    rand(rng, (1040,), d, 0.5, 2),
    rand(rng, (1040,), d, -1, 1),
]  # noqa: E731
add_row("fusion-row-library-softmax", "fusion", FLOATS, _ROW_INPUTS, _softmax_ref, graph=_nn_graph(_nn("softmax")))
add_row(
    "fusion-row-library-log_softmax",
    "fusion",
    FLOATS,
    _ROW_INPUTS,
    lambda x, dtype: np.log(_softmax_ref(x, dtype)),
    graph=_nn_graph(_nn("log_softmax")),
)
add_row(
    "fusion-row-library-layer_norm", "fusion", FLOATS, _NORM_INPUTS, _layer_norm_ref, graph=_nn_graph(_nn("layer_norm"))
)
add_row(
    "fusion-row-library-rms_norm",
    "fusion",
    FLOATS,
    lambda rng, d: _NORM_INPUTS(rng, d)[:2],
    _rms_norm_ref,
    graph=_nn_graph(_nn("rms_norm")),
)
# Short rows in a small input (row_library.SMALL_INPUT_BYTES): the library too, for f32/f64.
add_row(
    "fusion-row-library-short-softmax",
    "fusion",
    FLOATS,
    lambda rng, d: [rand(rng, (48, 128), d, -4, 4)],
    _softmax_ref,
    graph=_nn_graph(_nn("softmax")),
)
add_row(
    "fusion-row-library-short-layer_norm",
    "fusion",
    FLOATS,
    lambda rng, d: [rand(rng, (48, 128), d, -2, 2), rand(rng, (128,), d, 0.5, 2), rand(rng, (128,), d, -1, 1)],
    _layer_norm_ref,
    graph=_nn_graph(_nn("layer_norm")),
)


def _conv_pool(kind):
    def layer(x, w, b):
        import flowjit.nn as nn

        act = nn.relu(nn.conv2d(x, w, b, padding=1))
        return nn.max_pool2d(act, 2) if kind == "max" else nn.avg_pool2d(act, 3)

    return layer


def _conv_pool_ref(kind):
    def ref(x, w, b, dtype):
        act = np.maximum(_conv2d_ref(x, w, dtype, (1, 1), ((1, 1), (1, 1)), (1, 1)) + b.reshape(1, -1, 1, 1), 0)
        n, c, h, wid = act.shape
        k = 2 if kind == "max" else 3
        windows = act[:, :, : h // k * k, : wid // k * k].reshape(n, c, h // k, k, wid // k, k)
        return windows.max(axis=(3, 5)) if kind == "max" else windows.mean(axis=(3, 5))

    return ref


# Pooling fused into a conv's epilogue (fuse._tiling_pool): each chunk of the conv's output pooled in
# cache; odd sizes leave the last rows and columns out. float32/float64 (others pool on their own).
for _kind, _xs in (("max", (3, 2, 13, 11)), ("avg", (2, 3, 10, 14))):
    add_row(
        f"fusion-conv-{_kind}-pool",
        "fusion",
        FLOATS,
        lambda rng, d, a=_xs: [rand(rng, a, d, -1, 1), rand(rng, (16, a[1], 3, 3), d, -1, 1), rand(rng, (16,), d)],
        _conv_pool_ref(_kind),
        graph=_nn_graph(_conv_pool(_kind)),
        tol_scale=16.0,
    )


def _fusion_rows_shared_exp_regions(dtype):
    # Softmax: exp(x - max) is read by the row sum and by the division, so a row tile computes it
    # once into the output's tile and divides it in place (37 rows: a loop and a last, larger tile).
    t = TensorType((37, 1000), dtype)

    def body(g, x):
        peak = _op1(g, "broadcast", _op1(g, "reduce_max", x, axes=(1,)), shape=(37, 1000), dims=(0,))
        e = _op1(g, "exp", _op1(g, "sub", x, peak))
        total = _op1(g, "broadcast", _op1(g, "reduce_sum", e, axes=(1,)), shape=(37, 1000), dims=(0,))
        return [_op1(g, "div", e, total)]

    return [region("fused", [t], body)]


def _fusion_rows_shared_exp_reference(x, dtype):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


add_row(
    "fusion-rows-shared-exp",
    "fusion",
    FLOATS,
    lambda rng, d: [rand(rng, (37, 1000), d, -3, 3)],
    _fusion_rows_shared_exp_reference,
    attrs={"kind": "reduction"},
    regions=_fusion_rows_shared_exp_regions,
)


def _tap(x, start, stride, shape):
    """x[start::stride] cut to `shape`: the numpy reference of a slice."""
    return x[tuple(slice(a, a + st * (n - 1) + 1, st) for a, st, n in zip(start, stride, shape))]


def _slice_op(g, x, start, stride, shape):
    limit = tuple(a + st * (n - 1) + 1 for a, st, n in zip(start, stride, shape))
    return _op1(g, "slice", x, start=start, limit=limit, stride=stride)


# Fused slices (strided views of a group input): taps (start, stride) of x and of a bool mask. `a`
# is read by two members and returned as well (a copy of it is the group's result); the second
# shape is large enough for the parallel, vectorized n-d schedule (unaligned and strided rows).
_SLICE_FUSIONS = (
    ((5, 6, 9), (3, 5, 3), ((0, 1, 0), (2, 1, 3)), ((1, 0, 2), (1, 1, 3)), ((2, 1, 0), (1, 1, 4))),
    (
        (4, 40, 66, 70),
        (4, 40, 64, 33),
        ((0, 0, 1, 1), (1, 1, 1, 2)),
        ((0, 0, 2, 2), (1, 1, 1, 2)),
        ((0, 0, 0, 3), (1, 1, 1, 1)),
    ),
)


def _fusion_slices_regions(dtype, shape, out, ta, tb, tm):
    def body(g, x, mask):
        a, b = _slice_op(g, x, *ta, out), _slice_op(g, x, *tb, out)
        return [_op1(g, "select", _slice_op(g, mask, *tm, out), a, b), _op1(g, "eq", a, b), a]

    return [region("fused", [TensorType(shape, dtype), TensorType(shape, BOOL)], body)]


def _fusion_slices_reference(x, mask, dtype, out, ta, tb, tm):
    a, b = _tap(x, *ta, out), _tap(x, *tb, out)
    return [np.where(_tap(mask, *tm, out), a, b), a == b, a]


for _shape, _out, _ta, _tb, _tm in _SLICE_FUSIONS:
    add_row(
        f"fusion-slices-{_shape_id(_shape)}",
        "fusion",
        ALL,
        lambda rng, d, s=_shape: [small_ints(rng, s, d, 0, 3), rand(rng, s, BOOL)],
        lambda x, mask, dtype, o=_out, a=_ta, b=_tb, m=_tm: _fusion_slices_reference(x, mask, dtype, o, a, b, m),
        attrs={"kind": "loop"},
        regions=lambda dtype, s=_shape, o=_out, a=_ta, b=_tb, m=_tm: _fusion_slices_regions(dtype, s, o, a, b, m),
    )


# --- ops for differentiation: identities on values ---------------------------------------------------------

for _shape in ELEMENTWISE_SHAPES:
    add_row(
        f"stop_gradient-{_shape_id(_shape)}",
        "stop_gradient",
        ALL,
        lambda rng, d, s=_shape: [rand(rng, s, d)],
        lambda x, dtype: x,
    )
for _shapes, _num_inputs, _num_residuals in (
    (((2,), (3,), (2,)), 1, 1),
    (((4,), (2, 2), (4,), ()), 1, 1),
    (((3,),), 0, 0),
):
    add_row(
        f"custom_vjp_call-{len(_shapes)}-operands-{_num_inputs}-{_num_residuals}",
        "custom_vjp_call",
        ALL,
        lambda rng, d, ss=_shapes: [rand(rng, s, d) for s in ss],
        lambda *xs, dtype, n=_num_inputs + _num_residuals: list(xs[n:]),
        attrs={"rule": 0, "num_inputs": _num_inputs, "num_residuals": _num_residuals},
    )


# --- state ------------------------------------------------------------------------------------------------


def _state_graph(op):
    """v = x0; op(v, x1) (for updates); return read(v): the result shows the variable's new value."""

    def build(inputs, attrs):
        graph = Graph(op)
        params = [graph.add_param(TensorType(a.shape, dt.dtype(a.dtype)), f"x{i}") for i, a in enumerate(inputs)]
        emit(graph, "assign", params[:1], attrs)
        if op != "read_variable":
            emit(graph, op, params[1:2], attrs)
        graph.results = [emit(graph, "read_variable", [], attrs).result]
        return graph

    return build


_STATE_REFS = {
    "read_variable": lambda x0, x1, dtype: x0,
    "assign": lambda x0, x1, dtype: x1,
    "assign_add": lambda x0, x1, dtype: x0 + x1,
    "assign_sub": lambda x0, x1, dtype: x0 - x1,
}
for _op, _ref in _STATE_REFS.items():
    for _shape in ((), (2, 3)):
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            ALL if _op in ("read_variable", "assign") else NUMERIC,
            lambda rng, d, s=_shape, op=_op: (
                [rand(rng, s, d, -50, 50)] + ([] if op == "read_variable" else [rand(rng, s, d, -50, 50)])
            ),
            lambda x0, x1=None, dtype=None, f=_ref: f(x0, x1, dtype),
            attrs=lambda d, s=_shape: {"var": "v", "shape": s, "dtype": d},
            graph=_state_graph(_op),
        )


# --- communication -------------------------------------------------------------------------------------


def _sent_to_itself(name: str, inputs, src: str) -> tuple[Graph, Value]:
    """A graph that sends its parameter x from device `src` to another (cpu:1, or cpu:0 when `src`
    is another task's) and receives it: send x; r = recv; send_done x. Returns the graph and r."""
    graph = Graph(name)
    (x,) = [graph.add_param(TensorType(a.shape, dt.dtype(a.dtype)), "x") for a in inputs]
    dst = "cpu:1" if src == "cpu:0" else "cpu:0"
    keys = {"key": f"{src}->{dst}:%x", "src": src, "dst": dst}
    emit(graph, "send", [x], keys)
    received = emit(graph, "recv", [], {**keys, "shape": x.type.shape, "dtype": x.type.dtype}).result
    emit(graph, "send_done", [x], {})
    return graph, received


def _loopback_graph(inputs, attrs):
    """send x; r = recv (same key); send_done x; return r: a function sending to itself."""
    graph, received = _sent_to_itself("loopback", inputs, "cpu:0")
    graph.results = [received]
    return graph


def _viewed_recv_graph(inputs, attrs):
    """The same with r from another task's device (so native code reads r where the channel holds
    it: `flowjit_recv_view`), returning r + r (r itself is no graph result, which would be copied)."""
    graph, received = _sent_to_itself("viewed_recv", inputs, "/job:worker/task:1/device:cpu:0")
    graph.results = [emit(graph, "add", [received, received], {}).result]
    return graph


for _op in ("send", "recv", "send_done"):
    for _shape in ((), (2, 3)):
        add_row(
            f"{_op}-{_shape_id(_shape)}",
            _op,
            ALL,
            lambda rng, d, s=_shape: [rand(rng, s, d)],
            lambda x, dtype: x,
            graph=_loopback_graph,
        )
for _shape in ((), (2, 3), (1000,)):
    add_row(
        f"recv-from-another-task-{_shape_id(_shape)}",
        "recv",
        NUMERIC,
        lambda rng, d, s=_shape: [rand(rng, s, d)],
        lambda x, dtype: x + x,
        graph=_viewed_recv_graph,
    )


def fresh_variables(graph: Graph) -> dict[str, np.ndarray]:
    """A zero buffer for every variable the graph's state ops name (by their `var` attribute)."""
    return {
        op.attrs["var"]: np.zeros(op.attrs["shape"], dt.dtype(op.attrs["dtype"]).np_dtype)
        for op in graph.walk()
        if "var" in op.attrs
    }


# --- expanding rows into cases ---------------------------------------------------------------------------


def _resolve(value, dtype):
    return value(dtype) if callable(value) else value


def single_op_graph(op: str, inputs: list[np.ndarray], attrs: dict, regions=()) -> Graph:
    """A graph whose params are `inputs`' types and whose results are op `op` applied to them."""
    graph = Graph(op)
    params = [graph.add_param(TensorType(a.shape, dt.dtype(a.dtype)), f"x{i}") for i, a in enumerate(inputs)]
    graph.results = list(emit(graph, op, params, attrs, regions=regions).results)
    return graph


def build_case(row: Row, dtype: dt.DType) -> OpCase:
    """Generate the inputs of `row` in `dtype` (seeded by the case id), its graph and expected results."""
    rng = np.random.default_rng(zlib.crc32(f"{row.name}-{dtype.name}".encode()))
    inputs = [np.asarray(a) for a in row.inputs(rng, dtype)]
    attrs = _resolve(row.attrs, dtype)
    if row.graph is not None:
        graph = row.graph(inputs, attrs)
    else:
        graph = single_op_graph(row.op, inputs, attrs, row.regions(dtype) if row.regions else ())
    out_dtype = _resolve(row.out_dtype, dtype) or dtype
    with np.errstate(all="ignore"):
        ref = row.ref(*(_wide(a) for a in inputs), dtype=dtype)
        refs = list(ref) if isinstance(ref, list | tuple) else [ref]
        # Results of multi-result ops (control flow, sort) keep their own types: each takes its
        # graph result's dtype.
        dtypes = [r.dtype for r in graph.result_types] if len(refs) > 1 or row.regions else [out_dtype] * len(refs)
        expected = [np.asarray(r).astype(d.np_dtype) for r, d in zip(refs, dtypes)]
    return OpCase(graph, inputs, expected, tolerance(out_dtype, row.tol_scale))


def cases() -> Iterator[tuple[str, OpCase]]:
    """Every (case id, OpCase) of the table, in table order."""
    for row in ROWS:
        for dtype in row.dtypes:
            yield f"{row.name}-{dtype.name}".replace(" ", ""), build_case(row, dtype)


def ops_with_rows() -> set[str]:
    return {row.op for row in ROWS}


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: Tol, what: str = "") -> None:
    """Equal dtype and shape; values within `tol` (exact for ints and bools), nan where nan."""
    actual = np.asarray(actual)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    if tol == EXACT or not _is_float_np(expected.dtype):
        np.testing.assert_array_equal(actual, expected, err_msg=what)
        return
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.astype(np.float64), rtol=tol.rtol, atol=tol.atol, err_msg=what
    )
