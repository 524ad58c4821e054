"""Forward mode and Jacobians (`jvp`, `linearize`, `jacfwd`, `jacrev`, `hessian`) against central
finite differences in float64, eagerly and under jit; jacfwd equals jacrev."""

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp

RNG = np.random.default_rng(11)
X = RNG.uniform(-1.5, 1.5, 4)
W = RNG.standard_normal((4, 3))


def mixed(x):
    return fnp.sin(x) * x[::-1] + fnp.sum(x**2) + fnp.exp(x).cumsum()


def layer(params, x):
    return fnp.tanh(x @ params["w"] + params["b"])


def scalar(x):
    return fnp.sum(fnp.tanh(x) * x**3) + fnp.prod(fnp.cos(x))


def numeric_jacobian(f, x, eps=1e-6):
    """d f(x) / d x by central differences: shape f(x).shape + x.shape."""
    x = np.asarray(x, np.float64)
    columns = []
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        columns.append((np.asarray(f(up)) - np.asarray(f(down))) / (2 * eps))
    out_shape = np.shape(f(x))
    return np.moveaxis(np.array(columns), 0, -1).reshape(out_shape + x.shape)


@pytest.mark.parametrize("wrap", [lambda f: f, fj.jit], ids=["eager", "jit"])
def test_jvp_is_the_jacobian_times_the_tangent(wrap):
    t = RNG.standard_normal(4)
    out, tangent = wrap(lambda x, t: fj.jvp(mixed, (x,), (t,)))(X, t)
    np.testing.assert_allclose(out, mixed(X), rtol=1e-12)
    np.testing.assert_allclose(tangent, numeric_jacobian(mixed, X) @ t, rtol=1e-6, atol=1e-8)


def test_jvp_of_scalars_pytrees_and_the_issues_example():
    out, tangent = fj.jvp(fnp.sin, (4.0,), (1.0,))
    np.testing.assert_allclose([out, tangent], [np.sin(4.0), np.cos(4.0)], rtol=1e-6)
    b = RNG.standard_normal(3)
    params, dparams = {"w": W, "b": b}, {"w": RNG.standard_normal((4, 3)), "b": RNG.standard_normal(3)}
    dx = RNG.standard_normal(4)
    _, tangent = fj.jvp(layer, (params, X), (dparams, dx))
    eps = 1e-6
    plus = layer({k: v + eps * dparams[k] for k, v in params.items()}, X + eps * dx)
    minus = layer({k: v - eps * dparams[k] for k, v in params.items()}, X - eps * dx)
    np.testing.assert_allclose(tangent, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-8)


