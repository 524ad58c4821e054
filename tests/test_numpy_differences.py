"""Every row of docs/numpy-differences.md: what numpy gives, what `flowjit.numpy` gives eagerly, and
what it gives under `jit`. A change of behaviour fails here and must change the page too."""

import warnings

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp

I32 = np.array([1, 2, 3], np.int32)
I64 = np.array([1, 2, 3], np.int64)
F32 = np.array([1.0, 2.0, 3.0], np.float32)
F16 = np.array([1.0, 2.0], np.float16)

# (case, function of (module, *args), args, numpy dtype, flowjit dtype: eager and under jit)
DTYPES = [
    ("int32 + float32", lambda m, a, b: m.add(a, b), (I32, F32), "float64", "float32"),
    ("float32 * int64", lambda m, a, b: m.multiply(a, b), (F32, I64), "float64", "float32"),
    ("float16 + int32", lambda m, a, b: m.add(a, b), (F16, I32[:2]), "float64", "float16"),
    ("int64 + float16", lambda m, a, b: m.add(a, b), (I64[:2], F16), "float64", "float16"),
    ("int32 * 2.5", lambda m, a: m.multiply(a, 2.5), (I32,), "float64", "float32"),
    ("float32 * 2.0", lambda m, a: m.multiply(a, 2.0), (F32,), "float32", "float32"),
    ("int32 + 2", lambda m, a: m.add(a, 2), (I32,), "int32", "int32"),
    ("asarray(1.0)", lambda m: m.asarray(1.0), (), "float64", "float32"),
    ("array([1.0, 2.0])", lambda m: m.array([1.0, 2.0]), (), "float64", "float32"),
    ("asarray(1)", lambda m: m.asarray(1), (), "int64", "int64"),
    ("zeros(2)", lambda m: m.zeros(2), (), "float64", "float32"),
    ("full(2, 1.5)", lambda m: m.full(2, 1.5), (), "float64", "float32"),
    ("full(2, 1)", lambda m: m.full(2, 1), (), "int64", "int64"),
    ("eye(2)", lambda m: m.eye(2), (), "float64", "float32"),
    ("linspace", lambda m: m.linspace(0, 1, 3), (), "float64", "float32"),
    ("arange(3.0)", lambda m: m.arange(3.0), (), "float64", "float32"),
    ("arange(3)", lambda m: m.arange(3), (), "int64", "int64"),
    ("sqrt(int32)", lambda m, a: m.sqrt(a), (I32,), "float64", "float32"),
    ("exp(int64)", lambda m, a: m.exp(a), (I64,), "float64", "float32"),
    ("true_divide(int32)", lambda m, a: m.true_divide(a, a), (I32,), "float64", "float32"),
    ("mean(int32)", lambda m, a: m.mean(a), (I32,), "float64", "float32"),
    ("var(int64)", lambda m, a: m.var(a), (I64,), "float64", "float32"),
    ("median(int32)", lambda m, a: m.median(a), (I32,), "float64", "float32"),
    ("sum(int32)", lambda m, a: m.sum(a), (I32,), "int64", "int32"),
    ("cumsum(int32)", lambda m, a: m.cumsum(a), (I32,), "int64", "int32"),
    ("prod(int32)", lambda m, a: m.prod(a), (I32,), "int64", "int32"),
    ("sum(int32, dtype=int64)", lambda m, a: m.sum(a, dtype="int64"), (I32,), "int64", "int64"),
    ("sum(bool)", lambda m, a: m.sum(a > 1), (I32,), "int64", "int64"),
    ("tanh(float64)", lambda m, a: m.tanh(a), (F32.astype(np.float64),), "float64", "float64"),
    ("float32 + np.float64 scalar", lambda m, a: m.add(a, np.float64(1)), (F32,), "float64", "float64"),
]


@pytest.mark.parametrize("case, f, args, numpy_dtype, flowjit_dtype", DTYPES, ids=[row[0] for row in DTYPES])
def test_result_dtypes(case, f, args, numpy_dtype, flowjit_dtype):
    assert np.asarray(f(np, *args)).dtype == numpy_dtype
    assert np.asarray(f(fnp, *args)).dtype == flowjit_dtype
    assert fj.jit(lambda *a: f(fnp, *a))(*args).dtype == flowjit_dtype


def test_operators_outside_jit_are_numpys():
    f = lambda a, b: a * b  # noqa: E731
    assert f(F32, I64).dtype == np.float64
    assert fj.jit(f)(F32, I64).dtype == np.float32


