"""fj.jit(donate_argnums=/donate_argnames=): results written into donated arguments' memory."""

import tracemalloc

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit import optim
from flowjit.backends.mlir.in_place import in_place_outputs
from flowjit.frontend.lowered import _overlapping, _overlapping_spans
from flowjit.ir.parser import parse_graph


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


def written_in_place(jitted, *args) -> str:
    """The MLIR header's list of outputs written in place ('' when none is)."""
    for line in jitted.lower(*args).as_text("mlir").splitlines():
        if line.startswith("// written in place: "):
            return line.removeprefix("// written in place: ")
    return ""


def run_steps(step, *args, steps: int = 3, copy: bool = True):
    """`steps` calls of `step` feeding its results back (on copies of `args` when `copy`); the last results."""
    args = tuple(_copied(a) for a in args) if copy else args
    for _ in range(steps):
        args = step(*args)
    return args


def _copied(tree):
    return {k: _copied(v) for k, v in tree.items()} if isinstance(tree, dict) else np.array(tree)


def _leaves(tree) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in _leaves(tree[key])]
    if isinstance(tree, tuple | list):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


def assert_bitwise_equal(got, want):
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_an_elementwise_update_is_written_in_place_with_no_workspace():
    def sgd(p, g):
        return p - 0.01 * g

    rng = np.random.default_rng(1)
    p, g = rng.standard_normal(1 << 18).astype(np.float32), rng.standard_normal(1 << 18).astype(np.float32)
    donated = fj.jit(sgd, donate_argnums=0)
    assert written_in_place(donated, p, g) == "%out0 in %in0"
    mlir = donated.lower(p, g).as_text("mlir")
    assert "// workspace: 0 bytes" in mlir and "%ws[" not in mlir  # no slot, no copy out of one
    want = fj.jit(sgd)(p, g)
    q = p.copy()
    assert donated(q, g) is q
    assert_bitwise_equal(q, want)


def test_sgd_with_momentum_donated_equals_undonated_bit_for_bit():
    opt = optim.SGD(0.1, momentum=0.9)
    rng = np.random.default_rng(2)
    params = {"w": rng.standard_normal((256, 300)).astype(np.float32), "b": rng.standard_normal(300).astype(np.float32)}
    grads = {"w": rng.standard_normal((256, 300)).astype(np.float32), "b": rng.standard_normal(300).astype(np.float32)}

    def step(params, state):
        return (*opt.update(grads, state, params),)

    donated = fj.jit(step, donate_argnums=(0, 1))
    state = opt.init(params)
    assert written_in_place(donated, params, state).count("%out") == 4  # w, b and their velocities
    assert_bitwise_equal(run_steps(donated, params, state), run_steps(fj.jit(step), params, state))


def test_adam_donated_equals_undonated_bit_for_bit():
    opt = optim.Adam(1e-2)
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((512, 513)).astype(np.float32), "b": rng.standard_normal(513).astype(np.float32)}
    grads = {"w": rng.standard_normal((512, 513)).astype(np.float32), "b": rng.standard_normal(513).astype(np.float32)}

    def step(params, state):
        return (*opt.update(grads, state, params),)

    donated = fj.jit(step, donate_argnums=(0, 1))
    state = opt.init(params)
    # p, m and v of both leaves: six results of one loop fusion, each in its own input (the step
    # count, read by a broadcast, is copied out at the end).
    assert written_in_place(donated, params, state).count("%out") == 6
    p, s = _copied(params), _copied(state)
    for _ in range(3):
        leaves = _leaves((p, s))
        p, s = donated(p, s)
        assert all(any(a is b for b in leaves) for a in _leaves((p, s)))  # every result in a donated array
    assert_bitwise_equal((p, s), run_steps(fj.jit(step), params, state))


