"""Row stages (flowjit/backends/gpu/row_stages.py): a fused region whose row part is only part of
it (cross-entropy and its gradient, a layer norm's gradient with gamma's) is split into stages, each
one kernel: row kernels (a block per row), totals kernels (one block over the row values) and
column sums.

Without a GPU: the launch plan counts the launches and their grids; ptxas assembles every kernel
for sm_80 and sm_90; the CPU emulator (tests/gpu_emulator.py) replays the plan against the
reference interpreter, within the op table's tolerances.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.backends.gpu import lower_rows, row_stages
from flowjit.backends.gpu.compiler import lower_to_ptx
from flowjit.backends.gpu.pipeline import GpuOptions
from flowjit.backends.mlir.row_regions import row_shape
from flowjit.ir import dtypes as dt
from flowjit.ir.interpreter import interpret

pytest.importorskip("mlir")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_emulator  # noqa: E402
from op_table import assert_close, tolerance  # noqa: E402
from test_gpu_codegen import assemble_all, needs_ptxas  # noqa: E402


def xent(x, labels):
    return nn.cross_entropy(x, labels)


def xent_sum(x, labels):
    return nn.cross_entropy(x, labels, reduction="sum")


def xent_smoothed(x, labels):
    return nn.cross_entropy(x, labels, label_smoothing=0.1)


def xent_soft(x, targets):
    return nn.cross_entropy(x, targets)


def layer_norm_loss(x, gamma):
    return fnp.sum(nn.layer_norm(x) * gamma)


def softmax_column_mean(x):
    return fnp.mean(nn.softmax(x), axis=tuple(range(x.ndim - 1)))


def softmax_after_column_max(x):
    return nn.softmax(x - fnp.max(x, axis=tuple(range(x.ndim - 1))))


def largest_logsumexp(x):
    return fnp.max(nn.logsumexp(x, axis=-1))


# name -> (function, its second argument: "labels", "soft" targets, "gamma" or None, launches as
# stages for (64, 10) float32 inputs; docs/gpu-backend.md gives those of the whole-tensor kernels).
FUNCTIONS = {
    "xent": (xent, "labels", 2),
    "xent_grad": (fj.grad(xent), "labels", 3),
    "xent_sum": (xent_sum, "labels", 2),
    "xent_smoothed": (xent_smoothed, "labels", 2),
    "xent_smoothed_grad": (fj.grad(xent_smoothed), "labels", 3),
    "xent_soft": (xent_soft, "soft", 2),
    "layer_norm_grads": (fj.grad(layer_norm_loss, argnums=(0, 1)), "gamma", 3),
    "softmax_column_mean": (softmax_column_mean, None, 4),
    "softmax_after_column_max": (softmax_after_column_max, None, 3),
    "largest_logsumexp": (largest_logsumexp, None, 2),
}


def _arguments(name: str, shape: tuple[int, ...], dtype=np.float32) -> tuple:
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    second = FUNCTIONS[name][1]
    if second is None:
        return (x,)
    if second == "gamma":
        return x, rng.standard_normal(shape[-1]).astype(dtype)
    if second == "soft":
        p = rng.random(shape).astype(dtype)
        return x, p / p.sum(axis=-1, keepdims=True)
    labels = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    labels.reshape(-1)[0] = -100  # an ignored label: left out of the mean
    return x, labels


def _compiled(name: str, shape: tuple[int, ...], chip: str = "sm_80", dtype=np.float32):
    args = _arguments(name, shape, dtype)
    graph = fj.jit(FUNCTIONS[name][0]).lower(*args).graph("optimized")
    return graph, args, lower_to_ptx(graph, GpuOptions(chip=chip))


def _replayed(args, module):
    outputs = [(tuple(t.shape), t.dtype.np_dtype) for t in module.mlir.outputs]
    return gpu_emulator.run(module.plan, gpu_emulator.EmulatedKernels(module.gpu_mlir), list(args), outputs)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_a_partial_row_region_takes_a_kernel_per_stage(name):
    graph, _, module = _compiled(name, (64, 10))
    launches = [launch for launch, _ in module.plan.launches()]
    assert len(launches) == FUNCTIONS[name][2], [launch.module for launch in launches]
    assert len(split := row_stages.split_row_stages(graph).ops) > len(graph.ops), split
    grids = [launch.grid for launch in launches]
    assert (64, 1, 1) in grids  # a row stage: a block per row
    if name.startswith("xent") or name == "largest_logsumexp":  # then the totals over the rows: one block
        assert grids[:2] == [(64, 1, 1), (1, 1, 1)]


def test_cross_entropy_forward_has_one_row_stage_then_one_totals_stage():
    graph, _, _ = _compiled("xent", (64, 10))
    split = row_stages.split_row_stages(graph)
    stages = [op for op in split.ops if op.name == "fusion"]
    assert [op.attrs.get("row_stage") for op in stages] == [None, row_stages.TOTALS]
    assert len([op for op in graph.ops if op.name == "fusion"]) == 1


def test_a_later_row_stage_computes_the_full_values_again():
    """The gradient's last row stage computes exp(x - max) again from x and the row maxima, so the
    first row stage writes two values per row (max, sum), never a (64, 10) tile."""
    graph, _, _ = _compiled("xent_grad", (64, 10))
    first, totals, last = [op for op in row_stages.split_row_stages(graph).ops if op.name == "fusion"]
    assert [r.shape for r in first.results] == [(64,), (64,)]
    assert totals.attrs["row_stage"] == row_stages.TOTALS and [r.shape for r in totals.results] == [()]
    assert [o.name for o in last.regions[0].ops].count("exp") == 1
    assert any(v.shape == (64, 10) for v in last.operands)  # the logits, read again


# Odd row lengths, rows shorter than a warp, several leading axes, rows too long to hold in
# registers (the loops that re-read them).
SHAPES = [(64, 10), (5, 33), (3, 1000), (2, 3, 100), (2, 4500)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_row_stages_compute_the_reference(name, shape):
    graph, args, module = _compiled(name, shape)
    assert len(row_stages.split_row_stages(graph).ops) > len(graph.ops)
    assert len(list(module.plan.launches())) <= FUNCTIONS[name][2]
    for got, expected in zip(_replayed(args, module), interpret(graph, list(args))):
        assert_close(got, np.asarray(expected), tolerance(dt.float32, float(np.prod(shape))))


@pytest.mark.parametrize("name", ["xent", "xent_smoothed_grad", "layer_norm_grads"])
def test_row_stages_of_float16(name):
    graph, args, module = _compiled(name, (7, 300), dtype=np.float16)
    assert len(list(module.plan.launches())) <= FUNCTIONS[name][2]
    for got, expected in zip(_replayed(args, module), interpret(graph, list(args))):
        assert_close(got, np.asarray(expected), tolerance(dt.float16, 7 * 300))


@needs_ptxas
@pytest.mark.parametrize("chip", ["sm_80", "sm_90"])
@pytest.mark.parametrize(
    ("name", "shape"), [("xent_grad", (64, 1000)), ("xent", (3, 4500)), ("layer_norm_grads", (5, 33))]
)
def test_row_stages_assemble(name, shape, chip):
    _, _, module = _compiled(name, shape, chip)
    assert any("shfl.sync" in kernel.ptx for kernel in module.kernels)
    assemble_all(module.kernels, chip)


def test_a_single_row_is_not_split():
    """With one row, the row values and the totals have the same shape: the region keeps its kernels."""
    graph, args, module = _compiled("xent", (1, 100))
    assert row_stages.split_row_stages(graph) is graph
    assert len(list(module.plan.launches())) > 2
    for got, expected in zip(_replayed(args, module), interpret(graph, list(args))):
        assert_close(got, np.asarray(expected), tolerance(dt.float32, 100))


def test_a_reduction_over_a_middle_axis_keeps_the_region_whole():
    """A sum of softmax rows over the middle axis of (4, 8, 16) is neither a row op, a total nor a
    column sum: the region is not split, and keeps its kernels and their results."""
    x = np.random.default_rng(0).standard_normal((4, 8, 16)).astype(np.float32)
    graph = fj.jit(lambda x: fnp.sum(nn.softmax(x), axis=1)).lower(x).graph("optimized")
    (fusion,) = [op for op in graph.ops if op.name == "fusion"]
    assert row_shape(fusion.regions[0]) == ((4, 8), (16,)) and lower_rows.plan(fusion) is None
    assert row_stages.split_row_stages(graph) is graph
    module = lower_to_ptx(graph, GpuOptions())
    assert len(list(module.plan.launches())) > 1
    for got, expected in zip(_replayed((x,), module), interpret(graph, [x])):
        assert_close(got, np.asarray(expected), tolerance(dt.float32, 16))


def _mlp_cross_entropy_step(x, labels, w1, b1, w2):
    def loss(w1, b1, w2):
        return nn.cross_entropy(fnp.tanh(x @ w1 + b1) @ w2, labels)

    g1, gb, g2 = fj.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)
    return w1 - 0.01 * g1, b1 - 0.01 * gb, w2 - 0.01 * g2


def test_an_mlp_training_step_on_cross_entropy_computes_its_new_parameters():
    """The loss's gradient as stages (a row kernel, the count of labels, a row kernel) amid the
    products and the update: 10 launches (22 as whole-tensor kernels), the CPU backend's values (the
    device check's mlp_xent_step, small)."""
    rng = np.random.default_rng(5)
    x, w1, b1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((6, 12), (12, 16), (16,), (16, 3)))
    args = [x, rng.integers(0, 3, 6).astype(np.int32), w1, b1, w2]
    module = lower_to_ptx(fj.jit(_mlp_cross_entropy_step).lower(*args).graph("optimized"), GpuOptions())
    assert len(list(module.plan.launches())) == 10
    expected = fj.jit(_mlp_cross_entropy_step, target="cpu")(*args)
    got = _replayed(args, module)
    assert len(got) == len(expected) == 3
    for g, e, before in zip(got, expected, (w1, b1, w2)):
        assert np.abs(e - before).max() > 1e-3  # the step moved every parameter
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)
