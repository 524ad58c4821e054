"""The `fuse` pass and fused kernels: what it groups on traced programs (softmax, layer norm,
cross-entropy, MLP gradients), that fused IR verifies and round-trips, that fused and unfused
programs compute the same (interpreter: exactly; CPU: bit-identical to the unfused compile, but
float reductions of transposed inputs, which sum in the input's layout order, and close to the
interpreter) on hand-written and random programs, that effects keep their order,
and that the optimized stage and the dumps show kernels and member source lines."""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.backends import compile_graph
from flowjit.backends.cpu import schedule
from flowjit.ir.interpreter import interpret
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph
from flowjit.passes.fuse import kernel_count
from flowjit.passes.registry import run_pipeline

RNG = np.random.default_rng(7)


def _traced(fn, *args):
    return fj.jit(fn).lower(*args).graph("traced")


def _optimized(fn, *args, fuse=True):
    graph = parse_graph(print_graph(_traced(fn, *args)))
    return run_pipeline(graph, ["canonicalize", "fuse"] if fuse else ["canonicalize"], verify=True)


def _fusions(graph):
    return [op for op in graph.ops if op.name == "fusion"]


def _softmax(x):
    return nn.softmax(x, axis=-1)


def _layer_norm(x):
    return nn.layer_norm(x)


def _cross_entropy(logits, labels):
    return nn.cross_entropy(logits, labels)


def _chain(x):
    return fnp.tanh(x * 0.7 + 0.1) * nn.sigmoid(x) + 0.5 * x


def _mlp_loss(params, x, labels):
    w1, b1, w2, b2, w3, b3 = params
    h = nn.relu(x @ w1 + b1)
    h = nn.relu(h @ w2 + b2)  # two hidden layers: their gradients once made two groups need each other
    return nn.cross_entropy(h @ w3 + b3, labels)


def _mlp_grad(params, x, labels):
    return fj.grad(_mlp_loss)(params, x, labels)


def _mlp_args():
    params = (
        RNG.standard_normal((20, 16)).astype(np.float32) * 0.3,
        RNG.standard_normal(16).astype(np.float32),
        RNG.standard_normal((16, 12)).astype(np.float32) * 0.3,
        RNG.standard_normal(12).astype(np.float32),
        RNG.standard_normal((12, 5)).astype(np.float32) * 0.3,
        RNG.standard_normal(5).astype(np.float32),
    )
    return params, RNG.standard_normal((8, 20)).astype(np.float32), RNG.integers(0, 5, 8)


X = RNG.standard_normal((32, 24)).astype(np.float32)
LABELS = RNG.integers(0, 24, 32)


# --- what the pass groups --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, args, kernels",
    [(_chain, (X,), 1), (_softmax, (X,), 1), (_layer_norm, (X,), 1), (_cross_entropy, (X, LABELS), 2)],
    ids=["chain", "softmax", "layer_norm", "cross_entropy"],
)
def test_groups_become_one_or_two_kernels(fn, args, kernels):
    unfused = _optimized(fn, *args, fuse=False)
    fused = _optimized(fn, *args)
    assert kernel_count(fused) <= kernels < kernel_count(unfused)
    assert _fusions(fused)


def test_kinds():
    assert [op.attrs["kind"] for op in _fusions(_optimized(_chain, X))] == ["loop"]
    assert [op.attrs["kind"] for op in _fusions(_optimized(_softmax, X))] == ["reduction"]
    dense = _optimized(lambda x, w, b: nn.relu(x @ w + b), X, X.T.copy(), np.ones(32, np.float32))
    assert [op.attrs["kind"] for op in _fusions(dense)] == ["output"]
    assert [op.name for op in _fusions(dense)[0].regions[0].ops if op.name != "constant"][0] == "dot_general"


def test_mlp_gradient_fuses_epilogues_and_keeps_contractions_apart():
    graph = _optimized(_mlp_grad, *_mlp_args())
    kinds = [op.attrs["kind"] for op in _fusions(graph)]
    assert "output" in kinds
    for op in _fusions(graph):
        contractions = [inner for inner in op.regions[0].ops if inner.name in ("dot_general", "conv2d")]
        assert len(contractions) <= 1
        if contractions:  # a contraction's operands come from outside the group
            assert all(v.producer is None for v in contractions[0].operands)


def test_training_step_groups_never_depend_on_each_other():
    """784-1024-1024-10 MLP gradient (shapes only, no compile): the grouping of its backward
    pass once had two groups each reading the other's result (a cycle the verifier rejects)."""
    shapes = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
    params = tuple(fj.ShapeDtype(s, "float32") for s in shapes)
    x, labels = fj.ShapeDtype((256, 784), "float32"), fj.ShapeDtype((256,), "int64")
    graph = parse_graph(print_graph(fj.jit(_mlp_grad).lower(params, x, labels).graph("traced")))
    fused = run_pipeline(graph, ["canonicalize", "fuse"], verify=True)
    assert len(_fusions(fused)) >= 4


def _unrolled_steps(x, steps=300):
    """An unrolled integrator: every step reads x twice (a value shared inside one kernel)."""
    for _ in range(steps):
        x = x + 0.01 * fnp.tanh(x * 0.5 + 0.1)
    return x


def test_a_long_unrolled_chain_is_one_group():
    """1,500 ops, one fused region (the grouping's checks look at what crosses between the two
    groups a merge joins, not at every member, so the chain groups in about n steps)."""
    graph = _optimized(_unrolled_steps, X)
    (fusion,) = _fusions(graph)
    assert kernel_count(graph) == 1
    assert sum(1 for op in fusion.regions[0].ops if op.name == "tanh") == 300


def test_fused_ir_round_trips_and_verifies():
    graph = _optimized(_mlp_grad, *_mlp_args())
    text = print_graph(graph)
    assert print_graph(parse_graph(text)) == text
    refused = run_pipeline(parse_graph(text), ["fuse"], verify=True)  # fusing again changes nothing
    assert print_graph(refused) == text


# --- numerics: fused == unfused ----------------------------------------------------------------------


def _random_program(seed: int):
    """A random function of two inputs: elementwise ops, scalar constants, broadcasts of a row
    vector, row reductions broadcast back; returns the program and its arguments."""
    rng = np.random.default_rng(seed)
    unary = [fnp.exp, fnp.tanh, nn.sigmoid, fnp.abs, fnp.negative, lambda v: fnp.log1p(fnp.abs(v))]
    steps = [int(k) for k in rng.integers(0, 6, size=8)]
    scalars = [float(s) for s in rng.uniform(-1.5, 1.5, size=8)]
    picks = [int(k) for k in rng.integers(0, len(unary), size=8)]

    def program(x, row):
        values = [x, x * row]
        for step, scalar, pick in zip(steps, scalars, picks):
            a, b = values[-1], values[len(values) // 2]
            if step == 0:
                values.append(unary[pick](a))
            elif step == 1:
                values.append(a * scalar + b)
            elif step == 2:
                values.append(fnp.maximum(a, b) - row)
            elif step == 3:
                values.append(a - fnp.max(a, axis=1, keepdims=True))
            elif step == 4:
                values.append(a / (fnp.sum(fnp.abs(a), axis=1, keepdims=True) + 1.0))
            else:
                values.append(fnp.where(a > b, a, b * 0.5).astype(np.float32))
        return values[-1], values[len(values) // 2]

    args = (rng.standard_normal((16, 40)).astype(np.float32), rng.standard_normal(40).astype(np.float32))
    return program, args


def _check_fused_equals_unfused(fn, args, tol, exact=True):
    """Fused and unfused programs: the interpreter's results equal, the CPU's too (bit for bit, or
    within `tol` where the fused kernel sums in another order: not `exact`), and close to the
    interpreter's."""
    flat = [np.asarray(a) for a in _flatten(args)]
    unfused = _optimized(fn, *args, fuse=False)
    fused = _optimized(fn, *args)
    assert _fusions(fused), "nothing was fused"
    expected = interpret(unfused, flat)
    for got, want in zip(interpret(fused, flat), expected):
        np.testing.assert_array_equal(got, want)
    compiled_fused = compile_graph(fused, "cpu").run(flat)
    compiled_unfused = compile_graph(unfused, "cpu").run(flat)
    for f, u, want in zip(compiled_fused, compiled_unfused, expected):
        if exact:
            np.testing.assert_array_equal(f, u)  # same scalar code, same roundings
        np.testing.assert_allclose(f, u, rtol=tol, atol=tol)
        np.testing.assert_allclose(f, want, rtol=tol, atol=tol)


def _flatten(args):
    for a in args:
        if isinstance(a, tuple | list):
            yield from _flatten(a)
        else:
            yield a


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_fused_equal_unfused(seed):
    fn, args = _random_program(seed)
    _check_fused_equals_unfused(fn, args, 2e-5)


@pytest.mark.parametrize(
    "fn, args",
    [
        (_chain, (X,)),
        (_softmax, (X,)),
        (_layer_norm, (X,)),
        (_cross_entropy, (X, LABELS)),
        (_mlp_grad, _mlp_args()),
    ],
    ids=["chain", "softmax", "layer_norm", "cross_entropy", "mlp_grad"],
)
def test_models_fused_equal_unfused(fn, args):
    _check_fused_equals_unfused(fn, args, 1e-5)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: fnp.sum(fnp.exp(x) * 2.0, axis=1),
        lambda x: fnp.max(fnp.tanh(x) + x, axis=(1, 2)),
        lambda x: fnp.sum(fnp.abs(x), axis=0),
        lambda x: x / fnp.sum(fnp.abs(x), axis=2, keepdims=True),
    ],
    ids=["middle", "trailing_pair", "leading", "last_keepdims"],
)
def test_fused_reductions_over_3d_use_the_one_op_schedule(fn):
    """Contiguous axes collapse to the one-op lowering's (A, R, B) form: same summation order."""
    _check_fused_equals_unfused(fn, (RNG.standard_normal((6, 50, 40)).astype(np.float32),), 1e-5)