def test_a_donated_input_read_after_its_update_falls_back_to_the_late_copy():
    def f(p, g):
        new = p - 0.1 * g
        return new, new @ p.T  # p read again by a product that needs the new value

    rng = np.random.default_rng(4)
    p, g = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    donated = fj.jit(f, donate_argnums=0)
    assert written_in_place(donated, p, g) == ""
    want = fj.jit(f)(p, g)
    q = p.copy()
    got = donated(q, g)
    assert got[0] is q
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize(
    "f, in_place",
    [
        (lambda p: p * p[0], False),  # a row of it broadcast, in the same loop fusion
        (lambda p: p / fnp.sum(p, axis=1, keepdims=True), False),  # a reduction of it
        (lambda p: p + p.T, True),  # the transpose is a kernel of its own, run first
        (lambda p: p - fnp.roll(p, 1, axis=1), True),  # the roll's concatenate copies it first
    ],
    ids=["broadcast", "reduction", "transpose-first", "roll-first"],
)
def test_a_donated_input_read_other_than_elementwise(f, in_place):
    p = np.random.default_rng(5).standard_normal((96, 96)).astype(np.float32) + 4.0
    donated = fj.jit(f, donate_argnums=0)
    assert written_in_place(donated, p) == ("%out0 in %in0" if in_place else "")
    want = fj.jit(f)(p)
    q = p.copy()
    assert donated(q) is q
    assert_bitwise_equal(q, want)


# in_place_outputs on IR: (graph, output -> the input its buffer may be, the outputs written in place)
IN_PLACE_CASES = {
    "elementwise op": (
        """func @f(%p: tensor<4x4xf32>, %g: tensor<4x4xf32>) -> (tensor<4x4xf32>) {
  %0 = sub %p, %g : tensor<4x4xf32>
  return %0 : tensor<4x4xf32>
}""",
        {0: 0},
        {0: 0},
    ),
    "several results of one loop fusion, each in its own input": (
        """func @f(%p: tensor<8xf32>, %m: tensor<8xf32>, %g: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
  %0:2 = fusion %m, %g, %p {kind = "loop"} ({
  ^fused(%m_1: tensor<8xf32>, %g_1: tensor<8xf32>, %p_1: tensor<8xf32>):
    %1 = add %m_1, %g_1 : tensor<8xf32>
    %2 = sqrt %1 : tensor<8xf32>
    %3 = sub %p_1, %2 : tensor<8xf32>
    yield %1, %3 : tensor<8xf32>, tensor<8xf32>
  }) : tensor<8xf32>, tensor<8xf32>
  return %0#1, %0#0 : tensor<8xf32>, tensor<8xf32>
}""",
        {0: 0, 1: 1},
        {0: 0, 1: 1},
    ),
    "transposed inside the fusion: not that input, but the other": (
        """func @f(%p: tensor<4x4xf32>, %g: tensor<4x4xf32>) -> (tensor<4x4xf32>) {
  %0 = fusion %p, %g {kind = "loop"} ({
  ^fused(%p_1: tensor<4x4xf32>, %g_1: tensor<4x4xf32>):
    %1 = transpose %p_1 {perm = [1, 0]} : tensor<4x4xf32>
    %2 = add %1, %g_1 : tensor<4x4xf32>
    yield %2 : tensor<4x4xf32>
  }) : tensor<4x4xf32>
  return %0 : tensor<4x4xf32>
}""",
        {0: 0},
        {},
    ),
    "a value computed from it broadcast inside the fusion": (
        """func @f(%p: tensor<4xf32>, %g: tensor<4x4xf32>) -> (tensor<4xf32>, tensor<4x4xf32>) {
  %0:2 = fusion %p, %g {kind = "loop"} ({
  ^fused(%p_1: tensor<4xf32>, %g_1: tensor<4x4xf32>):
    %1 = mul %p_1, %p_1 : tensor<4xf32>
    %2 = broadcast %1 {dims = [1], shape = [4, 4]} : tensor<4x4xf32>
    %3 = add %2, %g_1 : tensor<4x4xf32>
    yield %1, %3 : tensor<4xf32>, tensor<4x4xf32>
  }) : tensor<4xf32>, tensor<4x4xf32>
  return %0#0, %0#1 : tensor<4xf32>, tensor<4x4xf32>
}""",
        {0: 0, 1: 1},
        {1: 1},
    ),
    "read by a later op": (
        """func @f(%p: tensor<4xf32>, %g: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
  %0 = mul %p, %g : tensor<4xf32>
  %1 = add %p, %0 : tensor<4xf32>
  return %0, %1 : tensor<4xf32>, tensor<4xf32>
}""",
        {0: 0, 1: 1},
        {1: 1},
    ),
    "a reshape of it read by a later op": (
        """func @f(%p: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<16xf32>) {
  %0 = reshape %p {shape = [16]} : tensor<16xf32>
  %1 = neg %p : tensor<4x4xf32>
  %2 = neg %0 : tensor<16xf32>
  return %1, %2 : tensor<4x4xf32>, tensor<16xf32>
}""",
        {0: 0},
        {},
    ),
    "read through a view of it by the same op": (
        """func @f(%p: tensor<4x4xf32>) -> (tensor<4x4xf32>) {
  %0 = reshape %p {shape = [16]} : tensor<16xf32>
  %1 = reshape %0 {shape = [4, 4]} : tensor<4x4xf32>
  %2 = add %p, %1 : tensor<4x4xf32>
  return %2 : tensor<4x4xf32>
}""",
        {0: 0},
        {},
    ),
    "also returned as is (copied at the end)": (
        """func @f(%p: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
  %0 = neg %p : tensor<4xf32>
  return %0, %p : tensor<4xf32>, tensor<4xf32>
}""",
        {0: 0},
        {},
    ),
    "returned twice: only the first output is computed, the second copied": (
        """func @f(%p: tensor<4xf32>, %q: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
  %0 = neg %p : tensor<4xf32>
  return %0, %0 : tensor<4xf32>, tensor<4xf32>
}""",
        {0: 0, 1: 1},
        {0: 0},
    ),
    "a function that sends": (
        """func @f(%p: tensor<4xf32>) -> (tensor<4xf32>) {
  send %p {key = "a", src = "cpu:0", dst = "cpu:1"} : ()
  %0 = neg %p : tensor<4xf32>
  return %0 : tensor<4xf32>
}""",
        {0: 0},
        {},
    ),
}


