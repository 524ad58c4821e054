"""Compiled CPU code vs the reference interpreter for the movement, contraction, convolution,
pooling and argmax/argmin lowerings: odd and size-1 shapes, every dtype the op allows, clamped
out-of-range indices, nan and tie rules, and the tiled matmul kernel's tails and threads."""

from __future__ import annotations

import ctypes
import mmap
import os
import re

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.backends import compile_graph
from flowjit.backends.cpu import (
    contraction,
    host,
    lower_conv,
    matmul_kernel,
    matmul_plan,
    pipeline,
    schedule,
    toolchain,
)
from flowjit.backends.mlir import pipeline as mlir_pipeline
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import emit
from flowjit.ir.graph import Graph
from flowjit.ir.types import TensorType

ALL = dt.ALL_DTYPES
NUMERIC = dt.NUMERIC_DTYPES
FLOATS = dt.FLOAT_DTYPES

# Relative to the largest |expected| element: one rounding of the result plus summation-order
# differences of an f32 (or f64) accumulator.
TOLERANCE = {dt.float16: 2e-3, dt.bfloat16: 1.6e-2, dt.float32: 2e-6, dt.float64: 1e-13}


def compiled_and_reference(name: str, inputs: list[np.ndarray], attrs: dict):
    """Run one op through the CPU backend and the interpreter; returns both results and the MLIR."""
    inputs = [np.asarray(a) for a in inputs]
    graph = Graph(name)
    params = [graph.add_param(TensorType(a.shape, dt.dtype(a.dtype))) for a in inputs]
    graph.results = list(emit(graph, name, params, attrs).results)
    compiled = compile_graph(graph, "cpu")
    (got,) = compiled.run(inputs)
    (want,) = compile_graph(graph, "interpreter").run(inputs)
    return got, want, compiled.stages["mlir"]


def check(name: str, inputs: list[np.ndarray], attrs: dict) -> str:
    """Assert compiled == interpreted (within the dtype's tolerance); returns the generated MLIR."""
    got, want, mlir = compiled_and_reference(name, inputs, attrs)
    assert got.shape == want.shape and got.dtype == want.dtype
    kind = dt.dtype(want.dtype)
    if not kind.is_float or want.size == 0:
        np.testing.assert_array_equal(got, want)
        return mlir
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    assert np.array_equal(np.isnan(got64), np.isnan(want64))
    finite = np.isfinite(want64)
    scale = max(1.0, float(np.abs(want64[finite]).max(initial=0.0)))
    np.testing.assert_allclose(got64[finite], want64[finite], rtol=0, atol=TOLERANCE[kind] * scale)
    np.testing.assert_array_equal(got64[~finite], want64[~finite])
    return mlir


def data(shape, dtype: dt.DType, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.is_bool:
        return rng.random(shape) < 0.5
    if dtype.is_int:
        return rng.integers(-20, 20, shape).astype(dtype.np_dtype)
    return rng.standard_normal(shape).astype(dtype.np_dtype)


def ids(dtypes):
    return [d.name for d in dtypes]


# --- movement --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_slice_and_pad_every_dtype(dtype):
    x = data((4, 5, 7), dtype)
    check("slice", [x], dict(start=(1, 0, 2), limit=(4, 5, 7), stride=(2, 3, 1)))
    value = np.asarray(x.flat[0])
    check("pad", [x, value], dict(low=(1, 0, 2), high=(0, 2, 1), interior=(1, 0, 2)))
    for axis in range(3):  # along one axis: rows of copies and splat writes (`lower_movement._pad_blocks`)
        low, high = [0, 0, 0], [0, 0, 0]
        low[axis], high[axis] = 2, 1 + axis
        check("pad", [x, value], dict(low=tuple(low), high=tuple(high), interior=(0, 0, 0)))
    check("pad", [x, value], dict(low=(1, 0, 3), high=(2, 1, 0), interior=(0, 0, 0)))  # along all three


@pytest.mark.parametrize(
    "shape, start, limit, stride",
    [((1,), (0,), (1,), (1,)), ((9,), (2,), (9,), (4,)), ((3, 4), (3, 0), (3, 4), (1, 1)), ((), (), (), ())],
)
def test_slice_shapes(shape, start, limit, stride):
    check("slice", [data(shape, dt.float32)], dict(start=start, limit=limit, stride=stride))


@pytest.mark.parametrize(
    "dtype", [dt.bool_, dt.int64, dt.bfloat16, dt.float32], ids=ids([dt.bool_, dt.int64, dt.bfloat16, dt.float32])
)
@pytest.mark.parametrize("starts", [(0, 0), (2, 3), (-5, 1), (100, -100), (2**40, 7)])
def test_dynamic_slice_clamps_starts(dtype, starts):
    x = data((5, 6), dtype)
    index_dtype = np.int64 if abs(starts[0]) > 2**31 else np.int32
    check("dynamic_slice", [x, np.asarray(starts[0], index_dtype), np.asarray(starts[1], np.int64)], dict(sizes=(3, 2)))


def test_dynamic_slice_full_and_empty_windows():
    x = data((4, 3), dt.float64)
    check("dynamic_slice", [x, np.asarray(9, np.int32), np.asarray(-9, np.int32)], dict(sizes=(4, 3)))
    check("dynamic_slice", [x, np.asarray(9, np.int32), np.asarray(1, np.int32)], dict(sizes=(0, 2)))


def test_pad_edge_cases():
    check("pad", [data((1,), dt.float32), np.float32(-1)], dict(low=(0,), high=(3,), interior=(5,)))
    check("pad", [data((2, 3), dt.int32), np.int32(7)], dict(low=(0, 0), high=(0, 0), interior=(0, 0)))
    check("pad", [data((3,), dt.float16), np.float16(np.inf)], dict(low=(2,), high=(2,), interior=(1,)))


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_concatenate(dtype):
    a, b, c = data((2, 3, 4), dtype, 1), data((2, 1, 4), dtype, 2), data((2, 5, 4), dtype, 3)
    check("concatenate", [a, b, c], dict(axis=1))
    # blocks of a vector or more: the vector copy loops, with tails
    mlir = check("concatenate", [data((3, 70), dtype, 1), data((3, 130), dtype, 2)], dict(axis=1))
    assert "linalg.fill" not in mlir


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.bfloat16, dt.bool_], ids=["f32", "f64", "bf16", "bool"])
def test_concatenate_rows_split_over_cores(monkeypatch, dtype):
    """A large concatenation of blocks: one forall chunk of the rows per core (an uneven last chunk,
    blocks with a masked tail vector)."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: 2)
    monkeypatch.setattr(schedule, "PARALLEL_MIN_ELEMENTS", 1000)
    a, b = data((33, 70), dtype, 1), data((33, 75), dtype, 2)  # blocks of a vector or more
    mlir = check("concatenate", [a, b, a], dict(axis=1))
    assert "scf.forall" in mlir and "linalg.fill" not in mlir
    c = data((33, 3), dtype, 3)  # and shorter ones
    mlir = check("concatenate", [c, a, c, b, c], dict(axis=1))
    assert "scf.forall" in mlir and "linalg.fill" not in mlir


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.bool_, dt.int64], ids=["f32", "f64", "bool", "i64"])
def test_concatenate_blocks_shorter_than_a_vector(dtype):
    """Blocks shorter than a vector are one masked copy per row (no fill): a short block's masked
    write runs past it into the next block's columns, which that block then overwrites; in the
    middle, first and last of a row (with rows over the cores: `test_concatenate_rows_split_over_cores`)."""
    for widths in ((3, 1021), (1021, 3), (3, 1, 2), (1,) * 16, (7, 40, 2)):
        parts = [data((37, w), dtype, k) for k, w in enumerate(widths)]
        mlir = check("concatenate", parts, dict(axis=1))
        assert "linalg.fill" not in mlir, widths
    check("concatenate", [data((300, 5), dtype, 1), data((300, 3), dtype, 2)], dict(axis=1))
    middle_axis = [data((6, 2, 3), dtype, 1), data((6, 1, 3), dtype, 2), data((6, 1, 3), dtype, 3)]
    check("concatenate", middle_axis, dict(axis=1))


def test_concatenate_along_first_and_last_axes():
    a = data((2, 3, 4), dt.float32)
    check("concatenate", [a, a], dict(axis=0))
    check("concatenate", [a, a[:, :, :1]], dict(axis=2))
    check("concatenate", [a[:0], a[:0]], dict(axis=1))  # an empty result: no loops


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: fnp.concatenate([x, x * 2.0]),
        lambda x: fnp.stack([x, x + 1.0, x * 3.0]),
        lambda x: fnp.concatenate([x, x * 2.0, x[:, :17]], axis=1),
        lambda x: fnp.concatenate([x.reshape(4, 16, 8, 64), x.reshape(4, 16, 8, 64)[:, :3] * 2.0], axis=1),
    ],
    ids=["first_axis", "stack", "columns", "channels"],
)
def test_concatenate_writes_its_blocks_into_the_output_buffer(fn):
    """The vector copy loops write the result's buffer (viewed as (outer, total), or flat along
    axis 0) directly: no temporary of the result's size is allocated per call and copied out (for
    a stack of three 16 MiB arrays that copy would take most of the call)."""
    x = data((512, 64), dt.float32)
    f = fj.jit(fn)
    llvm = f.lower(x).as_text("llvm")
    assert "@malloc(" not in llvm
    np.testing.assert_array_equal(f(x), np.asarray(fn(x)))  # flowjit.numpy runs eagerly on numpy data


@pytest.mark.parametrize(
    "fn, idx",
    [
        (lambda t, i: t[i], np.arange(3000) % 500),
        (lambda t, i: t[i], (np.arange(600) % 500).reshape(30, 20)),
        (lambda t, i: t[i], np.int64(7)),
        (lambda t, i: fnp.take(t.reshape(10, 50, 64), i % 50, axis=1), np.arange(3000) % 50),
    ],
    ids=["rows", "rows_2d_indices", "one_row", "middle_axis"],
)
def test_gather_of_rows_writes_the_output_buffer(fn, idx):
    """Row gathers (embedding lookups) write the result's buffer, viewed as (outer, count, inner)
    (unit leading dims added back by an expand): no per-call temporary of the result's size, whose
    copy would be most of a large gather's time."""
    table = data((500, 64), dt.float32)
    f = fj.jit(fn)
    assert "@malloc(" not in f.lower(table, idx).as_text("llvm")
    np.testing.assert_array_equal(f(table, idx), np.asarray(fn(table, idx)))


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_gather_clamps_indices(dtype):
    x = data((4, 5, 3), dtype)
    idx = np.array([[0, 4], [-1, 99], [3, -7]], np.int32)
    check("gather", [x, idx], dict(axis=1))
    check("gather", [x, np.array([7, -3, 2, 2], np.int64)], dict(axis=0))
    check("gather", [x, np.array(-1, np.int64)], dict(axis=2))


def test_zero_size_operands():
    x = data((3, 4), dt.float32)
    check("concatenate", [x[:, :0], x, x[:, :0]], dict(axis=1))
    check("pad", [x[:0], np.float32(2)], dict(low=(1, 0), high=(2, 1), interior=(3, 0)))
    check("gather", [x, np.zeros((0, 2), np.int32)], dict(axis=1))
    check("scatter_add", [x, np.zeros((0,), np.int64), np.zeros((3, 0), np.float32)], dict(axis=1))


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_gather_rows_kernel(dtype):
    """Embedding-style lookups, where each index selects a block of at least one vector."""
    table = data((20, 70), dtype)
    mlir = check("gather", [table, np.array([[3, 19, -4], [25, 0, 3]], np.int64)], dict(axis=0))
    assert "vector.transfer_read" in mlir
    check("gather", [data((3, 9, 140), dtype), np.array([8, 0, 99, -1], np.int32)], dict(axis=1))


@pytest.mark.parametrize("dtype", [dt.float32, dt.bfloat16, dt.bool_], ids=["f32", "bf16", "bool"])
def test_gather_rows_split_over_cores(monkeypatch, dtype):
    """A large row gather: one forall chunk of the indices per core (an uneven last chunk, clamped
    and negative indices, rows with a masked tail vector)."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: 2)
    monkeypatch.setattr(schedule, "PARALLEL_MIN_ELEMENTS", 1000)
    idx = np.random.default_rng(4).integers(-50, 350, (7, 9))
    mlir = check("gather", [data((300, 70), dtype, 2), idx], dict(axis=0))
    assert "scf.forall" in mlir


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
@pytest.mark.parametrize("parallel", [False, True], ids=["one-core", "split"])
def test_reversed_columns(monkeypatch, dtype, parallel):
    """`x[..., ::-1]`, `x[:, b:a:-1]` and `flip` trace to a gather of constant, descending columns:
    vectors read backwards with their lanes reversed, a masked tail (no element-wise generic), and
    the gradient of a whole reversal is the reversed cotangent (no scatter loop)."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    if parallel:
        monkeypatch.setattr(host, "cores", lambda: 2)
        monkeypatch.setattr(schedule, "PARALLEL_MIN_ELEMENTS", 100)
    for shape in [(3,), (5, 16), (4, 3, 37), (9, 70)]:
        x = data(shape, dtype, 5)
        for key in [np.s_[..., ::-1], np.s_[..., shape[-1] - 2 : 0 : -1], np.s_[..., 2::-1]]:
            lowered = fj.jit(lambda x, key=key: x[key]).lower(x)
            mlir = lowered.as_text("mlir")
            reversal = x[key].shape[-1] >= 2  # one column is a slice
            assert ("vector.shuffle" in mlir and "tensor.extract %" not in mlir) == reversal
            rows = x[key].size // x[key].shape[-1]
            assert ("scf.forall" in mlir) == (reversal and parallel and x[key].size >= 100 and rows >= 4)
            np.testing.assert_array_equal(lowered.compile()(x), x[key])
    if dtype.is_float:
        x, w = data((6, 45), dtype, 1), data((6, 45), dtype, 2)
        grad = fj.jit(fj.grad(lambda x, w: fnp.sum(fnp.flip(x, -1) * w)))
        mlir = grad.lower(x, w).as_text("mlir")
        assert "vector.shuffle" in mlir and "arith.addf" not in mlir  # no scatter adding into zeros
        np.testing.assert_array_equal(grad(x, w), np.flip(w, -1))


