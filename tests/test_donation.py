"""fj.jit(donate_argnums=/donate_argnames=): results written into donated arguments' memory."""

import tracemalloc

import numpy as np
import pytest

import flowjit as fj


def test_elementwise_update_reuses_the_donated_array_call_after_call():
    @fj.jit(donate_argnums=0)
    def step(p, g):
        return p - 0.5 * g

    p, g = np.ones(1000, np.float32), np.ones(1000, np.float32)
    q = step(p, g)
    assert q is p
    np.testing.assert_array_equal(q, np.full(1000, 0.5, np.float32))
    assert step(q, g) is q
    np.testing.assert_array_equal(q, np.zeros(1000, np.float32))


def test_results_that_read_the_donated_input_out_of_order_are_exact():
    # The reversed and transposed reads would see half-written data if the result were written in place
    # while the input is still being read; donated results are written after every read.
    @fj.jit(donate_argnums=(0,))
    def f(x, w):
        return (x @ w)[::-1] + x.T[::-1, ::-1]

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    want = (x @ w)[::-1] + x.T[::-1, ::-1]
    out = f(x, w)
    assert out is x
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_pytrees_by_name_and_an_input_returned_as_is():
    @fj.jit(donate_argnames=("params",))
    def update(params, lr):
        return {k: v * lr for k, v in params.items()}, params["b"]

    params = {"a": np.ones(3, np.float32), "b": np.full(3, 2.0, np.float32)}
    a, b = params["a"], params["b"]
    new, returned_b = update(params, 0.5)
    assert new["a"] is a  # donated and written in place
    np.testing.assert_array_equal(new["a"], [0.5, 0.5, 0.5])
    # `b` is also returned unchanged, so it keeps its value (and is not overwritten by new["b"])
    np.testing.assert_array_equal(returned_b, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(b, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(new["b"], [1.0, 1.0, 1.0])


def test_the_same_array_donated_twice_backs_at_most_one_result():
    @fj.jit(donate_argnums=(0, 1))
    def f(x, y):
        return x + y, x - y

    z = np.ones(4, np.float32)
    s, d = f(z, z)
    np.testing.assert_array_equal(s, [2, 2, 2, 2])
    np.testing.assert_array_equal(d, [0, 0, 0, 0])
    assert not np.shares_memory(s, d)


def test_arrays_that_cannot_take_the_result_get_a_fresh_one():
    step = fj.jit(lambda p: p * 2.0, donate_argnums=0)
    read_only = np.ones(4, np.float32)
    read_only.setflags(write=False)
    out = step(read_only)
    assert out is not read_only
    np.testing.assert_array_equal(read_only, np.ones(4, np.float32))
    strided = np.ones(8, np.float32)[::2]
    np.testing.assert_array_equal(step(strided), np.full(4, 2.0, np.float32))
    assert step(np.ones(4, np.float64)).dtype == np.float64  # a new signature: compiled again, donation kept


def test_donation_with_variables():
    v = fj.Variable(np.zeros(3, np.float32), name="donation_v")

    @fj.jit(donate_argnums=0)
    def f(x):
        v.assign_add(x)
        return x * 2 + v.value

    x = np.ones(3, np.float32)
    out = f(x)
    assert out is x
    np.testing.assert_array_equal(out, [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(v.value, [1.0, 1.0, 1.0])


def test_interpreter_target_computes_the_same_results():
    f = fj.jit(lambda x: x + 1.0, donate_argnums=0, target="interpreter")
    np.testing.assert_array_equal(f(np.ones(2, np.float32)), [2.0, 2.0])


def test_repeated_donated_calls_allocate_no_result_memory():
    n = 1 << 20  # 4 MiB of float32

    def peak_per_call(fn, x):
        fn(x)  # compile
        tracemalloc.start()
        for _ in range(3):
            x = fn(x)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    plain = peak_per_call(fj.jit(lambda x: x * 0.5 + 1.0), np.ones(n, np.float32))
    donated = peak_per_call(fj.jit(lambda x: x * 0.5 + 1.0, donate_argnums=0), np.ones(n, np.float32))
    assert plain >= 4 * n
    assert donated < n // 4


def test_bad_donation_arguments_are_clear_errors():
    with pytest.raises(fj.FlowjitValueError, match="both static and donated"):
        fj.jit(lambda x, n: x, static_argnums=1, donate_argnums=1)
    with pytest.raises(fj.FlowjitValueError, match="donate_argnums 3 is out of range"):
        fj.jit(lambda x: x, donate_argnums=3)
    with pytest.raises(fj.FlowjitValueError, match="donate_argnames 'y' is not a parameter"):
        fj.jit(lambda x: x, donate_argnames="y")
