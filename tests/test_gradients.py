"""Gradient checks from one table: every differentiable op, against central finite differences.

Each `GradRow` applies one op to operands drawn from a generator that keeps them away from the op's
kinks (ties of max, integers for rem, zero for abs). For each float dtype the test builds the
single-op graph, runs the autodiff pass with a random cotangent, evaluates the gradient graph with
the reference interpreter, and compares with central differences of <cotangent, op(inputs)> taken in
float64 with the op's numpy implementation. `test_every_differentiable_op_has_a_row` fails when an
op gains a vjp rule (or is registered without one) and no row checks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from flowjit.frontend.autodiff import VJP_RULES, VJPSpec, is_non_differentiable, vjp_graph
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import emit
from flowjit.ir.graph import Graph
from flowjit.ir.interpreter import interpret
from flowjit.ir.ops import REGISTRY
from flowjit.ir.types import TensorType
from flowjit.ir.verifier import verify

F16, BF16, F32, F64, I32 = dt.float16, dt.bfloat16, dt.float32, dt.float64, dt.int32

# Ops whose gradients are checked in tests/test_autodiff.py instead (they need a traced program).
CHECKED_ELSEWHERE = {
    "custom_vjp_call": "test_autodiff.py::test_custom_vjp*",
    "while": "the error test",
    "fusion": "made by the fuse pass, which runs after autodiff (never differentiated)",
}


@dataclass(frozen=True)
class GradRow:
    """One op under one configuration. `inputs(rng)` returns the operands in float64 (float operands,
    cast to each tested dtype) or their final integer/bool dtype (never differentiated)."""

    id: str
    op: str
    inputs: object
    attrs: dict = field(default_factory=dict)
    half: bool = False  # also check float16 and bfloat16 (loose tolerance)
    regions: object = None  # regions(float dtype) -> the op's region graphs
    static: tuple[int, ...] = ()  # operands emitted as constants (loop bounds), not parameters


def uniform(lo, hi, *shape):
    return lambda rng: rng.uniform(lo, hi, size=shape)


def away_from_zero(*shape):
    return lambda rng: rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def distinct(*shape):
    """A permutation of well-separated values: no ties for max/min."""
    return lambda rng: rng.permutation(np.arange(int(np.prod(shape)), dtype=np.float64)).reshape(shape) * 0.37 - 1.0


def _rem_operands(rng):
    x = rng.uniform(-3, 3, size=(2, 3))
    y = rng.uniform(0.7, 1.3, size=(2, 3)) * rng.choice([-1.0, 1.0], size=(2, 3))
    frac = np.abs(x / y) % 1.0
    x = np.where((frac < 0.1) | (frac > 0.9), x + 0.5 * y, x)  # keep x/y away from integers (trunc jumps)
    return [x, y]


def _separated(rng):
    x = rng.uniform(-2, 2, size=(2, 3))
    y = x + rng.choice([-1.0, 1.0], size=(2, 3)) * rng.uniform(0.2, 1.0, size=(2, 3))
    return [x, y]


UNARY_DOMAINS = {
    "exp": uniform(-2, 2, 2, 3),
    "log": uniform(0.5, 3, 2, 3),
    "log1p": uniform(-0.5, 3, 2, 3),
    "expm1": uniform(-2, 2, 2, 3),
    "tanh": uniform(-2, 2, 2, 3),
    "logistic": uniform(-3, 3, 2, 3),
    "sqrt": uniform(0.5, 3, 2, 3),
    "rsqrt": uniform(0.5, 3, 2, 3),
    "sin": uniform(-3, 3, 2, 3),
    "cos": uniform(-3, 3, 2, 3),
    "erf": uniform(-2, 2, 2, 3),
    "abs": away_from_zero(2, 3),
    "neg": uniform(-2, 2, 2, 3),
}


def _rows() -> list[GradRow]:
    rows = [GradRow(f"{op}", op, lambda rng, g=gen: [g(rng)], half=True) for op, gen in UNARY_DOMAINS.items()]
    rows += [GradRow(f"{op}-scalar", op, lambda rng: [rng.uniform(0.5, 2, ())]) for op in ("exp", "log", "sqrt")]
    rows += [
        GradRow("add", "add", lambda rng: [rng.uniform(-2, 2, (2, 3)), rng.uniform(-2, 2, (2, 3))], half=True),
        GradRow("sub", "sub", lambda rng: [rng.uniform(-2, 2, (2, 3)), rng.uniform(-2, 2, (2, 3))], half=True),
        GradRow("mul", "mul", lambda rng: [rng.uniform(-2, 2, (2, 3)), rng.uniform(-2, 2, (2, 3))], half=True),
        GradRow("mul-scalar", "mul", lambda rng: [rng.uniform(-2, 2, ()), rng.uniform(-2, 2, ())]),
        GradRow("div", "div", lambda rng: [rng.uniform(-2, 2, (2, 3)), away_from_zero(2, 3)(rng)], half=True),
        GradRow("rem", "rem", _rem_operands),
        GradRow("pow", "pow", lambda rng: [rng.uniform(0.5, 2, (2, 3)), rng.uniform(-1.5, 1.5, (2, 3))]),
        GradRow("max", "max", _separated),
        GradRow("min", "min", _separated),
        GradRow("atan2", "atan2", lambda rng: [away_from_zero(2, 3)(rng), away_from_zero(2, 3)(rng)]),
        GradRow(
            "select",
            "select",
            lambda rng: [rng.random((2, 3)) < 0.5, rng.uniform(-2, 2, (2, 3)), rng.uniform(-2, 2, (2, 3))],
        ),
        GradRow("convert-up", "convert", lambda rng: [rng.uniform(-2, 2, (2, 3))], {"dtype": F64}),
        GradRow("broadcast-new-dims", "broadcast", uniform(-1, 1, 3), {"shape": (2, 3, 4), "dims": (1,)}),
        GradRow("broadcast-stretch", "broadcast", uniform(-1, 1, 1, 3), {"shape": (2, 3), "dims": (0, 1)}),
        GradRow("broadcast-scalar", "broadcast", uniform(-1, 1), {"shape": (2, 2), "dims": ()}),
        GradRow("reshape", "reshape", uniform(-1, 1, 2, 3), {"shape": (3, 2)}),
        GradRow("transpose", "transpose", uniform(-1, 1, 2, 3, 4), {"perm": (2, 0, 1)}),
        GradRow("slice", "slice", uniform(-1, 1, 5, 6), {"start": (1, 0), "limit": (5, 6), "stride": (2, 3)}),
        GradRow("slice-empty", "slice", uniform(-1, 1, 3, 4), {"start": (1, 2), "limit": (1, 4), "stride": (1, 1)}),
        GradRow(
            "dynamic_slice",
            "dynamic_slice",
            lambda rng: [rng.uniform(-1, 1, (5, 4)), np.int32(1), np.int32(7)],
            {"sizes": (2, 3)},
        ),
        GradRow(
            "dynamic_slice-negative-start",
            "dynamic_slice",
            lambda rng: [rng.uniform(-1, 1, (6,)), np.int32(-2)],
            {"sizes": (3,)},
        ),
        GradRow(
            "pad",
            "pad",
            lambda rng: [rng.uniform(-1, 1, (3, 4)), rng.uniform(-1, 1, ())],
            {"low": (1, 0), "high": (0, 2), "interior": (1, 2)},
        ),
        GradRow(
            "concatenate",
            "concatenate",
            lambda rng: [rng.uniform(-1, 1, (2, 3)), rng.uniform(-1, 1, (2, 1)), rng.uniform(-1, 1, (2, 2))],
            {"axis": 1},
        ),
        GradRow(
            "gather",
            "gather",
            lambda rng: [rng.uniform(-1, 1, (4, 3)), np.array([[0, 3], [3, 9]], np.int32)],
            {"axis": 0},
        ),
        GradRow(
            "gather-axis1",
            "gather",
            lambda rng: [rng.uniform(-1, 1, (2, 4)), np.array([1, 1, 2], np.int32)],
            {"axis": 1},
        ),
        GradRow(
            "scatter_add",
            "scatter_add",
            lambda rng: [rng.uniform(-1, 1, (4, 3)), np.array([2, 0, 2], np.int32), rng.uniform(-1, 1, (3, 3))],
            {"axis": 0},
        ),
        GradRow("sort", "sort", distinct(3, 5), {"axis": 1}),
        GradRow(
            "sort-payloads",
            "sort",
            lambda rng: [distinct(4, 3)(rng), rng.uniform(-1, 1, (4, 3)), np.arange(12, dtype=np.int32).reshape(4, 3)],
            {"axis": 0},
        ),
        GradRow("cumsum", "cumsum", uniform(-1, 1, 3, 5), {"axis": 1, "reverse": False}),
        GradRow("cumsum-reverse-axis0", "cumsum", uniform(-1, 1, 4, 2, 3), {"axis": 0, "reverse": True}),
        GradRow(
            "linear_recurrence",
            "linear_recurrence",
            lambda rng: [rng.uniform(-1.5, 1.5, (3, 5)), rng.uniform(-1, 1, (3, 5))],
            {"axis": 1, "reverse": False},
        ),
        GradRow(
            "linear_recurrence-reverse-axis0",
            "linear_recurrence",
            lambda rng: [rng.uniform(-1.5, 1.5, (4, 2, 3)), rng.uniform(-1, 1, (4, 2, 3))],
            {"axis": 0, "reverse": True},
        ),
        GradRow("reduce_sum", "reduce_sum", uniform(-1, 1, 2, 3, 4), {"axes": (0, 2)}),
        GradRow("reduce_sum-all", "reduce_sum", uniform(-1, 1, 3, 2), {"axes": (0, 1)}),
        GradRow("reduce_max", "reduce_max", distinct(3, 4), {"axes": (1,)}),
        GradRow("reduce_max-all", "reduce_max", distinct(2, 3), {"axes": (0, 1)}),
        GradRow("reduce_min", "reduce_min", distinct(3, 4), {"axes": (0,)}),
        GradRow("reduce_prod", "reduce_prod", uniform(0.5, 1.5, 2, 4), {"axes": (1,)}),
        GradRow(
            "reduce_prod-two-axes",
            "reduce_prod",
            lambda rng: [np.where(rng.random((3, 2, 5)) < 0.1, 0.0, rng.uniform(0.6, 1.4, (3, 2, 5)))],
            {"axes": (2, 0)},
        ),
        GradRow(
            "reduce_prod-zeros",
            "reduce_prod",
            lambda rng: [np.array([[0.0, 1.5, -2.0], [0.0, 0.0, 3.0], [1.2, -0.7, 2.0]])],
            {"axes": (1,)},
        ),
        GradRow("dot_general-matmul", "dot_general", _dot_inputs((2, 3), (3, 4)), _dot(lc=(1,), rc=(0,))),
        GradRow(
            "dot_general-batched",
            "dot_general",
            _dot_inputs((2, 3, 4), (2, 4, 5)),
            _dot(lc=(2,), rc=(1,), lb=(0,), rb=(0,)),
        ),
        GradRow("dot_general-transposed", "dot_general", _dot_inputs((3, 2), (4, 3)), _dot(lc=(0,), rc=(1,))),
        GradRow("dot_general-vector", "dot_general", _dot_inputs((3,), (3,)), _dot(lc=(0,), rc=(0,))),
        GradRow(
            "dot_general-batch-last",
            "dot_general",
            _dot_inputs((3, 2, 4), (4, 5, 2)),
            _dot(lc=(2,), rc=(0,), lb=(1,), rb=(2,)),
        ),
        GradRow(
            "conv2d",
            "conv2d",
            _dot_inputs((2, 2, 6, 5), (3, 2, 3, 2)),
            {"stride": (1, 1), "padding": ((0, 0), (0, 0)), "dilation": (1, 1)},
        ),
        GradRow(
            "conv2d-strided-padded-dilated",
            "conv2d",
            _dot_inputs((1, 2, 7, 6), (2, 2, 2, 3)),
            {"stride": (2, 1), "padding": ((1, 2), (0, 1)), "dilation": (1, 2)},
        ),
        GradRow(
            "conv2d-wide-padding",
            "conv2d",
            _dot_inputs((1, 1, 3, 3), (2, 1, 2, 2)),
            {"stride": (2, 2), "padding": ((3, 2), (2, 3)), "dilation": (1, 1)},
        ),
        GradRow(
            "reduce_window-max",
            "reduce_window",
            distinct(1, 2, 4, 5),
            _window("max", (1, 1, 2, 2), (1, 1, 2, 2), ((0, 0), (0, 0), (0, 0), (0, 1))),
        ),
        GradRow(
            "reduce_window-max-overlap",
            "reduce_window",
            distinct(1, 1, 4, 4),
            _window("max", (1, 1, 3, 3), (1, 1, 1, 1), ((0, 0), (0, 0), (1, 1), (1, 0))),
        ),
        GradRow(
            "reduce_window-sum", "reduce_window", uniform(-1, 1, 5, 6), _window("sum", (2, 3), (1, 2), ((1, 0), (0, 2)))
        ),
        GradRow(
            "reduce_window-avg",
            "reduce_window",
            uniform(-1, 1, 1, 2, 5, 5),
            _window("avg", (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1))),
        ),
        GradRow(
            "cond-true",
            "cond",
            lambda rng: [np.array(True), rng.uniform(-1, 1, 3), rng.uniform(-1, 1, ())],
            regions=_cond_regions,
        ),
        GradRow(
            "cond-false",
            "cond",
            lambda rng: [np.array(False), rng.uniform(-1, 1, 3), rng.uniform(-1, 1, ())],
            regions=_cond_regions,
        ),
        GradRow(
            "for",
            "for",
            lambda rng: [
                np.int64(1),
                np.int64(4),
                rng.uniform(-1, 1, 3),
                rng.uniform(-1, 1, ()),
                rng.uniform(-1, 1, 3),
            ],
            {"num_carry": 2},
            regions=_for_regions,
            static=(0, 1),
        ),
    ]
    return rows


def _region(name, types, body) -> Graph:
    region = Graph(name)
    params = [region.add_param(t) for t in types]
    region.results = body(region, *params)
    return region


def _op(graph, name, *operands, **attrs):
    return emit(graph, name, list(operands), attrs).result


def _cond_regions(dtype):
    vec, scalar = TensorType((3,), dtype), TensorType((), dtype)

    def true_branch(g, a, b):  # (sin(a) * b, sum(a) + b)
        return [
            _op(g, "mul", _op(g, "sin", a), _op(g, "broadcast", b, shape=(3,), dims=())),
            _op(g, "add", _op(g, "reduce_sum", a, axes=(0,)), b),
        ]

    def false_branch(g, a, b):  # (a * a, exp(b))
        return [_op(g, "mul", a, a), _op(g, "exp", b)]

    return [_region("true", [vec, scalar], true_branch), _region("false", [vec, scalar], false_branch)]


def _for_regions(dtype):
    vec, scalar, index = TensorType((3,), dtype), TensorType((), dtype), TensorType((), dt.int64)

    def body(g, i, h, acc, w):  # h = tanh(h * w + i); acc = acc + sum(h)
        shift = _op(g, "broadcast", _op(g, "convert", i, dtype=dtype), shape=(3,), dims=())
        new_h = _op(g, "tanh", _op(g, "add", _op(g, "mul", h, w), shift))
        return [new_h, _op(g, "add", acc, _op(g, "reduce_sum", h, axes=(0,)))]

    return [_region("body", [index, vec, scalar, vec], body)]


def _dot_inputs(a_shape, b_shape):
    return lambda rng: [rng.uniform(-1, 1, a_shape), rng.uniform(-1, 1, b_shape)]


def _dot(lc, rc, lb=(), rb=()):
    return {"lhs_contract": lc, "rhs_contract": rc, "lhs_batch": lb, "rhs_batch": rb}


def _window(kind, window, strides, padding):
    return {"kind": kind, "window": window, "strides": strides, "padding": padding}


ROWS = _rows()

# |gradient - finite difference| <= tol * max(1, max|finite difference|)
TOLERANCE = {F64: 1e-6, F32: 2e-4, F16: 2e-2, BF16: 1e-1}


def _operands(row: GradRow, seed: int) -> list[np.ndarray]:
    out = row.inputs(np.random.default_rng(seed))
    return [np.asarray(x) for x in (out if isinstance(out, list) else [out])]


def _is_float(x: np.ndarray) -> bool:
    return dt.dtype(x.dtype).is_float


def _cast(operands, dtype: dt.DType):
    return [x.astype(dtype.np_dtype) if _is_float(x) else x for x in operands]


def _single_op_graph(row: GradRow, operands) -> Graph:
    """The graph applying `row.op` to parameters (and constants for `row.static` operands)."""
    graph = Graph(row.op)
    values = []
    for i, x in enumerate(operands):
        if i in row.static:
            values.append(emit(graph, "constant", [], {"value": x}).result)
        else:
            values.append(graph.add_param(TensorType(x.shape, dt.dtype(x.dtype)), f"x{i}"))
    float_dtype = next(dt.dtype(x.dtype) for x in operands if _is_float(x))
    regions = row.regions(float_dtype) if row.regions else ()
    graph.results = list(emit(graph, row.op, values, row.attrs, regions=regions).results)
    return graph


def _finite_differences(graph: Graph, params, cotangents, eps: float = 1e-6) -> list[np.ndarray | None]:
    """d <cotangents, graph(params)> / d param for the float params, by central differences in float64."""

    def objective(xs):
        outs = interpret(graph, xs)
        return sum(float(np.sum(out * ct)) for out, ct in zip(outs, cotangents) if ct is not None)

    grads = []
    for i, x in enumerate(params):
        if not _is_float(x):
            grads.append(None)
            continue
        g = np.zeros(x.shape)
        for idx in np.ndindex(*x.shape):
            hi, lo = [list(params) for _ in range(2)]
            hi[i], lo[i] = x.copy(), x.copy()
            hi[i][idx] += eps
            lo[i][idx] -= eps
            g[idx] = (objective(hi) - objective(lo)) / (2 * eps)
        grads.append(g)
    return grads


def _dtypes(row: GradRow):
    return [F32, F64] + ([F16, BF16] if row.half else [])


# Half precision is checked for elementwise rows only: in reductions and contractions the rounding of
# each partial sum swamps what the comparison could detect.
CASES = [pytest.param(row, dtype, id=f"{row.id}-{dtype.name}") for row in ROWS for dtype in _dtypes(row)]


@pytest.mark.parametrize(("row", "dtype"), CASES)
def test_gradient_matches_finite_differences(row: GradRow, dtype: dt.DType):
    wide = _operands(row, seed=len(row.id))
    params = [x for i, x in enumerate(_cast(wide, dtype)) if i not in row.static]
    graph = _single_op_graph(row, _cast(wide, dtype))
    rng = np.random.default_rng(1)
    cotangents = [rng.uniform(0.5, 1.5, r.type.shape) if r.type.dtype.is_float else None for r in graph.results]
    grad_graph = vjp_graph(graph, VJPSpec(primal_outputs=False))
    verify(grad_graph)
    cast_cts = [ct.astype(r.type.dtype.np_dtype) for ct, r in zip(cotangents, graph.results) if ct is not None]
    grads = iter(interpret(grad_graph, [*params, *cast_cts]))
    # float64 differences of the op at the (rounded) inputs the gradient saw
    wide_params = [x.astype(np.float64) if _is_float(x) else x for x in params]
    graph64 = _single_op_graph(row, [x.astype(np.float64) if _is_float(x) else x for x in _cast(wide, dtype)])
    expected = _finite_differences(graph64, wide_params, cotangents)
    for i, (x, fd) in enumerate(zip(params, expected)):
        if fd is None:
            continue
        got = next(grads)
        assert got.shape == x.shape and got.dtype == x.dtype, f"param {i}: gradient {got.shape} {got.dtype}"
        scale = max(1.0, float(np.max(np.abs(fd), initial=0.0)))
        np.testing.assert_allclose(
            got.astype(np.float64), fd, rtol=0, atol=TOLERANCE[dtype] * scale, err_msg=f"param {i}"
        )


def test_every_differentiable_op_has_a_row():
    with_rows = {row.op for row in ROWS}
    missing = sorted(
        name
        for name in REGISTRY
        if not is_non_differentiable(name) and name not in with_rows and name not in CHECKED_ELSEWHERE
    )
    assert not missing, f"differentiable ops without a gradient row (add one to ROWS): {missing}"
    without_rule = sorted(name for name in with_rows if name not in VJP_RULES)
    assert not without_rule, f"rows for ops with no vjp rule: {without_rule}"


# Second order: the gradient graph is itself differentiated (grad of grad, Hessian-vector products),
# so every rule's output must have correct rules too. Checked in float64 against central differences
# of the first-order gradient graph.
SECOND_ORDER_SKIP = {
    "max": "piecewise linear: zero second derivative",
    "min": "piecewise linear: zero second derivative",
}


@pytest.mark.parametrize("row", [r for r in ROWS if r.op not in SECOND_ORDER_SKIP], ids=lambda r: r.id)
def test_second_order_matches_finite_differences(row: GradRow):
    wide = _operands(row, seed=len(row.id))
    graph = _single_op_graph(row, wide)
    params = [x for i, x in enumerate(wide) if i not in row.static]
    rng = np.random.default_rng(2)
    cotangents = [rng.uniform(0.5, 1.5, r.type.shape) for r in graph.results if r.type.dtype.is_float]
    first = vjp_graph(graph, VJPSpec(primal_outputs=False))  # (params, cts) -> grads of float params
    num_params = len(params)
    # differentiate <v, first(params, cts)> with respect to the float params only (cts held fixed)
    float_params = tuple(i for i, x in enumerate(params) if _is_float(x))
    directions = [rng.uniform(-1, 1, r.type.shape) for r in first.results]
    second = vjp_graph(first, VJPSpec(wrt=float_params, primal_outputs=False))
    verify(second)
    got = interpret(second, [*params, *cotangents, *directions])
    fixed = [*params, *cotangents]
    expected = _finite_differences(first, fixed, directions)[:num_params]
    for g, fd in zip(got, [fd for fd in expected if fd is not None]):
        scale = max(1.0, float(np.max(np.abs(fd), initial=0.0)))
        np.testing.assert_allclose(g, fd, rtol=0, atol=1e-6 * scale)


def test_gradient_of_a_traced_column_index_compiles():
    import flowjit as fj

    # the gradient is a scatter_add of rank-0 indices along the last axis (its updates have one
    # dimension less than the source), which the reversed-columns fast path once misread
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    grad = fj.jit(fj.grad(lambda x, i: x[:, i].sum()))(x, np.int32(2))
    expected = np.zeros_like(x)
    expected[:, 2] = 1.0
    np.testing.assert_array_equal(grad, expected)