def test_linearize_gives_a_reusable_jvp_function():
    out, f_jvp = fj.linearize(mixed, X)
    np.testing.assert_allclose(out, mixed(X), rtol=1e-12)
    jac = numeric_jacobian(mixed, X)
    for t in (np.eye(4)[1], RNG.standard_normal(4)):
        np.testing.assert_allclose(f_jvp(t), jac @ t, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("f", [mixed, scalar, lambda x: fnp.outer(x, x)], ids=["mixed", "scalar", "outer"])
def test_jacfwd_equals_jacrev_equals_finite_differences(f):
    expected = numeric_jacobian(f, X)
    forward, reverse = fj.jacfwd(f)(X), fj.jit(fj.jacrev(f))(X)
    assert forward.shape == reverse.shape == expected.shape
    np.testing.assert_allclose(forward, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(reverse, forward, rtol=1e-12, atol=1e-12)
    assert fj.jacobian is fj.jacrev


def test_jacobians_of_pytrees_follow_the_output_and_input_structures():
    params = {"w": W, "b": RNG.standard_normal(3)}
    jac = fj.jacrev(layer, argnums=(0, 1))(params, X)
    fwd = fj.jacfwd(layer, argnums=(0, 1))(params, X)
    assert jac[0]["w"].shape == (3, 4, 3) and jac[0]["b"].shape == (3, 3) and jac[1].shape == (3, 4)
    np.testing.assert_allclose(jac[1], numeric_jacobian(lambda x: layer(params, x), X), rtol=1e-6, atol=1e-8)
    expected_w = numeric_jacobian(lambda w: layer({"w": w, "b": params["b"]}, X), W)
    for j in (jac, fwd):
        np.testing.assert_allclose(j[0]["w"], expected_w, rtol=1e-6, atol=1e-8)
    (j, aux) = fj.jacrev(lambda x: (mixed(x), 2 * x), has_aux=True)(X)
    np.testing.assert_allclose(aux, 2 * X)
    np.testing.assert_allclose(j, fj.jacrev(mixed)(X), rtol=1e-12)


@pytest.mark.parametrize("wrap", [lambda f: f, fj.jit], ids=["eager", "jit"])
def test_hessian_matches_finite_differences_of_the_gradient(wrap):
    hess = wrap(fj.hessian(scalar))(X)
    expected = numeric_jacobian(fj.grad(scalar), X, eps=1e-5)
    np.testing.assert_allclose(hess, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(hess, hess.T, rtol=1e-12, atol=1e-12)


def test_jvp_errors_name_the_users_line():
    with pytest.raises(fj.FlowjitTypeError, match=r"test_forward.py:\d+: jvp takes primals and tangents as tuples"):
        fj.jvp(mixed, X, X)
    with pytest.raises(fj.FlowjitTypeError, match=r"test_forward.py:\d+: .*must have the primal's shape \(4,\)"):
        fj.jit(lambda x: fj.jvp(mixed, (x,), (np.ones(3),)))(X)


# --- every differentiable op's JVP, from the gradient table ---------------------------------------------


def _jvp_cases():
    from test_gradients import ROWS

    return [pytest.param(row, id=row.id) for row in ROWS]


@pytest.mark.parametrize("row", _jvp_cases())
def test_every_ops_jvp_matches_directional_finite_differences(row):
    """The JVP flowjit computes (the VJP graph transposed: the VJP of the VJP with respect to its
    cotangents, as `fj.jvp` does) against central differences along a random tangent, float64."""
    from test_gradients import _is_float, _operands, _single_op_graph

    from flowjit.frontend.autodiff import VJPSpec, vjp_graph
    from flowjit.ir.interpreter import interpret

    wide = _operands(row, seed=len(row.id))
    graph = _single_op_graph(row, wide)
    params = [x for i, x in enumerate(wide) if i not in row.static]
    floats = [i for i, x in enumerate(params) if _is_float(x)]
    float_results = [r for r in graph.results if r.type.dtype.is_float]
    rng = np.random.default_rng(3)
    tangents = {i: rng.uniform(-1, 1, params[i].shape) for i in floats}
    first = vjp_graph(graph, VJPSpec(primal_outputs=False))  # (params, cts) -> gradients of float params
    cts = tuple(range(len(params), len(params) + len(float_results)))
    transposed = vjp_graph(first, VJPSpec(wrt=cts, primal_outputs=False))  # (params, cts, t) -> J t
    zeros = [np.zeros(r.type.shape) for r in float_results]
    got = interpret(transposed, [*params, *zeros, *(tangents[i] for i in floats)])
    eps = 1e-6
    up = [x + eps * tangents[i] if i in tangents else x for i, x in enumerate(params)]
    down = [x - eps * tangents[i] if i in tangents else x for i, x in enumerate(params)]
    outs_up, outs_down = interpret(graph, up), interpret(graph, down)
    expected = [(u - d) / (2 * eps) for u, d, r in zip(outs_up, outs_down, graph.results) if r.type.dtype.is_float]
    assert len(got) == len(expected)
    for g, fd in zip(got, expected):
        scale = max(1.0, float(np.max(np.abs(fd), initial=0.0)))
        np.testing.assert_allclose(g, fd, rtol=0, atol=1e-6 * scale)
