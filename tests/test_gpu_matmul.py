"""Matmul-shaped products as a tiled kernel through shared memory (flowjit/backends/gpu/lower_matmul.py).

Compile-only, no GPU: a (256, 512) @ (512, 384) product is one launch of 64 x 64 tiles whose PTX
loads and stores shared memory between barriers and assembles for sm_80 and sm_90 without spills;
the kernel's values come from the CPU emulator (tests/gpu_emulator.py: every thread of a block an
OS thread, barriers honoured, shared memory starting as NaN) against the reference interpreter, on
odd shapes that mask every edge (forced onto the tiled kernel: the rule alone would keep most of
them on one thread per element); a layer (product, bias, tanh: a fused region) and its gradient
(transposed products) against the CPU backend; products' and convolutions' elementwise epilogues
applied in the tiled kernel (one launch) against the interpreter and the two launches they replace;
and the rules keep the simple kernel, or two launches, where they say so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
from flowjit.backends.gpu import lower_epilogue, lower_matmul
from flowjit.backends.gpu.compiler import lower_to_ptx
from flowjit.backends.gpu.pipeline import GpuOptions
from flowjit.ir import dtypes as dt

sys.path.insert(0, os.path.dirname(__file__))
import gpu_emulator  # noqa: E402
from op_table import assert_close, tolerance  # noqa: E402
from test_gpu_codegen import PTXAS, assemble_all, needs_ptxas  # noqa: E402


def compiled(fn, *args, chip="sm_80"):
    return lower_to_ptx(fj.jit(fn).lower(*args).graph("optimized"), GpuOptions(chip=chip))


def tiled(module) -> bool:
    """Whether the module's kernels cooperate through workgroup memory and barriers."""
    return "gpu.barrier" in module.gpu_mlir and "#gpu.address_space<workgroup>" in module.gpu_mlir


def matmul(a, b):
    return a @ b


def a_transposed(a, b):
    return a.T @ b


def b_transposed(a, b):
    return a @ b.T


def both_transposed(a, b):
    return a.T @ b.T


def batched(a, b):
    return fj.numpy.matmul(a, b)


_RNG = np.random.default_rng(38)
_A, _B = (_RNG.standard_normal(s).astype(np.float32) for s in ((256, 512), (512, 384)))