def _normalized_by_column_sum(v):  # whole-tensor kernels: the row loop nest takes trailing axes only
    return v / fnp.sum(v, axis=0, keepdims=True)


def _normalized_by_row_sum(v):
    return v / fnp.sum(v, axis=1, keepdims=True)


@pytest.mark.parametrize(
    "fn, generics",
    [
        (lambda x: _normalized_by_column_sum(fnp.exp(x - 1.0)), 2),  # exp recomputed in the sum and the division
        (lambda x: _normalized_by_column_sum(fnp.tanh(fnp.exp(fnp.log1p(fnp.abs(x)))) * fnp.sin(x)), 3),  # stored
    ],
    ids=["cheap_recomputed", "costly_stored"],
)
def test_cost_check_recomputes_cheap_values_and_stores_costly_ones(fn, generics):
    mlir = fj.jit(fn).lower(X).as_text("mlir")
    assert "whole-tensor kernels" in mlir
    assert mlir.count("= linalg.generic") == generics
    _check_fused_equals_unfused(fn, (X,), 1e-5)


@pytest.mark.parametrize("steps", [3, 12, 40])
def test_a_value_read_twice_in_one_generic_is_never_stored(steps):
    """An unrolled `x = x + 0.01 * tanh(...)`: each step reads x twice, but every reader ends in the
    one generic of the result, so x stays an SSA value there: one generic, nothing allocated
    (it once stored x every second step: 4 MiB per store here, 64 MiB at 16M elements)."""
    x = np.random.default_rng(3).standard_normal((64, 96)).astype(np.float32)
    fn = functools.partial(_unrolled_steps, steps=steps)
    lowered = fj.jit(fn).lower(x)
    assert lowered.as_text("mlir").count("= linalg.generic") == 1
    assert "@malloc(" not in lowered.as_text("llvm").split("declare ptr @malloc")[0]
    _check_fused_equals_unfused(fn, (x,), 1e-5)


def test_long_fused_bodies_compute_two_vectors_per_step():
    """Past `LONG_CHAIN_DEPTH` a 1-D kernel's loop takes two vectors per step; shallow ones one."""
    x = np.ones(4096, np.float32)
    vl = schedule.lanes(32)
    long_body = fj.jit(functools.partial(_unrolled_steps, steps=3)).lower(x).as_text("mlir")
    assert f"vector_sizes [{2 * vl}]" in long_body
    short_body = fj.jit(_chain).lower(x).as_text("mlir")
    assert f"vector_sizes [{vl}]" in short_body and f"vector_sizes [{2 * vl}]" not in short_body


def test_large_memory_bound_streams_compute_four_vectors_per_step():
    """A large 1-D kernel with no math function (an SGD step) unrolls `MAX_UNROLLED_STEPS` vectors
    a step; below `PARALLEL_MIN_ELEMENTS`, or with a math function, one vector."""
    vl, steps = schedule.lanes(32), schedule.MAX_UNROLLED_STEPS
    big, small = np.ones(schedule.PARALLEL_MIN_ELEMENTS, np.float32), np.ones(4096, np.float32)
    sgd = fj.jit(lambda p, g: p - 0.01 * g)
    assert f"vector_sizes [{steps * vl}]" in sgd.lower(big, big).as_text("mlir")
    # each thread's chunk is a whole number of steps, here an odd number of 4-vector groups, so
    # there are no masked loads or stores in the loop
    groups = -(-schedule.PARALLEL_MIN_ELEMENTS // (schedule.threads() * 4 * vl)) | 1
    even = np.ones(schedule.threads() * 4 * vl * groups, np.float32)
    assert "masked" not in sgd.lower(even, even).as_text("llvm")
    assert f"vector_sizes [{vl}]" in sgd.lower(small, small).as_text("mlir")
    with_math = fj.jit(lambda p, g: p - 0.01 * fnp.tanh(g)).lower(big, big).as_text("mlir")
    assert f"vector_sizes [{vl}]" in with_math and f"vector_sizes [{steps * vl}]" not in with_math
    _check_fused_equals_unfused(lambda p, g: p - 0.01 * g + p * g, (big, big), 0.0)


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda a: (a[:, :, None] == a[0, :8]).any(-1), (X,)),
        (lambda p, q: ((p[:, None, :] - q[None, :, :]) ** 2).sum(-1), (X[:, :3], X[:7, 5:8])),
        (lambda p, q: fnp.abs(p[:, None, :] - q[None, :, :]).max(-1), (X[:, :5], X[:9, :5])),
        (lambda labels: (labels[:, None] == fnp.arange(6)).sum(-1), (LABELS,)),
    ],
    ids=["isin", "distances", "max_distance", "one_hot_count"],
)
def test_reductions_over_a_short_broadcast_axis_become_elementwise_kernels(fn, args):
    """`_small_axis_rule`: the reduced (.., k) values are never formed; an elementwise kernel
    computes the k positions and combines them, in numpy's order (small slices of the table, like
    `a[0, :8]`, may be a kernel of their own)."""
    graph = _optimized(fn, *args)
    ops = list(graph.ops) + [inner for f in _fusions(graph) for inner in f.regions[0].ops]
    assert not any(op.name.startswith("reduce_") for op in ops)
    got = fj.jit(fn)(*args)
    want = _with_numpy(fn)(*args)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.dtype == want.dtype


def _with_numpy(fn):
    import types

    return types.FunctionType(fn.__code__, {**fn.__globals__, "fnp": np}, closure=fn.__closure__)


