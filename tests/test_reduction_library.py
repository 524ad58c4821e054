"""The JIT's reduction library (flowjit/backends/cpu/reduction_library.py): a sum, max or min of a
whole float32/float64 array calls a precompiled function; its results equal the compiled kernel's
bit for bit, and other reductions keep their kernel."""

from __future__ import annotations

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit import aot
from flowjit.backends.cpu import reduction_library, schedule

CALL = "calls the reduction library's @fj_reduce_"
REDUCTIONS = {"sum": fnp.sum, "max": fnp.max, "min": fnp.min}


def _both(fn, x, monkeypatch):
    """(library result, kernel result, library's MLIR)"""
    results, texts = [], []
    for switch in ("1", "0"):
        monkeypatch.setenv("FLOWJIT_REDUCTION_LIBRARY", switch)
        f = fj.jit(fn)
        texts.append(f.lower(x).as_text("mlir"))
        results.append(np.asarray(f(x)))
    assert CALL not in texts[1]
    return results[0], results[1], texts[0]


LENGTHS = [
    # one partial chunk; whole chunks and a partial one; the parallel threshold and past it (64 pieces
    # of 4 vectors, the last pieces shorter); a length no piece divides
    1,
    63,
    1000,
    schedule.PARALLEL_MIN_ELEMENTS - 1,
    schedule.PARALLEL_MIN_ELEMENTS,
    1_000_003,
    (1 << 22) + 17,
]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", list(REDUCTIONS))
def test_library_results_equal_the_kernels(kind, dtype, n, monkeypatch):
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    lib, kernel, text = _both(REDUCTIONS[kind], x, monkeypatch)
    elem = "f32" if dtype == np.float32 else "f64"
    assert f"{CALL}{kind}_{elem}" in text
    assert lib.tobytes() == kernel.tobytes()


def test_a_streamed_array_sums_as_the_kernel(monkeypatch):
    """Arrays of `STREAMING_REDUCTION_MIN_BYTES` or more: 256 pieces of one vector accumulator."""
    n = schedule.STREAMING_REDUCTION_MIN_BYTES // 8 + 5
    call = reduction_library.ReductionCall("sum", "f64", n)
    if schedule.threads() > 1:
        assert call.plan() == (256, 1, schedule.threads())
    x = np.random.default_rng(0).standard_normal(n)
    lib, kernel, text = _both(fnp.sum, x, monkeypatch)
    assert CALL in text and lib.tobytes() == kernel.tobytes()


@pytest.mark.parametrize("kind", list(REDUCTIONS))
def test_special_values_and_shapes(kind, monkeypatch):
    """Any rank (every axis reduced), nan anywhere gives nan, infinities, as the kernel."""
    rng = np.random.default_rng(3)
    for x in (
        rng.standard_normal((512, 700)).astype(np.float32),
        rng.standard_normal((3, 4, 5)),
        np.array([1.0, np.nan, 3.0], np.float32),
        np.concatenate([rng.standard_normal(300000), [np.inf, -np.inf]]).astype(np.float32),
        np.full(1000, -np.inf, np.float32),
    ):
        lib, kernel, text = _both(REDUCTIONS[kind], x, monkeypatch)
        assert CALL in text
        np.testing.assert_array_equal(lib, kernel)


OTHER_REDUCTIONS = {
    # some axes only; integers; half precision (accumulated in float32); a product; more work fused
    "one axis": (lambda x: fnp.sum(x, axis=0), np.float32),
    "int32": (fnp.sum, np.int32),
    "f16": (fnp.sum, np.float16),
    "prod": (fnp.prod, np.float32),
    "fused": (lambda x: fnp.sum(x * x), np.float32),
}


@pytest.mark.parametrize("case", list(OTHER_REDUCTIONS))
def test_other_reductions_keep_their_kernel(case, monkeypatch):
    fn, dtype = OTHER_REDUCTIONS[case]
    x = (np.random.default_rng(4).standard_normal((300, 400)) * 3).astype(dtype)
    lib, kernel, text = _both(fn, x, monkeypatch)
    assert CALL not in text
    np.testing.assert_array_equal(lib, kernel)


def test_aot_libraries_keep_their_own_kernels():
    x = np.ones(1 << 20, np.float32)
    graph = fj.jit(lambda x: fnp.sum(x)).lower(x).graph()
    _, mlir, externals = aot.kernel_object(graph, "total", "openmp")
    assert "fj_reduce" not in mlir.text
    assert not [name for name in externals if name.startswith("fj_reduce")]


def test_library_module_compiles_for_a_256_bit_host(monkeypatch):
    """An AVX2 host's geometry (8 float32 lanes): the module is written, lowered and compiled (it
    runs here as well, being plain AVX2 code), and its sums are numpy's to rounding, in one pass and
    in pieces over the cores."""
    import ctypes

    from flowjit.backends.cpu import host, toolchain

    monkeypatch.setattr(host, "vector_bits", lambda: 256)
    reduction_library.library_mlir.cache_clear()
    try:
        native = toolchain.load_objects((reduction_library.LIBRARY.build(),), "fj_reduction_library_avx2")
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        total = ctypes.CFUNCTYPE(None, pointer, pointer, size, size, size, size)(native.address("fj_reduce_sum_f32"))
        x = np.random.default_rng(5).standard_normal(100_003).astype(np.float32)
        for pieces, vectors, threads in [(0, 4, 1), (64, 4, 2), (256, 1, 2)]:
            out = np.zeros(1, np.float32)
            total(x.ctypes.data, out.ctypes.data, x.size, pieces, vectors, threads)
            np.testing.assert_allclose(out[0], x.sum(dtype=np.float64), rtol=1e-5)
    finally:
        reduction_library.library_mlir.cache_clear()
