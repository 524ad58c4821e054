"""flowjit.numpy against numpy: each function eagerly on plain arrays and traced under `fj.jit`.

Traced functions run on the reference interpreter: what is under test here is the frontend
(broadcasting, promotion, indexing, the ops it emits); compiled numerics are checked against the
interpreter by the op table's backend tests.

Deliberate differences from numpy, asserted as such: Python scalars are weak (`f32 * 2.0` stays
f32, `i32 * 2.5` is f32), float math on ints and a lone Python float give float32, int + float
arrays give the float dtype (the JAX lattice), integer sums keep their dtype, and integer division
or remainder by zero gives 0.
"""

import functools
import math
import re
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.errors import FlowjitError

jit = functools.partial(fj.jit, target="interpreter")
bf16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(1234)


def f32(*shape, lo=-3.0, hi=3.0):
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def i32(*shape, lo=-9, hi=9):
    return RNG.integers(lo, hi + 1, shape).astype(np.int32)


X = f32(3, 4)
V = f32(4)
A3 = f32(2, 3, 4)
POS = f32(3, 4, lo=0.1, hi=5.0)
I = i32(3, 4)


def both(fn, *args):
    """`fn` evaluated eagerly and under jit (wrapped, so its defaulted parameters stay Python values)."""
    return {"eager": fn(*args), "jit": jit(lambda *xs: fn(*xs))(*args)}


def check(fn, *args, ref, dtype=None, rtol=2e-6, atol=1e-6, modes=("eager", "jit")):
    """fn(*args), eagerly and under jit, equals ref(*args) in shape, dtype (`dtype` overrides
    numpy's where flowjit deliberately differs) and value. Tuple results compare elementwise."""
    expected = ref(*args)
    expected = [np.asarray(e) for e in expected] if isinstance(expected, tuple) else [np.asarray(expected)]
    if dtype is not None:
        expected = [e.astype(dtype) for e in expected]
    results = both(fn, *args) if "eager" in modes else {"jit": jit(lambda *xs: fn(*xs))(*args)}
    for mode, out in results.items():
        out = [np.asarray(o) for o in out] if isinstance(out, tuple) else [np.asarray(out)]
        assert len(out) == len(expected), mode
        for got, want in zip(out, expected):
            _assert_equal_array(got, want, rtol, atol, mode)


def check_jit(fn, *args, **kwargs):
    """`check` for operators and methods: on plain numpy arrays those are numpy's own."""
    check(fn, *args, modes=("jit",), **kwargs)


def _assert_equal_array(got, want, rtol, atol, mode):
    assert got.shape == want.shape, f"{mode}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{mode}: dtype {got.dtype}, expected {want.dtype}"
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=mode)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol, atol, err_msg=mode)


# --- elementwise math ---------------------------------------------------------------------------------------

UNARY = {
    "exp": X,
    "log": POS,
    "log1p": POS,
    "expm1": X,
    "tanh": X,
    "sqrt": POS,
    "sin": X,
    "cos": X,
    "tan": f32(3, 4, lo=-1.2, hi=1.2),
    "sinh": X,
    "cosh": X,
    "floor": X,
    "ceil": X,
    "round": np.array([0.5, 1.5, 2.5, -0.5, -2.5, 1.2, -1.7], np.float32),
    "abs": X,
    "negative": X,
    "sign": np.array([-2.0, 0.0, 3.0, np.nan], np.float32),
    "square": X,
    "reciprocal": POS,
    "exp2": X,
    "log2": POS,
    "log10": POS,
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_math(name):
    check(getattr(fnp, name), UNARY[name], ref=getattr(np, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["exp", "sqrt", "tanh", "floor", "abs", "negative"])
def test_unary_math_float64_stays_float64(name):
    x = POS.astype(np.float64)
    check(getattr(fnp, name), x, ref=getattr(np, name), rtol=1e-12)


def test_float_math_on_ints_gives_float32():
    check(fnp.sqrt, np.array([1, 4, 9], np.int32), ref=np.sqrt, dtype=np.float32)
    check(fnp.exp, np.array([True, False]), ref=lambda a: np.exp(a.astype(np.float32)))


@pytest.mark.parametrize("name", ["abs", "negative", "sign", "square"])
def test_unary_ints_stay_ints(name):
    check(getattr(fnp, name), I, ref=getattr(np, name))


BINARY = [
    "add",
    "subtract",
    "multiply",
    "divide",
    "true_divide",
    "power",
    "maximum",
    "minimum",
    "arctan2",
    "equal",
    "not_equal",
    "less",
    "less_equal",
    "greater",
    "greater_equal",
]


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 1), (4,)), ((), (2, 3)), ((2, 1, 4), (3, 1))])
def test_binary_broadcasting(name, shapes):
    a, b = f32(*shapes[0], lo=0.5, hi=3.0), f32(*shapes[1], lo=0.5, hi=3.0)
    if name in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"):
        a, b = np.round(a), np.round(b)  # ties
    check(getattr(fnp, name), a, b, ref=getattr(np, name), rtol=1e-5)


@pytest.mark.parametrize("name", ["logical_and", "logical_or", "logical_xor"])
def test_logical(name):
    a, b = RNG.random((3, 4)) < 0.5, RNG.random((4,)) < 0.5
    check(getattr(fnp, name), a, b, ref=getattr(np, name))


def test_logical_not():
    check(fnp.logical_not, RNG.random((3, 4)) < 0.5, ref=np.logical_not)


def test_isnan_isinf_isfinite():
    x = np.array([1.0, np.nan, np.inf, -np.inf, 0.0], np.float32)
    for name in ("isnan", "isinf", "isfinite"):
        check(getattr(fnp, name), x, ref=getattr(np, name))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int64])