# 103 rows: tiles of 8 and a last tile of more rows (its own copy of the tile body)
@pytest.mark.parametrize("args", [(X,), (np.random.default_rng(1).standard_normal((103, 600)).astype(np.float32),)])
def test_row_tile_stores_a_shared_math_value_in_its_output_tile(args):
    """In a row tile, exp(x - 1), read by the row sum and by the division, is computed once into
    the output's tile (3 generics: exp, sum, division); the division reads it from there and
    overwrites it in place: its only input is the row sums, its `outs` the exp's result."""

    def fn(x):
        e = fnp.exp(x - 1.0)
        return e / fnp.sum(e, axis=1, keepdims=True)

    mlir = fj.jit(fn).lower(*args).as_text("mlir")
    assert "row loop nest" in mlir
    generics = [line.split(" = ")[0].strip() for line in mlir.splitlines() if "= linalg.generic" in line]
    tiles = 2 if args[0].shape[0] % 8 else 1  # tiles of 8 rows and a last tile of more rows
    assert len(generics) == 3 * tiles
    lines = mlir.splitlines()
    for exp, division in zip(generics[0::3], generics[2::3]):
        line = next(line for line in lines if line.strip().startswith(f"{division} = linalg.generic"))
        ins = line.split("ins(")[1].split(")")[0]
        assert "," not in ins.split(":")[0], line  # the row sums only
        view = next((ln.split(" = ")[0].strip() for ln in lines if f"tensor.expand_shape {exp} " in ln), exp)
        assert f"outs({exp} :" in line or f"outs({view} :" in line, line
    _check_fused_equals_unfused(fn, args, 1e-5)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: _normalized_by_row_sum(fnp.exp(x - fnp.max(x, axis=1, keepdims=True))),
        lambda x: (fnp.exp(x) * 2.0, fnp.sum(fnp.exp(x), axis=1)),  # the output's generic is 1-d (no broadcast)
    ],
    ids=["softmax", "flat_output"],
)
def test_row_tile_overwrites_the_stored_value_without_a_copy(fn, compiled_rows):
    """The output's generic reads the stored value from its own tile: bufferization needs no
    temporary tile and no copy (read as an input as well, it would copy the tile)."""
    x = np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32)
    lowered = fj.jit(fn).lower(x)
    assert "row loop nest" in lowered.as_text("mlir")
    assert lowered.as_text("mlir").count("math.roundeven") == 1  # exp's polynomial, once
    llvm = lowered.as_text("llvm")
    assert "memcpy" not in llvm and "@malloc(i64 32768)" not in llvm
    _check_fused_equals_unfused(fn, (x,), 1e-5)


def test_row_tile_reads_a_stored_output_back_instead_of_recomputing_it():
    """Cross-entropy with its gradient keeps exp(x - max) as an output of the row nest (the gradient
    reads it after the batch mean): the tile computes it into its output tile once and the row sum
    reads it from there. exp's polynomial is the module's only `math.roundeven`."""

    def loss_and_grad(logits, labels):
        return fj.value_and_grad(lambda z: nn.cross_entropy(z, labels))(logits)

    mlir = fj.jit(loss_and_grad).lower(X, LABELS).as_text("mlir")
    assert "row loop nest" in mlir
    assert mlir.count("math.roundeven") == 1
    got = fj.jit(loss_and_grad)(X, LABELS)
    want = fj.jit(loss_and_grad, target="interpreter")(X, LABELS)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-9)


def test_half_precision_and_bool_values_in_a_fused_loop():
    def fn(x, y):
        h = (x.astype(fnp.float16) * 3.0 + 1.0).astype(fnp.float32)
        mask = fnp.logical_and(x > y, y > 0)
        return fnp.where(mask, h, -y), mask

    args = (X, RNG.standard_normal((32, 24)).astype(np.float32))
    _check_fused_equals_unfused(fn, args, 1e-3)


def test_effects_keep_their_order_and_values():
    v = fj.Variable(np.zeros(24, np.float32), name="fuse_order")

    @fj.jit
    def step(x):
        y = fnp.exp(x) * 2.0
        v.assign(y)
        z = v.value + y
        return fnp.tanh(z) + 1.0

    x = RNG.standard_normal(24).astype(np.float32)
    np.testing.assert_allclose(step(x), np.tanh(np.exp(x) * 4.0) + 1.0, rtol=1e-5)
    np.testing.assert_allclose(v.value, np.exp(x) * 2.0, rtol=1e-6)
    graph = step.lower(x).graph("optimized")
    names = [op.name for op in graph.ops]
    assert names.index("assign") < names.index("read_variable")


# --- what users see ------------------------------------------------------------------------------------


def test_optimized_stage_shows_kernels_and_member_lines():
    text = fj.jit(_chain).lower(X).as_text("optimized")
    assert "// pipeline: canonicalize, fuse" in text
    assert "// kernels: 1 (1 fused regions holding" in text
    line = _chain.__code__.co_firstlineno + 1
    assert 'fusion %x {kind = "loop"}' in text
    assert text.count(f'test_fuse.py":{line})') >= 5  # each member carries its source line


def test_dumps_count_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWJIT_DUMP_DIR", str(tmp_path))
    fj.jit(_softmax).lower(X).graph("optimized")
    (fuse_dump,) = [p for p in os.listdir(tmp_path) if p.endswith("-fuse.fj")]
    text = (tmp_path / fuse_dump).read_text()
    assert "// kernels: 1 (1 fused regions holding" in text
    (canon_dump,) = [p for p in os.listdir(tmp_path) if p.endswith("-canonicalize.fj")]
    assert "(0 fused regions" in (tmp_path / canon_dump).read_text()


# --- row loop nests (lower_rows) -----------------------------------------------------------------------


def _log_softmax(x):
    return nn.log_softmax(x, axis=-1)


def _logsumexp(x):
    return nn.logsumexp(x, axis=-1)


def _layer_norm_affine(x, gamma, beta):
    return nn.layer_norm(x, gamma, beta)


def _softmax_and_logsumexp(x):
    return nn.softmax(x, axis=-1), nn.logsumexp(x, axis=-1, keepdims=True)


def _masked_softmax(x, mask):
    return nn.softmax(fnp.where(mask, x, -1e9), axis=-1)


def _layer_norm_gradient(x, gamma):
    return fj.grad(lambda x, g: fnp.sum(fnp.tanh(nn.layer_norm(x, g)) * g))(x, gamma)


def _softmax_gradient(x):
    return fj.grad(lambda x: fnp.sum(nn.softmax(x, axis=-1) * x))(x)


def _row_nest_lines(fn, *args):
    return [line.strip() for line in fj.jit(fn).lower(*args).as_text("mlir").splitlines() if "// fusion:" in line]


# 103 rows (prime: a last tile of more rows after the loop) of 2600 f32 (above the parallel
# threshold: scf.forall); 3-d inputs flatten their leading axes; 1000 is no multiple of a vector.
_ROWS = RNG.standard_normal((103, 2600)).astype(np.float32)
_ROWS_3D = RNG.standard_normal((3, 7, 1000)).astype(np.float32)
_GAMMA, _BETA = RNG.uniform(0.5, 2, 2600).astype(np.float32), RNG.standard_normal(2600).astype(np.float32)


@pytest.mark.parametrize(
    "fn, args",
    [
        (_softmax, (_ROWS,)),
        (_softmax, (_ROWS.astype(np.float64),)),
        (_softmax, (_ROWS_3D,)),
        (_log_softmax, (_ROWS,)),
        (_logsumexp, (_ROWS_3D,)),
        (lambda x: nn.logsumexp(x, axis=-1, keepdims=True), (RNG.standard_normal((5, 6, 7, 76)).astype(np.float32),)),
        (_layer_norm, (_ROWS_3D,)),
        (_layer_norm_affine, (_ROWS, _GAMMA, _BETA)),
        (_softmax_and_logsumexp, (_ROWS,)),
        (_masked_softmax, (_ROWS, _ROWS > 0.5)),
        (_cross_entropy, (_ROWS, RNG.integers(0, 2600, 103))),
        (_layer_norm_gradient, (_ROWS_3D, _GAMMA[:1000])),
        (_softmax_gradient, (X,)),
    ],
    ids=[
        "softmax",
        "softmax_f64",
        "softmax_3d",
        "log_softmax",
        "logsumexp_3d",
        "logsumexp_keepdims_4d",  # one reduction, but whole-tensor kernels would run it unvectorized
        "layer_norm_3d",
        "layer_norm_affine",
        "two_outputs",
        "bool_input",
        "cross_entropy",
        "layer_norm_gradient",
        "softmax_gradient",
    ],
)
def test_row_reductions_run_as_one_loop_nest(fn, args, compiled_rows):
    """Each fused region with row reductions runs as one loop over row tiles, bit-identical to the
    unfused program (same kernels per tile, same summation order)."""
    lines = _row_nest_lines(fn, *args)
    assert lines and all("row loop nest" in line for line in lines), lines
    _check_fused_equals_unfused(fn, args, 1e-5 if args[0].dtype == np.float32 else 1e-12)


