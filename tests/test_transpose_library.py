"""The JIT's transpose library (flowjit/backends/cpu/transpose_library.py): products with fewer
columns than a vector (dot blocks) get B^T from a precompiled function instead of gathers compiled
into the program; the results are the same bits, and nothing outside either matrix is touched."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit import aot
from flowjit.backends.cpu import cache, host, toolchain, transpose_library

CALL = "calls the transpose library's @fj_transpose_narrow_"


def _both(fn, args, monkeypatch):
    """(library result, gathers' result, library's MLIR)"""
    results, texts = [], []
    for switch in ("1", "0"):
        monkeypatch.setenv("FLOWJIT_TRANSPOSE_LIBRARY", switch)
        f = fj.jit(fn)
        texts.append(f.lower(*args).as_text("mlir"))
        results.append(np.asarray(f(*args)))
    assert CALL not in texts[1] and "vector.gather" in texts[1]
    return results[0], results[1], texts[0]


@pytest.mark.parametrize(
    "m, k, n, dtype",
    [
        (64, 6272, 10, np.float32),  # the CNN's dense layer: B^T's blocks over the cores
        (13, 100, 8, np.float32),  # a partial last block of rows (100 = 6 x 16 + 4), one core
        (37, 64, 15, np.float32),
        (9, 33, 5, np.float64),
        (40, 4001, 12, np.float32),
        (20, 3001, 7, np.float64),
    ],
)
def test_dot_blocks_take_b_transposed_from_the_library(m, k, n, dtype, monkeypatch):
    if host.vector_bits() != 512:
        pytest.skip("the shapes are chosen for AVX-512's lanes")
    rng = np.random.default_rng(k)
    a, b, c = (rng.standard_normal(s).astype(dtype) for s in ((m, k), (k, n), (n,)))
    lib, gathered, text = _both(lambda a, b, c: fnp.maximum(a @ b + c, 0), (a, b, c), monkeypatch)
    elem = "f32" if dtype == np.float32 else "f64"
    assert f"{CALL}{elem}" in text and "dots along K (few columns)" in text
    assert lib.tobytes() == gathered.tobytes()


def test_b_given_as_rows_needs_no_transpose(monkeypatch):
    a, w = np.ones((32, 640), np.float32), np.ones((10, 640), np.float32)
    monkeypatch.setenv("FLOWJIT_TRANSPOSE_LIBRARY", "1")
    text = fj.jit(lambda a, w: a @ w.T).lower(a, w).as_text("mlir")
    assert "dots along K" in text and CALL not in text


def _library_function(elem: str, native=None):
    if native is None:
        transpose_library.LIBRARY.load()
        native = transpose_library.LIBRARY.loaded[0]
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return ctypes.CFUNCTYPE(None, pointer, pointer, size, size, size)(native.address(transpose_library.symbol(elem)))


def _check_transposes(fn, dtype, lanes):
    """Every width up to a vector, lengths around the vector, one core and several: out == b.T
    exactly, and the elements around the output untouched."""
    rng = np.random.default_rng(7)
    for n in range(1, lanes + 1):
        for k in (1, lanes - 1, lanes, 3 * lanes + 5, 1000):
            for threads in (1, 2, 3):
                b = rng.standard_normal((k, n)).astype(dtype)
                guard = lanes * 2
                out = np.full(n * k + 2 * guard, 7.0, dtype)
                fn(b.ctypes.data, out[guard:].ctypes.data, k, n, threads)
                assert np.array_equal(out[guard : guard + n * k].reshape(n, k), b.T), (n, k, threads)
                assert (out[:guard] == 7).all() and (out[guard + n * k :] == 7).all(), (n, k, threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_library_transposes_every_width_and_length(dtype):
    elem = "f32" if dtype == np.float32 else "f64"
    lanes = host.vector_bits() // (32 if dtype == np.float32 else 64)
    _check_transposes(_library_function(elem), dtype, lanes)


def test_library_module_compiles_for_a_256_bit_host(monkeypatch):
    """An AVX2 host's geometry (8 float32 lanes): the module is written, compiled and (plain AVX2
    code) runs here too."""
    monkeypatch.setattr(host, "vector_bits", lambda: 256)
    native = toolchain.load_objects((transpose_library.LIBRARY.build(),), "fj_transpose_library_avx2")
    _check_transposes(_library_function("f32", native), np.float32, 8)


def test_aot_libraries_keep_the_gathers():
    a, b = np.ones((64, 6272), np.float32), np.ones((6272, 10), np.float32)
    graph = fj.jit(lambda a, b: a @ b).lower(a, b).graph()
    _, mlir, externals = aot.kernel_object(graph, "dense", "openmp")
    assert "fj_transpose" not in mlir.text
    assert not [name for name in externals if name.startswith("fj_transpose")]


def test_the_compile_cache_keys_on_the_library_switches(monkeypatch):
    """A program compiled with a library off is not served the cached one that calls it."""
    monkeypatch.setenv("FLOWJIT_TRANSPOSE_LIBRARY", "1")
    on = cache.cache_key("graph", None)
    monkeypatch.setenv("FLOWJIT_TRANSPOSE_LIBRARY", "0")
    assert cache.cache_key("graph", None) != on
    monkeypatch.setenv("FLOWJIT_TRANSPOSE_LIBRARY", "1")
    assert cache.cache_key("graph", None) == on