@pytest.mark.parametrize("exponent", [2, 2.0])
def test_power_of_a_scalar_two_is_a_product_as_in_numpy(dtype, exponent):
    """`x ** 2` with a Python scalar 2 traces to `x * x`, bit-identical to numpy's (its fast scalar
    power squares), where a general power costs a logarithm and an exponential per element; other
    exponents, array exponents and exponents that change the dtype keep the power."""
    x = (RNG.standard_normal(50) * 30).astype(dtype)
    if np.dtype(dtype).kind == "i" and exponent == 2.0:
        exponent = 2  # numpy makes an int ** 2.0 float64; flowjit's float is float32 (checked below)
    fn = fj.jit(lambda a: a**exponent)
    got = np.asarray(fn(x))
    assert got.dtype == x.dtype
    want = np.asarray(x**exponent).astype(dtype)  # ml_dtypes' bfloat16 ** 2.0 is float32: x * x rounded once
    np.testing.assert_array_equal(got, want)
    assert "= mul %a, %a" in fn.lower(x).as_text("traced")
    np.testing.assert_array_equal(fj.jit(lambda a: fnp.power(a, exponent))(x), want)


@pytest.mark.parametrize(
    "fn, ref",
    [
        (lambda a: a**3, lambda a: a**3),
        (lambda a: a ** np.float32(2), lambda a: a**2),
        (lambda a: 2**a, lambda a: 2**a),
        (lambda a: a ** fnp.full_like(a, 2), lambda a: a**2),
        (lambda a: a**2.5, lambda a: a**2.5),
    ],
    ids=["cube", "numpy_scalar", "base_two", "array_exponent", "non_integer"],
)
def test_other_powers_stay_powers(fn, ref):
    x = np.abs(RNG.standard_normal(20)).astype(np.float32) + 0.5
    assert "pow" in fj.jit(fn).lower(x).as_text("traced")
    np.testing.assert_allclose(fj.jit(fn)(x), ref(x.astype(np.float64)), rtol=2e-6)


def test_int_to_the_float_two_keeps_the_float_power():
    x = np.arange(-3, 4, dtype=np.int32)
    fn = fj.jit(lambda a: a**2.0)
    assert "pow" in fn.lower(x).as_text("traced")
    np.testing.assert_array_equal(fn(x), (x**2.0).astype(np.float32))


# --- // and %: numpy's sign rules ------------------------------------------------------------------------

INT_NUM = np.array([7, -7, 7, -7, 0, 6, -6, 5, -5, 0], np.int32)
INT_DEN = np.array([2, 2, -2, -2, 3, 3, -3, 0, 0, 0], np.int32)
FLOAT_NUM = np.array([7.5, -7.5, 7.5, -7.5, 1.0, -0.0, 6.0, 3.0, 1e-8, -1e-8], np.float32)
FLOAT_DEN = np.array([2.0, 2.0, -2.0, -2.0, 0.1, 3.0, -3.0, 0.7, 1.0, 1.0], np.float32)


