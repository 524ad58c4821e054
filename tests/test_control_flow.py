"""fj.cond / fj.while_loop / fj.fori_loop: structured ops with regions, traced once, not unrolled."""

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph

TARGETS = ["interpreter", "cpu"]


@pytest.mark.parametrize("target", TARGETS)
def test_cond_picks_branch_and_captures_outer_values(target):
    @fj.jit(target=target)
    def f(x, y):
        return fj.cond(x.sum() > 0, lambda a: a * 2 + y, lambda a: a - y.sum(), x)

    x, y = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    np.testing.assert_allclose(f(x, y), x * 2 + y)
    np.testing.assert_allclose(f(-x, y), -x - y.sum())
    ops = [op.name for op in f.lower(x, y).graph("traced").ops]
    assert ops.count("cond") == 1


@pytest.mark.parametrize("target", TARGETS)
def test_fori_loop_is_one_op_not_unrolled(target):
    @fj.jit(target=target)
    def f(x):
        return fj.fori_loop(0, 1000, lambda i, c: c + fnp.astype(i, "float32"), x)

    np.testing.assert_allclose(f(np.zeros(2, np.float32)), np.full(2, sum(range(1000)), np.float32))
    graph = f.lower(np.zeros(2, np.float32)).graph("traced")
    assert [op.name for op in graph.ops].count("for") == 1
    assert len(list(graph.walk())) < 20


@pytest.mark.parametrize("target", TARGETS)
def test_while_loop_with_pytree_carry(target):
    @fj.jit(target=target)
    def f(x):
        return fj.while_loop(lambda c: c["n"] < 10, lambda c: {"n": c["n"] + 1, "x": c["x"] * 1.5}, {"n": 0, "x": x})

    out = f(np.ones(2, np.float32))
    assert int(out["n"]) == 10
    np.testing.assert_allclose(out["x"], np.full(2, 1.5**10, np.float32), rtol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
def test_python_scalars_in_carries_and_results_convert_as_flowjit_numpy_does(target):
    # A lone Python float is float32 (not numpy's float64) in the carry, in what bodies return and in
    # cond operands and results, so a carry started from `1.0` matches a body computing in float32.
    @fj.jit(target=target)
    def f(n):
        i, x = fj.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2.0), (0, 1.0))
        y = fj.fori_loop(0, 3, lambda i, c: c + 0.5, 1.0)
        z = fj.cond(n > 3, lambda a: 2.0, lambda a: a, 1.0)
        return i, x, y, z

    i, x, y, z = f(10)
    assert (int(i), float(x), float(y), float(z)) == (10, 1024.0, 2.5, 2.0)
    assert (i.dtype, x.dtype, y.dtype, z.dtype) == (np.int64, np.float32, np.float32, np.float32)


def test_fori_loop_bounds_must_be_integer_scalars():
    with pytest.raises(fj.FlowjitTypeError, match="upper bound must be an integer scalar; found tensor<f32>"):
        fj.jit(lambda x: fj.fori_loop(0, 2.5, lambda i, c: c, x))(np.float32(1))
    with pytest.raises(fj.FlowjitTypeError, match="lower bound must be an integer scalar"):
        fj.fori_loop(np.zeros(2, np.int32), 3, lambda i, c: c, 1.0)


def test_dynamic_trip_count():
    @fj.jit(target="interpreter")
    def f(n, x):
        return fj.fori_loop(0, n, lambda i, c: c * 2.0, x)

    assert float(f(5, np.float32(1.0))) == 32.0
    assert float(f(3, np.float32(1.0))) == 8.0  # same signature, no retrace needed


def test_control_flow_round_trips_through_text_ir():
    @fj.jit(target="interpreter")
    def f(x, y):
        z = fj.cond(x.sum() > 0, lambda a: a * y, lambda a: a, x)
        return fj.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 2.0 + y, z)

    text = print_graph(f.lower(np.ones(3, np.float32), np.ones(3, np.float32)).graph("traced"))
    assert print_graph(parse_graph(text)) == text


def test_eager_control_flow_runs_python():
    assert fj.cond(True, lambda a: a + 1, lambda a: a - 1, 3) == 4
    assert fj.fori_loop(0, 4, lambda i, c: c + i, 0) == 6
    assert fj.while_loop(lambda c: c < 5, lambda c: c + 2, 0) == 6


def test_branch_type_mismatch_is_a_clear_error():
    @fj.jit(target="interpreter")
    def f(x):
        return fj.cond(x.sum() > 0, lambda a: a, lambda a: a.sum(), x)

    with pytest.raises(fj.FlowjitTypeError, match=r"test_control_flow.py:\d+: both branches of fj.cond"):
        f(np.ones(3, np.float32))


def test_loop_body_must_keep_carry_types():
    @fj.jit(target="interpreter")
    def f(x):
        return fj.fori_loop(0, 3, lambda i, c: c * 2, x)  # int carry * 2 stays int: fine

    assert f(np.int64(1)) == 8

    @fj.jit(target="interpreter")
    def g(x):
        return fj.fori_loop(0, 3, lambda i, c: c * 0.5, x)  # int carry becomes float

    with pytest.raises(fj.FlowjitTypeError, match="must keep the carry's types"):
        g(np.int64(1))


def test_python_if_on_traced_value_names_cond():
    @fj.jit(target="interpreter")
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(fj.FlowjitTypeError, match="fj.cond"):
        f(np.ones(2, np.float32))


@pytest.mark.parametrize(
    "body",
    [
        lambda h: fnp.concatenate([fnp.tanh(h[:, 8:]), h[:, :8] * 0.5], axis=1),
        lambda h: fnp.pad(h[:, 1:] * 0.5, ((0, 0), (0, 1))),
        lambda h: fnp.roll(h, 3, axis=1),
    ],
    ids=["concatenate", "pad", "roll"],
)
def test_a_loop_body_may_build_its_carry_from_slices_of_it(body):
    # the new carry is written slice by slice while the slices read the old one: it goes through a
    # copy, not straight into the carried buffer (a read-after-write conflict bufferization refuses)
    x = np.linspace(-1, 1, 32).astype(np.float32).reshape(2, 16)
    expected = x
    for _ in range(3):
        expected = np.asarray(body(expected))
    out = fj.jit(lambda h: fj.fori_loop(0, 3, lambda i, h: body(h), h))(x)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
