"""fj.custom_jvp (defjvp, defjvps) as a reverse-mode rule, and nondiff_argnums of custom_jvp and
custom_vjp; the examples are JAX's "Custom derivative rules" documentation's."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.errors import FlowjitTypeError, FlowjitValueError


@fj.custom_jvp
def log1pexp(x):
    return fnp.log(1.0 + fnp.exp(x))


@log1pexp.defjvp
def log1pexp_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    ans = log1pexp(x)  # the rule calls the function itself
    return ans, (1 - 1 / (1 + fnp.exp(x))) * x_dot


@fj.custom_jvp
def sin_times(x, y):
    return fnp.sin(x) * y


@sin_times.defjvp
def sin_times_jvp(primals, tangents):
    x, y = primals
    x_dot, y_dot = tangents
    return sin_times(x, y), fnp.cos(x) * x_dot * y + fnp.sin(x) * y_dot


def test_custom_jvp_gives_a_numerically_stable_gradient():
    # Differentiating log(1 + exp(x)) itself gives exp(100)/(1 + exp(100)) = inf/inf = nan in float32.
    assert float(fj.grad(log1pexp)(100.0)) == 1.0
    assert float(fj.jit(fj.grad(log1pexp))(100.0)) == 1.0
    assert np.isnan(float(fj.grad(lambda x: fnp.log(1.0 + fnp.exp(x)))(100.0)))
    g = fj.jit(fj.grad(lambda x: fnp.sum(log1pexp(x))))(np.array([-100.0, 0.0, 100.0], np.float32))
    np.testing.assert_allclose(g, [0.0, 0.5, 1.0], atol=1e-7)


def test_custom_jvp_outside_differentiation_runs_the_function():
    np.testing.assert_allclose(log1pexp(3.0), np.log1p(np.exp(3.0)), rtol=1e-6)
    np.testing.assert_allclose(fj.jit(log1pexp)(np.float32(3.0)), np.log1p(np.exp(3.0)), rtol=1e-6)
    assert "custom_vjp_call" not in fj.jit(log1pexp).lower(np.float32(3.0)).as_text("traced")


def test_custom_jvp_of_two_arguments_in_every_transformation():
    x, y = 2.0, 3.0
    gx, gy = fj.grad(sin_times, argnums=(0, 1))(x, y)
    np.testing.assert_allclose([gx, gy], [np.cos(x) * y, np.sin(x)], rtol=1e-6)
    out, tangent = fj.jvp(sin_times, (x, y), (1.0, 2.0))
    np.testing.assert_allclose(out, np.sin(x) * y, rtol=1e-6)
    np.testing.assert_allclose(tangent, np.cos(x) * y + 2.0 * np.sin(x), rtol=1e-6)
    _, vjp_fn = fj.vjp(sin_times, x, y)
    np.testing.assert_allclose(vjp_fn(np.float32(2.0)), [2 * np.cos(x) * y, 2 * np.sin(x)], rtol=1e-6)
    xs = np.array([0.5, 1.0, 2.0], np.float32)
    jac_fwd = fj.jit(fj.jacfwd(lambda v: sin_times(v, v)))(xs)
    jac_rev = fj.jit(fj.jacrev(lambda v: sin_times(v, v)))(xs)
    np.testing.assert_allclose(jac_fwd, np.diag(np.cos(xs) * xs + np.sin(xs)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jac_rev, jac_fwd, rtol=1e-6, atol=1e-7)


def test_the_derivative_is_the_rule_not_the_function():
    @fj.custom_jvp
    def f(x):
        return fnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 3.0 * t[0]))  # deliberately not the true derivative
    assert float(fj.grad(f)(1.0)) == 3.0
    assert float(fj.jvp(f, (1.0,), (2.0,))[1]) == 6.0
    np.testing.assert_allclose(fj.jit(fj.grad(lambda x: fnp.sum(f(x) ** 2)))(np.ones(2, np.float32)), 6 * np.sin(1.0))


def test_higher_order_differentiates_the_rule():
    # d/dx (cos(x) * y) = -sin(x) * y: grad of grad, and hessian, go through the rule's tangent map.
    np.testing.assert_allclose(fj.grad(fj.grad(sin_times))(2.0, 3.0), -np.sin(2.0) * 3.0, rtol=1e-6)
    np.testing.assert_allclose(fj.jit(fj.hessian(sin_times))(np.float32(2.0), 3.0), -np.sin(2.0) * 3.0, rtol=1e-6)
    second = fj.grad(fj.grad(log1pexp))(0.5)
    np.testing.assert_allclose(second, np.exp(0.5) / (1 + np.exp(0.5)) ** 2, rtol=1e-6)


def test_defjvps_sums_one_rule_per_argument():
    @fj.custom_jvp
    def f(x, y):
        return fnp.sin(x) * y

    f.defjvps(lambda x_dot, ans, x, y: fnp.cos(x) * x_dot * y, lambda y_dot, ans, x, y: fnp.sin(x) * y_dot)
    np.testing.assert_allclose(fj.grad(f, argnums=(0, 1))(2.0, 3.0), [np.cos(2.0) * 3.0, np.sin(2.0)], rtol=1e-6)
    np.testing.assert_allclose(fj.jvp(f, (2.0, 3.0), (1.0, 0.0))[1], np.cos(2.0) * 3.0, rtol=1e-6)


def test_custom_jvp_under_jit_with_arrays_and_pytrees():
    @fj.custom_jvp
    def norm_sq(tree):
        return fnp.sum(tree["a"] ** 2) + fnp.sum(tree["b"] ** 2)

    @norm_sq.defjvp
    def _(primals, tangents):
        (t,), (dt,) = primals, tangents
        return norm_sq(t), 2 * fnp.sum(t["a"] * dt["a"]) + 2 * fnp.sum(t["b"] * dt["b"])

    tree = {"a": np.arange(3.0), "b": np.ones((2, 2))}
    g = fj.jit(fj.grad(norm_sq))(tree)
    np.testing.assert_allclose(g["a"], 2 * tree["a"])
    np.testing.assert_allclose(g["b"], 2 * tree["b"])


def test_custom_jvp_rule_errors_name_the_function():
    @fj.custom_jvp
    def f(x):
        return x

    with pytest.raises(FlowjitValueError, match="has no rule"):
        fj.grad(f)(1.0)
    f.defjvp(lambda p, t: p[0])
    with pytest.raises(FlowjitTypeError, match=r"must return \(primal_out, tangent_out\)"):
        fj.grad(f)(1.0)
    f.defjvp(lambda p, t: (p[0], (t[0], t[0])))
    with pytest.raises(FlowjitTypeError, match="tangent_out of structure"):
        fj.grad(f)(1.0)


# --- nondiff_argnums --------------------------------------------------------------------------------------------


def test_custom_jvp_with_a_function_as_a_nondiff_argument():
    @partial(fj.custom_jvp, nondiff_argnums=(0,))
    def app(f, x):
        return f(x)

    @app.defjvp
    def app_jvp(f, primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return f(x), 2.0 * x_dot

    assert float(app(lambda x: x**3, 3.0)) == 27.0
    assert float(fj.grad(app, 1)(lambda x: x**3, 3.0)) == 2.0
    assert float(fj.jit(fj.grad(lambda x: app(lambda v: v**3, x)))(np.float32(3.0))) == 2.0


def test_custom_jvp_with_an_int_and_an_array_as_nondiff_arguments():
    @partial(fj.custom_jvp, nondiff_argnums=(1, 2))
    def power_scaled(x, n, scale):
        return scale * x**n

    @power_scaled.defjvp
    def _(n, scale, primals, tangents):
        assert isinstance(n, int)  # a Python value stays a Python value
        (x,), (x_dot,) = primals, tangents
        return power_scaled(x, n, scale), scale * n * x ** (n - 1) * x_dot

    scale = np.float32(2.0)
    g = fj.jit(fj.grad(lambda x, s: power_scaled(x, 3, s)))(np.float32(2.0), scale)
    assert float(g) == 24.0
    assert float(fj.grad(lambda x: power_scaled(x, 2, scale))(3.0)) == 12.0


def test_custom_vjp_with_nondiff_arguments_first_in_bwd():
    @partial(fj.custom_vjp, nondiff_argnums=(0,))
    def app(f, x):
        return f(x)

    app.defvjp(lambda f, x: (f(x), x), lambda f, x, g: (5 * g,))
    assert float(fj.grad(app, 1)(lambda x: x**3, 3.0)) == 5.0

    @partial(fj.custom_vjp, nondiff_argnums=(0, 1))
    def clip_gradient(lo, hi, x):
        return x

    clip_gradient.defvjp(lambda lo, hi, x: (x, None), lambda lo, hi, _, g: (fnp.clip(g, lo, hi),))
    g = fj.jit(fj.grad(lambda x: fnp.sum(clip_gradient(-0.5, 0.5, x) * np.array([0.1, 3.0], np.float32))))
    np.testing.assert_allclose(g(np.ones(2, np.float32)), [0.1, 0.5], rtol=1e-6)


class _Scale:
    """A configuration object with value equality and no hash (`__eq__` without `__hash__`)."""

    def __init__(self, k):
        self.k = k

    def __eq__(self, other):
        return isinstance(other, _Scale) and self.k == other.k


def test_nondiff_values_key_the_rule_by_value_and_must_be_hashable():
    @partial(fj.custom_vjp, nondiff_argnums=(1,))
    def scaled(x, k):
        return x * (k.k if isinstance(k, _Scale) else k)

    scaled.defvjp(lambda x, k: (scaled(x, k), None), lambda k, _, g: (g * k,))
    assert float(fj.grad(scaled)(1.0, 2)) == 2.0
    assert float(fj.grad(scaled)(1.0, 3)) == 3.0  # a new value: its own rule, not the cached one
    with pytest.raises(FlowjitTypeError, match="must be hashable") as info:
        fj.grad(lambda x: scaled(x, _Scale(2)))(1.0)
    assert "test_custom_derivatives.py" in str(info.value)


def test_vmap_of_a_custom_jvp_and_of_its_gradient():
    xs = np.array([-100.0, 0.0, 3.0, 100.0], np.float32)
    np.testing.assert_allclose(
        fj.vmap(log1pexp)(np.array([0.0, 3.0], np.float32)), np.log1p(np.exp([0.0, 3.0])), rtol=1e-6
    )
    np.testing.assert_allclose(
        fj.jit(fj.vmap(fj.grad(log1pexp)))(xs), [0.0, 0.5, 1 / (1 + np.exp(-3.0)), 1.0], atol=1e-7
    )


def test_nondiff_arguments_reach_the_rules_in_the_order_of_nondiff_argnums():
    @partial(fj.custom_vjp, nondiff_argnums=(2, 0))
    def f(a, x, b):
        return x * (a - b)

    f.defvjp(lambda a, x, b: (f(a, x, b), None), lambda b, a, _, g: (g * (a - b),))
    assert float(fj.grad(f, 1)(5, 2.0, 3)) == 2.0

    @partial(fj.custom_jvp, nondiff_argnums=(2, 0))
    def h(a, x, b):
        return x * (a - b)

    h.defjvp(lambda b, a, primals, tangents: (h(a, primals[0], b), tangents[0] * (a - b)))
    assert float(fj.grad(h, 1)(5, 2.0, 3)) == 2.0