def test_floor_divide_and_remainder_ints():
    expected_q = np.array([3, -4, -4, 3, 0, 2, 2, 0, 0, 0], np.int32)  # x // 0 == 0
    expected_r = np.array([1, 1, -1, -1, 0, 0, 0, 0, 0, 0], np.int32)  # x % 0 == 0
    check(fnp.floor_divide, INT_NUM, INT_DEN, ref=lambda a, b: expected_q)
    check(fnp.remainder, INT_NUM, INT_DEN, ref=lambda a, b: expected_r)
    check_jit(lambda a, b: a // b, INT_NUM, INT_DEN, ref=lambda a, b: expected_q)
    check_jit(lambda a, b: a % b, INT_NUM, INT_DEN, ref=lambda a, b: expected_r)
    ok = INT_DEN != 0
    check(fnp.floor_divide, INT_NUM[ok], INT_DEN[ok], ref=np.floor_divide)
    check(fnp.remainder, INT_NUM[ok], INT_DEN[ok], ref=np.remainder)
    big = np.array([np.iinfo(np.int32).min, 7], np.int32)
    check(fnp.floor_divide, big, np.array([-1, -1], np.int32), ref=lambda a, b: np.array([big[0], -7], np.int32))


def test_floor_divide_and_remainder_floats():
    check(fnp.floor_divide, FLOAT_NUM, FLOAT_DEN, ref=np.floor_divide)
    check(fnp.remainder, FLOAT_NUM, FLOAT_DEN, ref=np.remainder, atol=1e-6)
    check_jit(lambda a, b: a // b, FLOAT_NUM, FLOAT_DEN, ref=np.floor_divide)
    check_jit(lambda a, b: a % b, FLOAT_NUM, FLOAT_DEN, ref=np.remainder, atol=1e-6)
    wide = (FLOAT_NUM.astype(np.float64) * 1e3, FLOAT_DEN.astype(np.float64) / 7)
    check(fnp.floor_divide, *wide, ref=np.floor_divide, rtol=0)
    check(fnp.remainder, *wide, ref=np.remainder, rtol=1e-12, atol=1e-12)
    check(fnp.mod, FLOAT_NUM, FLOAT_DEN, ref=np.mod, atol=1e-6)
    check(fnp.fmod, FLOAT_NUM, FLOAT_DEN, ref=np.fmod)


def test_floor_divide_and_remainder_scalars():
    check_jit(lambda a: a // 3, INT_NUM, ref=lambda a: a // 3)
    check_jit(lambda a: a % -3, INT_NUM, ref=lambda a: a % -3)
    check_jit(lambda a: 17 // a, INT_DEN[:7], ref=lambda a: 17 // a)
    check_jit(lambda a: -17 % a, INT_DEN[:7], ref=lambda a: -17 % a)
    check_jit(lambda a: a % 2.5, FLOAT_NUM, ref=lambda a: a % np.float32(2.5), atol=1e-6)
    check_jit(lambda a: 7.5 // a, FLOAT_DEN, ref=lambda a: np.float32(7.5) // a)
    check(lambda a: fnp.floor_divide(a, 3), INT_NUM, ref=lambda a: a // 3)
    check(lambda a: fnp.remainder(-17, a), INT_DEN[:7], ref=lambda a: -17 % a)


def test_float_division_by_zero():
    x = np.array([1.0, -1.0, 0.0], np.float32)
    zero = np.zeros(3, np.float32)
    with np.errstate(all="ignore"):
        check(fnp.divide, x, zero, ref=np.divide)
        check(fnp.floor_divide, x, zero, ref=np.floor_divide)
        check(fnp.remainder, x, zero, ref=np.remainder)


# --- Tracer operators and methods -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        lambda a, b: a + b,
        lambda a, b: a - b,
        lambda a, b: a * b,
        lambda a, b: a / b,
        lambda a, b: a**b,
        lambda a, b: a @ b.T,
        lambda a, b: -a,
        lambda a, b: +a,
        lambda a, b: abs(a),
        lambda a, b: 2.0 - a,
        lambda a, b: 1.0 / b,
        lambda a, b: 2.0**a,
        lambda a, b: a**2,
        lambda a, b: (a < b) & (a > 1.0) | ~(b >= 2.0) ^ (a == b),
        lambda a, b: a != b,
        lambda a, b: a <= b,
    ],
)
def test_operators(expr):
    a, b = f32(3, 4, lo=0.5, hi=3.0), f32(3, 4, lo=0.5, hi=3.0)
    check_jit(expr, a, b, ref=expr, rtol=1e-5)


def test_ndarray_op_tracer_uses_reflected_operator():
    c = f32(3, 4)
    check_jit(lambda a: c - a, X, ref=lambda a: c - a)
    check_jit(lambda a: c @ a.T, X, ref=lambda a: c @ a.T, rtol=1e-5)


def test_methods_and_attributes():
    def fn(x):
        assert x.shape == (2, 3, 4) and x.dtype == np.float32 and x.ndim == 3
        return (
            x.T,
            x.reshape(6, 4),
            x.reshape((-1,)),
            x.sum(),
            x.sum(axis=1),
            x.mean(axis=(0, 2), keepdims=True),
            x.max(axis=-1),
            x.min(),
            x.astype(np.int32),
            x.astype("float16"),
            x.transpose(1, 0, 2),
            x.swapaxes(0, 2),
        )

    def ref(x):
        return (
            x.T,
            x.reshape(6, 4),
            x.reshape(-1),
            x.sum(),
            x.sum(axis=1),
            x.mean(axis=(0, 2), keepdims=True),
            x.max(axis=-1),
            x.min(),
            x.astype(np.int32),
            x.astype(np.float16),
            x.transpose(1, 0, 2),
            x.swapaxes(0, 2),
        )

    out = jit(fn)(A3)
    for got, want in zip(out, ref(A3), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3)


# --- dtype promotion ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, fn, expected",
    [
        (np.ones(3, np.float32), lambda a: fnp.multiply(a, 2.0), np.float32),
        (np.ones(3, np.float16), lambda a: fnp.add(a, 1), np.float16),
        (np.ones(3, bf16), lambda a: fnp.multiply(a, 0.5), bf16),
        (np.ones(3, np.int32), lambda a: fnp.add(a, 1), np.int32),
        (np.ones(3, np.int32), lambda a: fnp.multiply(a, 2.5), np.float32),
        (np.ones(3, np.int64), lambda a: fnp.subtract(3, a), np.int64),
        (np.ones(3, bool), lambda a: fnp.add(a, 1), np.int64),
        (np.ones(3, bool), lambda a: fnp.multiply(a, 1.5), np.float32),
        (np.ones(3, np.float64), lambda a: fnp.multiply(a, 2.0), np.float64),
        (np.ones(3, np.float32), lambda a: fnp.add(a, np.ones(3, np.float16)), np.float32),
        (np.ones(3, np.float16), lambda a: fnp.add(a, np.ones(3, bf16)), np.float32),
        (np.ones(3, np.int32), lambda a: fnp.add(a, np.ones(3, np.int64)), np.int64),
        (np.ones(3, np.int32), lambda a: fnp.add(a, np.ones(3, np.float16)), np.float16),
        (np.ones(3, np.float32), lambda a: fnp.add(a, np.ones(3, np.float64)), np.float64),
        (np.ones(3, np.int32), lambda a: fnp.divide(a, 2), np.float32),
        (np.ones(3, np.int32), lambda a: fnp.floor_divide(a, 2), np.int32),
        (np.ones(3, np.int32), lambda a: fnp.power(a, 2), np.int32),
        (np.ones(3, np.float16), lambda a: fnp.where(a > 0, a, 0.0), np.float16),
        (np.ones(3, np.float16), lambda a: fnp.where(a > 0, 1.0, -1.0), np.float32),
        (np.ones(3, np.int32), lambda a: fnp.maximum(a, 0), np.int32),
        (np.ones(3, np.int32), lambda a: fnp.clip(a, 0.5, 2), np.float32),
        (np.ones(3, np.float16), lambda a: fnp.concatenate([a, np.ones(2, np.float32)]), np.float32),
        (np.ones(3, np.int32), lambda a: fnp.matmul(a, np.ones(3, np.float16)), np.float16),
    ],
)
def test_promotion(x, fn, expected):
    for mode, out in both(fn, x).items():
        assert np.asarray(out).dtype == np.dtype(expected), mode


@pytest.mark.parametrize(
    "x, fn, expected",
    [
        (np.ones(3, np.float32), lambda a: a * 2.0, np.float32),
        (np.ones(3, np.float16), lambda a: 1 + a, np.float16),
        (np.ones(3, bf16), lambda a: a / 3, bf16),
        (np.ones(3, np.int32), lambda a: a + 1, np.int32),
        (np.ones(3, np.int32), lambda a: a * 2.5, np.float32),
        (np.ones(3, np.int32), lambda a: a / 2, np.float32),
        (np.ones(3, np.int32), lambda a: 2**a, np.int32),
        (np.ones(3, np.int32), lambda a: a**0.5, np.float32),
        (np.ones(3, bool), lambda a: a + 1, np.int64),
        (np.ones(3, np.float16), lambda a: a - np.ones(3, bf16), np.float32),
    ],
)
def test_promotion_with_operators(x, fn, expected):
    assert jit(fn)(x).dtype == np.dtype(expected)


def test_python_int_out_of_range_for_the_array_dtype_is_an_error():
    with pytest.raises(FlowjitError, match="out of bounds for int32"):
        fnp.add(np.ones(2, np.int32), 2**40)
    with pytest.raises(FlowjitError, match="out of bounds for int32"):
        jit(lambda a: a * 2**31)(np.ones(2, np.int32))
    check(lambda a: fnp.multiply(a, -(2**31)), np.ones(2, np.int32), ref=lambda a: a * -(2**31))


def test_python_scalar_alone_and_lists():
    assert fnp.asarray(2.0).dtype == np.float32
    assert fnp.asarray(2).dtype == np.int64
    assert fnp.asarray([1.0, 2.0]).dtype == np.float32
    assert fnp.asarray(np.ones(2)).dtype == np.float64


# --- contractions ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sa, sb",
    [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 3, 4), (2, 4, 5)), ((2, 3, 4), (4, 5))]
    + [((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 3))],
)
def test_matmul(sa, sb):
    a, b = f32(*sa), f32(*sb)
    check(fnp.matmul, a, b, ref=np.matmul, rtol=1e-5, atol=1e-5)
    check_jit(lambda x, y: x @ y, a, b, ref=np.matmul, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sa, sb", [((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (4, 5)), ((2, 3, 4), (4,))])
def test_matmul_of_a_stack_by_one_matrix_is_one_product(sa, sb):
    """(B, T, D) @ (D, F): one dot_general with B * T rows, the matrix neither broadcast nor
    copied per stacked matrix (numpy's batch broadcasting would make it (B, D, F))."""
    a, b = f32(*sa), f32(*sb)
    check_jit(lambda x, y: x @ y, a, b, ref=np.matmul, rtol=1e-5, atol=1e-5)
    graph = fj.jit(lambda x, y: x @ y).lower(a, b).graph("traced")
    (dot,) = [op for op in graph.ops if op.name == "dot_general"]
    assert dot.attrs["lhs_batch"] == () and dot.operands[0].type.shape == sa
    assert not [op for op in graph.ops if op.name == "broadcast"]


@pytest.mark.parametrize("sa, sb", [((3, 4), (4, 5)), ((4,), (4,)), ((3, 4), (4,)), ((2, 3, 4), (5, 4, 2)), ((), (3,))])
def test_dot(sa, sb):
    check(fnp.dot, f32(*sa), f32(*sb), ref=np.dot, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sa, sb", [((300, 200), (200, 100)), ((4, 30, 20), (20, 10)), ((3, 30, 20), (3, 20, 10))])
def test_eager_float64_products_run_blas_not_einsum(sa, sb, monkeypatch):
    # Eager products were np.einsum, which has no BLAS: 347 ms against 27 for (1437, 784) @ (784, 1024).
    def no_einsum(*args, **kwargs):
        raise AssertionError("eager dot_general called np.einsum")

    monkeypatch.setattr(np, "einsum", no_einsum)
    a, b = RNG.standard_normal(sa), RNG.standard_normal(sb)
    np.testing.assert_allclose(fnp.matmul(a, b), np.matmul(a, b), rtol=1e-12)
    np.testing.assert_allclose(
        fnp.dot(a[0], b[0] if b.ndim == 3 else b), np.dot(a[0], b[0] if b.ndim == 3 else b), rtol=1e-12
    )
    if len(sa) == len(sb) == 2:
        np.testing.assert_array_equal(fnp.matmul(a, b), np.matmul(a, b))  # the very same BLAS call


def test_matmul_ints_and_mixed_dtypes():
    check(fnp.matmul, i32(3, 4), i32(4, 2), ref=np.matmul)
    check(fnp.matmul, X.astype(np.float16), V.astype(np.float32), ref=lambda a, b: a.astype(np.float32) @ b)


@pytest.mark.parametrize(
    "spec, shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("i,i->", [(4,), (4,)]),
        ("ij,j->i", [(3, 4), (4,)]),
        ("i,j->ij", [(3,), (4,)]),
        ("ij,kj->ki", [(3, 4), (5, 4)]),
        ("bij,jk->bki", [(2, 3, 4), (4, 5)]),
        ("ij,jk", [(3, 4), (4, 5)]),
        ("ij->ji", [(3, 4)]),
        ("ij->", [(3, 4)]),
        ("ijk->kj", [(2, 3, 4)]),
        ("ij,ij->i", [(3, 4), (3, 4)]),
        # diagonals (repeated indices), '...', size-1 broadcasting, three operands
        ("ii", [(4, 4)]),
        ("ii->i", [(4, 4)]),
        ("bii->bi", [(2, 3, 3)]),
        ("iij->j", [(3, 3, 5)]),
        ("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 6)]),
        ("...d,...d->...", [(2, 7, 8), (7, 8)]),
        ("...ij->...ji", [(2, 3, 4)]),
        ("i...->...", [(3, 4, 5)]),
        ("a...,b...->ab...", [(2, 3), (4, 3)]),
        ("...,...", [(2, 3), (3,)]),
        ("ab,b", [(3, 1), (4,)]),
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
        ("i,i,i->", [(5,), (5,), (5,)]),
        ("bhqd,bhkd->bhqk", [(2, 3, 4, 8), (2, 3, 5, 8)]),
    ],
)
def test_einsum(spec, shapes):
    arrays = [f32(*s) for s in shapes]
    check(lambda *xs: fnp.einsum(spec, *xs), *arrays, ref=lambda *xs: np.einsum(spec, *xs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "spec, shapes, message",
    [
        ("ij,jk->ik", [(3, 4), (5, 5)], "index 'j' has sizes 4 and 5"),
        ("ij->ii", [(3, 3)], "repeats an index"),
        ("ij,jk->iq", [(3, 4), (4, 5)], "names one no input has"),
        ("i", [(3, 4)], "does not fit an operand of shape (3, 4)"),
        ("ij,j", [(3, 4)], "names 2 operands; found 1"),
    ],
)
def test_einsum_errors(spec, shapes, message):
    with pytest.raises(FlowjitError, match=re.escape(message)):
        fnp.einsum(spec, *[np.ones(s, np.float32) for s in shapes])


# --- reductions ------------------------------------------------------------------------------------------------------

AXES = [None, 0, 1, -1, (0, 2), (0, 1, 2), ()]


@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "prod", "var", "std"])
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(name, axis, keepdims):
    x = f32(2, 3, 4, lo=0.5, hi=1.5)
    fn = getattr(fnp, name)
    check(
        lambda a: fn(a, axis=axis, keepdims=keepdims),
        x,
        ref=lambda a: getattr(np, name)(a, axis=axis, keepdims=keepdims),
        rtol=2e-5,
    )


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("keepdims", [False, True])
def test_arg_reductions(name, axis, keepdims):
    x = i32(3, 4, 5, lo=-2, hi=2)  # ties: the first index wins
    check(
        lambda a: getattr(fnp, name)(a, axis=axis, keepdims=keepdims),
        x,
        ref=lambda a: getattr(np, name)(a, axis=axis, keepdims=keepdims),
    )
    check_jit(lambda a: getattr(a, name)(axis), x, ref=lambda a: getattr(np, name)(a, axis))


def test_reduction_dtypes_and_edge_cases():
    check(fnp.sum, I, ref=np.sum, dtype=np.int32)  # integer sums keep their dtype
    check(lambda a: fnp.sum(a, axis=0), RNG.random((4, 3)) < 0.5, ref=lambda a: np.sum(a, axis=0))
    check(fnp.mean, I, ref=np.mean, dtype=np.float32)
    check(lambda a: fnp.mean(a, axis=0, dtype=np.float64), X, ref=lambda a: np.mean(a, axis=0, dtype=np.float64))
    check(fnp.max, I, ref=np.max)
    check(lambda a: fnp.var(a, ddof=1), X, ref=lambda a: np.var(a, ddof=1), rtol=1e-5)
    check(lambda a: fnp.std(a, axis=0, ddof=1), X, ref=lambda a: np.std(a, axis=0, ddof=1), rtol=1e-5)
    check(lambda a: fnp.sum(a, axis=0), np.zeros((0, 3), np.float32), ref=lambda a: np.sum(a, axis=0))
    check(lambda a: fnp.prod(a, axis=1), np.zeros((2, 0), np.float32), ref=lambda a: np.prod(a, axis=1))
    check(lambda a: fnp.sum(a, dtype=np.float64), X, ref=lambda a: np.sum(a, dtype=np.float64), rtol=1e-6)
    check(lambda a: fnp.max(a, axis=1), np.array([[1.0, np.nan], [2.0, 3.0]], np.float32), ref=lambda a: a.max(1))
    check(lambda a: (fnp.any(a, axis=1), fnp.all(a)), RNG.random((3, 4)) < 0.5, ref=lambda a: (a.any(1), a.all()))
    with pytest.raises(FlowjitError, match="zero-size"):
        fnp.max(np.zeros((0,), np.float32))


def test_any_all_count_nan_and_negatives_as_true():
    x = np.array([[-0.5, 0.0, np.nan], [1.0, 2.0, 0.0]], np.float32)
    check(lambda a: fnp.any(a, axis=1), x, ref=lambda a: np.any(a, axis=1))
    check(lambda a: fnp.all(a, axis=0, keepdims=True), x, ref=lambda a: np.all(a, axis=0, keepdims=True))
    check(fnp.any, np.zeros((0,), np.float32), ref=np.any)


def test_bool_arithmetic_is_logic():
    a, b = np.array([True, False, True, False]), np.array([True, True, False, False])
    for name in ("add", "multiply", "maximum", "minimum", "matmul"):
        check(getattr(fnp, name), a, b, ref=getattr(np, name))
    check_jit(lambda x, y: (x + y, x * y), a, b, ref=lambda x, y: (x + y, x * y))


def test_round_decimals():
    check(lambda a: fnp.round(a, 1), np.array([1.25, 2.35, -0.05, 0.15], np.float32), ref=lambda a: np.round(a, 1))
    check(lambda a: fnp.round(a, -1), np.array([15, 25, -35, 4], np.int32), ref=lambda a: np.round(a, -1))
    check(lambda a: fnp.round(a, 2), np.array([15, -3], np.int64), ref=lambda a: np.round(a, 2))


def test_cumsum():
    check(fnp.cumsum, np.array([True, False, True]), ref=np.cumsum)
    check(fnp.cumsum, X, ref=np.cumsum, rtol=1e-5)
    check(lambda a: fnp.cumsum(a, axis=1), A3, ref=lambda a: np.cumsum(a, axis=1), rtol=1e-5, atol=1e-5)
    check(lambda a: fnp.cumsum(a, axis=-1), I, ref=lambda a: a.cumsum(axis=-1), dtype=np.int32)
    check_jit(lambda a: a.cumsum(axis=0), I, ref=lambda a: a.cumsum(axis=0), dtype=np.int32)
    # dtype=: numpy's widening on request (int32 sums stay int32 by default, docs/design-notes.md)
    check(lambda a: fnp.cumsum(a, axis=-1, dtype="int64"), I, ref=lambda a: np.cumsum(a, axis=-1, dtype=np.int64))
    check(lambda a: fnp.cumprod(a, 0, np.float64), I, ref=lambda a: np.cumprod(a, 0, dtype=np.float64))
    check(lambda a: fnp.nancumsum(a, dtype="float64"), X, ref=lambda a: np.nancumsum(a, dtype=np.float64))
    check_jit(lambda a: a.cumsum(dtype="int64"), I, ref=lambda a: a.cumsum(dtype=np.int64))


# --- shapes, joins, creation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: fnp.reshape(a, -1),
        lambda a: fnp.reshape(a, (4, -1)),
        lambda a: fnp.reshape(a, (2, 2, 6)),
        lambda a: fnp.ravel(a),
        lambda a: fnp.transpose(a),
        lambda a: fnp.transpose(a, (1, 0, 2)),
        lambda a: fnp.transpose(a, (-1, 0, 1)),
        lambda a: fnp.swapaxes(a, 0, -1),
        lambda a: fnp.moveaxis(a, 0, 2),
        lambda a: fnp.moveaxis(a, (2, 0), (0, -1)),
        lambda a: fnp.expand_dims(a, 1),
        lambda a: fnp.expand_dims(a, -1),
        lambda a: fnp.expand_dims(a, (0, 4)),
        lambda a: fnp.squeeze(fnp.expand_dims(a, (0, 2))),
        lambda a: fnp.squeeze(fnp.expand_dims(a, 2), axis=2),
        lambda a: fnp.concatenate([a, a * 2], axis=1),
        lambda a: fnp.concatenate([a, a], axis=-1),
        lambda a: fnp.stack([a, a + 1, a + 2]),
        lambda a: fnp.stack([a, a], axis=-1),
        lambda a: fnp.split(a, 2, axis=0)[1],
        lambda a: fnp.split(a, [1, 3], axis=2)[2],
        lambda a: fnp.split(a, [1, 9], axis=1)[2],
        lambda a: fnp.split(a, [-1], axis=2)[0],
        lambda a: fnp.pad(a, ((1,), (2,), (0,))),
        lambda a: fnp.pad(a, (1, 2)),
        lambda a: fnp.pad(a, 1),
        lambda a: fnp.pad(a, ((0, 0), (1, 2), (2, 0)), constant_values=5.0),
        lambda a: fnp.pad(a, 2, constant_values=((1.0, 2.0), (3.0, 4.0), (5.0, 6.0))),
        lambda a: fnp.pad(a, ((1, 2), (0, 3), (2, 1)), mode="edge"),
        lambda a: fnp.pad(a, ((1, 1), (2, 1), (3, 0)), mode="reflect"),
        lambda a: fnp.pad(a, 7, mode="reflect"),  # wider than the axes: reflected again
        lambda a: fnp.pad(a, ((2, 0), (1, 3), (0, 4)), mode="symmetric"),
        lambda a: fnp.pad(a, ((1, 3), (5, 2), (1, 1)), mode="wrap"),
        lambda a: fnp.tile(a, 2),
        lambda a: fnp.tile(a, (2, 1, 1, 2)),
        lambda a: fnp.repeat(a, 3, axis=1),
        lambda a: fnp.repeat(a, 2),
        lambda a: fnp.flip(a),
        lambda a: fnp.flip(a, axis=1),
        lambda a: fnp.flip(a, axis=(0, 2)),
        lambda a: fnp.take(a, np.array([2, 0, -1]), axis=2),
        lambda a: fnp.take(a, np.array([[0, 5], [23, -2]])),
        lambda a: fnp.where(a > 0, a, 0.0),
        lambda a: fnp.where(a > 0, -1.0, a),
        lambda a: fnp.clip(a, -1.0, 1.0),
        lambda a: fnp.clip(a, None, 0.5),
        lambda a: fnp.maximum(a, 0.0),
        lambda a: fnp.minimum(a, a[0]),
        lambda a: fnp.broadcast_to(a[:, :1], (2, 3, 4)),
    ],
)
def test_shape_functions(fn):
    check(fn, A3, ref=_with_np(fn))


