"""Non-temporal stores into large outputs a function only writes (`backends/cpu/nontemporal.py`):
which stores get them, the fences that close them, and exact results whichever branch a store
takes (a 64-byte aligned line or not)."""

import platform
import re

import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.backends.cpu import nontemporal
from flowjit.backends.cpu.host import vector_bits
from flowjit.backends.cpu.nontemporal import NONTEMPORAL_MIN_BYTES

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or vector_bits() != 512,
    reason="streaming whole-line stores are made from 64-byte vectors (x86-64 with AVX-512)",
)

COLS = 1024
ROWS = NONTEMPORAL_MIN_BYTES // (4 * COLS)  # float32 rows: an output of exactly the threshold


def _layer_norm(x, g, b):
    return nn.layer_norm(x, g, b, eps=1e-5)


def _inputs(rows=ROWS, cols=COLS):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    return x, rng.uniform(0.5, 1.5, cols).astype(np.float32), rng.uniform(-0.5, 0.5, cols).astype(np.float32)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _without_streaming(monkeypatch, fn, *args):
    """`fn(*args)` compiled with ordinary stores only."""
    with monkeypatch.context() as m:
        m.setattr(nontemporal, "NONTEMPORAL_MIN_BYTES", 1 << 62)
        f = fj.jit(fn)
        assert "!nontemporal" not in f.lower(*args).as_text("llvm")
        return f(*args)


def test_a_large_write_only_output_is_streamed_exactly(monkeypatch, compiled_rows):
    args = _inputs()
    f = fj.jit(_layer_norm)
    lowered = f.lower(*args)
    assert re.search(r"\{fj\.stream\}", lowered.as_text("mlir"))
    llvm = lowered.as_text("llvm")
    assert re.search(r"; non-temporal stores \(nontemporal.py\): @\w+ argument 3: 1 store\n", llvm)
    assert re.search(r"store <16 x float> .*, align 64, !nontemporal", llvm)
    assert "call void @llvm.x86.sse.sfence()" in llvm
    assert "vmovntps" in lowered.as_text("asm")
    y = f(*args)
    assert _address(y) % 64 == 0  # the executable allocates such outputs on a line
    np.testing.assert_array_equal(y, _without_streaming(monkeypatch, _layer_norm, *args))


def test_unaligned_outputs_and_rows_store_ordinarily_and_exactly(monkeypatch):
    x, g, b = _inputs()
    # A donated buffer 16 bytes past a line: every store takes the ordinary branch.
    block = np.empty(x.nbytes + 64, np.uint8)
    start = -_address(block) % 64 + 16
    donated = block[start : start + x.nbytes].view(np.float32).reshape(x.shape)
    donated[...] = x
    expected = _without_streaming(monkeypatch, _layer_norm, x, g, b)
    y = fj.jit(_layer_norm, donate_argnums=0)(donated, g, b)
    assert _address(y) == _address(donated)
    np.testing.assert_array_equal(y, expected)
    # Rows of 1000 floats: a row starts on a line only every 16 rows; the rest and the row tails store
    # ordinarily.
    args = _inputs(rows=ROWS + 7, cols=1000)
    np.testing.assert_array_equal(fj.jit(_layer_norm)(*args), _without_streaming(monkeypatch, _layer_norm, *args))


def test_parallel_tiles_fence_their_stores_before_the_barrier(compiled_rows):
    text = fj.jit(_layer_norm).lower(*_inputs()).as_text("mlir-llvm")
    assert "omp.parallel" in text
    lines = text.splitlines()
    yields = [i for i, line in enumerate(lines) if line.strip() == "omp.yield"]
    assert yields and all("llvm.x86.sse.sfence" in lines[i - 1] for i in yields)


@pytest.mark.parametrize(
    "name, fn, elements",
    [
        ("read back (softmax divides its output in place)", lambda x: nn.softmax(x, axis=-1), ROWS * COLS),
        ("too much arithmetic per line (exp)", fnp.exp, ROWS * COLS),
        ("below the threshold", lambda x: x * 0.7 + 0.1, ROWS * COLS // 2),
    ],
)
def test_other_outputs_keep_ordinary_stores(name, fn, elements):
    x = np.linspace(-3, 3, elements, dtype=np.float32).reshape(-1, COLS)
    assert "!nontemporal" not in fj.jit(fn).lower(x).as_text("llvm"), name


def test_a_cheap_elementwise_kernel_streams():
    x = np.linspace(-3, 3, ROWS * COLS, dtype=np.float32)
    f = fj.jit(lambda x: x * 0.7 + 0.1)
    assert "!nontemporal" in f.lower(x).as_text("llvm")
    np.testing.assert_allclose(f(x), x * np.float32(0.7) + np.float32(0.1), rtol=1e-6)


def test_functions_writing_more_than_they_read_keep_ordinary_stores():
    row = np.linspace(-1, 1, COLS, dtype=np.float32)
    assert "!nontemporal" not in fj.jit(lambda v: fnp.broadcast_to(v, (ROWS, COLS)) * 1.5).lower(row).as_text("llvm")
    half = np.linspace(-3, 3, ROWS * COLS, dtype=np.float16)  # 4 MiB in, 8 MiB out
    assert "!nontemporal" not in fj.jit(lambda h: h.astype(np.float32)).lower(half).as_text("llvm")


def test_only_streamed_outputs_are_allocated_on_a_line():
    # Outputs with streaming stores are placed on a line: off a line, softmax's and layer norm's run slower.
    from flowjit.backends.cpu import executable

    shape, f32 = (ROWS, COLS), np.dtype(np.float32)
    plain, streamed = executable._allocators([shape, shape], [f32, f32], streamed=(1,))
    assert plain is None and _address(streamed()) % 64 == 0


def test_a_cache_hit_keeps_the_streamed_outputs(tmp_path, monkeypatch, compiled_rows):
    from flowjit.backends import compile_graph
    from flowjit.backends.cpu import cache

    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWJIT_CACHE", "1")
    args = _inputs()
    graph = fj.jit(_layer_norm).lower(*args).graph()
    first = compile_graph(graph, "cpu")
    second = compile_graph(graph, "cpu")  # loaded from the entry the first one wrote
    assert first.stages.parts and not second.stages.parts
    (entry,) = [cache.decode(p.read_bytes()) for p in tmp_path.iterdir() if p.suffix == ".fjo"]
    assert entry.streamed_outputs == (0,)
    y = second.run(list(args))[0]
    assert _address(y) % 64 == 0
    np.testing.assert_array_equal(y, first.run(list(args))[0])