@pytest.mark.parametrize(
    "fn",
    [
        fnp.triu,
        fnp.tril,
        lambda x: fnp.triu(x, 3) - fnp.tril(x, -2) * 2.0,
        lambda x: fnp.where(fnp.iota((300, 200), 1, "i64") < 7, x, fnp.iota((300, 200), 0, "f32")),
    ],
    ids=["triu", "tril", "both", "where_positions"],
)
def test_iotas_in_a_fused_loop_are_loop_positions(fn):
    """An iota read by a fused elementwise kernel is its loop position (`linalg.index`), not an
    int64 tensor stored first, which would make triu ten times slower."""
    x = RNG.standard_normal((300, 200)).astype(np.float32)
    mlir = fj.jit(fn).lower(x).as_text("mlir")
    assert "tensor<300x200xi64>" not in mlir and "tensor<300x200xf32>" in mlir
    _check_fused_equals_unfused(fn, (x,), 1e-6)


def test_cross_entropy_class_index_is_computed_in_the_row_nest_not_stored():
    """The one-hot compare's iota (int64, as large as the logits) streams into the fused group and is
    a row-nest member (the same positions in every tile): no kernel stores it, results match the
    interpreter, forward and gradient."""
    labels = RNG.integers(0, 2600, 103)

    def loss_and_grad(logits, labels):
        return fj.value_and_grad(lambda z: nn.cross_entropy(z, labels))(logits)

    lowered = fj.jit(loss_and_grad).lower(_ROWS, labels)
    assert "iota" not in [op.name for op in lowered.graph("optimized").ops]
    assert all("row loop nest" in line for line in _row_nest_lines(loss_and_grad, _ROWS, labels))
    got = fj.jit(loss_and_grad)(_ROWS, labels)
    want = fj.jit(loss_and_grad, target="interpreter")(_ROWS, labels)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-9)


def test_row_nest_splits_large_inputs_over_cores_and_tiles_small_ones_whole(compiled_rows):
    (large,) = _row_nest_lines(_softmax, _ROWS)
    (small,) = _row_nest_lines(_softmax, X)
    if os.cpu_count() > 1:
        assert "(forall): 103 rows of 2600" in large
    assert "(for): 32 rows of 24, tiles of 32 rows" in small  # one tile: no loop at all
    body = fj.jit(_softmax).lower(X).as_text("mlir").split("transform.named_sequence")[0]
    assert "scf.for" not in body  # the lowering's own loops (schedules add theirs)


def test_row_nest_kernels_peel_partial_vectors_off_their_rows(compiled_rows):
    """Rows that are not a whole number of vectors (1000 columns): the nest's reductions and its
    elementwise kernels peel the partial chunk off their column loops, so that the others are not
    masked; whole rows (1024) peel nothing. The same results either way (checked bitwise against
    the unpeeled schedules when this was written)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 1000)).astype(np.float32)
    mlir = fj.jit(_softmax).lower(x).as_text("mlir")
    assert mlir.count("transform.loop.peel") == 4  # max, sum; exp, division
    whole = rng.standard_normal((16, 1024)).astype(np.float32)
    assert "transform.loop.peel" not in fj.jit(_softmax).lower(whole).as_text("mlir")
    _check_fused_equals_unfused(_softmax, (x,), 1e-6)


@pytest.mark.parametrize(
    "fn, reason",
    [
        (lambda x: fnp.sum(x, axis=0) + fnp.max(x, axis=0), "no reduction over trailing axes"),
        (lambda x: fnp.sum(fnp.exp(x), axis=1), "one sweep already"),
        (lambda x: x > fnp.max(x, axis=1, keepdims=True), "a bool output"),
    ],
    ids=["columns", "one_sweep", "bool_output"],
)
def test_row_nest_falls_back_visibly(fn, reason):
    """Regions the nest does not cover keep the whole-tensor kernels, and the MLIR says why."""
    assert _row_nest_lines(fn, _ROWS) == [f"// fusion: whole-tensor kernels ({reason})"]
    _check_fused_equals_unfused(fn, (_ROWS,), 1e-5)


@pytest.mark.parametrize(
    "fn, a, b",
    [
        (lambda a, b: fnp.sum((a[:, None, :] - b[None, :, :]) ** 2, axis=-1), (64, 40), (48, 40)),
        (lambda a, b: fnp.sum(a[:, None, :] * b[None, :, :], axis=-1), (64, 100), (48, 100)),
        (
            lambda a, b: fnp.max(fnp.abs(a[:, None, :] - b[None, :, :]), axis=-1),
            (64, 9),
            (48, 9),
        ),  # 8 or less: unrolled
        (lambda a, b: fnp.exp(-fnp.sum((a[:, None, :] - b[None, :, :]) ** 2, axis=-1)), (33, 70), (50, 70)),
        (lambda a, b: fnp.sum((a[:, None, None, :] - b[None, :, :, :]) ** 2, axis=-1), (9, 16), (10, 12, 16)),
        (lambda a, b: fnp.sum((a[:, None, None, :] - b[None, :, :, :]) ** 2, axis=-1), (5, 20), (3, 7, 20)),
        (lambda a, b: fnp.sum((a[:, None, None, :] - b[None, :, :, :]) ** 2, axis=-1), (5, 100), (3, 7, 100)),
    ],
    ids=["distances", "products", "max_abs", "rbf_kernel", "4d", "4d_odd_rows", "4d_long_rows"],
)
def test_one_reduction_of_broadcast_values_reads_them_through_maps(fn, a, b):
    """A single reduction over the last axis of broadcast values (pairwise distances) is not a row
    nest, which would store each broadcast whole first: the whole-tensor reduction reads them
    through its indexing maps, vectorized over the last axis and split over the cores. Its blocks
    of rows are those of the n-d space, not of the one-op kernel's collapsed rows, so float sums
    may differ from the unfused program's in the last bits (max is exact). Rows shorter than a
    vector take tiles of whole rows (`schedule._short_row_reduction`)."""
    x, y = RNG.standard_normal(a).astype(np.float32), RNG.standard_normal(b).astype(np.float32)
    assert _row_nest_lines(fn, x, y) == ["// fusion: whole-tensor kernels (one sweep over a broadcast input)"]
    mlir = fj.jit(fn).lower(x, y).as_text("mlir")
    if a[-1] < schedule.lanes(32):
        assert 'lowering_strategy = "innerparallel"' in mlir and "tile_reduction_using_for" not in mlir
    else:
        assert "tile_reduction_using_for" in mlir and "vector_sizes [1, " in mlir
    assert "tensor.empty() : tensor<" + "x".join(map(str, (a[0], *b[:-1], a[-1]))) not in mlir  # no broadcast stored
    _check_fused_equals_unfused(fn, (x, y), 1e-5, exact="max" in print_graph(_traced(fn, x, y)))


_NCHW = RNG.standard_normal((6, 5, 12, 20)).astype(np.float32)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: fnp.mean((x - fnp.mean(x, axis=(0, 2, 3), keepdims=True)) ** 2, axis=(0, 2, 3)),
        lambda x: nn.batch_norm_train(x, np.zeros(5, np.float32), np.ones(5, np.float32))[0],
        lambda x: fnp.sum(fnp.exp(x), axis=(0, 2, 3)),
        lambda x: fnp.max(fnp.abs(x), axis=(1, 3)),
        lambda x: fnp.sum(x * fnp.arange(20, dtype=np.float32), axis=(0, 3)),
        lambda x: fnp.min(x + fnp.ones((1, 5, 1, 1), np.float32), axis=(2, 3)),
        lambda x: nn.batch_norm_train(x, np.zeros(20, np.float32), np.ones(20, np.float32), axis=-1)[0],
        lambda x: nn.softmax(x, axis=1),
        lambda x: fnp.max(fnp.exp(x - fnp.mean(x, axis=(0, 1), keepdims=True)), axis=2),
    ],
    ids=[
        "variance",
        "batch_norm_train",
        "groups",
        "max_groups",
        "broadcast_row",
        "broadcast_channels",
        "batch_norm_channels_last",
        "softmax_over_channels",
        "middle_axis",
    ],
)
def test_fused_reductions_without_a_collapsed_form_are_vectorized(fn):
    """A fused reduction with no (A, R, B) form (broadcast leaves, or axes in several groups) is
    vectorized: over one axis, as an n-d row or column reduction; over several, its last axis in
    its own generic and the rest of the partial result by the one-op lowering (as one generic it
    was scalar loops). Float sums may differ from the unfused program's in the last bits (max and
    min exact)."""
    mlir = fj.jit(fn).lower(_NCHW).as_text("mlir")
    reductions = [line for line in mlir.splitlines() if "linalg.generic" in line and '"reduction"' in line]
    assert reductions and all("fj.kernel" in line for line in reductions)  # each has a schedule
    text = print_graph(_traced(fn, _NCHW))
    _check_fused_equals_unfused(fn, (_NCHW,), 1e-5, exact="reduce_sum" not in text and "reduce_prod" not in text)


def _small_short_rows(generic: str) -> bool:
    """Whether a reduction generic's input is small with short rows: plain loops (`schedule.stays_plain`)."""
    (shape,) = re.findall(r"ins\(%\w+ : tensor<([0-9x]+)x\w+>", generic)
    dims = tuple(int(d) for d in shape.split("x"))
    return schedule.stays_plain(dims, len(dims) - 1, 32)