def test_pad_modes_gradients_and_errors():
    """Reflected padding is differentiable (slices, reversed slices and a concatenation); modes
    without a lowering, negative widths and an empty axis to extend are errors naming the line."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    got = fj.grad(lambda a: (fnp.pad(a, 2, mode="reflect") ** 2).sum())(x)
    # each element is counted once per position np.pad copies it to
    counts = np.zeros(12)
    np.add.at(counts, np.pad(np.arange(12).reshape(3, 4), 2, mode="reflect").ravel(), 1)
    np.testing.assert_allclose(got, 2 * x * counts.reshape(3, 4), rtol=1e-6)
    with pytest.raises(FlowjitError, match=r"test_numpy_api.py:\d+.*'constant', 'edge'.*'median'"):
        fnp.pad(x, 1, mode="median")
    with pytest.raises(FlowjitError, match=">= 0"):
        fnp.pad(x, -1)
    with pytest.raises(FlowjitError, match="empty axis"):
        fj.jit(lambda a: fnp.pad(a, 1, mode="wrap"))(np.zeros((0, 2), np.float32))


def _with_np(fn):
    """The same function with numpy in place of flowjit.numpy: the reference."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, "fnp": np}, closure=fn.__closure__)


@pytest.mark.parametrize(
    "fn, expected_dtype",
    [
        (lambda: fnp.zeros((2, 3)), np.float32),
        (lambda: fnp.ones(4, dtype=np.int32), np.int32),
        (lambda: fnp.full((2, 2), 7), np.int64),
        (lambda: fnp.full((2, 2), 1.5), np.float32),
        (lambda: fnp.full(3, 2, dtype=np.float16), np.float16),
        (lambda: fnp.arange(5), np.int64),
        (lambda: fnp.arange(1, 7, 2), np.int64),
        (lambda: fnp.arange(0.0, 1.0, 0.25), np.float32),
        (lambda: fnp.arange(5, 0, -2), np.int64),
        (lambda: fnp.eye(3), np.float32),
        (lambda: fnp.eye(3, 4, k=1, dtype=np.int32), np.int32),
        (lambda: fnp.linspace(0.0, 1.0, 5), np.float32),
    ],
)
def test_creation(fn, expected_dtype):
    got = fn()
    want = _with_np(fn)()
    assert got.dtype == expected_dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want.astype(expected_dtype))
    out = jit(lambda x: x + fn())(np.zeros((), expected_dtype))  # constants inside a trace
    np.testing.assert_allclose(out, want.astype(expected_dtype))