@needs_ptxas
@pytest.mark.parametrize("chip", ["sm_80", "sm_90"])
def test_a_large_product_is_one_launch_of_tiles_through_shared_memory(chip):
    module = compiled(matmul, _A, _B, chip=chip)
    launches = [launch for launch, _ in module.plan.launches()]
    assert [(launch.grid, launch.block) for launch in launches] == [((384 // 64, 256 // 64, 1), (256, 1, 1))]
    (kernel,) = module.kernels
    assert "bar.sync" in kernel.ptx
    assert re.search(r"\bld\.shared\.", kernel.ptx) and re.search(r"\bst\.shared\.", kernel.ptx)
    # two tiles of 16 k-rows of 64 + 2 floats (the padding against bank conflicts)
    assert re.findall(r"\.shared \.align \d+ \.b8 \w+\[(\d+)\]", kernel.ptx) == ["4224", "4224"]
    assemble_all(module.kernels, chip)
    assert "0 bytes spill stores, 0 bytes spill loads" in _ptxas_verbose(kernel.ptx, chip)


def _ptxas_verbose(ptx: str, chip: str) -> str:
    """ptxas -v's report (registers, shared memory, spills) on `ptx` for `chip`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([PTXAS, "-v", f"-arch={chip}", path, "-o", os.devnull], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture
def always_tiled(monkeypatch):
    """Every matmul-shaped product takes the tiled kernel, however small."""
    monkeypatch.setattr(lower_matmul, "uses_tiles", lambda product: True)


def _replayed(fn, *args):
    """`fn`'s GPU plan replayed on the emulator, the reference interpreter's result, and whether
    the product was tiled."""
    module = compiled(fn, *args)
    want = np.asarray(fj.jit(fn, target="interpreter")(*args))
    kernels = gpu_emulator.EmulatedKernels(module.gpu_mlir)
    (got,) = gpu_emulator.run(module.plan, kernels, list(args), [(want.shape, want.dtype)])
    return got, want, tiled(module)


_F32 = np.float32
REPLAYS = [
    pytest.param(matmul, (33, 17), (17, 65), _F32, id="33x17@17x65"),
    pytest.param(matmul, (1, 5), (5, 1), _F32, id="1x5@5x1"),
    pytest.param(matmul, (70, 130), (130, 3), _F32, id="70x130@130x3"),
    pytest.param(matmul, (64, 32), (32, 128), _F32, id="64x32@32x128-no-masks"),
    pytest.param(batched, (2, 33, 20), (2, 20, 45), _F32, id="batched-2x33x20@2x20x45"),
    pytest.param(batched, (2, 2, 9, 20), (2, 2, 20, 7), _F32, id="batched-two-batch-dims"),
    pytest.param(a_transposed, (17, 33), (17, 65), _F32, id="a-transposed"),
    pytest.param(b_transposed, (33, 17), (65, 17), _F32, id="b-transposed"),
    pytest.param(both_transposed, (17, 33), (65, 17), _F32, id="both-transposed"),
    pytest.param(matmul, (33, 17), (17, 65), np.float16, id="float16"),
    pytest.param(matmul, (33, 17), (17, 65), ml_dtypes.bfloat16, id="bfloat16"),
]


@pytest.mark.parametrize("fn,a_shape,b_shape,dtype", REPLAYS)
def test_the_tiled_kernel_computes_the_interpreters_product(always_tiled, fn, a_shape, b_shape, dtype):
    rng = np.random.default_rng(len(a_shape) * 100 + a_shape[-1])
    a, b = (rng.standard_normal(s).astype(dtype) for s in (a_shape, b_shape))
    got, want, was_tiled = _replayed(fn, a, b)
    assert was_tiled
    assert got.shape == want.shape and got.dtype == want.dtype
    k = a_shape[-2] if fn in (a_transposed, both_transposed) else a_shape[-1]
    assert_close(got, want, tolerance(dt.dtype(np.dtype(dtype)), max(12.0, 3.0 * k)))


def test_the_rule_keeps_one_thread_per_element_for_small_or_other_products():
    """Tiles where the product fills them (M, N >= 32, K >= 16, floats, batch dims leading, one
    contracting dim); the simple kernel otherwise."""
    rng = np.random.default_rng(1)

    def args(*shapes, dtype=np.float32):
        return [rng.standard_normal(s).astype(dtype) for s in shapes]

    assert tiled(compiled(matmul, *args((32, 16), (16, 32))))
    assert tiled(compiled(batched, *args((3, 40, 16), (3, 16, 50))))
    for fn, operands in (
        (matmul, args((31, 64), (64, 64))),  # too few rows
        (matmul, args((64, 64), (64, 31))),  # too few columns
        (matmul, args((64, 15), (15, 64))),  # K shorter than a step
        (matmul, args((64, 64), (64,))),  # a matrix-vector product
        (matmul, args((64, 64), (64, 64), dtype=np.float64)),  # float64
        (lambda a, b: fj.numpy.einsum("mbk,bkn->bmn", a, b), args((40, 2, 16), (2, 16, 40))),  # batch not leading
    ):
        module = compiled(fn, *operands)
        assert not tiled(module) and len(module.kernels) >= 1


def _layer(x, w, b):
    return fj.numpy.tanh(x @ w + b)


def _layer_gradients(x, w, b):
    return fj.grad(lambda w, b: fj.numpy.mean(_layer(x, w, b) ** 2), argnums=(0, 1))(w, b)


@pytest.mark.parametrize(
    "fn,shapes",
    [
        pytest.param(_layer, ((70, 40), (40, 50), (50,)), id="fused-layer"),
        pytest.param(_layer_gradients, ((40, 48), (48, 36), (36,)), id="layer-gradients"),
    ],
)
def test_products_inside_fused_regions_and_gradients_are_tiled(fn, shapes):
    """A product with its epilogue (a fused region: one launch, the epilogue applied before the
    tiled kernel's store) and the gradient of a layer (its products transposed) on the emulator,
    against the CPU backend."""
    rng = np.random.default_rng(7)
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    module = compiled(fn, *args)
    assert tiled(module)
    expected = fj.jit(fn, target="cpu")(*args)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    outputs = [(e.shape, e.dtype) for e in expected]
    got = gpu_emulator.run(module.plan, gpu_emulator.EmulatedKernels(module.gpu_mlir), args, outputs)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)


# --- a fused region's elementwise epilogue inside the tiled kernel (lower_epilogue.py) ------------


def _relu_layer(x, w, b):
    return fj.nn.relu(x @ w + b)


def _residual(x, w, r):
    return x @ w + r


def _scaled_residual(x, w, r):
    return x @ w * 2.0 + r


def _transposed_layer(x, w, b):
    return fj.numpy.tanh(x.T @ w + b)


def _column_bias(x, w, b):
    return x @ w + b[:, None]  # the bias reshaped to (M, 1) inside the region: a unit view


def _reshaped_residual(x, w, r):
    return x @ w + r.reshape(x.shape[0], w.shape[1])  # a reshape that is no unit view


def _sliced_scalar(x, w, b):
    return fj.numpy.tanh(x @ w + b[0])  # a slice inside the region


def _conv_bias_relu(x, w, b):
    return fj.nn.relu(fj.nn.conv2d(x, w, b, padding=1))  # the bias as (1, O, 1, 1), broadcast


def _conv_residual(x, w, r):
    return fj.nn.conv2d(x, w, padding=1) * 2.0 + r


def _strided_conv_tanh(x, w, b):
    conv = fj.nn.conv2d(x, w, stride=2, padding=((1, 1), (0, 2)), dilation=(2, 1))
    return fj.numpy.tanh(conv + b[:, None, None])  # the bias broadcast by hand along N, H, W


def _conv_sliced_scalar(x, w, b):
    return fj.nn.relu(fj.nn.conv2d(x, w, padding=1) + b[0])  # a slice inside the region


_BIAS = _RNG.standard_normal(384).astype(np.float32)
_RESIDUAL = _RNG.standard_normal((256, 384)).astype(np.float32)


@needs_ptxas
@pytest.mark.parametrize("chip", ["sm_80", "sm_90"])
@pytest.mark.parametrize(
    "fn,third", [(_layer, _BIAS), (_relu_layer, _BIAS), (_residual, _RESIDUAL)], ids=["tanh", "relu", "residual"]
)
def test_a_product_and_its_epilogue_are_one_launch(chip, fn, third):
    """Two launches before (the product writing a temporary, the epilogue a kernel of its own)."""
    module = compiled(fn, _A, _B, third, chip=chip)
    launches = [launch for launch, _ in module.plan.launches()]
    assert [(launch.grid, launch.block) for launch in launches] == [((384 // 64, 256 // 64, 1), (256, 1, 1))]
    (kernel,) = module.kernels
    assert "bar.sync" in kernel.ptx and re.search(r"\bld\.shared\.", kernel.ptx)
    assemble_all(module.kernels, chip)


def _launches(fn, *args) -> int:
    return len(list(compiled(fn, *args).plan.launches()))


EPILOGUES = [
    pytest.param(_layer, [(70, 130), (130, 33), (33,)], _F32, id="tanh-bias"),
    pytest.param(_relu_layer, [(70, 130), (130, 33), (33,)], np.float16, id="relu-bias-float16"),
    pytest.param(_transposed_layer, [(130, 70), (130, 33), (33,)], _F32, id="a-transposed"),
    pytest.param(_scaled_residual, [(70, 40), (40, 33), (70, 33)], ml_dtypes.bfloat16, id="scaled-residual-bfloat16"),
    pytest.param(_column_bias, [(70, 130), (130, 33), (70,)], _F32, id="reshaped-column-bias"),
    pytest.param(
        lambda x, w, b: fj.numpy.tanh(fj.numpy.matmul(x, w) + b),
        [(2, 3, 40, 20), (2, 3, 20, 36), (3, 1, 36)],
        _F32,
        id="two-batch-dims-bias",
    ),
]


# Convolutions (taken by the tiled rule itself: O >= 32, OH OW >= 32, C KH KW >= 16) and their epilogues.
CONV_EPILOGUES = [
    pytest.param(_conv_bias_relu, [(2, 3, 8, 8), (33, 3, 3, 3), (33,)], _F32, id="conv-bias-relu"),
    pytest.param(_conv_residual, [(2, 3, 8, 8), (33, 3, 3, 3), (2, 33, 8, 8)], _F32, id="conv-scaled-residual"),
    pytest.param(_strided_conv_tanh, [(2, 3, 13, 12), (35, 3, 3, 3), (35,)], _F32, id="conv-strided-padded-dilated"),
    pytest.param(_conv_bias_relu, [(1, 4, 8, 11), (40, 4, 3, 2), (40,)], np.float16, id="conv-bias-relu-float16"),
    pytest.param(
        _conv_residual, [(1, 3, 8, 8), (33, 3, 3, 3), (1, 33, 8, 8)], ml_dtypes.bfloat16, id="conv-residual-bfloat16"
    ),
]


def _fused_region(fn, *args):
    (region,) = [op for op in fj.jit(fn).lower(*args).graph("optimized").walk() if op.name == "fusion"]
    return region


@pytest.mark.parametrize("fn,shapes,dtype", EPILOGUES + CONV_EPILOGUES)
def test_the_fused_epilogue_computes_the_interpreters_values(monkeypatch, fn, shapes, dtype):
    """One launch, its values those of the reference interpreter and, bit for bit, of the two
    launches the region took before (the rule refusing every region)."""
    rng = np.random.default_rng(shapes[0][-1])
    args = [rng.standard_normal(s).astype(dtype) for s in shapes]
    epilogue = lower_epilogue.plan(_fused_region(fn, *args))
    assert epilogue is not None
    assert _launches(fn, *args) == 1
    got, want, was_tiled = _replayed(fn, *args)
    assert was_tiled
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, tolerance(dt.dtype(np.dtype(dtype)), max(12.0, 3.0 * epilogue.product.k)))
    monkeypatch.setattr(lower_epilogue, "plan", lambda op: None)
    assert _launches(fn, *args) == 2
    two_launches, _, _ = _replayed(fn, *args)
    np.testing.assert_array_equal(got.view(np.uint8), two_launches.view(np.uint8))


@pytest.mark.parametrize(
    "fn,third", [(_reshaped_residual, (1600,)), (_sliced_scalar, (40,))], ids=["reshaped-residual", "sliced-scalar"]
)
def test_regions_the_epilogue_rule_refuses_keep_two_launches(fn, third):
    """A region holding the product and an op that is neither pointwise, nor a broadcast of an
    input, nor a reshape only inserting or dropping unit dimensions (here a reshape (1600,) ->
    (40, 40), a slice) keeps the product writing a temporary that a kernel of its own reads. (The
    fusion pass puts no reduction, transpose or second product after a product in its region;
    `plan` refuses those as it refuses these.)"""
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((40, 40), (40, 40), third))
    region = _fused_region(fn, x, w, b)
    assert any(op.name == "dot_general" for op in region.regions[0].ops)
    assert lower_epilogue.plan(region) is None
    assert _launches(fn, x, w, b) == 2
    got, want, was_tiled = _replayed(fn, x, w, b)
    assert was_tiled
    assert_close(got, want, tolerance(dt.float32, 3.0 * 40))


# --- conv2d as an implicit product through the same kernel ----------------------------------------


def _conv(stride, padding, dilation):
    return lambda x, w: fj.nn.conv2d(x, w, stride=stride, padding=padding, dilation=dilation)


@needs_ptxas
@pytest.mark.parametrize("chip", ["sm_80", "sm_90"])
def test_a_convolution_is_one_launch_of_the_tiled_kernel(chip):
    x, w = np.ones((8, 64, 32, 32), np.float32), np.ones((128, 64, 3, 3), np.float32)
    module = compiled(_conv(1, 1, 1), x, w, chip=chip)
    # per image: weights (128, 576) @ windows (576, 32 x 32), tiles of 64 x 64
    assert [(launch.grid, launch.block) for launch, _ in module.plan.launches()] == [((16, 2, 8), (256, 1, 1))]
    (kernel,) = module.kernels
    assert "bar.sync" in kernel.ptx and re.search(r"\bld\.shared\.", kernel.ptx)
    assemble_all(module.kernels, chip)


CONVOLUTIONS = [
    pytest.param(_conv(1, 0, 1), [(2, 3, 9, 9), (40, 3, 3, 3)], _F32, id="valid"),
    pytest.param(_conv(1, 1, 1), [(1, 4, 8, 11), (33, 4, 3, 2)], _F32, id="padded"),
    pytest.param(_conv(2, 1, 1), [(2, 2, 13, 12), (35, 2, 3, 3)], _F32, id="stride2"),
    pytest.param(_conv(1, 0, 2), [(1, 3, 12, 12), (34, 3, 3, 3)], _F32, id="dilation2"),
    pytest.param(_conv(1, ((0, 1), (2, 0)), (2, 1)), [(1, 3, 10, 12), (36, 3, 2, 3)], _F32, id="asymmetric"),
    pytest.param(_conv((2, 1), ((1, 1), (0, 2)), 1), [(2, 3, 10, 12), (36, 3, 2, 3)], np.float16, id="float16"),
    pytest.param(_conv(1, 1, 1), [(1, 3, 8, 8), (33, 3, 3, 3)], ml_dtypes.bfloat16, id="bfloat16"),
]


@pytest.mark.parametrize("fn,shapes,dtype", CONVOLUTIONS)
def test_the_tiled_kernel_computes_the_interpreters_convolution(fn, shapes, dtype):
    """Taken by the rule itself (O >= 32 channels, OH OW >= 32 pixels, C KH KW >= 16 taps);
    padding, strides and dilations land in the windows the kernel loads. (With an epilogue:
    `CONV_EPILOGUES` above.)"""
    rng = np.random.default_rng(shapes[0][-1])
    args = [rng.standard_normal(s).astype(dtype) for s in shapes]
    got, want, was_tiled = _replayed(fn, *args)
    assert was_tiled
    assert got.shape == want.shape and got.dtype == want.dtype
    taps = int(np.prod(shapes[1][1:]))
    assert_close(got, want, tolerance(dt.dtype(np.dtype(dtype)), max(12.0, 3.0 * taps)))


def test_small_convolutions_stay_direct():
    """The product's rule: 32 output channels, 36 pixels and 18 taps are tiled; 3 channels, 9
    pixels or 9 taps are not."""
    ones = lambda *shape: np.ones(shape, np.float32)
    assert tiled(compiled(_conv(1, 0, 1), ones(1, 2, 8, 8), ones(32, 2, 3, 3)))
    assert not tiled(compiled(_conv(1, 0, 1), ones(1, 2, 8, 8), ones(3, 2, 3, 3)))
    assert not tiled(compiled(_conv(1, 0, 1), ones(1, 2, 5, 5), ones(32, 2, 3, 3)))
    assert not tiled(compiled(_conv(1, 0, 1), ones(1, 1, 8, 8), ones(32, 1, 3, 3)))


# A ResNet-like layer in float32; in half types one whose result fits the fusion pass's temporaries
# (`FusionLimits.max_internal_bytes`): a larger half-precision product is no streamed epilogue
# there (`fuse._streams_epilogue`), so its epilogue is a group of its own.
_LAYER, _HALF_LAYER = ((8, 64, 32, 32), (128, 64, 3, 3)), ((2, 64, 16, 16), (64, 64, 3, 3))


@needs_ptxas
@pytest.mark.parametrize("chip", ["sm_80", "sm_90"])
@pytest.mark.parametrize(
    "fn,shapes,dtype",
    [
        (_conv_bias_relu, (*_LAYER, (128,)), _F32),
        (_strided_conv_tanh, (*_LAYER, (128,)), _F32),
        (_conv_bias_relu, (*_HALF_LAYER, (64,)), np.float16),
        (_conv_residual, (*_HALF_LAYER, (2, 64, 16, 16)), ml_dtypes.bfloat16),
    ],
    ids=["bias-relu", "strided-padded-dilated", "bias-relu-float16", "residual-bfloat16"],
)
def test_a_convolution_and_its_epilogue_are_one_launch(chip, fn, shapes, dtype):
    """Two launches before (the convolution writing a temporary, the epilogue a kernel of its
    own); the epilogue's loads and math add no spills to the tiled kernel."""
    args = [np.ones(s, dtype) for s in shapes]
    module = compiled(fn, *args, chip=chip)
    n, o, oh, ow = _fused_region(fn, *args).result.type.shape
    # per image: weights (O, C KH KW) @ windows (C KH KW, OH OW), tiles of 64 x 64
    assert [(launch.grid, launch.block) for launch, _ in module.plan.launches()] == [
        ((-(-oh * ow // 64), -(-o // 64), n), (256, 1, 1))
    ]
    (kernel,) = module.kernels
    assert "bar.sync" in kernel.ptx and re.search(r"\bld\.shared\.", kernel.ptx)
    assemble_all(module.kernels, chip)
    assert "0 bytes spill stores, 0 bytes spill loads" in _ptxas_verbose(kernel.ptx, chip)


def test_convolution_regions_the_epilogue_rule_refuses_keep_their_lowering():
    """A tiled convolution whose epilogue holds a slice keeps two launches (the convolution
    writing a temporary, the epilogue a kernel of its own); a convolution the tiled rule does not
    take (3 output channels) keeps its direct kernel, fused with its epilogue by the tensor
    lowering (one launch, no tiles)."""
    rng = np.random.default_rng(9)
    for shapes, launches, was_tiled in (
        (((2, 3, 8, 8), (33, 3, 3, 3), (33,)), 2, True),
        (((2, 3, 8, 8), (3, 3, 3, 3), (3,)), 1, False),
    ):
        fn = _conv_sliced_scalar if was_tiled else _conv_bias_relu
        args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        assert lower_epilogue.plan(_fused_region(fn, *args)) is None
        assert _launches(fn, *args) == launches
        got, want, tiled_here = _replayed(fn, *args)
        assert tiled_here == was_tiled
        assert_close(got, want, tolerance(dt.float32, 3.0 * 27))