@pytest.mark.parametrize(
    "fn, merged",
    [
        (lambda x: fnp.mean((x - fnp.mean(x, axis=(0, 2, 3), keepdims=True)) ** 2, axis=(0, 2, 3)), True),
        (lambda x: fnp.sum((x - fnp.mean(x, axis=(0, 2, 3), keepdims=True)) * x, axis=(0, 2, 3)), True),
        (lambda x: fnp.sum(x * fnp.arange(20, dtype=np.float32), axis=(0, 2, 3)), False),  # reads W, not H
        (lambda x: fnp.sum(x * fnp.arange(6, dtype=np.float32).reshape(6, 1, 1, 1), axis=(0, 1, 2)), False),
    ],
    ids=["variance", "centered_product", "row_broadcast", "leading_axes"],
)
def test_fused_reductions_merge_their_trailing_axes_when_every_leaf_allows(fn, merged):
    """A fused reduction over trailing axes (batch norm's (2, 3) of NCHW) whose leaves each read
    all of them or none (a per-channel broadcast) iterates them as one dimension: a row reduction
    over H * W, not over W then H in three kernels (a shorter first call and a faster run). A leaf
    reading some of them only, or axes that stop before the last, keep the
    last axis first."""
    mlir = fj.jit(fn).lower(_NCHW).as_text("mlir")
    reductions = [line for line in mlir.splitlines() if "linalg.generic" in line and '"reduction"' in line]
    assert any("tensor<6x5x240xf32>" in line for line in reductions) == merged
    assert all("fj.kernel" in line or _small_short_rows(line) for line in reductions)
    _check_fused_equals_unfused(fn, (_NCHW,), 1e-5, exact=False)  # sums in another order


def test_row_nest_falls_back_for_rows_too_long_to_stay_in_cache():
    x = RNG.standard_normal((4, 20000)).astype(np.float32)
    assert _row_nest_lines(_softmax, x) == ["// fusion: whole-tensor kernels (rows of 80000 bytes (above 65536))"]
    _check_fused_equals_unfused(_softmax, (x,), 1e-5)


# --- slices: strided views of group inputs ---------------------------------------------------------


def _depthwise(x, w):
    return nn.conv2d(x, w, padding=1, groups=x.shape[1])


_DW_X = RNG.standard_normal((2, 8, 11, 10)).astype(np.float32)
_DW_W = RNG.standard_normal((8, 1, 3, 3)).astype(np.float32)
_DIFF_X = RNG.standard_normal((6, 33)).astype(np.float32)


def _slices_in_fusions(graph):
    """Every slice inside a fusion body, after checking it reads a group input (a body param)."""
    slices = [inner for op in _fusions(graph) for inner in op.regions[0].ops if inner.name == "slice"]
    assert all(s.operands[0].producer is None for s in slices)
    return slices


def test_depthwise_conv_taps_fuse_as_views_of_the_padded_input():
    graph = _optimized(_depthwise, _DW_X, _DW_W)
    assert [op.name for op in graph.ops if op.name != "constant"] == ["pad", "fusion"]
    assert len(_slices_in_fusions(graph)) == 18  # 9 taps of the padded x, 9 of the weights
    lowered = fj.jit(_depthwise).lower(_DW_X, _DW_W)
    assert lowered.as_text("optimized").count("= slice %") == 18
    mlir = lowered.as_text("mlir")
    # The taps are views read by the kernel's generic: none is copied, and the pad writes x into
    # its interior with vector copies of rows (`lower_movement._pad_blocks`), no copy of that shape.
    # The 8-element weight taps, read by reshapes, still are.
    views = [
        line for line in mlir.splitlines() if "tensor.extract_slice" in line and "to tensor<2x8x11x10xf32>" in line
    ]
    copies = [line for line in mlir.splitlines() if "linalg.copy" in line and "2x8x11x10" in line]
    assert (len(views), len(copies)) == (9, 0)
    _check_fused_equals_unfused(_depthwise, (_DW_X, _DW_W), 1e-5)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x[:, 1:] - x[:, :-1],
        lambda x: x[::2, 1::3] * x[1::2, ::3] + 1.0,
        lambda x: fnp.where(x[:, 2:] > 0.0, x[:, 2:], fnp.exp(x[:, :-2])),
        lambda x: fnp.tanh(x[1:4, 5:30:4] - 2.0 * x[2:5, 3:28:4]),
    ],
    ids=["difference", "strided", "read_twice", "window"],
)
def test_slices_of_a_param_fuse_into_one_kernel_without_copies(fn):
    graph = _optimized(fn, _DIFF_X)
    assert [op.name for op in graph.ops] == ["fusion"]
    assert _slices_in_fusions(graph)
    assert "linalg.copy" not in fj.jit(fn).lower(_DIFF_X).as_text("mlir")
    _check_fused_equals_unfused(fn, (_DIFF_X,), 1e-5)


def test_large_strided_slices_run_threaded_and_vectorized():
    """Above the parallel threshold the n-d kernel over strided views takes `copy_nd`'s schedule."""
    x = RNG.standard_normal((8, 130, 301)).astype(np.float32)

    def fn(v):
        return v[:, 1:, 2::3] * 0.5 + v[:, :-1, 1:-1:3]

    mlir = fj.jit(fn).lower(x).as_text("mlir")
    assert "linalg.copy" not in mlir
    _check_fused_equals_unfused(fn, (x,), 1e-6)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x[0:1, 0:2, 0:1] << 0, lambda x: x[:, ::2, 1:] >> 0, lambda x: (x[1:, :, ::3] | 0, x + 1)],
    ids=["shift_left", "shift_right", "or_with_other_output"],
)
def test_a_kernel_over_views_that_folds_to_the_identity_still_compiles(fn):
    """MLIR folds `x << 0` and erases the then-identity kernel: its strided input is copied to the
    output by a `memref.copy`, whose library call (`memrefCopy`) native code cannot make; the
    toolchain lowers such a module again with the copies as loops (fuzzer find)."""
    x = np.arange(60, dtype=np.int32).reshape(3, 4, 5) - 30
    got = fj.jit(fn)(x)
    want = fn(x)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        np.testing.assert_array_equal(g, w)
    assert "memrefCopy" not in fj.jit(fn).lower(x).as_text("llvm")


def test_a_slice_the_group_returns_is_stored_once_and_still_read_as_a_view():
    def fn(x):
        head = x[:, 1:]
        return head, head - x[:, :-1], fnp.exp(head)

    graph = _optimized(fn, _DIFF_X)
    assert [op.name for op in graph.ops] == ["fusion"]
    mlir = fj.jit(fn).lower(_DIFF_X).as_text("mlir")
    # the slice is viewed twice: once read by the fused kernel, once copied out (stored once)
    assert len(re.findall(r"tensor\.extract_slice %\w+\[0, 1\] \[6, 32\]", mlir)) == 2
    _check_fused_equals_unfused(fn, (_DIFF_X,), 1e-5)


