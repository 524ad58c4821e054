"""vmap: every op's batching rule against stacking the op's per-example results (from the op table,
through the reference interpreter), and vmap of programs (compiled) against loops over examples."""

import zlib

import numpy as np
import pytest
from op_table import ROWS, _resolve, assert_close, single_op_graph, tolerance

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.batching import BATCH_RULES, batch_graph
from flowjit.ir.interpreter import RunContext, interpret
from flowjit.ir.ops import REGISTRY
from flowjit.ir.verifier import verify

BATCH = 3


def test_every_registered_op_has_a_batching_rule():
    missing = sorted(set(REGISTRY) - set(BATCH_RULES))
    assert not missing, f"ops without a batching rule in flowjit/frontend/batching*.py: {', '.join(missing)}"


def _table_cases():
    for row in ROWS:
        if row.graph is not None or row.op == "fusion":  # whole graphs (state, communication), fused regions
            continue
        for dtype in row.dtypes:
            yield pytest.param(row, dtype, id=f"{row.name}-{dtype.name}".replace(" ", ""))


def _patterns(n: int):
    """Which operands are batched: all of them, and each alone."""
    yield (True,) * n
    if n > 1:
        for k in range(n):
            yield tuple(i == k for i in range(n))


def _examples(row, dtype) -> list[list[np.ndarray]]:
    """BATCH sets of the row's operands, each drawn with its own seed."""
    examples = []
    for b in range(BATCH):
        rng = np.random.default_rng(zlib.crc32(f"{row.name}-{dtype.name}-{b}".encode()))
        examples.append([np.asarray(a) for a in row.inputs(rng, dtype)])
    return examples


@pytest.mark.parametrize("row, dtype", list(_table_cases()))
def test_batching_rule_matches_stacked_examples(row, dtype):
    examples = _examples(row, dtype)
    if any(a.shape != c.shape for ex in examples for a, c in zip(ex, examples[0])):
        pytest.skip("the row's inputs change shape with the seed")
    attrs = _resolve(row.attrs, dtype)
    regions = row.regions(dtype) if row.regions else ()
    graph = single_op_graph(row.op, examples[0], attrs, regions)
    tol = tolerance(_resolve(row.out_dtype, dtype) or dtype, row.tol_scale)
    for flags in _patterns(len(examples[0])):
        inputs = [np.stack([ex[k] for ex in examples]) if f else examples[0][k] for k, f in enumerate(flags)]
        per_example = [
            interpret(graph, [ex[k] if f else examples[0][k] for k, f in enumerate(flags)], RunContext({}))
            for ex in examples
        ]
        batched = batch_graph(graph, flags, BATCH)
        verify(batched)
        outputs = interpret(batched, inputs, RunContext({}))
        for i, out in enumerate(outputs):
            expected = np.stack([results[i] for results in per_example])
            assert_close(out, expected, tol, f"result {i} with operands batched {flags}")


# --- programs, compiled ---------------------------------------------------------------------------------------

rng = np.random.default_rng(0)
X = rng.standard_normal((5, 4)).astype(np.float32)
Y = rng.standard_normal((5, 3)).astype(np.float32)
W = rng.standard_normal((4, 3)).astype(np.float32)


def _loss(w, x, y):
    return fnp.sum((fnp.tanh(x @ w) - y) ** 2)


def test_per_example_gradients_equal_a_loop_of_grads():
    per_example = fj.jit(fj.vmap(fj.grad(_loss), in_axes=(None, 0, 0)))(W, X, Y)
    expected = np.stack([fj.grad(_loss)(W, X[i], Y[i]) for i in range(len(X))])
    np.testing.assert_allclose(per_example, expected, rtol=1e-5, atol=1e-5)


def test_grad_of_vmap_is_the_sum_of_per_example_grads():
    def total(w):
        return fj.vmap(lambda x, y: _loss(w, x, y))(X, Y).sum()

    expected = sum(fj.grad(_loss)(W, X[i], Y[i]) for i in range(len(X)))
    np.testing.assert_allclose(fj.jit(fj.grad(total))(W), expected, rtol=1e-5, atol=1e-5)


def test_nested_vmap_and_axes():
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    outer = fj.vmap(fj.vmap(lambda v: fnp.sum(v * v)), in_axes=2, out_axes=0)
    np.testing.assert_allclose(outer(a), np.sum(a * a, axis=1).T, rtol=1e-5)
    np.testing.assert_allclose(fj.vmap(lambda c: c * 2, in_axes=1, out_axes=1)(X), X * 2)
    np.testing.assert_allclose(fj.vmap(lambda r: r.sum(), in_axes=-1)(X), X.sum(0), rtol=1e-5)