@pytest.mark.parametrize("case", IN_PLACE_CASES)
def test_in_place_outputs(case):
    text, aliased, want = IN_PLACE_CASES[case]
    assert in_place_outputs(parse_graph(text), aliased) == want


def test_an_array_passed_twice_is_not_written_while_read():
    @fj.jit(donate_argnums=0)
    def f(p, g):
        new = p * 2.0
        return new, fnp.flip(g) + new  # g read after `new` is computed

    a = np.arange(8, dtype=np.float32)
    new, other = f(a, a)
    assert new is not a
    np.testing.assert_array_equal(a, np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(other, a[::-1] + 2 * a)


def test_overlapping_finds_every_array_that_shares_bytes_with_another():
    base = np.zeros(64, np.uint8)
    rng = np.random.default_rng(6)
    for _ in range(200):
        spans = [sorted(rng.integers(0, 65, 2)) for _ in range(rng.integers(1, 6))]
        arrays = [base[lo:hi] for lo, hi in spans]
        want = {
            i
            for i, (lo, hi) in enumerate(spans)
            for j, (lo2, hi2) in enumerate(spans)
            if i != j and lo < hi and lo2 < hi2 and lo < hi2 and lo2 < hi
        }
        assert _overlapping(arrays, range(len(arrays))) == want  # pair by pair
        assert _overlapping_spans(arrays) == want  # by sorted spans (many donated arrays)


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


def test_variables_updated_in_place_stay_exact():
    w = fj.Variable(np.linspace(-1, 1, 4096, dtype=np.float32), name="in_place_w")
    m = fj.Variable(np.zeros(4096, np.float32), name="in_place_m")

    @fj.jit
    def step(g):
        m.assign(0.9 * m.value + g)
        w.assign_sub(0.01 * m.value)
        return w.value * 2.0

    g = np.random.default_rng(7).standard_normal(4096).astype(np.float32)
    assert written_in_place(step, g).count("%out") == 2  # both variables
    want_w, want_m = np.linspace(-1, 1, 4096, dtype=np.float32), np.zeros(4096, np.float32)
    for _ in range(3):
        out = step(g)
        want_m = np.float32(0.9) * want_m + g
        want_w = want_w - np.float32(0.01) * want_m
        np.testing.assert_allclose(w.value, want_w, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(m.value, want_m, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out, 2 * want_w, rtol=1e-6, atol=1e-6)


def test_a_variable_read_before_its_update_and_used_after_keeps_its_old_value():
    v = fj.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="in_place_old")

    @fj.jit
    def f(g):
        old = v.value
        v.assign_sub(g)
        return old.T * 3.0  # the old value, read after the update, transposed

    np.testing.assert_array_equal(f(np.ones((2, 3), np.float32)), np.arange(6, dtype=np.float32).reshape(2, 3).T * 3)
    np.testing.assert_array_equal(v.value, np.arange(6, dtype=np.float32).reshape(2, 3) - 1)


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
