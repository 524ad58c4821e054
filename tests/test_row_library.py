"""The JIT's row library (flowjit/backends/cpu/row_library.py): a fused region that is exactly
softmax, log-softmax or layer norm over rows calls a precompiled function; its results equal the
compiled row kernel's bit for bit, and regions of any other form keep their kernel."""

from __future__ import annotations

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit import aot, nn
from flowjit.backends.cpu import libraries, row_library

CALL = "calls the row library's @fj_"


def _run(fn, args, use_library: bool, monkeypatch, **jit_kwargs):
    monkeypatch.setenv("FLOWJIT_ROW_LIBRARY", "1" if use_library else "0")
    f = fj.jit(fn, **jit_kwargs)
    text = f.lower(*args).as_text("mlir")
    return np.asarray(f(*args)), text


def _both(fn, args, monkeypatch, **jit_kwargs):
    """(library result, kernel result, library's MLIR)"""
    lib, text = _run(fn, args, True, monkeypatch, **jit_kwargs)
    kernel, kernel_text = _run(fn, args, False, monkeypatch, **jit_kwargs)
    assert CALL not in kernel_text
    return lib, kernel, text


def _softmax_divided(x):
    e = fnp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _layer_norm_divided(x):  # as numpy users write it
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / fnp.sqrt(var + 1e-5)


FUNCTIONS = {
    "softmax": (lambda x: nn.softmax(x, axis=-1), 0),
    "log_softmax": (lambda x: nn.log_softmax(x, axis=-1), 0),
    "layer_norm": (lambda x: nn.layer_norm(x, eps=1e-5), 0),
    "layer_norm_affine": (lambda x, g, b: nn.layer_norm(x, g, b, eps=1e-5), 2),
    "softmax_divided": (_softmax_divided, 0),
    "layer_norm_divided": (_layer_norm_divided, 0),
    "layer_norm_divided_affine": (lambda x, g, b: _layer_norm_divided(x) * g + b, 2),
    "rms_norm": (lambda x: nn.rms_norm(x, eps=1e-6), 0),
    "rms_norm_scaled": (lambda x, g: nn.rms_norm(x, g, eps=1e-6), 1),
}
SHAPES = [
    # whole chunks of 64 floats, split over the cores (4096 x 1024) or not; a partial last chunk
    # (1000, 1040: 16 over), rows longer than four chunks and not a multiple (4000), 3-d, f64
    ((4096, 1024), np.float32),
    ((7, 512), np.float32),
    ((33, 1000), np.float32),
    ((300, 1040), np.float32),
    ((2, 4000), np.float32),
    ((3, 5, 640), np.float32),
    ((40, 256), np.float64),
    ((9, 1000), np.float64),
    # short rows in small inputs (`SMALL_INPUT_BYTES`)
    ((128, 128), np.float32),
    ((3, 64), np.float32),
    ((50, 64), np.float64),
]