@pytest.mark.parametrize("dtype", NUMERIC, ids=ids(NUMERIC))
@pytest.mark.parametrize("kind", ["sum", "max", "min", "prod"])
def test_column_reductions_over_few_positions_and_several_axes(dtype, kind):
    """Not over the last axis: at most `VIEWS_MAX` positions are one elementwise kernel over strided
    views of x (no reduction loop, no filled accumulator); more, over several groups of axes, one
    column-reduction kernel over all of them (`schedule.reduction` with a tuple of axes)."""
    from flowjit.backends.mlir import lower_reduction

    x = data((3, 4, 2, 5, 2, 32), dtype, 3)  # an average pool's (n, h, 2, w, 2, c), as in a reshape
    mlir = check(f"reduce_{kind}", [x], dict(axes=(2, 4)))
    assert '"reduction"' not in mlir and mlir.count("tensor.extract_slice") == 4
    x = data((2, 6, 3, 4, 33), dtype, 4)  # 33 columns: a masked vector per row
    mlir = check(f"reduce_{kind}", [x], dict(axes=(1, 3)))
    assert "tile_sizes [0, 1, 0, 1, 0]" in mlir and mlir.count('"reduction"') == 2
    x = data((5, 3, 48), dtype, 5)
    mlir = check(f"reduce_{kind}", [x], dict(axes=(1,)))
    assert ('"reduction"' not in mlir) == (3 <= lower_reduction.VIEWS_MAX)


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.int32, dt.float16], ids=["f32", "f64", "i32", "f16"])
def test_row_reductions_peel_their_partial_chunk(dtype):
    """Rows longer than one chunk but not a whole number of chunks (1000 columns): the partial chunk
    is peeled off the reduction loop (`transform.loop.peel`), which keeps every other chunk
    unmasked. Column reductions peel their partial last column tile."""
    for kind in ("sum", "max"):
        mlir = check(f"reduce_{kind}", [data((6, 1000), dtype, 1)], dict(axes=(1,)))
        assert "transform.loop.peel" in mlir
    mlir = check("reduce_sum", [data((3, 1024), dtype, 3)], dict(axes=(1,)))
    assert "transform.loop.peel" not in mlir  # whole chunks
    # columns: the partial last column tile, the same way
    for kind in ("sum", "min"):
        mlir = check(f"reduce_{kind}", [data((40, 1000), dtype, 4)], dict(axes=(0,)))
        assert "transform.loop.peel" in mlir
        mlir = check(f"reduce_{kind}", [data((5, 3, 4, 130), dtype, 5)], dict(axes=(1, 2)))
        assert "transform.loop.peel" in mlir
    mlir = check("reduce_sum", [data((40, 1024), dtype, 6)], dict(axes=(0,)))
    assert "transform.loop.peel" not in mlir


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.int32, dt.float16], ids=["f32", "f64", "i32", "f16"])
def test_short_rows_reduce_whole_rows_per_tile(dtype):
    """Rows shorter than a vector reduce a tile of one vector's worth of whole rows at a time,
    transposed (`schedule._short_row_reduction`: the inner-parallel strategy, no horizontal
    reduction); a partial last tile of rows is peeled off. Rows of a whole vector keep the general
    schedule. Up to `PLAIN_LOOP_MAX_ELEMENTS` in all, such a reduction is plain loops
    (`schedule.stays_plain`: the transposes cost more compile time than they save run time)."""
    lanes = schedule.lanes(32 if dtype is dt.float16 else dtype.bits)
    longest = min(lanes - 1, schedule.SHORT_ROW_MAX)
    rows = lanes * (schedule.PLAIN_LOOP_MAX_ELEMENTS // (lanes * longest) + 1)  # whole tiles, past plain
    for kind in ("sum", "max", "min", "prod"):
        many = lanes * (schedule.PARALLEL_MIN_ELEMENTS // lanes // 3 + 1) + 5  # over the cores
        for shape, peeled in (((many, 3), True), ((rows, longest), False)):
            mlir = check(f"reduce_{kind}", [data(shape, dtype, 8)], dict(axes=(1,)))
            assert 'lowering_strategy = "innerparallel"' in mlir
            assert ("transform.loop.peel" in mlir) == peeled
        mlir = check(f"reduce_{kind}", [data((2, 64, lanes + 1, 5), dtype, 9)], dict(axes=(3,)))  # leading dims
        assert 'lowering_strategy = "innerparallel"' in mlir
        mlir = check(f"reduce_{kind}", [data((rows, longest + 1), dtype, 10)], dict(axes=(1,)))
        assert 'lowering_strategy = "innerparallel"' not in mlir and "fj.kernel" in mlir
        for small in ((5, 2), (lanes * 4, longest), (2, 4, lanes + 1, 5)):
            mlir = check(f"reduce_{kind}", [data(small, dtype, 11)], dict(axes=(len(small) - 1,)))
            reductions = [line for line in mlir.splitlines() if "linalg.generic" in line and '"reduction"' in line]
            assert reductions and not any("fj.kernel" in line for line in reductions)  # plain loops


def test_small_short_row_reductions_keep_their_schedule_in_loops_and_with_math():
    """A small reduction over short rows is plain loops only when it runs once per call and its
    body has no math function: in a `for` body, a row nest's tile loop, or summing an exp it keeps
    its vectorizing schedule (`schedule.stays_plain`)."""
    x = data((64, 10), dt.float32, 12)
    assert "innerparallel" not in fj.jit(lambda x: fnp.sum(x, axis=1)).lower(x).as_text("mlir")
    summed_exp = fj.jit(lambda x: fnp.sum(fnp.exp(x), axis=1))
    assert 'lowering_strategy = "innerparallel"' in summed_exp.lower(x).as_text("mlir")
    np.testing.assert_allclose(summed_exp(x), np.exp(x).sum(1), rtol=1e-6)

    def loop(x):
        return fj.fori_loop(0, 3, lambda i, acc: acc + fnp.sum(acc, axis=1, keepdims=True) * 0.1, x)

    looped = fj.jit(loop)
    assert 'lowering_strategy = "innerparallel"' in looped.lower(x).as_text("mlir")
    want = x.astype(np.float64)
    for _ in range(3):
        want = want + want.sum(1, keepdims=True) * 0.1
    np.testing.assert_allclose(looped(x), want, rtol=1e-5)
    # Many tiles of a row nest (softmax over 100K rows of 10): each tile's reductions are scheduled.
    big = data((100_000, 10), dt.float32, 13)
    nested = fj.jit(nn.softmax).lower(big).as_text("mlir")
    assert "row loop nest" in nested and 'lowering_strategy = "innerparallel"' in nested


def test_gather_scalar_result():
    check("gather", [data((6,), dt.float32), np.array(4, np.int32)], dict(axis=0))


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_scatter_add_accumulates_duplicates_and_clamps(dtype):
    x = data((5, 3), dtype)
    idx = np.array([1, 1, -4, 9, 4, 1], np.int64)
    updates = data((6, 3), dtype, 7)
    check("scatter_add", [x, idx, updates], dict(axis=0))
    idx2 = np.array([[2, 2], [0, 5]], np.int32)
    check("scatter_add", [x, idx2, data((5, 2, 2), dtype, 8)], dict(axis=1))


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
def test_scatter_add_rows_kernel(dtype):
    """Embedding-gradient-style updates of whole blocks, with duplicate and out-of-range indices."""
    x = data((12, 70), dtype)
    idx = np.array([[3, 11, 3], [40, -2, 3]], np.int64)
    mlir = check("scatter_add", [x, idx, data((2, 3, 70), dtype, 5)], dict(axis=0))
    assert "vector.transfer_write" in mlir
    check(
        "scatter_add",
        [data((2, 5, 130), dtype), np.array([4, 4, -9], np.int32), data((2, 3, 130), dtype, 6)],
        dict(axis=1),
    )


def test_scatter_add_scalar_index():
    x = data((4,), dt.int32)
    check("scatter_add", [x, np.array(-2, np.int64), np.array(5, np.int32)], dict(axis=0))


@pytest.mark.parametrize(
    "dtype", [dt.float32, dt.int32, dt.float64, dt.bool_], ids=ids([dt.float32, dt.int32, dt.float64, dt.bool_])
)
@pytest.mark.parametrize("fill", [0, 3])
def test_scatter_add_into_a_splat_fills_the_output(dtype, fill):
    """scatter_add into zeros (a gather's gradient) or another splat: the output is filled with the
    scalar, the splat never stored and copied (half an embedding gradient's time)."""
    rows, width = 3000, 40
    idx = np.random.default_rng(1).integers(-rows, rows, (50, 7)).astype(np.int32)
    upd = data((50, 7, width), dtype, 2)
    np_dtype = dtype.np_dtype

    def f(i, u):
        return fnp.scatter_add(fnp.full((rows, width), fill, np_dtype), i, u)

    want = np.full((rows, width), fill, np_dtype)
    np.add.at(want, np.where(idx < 0, idx + rows, idx), upd)
    lowered = fj.jit(f).lower(idx, upd)
    np.testing.assert_array_equal(lowered.compile()(idx, upd), want)
    mlir = lowered.as_text("mlir")
    workspace = int(re.search(r"// workspace: (\d+) bytes", mlir).group(1))
    assert "linalg.copy" not in mlir and workspace < rows * width  # the splat is not stored
    assert "linalg.fill" not in mlir  # a scheduled kernel: vector stores


def test_large_fills_are_vectorized_kernels():
    """A large broadcast scalar is a scheduled generic (vector stores, both cores), not a
    `linalg.fill`, which the pipeline leaves as scalar loops."""
    x = np.ones((300, 128), np.float32)
    lowered = fj.jit(lambda x: fnp.zeros_like(x) + 1.0).lower(x)
    mlir = lowered.as_text("mlir")
    assert "linalg.fill" not in mlir and "fj.kernel" in mlir
    np.testing.assert_array_equal(lowered.compile()(x), np.ones_like(x))


# --- dot_general -----------------------------------------------------------------------------------

MATMUL = dict(lhs_contract=(1,), rhs_contract=(0,), lhs_batch=(), rhs_batch=())


@pytest.mark.parametrize("dtype", NUMERIC, ids=ids(NUMERIC))
def test_dot_general_forms(dtype):
    check("dot_general", [data((3, 5), dtype, 1), data((5, 7), dtype, 2)], MATMUL)
    # vector-matrix and matrix-vector
    vec = dict(lhs_contract=(0,), rhs_contract=(0,), lhs_batch=(), rhs_batch=())
    check("dot_general", [data((5,), dtype, 1), data((5, 4), dtype, 2)], vec)
    check("dot_general", [data((4, 5), dtype, 1), data((5,), dtype, 2)], MATMUL | dict(rhs_contract=(0,)))
    # batched, with the batch dims in different places, and two contracting dims
    batched = dict(lhs_contract=(2,), rhs_contract=(0,), lhs_batch=(0,), rhs_batch=(2,))
    check("dot_general", [data((2, 3, 4), dtype, 3), data((4, 5, 2), dtype, 4)], batched)
    two = dict(lhs_contract=(0, 2), rhs_contract=(1, 0), lhs_batch=(), rhs_batch=())
    check("dot_general", [data((3, 2, 4), dtype, 5), data((4, 3, 6), dtype, 6)], two)


def test_dot_general_degenerate_shapes():
    check("dot_general", [data((1, 1), dt.float32), data((1, 1), dt.float32)], MATMUL)
    check("dot_general", [data((3, 0), dt.float32), data((0, 20), dt.float32)], MATMUL)  # empty sums are 0
    dot = dict(lhs_contract=(0,), rhs_contract=(0,), lhs_batch=(), rhs_batch=())
    check("dot_general", [data((7,), dt.float64), data((7,), dt.float64)], dot)


@pytest.mark.parametrize(
    "m, k, n, dtype",
    [
        (65, 33, 129, dt.float32),  # row, column and k tails of the register tile
        (128, 64, 96, dt.float32),  # exact tiles
        (130, 128, 141, dt.float32),  # one row chunk per thread, with tails
        (9, 300, 17, dt.float64),
        (40, 24, 72, dt.float16),
        (33, 40, 50, dt.bfloat16),
        (41, 33, 50, dt.int32),
        (20, 17, 30, dt.int64),
    ],
)
@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_kernel(m, k, n, dtype):
    mlir = check("dot_general", [data((m, k), dtype, 1), data((k, n), dtype, 2)], MATMUL)
    assert "vector.fma" in mlir if dtype.is_float else "arith.muli" in mlir and "vector.broadcast" in mlir
    assert ("scf.forall" in mlir) == (m * n * k >= matmul_plan.PARALLEL_MIN_FLOPS and (os.cpu_count() or 1) > 1)


@pytest.mark.parametrize("dtype", NUMERIC, ids=ids(NUMERIC))
def test_row_dot_kernel(dtype):
    """Narrow products (fewer than 8 output columns) with long contractions: one vector dot per
    output, unrolled accumulators, masked tail, outputs over both cores."""
    vec = dict(lhs_contract=(1,), rhs_contract=(0,), lhs_batch=(), rhs_batch=())
    mlir = check("dot_general", [data((300, 1001), dtype, 1), data((1001,), dtype, 2)], vec)
    assert "vector.reduction <add>" in mlir
    check("dot_general", [data((37, 133), dtype, 1), data((133, 3), dtype, 2)], MATMUL)
    check("dot_general", [data((133,), dtype, 1), data((133,), dtype, 2)], dict(vec, lhs_contract=(0,)))
    batched = dict(lhs_contract=(2,), rhs_contract=(2,), lhs_batch=(0,), rhs_batch=(0,))
    check("dot_general", [data((3, 5, 200), dtype, 1), data((3, 2, 200), dtype, 2)], batched)


@pytest.mark.parametrize(
    "m, k, n, dtype",
    [
        (64, 6272, 10, dt.float32),  # the CNN's dense layer: blocks of 2 rows over the cores
        (13, 100, 8, dt.float32),  # 3-row blocks, a last block of 1 row, a masked last step of K
        (37, 64, 15, dt.float32),  # one row a block
        (9, 33, 5, dt.float64),  # 4-row blocks, a masked last step
    ],
)
def test_few_columns_take_dot_blocks(m, k, n, dtype):
    """Products with half a vector to a vector of columns: blocks of rows x N dots along K (not the
    tiled kernel, whose two-vector panels were mostly padding), B as (N, K) rows given or transposed,
    fused with a bias and relu."""
    if host.vector_bits() != 512:
        pytest.skip("the shapes are chosen for AVX-512's 16 float32 lanes")
    mlir = check("dot_general", [data((m, k), dtype, 1), data((k, n), dtype, 2)], MATMUL)
    assert "dots along K (few columns)" in mlir
    parallel = m * n * k >= contraction.PARALLEL_MIN_WORK and (os.cpu_count() or 1) > 1
    assert ("scf.forall" in mlir) == parallel
    assert "fj_matmul" not in mlir and "vector.reduction <add>" in mlir
    transposed = dict(lhs_contract=(1,), rhs_contract=(1,), lhs_batch=(), rhs_batch=())
    assert "dots along K" in check("dot_general", [data((m, k), dtype, 3), data((n, k), dtype, 4)], transposed)
    x, w, b = data((m, k), dtype, 5), data((k, n), dtype, 6), data((n,), dtype, 7)
    want = np.maximum(x.astype(np.float64) @ w + b, 0)
    got = fj.jit(lambda x, w, b: fnp.maximum(x @ w + b, 0))(x, w, b)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * 8 * np.abs(want).max())


@pytest.mark.parametrize(
    "m, k, n, dtype",
    [
        (1, 1024, 2048, dt.float32),  # split over the cores
        (2, 513, 4100, dt.float32),  # split over the cores, a partial last vector, a k remainder
        (3, 7, 1000, dt.float32),  # one thread, a partial last vector
        (4, 300, 40, dt.float64),
        (1, 128, 33, dt.int32),
        (4, 45, 70, dt.int64),
        (2, 40, 72, dt.float16),
        (3, 33, 50, dt.bfloat16),
    ],
)
def test_matmul_few_rows_are_streamed(m, k, n, dtype):
    """A product of at most FEW_ROWS_MAX rows reads B once, row after row, into C's columns: no
    packed panels, masked past N, C's vectors split over the cores when large."""
    mlir = check("dot_general", [data((m, k), dtype, 1), data((k, n), dtype, 2)], MATMUL)
    assert "streamed against B's rows, nothing packed" in mlir
    assert ("scf.forall" in mlir) == (m * n * k >= matmul_plan.PARALLEL_MIN_FLOPS and (os.cpu_count() or 1) > 1)
    mlir = check("dot_general", [data((k,), dtype, 1), data((k, n), dtype, 2)], dict(MATMUL, lhs_contract=(0,)))
    assert ("streamed against B's rows" in mlir) == (k * n >= matmul_plan.KERNEL_MIN_FLOPS)  # vector @ matrix
    more = matmul_plan.FEW_ROWS_MAX + 1
    assert "streamed" not in check("dot_general", [data((more, k), dtype, 1), data((k, n), dtype, 2)], MATMUL)


@pytest.mark.parametrize("m", [5, 8])
def test_matmul_up_to_8_rows_stream_a_b_larger_than_the_last_cache(monkeypatch, m):
    """5-8 rows are streamed only when B does not fit in the last-level cache (here pretended 4 KiB)."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")  # the same graph compiles to other code
    a, b = data((m, 40), dt.float32, 1), data((40, 72), dt.float32, 2)
    assert "streamed" not in check("dot_general", [a, b], MATMUL)
    monkeypatch.setattr(host, "last_level_cache_bytes", lambda: 4096)
    assert "streamed against B's rows" in check("dot_general", [a, b], MATMUL)
    assert "streamed" not in check("dot_general", [data((9, 40), dt.float32, 3), b], MATMUL)


@pytest.mark.parametrize("m", [1, 3])
def test_matmul_few_rows_with_epilogues(m):
    """Bias + relu and a residual over a streamed product, through fj.jit against numpy in float64."""
    x, w, b = data((m, 300), dt.float32, 1), data((300, 1000), dt.float32, 2), data((1000,), dt.float32, 3)
    want = np.maximum(x.astype(np.float64) @ w + b, 0)
    got = fj.jit(lambda x, w, b: fnp.maximum(x @ w + b, 0))(x, w, b)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    w2 = data((300, 300), dt.float32, 4)
    want = np.tanh(x.astype(np.float64) @ w2) + x
    np.testing.assert_allclose(fj.jit(lambda x, w: fnp.tanh(x @ w) + x)(x, w2), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.int32], ids=ids([dt.float32, dt.float64, dt.int32]))
def test_one_row_against_rows_takes_row_dots(dtype):
    """x @ w.T of one row (PyTorch's linear layout): one dot per output over B's contiguous rows,
    not the tiled kernel packing B's rows into panels."""
    transposed = dict(lhs_contract=(1,), rhs_contract=(1,), lhs_batch=(), rhs_batch=())
    mlir = check("dot_general", [data((1, 1001), dtype, 1), data((300, 1001), dtype, 2)], transposed)
    assert "vector.reduction <add>" in mlir and "streamed" not in mlir
    batched = dict(lhs_contract=(2,), rhs_contract=(2,), lhs_batch=(0,), rhs_batch=(0,))
    mlir = check("dot_general", [data((3, 1, 200), dtype, 1), data((3, 70, 200), dtype, 2)], batched)
    assert "vector.reduction <add>" in mlir


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64], ids=ids([dt.float32, dt.float64]))
def test_split_head_products_move_rows_not_elements(dtype):
    """Attention's products on split heads, batched over dims that are not leading: an rhs that
    contracts its last dim (`q @ k.T`) goes to the kernel as rows, an lhs whose free dims are last
    (`q.T @ ds` in a gradient) as columns, each a copy of whole contiguous rows; no element-wise
    `linalg.transpose`."""
    heads = dict(lhs_contract=(3,), rhs_contract=(3,), lhs_batch=(0, 2), rhs_batch=(0, 2))
    mlir = check("dot_general", [data((2, 40, 3, 32), dtype, 1), data((2, 48, 3, 32), dtype, 2)], heads)
    assert "linalg.transpose" not in mlir
    grads = dict(lhs_contract=(1,), rhs_contract=(1,), lhs_batch=(0, 2), rhs_batch=(0, 2))
    mlir = check("dot_general", [data((2, 40, 3, 32), dtype, 3), data((2, 40, 3, 48), dtype, 4)], grads)
    assert "linalg.transpose" not in mlir


