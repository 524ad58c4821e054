"""The JIT's matmul library (flowjit/backends/cpu/matmul_library.py): large plain products call a
precompiled shape-generic kernel; its results equal the specialized kernel's bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit import aot
from flowjit.backends.cpu import host, matmul_library, matmul_plan

needs_cores = pytest.mark.skipif(host.cores() < 2, reason="the library takes products split over two or more cores")


def _product(a, b, library: bool, monkeypatch, fn=lambda a, b: a @ b):
    monkeypatch.setenv("FLOWJIT_MATMUL_LIBRARY", "1" if library else "0")
    f = fj.jit(fn)
    text = f.lower(a, b).as_text("mlir")
    return np.asarray(f(a, b)), text


SHAPES = [
    # (m, k, n, dtype): rows left over from the 14-row tiles (0, 1, 13: tiles of 8, 4, 2, 1 rows),
    # partial panels of less than a vector, of exactly one (n % 32 = 16) and of more (the second
    # masked), f32 rows 4 KiB long (A restrided), narrow products (split by rows), a short
    # contraction (K < 64, small), f64
    (14 * 30, 128, 256, np.float32),
    (14 * 30 + 1, 100, 300, np.float32),
    (14 * 20 + 13, 96, 784, np.float32),
    (200, 1024, 160, np.float32),
    (256, 1024, 20, np.float32),
    (300, 10, 1000, np.float32),
    (150, 512, 230, np.float64),
    (97, 333, 161, np.float64),
]
LAYOUTS = {"nn": lambda a, b: a @ b, "bt": lambda a, b: a @ b.T, "at": lambda a, b: a.T @ b}


@needs_cores
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m, k, n, dtype", SHAPES, ids=[f"{m}x{k}x{n}-{np.dtype(d).name}" for m, k, n, d in SHAPES])
def test_library_products_equal_the_specialized_kernel(m, k, n, dtype, layout, monkeypatch):
    rng = np.random.default_rng(m + n)
    a = rng.standard_normal((k, m) if layout == "at" else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if layout == "bt" else (k, n)).astype(dtype)
    fn = LAYOUTS[layout]
    got, text = _product(a, b, True, monkeypatch, fn)
    assert "func.call @fj_matmul_" in text
    want, plain = _product(a, b, False, monkeypatch, fn)
    assert "fj_matmul_" not in plain
    np.testing.assert_array_equal(got, want)  # the same multiply-adds in the same order
    reference = fn(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got, reference, rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-3)


@needs_cores
def test_fused_epilogues_after_a_library_product(monkeypatch):
    """Fusions whose product calls the library: the epilogue reads the product from the scratch
    area and writes the result (a mask of the product's shape, an SGD update, a small product's
    bias), with the same bits as the specialized kernel's."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 300)).astype(np.float32)
    w = rng.standard_normal((512, 300)).astype(np.float32)
    h = rng.standard_normal((256, 512)).astype(np.float32)
    v = rng.standard_normal((300, 512)).astype(np.float32)
    c = rng.standard_normal((20,)).astype(np.float32)
    u = rng.standard_normal((512, 20)).astype(np.float32)

    def fn(x, w, h, v):
        masked = (x @ w.T) * (h > 0)  # reads a tensor of the product's shape
        updated = v - 0.01 * (x.T @ masked)  # an SGD step on a weight gradient
        logits = masked @ u + c  # small: a bias the kernel would add tile by tile
        return masked, updated, logits

    results = {}
    for library in (True, False):
        monkeypatch.setenv("FLOWJIT_MATMUL_LIBRARY", "1" if library else "0")
        f = fj.jit(fn)
        text = f.lower(x, w, h, v).as_text("mlir")
        assert (text.count("the product is a matmul library call") == 3) == library, text.count("library call")
        results[library] = [np.asarray(r) for r in f(x, w, h, v)]
    for got, want in zip(results[True], results[False]):
        np.testing.assert_array_equal(got, want)
    masked = (x.astype(np.float64) @ w.T) * (h > 0)
    np.testing.assert_allclose(results[True][0], masked, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(results[True][1], v - 0.01 * (x.T.astype(np.float64) @ masked), rtol=1e-4, atol=1e-3)


@needs_cores
def test_operands_from_kernels_constants_and_leading_dims(monkeypatch):
    """Operands that are other kernels' results (workspace slots), a large closed-over constant, an
    lhs with two free dims (M = 4 x 64), and a result read by later kernels."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64, 256)).astype(np.float32)
    w = rng.standard_normal((256, 384)).astype(np.float32)
    c = rng.standard_normal((384, 200)).astype(np.float32)

    def fn(x, w):
        h = (x * 2.0) @ (w - 1.0)
        return fnp.sum(h @ c, axis=1), h

    results = {}
    for library in (True, False):
        monkeypatch.setenv("FLOWJIT_MATMUL_LIBRARY", "1" if library else "0")
        f = fj.jit(fn)
        text = f.lower(x, w).as_text("mlir")
        assert (text.count("func.call @fj_matmul_f32(") == 2) == library
        results[library] = [np.asarray(r) for r in f(x, w)]
    for got, want in zip(results[True], results[False]):
        np.testing.assert_array_equal(got, want)
    h = (x * 2.0).astype(np.float64) @ (w - 1.0).astype(np.float64)
    np.testing.assert_allclose(results[True][1], h, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_small_products_call_the_library_on_one_core(layout, monkeypatch):
    """Products of one core's work (the specialized kernel would not fork: `call_threads`) call the
    library too, with threads = 1, which runs the body in place instead of in a parallel region;
    their bits are the kernel's. Their kernels would cost tens of milliseconds of compile each."""
    fn = LAYOUTS[layout]
    for m, k, n in ((64, 64, 64), (16, 32, 256), (32, 48, 10), (5, 7, 3)):
        assert matmul_library.call_threads(m, n, k, "f32") == 1
        rng = np.random.default_rng(m * n)
        a = rng.standard_normal((k, m) if layout == "at" else (m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if layout == "bt" else (k, n)).astype(np.float32)
        got, text = _product(a, b, True, monkeypatch, fn)
        if not matmul_plan.worth_it(0, m, n, k):  # too small for a tiled product at all
            assert "fj_matmul_" not in text
            continue
        lines = text.splitlines()
        call = next(i for i, line in enumerate(lines) if "func.call @fj_matmul_f32" in line)
        assert lines[call - 1].strip().endswith("= arith.constant 1 : index")  # threads
        want, plain = _product(a, b, False, monkeypatch, fn)
        assert "fj_matmul_" not in plain
        np.testing.assert_array_equal(got, want)


def test_products_the_library_does_not_take_keep_their_kernels(monkeypatch):
    monkeypatch.setenv("FLOWJIT_MATMUL_LIBRARY", "1")
    f32 = np.float32
    for fn, args in [
        (lambda a, b: a @ b, (np.ones((2, 1024), f32), np.ones((1024, 2048), f32))),  # streamed
        (lambda a, b: a.T @ b.T, (np.ones((256, 512), f32), np.ones((512, 256), f32))),  # both transposed
        (lambda a, b: a @ b, (np.ones((4, 256, 256), f32), np.ones((4, 256, 256), f32))),  # batched
        (lambda a, b: a @ b, (np.ones((512, 256), np.int32), np.ones((256, 512), np.int32))),  # integers
        (lambda a, b: a @ b, (np.ones((1024, 16), f32), np.ones((16, 1024), f32))),  # large, K < 64
        (lambda a, b: a @ b, (np.ones((256, 1024), f32), np.ones((1024, 10), f32))),  # few columns: dot blocks
        # large, with an epilogue fused into its tiles
        (lambda a, b: fnp.maximum(a @ b + 1.0, 0.0), (np.ones((512, 256), f32), np.ones((256, 512), f32))),
    ]:
        assert "fj_matmul_" not in fj.jit(fn).lower(*args).as_text("mlir")


@needs_cores
def test_aot_libraries_keep_their_own_kernels():
    a = np.ones((256, 256), np.float32)
    graph = fj.jit(lambda a, b: a @ b).lower(a, a).graph()
    _, mlir, externals = aot.kernel_object(graph, "product", "openmp")
    assert "fj_matmul_" not in mlir.text
    assert not [name for name in externals if name.startswith("fj_matmul_")]


def test_library_file_is_checked_and_rebuilt(tmp_path, monkeypatch):
    """The object is written with a checksum; a damaged file is rebuilt, never loaded."""
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(matmul_library.LIBRARY, "build", lambda: builds.append(1) or b"object code")
    assert matmul_library.LIBRARY.object_code() == b"object code"
    assert matmul_library.LIBRARY.object_code() == b"object code" and len(builds) == 1  # read back
    (path,) = (tmp_path / "library").iterdir()
    path.write_bytes(b"object codf" + path.read_bytes()[11:])
    assert matmul_library.LIBRARY.object_code() == b"object code" and len(builds) == 2
    path.write_bytes(b"")
    assert matmul_library.LIBRARY.object_code() == b"object code" and len(builds) == 3
    blocked = tmp_path / "a file"  # a cache folder that cannot be made: built, used, not written
    blocked.write_bytes(b"")
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(blocked))
    assert matmul_library.LIBRARY.object_code() == b"object code" and len(builds) == 4


@needs_cores
def test_a_cached_program_loads_the_library_in_a_new_process(tmp_path):
    """A second process loads the program's object from the disk cache, without lowering it: the
    library is loaded when that object is linked."""
    script = textwrap.dedent(
        """
        import sys, numpy as np, flowjit as fj
        from flowjit.backends.cpu import matmul_library
        a = np.arange(300 * 200, dtype=np.float32).reshape(300, 200) % 7
        b = np.arange(200 * 260, dtype=np.float32).reshape(200, 260) % 5
        f = fj.jit(lambda a, b: a @ b)
        if sys.argv[1] == "first":
            assert "fj_matmul_f32" in f.lower(a, b).as_text("mlir")
        np.testing.assert_array_equal(np.asarray(f(a, b)), a @ b)
        print("loaded" if matmul_library.LIBRARY.loaded else "not loaded")
        """
    )
    env = {**os.environ, "FLOWJIT_CACHE": "1", "FLOWJIT_CACHE_DIR": str(tmp_path), "FLOWJIT_MATMUL_LIBRARY": "1"}
    for which in ("first", "second"):
        run = subprocess.run(
            [sys.executable, "-c", script, which], env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "loaded"
    assert len(list(tmp_path.glob("*.fjo"))) == 1


@needs_cores
def test_threads_compiling_products_share_one_build(tmp_path):
    """Threads compiling and running products at once in a process whose cache folder has no library
    yet: one build (under the toolchain's lock), no deadlock, correct results."""
    script = textwrap.dedent(
        """
        import threading, numpy as np, flowjit as fj
        rng = np.random.default_rng(0)
        errors = []

        def work(i):
            try:
                a = rng.standard_normal((200 + 10 * i, 128 + i)).astype(np.float32)
                b = rng.standard_normal((128 + i, 256 + 7 * i)).astype(np.float32)
                f = fj.jit(lambda a, b: a @ b)
                np.testing.assert_allclose(np.asarray(f(a, b)), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
            except Exception as e:
                errors.append(repr(e))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors and not any(t.is_alive() for t in threads), errors
        """
    )
    # The cache on: the one build is seen as the one library file written (with FLOWJIT_CACHE=0
    # nothing is written into the folder).
    env = {**os.environ, "FLOWJIT_CACHE": "1", "FLOWJIT_CACHE_DIR": str(tmp_path), "FLOWJIT_MATMUL_LIBRARY": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert len(list((tmp_path / "library").glob("matmul-*.o"))) == 1


def test_library_for_256_bit_vectors_is_correct(monkeypatch):
    """The library as an AVX2 host gets it (8 f32 lanes, 6-row tiles: `host.vector_bits`
    answering 256), built and run here: every layout and element type against float64 products."""
    import ctypes
    import functools

    from flowjit.backends.cpu import toolchain

    monkeypatch.setattr(host, "vector_bits", functools.cache(lambda: 256))
    matmul_plan.tile_rows.cache_clear()
    matmul_library.library_mlir.cache_clear()
    try:
        native = toolchain.load_objects((matmul_library.LIBRARY.build(),), "fj_matmul_library_avx2")
        signature = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7))
        rng = np.random.default_rng(3)
        for layout in ("", "bt", "at"):
            for dtype, elem in ((np.float32, "f32"), (np.float64, "f64")):
                fn = signature(native.address(matmul_library.symbol(elem, layout)))
                for m, n, k in [(100, 130, 70), (13, 1000, 100), (300, 20, 1024), (29, 45, 17)]:
                    a = rng.standard_normal((m, k)).astype(dtype)
                    b = rng.standard_normal((k, n)).astype(dtype)
                    a_in = np.ascontiguousarray(a.T) if layout == "at" else a
                    b_in = np.ascontiguousarray(b.T) if layout == "bt" else b
                    c = np.full((m, n), np.nan, dtype)
                    scratch = np.zeros(matmul_library.scratch_bytes(m, n, k, elem, layout) + 64, np.uint8)
                    pointers = (a_in.ctypes.data, b_in.ctypes.data, c.ctypes.data, scratch.ctypes.data)
                    fn(*pointers, m, n, k, a_in.shape[1], b_in.shape[1], n, 2)
                    tol = 1e-4 if dtype == np.float32 else 1e-12
                    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=tol, atol=tol * 10)
    finally:
        matmul_plan.tile_rows.cache_clear()
        matmul_library.library_mlir.cache_clear()