def test_a_slice_of_a_value_computed_in_the_group_does_not_fuse_with_it():
    def fn(x):
        e = fnp.exp(x)
        return (e[:, 1:] + e[:, :-1]) * fnp.sum(e)

    graph = _optimized(fn, _DIFF_X)
    fusions = _fusions(graph)
    assert len(fusions) == 2 and len(_slices_in_fusions(graph)) == 2
    _check_fused_equals_unfused(fn, (_DIFF_X,), 1e-5)


def test_a_reduction_of_sliced_values_keeps_the_one_op_summation():
    """A sum over a difference of views: the difference is computed (n-d) and reduced on its own,
    bit-identical to the unfused program."""

    def fn(x):
        return fnp.sum(fnp.abs(x[:, 1:] - x[:, :-1]), axis=1)

    assert len(_fusions(_optimized(fn, _DIFF_X))) == 1
    _check_fused_equals_unfused(fn, (_DIFF_X,), 1e-5)
    _check_fused_equals_unfused(fn, (_ROWS,), 1e-4)


def test_depthwise_conv_gradient_with_fused_slices():
    def loss(x, w):
        return fnp.sum(_depthwise(x, w) ** 2)

    _check_fused_equals_unfused(fj.grad(loss, argnums=(0, 1)), (_DW_X, _DW_W), 1e-4)


def test_slices_read_by_a_row_loop_nest_are_its_inputs():
    """The nest reads whole tiles of its inputs: slices read in it are copied once, before it."""

    def fn(x):
        return nn.softmax(x[:, 1:] - x[:, :-1], axis=-1)

    assert [op.name for op in _optimized(fn, _ROWS).ops] == ["fusion"]
    assert "row loop nest" in _row_nest_lines(fn, _ROWS)[0]
    _check_fused_equals_unfused(fn, (_ROWS,), 1e-5)


# --- transposes read by reductions: the input reduced along the permuted axes --------------------------

_T2 = RNG.standard_normal((67, 300)).astype(np.float32)
_T3 = RNG.standard_normal((6, 10, 40)).astype(np.float32)


@pytest.mark.parametrize(
    "fn, x",
    [
        (lambda x: x.T.sum(1), _T2),
        (lambda x: x.T.sum(0), _T2),
        (lambda x: x.T.max(0), _T2),
        (lambda x: x.T.min(1), _T2),
        (lambda x: fnp.sum(x.T), _T2),
        (lambda x: fnp.sum(fnp.exp(x).T, axis=1), _T2),  # the transpose reads a value another group computes
        (lambda x: fnp.prod(fnp.transpose(1.0 + 0.001 * x), axis=1), _T2),
        (lambda x: fnp.sum(x.T, axis=1, keepdims=True) * (1.0 / 67), _T2),
        (lambda x: fnp.sum(fnp.transpose(x, (2, 0, 1)), axis=1), _T3),  # kept dims come back transposed
        (lambda x: fnp.max(fnp.transpose(x, (1, 0, 2)), axis=2), _T3),
        (lambda x: fnp.sum(fnp.transpose(x, (2, 1, 0)), axis=(0, 2)), _T3),
        (lambda x: fnp.sum(x.T.astype(np.float64), axis=1), _T2),  # a convert between: a copy, then the sum
        (lambda x: fnp.sum(x.astype(np.int32).T, axis=1), _T2 * 100),
        (lambda x: fnp.sum(x.astype(np.float16).T, axis=0), _T2),
        (lambda x: (x.T, x.T.sum(1)), _T2),  # the group also returns the transpose: stored once
        (lambda x: x.T.sum(1), np.zeros((0, 5), np.float32)),
    ],
    ids=[
        "sum_rows",
        "sum_cols",
        "max_cols",
        "min_rows",
        "sum_all",
        "of_computed",
        "prod",
        "keepdims_mean",
        "3d_kept_transposed",
        "3d_outer_swap",
        "3d_two_axes",
        "convert_between",
        "int32",
        "float16",
        "also_returned",
        "empty",
    ],
)
def test_reductions_of_a_transpose_read_the_input_in_place(fn, x):
    """A transpose read by a reduction fuses with it, and the CPU kernel reduces the input along
    the permuted axes: no transposed copy unless the group returns it. Results agree with numpy and
    with the unfused compile (max/min and integer sums exactly; float sums and products up to their
    summation order, which follows the input's layout)."""
    traced = _traced(fn, x)
    text = print_graph(traced)
    expected = interpret(traced, [x])
    got = fj.jit(fn)(x)
    got = got if isinstance(got, tuple) else (got,)
    unfused = compile_graph(_optimized(fn, x, fuse=False), "cpu").run([x])
    for g, u, want in zip(got, unfused, expected):
        assert g.shape == want.shape and g.dtype == want.dtype
        tol = 2e-3 if want.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(g, want, rtol=tol, atol=tol)
        np.testing.assert_allclose(g, u, rtol=tol, atol=tol)
        if want.dtype.kind in "iu" or "reduce_max" in text or "reduce_min" in text:
            np.testing.assert_array_equal(g, u)


def test_a_transposed_reduction_makes_no_transposed_copy():
    graph = _optimized(lambda x: x.T.sum(1), _T2)
    (fusion,) = _fusions(graph)
    assert [op.name for op in fusion.regions[0].ops] == ["transpose", "reduce_sum"]
    mlir = fj.jit(lambda x: x.T.sum(1)).lower(_T2).as_text("mlir")
    assert "tensor<300x67xf32>" not in mlir  # the transposed shape appears nowhere
    # The transposed shape of a 3-d input only as the reduced result's transpose back.
    mlir = fj.jit(lambda x: fnp.sum(fnp.transpose(x, (2, 0, 1)), axis=1)).lower(_T3).as_text("mlir")
    assert "tensor<40x6x10xf32>" not in mlir and "tensor<10x40xf32>" in mlir and "tensor<40x10xf32>" in mlir


def test_a_transpose_read_by_elementwise_ops_stays_a_copy_of_its_own():
    """Elementwise kernels reading a transposed input were slower fused (docs: fuse.py); the copy
    and the kernel after it stay two kernels, the copy in blocks."""
    graph = _optimized(lambda x, y: fnp.exp(x.T) + y, _T2, _T2.T.copy())
    assert [op.name for op in graph.ops] == ["transpose", "fusion"]


# --- convolution epilogues: streamed through each chunk of the conv's output -------------------------


def _mlir(graph) -> str:
    from flowjit.backends.cpu.compiler import generate_mlir

    return generate_mlir(graph).text


def _conv_case(n, c, h, w, k, kernel, stride=1, padding=1, dilation=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((k, c, kernel, kernel)) / np.sqrt(c * kernel * kernel)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)

    def conv(x, wt):
        return nn.conv2d(x, wt, stride=stride, padding=padding, dilation=dilation)

    return conv, (x, wt, b)


# Each shape takes one path of the CPU lowering's im2col form (lower_conv._conv_as_matmul):
_CONV_PATHS = {
    "chunks of whole images over the cores, then a tail chunk": (16, 16, 12, 12, 32, 3),
    "row blocks of one image over the cores": (2, 64, 40, 40, 16, 3),
    "row blocks with a tail block": (2, 64, 43, 43, 8, 3),
    "row blocks one after another": (1, 64, 15, 40, 8, 3),
    "whole output in one chunk": (2, 8, 12, 12, 8, 3),
    "1x1 columns read in place": (4, 16, 20, 20, 8, 1),
    "sum over taps (output rows shorter than the kernel)": (2, 8, 12, 12, 4, 10),
    "generic (fewer taps than IM2COL_MIN_DEPTH)": (2, 1, 20, 20, 4, 2),
}


@pytest.mark.parametrize("path", list(_CONV_PATHS))
def test_conv_epilogue_streams_and_equals_unfused(path):
    n, c, h, w, k, kernel = _CONV_PATHS[path]
    conv, (x, wt, b) = _conv_case(n, c, h, w, k, kernel, padding=1 if kernel == 3 else 0)

    def layer(x, wt, b):
        return nn.relu(conv(x, wt) + b.reshape(1, -1, 1, 1))

    graph = _optimized(layer, x, wt, b)
    assert [op.name for op in graph.ops if op.name != "constant"] == ["fusion"]
    _check_fused_equals_unfused(layer, (x, wt, b), 1e-4)


