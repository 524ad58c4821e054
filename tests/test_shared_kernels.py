"""Ops whose kernels are the same text (a deep network's identical layers) are compiled once: one
private kernel function per distinct kernel, called from every op that runs it
(`sharing.shared_kernels`). Results are the same bits as with every kernel inlined, ops that only
share types stay apart, and a split function defines each shared kernel in one part."""

import numpy as np
import pytest
from test_parallel_mlir import _graph  # the graph a jitted function compiles

import flowjit as fj
from flowjit.backends.cpu import parallel_mlir
from flowjit.backends.cpu.target import CPU
from flowjit.backends.mlir import lowering


def _deep(x, ws):
    for w in ws:
        x = fj.numpy.tanh(x @ w)
    return x


def _deep_numpy(x, ws):
    for w in ws:
        x = np.tanh(x @ w)
    return x


def _inputs(layers=5, rows=24, width=40):
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((width, width)) * 0.2).astype(np.float32) for _ in range(layers)]
    return rng.standard_normal((rows, width)).astype(np.float32), ws


def _inlined(monkeypatch, fn, *args):
    """`fn(*args)` compiled with every kernel inlined in the entry (sharing off)."""
    with monkeypatch.context() as m:
        m.setattr(lowering, "may_repeat", lambda graph: False)
        return fj.jit(fn)(*args)


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("FLOWJIT_CACHE", "0")


def test_identical_layers_are_one_kernel_function(monkeypatch):
    x, ws = _inputs()
    lowered = fj.jit(_deep).lower(x, ws)
    mlir = lowered.as_text("mlir")
    assert mlir.count("func.func private @fj__deep_kernel") == 1
    assert mlir.count("func.call @fj__deep_kernel0(") == len(ws)
    assert "// the kernel of 5 ops, called from each" in mlir
    assert "define internal void @fj__deep_kernel0(" in lowered.as_text("llvm")  # not exported
    got = lowered.compile()(x, ws)
    np.testing.assert_allclose(got, _deep_numpy(x, ws), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got, _inlined(monkeypatch, _deep, x, ws))


def test_gradients_of_identical_layers(monkeypatch):
    x, ws = _inputs(layers=4)

    def loss(ws, x):
        return fj.numpy.sum(_deep(x, ws) ** 2)

    grad = fj.jit(fj.grad(loss))
    mlir = grad.lower(ws, x).as_text("mlir")
    assert "func.call @" in mlir  # the backward layers share kernels too
    got = grad(ws, x)
    expected = _inlined(monkeypatch, fj.grad(loss), ws, x)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_ops_that_only_share_types_stay_apart():
    x, ws = _inputs(layers=2)

    def scaled(x, w1, w2):  # same shapes, different constants in the epilogues
        return fj.numpy.tanh(x @ w1) * 2.0, fj.numpy.tanh(x @ w2) * 3.0

    lowered = fj.jit(scaled).lower(x, *ws)
    assert "_kernel" not in lowered.as_text("mlir")
    a, b = lowered.compile()(x, *ws)
    np.testing.assert_allclose(a, np.tanh(x @ ws[0]) * 2.0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, np.tanh(x @ ws[1]) * 3.0, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("specialized_matmul")  # the 32 x 32 products' kernels, not library calls
def test_operands_in_other_orders_and_the_same_buffer_twice():
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((32, 32)).astype(np.float32) * 0.3 for _ in range(2))

    def products(a, b):  # a @ b and b @ a share a kernel (arguments swapped); a @ a has one operand
        return fj.numpy.tanh(a @ b), fj.numpy.tanh(b @ a), fj.numpy.tanh(a @ a), fj.numpy.tanh(b @ b)

    lowered = fj.jit(products).lower(a, b)
    mlir = lowered.as_text("mlir")
    assert mlir.count("func.func private") == 2 and mlir.count("func.call @") == 4
    got = lowered.compile()(a, b)
    for g, e in zip(got, [np.tanh(a @ b), np.tanh(b @ a), np.tanh(a @ a), np.tanh(b @ b)]):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(parallel_mlir.processes() < 2, reason="needs os.fork and two cores")
def test_split_function_defines_each_shared_kernel_once(monkeypatch):
    monkeypatch.setattr(lowering, "SPLIT_MIN_LINES", 0)
    x, ws = _inputs(layers=6)
    graph = _graph(_deep, x, ws)
    module = lowering.lower_graph(graph, CPU, split=2)
    assert len(module.parts) == 2
    first, second = module.parts
    # defined (exported, for the other part) where it is first called, declared where it is not
    assert "func.func @fj__deep_kernel0(" in first and "func.func private @fj__deep_kernel0(" in second
    assert first.count("func.call @fj__deep_kernel0(") + second.count("func.call @fj__deep_kernel0(") == 6
    got = fj.jit(_deep)(x, ws)
    np.testing.assert_array_equal(got, _inlined(monkeypatch, _deep, x, ws))