def test_like_functions_under_jit():
    check(lambda a: fnp.zeros_like(a) + fnp.ones_like(a), I, ref=lambda a: np.zeros_like(a) + np.ones_like(a))
    check(lambda a: fnp.full_like(a, 2.5) * a, X, ref=lambda a: np.full_like(a, 2.5) * a)
    check(lambda a: fnp.zeros_like(a, dtype=np.float16), X, ref=lambda a: np.zeros_like(a, dtype=np.float16))
    check(lambda a: fnp.full((2, 3), a), np.float32(1.5), ref=lambda a: np.full((2, 3), a))


def test_take_scatter_add_dynamic_slice_with_traced_indices():
    def add_at(a, i, u):
        out = a.copy()
        np.add.at(out, (slice(None), i), u)
        return out

    idx = np.array([[-1, 0], [5, -9]])
    check(lambda a, i: fnp.take(a, i, axis=1), X, idx, ref=lambda a, i: np.take(a, [[3, 0], [3, 0]], axis=1))
    check(lambda a, i: fnp.take(a, i), X, np.array([-1, 11, 3]), ref=np.take)
    upd = f32(3, 3)
    check(lambda a, i, u: fnp.scatter_add(a, i, u, axis=1), X, np.array([1, 1, -1]), upd, ref=add_at)
    check(lambda a, i: fnp.scatter_add(a, i, 2.0, axis=1), X, np.array([0, 0]), ref=lambda a, i: add_at(a, i, 2.0))
    check(lambda a, i: fnp.dynamic_slice(a, (i, 1), (2, 2)), X, np.int32(5), ref=lambda a, i: a[1:3, 1:3])
    check(lambda a, i: fnp.dynamic_slice(a, (i, i), (2, 3)), X, np.int64(-2), ref=lambda a, i: a[0:2, 0:3])


