"""Row kernels (flowjit/backends/gpu/lower_rows.py): a fused region that works row by row is ONE
kernel, a block per row reducing with warp shuffles and workgroup memory.

Without a GPU: the launch plan counts the launches; ptxas assembles the PTX for sm_80 and sm_90
(and it holds `shfl.sync` and `bar.sync`); the CPU emulator (tests/gpu_emulator.py, each thread of a
block an OS thread, barriers and shuffles as host callbacks) replays the plan against the reference
interpreter, within the op table's tolerances.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.backends.gpu import lower_rows
from flowjit.backends.gpu.compiler import lower_to_ptx
from flowjit.backends.gpu.pipeline import GpuOptions
from flowjit.ir import dtypes as dt
from flowjit.ir.interpreter import interpret

pytest.importorskip("mlir")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_emulator  # noqa: E402
from op_table import assert_close, tolerance  # noqa: E402
from test_gpu_codegen import assemble, needs_ptxas  # noqa: E402


def softmax(x):
    return nn.softmax(x)


def log_softmax(x):
    return nn.log_softmax(x)


def layer_norm(x):
    return nn.layer_norm(x)


def layer_norm_affine(x, gamma, beta):
    return nn.layer_norm(x) * gamma + beta


def rms_norm(x, gamma):
    return nn.rms_norm(x, gamma)


def logsumexp(x):
    return nn.logsumexp(x, axis=-1)


def hand_softmax(x):
    m = fnp.max(x, axis=-1, keepdims=True)
    e = fnp.exp(x - m)
    return e / fnp.sum(e, axis=-1, keepdims=True)


softmax_grad = fj.grad(lambda x: fnp.sum(nn.softmax(x) * x))

FUNCTIONS = {
    "softmax": (softmax, 0),
    "log_softmax": (log_softmax, 0),
    "layer_norm": (layer_norm, 0),
    "layer_norm_affine": (layer_norm_affine, 2),
    "rms_norm": (rms_norm, 1),
    "logsumexp": (logsumexp, 0),
    "hand_softmax": (hand_softmax, 0),
    "softmax_grad": (softmax_grad, 0),
}


def _arguments(name: str, shape: tuple[int, ...], dtype) -> tuple:
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    columns = [rng.standard_normal(shape[-1]).astype(dtype) for _ in range(FUNCTIONS[name][1])]
    return (x, *columns)


def _compiled(name: str, shape: tuple[int, ...], dtype=np.float32, chip: str = "sm_80"):
    fn = FUNCTIONS[name][0]
    args = _arguments(name, shape, dtype)
    graph = fj.jit(fn).lower(*args).graph("optimized")
    return graph, args, lower_to_ptx(graph, GpuOptions(chip=chip))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("shape", [(64, 1000), (8, 4096)], ids=["64x1000", "8x4096"])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm", "hand_softmax"])
def test_a_row_region_is_one_launch(name, shape, dtype):
    _, _, module = _compiled(name, shape, dtype)
    launches = list(module.plan.launches())
    assert len(launches) == 1, [launch.module for launch, _ in launches]
    ((launch, _),) = launches
    assert launch.grid == (shape[0], 1, 1) and launch.block == (lower_rows.MAX_THREADS, 1, 1)
    (kernel,) = module.kernels
    assert "shfl.sync.bfly" in kernel.ptx and "bar.sync" in kernel.ptx


@needs_ptxas
@pytest.mark.parametrize("chip", ["sm_80", "sm_90"])
@pytest.mark.parametrize(
    ("name", "shape", "dtype"),
    [
        ("softmax", (64, 1000), np.float32),
        ("layer_norm_affine", (8, 4096), np.float16),
        ("log_softmax", (3, 20000), np.float32),  # the loops that re-read the row
        ("rms_norm", (5, 33), np.float64),  # 64-bit shuffles: two 32-bit ones each
        ("softmax_grad", (4, 7), np.float32),  # one warp: no workgroup memory, no barrier
    ],
)
def test_row_kernels_assemble(name, shape, dtype, chip):
    _, _, module = _compiled(name, shape, dtype, chip)
    (kernel,) = module.kernels
    assert f".target {chip}" in kernel.ptx and "shfl.sync" in kernel.ptx
    assert ("bar.sync" in kernel.ptx) == (shape[-1] > 32)
    assemble(kernel.ptx, chip)


def _row_kernel(graph) -> lower_rows.RowKernel:
    (fusion,) = [op for op in graph.ops if op.name == "fusion"]
    return lower_rows.plan(fusion)


def _replayed(graph, args, module):
    outputs = [(tuple(t.shape), t.dtype.np_dtype) for t in module.mlir.outputs]
    return gpu_emulator.run(module.plan, gpu_emulator.EmulatedKernels(module.gpu_mlir), list(args), outputs)


# Rows of odd lengths, shorter than a warp, a single row, several leading axes, and rows too long
# to hold in registers (the loops that re-read them).
SHAPES = [(3, 1000), (5, 33), (4, 7), (1, 1000), (2, 3, 100), (2, 4500)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_row_kernels_compute_the_reference(name, shape):
    graph, args, module = _compiled(name, shape)
    assert len(list(module.plan.launches())) == 1
    assert ("gpu.barrier" in module.gpu_mlir) == (shape[-1] > 32) and "gpu.shuffle" in module.gpu_mlir
    assert (_row_kernel(graph).held == 0) == (shape[-1] > lower_rows.HELD_PER_THREAD * lower_rows.MAX_THREADS)
    for got, expected in zip(_replayed(graph, args, module), interpret(graph, list(args))):
        assert_close(got, np.asarray(expected), tolerance(dt.float32, shape[-1]))


@pytest.mark.parametrize("name", ["softmax", "layer_norm_affine", "log_softmax"])
def test_row_kernels_of_float16(name):
    graph, args, module = _compiled(name, (3, 300), np.float16)
    assert len(list(module.plan.launches())) == 1
    for got, expected in zip(_replayed(graph, args, module), interpret(graph, list(args))):
        assert_close(got, np.asarray(expected), tolerance(dt.float16, 300))


def test_a_region_that_is_not_all_rows_is_no_row_kernel():
    """The gradient of a layer norm's gamma sums over the rows (a column sum): the region is not a
    row computation as a whole, so it is no row kernel; split into stages (row_stages.py,
    tests/test_gpu_row_parts.py) it is a row kernel, then the column sum's kernel."""
    fn = fj.grad(lambda x, g: fnp.sum(nn.layer_norm(x) * g), argnums=(0, 1))
    args = _arguments("rms_norm", (6, 50), np.float32)
    graph = fj.jit(fn).lower(*args).graph("optimized")
    assert _row_kernel(graph) is None
    module = lower_to_ptx(graph, GpuOptions())
    grids = [launch.grid for launch, _ in module.plan.launches()]
    assert len(grids) == 2 and grids[0] == (6, 1, 1)
    assert "gpu.shuffle" in module.gpu_mlir
    for got, expected in zip(_replayed(graph, args, module), interpret(graph, list(args))):
        assert_close(got, np.asarray(expected), tolerance(dt.float32, 50))
