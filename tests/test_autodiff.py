"""The differentiation API: grad, value_and_grad, vjp, stop_gradient, custom_vjp, nested grad, the
autodiff pass, and the errors users can cause. Numerics of each op's rule are in test_gradients.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.errors import CompileError, FlowjitTypeError
from flowjit.frontend import autodiff as autodiff_module
from flowjit.frontend import grad as grad_module
from flowjit.ir.interpreter import interpret
from flowjit.ir.parser import parse_graph
from flowjit.numpy import vjp_rules
from flowjit.passes.registry import get_pass

RNG = np.random.default_rng(0)
X = RNG.uniform(-1, 1, (3, 4)).astype(np.float32)
W = RNG.uniform(-1, 1, (4, 2)).astype(np.float32)


def interp(fn, **kwargs):
    return fj.jit(fn, target="interpreter", **kwargs)


def loss(w, x):
    return fnp.mean(fnp.tanh(x @ w) ** 2)


def loss_grad_reference(w, x):
    y = np.tanh(x @ w)
    return x.T @ (2 * y * (1 - y**2) / y.size)


# --- grad, value_and_grad, argnums, pytrees ------------------------------------------------------------


def test_grad_under_jit_matches_the_analytic_gradient():
    got = interp(fj.grad(loss))(W, X)
    assert got.dtype == np.float32 and got.shape == W.shape
    np.testing.assert_allclose(got, loss_grad_reference(W, X), rtol=1e-5, atol=1e-6)


def test_argnums_tuple_returns_a_tuple_of_gradients():
    gw, gx = interp(fj.grad(loss, argnums=(0, 1)))(W, X)
    np.testing.assert_allclose(gw, loss_grad_reference(W, X), rtol=1e-5, atol=1e-6)
    y = np.tanh(X @ W)
    np.testing.assert_allclose(gx, (2 * y * (1 - y**2) / y.size) @ W.T, rtol=1e-5, atol=1e-6)
    gx_only = interp(fj.grad(loss, argnums=-1))(W, X)
    np.testing.assert_allclose(gx_only, gx, rtol=1e-6)


def test_gradients_keep_the_pytree_structure_of_the_parameters():
    params = {"w": W, "layers": [np.float32(2.0), (np.ones(2, np.float32),)]}

    def f(p, x):
        s, (b,) = p["layers"]
        return fnp.sum(x @ p["w"] * s + b)

    g = interp(fj.grad(f))(params, X)
    assert set(g) == {"w", "layers"} and isinstance(g["layers"], list) and isinstance(g["layers"][1], tuple)
    np.testing.assert_allclose(g["w"], 2.0 * np.broadcast_to(X.sum(0)[:, None], W.shape), rtol=1e-5)
    np.testing.assert_allclose(g["layers"][0], np.sum(X @ W), rtol=1e-5)
    np.testing.assert_allclose(g["layers"][1][0], np.full(2, 3.0), rtol=1e-6)


def test_value_and_grad_and_has_aux():
    def f(w, x):
        out = x @ w
        return fnp.sum(out**2), {"mean": fnp.mean(out)}

    (value, aux), g = interp(fj.value_and_grad(f, has_aux=True))(W, X)
    np.testing.assert_allclose(value, np.sum((X @ W) ** 2), rtol=1e-5)
    np.testing.assert_allclose(aux["mean"], np.mean(X @ W), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, 2 * X.T @ (X @ W), rtol=1e-5, atol=1e-6)
    g2, aux2 = interp(fj.grad(f, has_aux=True))(W, X)
    np.testing.assert_allclose(g2, g, rtol=1e-6)
    np.testing.assert_allclose(aux2["mean"], aux["mean"], rtol=1e-6)


def test_grad_keeps_float64_and_accepts_python_floats():
    x64 = X.astype(np.float64)
    g = interp(fj.grad(lambda x: fnp.sum(fnp.sin(x))))(x64)
    assert g.dtype == np.float64
    np.testing.assert_allclose(g, np.cos(x64), rtol=1e-12)
    np.testing.assert_allclose(interp(lambda: fj.grad(lambda x: x * x * x)(3.0))(), 27.0)


def test_gradients_sum_over_broadcasts_and_scatter_through_indexing():
    b = np.arange(4, dtype=np.float32)
    idx = np.array([0, 2, 2], np.int64)

    def f(b, x):
        return fnp.sum((x + b)[idx] * 2.0)

    g = interp(fj.grad(f, argnums=(0, 1)))(b, X)
    np.testing.assert_allclose(g[0], np.full(4, 6.0), rtol=1e-6)
    np.testing.assert_allclose(g[1], np.array([[2.0] * 4, [0.0] * 4, [4.0] * 4]), rtol=1e-6)


# --- vjp ------------------------------------------------------------------------------------------------


def test_vjp_of_a_non_scalar_function_with_pytree_primals():
    def f(w, x):
        return {"y": x @ w, "s": fnp.sum(x)}

    def run(w, x, ct):
        out, vjp_fn = fj.vjp(f, w, x)
        return out, vjp_fn(ct)

    ct = {"y": RNG.uniform(-1, 1, (3, 2)).astype(np.float32), "s": np.float32(0.5)}
    out, (gw, gx) = interp(run)(W, X, ct)
    np.testing.assert_allclose(out["y"], X @ W, rtol=1e-6)
    np.testing.assert_allclose(gw, X.T @ ct["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, ct["y"] @ W.T + 0.5, rtol=1e-5, atol=1e-6)


def test_vjp_outside_jit_compiles_and_runs():
    out, vjp_fn = fj.vjp(lambda x: fnp.exp(x) * 2.0, X)
    np.testing.assert_allclose(out, np.exp(X) * 2.0, rtol=1e-6)
    (g,) = vjp_fn(np.ones_like(X))
    np.testing.assert_allclose(g, np.exp(X) * 2.0, rtol=1e-6)


def test_eager_vjp_function_can_be_jitted():
    # The program: this failed with "lambda.lower() called while tracing".
    y, f_vjp = fj.vjp(fnp.sin, 4.0)
    np.testing.assert_allclose(y, np.sin(4.0), rtol=1e-6)
    (g,) = fj.jit(f_vjp)(1.0)
    np.testing.assert_allclose(g, np.cos(4.0), rtol=1e-6)
    (g,) = fj.jit(f_vjp)(np.float32(2.0))
    np.testing.assert_allclose(g, 2 * np.cos(4.0), rtol=1e-6)


def test_vjp_rejects_a_cotangent_of_the_wrong_type():
    _, vjp_fn = fj.vjp(lambda x: x * 2.0, X)
    with pytest.raises(FlowjitTypeError, match="cotangent leaf 0 must be tensor<3x4xf32>"):
        vjp_fn(np.ones((4, 3), np.float32))


# --- eager (outside jit): compiled for the default target, cached by graph text --------------------------


def test_eager_grad_compiles_once_per_graph():
    f = fj.grad(loss)
    first = f(W, X)
    np.testing.assert_allclose(first, loss_grad_reference(W, X), rtol=1e-5, atol=1e-6)
    cached = len(grad_module._compiled)
    second = f(W * 2, X + 1)
    np.testing.assert_allclose(second, loss_grad_reference(W * 2, X + 1), rtol=1e-5, atol=1e-6)
    assert len(grad_module._compiled) == cached  # new values, same graph: no recompilation
    value, g = fj.value_and_grad(loss)(W, X)
    np.testing.assert_allclose(value, np.mean(np.tanh(X @ W) ** 2), rtol=1e-5)
    np.testing.assert_allclose(g, first, rtol=1e-5, atol=1e-7)


# --- nested grad, Hessian-vector products, closures ---------------------------------------------------------


def test_nested_grad_gives_higher_derivatives():
    third = fj.grad(fj.grad(fj.grad(fnp.sin)))
    np.testing.assert_allclose(interp(third)(np.float64(0.7)), -np.cos(0.7), rtol=1e-12)
    np.testing.assert_allclose(interp(fj.grad(fj.grad(lambda x: x**3)))(np.float32(2.0)), 12.0, rtol=1e-6)


def test_hessian_vector_product():
    a = RNG.uniform(-1, 1, (4, 4)).astype(np.float64)

    def f(x):
        return fnp.sum(fnp.tanh(a @ x)) + 0.5 * fnp.sum(x**4)

    def hvp(x, v):
        return fj.grad(lambda x: fnp.vdot(fj.grad(f)(x), v))(x)

    x, v = RNG.uniform(-1, 1, 4), RNG.uniform(-1, 1, 4)
    t = np.tanh(a @ x)
    hessian = a.T @ np.diag(-2 * t * (1 - t**2)) @ a + np.diag(6 * x**2)
    np.testing.assert_allclose(interp(hvp)(x, v), hessian @ v, rtol=1e-10)


def test_inner_grad_closing_over_the_outer_variable_is_differentiated():
    # d/dx [d/dy (x * y^2) at y = x] = d/dx (2 x^2) = 4x
    def outer(x):
        return fj.grad(lambda y: x * y * y)(x)

    np.testing.assert_allclose(interp(fj.grad(outer))(np.float32(2.0)), 8.0, rtol=1e-6)


# --- stop_gradient ---------------------------------------------------------------------------------------------


def test_stop_gradient_blocks_the_gradient_and_vanishes_from_compiled_graphs():
    def f(x):
        return fnp.sum(x * fj.stop_gradient(x))

    g = interp(fj.grad(f))
    np.testing.assert_allclose(g(X), X, rtol=1e-6)
    assert "stop_gradient" not in g.lower(X).as_text("optimized")
    np.testing.assert_array_equal(fj.stop_gradient(X), X)
    assert "stop_gradient" not in interp(f).lower(X).as_text("traced")


def test_stop_gradient_survives_nested_differentiation():
    # f(x) = x^2 * sg(x): first derivative 2x * x, second derivative 2x (not 6x).
    f = fj.grad(fj.grad(lambda x: x * x * fj.stop_gradient(x)))
    np.testing.assert_allclose(interp(f)(np.float32(3.0)), 6.0, rtol=1e-6)


# --- custom_vjp -------------------------------------------------------------------------------------------------


@fj.custom_vjp
def clip_gradient(x, bound):
    return x


def _clip_fwd(x, bound):
    return x, (bound,)


def _clip_bwd(residuals, ct):
    (bound,) = residuals
    return fnp.clip(ct, -bound, bound), None


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


@fj.custom_vjp
def safe_log1pexp(x):
    return fnp.log1p(fnp.exp(x))


def _softplus_fwd(x):
    return fnp.log1p(fnp.exp(x)), (x,)


def _softplus_bwd(residuals, ct):
    (x,) = residuals
    return (ct * fnp.logistic(x),)


safe_log1pexp.defvjp(_softplus_fwd, _softplus_bwd)


def test_custom_vjp_replaces_the_gradient_of_the_function():
    def f(x):
        return fnp.sum(clip_gradient(x * 10.0, np.float32(1.0)))

    np.testing.assert_allclose(interp(fj.grad(f))(X), np.full_like(X, 10.0), rtol=1e-6)  # ct 1 is within bound
    g = interp(fj.grad(lambda x: fnp.sum(clip_gradient(x, np.float32(0.5)) * 3.0)))(X)
    np.testing.assert_allclose(g, np.full_like(X, 0.5), rtol=1e-6)  # ct 3 clipped to 0.5


def test_custom_vjp_gradient_is_the_rule_not_the_forward_ops():
    x = np.array([-100.0, 0.0, 100.0], np.float32)  # exp(100) overflows in float32: autodiff would give nan
    g = interp(fj.grad(lambda x: fnp.sum(safe_log1pexp(x))))(x)
    np.testing.assert_allclose(g, [0.0, 0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(fj.grad(lambda x: fnp.sum(safe_log1pexp(x)))(x), [0.0, 0.5, 1.0], atol=1e-6)


def test_custom_vjp_outside_differentiation_calls_the_function():
    np.testing.assert_allclose(safe_log1pexp(np.float32(0.0)), np.log(2.0), rtol=1e-6)
    assert "custom_vjp_call" not in interp(lambda x: safe_log1pexp(x)).lower(X).as_text("traced")
    assert "custom_vjp_call" not in interp(fj.grad(lambda x: fnp.sum(safe_log1pexp(x)))).lower(X).as_text("optimized")


def test_custom_vjp_whose_forward_calls_the_function_itself():
    # The pattern of JAX's docs; it recursed until Python's RecursionError.
    @fj.custom_vjp
    def f(x):
        return fnp.sin(x)

    f.defvjp(lambda x: (f(x), fnp.cos(x)), lambda cos_x, g: (2.0 * cos_x * g,))  # 2x the true gradient
    np.testing.assert_allclose(fj.grad(f)(1.0), 2 * np.cos(1.0), rtol=1e-6)
    np.testing.assert_allclose(fj.jit(fj.grad(lambda x: fnp.sum(f(x))))(X), 2 * np.cos(X), rtol=1e-6)
    np.testing.assert_allclose(f(np.float32(1.0)), np.sin(1.0), rtol=1e-6)


def test_custom_vjp_backward_must_return_one_cotangent_per_argument():
    @fj.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, ()), lambda res, ct: ct)
    with pytest.raises(FlowjitTypeError, match="must return a tuple of 1 cotangent"):
        interp(fj.grad(lambda x: fnp.sum(f(x))))(X)


# --- control flow ---------------------------------------------------------------------------------------------------


def test_grad_through_cond_takes_the_branch_that_ran():
    def f(x, p):
        return fnp.sum(fj.cond(p > 0, lambda a: fnp.sin(a) * a, lambda a: a * fj.stop_gradient(a) * 3.0, x))

    g = interp(fj.grad(f))
    np.testing.assert_allclose(g(X, np.float32(1.0)), np.cos(X) * X + np.sin(X), rtol=1e-5)
    np.testing.assert_allclose(g(X, np.float32(-1.0)), 3.0 * X, rtol=1e-5)
    assert "stop_gradient" not in g.lower(X, np.float32(1.0)).as_text("optimized")  # not even inside regions


def _rnn(x, w, steps):
    def body(i, carry):
        h, total = carry
        h = fnp.tanh(h * w + 0.1 * fnp.astype(i, h.dtype))
        return h, total + fnp.sum(h)

    h, total = fj.fori_loop(0, steps, body, (x, fnp.zeros((), x.dtype)))
    return total + fnp.sum(h * h)


def _rnn_reference(x, w, steps):
    h, total = x, 0.0
    for i in range(steps):
        h = np.tanh(h * w + 0.1 * i)
        total += h.sum()
    return total + np.sum(h * h)


def test_grad_through_fori_loop_matches_finite_differences():
    x, w, eps = np.linspace(-1, 1, 3), np.float64(0.7), 1e-6
    gx, gw = interp(fj.grad(_rnn, argnums=(0, 1)), static_argnums=2)(x, w, 4)
    fd_x = [(_rnn_reference(x + eps * e, w, 4) - _rnn_reference(x - eps * e, w, 4)) / (2 * eps) for e in np.eye(3)]
    np.testing.assert_allclose(gx, fd_x, rtol=1e-7)
    np.testing.assert_allclose(
        gw, (_rnn_reference(x, w + eps, 4) - _rnn_reference(x, w - eps, 4)) / (2 * eps), rtol=1e-7
    )
    second = interp(fj.grad(fj.grad(lambda w: _rnn(x, w, 4))))(w)
    first = interp(fj.grad(lambda w: _rnn(x, w, 4)))
    np.testing.assert_allclose(second, (first(w + 1e-5) - first(w - 1e-5)) / 2e-5, rtol=1e-6)
    assert interp(fj.grad(_rnn, argnums=1), static_argnums=2)(x, w, 0) == 0.0  # no iterations: w unused


SEQ = RNG.uniform(-1, 1, (6, 2, 3))  # (T, B, D): the closed-over sequence of the loop tests below
SEQ_W = RNG.uniform(-1, 1, (3, 3))


def _seq_rnn(w, xs, whole_read):
    def body(i, h):
        step = xs[i] + 0.5 * xs[(i + 2) % xs.shape[0]]  # two rows of the invariant per iteration
        if whole_read:
            step = step + 0.1 * fnp.mean(xs, axis=0)  # and all of it: a dense cotangent every iteration
        return fnp.tanh(step @ w + h)

    return fnp.sum(fj.fori_loop(0, xs.shape[0], body, fnp.zeros(xs.shape[1:], xs.dtype)) ** 2)


def _numeric_grad(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for k in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[k] = eps
        grad[k] = (f(x + e) - f(x - e)) / (2 * eps)
    return grad


def _backward_loop_text(text: str) -> str:
    return text[text.index("^body_vjp") :]


@pytest.mark.parametrize("whole_read", [False, True], ids=["rows", "rows-and-whole"])
@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_grad_of_fori_loop_reading_rows_of_a_closed_over_sequence(target, whole_read):
    loss = fj.jit(lambda w, xs: _seq_rnn(w, xs, whole_read), target=target)
    grad = fj.jit(fj.grad(lambda w, xs: _seq_rnn(w, xs, whole_read), argnums=(0, 1)), target=target)
    gw, gxs = grad(SEQ_W, SEQ)
    np.testing.assert_allclose(gw, _numeric_grad(lambda w: float(loss(w, SEQ)), SEQ_W), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(gxs, _numeric_grad(lambda xs: float(loss(SEQ_W, xs)), SEQ), rtol=1e-6, atol=1e-9)
    backward = _backward_loop_text(grad.lower(SEQ_W, SEQ).as_text("optimized"))
    # rows only: each iteration adds its rows into the carried cotangent of xs (scatter_add into the
    # loop's parameter), never a dense (T, B, D) zeros + scatter_add + add; read whole, the dense add stays
    dense_add = re.search(r"= add %\S+, %\S+ .*: tensor<6x2x3xf64>", backward)
    assert (dense_add is not None) == whole_read
    assert (re.search(r"= scatter_add %a\d+_\d+, ", backward) is not None) != whole_read


def test_fori_loop_gradient_accumulates_rows_in_place_on_the_cpu():
    # The carried (T, B, D) buffers (the forward loop's tape of h, the reverse loop's cotangent of xs) are
    # updated in place: they start as zeros, filled (not copied) before each loop, and no iteration copies
    # a whole (T, ...) buffer.
    grad = fj.jit(fj.grad(lambda w, xs: _seq_rnn(w, xs, False), argnums=(0, 1)))
    mlir = grad.lower(SEQ_W, SEQ).as_text("mlir")
    assert not re.search(r"linalg.copy ins\(%c\d+ : tensor<6x2x3xf64>\)", mlir)  # scatter_add's copy of its x
    assert not re.findall(r"alloc_tensor\(\) copy\(%\w+\) : tensor<6x2x3xf64>", mlir)


def test_grad_through_fori_loop_with_traced_bounds_is_an_error():
    def f(x, n):
        return fnp.sum(fj.fori_loop(0, n, lambda i, h: h * 2.0, x))

    with pytest.raises(FlowjitTypeError, match="traced upper bound"):
        interp(fj.grad(f))(X, np.int64(3))


def test_grad_through_while_loop_is_an_error_naming_fori_loop():
    def f(x):
        return fj.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2.0, c[1] + 1), (x, 0))[0].sum()

    with pytest.raises(FlowjitTypeError, match="fori_loop") as info:
        interp(fj.grad(f))(X)
    assert "test_autodiff.py" in str(info.value)


# --- the pass and the optimized graph ------------------------------------------------------------------------------


def test_gradient_graph_is_canonicalized_and_carries_forward_locations():
    def f(x):
        return fnp.sum(fnp.sin(x))  # the line of the `cos` in the gradient

    text = interp(fj.grad(f)).lower(X).as_text("optimized")
    line = f.__code__.co_firstlineno + 1
    cos_lines = [ln for ln in text.splitlines() if "= cos " in ln]
    assert len(cos_lines) == 1 and f'test_autodiff.py":{line})' in cos_lines[0]
    assert "= sin " not in text  # the forward value is unused: DCE removed it
    assert "reduce_sum" not in text  # the cotangent of sum is a broadcast of 1: folded away


def test_gradient_ops_are_colocated_with_the_forward_op():
    def f(x):
        with fj.device("cpu:0"):
            y = fnp.sin(x)
        return fnp.sum(y * 2.0)

    text = interp(fj.grad(f)).lower(X).as_text("traced")  # before placement assigns every op a device
    (cos_line,) = [ln for ln in text.splitlines() if "= cos " in ln]
    assert 'device("/device:cpu:0")' in cos_line
    (sum_line,) = [ln for ln in text.splitlines() if "= reduce_sum " in ln]
    assert "device(" not in sum_line


def test_autodiff_pass_on_text_ir():
    graph = parse_graph(
        """func @f(%x: tensor<3xf32>, %n: tensor<3xi64>) -> (tensor<f32>) {
  %0 = mul %x, %x : tensor<3xf32>
  %1 = reduce_sum %0 {axes = [0]} : tensor<f32>
  return %1 : tensor<f32>
}"""
    )
    vjp = get_pass("autodiff")(graph)
    assert [str(t) for t in vjp.param_types] == ["tensor<3xf32>", "tensor<3xi64>", "tensor<f32>"]
    x = np.array([1.0, -2.0, 0.5], np.float32)
    value, grad = interpret(vjp, [x, np.zeros(3, np.int64), np.float32(2.0)])
    np.testing.assert_allclose(value, np.sum(x * x))
    np.testing.assert_allclose(grad, 4.0 * x)


# --- errors -------------------------------------------------------------------------------------------------------


def test_non_scalar_loss_is_an_error_suggesting_vjp():
    with pytest.raises(FlowjitTypeError, match="fj.vjp") as info:
        interp(fj.grad(lambda x: x * 2.0))(X)
    assert "tensor<3x4xf32>" in str(info.value) and "test_autodiff.py" in str(info.value)


def test_integer_argument_is_an_error():
    with pytest.raises(FlowjitTypeError, match="only float arrays have gradients") as info:
        interp(fj.grad(lambda x, n: fnp.sum(x) * n, argnums=1))(X, np.int32(3))
    assert "argument n, which is of dtype i32" in str(info.value)
    with pytest.raises(FlowjitTypeError, match=r"argument p\['w'\], which is a Python int"):
        fj.vjp(lambda p: p["w"] * 2, {"w": 3})


def test_missing_vjp_rule_names_the_op_and_the_users_line(monkeypatch):
    monkeypatch.delitem(autodiff_module.VJP_RULES, "sin")

    def f(x):
        return fnp.sum(fnp.sin(x))

    with pytest.raises(CompileError, match="no vjp rule for op 'sin'") as info:
        interp(fj.grad(f))(X)
    assert f"test_autodiff.py:{f.__code__.co_firstlineno + 1}" in str(info.value)


@pytest.mark.parametrize(
    "kernel, stride, padding, size",
    [
        ((3, 3), (2, 2), ((1, 1), (1, 1)), (9, 10)),
        ((1, 1), (2, 2), ((0, 0), (0, 0)), (8, 7)),
        ((7, 7), (2, 2), ((3, 3), (3, 3)), (16, 15)),
        ((2, 3), (3, 2), ((1, 2), (3, 0)), (11, 9)),
        ((5, 4), (1, 3), ((0, 0), (2, 2)), (9, 13)),
    ],
)
@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_strided_conv_input_gradient_by_phases(monkeypatch, kernel, stride, padding, size, target):
    """The input gradient of a strided conv as s0*s1 stride-1 convs, one per phase, equals the
    one stride-1 conv over the stride-dilated cotangent (float64), kernels larger and smaller than
    the stride, phases no tap reaches, uneven padding."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((2, 3, *size)), rng.standard_normal((4, 3, *kernel))

    def loss(x, w):
        y = fj.nn.conv2d(x, w, stride=stride, padding=padding)
        return fnp.sum(y * fnp.cos(y))

    grads = {}
    for phases in (True, False):
        monkeypatch.setattr(vjp_rules, "STRIDED_INPUT_GRADIENT_BY_PHASES", phases)
        grads[phases] = fj.jit(fj.grad(loss), target=target)(x, w)
    np.testing.assert_allclose(grads[True], grads[False], rtol=1e-10, atol=1e-10)