def test_other_contractions():
    check(lambda a: fnp.tensordot(a, a, axes=2), X, ref=lambda a: np.tensordot(a, a, axes=2), rtol=1e-5)
    check(lambda a: fnp.tensordot(a, a, axes=([0], [0])), X, ref=lambda a: np.tensordot(a, a, ([0], [0])), rtol=1e-5)
    check(lambda a, b: fnp.tensordot(a, b, axes=0), V, V, ref=lambda a, b: np.tensordot(a, b, axes=0))
    check(fnp.inner, X, X, ref=np.inner, rtol=1e-5, atol=1e-5)
    check(fnp.outer, V, X, ref=np.outer)
    check(fnp.vdot, X, X, ref=np.vdot, rtol=1e-5)


def test_flowjit_only_math():
    erf = np.vectorize(math.erf, otypes=[np.float64])
    check(fnp.erf, X, ref=lambda a: erf(a).astype(np.float32), rtol=1e-6)
    check(fnp.logistic, X, ref=lambda a: (1 / (1 + np.exp(-a))).astype(np.float32), rtol=1e-6)
    check(fnp.rsqrt, POS, ref=lambda a: (1 / np.sqrt(a)).astype(np.float32), rtol=1e-6)
    check(lambda: fnp.iota((2, 3), 1), ref=lambda: np.broadcast_to(np.arange(3), (2, 3)))