def test_conv_epilogue_windows_every_kind_of_leaf():
    """Full tensors (a residual, a bool mask) are read at each chunk's images and rows, a per-image
    broadcast at its images, the bias along channels; stride and dilation; row blocks over the cores."""
    conv, (x, wt, b) = _conv_case(2, 64, 47, 41, 8, 3, stride=1, padding=2, dilation=2, seed=3)
    out_shape = (2, 8, 47, 41)
    rng = np.random.default_rng(4)
    residual = rng.standard_normal(out_shape).astype(np.float32)
    mask = rng.random(out_shape) < 0.5
    scale = rng.standard_normal((2, 1, 1, 1)).astype(np.float32)

    def layer(x, wt, b, residual, mask, scale):
        y = fnp.tanh(conv(x, wt) * 0.5 + residual) * b.reshape(1, -1, 1, 1) * scale
        return fnp.where(mask, y, -y)

    args = (x, wt, b, residual, mask, scale)
    graph = _optimized(layer, *args)
    assert [op.name for op in graph.ops if op.name != "constant"] == ["fusion"]
    _check_fused_equals_unfused(layer, args, 1e-4)
    # One whole-output tensor: the product is never stored whole (unfused: the product, each op's result).
    whole = "tensor.empty() : tensor<2x8x47x41xf32>"
    assert fj.jit(layer).lower(*args).as_text("mlir").count(whole) == 1
    assert _mlir(_optimized(layer, *args, fuse=False)).count(whole) > 2


def test_conv_epilogue_strided_and_image_chunks():
    conv, (x, wt, b) = _conv_case(32, 16, 17, 17, 16, 3, stride=2, padding=1, seed=5)

    def layer(x, wt, b):
        return nn.gelu(conv(x, wt) + b.reshape(1, -1, 1, 1))

    _check_fused_equals_unfused(layer, (x, wt, b), 1e-4)


# --- pooling after a conv's epilogue: each chunk of the conv's output pooled in cache ---------------


def _pooled_group(graph) -> bool:
    """One fusion (constants aside) whose body ends in the pool it returns."""
    (op,) = [op for op in graph.ops if op.name != "constant"]
    body = op.regions[0]
    return op.name == "fusion" and body.results[0].producer.name == "reduce_window"


@pytest.mark.parametrize("path", list(_CONV_PATHS))
def test_conv_epilogue_pools_each_chunk(path):
    """Conv + bias + relu + 2x2 max pooling is one group on every path of the im2col form (chunks of
    whole images, blocks of rows rounded to whole windows, tails, odd sizes whose last row and column
    no window covers) and of the generic, equal to the unfused program bit for bit."""
    n, c, h, w, k, kernel = _CONV_PATHS[path]
    conv, (x, wt, b) = _conv_case(n, c, h, w, k, kernel, padding=1 if kernel == 3 else 0)

    def layer(x, wt, b):
        return nn.max_pool2d(nn.relu(conv(x, wt) + b.reshape(1, -1, 1, 1)), 2)

    graph = _optimized(layer, x, wt, b)
    assert _pooled_group(graph)
    _check_fused_equals_unfused(layer, (x, wt, b), 1e-4)
    # The conv's output is never a tensor of its own but in the generic form, which makes it whole.
    oh = h + 2 * (kernel == 3) - kernel + 1
    whole = f"tensor.empty() : tensor<{n}x{k}x{oh}x{oh}xf32>"
    assert _mlir(graph).count(whole) == (1 if path.startswith("generic") else 0)


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param(lambda y: nn.avg_pool2d(y, 3), id="avg 3x3"),
        pytest.param(lambda y: nn.max_pool2d(y, (2, 3)), id="max 2x3"),
        pytest.param(lambda y: nn.max_pool2d(y, (4, 1)), id="max 4x1"),
    ],
)
def test_conv_epilogue_pools_every_window_that_tiles(pool):
    """Average pooling (its division), windows taller than wide and wider than tall, a conv whose
    rows come in blocks (one 1 x 64 x 40 x 40 image: each block a whole number of windows)."""
    conv, (x, wt, b) = _conv_case(2, 64, 40, 40, 16, 3, seed=6)

    def layer(x, wt, b):
        return pool(nn.gelu(conv(x, wt) + b.reshape(1, -1, 1, 1)))

    assert _pooled_group(_optimized(layer, x, wt, b))
    _check_fused_equals_unfused(layer, (x, wt, b), 1e-4)


def test_conv_epilogue_pools_with_leaves_of_every_kind():
    """A residual of the conv's shape (read with each plane collapsed, as the product), a leaf along
    rows only (then the epilogue runs row by row), the product pooled without an epilogue, and
    float64."""
    conv, (x, wt, b) = _conv_case(4, 16, 30, 30, 32, 3, seed=7)
    rng = np.random.default_rng(8)
    residual = rng.standard_normal((4, 32, 30, 30)).astype(np.float32)
    rows = rng.standard_normal((1, 1, 30, 1)).astype(np.float32)

    def with_residual(x, wt, residual):
        return nn.max_pool2d(fnp.tanh(conv(x, wt) + residual), 2)

    def with_rows(x, wt, rows):
        return nn.max_pool2d(conv(x, wt) * rows, 2)

    def bare(x, wt):
        return nn.avg_pool2d(conv(x, wt), 2)

    for layer, args in ((with_residual, (x, wt, residual)), (with_rows, (x, wt, rows)), (bare, (x, wt))):
        assert _pooled_group(_optimized(layer, *args))
        _check_fused_equals_unfused(layer, args, 1e-4)
    wide = (x.astype(np.float64), wt.astype(np.float64), residual.astype(np.float64))
    _check_fused_equals_unfused(with_residual, wide, 1e-12)


def test_conv_max_pool_runs_first_only_under_non_decreasing_epilogues(monkeypatch):
    """A max pool runs before the epilogue when the epilogue is a non-decreasing function of the
    product with no operand varying inside a window (`_Epilogue._commutes_with_max`): then the max
    of the results is the result on the max, bit for bit. Decreasing or non-monotone epilogues (a
    negative scale, b - x, a relu whose floor is above its threshold) and leaves varying along rows
    keep the epilogue first; every one equals the unfused program."""
    from flowjit.backends.cpu import fusion_epilogue

    decided = []
    commutes = fusion_epilogue.FusedEpilogue._commutes_with_max
    monkeypatch.setattr(
        fusion_epilogue.FusedEpilogue, "_commutes_with_max", lambda self: decided.append(commutes(self)) or decided[-1]
    )
    conv, (x, wt, b) = _conv_case(4, 16, 20, 20, 32, 3, seed=11)
    rows = np.random.default_rng(12).standard_normal((1, 1, 20, 1)).astype(np.float32)
    bias = lambda b: b.reshape(1, -1, 1, 1)  # noqa: E731
    cases = [
        (lambda x, wt, b: nn.relu(conv(x, wt) + bias(b)), True),
        (lambda x, wt, b: fnp.maximum(conv(x, wt) * 2.0 - bias(b), bias(b)), True),
        (lambda x, wt, b: conv(x, wt) * -0.5 + bias(b), False),
        (lambda x, wt, b: bias(b) - conv(x, wt), False),
        (lambda x, wt, b: fnp.where(conv(x, wt) <= 0.0, 1.0, conv(x, wt)), False),
        (lambda x, wt, b: nn.relu(conv(x, wt) + rows), False),
    ]
    for epilogue, first in cases:
        layer = lambda x, wt, b, epilogue=epilogue: nn.max_pool2d(epilogue(x, wt, b), 2)  # noqa: E731
        decided.clear()
        _check_fused_equals_unfused(layer, (x, wt, b), 1e-4)
        assert decided and all(d == first for d in decided), (epilogue, decided)


def test_conv_pool_stays_apart_when_its_input_is_kept():
    """A training step keeps the activation for the pool's gradient: the pool is not fused (the
    activation is the group's result), and the gradients equal the unfused program's."""
    conv, (x, wt, b) = _conv_case(4, 8, 16, 16, 16, 3, seed=9)

    def loss(wt, x, b):
        return fnp.sum(nn.max_pool2d(nn.relu(conv(x, wt) + b.reshape(1, -1, 1, 1)), 2) ** 2)

    grad = fj.grad(loss)
    graph = _optimized(grad, wt, x, b)
    assert "reduce_window" in [op.name for op in graph.ops]
    _check_fused_equals_unfused(grad, (wt, x, b), 1e-4, exact=False)