def _inputs(shape, dtype, extra: int, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    params = [rng.uniform(0.5, 1.5, shape[-1]).astype(dtype), rng.uniform(-0.5, 0.5, shape[-1]).astype(dtype)]
    return (x, *params[:extra])


@pytest.mark.parametrize("shape,dtype", SHAPES, ids=lambda p: str(p))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_library_results_equal_the_kernels(name, shape, dtype, monkeypatch):
    fn, extra = FUNCTIONS[name]
    args = _inputs(shape, dtype, extra)
    lib, kernel, text = _both(fn, args, monkeypatch)
    elem = "f32" if dtype == np.float32 else "f64"
    assert f"{CALL}{name}_{elem} " in text
    np.testing.assert_array_equal(lib, kernel)


def test_special_values_as_the_kernel(monkeypatch):
    """nan, infinities and rows of -inf give what the compiled kernel gives (nan where numpy has it)."""
    x = np.random.default_rng(1).standard_normal((6, 1024)).astype(np.float32)
    x[0, 5] = np.nan
    x[1, 700] = np.inf
    x[2] = -np.inf
    x[3, 1000:] = -np.inf
    x[4, 3] = 1e30
    for name in ("softmax", "log_softmax", "layer_norm", "rms_norm", "softmax_divided"):
        fn, _ = FUNCTIONS[name]
        lib, kernel, text = _both(fn, (x,), monkeypatch)
        assert CALL in text
        np.testing.assert_array_equal(lib, kernel)
    assert np.isnan(lib[0]).all() and np.isnan(lib[2]).all()


@pytest.mark.parametrize("eps", [1e-3, 0.25, 1e-12])
def test_layer_norm_eps_is_passed(eps, monkeypatch):
    x, g, b = _inputs((64, 768), np.float32, 2)
    lib, kernel, text = _both(lambda x, g, b: nn.layer_norm(x, g, b, eps=eps), (x, g, b), monkeypatch)
    assert CALL in text
    np.testing.assert_array_equal(lib, kernel)


def test_hand_written_softmax_of_the_same_graph_calls_it(monkeypatch):
    """The match is on the graph, not on the name: the same ops written out call the library."""

    def softmax(x):
        e = fnp.exp(x - fj.stop_gradient(fnp.max(x, axis=-1, keepdims=True)))
        return e * fnp.reciprocal(fnp.sum(e, axis=-1, keepdims=True))

    x = _inputs((128, 1024), np.float32, 0)[0]
    lib, kernel, text = _both(softmax, (x,), monkeypatch)
    assert f"{CALL}softmax_f32" in text
    np.testing.assert_array_equal(lib, kernel)


REGIONS_OF_OTHER_FORMS = {
    # over another axis; rows too short or too long; exp without the max subtracted;
    # fused with more work; gamma without beta; other element types
    "axis 0": (lambda x: nn.softmax(x, axis=0), (256, 1024), np.float32, 0),
    "short rows": (lambda x: nn.softmax(x, axis=-1), (256, 256), np.float32, 0),
    "short rows summed otherwise": (lambda x: nn.softmax(x, axis=-1), (16, 100), np.float32, 0),
    "shorter than the sums": (lambda x: nn.softmax(x, axis=-1), (16, 32), np.float32, 0),
    "long rows": (lambda x: nn.log_softmax(x, axis=-1), (8, 32768), np.float32, 0),
    "unshifted": (lambda x: fnp.exp(x) / fnp.sum(fnp.exp(x), axis=-1, keepdims=True), (64, 1024), np.float32, 0),
    "more work": (lambda x: nn.softmax(x, axis=-1) * 2.0 + 1.0, (64, 1024), np.float32, 0),
    "gamma only": (lambda x, g: nn.layer_norm(x, g, eps=1e-5), (64, 1024), np.float32, 1),
    "f16": (lambda x: nn.softmax(x, axis=-1), (64, 1024), np.float16, 0),
}


@pytest.mark.parametrize("case", list(REGIONS_OF_OTHER_FORMS))
def test_regions_of_other_forms_keep_their_kernel(case, monkeypatch):
    fn, shape, dtype, extra = REGIONS_OF_OTHER_FORMS[case]
    args = _inputs(shape, dtype, extra)
    lib, kernel, text = _both(fn, args, monkeypatch)
    assert CALL not in text
    np.testing.assert_array_equal(lib, kernel)


def test_gradients_and_training_steps_are_unchanged(monkeypatch):
    x, g, b = _inputs((32, 1024), np.float32, 2)
    grad = fj.grad(lambda x, g, b: fnp.sum(nn.layer_norm(x, g, b) * nn.softmax(x)), argnums=(0, 1, 2))
    lib, kernel, _ = _both(lambda x, g, b: grad(x, g, b)[0], (x, g, b), monkeypatch)
    np.testing.assert_array_equal(lib, kernel)


def test_donated_input_is_written_in_place(monkeypatch):
    """The result may reuse x's buffer: the library reads each element before writing it."""
    x = _inputs((256, 1024), np.float32, 0)[0]
    expected, _ = _run(FUNCTIONS["log_softmax"][0], (x,), False, monkeypatch)
    lib, text = _run(FUNCTIONS["log_softmax"][0], (x.copy(),), True, monkeypatch, donate_argnums=0)
    assert CALL in text
    np.testing.assert_array_equal(lib, expected)


def test_aot_libraries_keep_their_own_kernels():
    x = np.ones((64, 1024), np.float32)
    graph = fj.jit(lambda x: nn.softmax(x)).lower(x).graph()
    _, mlir, externals = aot.kernel_object(graph, "softmax", "openmp")
    assert "fj_softmax" not in mlir.text
    assert not [name for name in externals if name.startswith("fj_softmax")]


def test_library_is_loaded_only_by_code_calling_it(monkeypatch):
    loads = []
    for each in libraries.libraries():
        monkeypatch.setattr(each, "loaded", [])
        monkeypatch.setattr(each, "load", lambda name=each.name: loads.append(name))
    libraries.resolve(["fj_matmul_f32", "memcpy"])
    assert loads == ["matmul"]
    libraries.resolve(["fj_layer_norm_affine_f64", "fj_reduce_max_f32"])
    assert loads == ["matmul", "row", "reduction"]


def test_library_module_compiles_for_a_256_bit_host(monkeypatch):
    """An AVX2 host's geometry (8 float32 lanes, chunks of 32): the module is written, lowered and
    compiled (it runs here as well, being plain AVX2 code), and its results are numpy's."""
    from flowjit.backends.cpu import host, toolchain

    monkeypatch.setattr(host, "vector_bits", lambda: 256)
    row_library.library_mlir.cache_clear()
    try:
        native = toolchain.load_objects((row_library.LIBRARY.build(),), "fj_row_library_avx2")
        import ctypes

        x = _inputs((5, 100), np.float32, 0)[0]
        y = np.empty_like(x)
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        softmax = ctypes.CFUNCTYPE(None, pointer, pointer, size, size, size)(native.address("fj_softmax_f32"))
        softmax(x.ctypes.data, y.ctypes.data, 5, 100, 1)
        e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
        np.testing.assert_allclose(y, e / e.sum(axis=-1, keepdims=True), rtol=1e-6)
    finally:
        row_library.library_mlir.cache_clear()


def test_reference_traces_are_not_the_users(monkeypatch, tmp_path, capsys):
    """Matching traces `flowjit.nn`'s function for the region's types: that trace is the compiler's
    own, so it neither prints a FLOWJIT_LOG_COMPILES line nor writes dumps."""
    monkeypatch.setenv("FLOWJIT_LOG_COMPILES", "1")
    monkeypatch.setenv("FLOWJIT_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    x = _inputs((48, 1536), np.float32, 0)[0]  # types no other test traced a reference for

    def user_softmax(x):
        return nn.softmax(x, axis=-1)

    assert CALL in fj.jit(user_softmax).lower(x).as_text("mlir")
    logged = capsys.readouterr().err
    assert "tracing user_softmax" in logged and "_softmax" not in logged.replace("user_softmax", "")
    assert all("-user_softmax-" in path.name for path in tmp_path.iterdir())
