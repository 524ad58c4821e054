"""Wide (128-bit) loads and stores in the GPU's elementwise kernels (flowjit/backends/gpu/wide_accesses.py).

Compile-only, no GPU: where every operand walks the contiguous dimension with unit stride, its
extent splits into vectors and every view starts 16 bytes aligned, each thread loads and stores 16
contiguous bytes (`ld.global.v4.b32`: NVPTX 22 writes the 32-bit accesses untyped), the launch has
a quarter of the threads for float32, and ptxas assembles the PTX for sm_80 and sm_90. An odd
extent or a view at an offset of 4 bytes keeps the scalar kernel (each next to the same program
that does vectorize). The values of the vectorized kernels come from the CPU emulator
(tests/gpu_emulator.py) against numpy.
"""

from __future__ import annotations

import os
import re
import sys

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.gpu.compiler import lower_to_ptx
from flowjit.backends.gpu.pipeline import GpuOptions

sys.path.insert(0, os.path.dirname(__file__))
import gpu_emulator  # noqa: E402
from test_gpu_codegen import assemble_all, needs_ptxas  # noqa: E402

_ACCESS = re.compile(r"^\s*((?:ld|st)\.global(?:\.v\d)?\.\w+)", re.MULTILINE)


def chain(x, y):
    return fnp.tanh(x * y + 1.0) * fnp.exp(-x) + fnp.log(y * y + 1.0)


def compiled(fn, *args, chip="sm_80"):
    return lower_to_ptx(fj.jit(fn).lower(*args).graph("optimized"), GpuOptions(chip=chip))


def accesses(module) -> list[str]:
    """The global loads and stores of every kernel, in order (`ld.global.v4.b32`, ...)."""
    return [a for k in module.kernels for a in _ACCESS.findall(k.ptx)]


def threads(module) -> int:
    """Threads launched in all."""
    return sum(int(np.prod(launch.grid)) * int(np.prod(launch.block)) for launch, _ in module.plan.launches())


def emulated(fn, *args):
    """`fn`'s GPU plan replayed on the CPU emulator, and what numpy computes; its kernels are
    vectorized."""
    module = compiled(fn, *args)
    assert "vector.load" in module.gpu_mlir and "vector.store" in module.gpu_mlir
    kernels = gpu_emulator.EmulatedKernels(module.gpu_mlir)
    want = fn(*args)
    return gpu_emulator.run(module.plan, kernels, list(args), [(want.shape, want.dtype)])[0], want


_X = np.linspace(-2, 2, 64 * 1024, dtype=np.float32).reshape(64, 1024)


@needs_ptxas
@pytest.mark.parametrize("chip", ["sm_80", "sm_90"])
def test_an_elementwise_chain_loads_and_stores_16_bytes_per_thread(chip):
    module = compiled(chain, _X, _X + 3.0, chip=chip)
    assert accesses(module) == ["ld.global.v4.b32", "ld.global.v4.b32", "st.global.v4.b32"]
    assert [launch.grid for launch, _ in module.plan.launches()] == [(64, 1, 1)]  # scalar: (64, 4, 1)
    assert threads(module) == 64 * 1024 // 4
    assemble_all(module.kernels, chip)


def test_an_odd_contiguous_extent_keeps_scalar_accesses():
    x = _X[:, :1023].copy()
    assert accesses(compiled(chain, x, x)) == ["ld.global.b32", "ld.global.b32", "st.global.b32"]
    assert accesses(compiled(chain, _X, _X))[0] == "ld.global.v4.b32"  # the same program, 1024 wide


def test_a_view_off_the_16_byte_grid_keeps_scalar_accesses():
    """x[1:] starts 4 bytes into x's buffer: no thread's 4 elements would start 16-byte aligned;
    x[4:] starts 16 bytes in, and does vectorize."""
    x = np.linspace(0, 1, 4100, dtype=np.float32)
    assert accesses(compiled(lambda x: fnp.exp(x[1:4097]) * 2.0, x)) == ["ld.global.b32", "st.global.b32"]
    assert accesses(compiled(lambda x: fnp.exp(x[4:4100]) * 2.0, x)) == ["ld.global.v4.b32", "st.global.v4.b32"]


def bias_and_scale(x, column, row):
    return x * column + row


def test_an_operand_broadcast_along_the_contiguous_dimension_is_read_as_one_element():
    column, row = np.linspace(1, 2, 64, dtype=np.float32).reshape(64, 1), np.linspace(-1, 1, 1024, dtype=np.float32)
    module = compiled(bias_and_scale, _X, column, row)
    assert accesses(module) == ["ld.global.v4.b32", "ld.global.b32", "ld.global.v4.b32", "st.global.v4.b32"]


@pytest.mark.parametrize(
    "dtype, loads, grid",
    [
        (np.float16, "ld.global.v4.b32", (64, 1, 1)),  # 8 elements a thread: 128 threads a row
        (ml_dtypes.bfloat16, "ld.global.v4.b32", (64, 1, 1)),
        (np.float64, "ld.global.v2.b64", (64, 2, 1)),  # 2 elements a thread: 512 threads a row
    ],
)
def test_the_width_is_16_bytes_of_the_element_type(dtype, loads, grid):
    x = _X.astype(dtype)
    module = compiled(lambda x, y: x * y + x, x, x)
    assert accesses(module) == [loads, loads, loads.replace("ld", "st")]
    assert [launch.grid for launch, _ in module.plan.launches()] == [grid]


@pytest.mark.parametrize(
    "fn, args",
    [
        (chain, (_X, _X + 3.0)),
        (bias_and_scale, (_X, np.linspace(1, 2, 64, dtype=np.float32).reshape(64, 1), _X[0] * 0.5)),
        (lambda x: fnp.exp(x[4:4100]) * 2.0, (np.linspace(0, 1, 4100, dtype=np.float32),)),
        (lambda x, y: x * y - x, (_X.astype(np.float16), (_X * 0.5).astype(np.float16))),
        (lambda x, y: x / y + x, (_X.astype(np.float64), _X.astype(np.float64) + 3.0)),
    ],
    ids=["chain", "broadcasts", "aligned view", "float16", "float64"],
)
def test_vectorized_kernels_compute_the_programs(fn, args):
    got, want = emulated(fn, *args)
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=2e-3, atol=1e-5)


def test_a_gradient_through_the_chain_runs_vectorized_kernels_and_computes_the_cpus_values():
    def loss(x, y):
        return fnp.sum(chain(x, y) * x)

    x, y = _X, _X[::-1] + 0.5
    gradient = fj.grad(loss, argnums=(0, 1))
    module = compiled(gradient, x, y)
    launches = module.plan.launch_count()
    assert module.gpu_mlir.count("gpu.func") == launches and module.gpu_mlir.count("vector.store") == launches
    kernels = gpu_emulator.EmulatedKernels(module.gpu_mlir)
    want = fj.jit(gradient)(x, y)
    got = gpu_emulator.run(module.plan, kernels, [x, y], [(w.shape, w.dtype) for w in want])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