# --- matrix-product epilogues: streamed through each register tile of the tiled kernel ------------

# Each shape takes one path of the CPU backend's tiled kernel (matmul_kernel.emit_matmul) on two or
# more cores (on one, every product takes the serial paths): (M, K, N, a @ b.T, a.T @ b, dtype).
_DOT_PATHS = {
    "whole panels over the cores, ragged rows": (203, 96, 256, False, False, np.float32),
    "whole panels over the cores, then the partial last panel": (128, 80, 300, False, False, np.float32),
    "row chunks over the cores, partial panel": (520, 72, 100, False, False, np.float32),
    "row chunks over the cores, b packed from its rows": (512, 64, 96, True, False, np.float32),
    "one thread, a read by columns": (96, 40, 112, False, True, np.float32),
    "float64, whole panels": (128, 128, 128, False, False, np.float64),
}


@pytest.mark.parametrize("path", list(_DOT_PATHS))
@pytest.mark.usefixtures("specialized_matmul")
def test_dot_epilogue_streams_and_equals_unfused(path):
    m, k, n, b_rows, a_cols, dtype = _DOT_PATHS[path]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((k, m) if a_cols else (m, k)).astype(dtype)
    w = rng.standard_normal((n, k) if b_rows else (k, n)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)

    def layer(x, w, b):
        product = (x.T if a_cols else x) @ (w.T if b_rows else w)
        return fnp.tanh(product * 0.5 + b) - nn.relu(product)

    graph = _optimized(layer, x, w, b)
    assert [op.name for op in graph.ops if op.name != "constant"] == ["fusion"]
    _check_fused_equals_unfused(layer, (x, w, b), 1e-4 if dtype == np.float32 else 1e-10)
    mlir = fj.jit(layer).lower(x, w, b).as_text("mlir")
    assert "epilogue over the whole product" not in mlir
    # One whole-output tensor: the tiles are computed in place, the product never stored apart.
    assert mlir.count(f"tensor.empty() : tensor<{m}x{n}x{'f32' if dtype == np.float32 else 'f64'}>") == 1


def test_dot_epilogue_of_a_stack_of_rows_streams():
    """A dense layer on (B, T, D) inputs: one product of B * T rows whose tiles go through the
    epilogue (a bias along the columns); a residual of the output's shape runs after it."""
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal((3, 70, 48)).astype(np.float32), rng.standard_normal((48, 120)).astype(np.float32)
    b, r = rng.standard_normal(120).astype(np.float32), rng.standard_normal((3, 70, 120)).astype(np.float32)
    biased, residual = (lambda x, w, b, r: nn.gelu(x @ w + b) * 2.0), (lambda x, w, b, r: x @ w + r)
    _check_epilogues([(biased, True), (residual, False)], (x, w, b, r))


def _check_epilogues(layers, args):
    """Each (layer, streamed): one group, equal to unfused, its epilogue streamed through the tiles
    or (not `streamed`) run over the whole product after it."""
    for layer, streamed in layers:
        assert [op.name for op in _optimized(layer, *args).ops if op.name != "constant"] == ["fusion"]
        _check_fused_equals_unfused(layer, args, 1e-4)
        mlir = fj.jit(layer).lower(*args).as_text("mlir")
        assert ("epilogue over the whole product" not in mlir) == streamed


def test_dense_layer_on_a_stack_writes_the_output_in_place(monkeypatch):
    """(B, T, D) @ (D, F) is C (B * T, F) viewed as (B, T, F): the output buffer is collapsed to C's
    shape so that the kernel (and an epilogue over the whole product, a residual) writes it, with
    no temporary C copied out; a matmul library call (this product is small) writes it too."""
    monkeypatch.setenv("FLOWJIT_MATMUL_LIBRARY", "0")
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((4, 33, 40)).astype(np.float32), rng.standard_normal((40, 96)).astype(np.float32)
    r = rng.standard_normal((4, 33, 96)).astype(np.float32)
    per_image = lambda x, w, r: x @ w * r[:, :1, :1] + r  # noqa: E731 (a (4, 1, 1) leaf: not a matrix)
    for layer in (lambda x, w, r: x @ w, lambda x, w, r: nn.relu(x @ w + r * 2.0), per_image):
        args = (x, w, r)
        if _fusions(_optimized(layer, *args)):
            _check_fused_equals_unfused(layer, args, 1e-4)
        want = fj.jit(layer, target="interpreter")(*args)
        np.testing.assert_allclose(fj.jit(layer)(*args), want, rtol=1e-5, atol=1e-4)
        if layer is not per_image:
            lowered = fj.jit(layer).lower(*args)
            assert "memref.collapse_shape %out0 [[0, 1], [2]]" in lowered.as_text("mlir")
            assert "memcpy" not in lowered.as_text("asm") and "malloc" not in lowered.as_text("asm")
    monkeypatch.setenv("FLOWJIT_MATMUL_LIBRARY", "1")
    lowered = fj.jit(lambda x, w: x @ w).lower(x, w)
    assert "func.call @fj_matmul_f32(" in lowered.as_text("mlir")
    assert "memcpy" not in lowered.as_text("asm") and "malloc" not in lowered.as_text("asm")
    np.testing.assert_allclose(lowered.compile()(x, w), x @ w, rtol=1e-5, atol=1e-4)


def test_dot_epilogue_of_batched_products_streams():
    """Batched products (attention scores times a scale, batched dense layers): each batch's
    tiles go through an epilogue that reads at most columns; a residual runs after the product."""
    rng = np.random.default_rng(11)
    q, k = rng.standard_normal((6, 72, 32)).astype(np.float32), rng.standard_normal((6, 32, 72)).astype(np.float32)
    b, r = rng.standard_normal(72).astype(np.float32), rng.standard_normal((6, 72, 72)).astype(np.float32)
    scaled, residual = (lambda q, k, b, r: fnp.tanh(q @ k * 0.125 + b)), (lambda q, k, b, r: q @ k - r)
    _check_epilogues([(scaled, True), (residual, False)], (q, k, b, r))


@pytest.mark.usefixtures("specialized_matmul")
def test_dot_epilogue_reading_rows_runs_after_the_product_in_place():
    """An epilogue reading a tensor of the product's shape (a residual, a mask) runs over the whole
    product after it (read tile by tile down the columns it makes the kernel slower), in place in
    the output: still one group, no intermediate tensor."""
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((260, 64)).astype(np.float32), rng.standard_normal((64, 200)).astype(np.float32)
    residual = rng.standard_normal((260, 200)).astype(np.float32)
    mask = rng.random((260, 1)) < 0.5

    def layer(x, w, residual, mask):
        return fnp.where(mask, x @ w + residual, 0.0)

    args = (x, w, residual, mask)
    assert [op.name for op in _optimized(layer, *args).ops if op.name != "constant"] == ["fusion"]
    _check_fused_equals_unfused(layer, args, 1e-4)
    mlir = fj.jit(layer).lower(*args).as_text("mlir")
    assert "epilogue over the whole product after it (it reads tensors of the product's rows)" in mlir
    assert mlir.count("tensor.empty() : tensor<260x200xf32>") == 1


def test_dot_epilogue_of_another_form_is_split_off():
    """A group returning the product too, or a bool, or a product with two free dimensions on the
    right: the product is split off (stored in the workspace) and its epilogue fuses with itself."""
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal((256, 64)).astype(np.float32), rng.standard_normal((64, 128)).astype(np.float32)
    w3 = rng.standard_normal((64, 8, 16)).astype(np.float32)
    cases = [
        (lambda x, w: (x @ w, nn.relu(x @ w)), (x, w)),
        (lambda x, w: x @ w > 0.0, (x, w)),
        (lambda x, w3: nn.relu(fnp.tensordot(x, w3, axes=1)), (x, w3)),
    ]
    for fn, args in cases:
        graph = _optimized(fn, *args)
        assert [op.name for op in graph.ops if op.name not in ("constant", "fusion")] == ["dot_general"]
        _check_fused_equals_unfused(fn, args, 1e-4)