@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_kernel_batched_and_transposed():
    batched = dict(lhs_contract=(2,), rhs_contract=(1,), lhs_batch=(0,), rhs_batch=(0,))
    mlir = check("dot_general", [data((3, 37, 45), dt.float32, 1), data((3, 45, 70), dt.float32, 2)], batched)
    assert "vector.fma" in mlir
    check("dot_general", [data((2, 16, 40), dt.float64, 1), data((2, 40, 33), dt.float64, 2)], batched)  # M % 8 == 0
    mlir = check("dot_general", [data((2, 70, 120), dt.float32, 1), data((2, 120, 130), dt.float32, 2)], batched)
    assert ("scf.forall" in mlir) == ((os.cpu_count() or 1) > 1)
    transposed = dict(lhs_contract=(1,), rhs_contract=(1,), lhs_batch=(), rhs_batch=())
    mlir = check("dot_general", [data((70, 45), dt.float32, 1), data((90, 45), dt.float32, 2)], transposed)
    # B as (N, K) is packed from its rows (transposed in registers), not copied to (K, N) first
    assert "linalg.transpose" not in mlir and "vector.shuffle" in mlir and "vector.fma" in mlir


@pytest.mark.parametrize("bits", [512, 256])
def test_matmul_tile_rows(monkeypatch, bits):
    """The register tile's height fills the vector registers (14 rows of 2 vectors with AVX-512's
    32, 6 with AVX2's 16) for K >= TALL_TILE_MIN_K; short contractions keep 8 rows (at most the
    tall height); a product split by rows over the cores takes the height that pads a core's rows
    least; leftover rows run as one shorter tile unless they are a tiny share of M."""
    monkeypatch.setattr(host, "vector_bits", lambda: bits)
    monkeypatch.setattr(host, "cores", lambda: 2)
    matmul_plan.tile_rows.cache_clear()
    try:
        tall = 14 if bits == 512 else 6
        assert matmul_plan.tile_rows(2) == tall
        shape = matmul_plan.MatmulShape
        assert shape(0, 1024, 1024, 1024, "f32").mr == tall  # columns split: any height
        assert shape(0, 32, 256, 9, "f32").mr == min(8, tall)  # short K
        assert shape(0, 1024, 1024, 1024, "f32", serial=True).mr == tall
        if bits == 512:
            # one panel of columns (N = 10): split by rows, 32 rows per core: 8-row tiles, not 14
            assert shape(0, 64, 10, 6272, "f32").mr == 8
            ranges = matmul_plan._row_ranges
            assert ranges(shape(0, 100, 64, 128, "f32", serial=True)) == [((0, 98), 14), ((98, 100), 2)]
            assert ranges(shape(0, 1024, 64, 128, "f32", serial=True)) == [((0, 1022), 14), ((1022, 1024), 1)]
    finally:
        matmul_plan.tile_rows.cache_clear()


@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_tile_is_stored_by_one_write():
    """A whole panel's register tile is stored by one 2-D transfer_write (one tensor value for
    bufferization per tile, not one per vector); the partial panel's masked vectors one by one."""
    mlir = check("dot_general", [data((100, 128), dt.float32, 1), data((128, 70), dt.float32, 2)], MATMUL)
    lanes = host.vector_bits() // 32
    mr = matmul_plan.MatmulShape(0, 100, 70, 128, "f32").mr
    assert re.search(rf"vector.transfer_write [^\n]*in_bounds = \[true, true\][^\n]*vector<{mr}x{2 * lanes}xf32>", mlir)
    assert re.search(r"vector.transfer_write [^\n]*in_bounds = \[false\]", mlir)


@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_restrides_rows_that_alias_in_l1():
    """A whose rows are a multiple of 4 KiB apart is copied to rows one cache line longer before the
    tiles read it (with all of a tile's rows in one L1 set, every broadcast of A misses L1);
    results match for whole and leftover row blocks, a partial panel, f32/f64/i32, batched, split
    over the cores or not."""
    shape = matmul_plan.MatmulShape
    restrides = matmul_plan._restrides_a
    assert restrides(shape(0, 100, 70, 1024, "f32")) and restrides(shape(0, 100, 70, 512, "f64"))
    assert not restrides(shape(0, 100, 70, 1008, "f32")) and not restrides(shape(0, 100, 70, 512, "f32"))
    assert not restrides(shape(0, 100, 70, 1024, "f32", a_cols=True))  # packed or read by columns
    assert not restrides(shape(0, 100, 70, 1024, "f32", serial=True))  # no scratch of its own
    plain = matmul_plan.scratch_bytes(shape(0, 100, 70, 1008, "f32"))
    assert matmul_plan.scratch_bytes(shape(0, 100, 70, 1024, "f32")) >= plain + 100 * 1040 * 4
    mlir = check("dot_general", [data((100, 1024), dt.float32, 1), data((1024, 70), dt.float32, 2)], MATMUL)
    assert "tensor<100x1040xf32>" in mlir
    check("dot_general", [data((300, 512), dt.float64, 1), data((512, 200), dt.float64, 2)], MATMUL)
    check("dot_general", [data((29, 1024), dt.int32, 1), data((1024, 40), dt.int32, 2)], MATMUL)
    batched = dict(lhs_contract=(2,), rhs_contract=(1,), lhs_batch=(0,), rhs_batch=(0,))
    check("dot_general", [data((2, 45, 1024), dt.float32, 3), data((2, 1024, 96), dt.float32, 4)], batched)