def test_pytree_in_axes_kwargs_and_unmapped_outputs():
    params = {"w": W, "b": np.ones(3, np.float32)}

    def predict(p, x, scale=1.0):
        return {"out": (x @ p["w"] + p["b"]) * scale, "const": fnp.sum(p["b"])}

    out = fj.vmap(predict, in_axes=({"w": None, "b": None}, 0), out_axes={"out": 0, "const": None})(params, X)
    np.testing.assert_allclose(out["out"], X @ W + 1, rtol=1e-5, atol=1e-5)
    assert np.shape(out["const"]) == ()
    scales = np.arange(5, dtype=np.float32)
    out = fj.vmap(lambda x, scale: predict(params, x, scale=scale)["out"])(X, scales)
    np.testing.assert_allclose(out, (X @ W + 1) * scales[:, None], rtol=1e-5, atol=1e-5)
    stacked = fj.vmap(lambda: fnp.arange(3.0), axis_size=4)()
    np.testing.assert_array_equal(stacked, np.tile(np.arange(3.0, dtype=np.float32), (4, 1)))


def test_control_flow_with_batched_predicates_and_bounds():
    x = np.array([0.5, -1.0, 2.0], np.float32)
    branch = fj.vmap(lambda v: fj.cond(v > 0, lambda u: u * 10, lambda u: u - 1, v))(x)
    np.testing.assert_allclose(branch, np.where(x > 0, x * 10, x - 1))
    steps = fj.jit(fj.vmap(lambda v: fj.while_loop(lambda c: c < v, lambda c: c + 1.0, 0.0)))(x)
    np.testing.assert_array_equal(steps, [1.0, 0.0, 2.0])
    sums = fj.vmap(lambda n: fj.fori_loop(0, n, lambda i, c: c + i, 0))(np.array([1, 3, 5]))
    np.testing.assert_array_equal(sums, [0, 3, 10])
    powers = fj.vmap(lambda a: fj.fori_loop(0, 3, lambda i, c: c * a, fnp.ones_like(a)))(X)
    np.testing.assert_allclose(powers, X**3, rtol=1e-5)


def test_batched_indices_gathers_and_updates():
    table = rng.standard_normal((10, 2)).astype(np.float32)
    idx = np.array([3, 1, 7, 9])
    np.testing.assert_array_equal(fj.vmap(lambda i: fnp.take(table, i, axis=0))(idx), table[idx])
    cols = np.array([0, 3, 1, 2, 0])
    np.testing.assert_array_equal(fj.vmap(lambda r, i: r[i])(X, cols), X[np.arange(5), cols])
    np.testing.assert_array_equal(
        fj.vmap(lambda r, i: fnp.dynamic_slice(r, (i,), (2,)))(X, np.array([0, 2, 1, 2, 3]))[4], X[4, 2:4]
    )
    updated = fj.jit(fj.vmap(lambda r, i: r.at[i].add(100.0)))(X, cols)
    expected = X.copy()
    expected[np.arange(5), cols] += 100.0
    np.testing.assert_allclose(updated, expected)


def test_convolution_with_batched_images_and_filters():
    images = rng.standard_normal((2, 1, 3, 6, 6)).astype(np.float32)
    filters = rng.standard_normal((2, 4, 3, 3, 3)).astype(np.float32)
    conv = fj.nn.conv2d if hasattr(fj, "nn") and hasattr(fj.nn, "conv2d") else None
    if conv is None:
        pytest.skip("no fj.nn.conv2d")
    out = fj.jit(fj.vmap(lambda x, w: conv(x, w)))(images, filters)
    expected = np.stack([conv(images[i], filters[i]) for i in range(2)])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    shared = fj.jit(fj.vmap(lambda x: conv(x, filters[0])))(images)
    np.testing.assert_allclose(shared, np.stack([conv(images[i], filters[0]) for i in range(2)]), rtol=1e-4, atol=1e-4)


def test_custom_vjp_inside_vmap_and_grad():
    @fj.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, ct: (fnp.clip(ct, -1.0, 1.0),))

    def f(x):
        return fnp.sum(clip_grad(x) * 5.0)

    per_example = fj.jit(fj.vmap(fj.grad(f)))(X)
    np.testing.assert_array_equal(per_example, np.ones_like(X))
    summed = fj.jit(fj.grad(lambda x: fj.vmap(f)(x).sum()))(X)
    np.testing.assert_array_equal(summed, np.ones_like(X))


