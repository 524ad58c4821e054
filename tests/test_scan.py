"""fj.scan: JAX's lax.scan semantics, compiled as one `for` op, and its gradients in O(T)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.mlir.lowering import splat_value
from flowjit.errors import FlowjitTypeError, FlowjitValueError

TARGETS = ["interpreter", "cpu"]
RNG = np.random.default_rng(0)
W = RNG.uniform(-1, 1, (3, 3))
XS = RNG.uniform(-1, 1, (6, 2, 3))


def _step(c, x):
    """A pytree carry and pytree xs and ys."""
    c = {"h": c["h"] * 0.5 + x["a"] * x["b"][0], "n": c["n"] + 1}
    return c, (fnp.sum(c["h"]), c["h"] * 2.0)


def _step_reference(init, xs, reverse):
    h, n = init["h"], init["n"]
    sums, doubled = [None] * len(xs["a"]), [None] * len(xs["a"])
    order = range(len(xs["a"]))
    for t in reversed(order) if reverse else order:
        h, n = h * np.float32(0.5) + xs["a"][t] * xs["b"][0][t], n + 1
        sums[t], doubled[t] = h.sum(), h * 2
    return {"h": h, "n": n}, (np.stack(sums), np.stack(doubled))


PYTREE_INIT = {"h": np.zeros(3, np.float32), "n": np.int64(0)}
PYTREE_XS = {
    "a": np.arange(12, dtype=np.float32).reshape(4, 3),
    "b": [RNG.uniform(-1, 1, (4, 3)).astype(np.float32)],
}


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("target", TARGETS)
def test_scan_of_pytrees_matches_a_python_loop(target, reverse):
    f = fj.jit(lambda init, xs: fj.scan(_step, init, xs, reverse=reverse), target=target)
    carry, ys = f(PYTREE_INIT, PYTREE_XS)
    want_carry, want_ys = _step_reference(PYTREE_INIT, PYTREE_XS, reverse)
    np.testing.assert_allclose(carry["h"], want_carry["h"], rtol=1e-6)
    assert int(carry["n"]) == 4
    np.testing.assert_allclose(ys[0], want_ys[0], rtol=1e-6)
    np.testing.assert_allclose(ys[1], want_ys[1], rtol=1e-6)
    assert ys[1].shape == (4, 3) and ys[1].dtype == np.float32


def test_scan_is_one_for_op_reading_and_writing_one_row_per_step():
    f = fj.jit(lambda init, xs: fj.scan(_step, init, xs))
    graph = f.lower(PYTREE_INIT, PYTREE_XS).graph("traced")
    assert [op.name for op in graph.ops].count("for") == 1
    (loop,) = [op for op in graph.ops if op.name == "for"]
    (body,) = loop.regions
    names = [op.name for op in body.ops]
    assert names.count("gather") == 2 and names.count("scatter_add") == 2  # x_t of two leaves, y_t of two


def test_scan_outside_jit_runs_compiled_and_equals_jit():
    carry, ys = fj.scan(_step, PYTREE_INIT, PYTREE_XS, reverse=True)
    want_carry, want_ys = _step_reference(PYTREE_INIT, PYTREE_XS, True)
    np.testing.assert_allclose(carry["h"], want_carry["h"], rtol=1e-6)
    np.testing.assert_allclose(ys[1], want_ys[1], rtol=1e-6)
    assert isinstance(ys[1], np.ndarray) and ys[1].dtype == np.float32


@pytest.mark.parametrize("target", TARGETS)
def test_scan_without_xs_runs_length_steps(target):
    f = fj.jit(lambda x: fj.scan(lambda c, _: (c * 2.0, c), x, length=5), target=target)
    carry, ys = f(np.float32(1.0))
    assert float(carry) == 32.0
    np.testing.assert_array_equal(ys, np.array([1, 2, 4, 8, 16], np.float32))


@pytest.mark.parametrize("target", TARGETS)
def test_scan_stacks_bool_and_int_ys(target):
    f = fj.jit(lambda xs: fj.scan(lambda c, x: (c + x, (x > 0, fnp.astype(x * 10, "int32"))), 0.0, xs), target=target)
    carry, (positive, scaled) = f(np.array([-1.0, 2.0, -0.5], np.float32))
    assert float(carry) == 0.5
    np.testing.assert_array_equal(positive, [False, True, False])
    np.testing.assert_array_equal(scaled, np.array([-10, 20, -5], np.int32))


def test_scan_of_zero_steps_returns_init_and_empty_ys():
    carry, ys = fj.jit(lambda x: fj.scan(lambda c, x: (c + x, c * x), x[0], x[:0]))(np.ones((3, 2), np.float32))
    np.testing.assert_array_equal(carry, np.ones(2, np.float32))
    assert ys.shape == (0, 2)


def test_scan_with_no_ys_and_the_unroll_hint():
    carry, ys = fj.jit(lambda xs: fj.scan(lambda c, x: (c + x, None), fnp.zeros(3, "float64"), xs, unroll=2))(XS[:, 0])
    np.testing.assert_allclose(carry, XS[:, 0].sum(0), rtol=1e-12)
    assert ys is None
    with pytest.raises(FlowjitValueError, match="unroll must be a positive int"):
        fj.jit(lambda xs: fj.scan(lambda c, x: (c + x, None), fnp.zeros(3, "float64"), xs, unroll=0))(XS[:, 0])


# --- errors -----------------------------------------------------------------------------------------------


def _raises(exc, match, fn, *args):
    with pytest.raises(exc, match=match) as info:
        fj.jit(fn)(*args)
    assert "test_scan.py" in str(info.value)


def test_mismatched_leading_lengths_name_the_leaves():
    xs = {"a": np.zeros((4, 2), np.float32), "b": np.zeros((5, 2), np.float32)}
    _raises(FlowjitValueError, r"xs\['a'\] of length 4, xs\['b'\] of length 5", lambda xs: fj.scan(_add, 0.0, xs), xs)


def _add(c, x):
    return c + fnp.sum(x["a"]) + fnp.sum(x["b"]), None


def test_length_must_match_xs_and_is_needed_without_xs():
    xs = np.zeros((4, 2), np.float32)
    _raises(
        FlowjitValueError, "length=3 does not match the leading length 4", lambda x: fj.scan(_sum, 0.0, x, length=3), xs
    )
    _raises(FlowjitValueError, "pass length=", lambda x: fj.scan(lambda c, _: (c, None), x, None), xs)
    _raises(FlowjitValueError, "is a scalar", lambda x: fj.scan(_sum, 0.0, x), np.float32(1.0))


def _sum(c, x):
    return c + fnp.sum(x), None


def test_carry_changes_are_clear_errors():
    xs = np.zeros((4, 2), np.float32)
    _raises(FlowjitTypeError, "keep the carry's types", lambda x: fj.scan(lambda c, x: (c + x, None), 0.0, x), xs)
    _raises(
        FlowjitTypeError,
        "keep the carry's types",
        lambda x: fj.scan(lambda c, x: (fnp.astype(c, "float64"), None), 0.0, x),
        xs,
    )
    _raises(FlowjitTypeError, "same structure", lambda x: fj.scan(lambda c, x: ((c, c), None), 0.0, x), xs)
    _raises(FlowjitTypeError, "must return a pair", lambda x: fj.scan(lambda c, x: c, 0.0, x), xs)


# --- gradients ---------------------------------------------------------------------------------------------


def _rnn(w, xs, reverse=False):
    def f(h, x):
        h = fnp.tanh(h @ w + x)
        return h, fnp.sum(h * h, axis=1)

    h, ys = fj.scan(f, fnp.zeros((2, 3), fnp.float64), xs, reverse=reverse)
    return fnp.sum(h) + fnp.sum(ys * fnp.arange(1.0, 7.0)[:, None])


def _rnn_unrolled(w, xs, reverse=False):
    h, ys = fnp.zeros((2, 3), fnp.float64), [None] * len(xs)
    for t in reversed(range(len(xs))) if reverse else range(len(xs)):
        h = fnp.tanh(h @ w + xs[t])
        ys[t] = fnp.sum(h * h, axis=1)
    return fnp.sum(h) + fnp.sum(fnp.stack(ys) * fnp.arange(1.0, 7.0)[:, None])


def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("target", TARGETS)
def test_grad_of_scan_matches_finite_differences_and_the_unrolled_loop(target, reverse):
    loss = fj.jit(lambda w, xs: _rnn(w, xs, reverse), target=target)
    gw, gxs = fj.jit(fj.grad(lambda w, xs: _rnn(w, xs, reverse), argnums=(0, 1)), target=target)(W, XS)
    uw, uxs = fj.jit(fj.grad(lambda w, xs: _rnn_unrolled(w, xs, reverse), argnums=(0, 1)), target=target)(W, XS)
    np.testing.assert_allclose(gw, uw, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gxs, uxs, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gw, _numeric_grad(lambda w: float(loss(w, XS)), W), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gxs, _numeric_grad(lambda xs: float(loss(W, xs)), XS), rtol=1e-6, atol=1e-8)


def test_grad_of_scan_with_respect_to_init_and_outside_jit():
    def loss(h0, w):
        h, ys = fj.scan(lambda h, x: (fnp.tanh(h @ w + x), h), h0, XS)
        return fnp.sum(h) + fnp.sum(ys**2)

    h0 = RNG.uniform(-1, 1, (2, 3))
    got = fj.grad(loss)(h0, W)  # eager: traced and compiled
    np.testing.assert_allclose(got, _numeric_grad(lambda h: float(fj.jit(loss)(h, W)), h0), rtol=1e-6, atol=1e-8)


def test_scan_inside_grad_inside_jit_and_forward_mode():
    @fj.jit
    def value_and_slope(w, direction):
        gw = fj.grad(lambda w: _rnn(w, XS))(w)
        _, tangent = fj.jvp(lambda w: _rnn(w, XS), (w,), (direction,))
        return gw, tangent

    direction = RNG.uniform(-1, 1, W.shape)
    gw, tangent = value_and_slope(W, direction)
    loss = fj.jit(lambda w: _rnn(w, XS))
    np.testing.assert_allclose(gw, _numeric_grad(lambda w: float(loss(w)), W), rtol=1e-6, atol=1e-8)
    eps = 1e-6
    slope = (float(loss(W + eps * direction)) - float(loss(W - eps * direction))) / (2 * eps)
    np.testing.assert_allclose(float(tangent), slope, rtol=1e-6)
    np.testing.assert_allclose(float(tangent), float(np.sum(gw * direction)), rtol=1e-10)


def test_grad_of_scan_tapes_only_what_the_reverse_pass_reads():
    # The stacked ys buffer (T, 2) is a carry of the loop that its VJP never reads: taping it would be a
    # (T, T, 2) tape, O(T) per iteration. Only the (T, 2, 3) tape of h is recorded.
    text = fj.jit(fj.grad(_rnn, argnums=(0, 1))).lower(W, XS).as_text("optimized")
    assert "tensor<6x6x2xf64>" not in text
    taped = text[text.index("^body_taped") : text.index("^body_vjp")]
    assert re.search(r"= scatter_add %\S+, %\S+, %\S+ \{axis = 0\} : tensor<6x2x3xf64>", taped)
    backward = text[text.index("^body_vjp") :]
    # each reverse iteration adds its row into the carried cotangent of xs (no dense (T, ...) add)
    assert not re.search(r"= add %\S+, %\S+ .*: tensor<6x2x3xf64>", backward)


def test_scan_gradient_updates_its_t_sized_buffers_in_place_on_the_cpu():
    # Every (T, ...) buffer a loop carries (the ys buffer, the tapes, the cotangents of xs and of ys) is
    # copied once, before its loop starts, then updated in place: never a copy of a carried buffer
    # (`copy(%cN)`, N a loop's block argument) in an iteration. The reverse loop passes the cotangent of
    # ys through unchanged and reads one row of it per iteration.
    lowered = fj.jit(fj.grad(_rnn, argnums=(0, 1))).lower(W, XS)
    mlir = lowered.as_text("mlir")
    assert re.findall(r"alloc_tensor\(\) copy\(%c\d+\) : tensor<6x", mlir) == []
    loops = [op for op in lowered.graph("optimized").ops if op.name == "for"]
    carried = [v for op in loops for v in op.operands[2 : 2 + op.attrs["num_carry"]] if v.type.shape[:1] == (6,)]
    initial = re.findall(r"alloc_tensor\(\) copy\(%v\d+\) : tensor<(6x\w+)>", mlir)
    copied = [v for v in carried if splat_value(v) is None]  # zeros to start from are filled, not copied
    assert len(loops) == 2 and len(carried) >= 4 and len(initial) == len(copied) < len(carried)


def _tanh_rnn(wx, wh, xs):
    def step(h, x):
        return fnp.tanh(x @ wx + h @ wh), None

    h, _ = fj.scan(step, fnp.zeros((xs.shape[1], wh.shape[0]), fnp.float32), xs)
    return fnp.sum(h)


def test_scan_gradient_adds_weight_gradients_into_their_carried_sums_on_the_cpu():
    # Each reverse step's weight gradient (acc + x.T @ dz, a matmul with its epilogue) is written into the
    # loop's carried sum itself (the generic's output is the carry: no temporary, no copies per step),
    # and the T-sized buffers the forward loop fills (tapes) start in the loop results' own buffers
    # (a writable view of the destination): nothing is copied after the loops.
    rng = np.random.default_rng(3)
    wx, wh = (rng.uniform(-0.3, 0.3, (64, 64)).astype(np.float32) for _ in range(2))
    xs = rng.uniform(-1, 1, (5, 32, 64)).astype(np.float32)
    grad = fj.grad(_tanh_rnn, argnums=(0, 1))
    mlir = fj.jit(grad).lower(wx, wh, xs).as_text("mlir")
    assert len(re.findall(r"outs\(%c\d+ : tensor<64x64xf32>\)", mlir)) == 2
    assert re.search(r"bufferization.to_tensor %\S+ restrict writable : memref<5x32x64xf32>", mlir)
    got = fj.jit(grad)(wx, wh, xs)
    want = fj.jit(grad, target="interpreter")(wx, wh, xs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_vmap_of_scan_and_of_its_gradient_equal_stacking():
    # vmap of scan is vmap of its `for` op: per-example sequences, and per-example gradients.
    batch = RNG.uniform(-1, 1, (3, *XS.shape))
    got = fj.jit(fj.vmap(lambda xs: _rnn(W, xs)))(batch)
    np.testing.assert_allclose(got, [float(fj.jit(lambda xs: _rnn(W, xs))(xs)) for xs in batch], rtol=1e-12)
    grads = fj.jit(fj.vmap(fj.grad(_rnn), in_axes=(None, 0)))(W, batch)
    want = [fj.jit(fj.grad(_rnn))(W, xs) for xs in batch]
    np.testing.assert_allclose(grads, np.stack(want), rtol=1e-10, atol=1e-12)