def test_aliases_and_lists_of_tracers():
    check(lambda a: fnp.amax(a, axis=0), X, ref=lambda a: np.amax(a, axis=0))
    check(lambda a: fnp.amin(a, axis=1), X, ref=lambda a: np.amin(a, axis=1))
    check(lambda a: fnp.around(a, 1), X, ref=lambda a: np.around(a, 1))
    check(fnp.absolute, X, ref=np.absolute)
    check(lambda a: fnp.concatenate([a, a[0]], axis=None), X, ref=lambda a: np.concatenate([a, a[0]], axis=None))
    check_jit(
        lambda a: fnp.asarray([[a[0, 0], a[1, 1]], [a[2, 2], 1.0]]),
        X,
        ref=lambda a: np.array([[a[0, 0], a[1, 1]], [a[2, 2], 1.0]], np.float32),
    )
    check_jit(lambda a: [row for row in a][1] + len(a), X, ref=lambda a: a[1] + 3)


def test_split_empty_axis():
    for mode, parts in both(lambda a: fnp.split(a, 3, axis=0), np.zeros((0, 2), np.float32)).items():
        assert [p.shape for p in parts] == [(0, 2)] * 3, mode


def test_split_returns_all_parts():
    for mode, parts in both(lambda a: fnp.split(a, [1, 3], axis=1), X).items():
        want = np.split(X, [1, 3], axis=1)
        assert len(parts) == len(want), mode
        for p, w in zip(parts, want):
            np.testing.assert_array_equal(p, w)