def test_variables_read_inside_vmap_and_batched_updates_refused():
    v = fj.Variable(np.ones(4, np.float32), name="vmap_bias")
    np.testing.assert_allclose(fj.jit(fj.vmap(lambda x: x + v.value))(X), X + 1)

    def update(r):
        v.assign(r)
        return r

    @fj.jit
    def bad(x):
        return fj.vmap(update)(x)

    with pytest.raises(FlowjitTypeError, match="vmap_bias.*differs per example"):
        bad(X)


def test_errors_name_the_problem():
    with pytest.raises(FlowjitValueError, match="different sizes"):
        fj.vmap(lambda a, b: a + b)(X, np.ones((4, 4), np.float32))
    with pytest.raises(FlowjitValueError, match="scalar"):
        fj.vmap(lambda a: a)(np.float32(1.0))
    with pytest.raises(FlowjitValueError, match="in_axes has 1 entries"):
        fj.vmap(lambda a, b: a, in_axes=(0,))(X, X)
    with pytest.raises(FlowjitValueError, match="out_axes is None"):
        fj.vmap(lambda a: a, out_axes=None)(X)
    with pytest.raises(FlowjitValueError, match="axis_size"):
        fj.vmap(lambda a: a, in_axes=None)(X)


def test_jacobians_and_jit_inside_vmap():
    inner = fj.jit(lambda r: fnp.sin(r) * 2)
    np.testing.assert_allclose(fj.vmap(inner)(X), np.sin(X) * 2, rtol=1e-6)
    jac = fj.vmap(fj.jacrev(lambda r: fnp.sin(r)))(X[:2])
    np.testing.assert_allclose(jac, np.stack([np.diag(np.cos(r)) for r in X[:2]]), rtol=1e-5, atol=1e-6)


def _compiled_cases():
    """One row per op configuration in its first float dtype (or its first dtype): the batched graph
    goes through the CPU backend's optimizer and lowering, which meet new shapes of every op here
    (batch dimensions of products, gathers over flattened rows, masked loops)."""
    for row in ROWS:
        if row.graph is not None or row.op == "fusion":
            continue
        floats = [d for d in row.dtypes if d.is_float and d.name == "f32"]
        dtype = floats[0] if floats else row.dtypes[0]
        yield pytest.param(row, dtype, id=f"{row.name}-{dtype.name}".replace(" ", ""))


@pytest.mark.parametrize("row, dtype", list(_compiled_cases()))
def test_batched_graphs_compile_and_match_the_interpreter(row, dtype):
    from flowjit.backends import compile_graph
    from flowjit.frontend.lowered import PIPELINE
    from flowjit.passes.registry import run_pipeline

    examples = _examples(row, dtype)
    attrs = _resolve(row.attrs, dtype)
    graph = single_op_graph(row.op, examples[0], attrs, row.regions(dtype) if row.regions else ())
    flags = (True,) * len(examples[0])
    inputs = [np.stack([ex[k] for ex in examples]) for k in range(len(flags))]
    batched = batch_graph(graph, flags, BATCH)
    expected = interpret(batched, inputs, RunContext({}))
    outputs = compile_graph(run_pipeline(batched, PIPELINE), "cpu").run(inputs)
    tol = tolerance(_resolve(row.out_dtype, dtype) or dtype, row.tol_scale)
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert_close(out, want, tol, f"result {i}")


def test_vmap_over_split_random_keys():
    keys = fj.random.split(fj.random.key(0), 4)
    assert np.shape(keys) == (4,)
    samples = fj.vmap(lambda k: fj.random.normal(k, (3,)))(keys)
    np.testing.assert_allclose(samples[2], fj.random.normal(keys[2], (3,)), rtol=1e-6)


def test_vmap_of_linalg_solvers_and_decompositions():
    a = rng.standard_normal((3, 5, 5))
    spd = (a @ a.transpose(0, 2, 1) + 5 * np.eye(5)).astype(np.float32)
    b = rng.standard_normal((3, 5)).astype(np.float32)
    chol = fj.jit(fj.vmap(fnp.linalg.cholesky))(spd)
    np.testing.assert_allclose(chol, np.linalg.cholesky(spd), rtol=1e-5, atol=1e-5)
    solved = fj.jit(fj.vmap(fnp.linalg.solve))(spd, b)
    np.testing.assert_allclose(solved, np.linalg.solve(spd, b[..., None])[..., 0], rtol=1e-4, atol=1e-5)
    eigenvalues = fj.jit(fj.vmap(lambda m: fnp.linalg.eigh(m)[0]))(spd)  # a while loop until converged
    np.testing.assert_allclose(eigenvalues, np.linalg.eigvalsh(spd), rtol=1e-5, atol=1e-4)