def test_conv_restrides_weights_that_alias_in_l1(monkeypatch):
    """A convolution whose weight rows are a multiple of 4 KiB long (a 1x1 conv over 1024 channels)
    copies them one cache line apart before its chunks' fork (the chunks' products are serial and
    would read them in place), from the function's scratch area; results match."""
    monkeypatch.setattr(host, "cores", lambda: 2)
    x, w = data((4, 1024, 10, 10), dt.float32, 1), data((40, 1024, 1, 1), dt.float32, 2)
    mlir = check("conv2d", [x, w], dict(stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)))
    assert "tensor<40x1040xf32>" in mlir and "tensor.empty() : tensor<40x1040xf32>" not in mlir
    # chunks of whole images over the cores, the odd one after the fork (its product not serial)
    x5 = data((5, 1024, 14, 14), dt.float32, 5)
    check(
        "conv2d",
        [x5, data((64, 1024, 1, 1), dt.float32, 6)],
        dict(stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)),
    )
    w2 = data((24, 256, 2, 2), dt.float32, 3)  # 2x2 over 256 channels: rows of 1024 taps
    x2 = data((4, 256, 16, 16), dt.float32, 4)
    check("conv2d", [x2, w2], dict(stride=(2, 2), padding=((0, 0), (0, 0)), dilation=(1, 1)))


@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_kernel_k_loop_is_not_unrolled_by_llvm():
    """The micro-kernel's k loop reaches LLVM with `llvm.loop.unroll.disable`: otherwise O3 fully
    unrolls a short contraction (the CNN conv's K = 9) into 9x the FMAs. A block of 8 rows has a
    loop of 16 FMAs (2 vectors x 8 rows) at any vector width, 144 unrolled; LLVM may still unroll
    the loop over the 4 blocks (64 FMAs, against 576 with the k loop unrolled too)."""
    a, b = data((32, 9), dt.float32, 1), data((9, 256), dt.float32, 2)
    fn = fj.jit(lambda a, b: a @ b)
    fmas = len(re.findall(r"call .*@llvm\.fmuladd", fn.lower(a, b).as_text("llvm")))
    assert 0 < fmas < 9 * 16
    np.testing.assert_allclose(fn(a, b), a @ b, rtol=1e-5, atol=1e-5)