# --- indexing ---------------------------------------------------------------------------------------------------------

IDX = np.array([0, 2, -1])
KEYS = [
    1,
    -1,
    (1, -2),
    (-2, 1, 3),
    slice(1, 3),
    slice(None, None, -1),
    slice(3, 0, -2),
    slice(-1, -5, -1),
    slice(None, None, 3),
    (slice(None, None, 2), slice(None, None, -3)),
    (slice(1, None), slice(None, -1), slice(None, None, -2)),
    slice(0, 0),
    slice(5, 1),
    (slice(None), slice(10, 20)),
    None,
    (None, None),
    Ellipsis,
    (Ellipsis, None),
    (Ellipsis, 1),
    (1, Ellipsis, -1),
    (None, 1, None, slice(1, 4), None),
    (slice(None), None, 2),
    IDX,
    [0, 1, 1],
    np.array([[0, 1], [2, 3]]),
    np.array(2),
    np.array([-1, -4]),
    (np.array([0, 1]), np.array([1, 2])),
    (np.array([0, 1]), slice(None), np.array([1, 2])),
    (slice(None), np.array([0, 1]), np.array([1, 2])),
    (1, np.array([0, 1])),
    (np.array([0, 1]), 1),
    (slice(None), 1, np.array([0, 2])),
    (0, slice(None), np.array([[1], [2]])),
    (np.array([[0], [1]]), np.array([1, 2, 3])),
    (Ellipsis, np.array([1, 0])),
    (np.array([0, 1]), Ellipsis, np.array([0, 1])),
    (None, np.array([0, 1]), None, np.array([1, 2])),
    (np.array([0, 1]), None, np.array([1, 2])),
    (slice(None, None, -1), np.array([0, 3])),
    (np.array([1, 0]), slice(None, None, -2), np.array([2, 5])),
    (slice(1, 3), np.array([[0, 1, 2]]), np.array([[1], [-1]])),
    ([[0, 1], [1, 0]], 2),
    (np.zeros((0,), np.int64),),
    (np.array([3, 0]), np.array([[1], [4]]), np.array([5, 5])),
]


def _key_id(key):
    return repr(key).replace("\n", "").replace(" ", "")


@pytest.mark.parametrize("key", KEYS, ids=_key_id)
def test_getitem_static_keys(key):
    x = f32(4, 5, 6)
    check(lambda a: a[key], x, ref=lambda a: a[key])  # under jit: Tracer.__getitem__
    got = fnp.getitem(x, key)  # eagerly on a numpy array
    np.testing.assert_array_equal(got, x[key])


def _as_tuple(key):
    return key if isinstance(key, tuple) else (key,)


@pytest.mark.parametrize("key", [k for k in KEYS if any(isinstance(e, np.ndarray) for e in _as_tuple(k))], ids=_key_id)
def test_getitem_traced_index_arrays(key):
    key = _as_tuple(key)
    arrays = [k for k in key if isinstance(k, np.ndarray)]

    def fn(a, *idx):
        it = iter(idx)
        return a[tuple(next(it) if isinstance(k, np.ndarray) else k for k in key)]

    x = f32(4, 5, 6)
    out = jit(fn)(x, *arrays)
    np.testing.assert_array_equal(out, x[key])


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, i: a[i],
        lambda a, i: a[i, 1:3],
        lambda a, i: a[1, i, ::-1],
        lambda a, i: a[:, i],
        lambda a, i: a[i, :, i],
        lambda a, i: a[..., i, None],
        lambda a, i: a[np.array([0, 2]), i],
    ],
)
@pytest.mark.parametrize("i", [np.int32(2), np.int64(-1), np.int64(0)])
def test_getitem_traced_scalar_index(fn, i):
    x = f32(4, 5, 6)
    out = jit(fn)(x, i)
    np.testing.assert_array_equal(out, fn(x, int(i)))


def test_traced_index_out_of_range_is_clamped():
    out = jit(lambda a, i: a[i])(np.arange(5, dtype=np.float32), np.array([7, -9, 2]))
    np.testing.assert_array_equal(out, [4.0, 0.0, 2.0])


@pytest.mark.parametrize(
    "key, message",
    [
        (5, "out of bounds"),
        (np.array([0, 9]), "out of bounds"),
        ((1, 2, 3, 4), "too many indices"),
        ((Ellipsis, Ellipsis), "single ellipsis"),
        (1.5, "unsupported index"),
        (np.array([True, False, True]), "boolean index of shape"),
        (np.array(True), "0-d boolean"),
        (np.array([0.0, 1.0]), "integers"),
    ],
)
def test_getitem_errors(key, message):
    x = f32(4, 5, 6)
    with pytest.raises(FlowjitError, match=message):
        fnp.getitem(x, key)
    with pytest.raises(FlowjitError, match=message):
        jit(lambda a: a[key])(x)


def test_getitem_traced_mask_is_an_error():
    with pytest.raises(FlowjitError, match="boolean mask"):
        jit(lambda a, m: a[m])(X, X > 0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(
        st.one_of(
            st.integers(-4, 3),
            st.builds(
                slice,
                st.none() | st.integers(-6, 6),
                st.none() | st.integers(-6, 6),
                st.sampled_from([None, 1, 2, -1, -3]),
            ),
            st.none(),
            st.lists(st.integers(-4, 3), min_size=1, max_size=3).map(np.array),
        ),
        max_size=4,
    )
)
def test_getitem_property(entries):
    x = np.arange(4 * 4 * 4, dtype=np.float32).reshape(4, 4, 4)
    key = tuple(entries)
    try:
        want = x[key]
    except IndexError:
        return
    np.testing.assert_array_equal(jit(lambda a: a[key])(x), want)