def test_float16_and_bfloat16_give_float32():
    bf16 = np.array([1.0], ml_dtypes.bfloat16)
    assert fnp.add(F16[:1], bf16).dtype == np.float32
    assert fj.jit(fnp.add)(F16[:1], bf16).dtype == np.float32


def test_narrow_and_unsigned_integers():
    assert fnp.add(np.array([1], np.uint8), np.array([1], np.int8)).dtype == np.int64
    with pytest.raises(fj.FlowjitTypeError, match="unsupported dtype uint8.*astype"):
        fj.jit(lambda a: a)(np.array([1], np.uint8))


def test_values_eager_and_jit():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divide-by-zero warning
        assert fnp.floor_divide(I32, 0 * I32).tolist() == [0, 0, 0]
        assert fnp.remainder(I32, 0 * I32).tolist() == [0, 0, 0]
    assert fj.jit(lambda a: fnp.floor_divide(a, 0 * a))(I32).tolist() == [0, 0, 0]
    for run in (fnp.power, fj.jit(fnp.power)):
        assert run(np.array([2, -1, -2], np.int32), np.array([-1, -1, -1], np.int32)).tolist() == [0, -1, 0]
    special = np.array([np.nan, 1e20, -1e20, 2.7], np.float32)
    for run in (lambda a: fnp.astype(a, "int32"), fj.jit(lambda a: fnp.astype(a, "int32"))):
        assert run(special).tolist() == [0, 2**31 - 1, -(2**31), 2]
    all_nan = np.array([np.nan, np.nan], np.float32)
    assert fnp.nanargmax(all_nan) == 0 and fj.jit(fnp.nanargmax)(all_nan) == 0
    assert fnp.empty(2).tolist() == [0.0, 0.0]
    big = np.array([2**30, 2**30], np.int32)
    assert fnp.sum(big) == -(2**31) and fj.jit(fnp.sum)(big) == -(2**31)


def test_indices():
    idx = np.array([5, -7, -1])
    assert fj.jit(lambda x, i: x[i])(F32, idx).tolist() == [3.0, 1.0, 3.0]
    assert fj.jit(fnp.take)(F32, idx).tolist() == [3.0, 1.0, 3.0]
    assert fnp.take(F32, idx).tolist() == [3.0, 1.0, 3.0]
    assert fj.jit(lambda x, i: fnp.take_along_axis(x, i, 0))(F32, np.array([4])).tolist() == [3.0]
    with pytest.raises(IndexError):
        F32[np.array([5])]
    with pytest.raises(fj.FlowjitValueError, match="index 5 is out of bounds"):
        fj.jit(lambda x: x[np.array([5])])(F32)
    assert fnp.dynamic_slice(F32, (2,), (2,)).tolist() == [2.0, 3.0]
    assert fj.jit(lambda x, s: fnp.dynamic_slice(x, (s,), (2,)))(F32, np.int64(2)).tolist() == [2.0, 3.0]


def test_unsupported_and_data_dependent():
    with pytest.raises(fj.FlowjitValueError, match="size="):
        fj.jit(fnp.unique)(F32)
    assert fj.jit(lambda x: fnp.nonzero(x > 1, size=3, fill_value=-1)[0])(F32).tolist() == [1, 2, -1]
    with pytest.raises(fj.FlowjitValueError, match="linear"):
        fnp.percentile(F32, 50, method="nearest")


def test_math_and_sums_differ_only_in_the_last_bits():
    x = np.linspace(-5, 5, 1001).astype(np.float32)
    assert np.array_equal(fnp.tanh(x), np.tanh(x))  # eager: numpy's bits
    compiled = fj.jit(fnp.tanh)(x)
    assert np.allclose(compiled, np.tanh(x), rtol=4e-7, atol=0)
    big = np.random.default_rng(0).random(1 << 22).astype(np.float32)
    assert fnp.sum(big) == np.sum(big)
    assert abs(float(fj.jit(fnp.sum)(big)) - big.astype(np.float64).sum()) < 1.0


def test_same_as_numpy():
    ties = np.array([1.0, 3.0, 3.0, np.nan], np.float32)
    for run in (fnp.argmax, fj.jit(fnp.argmax)):
        assert run(ties[:3]) == 1 and run(ties) == 3
    in_order = fj.jit(fnp.sort)(np.array([3.0, np.nan, 1.0], np.float32))
    assert in_order[:2].tolist() == [1.0, 3.0] and np.isnan(in_order[2])
    assert fj.jit(fnp.round)(np.array([0.5, 1.5, 2.5], np.float32)).tolist() == [0.0, 2.0, 2.0]
    assert fj.jit(lambda a: fnp.floor_divide(a, -1 + 0 * a))(np.array([-(2**31)], np.int32)).tolist() == [-(2**31)]