def test_short_loops_are_written_out_not_marked(monkeypatch):
    """Short loops of constant trip count are written out by the lowering (the im2col row's 2
    vector steps, the pack's 9 steps; the bias + relu epilogue's row by the transform schedule), so
    nothing reaches LLVM marked `llvm.loop.unroll.full`, which only its O3 pipeline honours: the
    function takes the light pipeline. The kernel's 4 row blocks are a loop (unmarked) around one
    copy of the register tile (written out, 4 copies lengthen the first call for the same run
    time). The conv output goes to NCHW through the epilogue's generic (no `linalg.transpose`,
    whose 28-element rows LLVM vectorizes behind an alias check). One thread."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    x, w, b = data((12, 1, 28, 28), dt.float32, 1), data((32, 1, 3, 3), dt.float32, 2), data((32,), dt.float32, 3)
    lowered = fj.jit(lambda x, w, b: nn.relu(nn.conv2d(x, w, b, padding=1))).lower(x, w, b)
    mlir = lowered.as_text("mlir")
    assert "linalg.transpose" not in mlir
    assert "llvm.loop.unroll.full" not in toolchain.lower_to_llvm_ir(mlir).llvm_ir
    assert lowered.as_text("llvm").startswith("; LLVM pipeline: light (")
    assert mlir.count("vector.fma") == 8 * 2  # one tile of 8 rows x 2 vectors, in a loop over 4 blocks
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    cols = np.stack([padded[:, 0, i : i + 28, j : j + 28] for i in range(3) for j in range(3)])
    want = np.maximum(np.einsum("ok,knhw->nohw", w.reshape(32, 9), cols) + b.reshape(1, 32, 1, 1), 0)
    np.testing.assert_allclose(lowered.compile()(x, w, b), want, rtol=1e-4, atol=1e-4)


def test_small_nd_kernels_with_short_rows_are_unrolled(monkeypatch):
    """A fused n-d kernel below `schedule.PARALLEL_MIN_ELEMENTS` with rows of a few vectors (the
    CNN's bias + relu at batch 4) gets the one-thread `copy_nd` schedule, whose row loop the
    transform schedule unrolls (without a schedule LLVM makes each 28-element row a vector loop plus
    a scalar remainder loop; marked for LLVM's unrolling instead, the function would need O3).
    Strided views keep no schedule when their rows end in a part of a vector (14-wide rows: LLVM's
    own vector loop is faster); views of whole vectors per row (an LSTM's gate columns) take it,
    since under LLVM's light pipeline a plain loop stays scalar."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    x, b = data((4, 32, 28, 28), dt.float32, 1), data((32,), dt.float32, 2)
    lowered = fj.jit(lambda x, b: nn.relu(x + b.reshape(1, 32, 1, 1))).lower(x, b)
    mlir = lowered.as_text("mlir")
    assert "fj.kernel" in mlir and "scf.forall" not in mlir  # small: one thread
    steps = -(-28 // schedule.lanes(32))
    assert "transform.loop.unroll %loop3" in mlir and f"{{factor = {steps}}}" in mlir
    scheduled = toolchain.apply_transform_schedule(mlir)
    assert scheduled.count("vector.transfer_write") == steps  # one per vector of a row, no row loop
    assert "llvm.loop.unroll.full" not in toolchain.lower_to_llvm_ir(mlir).llvm_ir
    assert lowered.as_text("llvm").startswith("; LLVM pipeline: light (")
    np.testing.assert_array_equal(lowered.compile()(x, b), np.maximum(x + b.reshape(1, 32, 1, 1), 0))
    strided = fj.jit(lambda x: x[:, :, :, ::2] * 2.0 + x[:, :, :, 1::2]).lower(x)
    assert "fj.kernel" not in strided.as_text("mlir")
    np.testing.assert_array_equal(strided.compile()(x), x[:, :, :, ::2] * 2.0 + x[:, :, :, 1::2])
    z = data((64, 256), dt.float32, 3)
    gate = fj.jit(lambda z: 1.0 / (1.0 + fnp.exp(-z[:, 64:128]))).lower(z)
    assert "fj.kernel" in gate.as_text("mlir") and gate.as_text("llvm").startswith("; LLVM pipeline: light (")
    np.testing.assert_allclose(gate.compile()(z), 1.0 / (1.0 + np.exp(-z[:, 64:128])), rtol=1e-6)


@pytest.mark.parametrize("shape", [(16, 200), (8, 512), (30, 100)])
def test_small_nd_kernels_with_long_rows_are_vectorized(monkeypatch, shape):
    """Up to `schedule.PLAIN_LOOP_MAX_ELEMENTS`, an n-d kernel with long rows (a bias and an
    activation on a small batch) gets `copy_nd`'s one-thread schedule: left as plain loops it would
    run under LLVM's light pipeline as scalar code, several times slower."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    x, b = data(shape, dt.float32, 1), data(shape[-1:], dt.float32, 2)
    lowered = fj.jit(lambda x, b: fnp.tanh(x + b)).lower(x, b)
    assert "fj.kernel" in lowered.as_text("mlir") and "scf.forall" not in lowered.as_text("mlir")
    assert lowered.as_text("llvm").startswith("; LLVM pipeline: light (")
    np.testing.assert_allclose(lowered.compile()(x, b), np.tanh(x + b), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    ("lead", "m", "n", "k", "dtype"),
    [
        ((), 70, 90, 45, dt.float32),
        ((), 33, 37, 19, dt.float32),  # odd N and K: partial panel, masked k tail
        ((), 9, 64, 128, dt.float64),
        ((), 40, 35, 77, dt.int32),
        ((), 24, 50, 33, dt.float16),
        ((3,), 21, 41, 29, dt.float32),
        ((2,), 70, 130, 120, dt.int64),
    ],
)
def test_matmul_kernel_rhs_rows(lead, m, n, k, dtype, specialized_matmul):
    """`a @ b.T`: the rhs arrives as (batch, N, K) and the kernel packs it without a transpose."""
    b = len(lead)
    dims = dict(lhs_contract=(b + 1,), rhs_contract=(b + 1,), lhs_batch=tuple(range(b)), rhs_batch=tuple(range(b)))
    mlir = check("dot_general", [data(lead + (m, k), dtype, 1), data(lead + (n, k), dtype, 2)], dims)
    assert "linalg.transpose" not in mlir and "vector.shuffle" in mlir
    # two free dims on the left become the kernel's rows (a view, no copy)
    check(
        "dot_general",
        [data((4, 9, 45), dt.float64, 1), data((45, 30), dt.float64, 2)],
        MATMUL | dict(lhs_contract=(2,)),
    )


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "rhs_rows"),
    [
        (64, 256, 128, dt.float32, False),
        (70, 300, 100, dt.float32, False),  # ragged M and a partial last panel (on the calling thread)
        (37, 520, 120, dt.float32, True),  # B as (N, K), packed from its rows panel by panel
        (40, 200, 300, dt.float64, False),
        (48, 170, 260, dt.int32, True),
        (300, 700, 20, dt.float32, False),  # a short contraction: rows split, B packed first
        (33, 280, 230, dt.float16, False),
    ],
)
@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_kernel_splits_columns_over_cores(m, n, k, dtype, rhs_rows):
    """Products with two or more panels per core split C's columns: each thread packs each of its
    panels into its own buffer just before using it (no serial packing of all of B)."""
    dims = MATMUL | (dict(rhs_contract=(1,)) if rhs_rows else {})
    mlir = check("dot_general", [data((m, k), dtype, 1), data((n, k) if rhs_rows else (k, n), dtype, 2)], dims)
    lanes = host.vector_bits() // (64 if dtype in (dt.float64, dt.int64) else 32)
    threads = host.cores()
    splits = threads > 1 and n // (2 * lanes) >= 2 * threads and m * n * k >= matmul_plan.PARALLEL_MIN_FLOPS
    splits = splits and k >= matmul_plan.COLUMN_SPLIT_MIN_K
    assert (f"tensor<1x{k}x{2 * lanes}x" in mlir) == splits
    assert ("scf.forall" in mlir) == (threads > 1 and m * n * k >= matmul_plan.PARALLEL_MIN_FLOPS)


@pytest.mark.parametrize(
    ("lead", "m", "n", "k", "dtype"),
    [
        ((), 70, 150, 45, dt.float32),  # 5 panels: A packed by blocks of MR columns, the 6 rows left one tile
        ((), 64, 300, 19, dt.float64),
        ((), 33, 10, 19, dt.float32),  # one partial panel: A read in place, by columns
        ((), 40, 135, 77, dt.int32),
        ((), 24, 50, 33, dt.float16),
        ((3,), 21, 141, 29, dt.float32),
        ((2,), 70, 130, 120, dt.int64),
        ((), 300, 200, 64, dt.float32),  # above PARALLEL_MIN_FLOPS: each core packs its own rows
    ],
)
@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_kernel_lhs_columns(lead, m, n, k, dtype):
    """`a.T @ b` (weight gradients): the lhs arrives as (batch, K, M) and the kernel reads its
    columns (packed when several panels re-read them), without a transpose copy."""
    b = len(lead)
    dims = dict(lhs_contract=(b,), rhs_contract=(b,), lhs_batch=tuple(range(b)), rhs_batch=tuple(range(b)))
    mlir = check("dot_general", [data(lead + (k, m), dtype, 1), data(lead + (k, n), dtype, 2)], dims)
    assert "linalg.transpose" not in mlir and ("vector.fma" in mlir or dtype.is_int)
    panels = -(-n // (2 * host.vector_bits() // (64 if dtype in (dt.float64, dt.int64) else 32)))
    elem = {dt.float64: "f64", dt.int32: "i32", dt.int64: "i64"}.get(dtype, "f32")
    mr = matmul_plan.MatmulShape(lead[0] if lead else 0, m, n, k, elem, a_cols=True).mr
    packs = re.search(rf"tensor<{''.join(f'{d}x' for d in lead)}{k}x{m}x\w+>, vector<{mr}x", mlir) is not None
    assert packs == (panels >= matmul_plan.PACK_A_MIN_PANELS)
    # both operands transposed: `a.T @ b.T`
    check(
        "dot_general",
        [data((k, m), dtype, 3), data((n, k), dtype, 4)],
        MATMUL | dict(lhs_contract=(0,), rhs_contract=(1,)),
    )


# --- transpose -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL, ids=ids(ALL))
@pytest.mark.parametrize(
    "shape, perm, blocks",
    [
        ((131, 170), (1, 0), True),  # edge blocks on both dims
        ((256, 64), (1, 0), True),
        ((4, 8, 56, 56), (0, 2, 3, 1), True),  # NCHW -> NHWC: (N, C, H*W) -> (N, H*W, C), whole blocks
        ((3, 20, 24, 16), (3, 1, 0, 2), True),
        ((5, 7, 60), (0, 2, 1), False),  # rank 3 with edge blocks stays plain (see `_in_blocks`)
        ((2, 3, 4, 5), (0, 2, 3, 1), False),  # too small for blocks
        ((40, 30, 20), (1, 0, 2), "rows"),  # the input's last dim stays last: vector copies of rows
        ((8, 30, 20), (1, 0, 2), "rows"),
        ((3, 30, 20), (1, 0, 2), False),  # rows, but too small for a schedule (plain loops)
    ],
)
def test_transpose_in_blocks(shape, perm, blocks, dtype):
    """Permuted copies, dims merged where the output keeps them together, large ones moved in
    square blocks (`schedule.transpose_blocks`) or, when the input's last dim stays last, as
    vector copies of rows (`schedule.copy_nd`), against the reference interpreter."""
    mlir = check("transpose", [data(shape, dtype, 3)], dict(perm=perm))
    assert ("transform.structured.vectorize" in mlir) == bool(blocks)  # plain loops have no schedule
    assert ("transform.structured.vectorize" in mlir and "vector_sizes [1, 1, " in mlir) == (blocks == "rows")


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.bool_], ids=ids([dt.float32, dt.float64, dt.bool_]))
@pytest.mark.parametrize("shape", [(6272, 10), (6000, 3), (1000, 17), (2000, 9)])
def test_transpose_rows_past_whole_blocks_are_a_kernel_of_their_own(shape, dtype):
    """A 2-D transpose whose output rows are no multiple of the block side: the whole blocks of rows,
    then the rows left in tiles of all of them (`lower_layout._transposed_in_two`), so that no block
    stores rows past the output's end under all-false masks (each a microcode assist on a page never
    mapped)."""
    mlir = check("transpose", [data(shape, dtype, 4)], dict(perm=(1, 0)))
    side = schedule.transpose_block(32 if dtype == dt.float32 else 64 if dtype == dt.float64 else 8)
    rest = shape[1] % side
    assert f"vector_sizes [{rest}, {side}]" in mlir
    assert (f"vector_sizes [{side}, {side}]" in mlir) == (shape[1] >= side)


@pytest.mark.parametrize("shape, perm", [((8, 32, 28, 28), (1, 0, 2, 3)), ((4, 8, 56, 56), (0, 2, 3, 1))])
def test_transpose_of_merged_dims_is_written_in_its_output(shape, perm):
    """A transpose moved on merged dims ((8, 32, 784) -> (32, 8, 784) for NCHW's N <-> C) writes
    its output through a view of that shape (`lower_layout.written_through`): stored through a
    1-D view it would fill a temporary copied out (200704 floats in every conv weight gradient). (A
    transpose too small for a schedule still copies: MLIR's elementwise fusion expands its plain
    generic back to the result's dims, which no longer match the view.)"""
    mlir = check("transpose", [data(shape, dt.float32, 3)], dict(perm=perm))
    bufferized = mlir_pipeline.run_mlir(
        toolchain.apply_transform_schedule(mlir), [pipeline.stage_pipeline("bufferize")]
    )
    assert "memref.copy" not in bufferized and "memref.alloc" not in bufferized


# --- conv2d, pooling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=ids(FLOATS))
def test_conv2d_stride_padding_dilation(dtype):
    x, w = data((2, 3, 9, 8), dtype, 1), data((4, 3, 3, 2), dtype, 2)
    check("conv2d", [x, w], dict(stride=(2, 1), padding=((1, 2), (0, 1)), dilation=(1, 2)))
    check("conv2d", [x, w], dict(stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)))


def test_conv2d_deep_goes_through_im2col_and_the_matmul_kernel():
    x, w = data((3, 16, 11, 10), dt.float32, 1), data((20, 16, 3, 3), dt.float32, 2)
    mlir = check("conv2d", [x, w], dict(stride=(2, 2), padding=((1, 1), (2, 0)), dilation=(1, 1)))
    assert "vector.fma" in mlir
    shallow = check(
        "conv2d", [x[:, :1], w[:5, :1, :2, :2]], dict(stride=(1, 1), padding=((0, 0),) * 2, dilation=(1, 1))
    )
    assert "vector.fma" not in shallow  # 4 taps: the direct generic


@pytest.mark.parametrize("cores", [1, 2])
def test_conv2d_im2col_in_chunks_of_images(monkeypatch, cores):
    """A column-matrix cap below the batch's size: chunks of whole images, then a tail chunk; on two
    cores the whole chunks are split over them (a forall), on one they run in a loop. 11 images,
    4 fit: no divisor of 11 between 2 and 4, so chunks of 4 and a tail of 3."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")  # neither setting is part of the cache key
    monkeypatch.setattr(lower_conv, "IM2COL_MAX_ELEMENTS", 4 * 18 * 7 * 4)
    monkeypatch.setattr(lower_conv, "IM2COL_MIN_COLUMNS", 1)
    monkeypatch.setattr(host, "cores", lambda: cores)
    x, w = data((11, 2, 9, 8), dt.float32, 1), data((3, 2, 3, 3), dt.float32, 2)
    mlir = check("conv2d", [x, w], dict(stride=(1, 2), padding=((0, 0), (1, 1)), dilation=(1, 1)))
    assert "tensor<4x3x7x4xf32>" in mlir and "tensor<3x3x7x4xf32>" in mlir  # chunks of 4, tail of 3
    assert ("scf.forall" in mlir) == (cores == 2)


@pytest.mark.parametrize("cores, images", [(1, 4), (2, 3)])
def test_conv2d_chunks_of_images_divide_the_batch(monkeypatch, cores, images):
    """Chunks of a number of images that divides the batch when one is at least half of those that
    fit (`_whole_images`): no tail chunk repeating the chunk's code. 12 images, 4 fit: chunks of 4
    on one core, of 3 on two (four chunks, two per core; 4 would make three)."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(lower_conv, "IM2COL_MAX_ELEMENTS", 4 * 18 * 7 * 4)
    monkeypatch.setattr(lower_conv, "IM2COL_MIN_COLUMNS", 1)
    monkeypatch.setattr(host, "cores", lambda: cores)
    x, w = data((12, 2, 9, 8), dt.float32, 1), data((3, 2, 3, 3), dt.float32, 2)
    mlir = check("conv2d", [x, w], dict(stride=(1, 2), padding=((0, 0), (1, 1)), dilation=(1, 1)))
    chunks = {int(m) for m in re.findall(r"tensor<(\d+)x3x7x4xf32>", mlir)} - {12}
    assert chunks == {images}
    assert ("scf.forall" in mlir) == (cores == 2)


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize(
    "stride, dilation, padding", [((1, 1), (1, 1), ((1, 1), (1, 1))), ((2, 1), (2, 1), ((2, 0), (1, 2)))]
)
def test_conv2d_im2col_in_blocks_of_rows(monkeypatch, stride, dilation, padding, cores):
    """One image's column matrix above the cap: each image in blocks of output rows (whole blocks,
    split over the cores or in a loop, then each image's tail block), reading the rows under them."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: cores)
    x, w = data((2, 3, 13, 8), dt.float32, 1), data((4, 3, 3, 2), dt.float32, 2)
    depth, out_cols = 3 * 3 * 2, (8 + sum(padding[1]) - dilation[1] * 1 - 1) // stride[1] + 1
    monkeypatch.setattr(lower_conv, "IM2COL_MAX_ELEMENTS", 3 * depth * out_cols)  # blocks of 3 rows
    monkeypatch.setattr(lower_conv, "IM2COL_MIN_COLUMNS", 1)
    mlir = check("conv2d", [x, w], dict(stride=stride, padding=padding, dilation=dilation))
    assert f"tensor<1x4x3x{out_cols}xf32>" in mlir  # a block of 3 output rows of one image


def test_conv2d_blocks_of_rows_are_computed_in_the_output(monkeypatch):
    """A convolution without an epilogue whose chunks are blocks of one image's output rows computes
    each block's product in its window of the output. As a product of its own reshaped to the
    window it would be a temporary copied out, a strided copy: plain loops, which put the whole
    function on LLVM's O3 and double its first call."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    x, w = data((2, 8, 48, 48), dt.float32, 3), data((8, 8, 3, 3), dt.float32, 4)
    attrs = dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1))
    mlir = check("conv2d", [x, w], attrs)
    bufferized = mlir_pipeline.run_mlir(
        toolchain.apply_transform_schedule(mlir), [pipeline.stage_pipeline("bufferize")]
    )
    assert "memref.copy" not in bufferized
    graph = Graph("conv")
    params = [graph.add_param(TensorType(a.shape, dt.float32)) for a in (x, w)]
    graph.results = list(emit(graph, "conv2d", params, attrs).results)
    assert compile_graph(graph, "cpu").stages["llvm"].startswith("; LLVM pipeline: light")


def test_conv2d_mid_size_padded_input_is_vector_code(monkeypatch):
    """A padded copy of the input above `schedule.PLAIN_LOOP_MAX_ELEMENTS` but below the parallel
    size is vector code too (`lower_movement._vector_pad`): as a scalar copy loop it would keep the
    whole function on LLVM's O3, nearly doubling its first call.
    A weight gradient (summed over its taps) keeps O3, which runs it faster."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    x, w = data((32, 8, 14, 14), dt.float32, 1), data((16, 8, 3, 3), dt.float32, 2)
    monkeypatch.setattr(lower_conv, "_im2col_pads", lambda *args: False)  # padded by a copy
    lowered = fj.jit(lambda x, w: nn.conv2d(x, w, padding=1)).lower(x, w)
    assert "tensor<32x8x16x16xf32>" in lowered.as_text("mlir")
    assert lowered.as_text("llvm").startswith("; LLVM pipeline: light (")
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = sum(
        np.einsum("oc,nchw->nohw", w[:, :, i, j], padded[:, :, i : i + 14, j : j + 14])
        for i in range(3)
        for j in range(3)
    )
    np.testing.assert_allclose(lowered.compile()(x, w), want, rtol=1e-4, atol=1e-4)
    grad = fj.jit(fj.grad(lambda w, x: fnp.sum(nn.conv2d(x, w, padding=1) ** 2))).lower(w, x)
    assert grad.as_text("llvm").startswith("; LLVM pipeline: O3 (for the scalar loops of: conv2d)")


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv2d_chunks_of_images_are_transposed_into_the_output(monkeypatch, cores, stride):
    """A convolution without an epilogue whose chunks are runs of whole images transposes each
    chunk's product (O, N, OH, OW) straight into its images of the output (NCHW): as a transpose of
    its own it was a temporary copied into a strided window of the output."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: cores)
    monkeypatch.setattr(lower_conv, "IM2COL_MAX_ELEMENTS", 2 * 18 * 8 * 8)
    monkeypatch.setattr(lower_conv, "IM2COL_MIN_COLUMNS", 1)
    x, w = data((8, 2, 16, 16), dt.float32, 3), data((8, 2, 3, 3), dt.float32, 4)
    attrs = dict(stride=(stride, stride), padding=((1, 1), (1, 1)), dilation=(1, 1))
    mlir = check("conv2d", [x, w], attrs)
    bufferized = mlir_pipeline.run_mlir(
        toolchain.apply_transform_schedule(mlir), [pipeline.stage_pipeline("bufferize")]
    )
    assert "memref.copy" not in bufferized


@pytest.mark.parametrize("dtype", [dt.float16, dt.float64], ids=["f16", "f64"])
def test_conv2d_im2col_chunks_in_other_types(monkeypatch, dtype):
    """The chunked paths widen half types to float32 and keep float64 (blocks of rows, two cores)."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: 2)
    monkeypatch.setattr(lower_conv, "IM2COL_MAX_ELEMENTS", 2 * 27 * 9)
    monkeypatch.setattr(lower_conv, "IM2COL_MIN_COLUMNS", 1)
    x, w = data((3, 3, 11, 9), dtype, 1), data((5, 3, 3, 3), dtype, 2)
    check("conv2d", [x, w], dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1)))


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("cap", [1 << 19, 3 * 10 * 7], ids=["whole-images", "blocks-of-rows"])
def test_conv2d_pointwise_reads_the_input_as_its_columns(monkeypatch, cap, cores):
    """1x1, stride 1: each image's (C, H*W) view (or a block of its rows) is the column matrix;
    with padding the view is of the padded input."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: cores)
    monkeypatch.setattr(lower_conv, "WIDE_CHUNK_ELEMENTS", cap)  # a 1x1 conv's chunks
    x, w = data((3, 10, 9, 7), dt.float32, 1), data((6, 10, 1, 1), dt.float32, 2)
    mlir = check("conv2d", [x, w], dict(stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)))
    columns = 63 if cap == 1 << 19 else 21  # a whole image, or blocks of 3 of its 9 rows
    assert f"[1, 10, {columns}] [1, 1, 1] : tensor<3x10x63xf32> to tensor<10x{columns}xf32>" in mlir
    assert f"tensor<{10 * columns}xf32>" not in mlir  # no im2col column matrix
    check("conv2d", [x, w], dict(stride=(1, 1), padding=((1, 0), (0, 2)), dilation=(1, 1)))


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize(
    "stride, dilation, padding", [((1, 1), (1, 1), ((0, 0), (0, 0))), ((1, 2), (2, 1), ((1, 0), (2, 1)))]
)
def test_conv2d_summed_over_chunks_of_taps(monkeypatch, cores, dtype, stride, dilation, padding):
    """Output rows shorter than the kernel's (a weight gradient's shape): the sum over chunks of
    (c, kh) pairs, split over the cores with a partial sum each, or in one loop."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: cores)
    x, w = data((3, 4, 24, 15), dtype, 1), data((5, 4, 9, 10), dtype, 2)
    attrs = dict(stride=stride, padding=padding, dilation=dilation)
    oh = (24 + sum(padding[0]) - dilation[0] * 8 - 1) // stride[0] + 1
    ow = (15 + sum(padding[1]) - dilation[1] * 9 - 1) // stride[1] + 1
    monkeypatch.setattr(lower_conv, "WIDE_CHUNK_ELEMENTS", 3 * oh * ow * 10 * 6)  # 6 of the 36 pairs per chunk
    mlir = check("conv2d", [x, w], attrs)
    assert f"tensor<{3 * oh * ow}x60x" in mlir  # a chunk of rows: 6 (c, kh) pairs of 10 taps
    assert ("scf.forall" in mlir) == (cores == 2)


def test_conv2d_weight_gradient_through_the_taps_form(monkeypatch):
    """fj.grad of a conv layer: its weight gradient is such a convolution; compiled equals the
    reference interpreter."""
    x = np.random.default_rng(3).standard_normal((4, 6, 30, 30)).astype(np.float32)
    w = np.random.default_rng(4).standard_normal((8, 6, 3, 3)).astype(np.float32)
    loss = lambda w, x: fnp.sum(nn.relu(nn.conv2d(x, w, stride=2, padding=1)) ** 2)
    calls = []
    taps_form = lower_conv._conv_over_taps
    monkeypatch.setenv("FLOWJIT_CACHE", "0")  # a cached compile would skip the lowering
    monkeypatch.setattr(lower_conv, "_conv_over_taps", lambda *a: calls.append(a) or taps_form(*a))
    got = fj.jit(fj.grad(loss, argnums=(0, 1)))(w, x)
    assert len(calls) == 1  # the weight gradient's conv, and only it
    want = fj.jit(fj.grad(loss, argnums=(0, 1)), target="interpreter")(w, x)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-3)


def test_conv2d_cnn_shape_and_1x1():
    check(
        "conv2d",
        [data((4, 1, 28, 28), dt.float32, 1), data((32, 1, 3, 3), dt.float32, 2)],
        dict(stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)),
    )
    check(
        "conv2d",
        [data((1, 5, 1, 1), dt.float64, 1), data((2, 5, 1, 1), dt.float64, 2)],
        dict(stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)),
    )


@pytest.mark.parametrize("dtype", NUMERIC, ids=ids(NUMERIC))
@pytest.mark.parametrize("kind", ["max", "sum", "avg"])
def test_reduce_window(dtype, kind):
    if kind == "avg" and not dtype.is_float:
        pytest.skip("avg pooling is defined for floats only")
    x = data((2, 3, 7, 6), dtype)
    attrs = dict(kind=kind, window=(1, 1, 2, 3), strides=(1, 1, 2, 2), padding=((0, 0), (0, 0), (1, 0), (1, 1)))
    check("reduce_window", [x], attrs)
    if kind == "max":  # the CNN pooling layer
        check("reduce_window", [x], attrs | dict(window=(1, 1, 2, 2), strides=(1, 1, 2, 2), padding=((0, 0),) * 4))


@pytest.mark.parametrize("dtype", [dt.float32, dt.float16, dt.int64], ids=ids([dt.float32, dt.float16, dt.int64]))
def test_reduce_window_ranks_strides_and_long_rows(dtype):
    for kind in ("max", "sum"):
        check("reduce_window", [data((37,), dtype)], dict(kind=kind, window=(3,), strides=(2,), padding=((1, 2),)))
        x = data((5, 40), dtype)
        check("reduce_window", [x], dict(kind=kind, window=(2, 2), strides=(1, 3), padding=((0, 0), (0, 0))))
        check("reduce_window", [x], dict(kind=kind, window=(1, 1), strides=(1, 1), padding=((0, 0), (2, 2))))


@pytest.mark.parametrize(
    "shape, dtype, kind, window, pad",
    [
        ((2, 8, 130, 130), dt.float32, "max", 3, 1),  # chunks of images over the cores
        ((1, 30, 100, 100), dt.float32, "avg", 2, 0),  # one image: chunks of channels
        ((3, 16, 90, 90), dt.float32, "max", 2, 0),  # 3 images on 2 cores: a shorter last chunk
        ((1, 4, 64, 64), dt.float16, "max", 2, 0),  # f16 rows read as whole vectors, widened
        ((2, 3, 40, 41), dt.int64, "sum", 3, 1),
    ],
)
def test_pooling_over_the_cores_with_stride_two_rows(shape, dtype, kind, window, pad):
    """Large poolings split their output planes over the cores; rows of at least a vector read
    their inputs by in-bounds vector reads (no masked read past the row): a window as wide as its
    step, one read of the inputs under a vector of outputs per window row."""
    from flowjit.backends.cpu import host, schedule

    x = data(shape, dtype)
    if dtype.is_float:
        x.flat[::997] = np.nan
    attrs = dict(
        kind=kind, window=(1, 1, window, window), strides=(1, 1, 2, 2), padding=((0, 0), (0, 0), (pad, pad), (pad, pad))
    )
    mlir = check("reduce_window", [x], attrs)
    out = [(n + 2 * pad - window) // 2 + 1 for n in shape[2:]]
    work = shape[0] * shape[1] * out[0] * out[1] * window * window
    assert ("scf.forall" in mlir) == (schedule.threads() > 1 and work >= schedule.PARALLEL_MIN_ELEMENTS)
    lanes = host.vector_bits() // (64 if dtype == dt.int64 else 32)
    if out[1] >= lanes:  # every row whole vectors: no wide masked read
        wide = [line for line in mlir.splitlines() if "transfer_read" in line and f"vector<{2 * lanes}x" in line]
        assert all("in_bounds = [true]" in line for line in wide)
        assert bool(wide) == (window == 2)  # the window rows' reads (`_window_rows_then_columns`)


def test_max_pool_propagates_nan_and_window_over_channels():
    x = data((1, 4, 5, 5), dt.float32)
    x[0, 1, 2, 3] = np.nan
    check("reduce_window", [x], dict(kind="max", window=(1, 2, 3, 3), strides=(1, 1, 1, 2), padding=((0, 0),) * 4))


@pytest.mark.parametrize("window", [2, 3])
def test_max_pool_propagates_nan_from_every_tap(window):
    """Windows as wide as their step (read a row at a time, columns picked by shuffles), their max
    NaN-propagating though unordered on signed zeros (`fastmath<nsz>`): a NaN at each tap of a
    window (one channel per tap), in rows of more and of fewer outputs than a vector, comes out;
    -0.0 and +0.0 compare equal."""
    for width in (40 * window, 7 * window):
        x = data((2, window * window, 2 * window, width), dt.float32)
        x[0, 0, 0, 0], x[0, 0, 0, 1] = -0.0, 0.0
        for tap in range(window * window):
            r, c = divmod(tap, window)
            x[1, tap, r, window + c] = np.nan
        attrs = dict(kind="max", window=(1, 1, window, window), strides=(1, 1, window, window), padding=((0, 0),) * 4)
        assert "fastmath<nsz>" in check("reduce_window", [x], attrs)


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.float16], ids=ids([dt.float32, dt.float64, dt.float16]))
@pytest.mark.parametrize("window", [2, 3])
def test_pooling_short_rows_read_only_their_windows(dtype, window):
    """Rows of fewer outputs than a vector (the CNN's 14 of 16 lanes) read each window row's inputs
    under a mask of the inputs their outputs use, in bounds, and store under a mask of the row,
    in bounds: no mask of the tensor's end per read or store. Columns no window covers (a width
    one past the windows) hold NaN and infinities that must not reach an output, the last row's
    among them, whose full-width read would run past the tensor's end."""
    lanes = host.vector_bits() // (64 if dtype == dt.float64 else 32)
    outputs = lanes - 2
    width = outputs * window + 1
    x = data((2, 3, 2 * window, width), dtype)
    x[..., -1] = np.nan
    x[0, 0, :, -1] = np.inf
    x[1, 2, -1, -1] = -np.inf
    x[1, 1, 0, 0] = np.nan  # a NaN inside a window comes out
    for kind in ("max", "avg"):
        attrs = dict(kind=kind, window=(1, 1, window, window), strides=(1, 1, window, window), padding=((0, 0),) * 4)
        mlir = check("reduce_window", [x], attrs)
        wide = [line for line in mlir.splitlines() if "transfer_read" in line and f"vector<{window * lanes}x" in line]
        masked = re.compile(r"transfer_read %\S+\[%\S+\], %\S+, %\S+ \{in_bounds = \[true\]\}")
        assert wide and all(masked.search(line) for line in wide)
        stores = [line for line in mlir.splitlines() if "transfer_write" in line and f"vector<{lanes}x" in line]
        assert stores and all("in_bounds = [true]" in line for line in stores)


# --- argmax, argmin ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMERIC, ids=ids(NUMERIC))
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_arg_extremes_first_index(name, dtype):
    x = data((4, 7), dtype) % 3 if dtype.is_int else np.round(data((4, 7), dtype))
    for axis in (0, 1):
        check(name, [x.astype(dtype.np_dtype)], dict(axis=axis, index_dtype="i32"))
    check(name, [data((1,), dtype)], dict(axis=0, index_dtype="i64"))
    check(name, [data((19,), dtype)], dict(axis=0, index_dtype="i64"))  # a scalar result


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_arg_extremes_nan_and_inf(name):
    x = np.array(
        [[1, np.nan, 5, np.nan], [-np.inf, -np.inf, -np.inf, -np.inf], [np.inf, np.inf, 2, np.inf], [0, 0, -0.0, 3]],
        np.float32,
    )
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        check(name, [x.astype(dtype)], dict(axis=1, index_dtype="i64"))
        check(name, [x.astype(dtype)], dict(axis=0, index_dtype="i32"))


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.int32], ids=ids([dt.float32, dt.float64, dt.int32]))
def test_arg_extremes_long_rows(name, dtype):
    """Rows long enough for the unrolled accumulators, and enough rows to split over cores; small
    integer values make ties across lanes and accumulators."""
    x = np.round(data((300, 1001), dtype, 3) * 2).astype(dtype.np_dtype)
    if dtype.is_float:
        x[5, 700] = x[5, 900] = np.nan
        x[7, :] = -np.inf if name == "argmax" else np.inf
        x[9, 1000] = np.nan
    check(name, [x], dict(axis=1, index_dtype="i64"))
    check(name, [x[:, :70]], dict(axis=1, index_dtype="i32"))


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("dtype", [dt.float32, dt.float64, dt.bfloat16], ids=ids([dt.float32, dt.float64, dt.bfloat16]))
def test_float_extremes_across_lanes_keep_nan(kind, dtype):
    """Row max/min end in a reduction across a vector's lanes, which `lane_extremes` makes a tree of
    plain max/min plus a nan test (no `llvm.vector.reduce.fmaximum`): nan in any position of a row
    (first, last, all) still gives nan, infinities and all-equal rows their value, in whole tiles of
    rows, the peeled partial tile and rows of several vectors."""
    for shape in ((40, 16), (37, 64), (21, 300)):
        x = data(shape, dtype, 5)
        x[0, 0] = x[1, -1] = np.nan
        x[2, :] = np.nan
        x[3, :] = np.inf
        x[4, :] = -np.inf
        x[5, :] = 2.0
        x[shape[0] - 1, shape[1] // 2] = np.nan  # in the partial last tile of rows
        check(f"reduce_{kind}", [x], dict(axes=(1,)))
    graph = Graph("extremes")
    (p,) = [graph.add_param(TensorType((64, 64), dtype))]
    graph.results = list(emit(graph, f"reduce_{kind}", [p], dict(axes=(1,))).results)
    llvm = compile_graph(graph, "cpu").stages["llvm"]
    assert "llvm.vector.reduce.fmaximum" not in llvm and "llvm.vector.reduce.fminimum" not in llvm
    assert re.search(rf"nnan .*@llvm\.vector\.reduce\.f{kind}\.", llvm)


def test_row_tiles_peel_the_partial_last_tile_of_rows():
    """Rows not a whole number of tiles (or of chunks over the cores): the last tile of each chunk is
    peeled off, so the others have a static size and are not masked."""
    for rows, peels in ((8 * 11 + 5, 1), (8 * 11, 0), (schedule.PARALLEL_MIN_ELEMENTS // 48 + 3, 1)):
        mlir = check("reduce_sum", [data((rows, 48), dt.float32, 6)], dict(axes=(1,)))
        assert mlir.count("transform.loop.peel") == peels, rows
    mlir = check("reduce_max", [data((8 * 11 + 5, 40), dt.float32, 7)], dict(axes=(1,)))
    assert mlir.count("transform.loop.peel") == 3  # the rows; the partial chunk of each kind of tile


def test_row_chunks_over_the_cores_are_whole_when_they_can_be():
    """Chunks of a row reduction's rows over the cores divide the rows when some chunk near the
    target does, in a number the cores share evenly: no tile is peeled off for the last chunk (half
    the kernel's code): on two cores, 20000 rows of 50 take chunks of 1000 rows, not 1248 and a
    peeled last 32."""
    for a in (20000, 30000, 50000, 4096):
        chunk = schedule._row_chunk(a, 8)
        assert chunk % 8 == 0 and a % chunk == 0 and (a // chunk) % schedule.threads() == 0, (a, chunk)
    assert schedule._row_chunk(8 * 683, 8) % 8 == 0  # 683 tiles (a prime): a partial last chunk
    mlir = check("reduce_max", [data((20000, 50), dt.float32, 8)], dict(axes=(1,)))
    assert mlir.count("transform.loop.peel") == 1  # the partial column chunk only


@pytest.mark.parametrize("dtype", [dt.float32, dt.float64], ids=ids([dt.float32, dt.float64]))
def test_rows_of_one_chunk_and_a_part_take_narrower_chunks(dtype):
    """A row of one whole chunk and a partial one (24 = 16 + 8 float32 columns, 100 = 64 + 36) is
    reduced in narrower chunks, at least two: with one, the chunk's reduction folded into its input
    and the partial chunk's update copied the tile each step."""
    lanes = schedule.lanes(dtype.bits)
    for width, chunk in ((lanes + lanes // 2, lanes // 2), (6 * lanes + 4, lanes), (3 * lanes, lanes)):
        for kind in ("max", "sum"):
            mlir = check(f"reduce_{kind}", [data((8 * 7 + 3, width), dtype, 11)], dict(axes=(1,)))
            assert f"by tile_sizes = [0, {chunk}]" in mlir, (width, mlir)


def test_loop_temporaries_are_allocated_once_per_thread():
    """A row reduction whose partial chunk updates part of its accumulator stores the accumulator; its
    allocation is hoisted out of the row loop (`buffer-loop-hoisting` in the "bufferize" stage), not
    out of the `scf.forall` chunk each thread runs: one per thread, not one per row."""
    from mlir import ir

    x = data((schedule.PARALLEL_MIN_ELEMENTS // 100 + 7, 100), dt.float32, 12)
    mlir = check("reduce_max", [x], dict(axes=(1,)))
    scheduled = toolchain.apply_transform_schedule(mlir)
    bufferized = mlir_pipeline.run_mlir(scheduled, [pipeline.stage_pipeline("bufferize")])
    enclosing = []
    with mlir_pipeline.mlir_context():
        module = ir.Module.parse(bufferized)

        def visit(op):
            if op.name == "memref.alloc":
                names, parent = [], op.parent
                while parent is not None:
                    names.append(parent.name)
                    parent = parent.parent
                enclosing.append(names)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    assert enclosing and all("scf.forall" in names and "scf.for" not in names for names in enclosing), enclosing


SHORT_ROW_DTYPES = [dt.float32, dt.float64, dt.float16, dt.int32]


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("dtype", SHORT_ROW_DTYPES, ids=ids(SHORT_ROW_DTYPES))
def test_arg_extremes_short_rows(name, dtype):
    """Rows shorter than a vector, a vector of rows at a time (`_ArgRows.across_rows`): whole tiles
    split over the cores, then a partial tile; ties (the first index wins), nan (the first nan),
    infinities; and leading dims."""
    rows = schedule.PARALLEL_MIN_ELEMENTS // 5 + 19
    x = np.round(data((rows, 5), dtype, 4)).astype(dtype.np_dtype)
    if dtype.is_float:
        x[3, 2] = x[3, 4] = np.nan
        x[rows - 1, 4] = np.nan
        x[8, :] = -np.inf if name == "argmax" else np.inf
    mlir = check(name, [x], dict(axis=1, index_dtype="i64"))
    assert "vector.shuffle" in mlir
    check(name, [x[:40]], dict(axis=1, index_dtype="i32"))
    check(name, [x[:6, :2]], dict(axis=1, index_dtype="i32"))
    check(name, [x[:60].reshape(3, 4, 5, 5)[..., :3]], dict(axis=3, index_dtype="i64"))


# --- no access outside the buffers -------------------------------------------------------------------

PAGE = mmap.PAGESIZE
PROT_NONE = 0


def guarded(array: np.ndarray, at_end: bool) -> np.ndarray:
    """A copy of `array` in memory flanked by pages the process may not touch (PROT_NONE), placed
    flush against the page after it (`at_end`) or the page before it: any generated load or store
    outside the array faults instead of passing silently."""
    pages = -(-array.nbytes // PAGE) + 2
    region = mmap.mmap(-1, pages * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    for page in (0, pages - 1):
        assert libc.mprotect(ctypes.c_void_p(base + page * PAGE), PAGE, PROT_NONE) == 0
    offset = (pages - 1) * PAGE - array.nbytes if at_end else PAGE
    copy = np.frombuffer(region, array.dtype, count=array.size, offset=offset).reshape(array.shape)
    copy[...] = array
    return copy


CONV_ATTRS = dict(stride=(2, 1), padding=((1, 2), (0, 1)), dilation=(1, 2))
PAD_HW = dict(low=(0, 0, 1, 1), high=(0, 0, 1, 1), interior=(0,) * 4)  # an NCHW image's edges
GUARDED_CASES = [
    ("gather", [data((20, 70), dt.float32), np.array([[25, -3, 19]], np.int64)], dict(axis=0)),
    ("gather", [data((9, 5), dt.float64), np.array([9, -1, 4], np.int32)], dict(axis=0)),
    (
        "scatter_add",
        [data((12, 70), dt.float32), np.array([30, -2, 11], np.int64), data((3, 70), dt.float32)],
        dict(axis=0),
    ),
    ("scatter_add", [data((6, 3), dt.int32), np.array([7, -7], np.int64), data((2, 3), dt.int32)], dict(axis=0)),
    (
        "dynamic_slice",
        [data((7, 9), dt.float32), np.asarray(50, np.int64), np.asarray(-50, np.int64)],
        dict(sizes=(3, 4)),
    ),
    ("argmax", [data((5, 37), dt.float32)], dict(axis=1, index_dtype="i64")),
    ("argmin", [data((3, 70), dt.float16)], dict(axis=1, index_dtype="i32")),
    (
        "reduce_window",
        [data((2, 3, 9, 11), dt.float32)],
        dict(kind="max", window=(1, 1, 3, 3), strides=(1, 1, 2, 2), padding=((0, 0),) * 4),
    ),
    ("dot_general", [data((33, 45), dt.float32), data((45, 37), dt.float32)], MATMUL),
    ("dot_general", [data((13, 101), dt.float64), data((101,), dt.float64)], MATMUL),
    ("concatenate", [data((3, 70), dt.float32), data((3, 33), dt.float32)], dict(axis=1)),
    # blocks shorter than a vector: one masked copy per row, the last one at the buffer's end
    ("concatenate", [data((5, 3), dt.float32), data((5, 1), dt.float32), data((5, 2), dt.float32)], dict(axis=1)),
    ("concatenate", [data((4, 2, 3), dt.bool_), data((4, 1, 3), dt.bool_)], dict(axis=1)),
    ("concatenate", [data((9, 20), dt.float64), data((9, 3), dt.float64)], dict(axis=1)),
    ("pad", [data((5, 6), dt.float32), np.float32(1)], dict(low=(1, 2), high=(2, 1), interior=(1, 1))),
    # along one axis: rows of blocks (`lower_movement._pad_blocks`), short ones masked
    ("pad", [data((5, 6), dt.float32), np.float32(1)], dict(low=(0, 2), high=(0, 3), interior=(0, 0))),
    ("pad", [data((7, 3, 5), dt.float64), np.float64(-2)], dict(low=(0, 1, 0), high=(0, 0, 0), interior=(0, 0, 0))),
    ("pad", [data((9, 20), dt.bool_), np.True_], dict(low=(2, 0), high=(1, 0), interior=(0, 0))),
    ("pad", [data((300, 130), dt.int32), np.int32(7)], dict(low=(0, 0), high=(0, 17), interior=(0, 0))),
    # along several axes: runs of blocks per row of the inner padded axis (`_Repeat`)
    ("pad", [data((9, 20), dt.float32), np.float32(1)], dict(low=(1, 3), high=(2, 0), interior=(0, 0))),
    ("pad", [data((2, 3, 5, 7), dt.float64), np.float64(0)], PAD_HW),
    ("pad", [data((3, 4, 5), dt.bool_), np.False_], dict(low=(1, 0, 2), high=(0, 0, 1), interior=(0, 0, 0))),
    ("slice", [data((9, 10), dt.float32)], dict(start=(1, 2), limit=(9, 10), stride=(3, 4))),
    ("gather", [data((20, 70), dt.bool_), np.array([3, 99], np.int32)], dict(axis=0)),
    ("conv2d", [data((2, 3, 9, 8), dt.float32), data((4, 3, 3, 2), dt.float32)], CONV_ATTRS),
    ("argmax", [data((300, 1001), dt.float32)], dict(axis=1, index_dtype="i64")),
    ("argmax", [data((37, 3), dt.float32)], dict(axis=1, index_dtype="i64")),  # short rows: a partial last tile
    ("argmin", [data((9, 5), dt.float64)], dict(axis=1, index_dtype="i32")),
    ("reduce_max", [data((37, 3), dt.float32)], dict(axes=(1,))),
    ("reduce_sum", [data((2, 21, 5), dt.float64)], dict(axes=(2,))),
    ("dot_general", [data((130, 128), dt.float32), data((128, 141), dt.float32)], MATMUL),
    # large enough for the matmul library (on two or more cores): partial panels of one vector and
    # of one and a masked one, rows left over, f64 rows 4 KiB long (restrided into the scratch area)
    ("dot_general", [data((301, 200), dt.float32), data((200, 300), dt.float32)], MATMUL),
    ("dot_general", [data((290, 256), dt.float32), data((256, 250), dt.float32)], MATMUL),
    ("dot_general", [data((150, 512), dt.float64), data((512, 230), dt.float64)], MATMUL),
    ("sort", [data((5, 37), dt.float32)], dict(axis=1)),
    ("sort", [data((37, 3), dt.int64)], dict(axis=0)),
    ("sort", [data((3, 70), dt.bool_)], dict(axis=1)),
    ("cumsum", [data((19, 70), dt.float32)], dict(axis=1, reverse=False)),  # a partial group of rows
    ("cumsum", [data((3, 40, 37), dt.float64)], dict(axis=1, reverse=True)),  # a block of columns and a narrower one
    ("cumsum", [data((37, 5), dt.int32)], dict(axis=0, reverse=False)),  # columns narrower than a vector
    ("cumsum", [data((301, 300), dt.float32)], dict(axis=1, reverse=False)),  # groups of rows over the cores
    ("cumsum", [data((2, 300, 130), dt.float32)], dict(axis=1, reverse=True)),  # blocks of columns over the cores
    ("linear_recurrence", [data((19, 70), dt.float32), data((19, 70), dt.float32)], dict(axis=1, reverse=False)),
    ("linear_recurrence", [data((3, 40, 37), dt.float64), data((3, 40, 37), dt.float64)], dict(axis=1, reverse=True)),
    ("linear_recurrence", [data((301, 300), dt.float32), data((301, 300), dt.float32)], dict(axis=1, reverse=False)),
]


@pytest.mark.parametrize("at_end", [True, False], ids=["guard-after", "guard-before"])
@pytest.mark.parametrize("name, inputs, attrs", GUARDED_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GUARDED_CASES)])
def test_kernels_stay_inside_their_buffers(name, inputs, attrs, at_end):
    inputs = [np.asarray(a) for a in inputs]
    graph = Graph(name)
    params = [graph.add_param(TensorType(a.shape, dt.dtype(a.dtype))) for a in inputs]
    graph.results = list(emit(graph, name, params, attrs).results)
    compiled = compile_graph(graph, "cpu")
    (want,) = compile_graph(graph, "interpreter").run(inputs)
    out = guarded(np.zeros(want.shape, want.dtype), at_end)
    (got,) = compiled.run_trusted([guarded(a, at_end) if a.size else a for a in inputs], provided={0: out})
    assert got is out
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-5, atol=1e-5)


SLICE_VIEW_CASES = [
    (lambda x: fnp.roll(x, 3, axis=1), (37, 70), dt.float32),  # a 3-column block: shorter than a vector
    (lambda x: fnp.roll(x, -50, axis=1), (37, 70), dt.float64),
    (lambda x: fnp.roll(x, 5, axis=0), (37, 70), dt.bfloat16),  # along the first axis: one block per slice
    (lambda x: fnp.roll(x, 9, axis=1), (37, 70), dt.float16),
    (lambda x: fnp.roll(x, 4, axis=1), (3, 9, 20), dt.int32),  # a middle axis: blocks of 20-element rows
    (lambda x: fnp.roll(x, (5, 7), axis=(0, 1)), (300, 130), dt.float32),  # the second roll reads a slot
    (lambda x: fnp.concatenate([x[..., 16:], x[..., 3:16] * 2.0, x[..., :3]], axis=-1), (4, 6, 40), dt.float32),
]


@pytest.mark.parametrize("at_end", [True, False], ids=["guard-after", "guard-before"])
@pytest.mark.parametrize("fn, shape, dtype", SLICE_VIEW_CASES, ids=[f"case{i}" for i in range(len(SLICE_VIEW_CASES))])
def test_concatenated_slices_are_copied_from_their_source(fn, shape, dtype, at_end):
    """A slice read only by concatenates along the axis it cuts is not copied on its own: the
    concatenate copies its blocks from the slice's source (`lowering._slice_views`). No read outside
    the source (guard pages on either side), and no slice kernel for a plain roll."""
    from flowjit.ir.parser import parse_graph

    x = data(shape, dtype, 5)
    lowered = fj.jit(fn).lower(x)
    if fn is SLICE_VIEW_CASES[0][0]:
        assert "tensor.extract_slice" not in lowered.as_text("mlir")  # the slices' copies were extract_slices
    compiled = compile_graph(parse_graph(lowered.as_text("optimized")), "cpu")
    (got,) = compiled.run_trusted([guarded(x, at_end)])
    np.testing.assert_array_equal(got, np.asarray(fn(x)))  # flowjit.numpy runs eagerly on numpy data


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: fnp.concatenate([fnp.zeros((37, 3), np.float32), x, fnp.full((37, 20), 2.5, np.float32)], axis=1),
        lambda x: fnp.concatenate([x, fnp.ones((5, 70), np.float32)], axis=0),
        lambda x: fnp.concatenate([x > 0, fnp.ones((37, 7), bool)], axis=1),
        lambda x: fnp.concatenate([x.astype(np.int32), fnp.full((37, 1), -3, np.int32)], axis=1),
    ],
    ids=["float_edges", "rows_below", "bool", "int_column"],
)
def test_concatenated_splats_are_written_not_stored(fn):
    """A splat constant read only by concatenates is never stored: the concatenation's loops write
    its value (`lower_movement._concatenate_blocks`), no fill kernel makes it first."""
    x = data((37, 70), dt.float32, 4)
    lowered = fj.jit(fn).lower(x)
    assert "linalg.fill" not in lowered.as_text("mlir")
    np.testing.assert_array_equal(lowered.compile()(x), np.asarray(fn(x)))


def test_slices_read_elsewhere_are_still_computed():
    """Slices that are also results, read by other ops, bool, or strided stay copies of their own;
    the source of a slice the concatenate reads lives (in the workspace) until the concatenate,
    though a later op's slot would fit where it was (`cumsum`'s, planned between them)."""
    x = data((64, 300), dt.float32, 2)

    def shared(x):
        head = x[:, :7]
        return fnp.concatenate([x[:, 7:], head], axis=1), head * 2.0, head

    def kept_alive(x):
        y = fnp.exp(x * 1e-3)
        a, b = y[:, 3:], y[:, :3]
        w = fnp.cumsum(x, axis=1)
        return fnp.concatenate([a, b], axis=1) * w

    for fn in (shared, kept_alive, lambda x: fnp.concatenate([x[:, ::2], x[:, 1::2]], axis=1)):
        got, want = fj.jit(fn)(x), fn(x)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-5)
    mask = data((33, 20), dt.bool_, 3)
    np.testing.assert_array_equal(fj.jit(lambda m: fnp.roll(m, 3, axis=1))(mask), np.roll(mask, 3, axis=1))


def test_one_lane_masked_stores_stay_inside_the_output():
    """A bool row of int64 comparisons whose last element is one past a whole vector ends in a
    masked store of one lane, which LLVM's x86 code generation writes 8 bytes wide, 7 past the
    output's end on the last row (heap corruption). `single_lane` makes such stores scalar: with the
    output flush against a protected page the call does not fault."""
    import flowjit as fj
    from flowjit.ir.parser import parse_graph

    x = data((40, 9), dt.float32, 13)
    f = lambda x: fnp.argmax(x, axis=0) < (x.astype("i32") ^ x.astype("i32"))
    graph = parse_graph(fj.jit(f).lower(x).as_text("optimized"))
    compiled = compile_graph(graph, "cpu")
    assert "%fj.lane0 = extractelement" in compiled.stages["llvm"] or "store i8" in compiled.stages["llvm"]
    out = guarded(np.ones((40, 9), np.bool_), at_end=True)
    (got,) = compiled.run_trusted([x], provided={0: out})
    np.testing.assert_array_equal(got, np.broadcast_to(x.argmax(0) < 0, (40, 9)))


def test_single_lane_rewrites_only_one_lane_masked_stores():
    from flowjit.backends.cpu import single_lane

    call = "  call void @llvm.masked.store.v4i8.p0(<4 x i8> %v, ptr align 1 %p, <4 x i1> <{}>)"
    one = call.format("i1 false, i1 false, i1 true, i1 false")
    two = call.format("i1 true, i1 false, i1 true, i1 false")
    rewritten = single_lane.scalar_stores(f"{one}\n{two}\n")
    assert rewritten.splitlines() == [
        "  %fj.lane0 = extractelement <4 x i8> %v, i64 2",
        "  %fj.addr0 = getelementptr i8, ptr %p, i64 2",
        "  store i8 %fj.lane0, ptr %fj.addr0, align 1",
        two,
    ]


@pytest.mark.usefixtures("specialized_matmul")
def test_matmul_temporaries_live_in_the_workspace_scratch_area():
    """Packed panels (B, and A given as (K, M)) go to the scratch area at the end of the workspace,
    sized for the function's largest product and shared by all: no malloc per call (per-call
    allocations this big fragmented the heap), and results still match."""
    import flowjit as fj

    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((200, 96), (96, 300), (200, 160)))
    f = fj.jit(lambda a, b, c: (a @ b, a.T @ c))
    lowered = f.lower(a, b, c)
    assert "restrict writable" in lowered.as_text("mlir") and "@malloc(" not in lowered.as_text("llvm")
    got = f(a, b, c)
    np.testing.assert_allclose(got[0], a @ b, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[1], a.T @ c, rtol=1e-5, atol=1e-4)
    shapes = [
        matmul_plan.MatmulShape(0, 200, 300, 96, "f32"),
        matmul_plan.MatmulShape(0, 96, 160, 200, "f32", a_cols=True),
    ]
    scratch = max(matmul_plan.scratch_bytes(s) for s in shapes)
    header = int(re.search(r"// workspace: (\d+) bytes", lowered.as_text("mlir")).group(1))
    assert header >= scratch and f"memref<{scratch}xi8>" in lowered.as_text("mlir")


@pytest.mark.parametrize(
    "fn",
    [
        lambda w: fnp.concatenate([w, np.full((2, 1, 3, 3), 7.0, np.float32)], axis=1),  # blocks of 9 < a vector
        lambda w: nn.conv2d(np.arange(25, dtype=np.float32).reshape(1, 1, 5, 5), w[:, :1], padding=1),
    ],
    ids=["concatenate", "conv2d_padding"],
)
def test_literals_written_into_strided_views_compile(fn):
    # MLIR folds the copy of a literal into a strided view to a memref.copy from its global, which
    # calls the unlinked memrefCopy; insert_into copies literals into a buffer of their own first.
    w = np.arange(18, dtype=np.float32).reshape(2, 1, 3, 3)
    np.testing.assert_allclose(fj.jit(fn)(w), fj.jit(fn, target="interpreter")(w), rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 4), (3, 28), (600, 1000)], ids=["tiny", "small-rows", "parallel"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_abs_in_nd_kernels(shape, dtype):
    """Integer abs in n-d kernels (2-d vectors): it compiled to `math.absi`, which the LLVM conversion
    left unconverted on 2-d vectors; the minimum value stays itself, as in numpy."""
    info = np.iinfo(dtype)
    x = np.linspace(-1000, 1000, shape[-1]).astype(dtype)
    x[0], x[-1] = info.min, info.max
    f = fj.jit(lambda x: fnp.abs(fnp.broadcast_to(x, shape)))
    np.testing.assert_array_equal(f(x), np.abs(np.broadcast_to(x, shape)))


@pytest.mark.parametrize(
    "shape, kernel, stride, padding, dilation, dtype",
    [
        ((2, 8, 16, 16), 3, 1, 1, 1, dt.float32),  # one vector per row: both edges in one shuffle
        ((2, 8, 16, 20), 3, 1, 2, 2, dt.float32),  # dilated, rows of two vectors
        ((1, 4, 30, 33), 5, 1, 4, 1, dt.float32),  # whole rows of zeros above and below
        ((1, 4, 12, 33), 5, 1, 2, 1, dt.float32),  # the third vector of 33 columns runs past the row
        ((1, 8, 9, 100), 3, 1, 1, 1, dt.float32),  # a loop of vectors inside the row
        ((3, 4, 17, 40), 3, (2, 1), 1, 1, dt.float32),  # stride along columns only
        ((2, 8, 20, 18), 3, 1, ((2, 0), (1, 3)), 1, dt.float32),  # uneven padding
        ((2, 8, 20, 48), 3, 1, 1, 1, dt.float16),  # widened as read
        ((2, 3, 24, 70), 7, 1, 3, 1, dt.float64),  # middle vectors in a loop
    ],
)
def test_im2col_pads_as_it_reads(monkeypatch, shape, kernel, stride, padding, dilation, dtype):
    """A padded stride-1 convolution makes no padded copy of its input: im2col reads the input
    clamped into it, zeroes rows outside it and moves each row's edge lanes into place with one
    constant shuffle (`lower_conv._im2col_padding`). Same bits as the padded form."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    x = data(shape, dtype, 1)
    w = data((8, shape[1], kernel, kernel), dtype, 2)

    def conv(x, w):
        return nn.conv2d(x, w, stride=stride, padding=padding, dilation=dilation)

    lowered = fj.jit(conv).lower(x, w)
    mlir = lowered.as_text("mlir")
    assert "vector.shuffle" in mlir and "linalg.fill" not in mlir  # no padded input filled with zeros
    got = lowered.compile()(x, w)
    monkeypatch.setattr(lower_conv, "_im2col_pads", lambda *args: False)
    padded = fj.jit(conv).lower(x, w)
    pads = ((padding, padding),) * 2 if isinstance(padding, int) else padding
    padded_type = f"tensor<{shape[0]}x{shape[1]}x{shape[2] + sum(pads[0])}x{shape[3] + sum(pads[1])}x"
    assert padded_type in padded.as_text("mlir")  # the padded copy of the input
    np.testing.assert_array_equal(padded.compile()(x, w), got)
    strides = (stride, stride) if isinstance(stride, int) else stride
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), *pads))
    oh, ow = got.shape[2:]
    taps = [
        xp[
            :,
            :,
            i * dilation : i * dilation + (oh - 1) * strides[0] + 1 : strides[0],
            j * dilation : j * dilation + (ow - 1) * strides[1] + 1 : strides[1],
        ]
        for i in range(kernel)
        for j in range(kernel)
    ]
    cols = np.stack(taps, axis=2)  # (n, c, taps, oh, ow)
    want = np.einsum("oct,ncthw->nohw", w.astype(np.float64).reshape(8, shape[1], -1), cols)
    tol = 2e-2 if dtype == dt.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


def test_conv_chunks_are_read_in_place_by_the_kernel(monkeypatch):
    """A conv chunk's column matrix (just written, in L2) is read where it is by the micro-kernel,
    no panel packed (`MatmulShape.b_in_place`); the same bits as packing each panel first."""
    import dataclasses

    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(host, "cores", lambda: 2)
    x, w = data((4, 16, 20, 21), dt.float32, 1), data((24, 16, 3, 3), dt.float32, 2)  # K = 144, 21 columns a row

    def conv(x, w):
        return nn.conv2d(x, w, padding=1)

    lowered = fj.jit(conv).lower(x, w)
    panel = "tensor<1x144x" + str(2 * schedule.lanes(32))
    assert "scf.forall" in lowered.as_text("mlir") and panel not in lowered.as_text("mlir")
    got = lowered.compile()(x, w)
    just_in_time = matmul_kernel._panels_just_in_time
    monkeypatch.setattr(
        matmul_kernel,
        "_panels_just_in_time",
        lambda w_, s, a, b, c: just_in_time(w_, dataclasses.replace(s, b_in_place=False), a, b, c),
    )
    packed = fj.jit(conv).lower(x, w)
    assert panel in packed.as_text("mlir")
    np.testing.assert_array_equal(packed.compile()(x, w), got)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the streaming schedule splits over several cores")
def test_full_reduction_streams_large_inputs(monkeypatch):
    """A full reduction of at least STREAMING_REDUCTION_MIN_BYTES takes 4x the partial results with one
    vector accumulator each (the same sequential adds per lane), smaller ones four accumulators;
    both sum exactly what numpy sums (checked with the threshold lowered, on a small input). The
    partials are combined a vector at a time (the last tile step), not as one vector of them all.
    The kernel's code: the reduction library (test_reduction_library.py) off."""
    monkeypatch.setenv("FLOWJIT_REDUCTION_LIBRARY", "0")
    lanes = host.vector_bits() // 32
    chunks, vectors = schedule.FULL_REDUCTION_CHUNKS, schedule.FULL_REDUCTION_VECTORS
    big = schedule.STREAMING_REDUCTION_MIN_BYTES // 4

    def steps(n: int) -> list[str]:
        text = fj.jit(lambda x: fnp.sum(x)).lower(fj.ShapeDtype((n,), "float32")).as_text("mlir")
        return re.findall(r"num_threads = \[\d+\]|tile_sizes = \[\d+\]", text)

    combine = f"tile_sizes = [{lanes}]"
    assert steps(big) == [f"num_threads = [{chunks * vectors}]", f"tile_sizes = [{lanes}]", combine]
    assert steps(big - 1) == [f"num_threads = [{chunks}]", f"tile_sizes = [{vectors * lanes}]", combine]
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(schedule, "STREAMING_REDUCTION_MIN_BYTES", 1 << 20)
    x = data((300_001,), dt.float32, 3)
    assert len(steps(x.size)) == 3 and steps(x.size)[1] == f"tile_sizes = [{lanes}]"
    np.testing.assert_allclose(fj.jit(lambda x: fnp.sum(x))(x), x.sum(dtype=np.float64), rtol=1e-6)
    np.testing.assert_array_equal(fj.jit(lambda x: fnp.max(x))(x), x.max())


def test_nd_kernels_with_math_keep_their_row_loop_rolled():
    """`copy_nd` unrolls a short row's vector loop for plain bodies only: with a math function the
    unrolled copies ran no faster and doubled the compile (`fusion_schedule.schedule_generic`)."""
    g = data((16, 256), dt.float32, 14)
    gates = fj.jit(lambda g: nn.sigmoid(g[:, :64]) * fnp.tanh(g[:, 128:192]))
    assert "transform.loop.unroll" not in gates.lower(g).as_text("mlir")
    want = 1 / (1 + np.exp(-g[:, :64].astype(np.float64))) * np.tanh(g[:, 128:192].astype(np.float64))
    np.testing.assert_allclose(gates(g), want, rtol=1e-6, atol=1e-7)
    plain = fj.jit(lambda g: g[:, :64] * 2.0 + g[:, 128:192])
    assert "transform.loop.unroll" in plain.lower(g).as_text("mlir")
    np.testing.assert_allclose(plain(g), g[:, :64] * 2.0 + g[:, 128:192], rtol=1e-6)
