"""The CPU backend: every op-table row compiled vs the reference interpreter, end-to-end `fj.jit`
programs, stage texts, the workspace planner, the disk cache (hit in a new process, corruption,
disabling), concurrent calls, and call-path errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections import defaultdict

import ml_dtypes
import numpy as np
import pytest
from op_table import assert_close, cases, fresh_variables

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.backends import compile_graph
from flowjit.backends.cpu import cache, compiler, host, pipeline, toolchain
from flowjit.backends.cpu.compiler import load_lowerings
from flowjit.backends.cpu.pipeline import CompileOptions
from flowjit.backends.cpu.target import BUFFER_LOWERINGS, LOWERINGS
from flowjit.backends.mlir import pipeline as mlir_pipeline
from flowjit.backends.mlir.workspace import plan_workspace
from flowjit.errors import CompileError, FlowjitTypeError
from flowjit.ir.builder import emit
from flowjit.ir.graph import Graph, Op
from flowjit.ir.interpreter import RunContext, interpret
from flowjit.ir.ops import REGISTRY
from flowjit.ir.parser import parse_graph
from flowjit.ir.types import TensorType

# Ops no CPU lowering exists for yet. Compiling them must fail with a CompileError naming the op;
# this set must shrink to empty (the test below fails when a lowering lands and it is not updated).
NOT_YET_LOWERED: set[str] = set()
# Ops compiled without a `LOWERINGS` entry: variables become parameters and results (stateful.py).
COMPILED_OUTSIDE_LOWERINGS = {"assign", "assign_add", "assign_sub", "read_variable"}


def _cases_by_op() -> dict[str, list]:
    by_op = defaultdict(list)
    for case_id, case in cases():
        by_op[case.graph.ops[-1].name].append((case_id, case))
    return dict(by_op)


CASES_BY_OP = _cases_by_op()


def merged_graph(name: str, graphs: list[Graph]) -> Graph:
    """One graph computing all single-op `graphs` side by side: one compile for many cases."""
    merged = Graph(name)
    for g in graphs:
        mapping = {p: merged.add_param(p.type, p.name_hint) for p in g.params}
        for op in g.ops:
            new = Op(op.name, [mapping[v] for v in op.operands], [r.type for r in op.results], op.attrs, op.loc)
            new.regions = op.regions
            merged.append(new)
            mapping.update(zip(op.results, new.results))
        merged.results += [mapping[r] for r in g.results]
    return merged


def test_not_yet_lowered_is_exactly_the_ops_without_lowering():
    lowered = set(load_lowerings()) | set(BUFFER_LOWERINGS)
    missing = {name for name in REGISTRY if name not in lowered and name != "constant"}
    assert missing - COMPILED_OUTSIDE_LOWERINGS == NOT_YET_LOWERED


@pytest.mark.parametrize("op_name", sorted(set(CASES_BY_OP) - NOT_YET_LOWERED))
def test_compiled_matches_interpreter(op_name):
    """All rows of one op compiled as one function, each result compared with the interpreter."""
    rows = CASES_BY_OP[op_name]
    # One by one: state ops (a variable name with several types across rows) and region ops.
    if op_name in COMPILED_OUTSIDE_LOWERINGS or rows[0][1].graph.ops[-1].regions:
        for case_id, case in rows:
            variables, reference_variables = fresh_variables(case.graph), fresh_variables(case.graph)
            got = compile_graph(case.graph, "cpu").run(case.inputs, variables)
            want = interpret(case.graph, case.inputs, RunContext(reference_variables))
            for a, b in zip([*got, *variables.values()], [*want, *reference_variables.values()]):
                assert_close(a, b, case.tol, case_id)
        return
    graph = merged_graph(op_name, [case.graph for _, case in rows])
    inputs = [a for _, case in rows for a in case.inputs]
    try:
        executable = compile_graph(graph, "cpu")
    except CompileError:
        for case_id, case in rows:  # name the failing row
            try:
                compile_graph(case.graph, "cpu")
            except CompileError as e:
                pytest.fail(f"{case_id}: {e}")
        raise
    got = iter(executable.run(inputs))
    want = iter(interpret(graph, inputs))
    for case_id, case in rows:
        for _ in case.graph.results:
            assert_close(next(got), next(want), case.tol, case_id)


@pytest.mark.parametrize("op_name", sorted(NOT_YET_LOWERED & set(CASES_BY_OP)))
def test_op_without_lowering_is_a_named_compile_error(op_name):
    case_id, case = CASES_BY_OP[op_name][0]
    first = next(op.name for op in case.graph.ops if op.name in NOT_YET_LOWERED)  # e.g. an assign feeding a read
    with pytest.raises(CompileError, match=f"op '{first}': has no lowering for target 'cpu'"):
        compile_graph(case.graph, "cpu")


# --- end to end ------------------------------------------------------------------------------------


def test_jit_program_matches_numpy():
    @fj.jit
    def f(x, y, k):
        h = fnp.tanh(x * 0.7 + 0.1) * (1 / (1 + fnp.exp(-x))) + 0.5 * x
        return h.sum(axis=1), fnp.maximum(h, y).max(axis=0), (x > y).astype(np.int32) * k, h.T.reshape(-1)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 70)).astype(np.float32)
    y = rng.standard_normal((37, 70)).astype(np.float32)
    k = np.int32(3)
    h = np.tanh(x * 0.7 + 0.1) * (1 / (1 + np.exp(-x))) + 0.5 * x
    rows, cols, ints, flat = f(x, y, k)
    np.testing.assert_allclose(rows, h.sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cols, np.maximum(h, y).max(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(ints, (x > y).astype(np.int32) * 3)
    np.testing.assert_allclose(flat, h.T.reshape(-1), rtol=1e-6, atol=1e-6)


def test_large_ops_run_threaded_and_vectorized_correctly():
    """Sizes above the parallel threshold, with odd tails: elementwise, full, row, column sums."""
    rng = np.random.default_rng(1)
    x = rng.random((1031, 517)).astype(np.float32)
    f = fj.jit(lambda x: (x * 2.0 + 1.0, x.sum(), x.sum(axis=1), x.max(axis=0)))
    ew, total, rows, cols = f(x)
    np.testing.assert_allclose(ew, x * 2 + 1, rtol=1e-7)
    np.testing.assert_allclose(total, x.sum(dtype=np.float64), rtol=1e-6)
    np.testing.assert_allclose(rows, x.sum(axis=1, dtype=np.float64), rtol=1e-6)
    np.testing.assert_array_equal(cols, x.max(axis=0))


def test_large_layout_and_bool_kernels_match_interpreter():
    """Above the threshold kernels are tiled, vectorized and threaded; bool ones must still never
    need an i1 buffer (MLIR cannot store those: the process would abort)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((700, 401)).astype(np.float32)
    mask = rng.random((700, 1)) > 0.5

    @fj.jit
    def f(x, mask):
        positive = x > 0
        wide = fnp.broadcast_to(mask, x.shape)
        both = fnp.logical_and(positive, wide)
        return both, both.T, fnp.where(both, x, -x), x.T * 2.0, positive.reshape(401, 700)

    for name, operand, attrs in (
        ("broadcast", mask, {"shape": x.shape, "dims": (0, 1)}),
        ("transpose", x > 0, {"perm": (1, 0)}),
        ("reshape", x > 0, {"shape": (401, 700)}),
    ):
        graph = Graph(name)
        param = graph.add_param(TensorType(operand.shape, "bool"))
        graph.results = list(emit(graph, name, [param], attrs).results)
        np.testing.assert_array_equal(compile_graph(graph, "cpu").run([operand])[0], interpret(graph, [operand])[0])

    got = f(x, mask)
    positive = x > 0
    both = positive & np.broadcast_to(mask, x.shape)
    want = (both, both.T, np.where(both, x, -x), x.T * 2.0, positive.reshape(401, 700))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_bf16_results_keep_denormals():
    x = np.array([1e-39, -3e-40, 9.2e-41, 1.5, np.nan, 3e38], np.float32)
    bf16 = x.astype(ml_dtypes.bfloat16)
    to_bf16, halve = fj.jit(lambda x: x.astype(ml_dtypes.bfloat16))(x), fj.jit(lambda y: y * 0.5)(bf16)
    np.testing.assert_array_equal(to_bf16.view(np.uint16), bf16.view(np.uint16))
    expected = (bf16.astype(np.float32) * 0.5).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(halve.view(np.uint16), expected.view(np.uint16))


def test_results_that_are_params_constants_or_repeated_are_copied():
    f = fj.jit(lambda x: (x, x * 2, x * 2, np.arange(3.0, dtype=np.float32), fnp.zeros((2,), np.float32)))
    x = np.arange(4, dtype=np.float32)
    same, a, b, const, zeros = f(x)
    assert same is not x
    np.testing.assert_array_equal(same, x)
    np.testing.assert_array_equal(a, x * 2)
    np.testing.assert_array_equal(b, x * 2)
    assert a is not b
    np.testing.assert_array_equal(const, [0, 1, 2])
    np.testing.assert_array_equal(zeros, [0, 0])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64", "bool"])
def test_large_constant_is_a_module_global_of_bytes(dtype):
    """A large constant is a module global held as bytes and viewed with its type: MLIR translates an
    i8 array as one string, a float array element by element (seconds of compile for a large
    closed-over weight)."""
    rng = np.random.default_rng(0)
    table = (rng.random((50, 40)) < 0.5) if dtype == "bool" else (rng.standard_normal((50, 40)) * 50).astype(dtype)
    x = np.ones((50, 40), table.dtype)
    f = (lambda x: x ^ table) if dtype == "bool" else (lambda x: x * table)
    lo = fj.jit(f).lower(x)
    mlir = lo.as_text("mlir")
    nbytes = table.size * table.dtype.itemsize
    assert f"memref<{nbytes}xi8> = dense<" in mlir and "memref.get_global" in mlir and "memref.view" in mlir
    np.testing.assert_array_equal(lo.compile()(x), f(x))


def test_large_constants_are_passed_as_inputs_not_built_in(tmp_path, monkeypatch):
    """A large closed-over array (a weight) is lifted out of the module: an input after the caller's,
    passed by the executable on every call (`compiler.lift_constants`), also where it is returned;
    a loop body's or a branch's own copy stays in the module as bytes, read before the loop. The
    user-facing signature is unchanged, a cache hit (same graph, same bytes) runs with this
    compile's arrays, and its stage texts, recomputed from the graph's text, parse back."""
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 160)).astype(np.float32)  # 80 KiB
    table = rng.integers(0, 9, (200, 128)).astype(np.int32)
    x = rng.standard_normal((4, 128)).astype(np.float32)

    def f(x):
        h = fnp.tanh(x @ w)
        looped = fj.fori_loop(0, 3, lambda i, c: c + (x @ w) * 0.5, h)
        picked = fj.cond(h.sum() > 0, lambda a: a @ w.T, lambda a: -(a @ w.T), looped)
        return h, picked, table, table[1:3] * 2

    jitted = fj.jit(f)
    lowered = jitted.lower(x)
    mlir = lowered.as_text("mlir")
    assert f"memref<{table.nbytes}xi8>" not in mlir  # the top-level one is an input, no global
    assert f"memref<{w.nbytes}xi8> = dense" in mlir  # the bodies' own copies of w
    signature = re.search(r"func.func @fj_f\((.*)\)", mlir).group(1)
    assert signature.startswith("%in0: memref<4x128xf32>")  # x first, then the constants
    assert "memref<128x160xf32>" in signature and "memref<200x128xi32>" in signature
    got = jitted(x)
    h = np.tanh(x.astype(np.float64) @ w)
    looped = h + 3 * 0.5 * (x.astype(np.float64) @ w)
    picked = looped @ w.T if h.sum() > 0 else -(looped @ w.T)
    for g, want in zip(got, (h, picked, table, table[1:3] * 2)):
        np.testing.assert_allclose(g, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(lowered.compile()(x)[0], got[0])  # the compiled signature takes x alone
    hit = fj.jit(f)  # another function object: a cache hit, with its own lifted arrays
    for g, want in zip(hit(x), got):
        np.testing.assert_array_equal(g, want)
    assert "define void @" in hit.lower(x).as_text("llvm")  # recomputed from the graph's text
    other = w + 1.0  # same graph, other bytes: another cache entry, not the first one's code
    np.testing.assert_allclose(fj.jit(lambda x: x @ other)(x), x @ other, rtol=1e-5, atol=1e-4)


def test_lifted_constants_with_variables_and_donation():
    """Lifted constants come after a stateful function's variable buffers; donation still pairs
    results with the caller's inputs."""
    w = np.arange(128 * 130, dtype=np.float32).reshape(128, 130) / 1e4
    v = fj.Variable(np.zeros((4, 130), np.float32), name="acc")

    @fj.jit
    def step(x):
        v.assign_add(x @ w)
        return v.value * 2.0

    x = np.ones((4, 128), np.float32)
    step(x)
    np.testing.assert_allclose(step(x), 2 * 2 * (x @ w), rtol=1e-5)
    donate = fj.jit(lambda a: a @ w[:, :128] + a, donate_argnums=0)
    a = np.ones((4, 128), np.float32)
    want = a @ w[:, :128] + a
    np.testing.assert_allclose(donate(a), want, rtol=1e-5)


# --- stages ----------------------------------------------------------------------------------------


def test_stages_show_mlir_llvm_and_vector_assembly():
    lo = fj.jit(lambda x: fnp.exp(x) * 2.0).lower(np.zeros(4096, np.float32))
    mlir = lo.as_text("mlir")
    assert "linalg.generic" in mlir and "// workspace:" in mlir
    assert "llvm.func" in lo.as_text("mlir-llvm")
    assert "define void @" in lo.as_text("llvm")
    asm = lo.as_text("asm")
    assert "zmm" in asm or "ymm" in asm, "expected vector registers in the assembly"
    assert lo.compile()(np.zeros(4096, np.float32))[0] == 2.0


_X3 = np.random.default_rng(3).standard_normal((32, 48, 40)).astype(np.float32)


@pytest.mark.parametrize(
    "fn, pipeline",
    [
        (lambda x: fnp.sum(fnp.exp(x - fnp.max(x, axis=-1, keepdims=True)), axis=-1), "light ("),
        (lambda x: x[0] @ x[1].T + 1.0, "light ("),
        (lambda x: fnp.mean(x, axis=1), "light ("),
        (lambda x: fnp.sort(x, axis=-1), "O3 (for the scalar loops of: sort)"),
        (lambda x: fnp.transpose(x, (2, 0, 1)) * 2.0, "light ("),  # in 8x8 blocks
        (lambda x: fnp.transpose(x, (1, 0, 2)) * 2.0, "light ("),  # rows kept: vector row copies
        # a broadcast below the parallel threshold that a product reads: vector row copies, one thread
        (lambda x: fnp.broadcast_to(fnp.sum(x, 2, keepdims=True), (32, 48, 40)) @ x[0, :40, :], "light ("),
        (lambda x: x[1:30, :, :20] @ x[0, :20, :], "light ("),  # a slice a product reads: row copies
        # vector copies of each block, blocks shorter than a vector (1 wide) masked ones
        (lambda x: fnp.concatenate([fnp.sum(x, 2, keepdims=True), x, fnp.max(x, 2, keepdims=True)], 2), "light ("),
        # a pad along one axis is rows of vector copies and splat writes, like a concatenation ...
        (lambda x: fnp.pad(x * 2.0, ((0, 0), (3, 1), (0, 0))), "light ("),
        # ... along two, too, when the rows before the first padded axis can split over the cores ...
        (lambda x: fnp.pad(x * 2.0, ((0, 0), (3, 1), (0, 2))), "light ("),
        # ... but a large one whose first padded axis is the first is one row: a fill and a copy
        # into its interior (on every core), kept on O3 (slower under the light pipeline)
        (
            lambda x: fnp.pad(fnp.concatenate([x] * 5, axis=0), ((1, 1), (2, 0), (0, 0))),
            "O3 (for the scalar loops of: pad)",
        ),
        # rank 3 with the last dim moved and sides not multiples of 8: plain loops, O3 vectorizes them
        (
            lambda x: fnp.transpose(x[:4, :45, :33], (0, 2, 1)) * 2.0,
            "O3 (a kernel of 5940 elements runs as plain loops, vectorized by no schedule)",
        ),
        # an n-d product with a broadcast, below the parallel threshold and with rows too long for
        # the short-row schedule, runs as plain loops (no schedule)
        (
            lambda x: fnp.reshape(x, (32, 16, 120)) * fnp.reshape(x, (32, 16, 120))[:, :1, :],
            "O3 (a kernel of 61440 elements runs as plain loops, vectorized by no schedule)",
        ),
    ],
    ids=[
        "row_reduction",
        "matmul",
        "middle_axis_mean",
        "sort",
        "transpose_blocks",
        "transpose_rows",
        "small_broadcast",
        "slice",
        "concatenate",
        "pad_one_axis",
        "pad_two_axes",
        "pad_two_axes_one_row",
        "transpose_plain",
        "plain_loops",
    ],
)
def test_llvm_pipeline_is_light_only_when_every_kernel_is_vectorized_and_the_dump_says_which(fn, pipeline):
    """LLVM runs `pipeline.LIGHT_PASSES` instead of O3 on functions whose kernels the lowering
    vectorized; the first line of the "llvm" stage names the pipeline and why; results are the same
    bits as under O3."""
    lo = fj.jit(fn).lower(_X3)
    assert lo.as_text("llvm").splitlines()[0].startswith(f"; LLVM pipeline: {pipeline}")
    got = lo.compile()(_X3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "LIGHT_PIPELINE_OPS", frozenset())
        patch.setattr(compiler, "LIGHT_PIPELINE_LOWERINGS", ())
        patch.setenv("FLOWJIT_CACHE", "0")
        o3 = fj.jit(fn).lower(_X3)
        assert o3.as_text("llvm").startswith("; LLVM pipeline: O3 (for the scalar loops of: ")
        np.testing.assert_array_equal(o3.compile()(_X3), got)


@pytest.mark.parametrize("stride, pipeline", [(1, "light ("), (2, "O3 (for the scalar loops of: conv2d)")])
def test_conv_layers_take_the_light_pipeline_with_stride_1_only(stride, pipeline):
    """A conv layer's im2col, matmul kernel and streamed epilogue are vector code: LLVM's light
    pipeline at stride 1 (the same bits as O3); strided im2col reads keep O3 (faster there)."""
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 16, 20, 20), (8, 16, 3, 3), (8,)))

    def layer(x, w, b):
        return nn.relu(nn.conv2d(x, w, b, stride=stride))

    lo = fj.jit(layer).lower(x, w, b)
    assert lo.as_text("llvm").splitlines()[0].startswith(f"; LLVM pipeline: {pipeline}")
    got = lo.compile()(x, w, b)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "LIGHT_PIPELINE_OPS", frozenset())
        patch.setenv("FLOWJIT_CACHE", "0")
        o3 = fj.jit(layer).lower(x, w, b)
        assert o3.as_text("llvm").startswith("; LLVM pipeline: O3 (for the scalar loops of: ")
        np.testing.assert_array_equal(o3.compile()(x, w, b), got)


@pytest.mark.parametrize("pool", [lambda x: nn.max_pool2d(x, 2), lambda x: nn.avg_pool2d(x, 3, stride=1)])
def test_pooling_takes_the_light_pipeline(pool):
    """Pooling's rows are vector code written out (no loop marked for unrolling): LLVM's light
    pipeline, the same bits as O3."""
    x = np.random.default_rng(6).standard_normal((2, 8, 40, 24)).astype(np.float32)
    lo = fj.jit(pool).lower(x)
    assert lo.as_text("llvm").splitlines()[0].startswith("; LLVM pipeline: light (")
    got = lo.compile()(x)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "LIGHT_PIPELINE_OPS", frozenset())
        patch.setenv("FLOWJIT_CACHE", "0")
        o3 = fj.jit(pool).lower(x)
        assert o3.as_text("llvm").startswith("; LLVM pipeline: O3 (for the scalar loops of: ")
        np.testing.assert_array_equal(o3.compile()(x), got)


def test_options_select_the_stages_passes_and_enter_the_cache_key():
    """AOT's serial libraries drop the OpenMP conversion through `CompileOptions(openmp=False)`,
    not by editing pass strings; every option field is part of the compile cache's key."""
    serial = CompileOptions(openmp=False)
    assert "convert-scf-to-openmp" in pipeline.mlir_stages(CompileOptions())["llvm-dialect"]
    assert "convert-scf-to-openmp" not in pipeline.mlir_stages(serial)["llvm-dialect"]
    assert pipeline.stage_pipeline("bufferize").startswith("builtin.module(func.func(linalg-fuse-elementwise-ops),")
    assert cache.cache_key("graph", serial) != cache.cache_key("graph", CompileOptions())
    with pytest.raises(ValueError, match="openmp"):
        CompileOptions(openmp="serial")


def test_llvm_pipeline_below_o2_is_the_o_level_and_marked_loops_keep_o3():
    graph = parse_graph(_TANH_SUM)
    assert compiler.light_pipeline(graph, toolchain.LLVMLowering("", None, 0), opt=1) == (False, "O1")
    assert compiler.light_pipeline(graph, toolchain.LLVMLowering("", None, 0), opt=3)[0]
    plain = toolchain.LLVMLowering("", None, compiler.PLAIN_LOOP_MAX_ELEMENTS + 1)
    assert compiler.light_pipeline(graph, plain, opt=3)[0] is False
    marked = toolchain.LLVMLowering('!7 = !{!"llvm.loop.unroll.full"}', None, 0)
    assert compiler.light_pipeline(graph, marked, opt=3) == (False, "O3 (loops marked for full unrolling)")


_STRIDED_LOOP = """
define void @f(ptr %a, ptr %b, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i1, %loop]
  %pa = getelementptr float, ptr %a, i64 %i
  %j = mul i64 %i, 5
  %pb = getelementptr float, ptr %b, i64 %j
  %x = load float, ptr %pb
  store float %x, ptr %pa
  %i1 = add i64 %i, 1
  %c = icmp slt i64 %i1, %n
  br i1 %c, label %loop, label %exit
exit:
  ret void
}
"""


def _host_assembly(llvm_ir: str) -> str:
    """LLVM IR text compiled for the host with whatever code generation options are set now."""
    module = host.llvm().parse_assembly(llvm_ir)
    tm = toolchain.target_machine()
    module.triple, module.data_layout = host.host_cpu().triple, str(tm.target_data)
    return tm.emit_assembly(module)


def test_codegen_options_apply_only_while_flowjit_generates_code():
    """Loop strength reduction is off while our code generation runs (a fifth to a half of it, no
    measurable speed) unless the function asks for it (row-tile nests), and LLVM's default is back
    after it, for other llvmlite users in the process; overlapping uses share one setting, and a
    use wanting the other waits for them. The "asm" stage says which."""

    def assembly() -> str:
        return _host_assembly(_STRIDED_LOOP)

    default = assembly()
    with toolchain.codegen_options():
        ours = assembly()
        with toolchain.codegen_options():
            pass
        assert assembly() == ours  # still set: an inner use ended, the outer has not
    with toolchain.codegen_options(strength_reduction=True):
        assert assembly() == default
    events = []

    def other():
        with toolchain.codegen_options(strength_reduction=True):
            events.append(("other", assembly() == default))

    with toolchain.codegen_options():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(0.2)
        events.append(("ours", assembly() == ours))
    thread.join(30)
    assert ours != default and events == [("ours", True), ("other", True)]
    x = np.ones((64, 100), np.float32)
    rows = fj.jit(lambda x: x - fnp.max(x, axis=-1, keepdims=True)).lower(x)
    assert rows.as_text("asm").startswith("# code generation: with loop strength reduction")
    flat = fj.jit(lambda x: x * 2 + 1).lower(x)
    assert flat.as_text("asm").startswith("# code generation: without loop strength reduction")
    np.testing.assert_array_equal(flat.compile()(x), x * 2 + 1)
    assert assembly() == default


_SELECT_LOOP = """
define void @pick(ptr %a, ptr %b, ptr %out, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %loop ]
  %pa = getelementptr float, ptr %a, i64 %i
  %pb = getelementptr float, ptr %b, i64 %i
  %x = load float, ptr %pa
  %y = load float, ptr %pb
  %c = fcmp olt float %x, %y
  %pick = select i1 %c, ptr %pa, ptr %pb
  %v = load float, ptr %pick
  %po = getelementptr float, ptr %out, i64 %i
  store float %v, ptr %po
  %i1 = add i64 %i, 1
  %d = icmp slt i64 %i1, %n
  br i1 %d, label %loop, label %exit
exit:
  ret void
}
"""


def test_sort_kernels_are_generated_without_cmov_conversion():
    """x86's cmov conversion (branches for conditional moves in loops) is off while a function with
    a sort kernel is generated, whose merges pick between two runs' heads unpredictably, and LLVM's
    default is back afterwards; the "asm" stage says so."""
    if not host.host_cpu().triple.startswith("x86_64"):
        pytest.skip("an x86 code generation option")

    def assembly() -> str:
        return _host_assembly(_SELECT_LOOP)

    default = assembly()
    with toolchain.codegen_options(cmov_conversion=False):
        branch_free = assembly()
    assert "cmov" in branch_free and branch_free != default and assembly() == default
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    sort = fj.jit(fnp.sort).lower(x)
    assert "without x86's cmov conversion" in sort.as_text("asm").split("\n", 2)[1]
    np.testing.assert_array_equal(sort.compile()(x), np.sort(x))
    assert "cmov conversion" not in fj.jit(lambda x: x * 2).lower(x).as_text("asm")
    assert assembly() == default


_TANH_SUM = (
    "func @h(%x: tensor<4096xf32>) -> (tensor<f32>) {\n  %0 = tanh %x : tensor<4096xf32>\n"
    "  %1 = reduce_sum %0 {axes = [0]} : tensor<f32>\n  return %1 : tensor<f32>\n}\n"
)


def test_dump_dir_gets_backend_stages(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWJIT_DUMP_DIR", str(tmp_path))
    fj.jit(lambda x: x + 1)(np.zeros(3, np.float32))
    names = sorted(os.listdir(tmp_path))
    for stage, ext in (("mlir", "mlir"), ("mlir-llvm", "mlir"), ("llvm", "ll"), ("asm", "s")):
        assert any(n.endswith(f"-{stage}.{ext}") for n in names), names


def test_stage_texts_are_made_on_demand_and_match_the_dumped_ones(tmp_path, monkeypatch):
    graph = parse_graph(
        "func @h(%x: tensor<4096xf32>) -> (tensor<f32>) {\n  %0 = tanh %x : tensor<4096xf32>\n"
        "  %1 = reduce_sum %0 {axes = [0]} : tensor<f32>\n  return %1 : tensor<f32>\n}\n"
    )
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    compiled = compile_graph(graph, "cpu")
    assert sorted(compiled.stages.texts) == ["mlir"]  # the compile itself printed nothing else
    monkeypatch.setenv("FLOWJIT_DUMP_DIR", str(tmp_path))
    dumped = compile_graph(graph, "cpu")
    assert sorted(dumped.stages.texts) == ["asm", "llvm", "mlir", "mlir-llvm"]
    for stage in ("mlir", "mlir-llvm", "llvm", "asm"):
        assert compiled.stages[stage] == dumped.stages[stage], stage
    x = np.linspace(0, 2, 4096, dtype=np.float32)
    np.testing.assert_allclose(compiled.run([x])[0], np.tanh(x.astype(np.float64)).sum(), rtol=1e-5)


def test_missing_lowering_names_op_line_and_target(monkeypatch):
    monkeypatch.delitem(LOWERINGS, "exp")
    graph = parse_graph(
        'func @f(%x: tensor<3xf32>) -> (tensor<3xf32>) {\n  %0 = exp %x : tensor<3xf32> loc("model.py":7)\n'
        "  return %0 : tensor<3xf32>\n}\n"
    )
    with pytest.raises(CompileError, match=r"model\.py:7: op 'exp': has no lowering for target 'cpu'"):
        compile_graph(graph, "cpu")


def test_two_conds_in_one_function():
    program = textwrap.dedent(
        """
        import numpy as np, flowjit as fj
        def f(x):
            a = fj.cond(x.sum() > 0, lambda x: x * 2.0, lambda x: x * 3.0, x)
            b = fj.cond(x.sum() > 1, lambda x: x + 2.0, lambda x: x - 3.0, x)
            return a + b
        print(fj.jit(f)(np.ones(5, np.float32)).tolist())
        """
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.strip() == str([5.0] * 5)  # 2x + (x + 2) at x = 1


def test_failed_pipeline_saves_a_reproducer(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # scf-to-openmp wraps the body in an alloca_scope that scf-to-cf then splits into several blocks.
    text = textwrap.dedent(
        """
        module {
          func.func @f(%m: memref<8xf32>) {
            %c0 = arith.constant 0 : index
            %c1 = arith.constant 1 : index
            %c8 = arith.constant 8 : index
            %x = arith.constant 1.0 : f32
            scf.parallel (%i) = (%c0) to (%c8) step (%c1) {
              scf.for %j = %c0 to %c8 step %c1 {
                memref.store %x, %m[%i] : memref<8xf32>
              }
              scf.reduce
            }
            return
          }
        }
        """
    )
    pipelines = ["builtin.module(convert-scf-to-openmp)", "builtin.module(convert-scf-to-cf)"]
    with pytest.raises(CompileError, match="reproduce with: python -c") as info:
        mlir_pipeline.run_mlir(text, pipelines)
    (saved,) = tmp_path.iterdir()
    assert saved.read_text() == text and str(saved) in str(info.value)


# --- workspace planning ----------------------------------------------------------------------------


def test_workspace_reuses_memory_of_dead_values():
    x = TensorType((1000,), "f32")
    graph = parse_graph(
        f"func @f(%x: {x}) -> ({x}) {{\n"
        f"  %0 = exp %x : {x}\n  %1 = exp %0 : {x}\n  %2 = exp %1 : {x}\n  %3 = exp %2 : {x}\n"
        f"  return %3 : {x}\n}}\n"
    )
    offsets, size = plan_workspace(graph, lambda v: v is not graph.results[0])
    # %0..%2 live in turn; each result overlaps no operand of its own op: two slots suffice.
    assert size == 2 * 4032
    assert offsets[graph.ops[0].result] == offsets[graph.ops[2].result] != offsets[graph.ops[1].result]


def test_reshapes_are_views_of_their_operands_buffer(monkeypatch):
    """A top-level reshape is a view of its operand's buffer (an input, a slot; a reshape of a
    reshape views the first), not a copy into a slot of its own, and that buffer stays allocated
    while any view of it is read: here the slots of %0 and %3 would otherwise be reused by later
    products. A reshape that is a graph result is still written to its output."""
    from flowjit.backends.mlir import lowering

    text = f"""func @f(%x: {TensorType((6, 8, 4), "f32")}, %w: tensor<32x32xf32>)
  -> (tensor<6x32xf32>, tensor<48x4xf32>) {{
  %0 = tanh %x : tensor<6x8x4xf32>
  %1 = reshape %0 {{shape = [6, 32]}} : tensor<6x32xf32>
  %2 = reshape %1 {{shape = [192]}} : tensor<192xf32>
  %3 = exp %x : tensor<6x8x4xf32>
  %4 = reshape %3 {{shape = [6, 32]}} : tensor<6x32xf32>
  %5 = dot_general %4, %w {{lhs_batch = [], lhs_contract = [1], rhs_batch = [], rhs_contract = [0]}} : tensor<6x32xf32>
  %6 = reshape %2 {{shape = [6, 32]}} : tensor<6x32xf32>
  %7 = dot_general %6, %5 {{lhs_batch = [], lhs_contract = [0], rhs_batch = [], rhs_contract = [0]}} : tensor<32x32xf32>
  %8 = reshape %7 {{shape = [32, 32]}} : tensor<32x32xf32>
  %9 = dot_general %6, %8 {{lhs_batch = [], lhs_contract = [1], rhs_batch = [], rhs_contract = [0]}} : tensor<6x32xf32>
  %10 = reshape %x {{shape = [48, 4]}} : tensor<48x4xf32>
  return %9, %10 : tensor<6x32xf32>, tensor<48x4xf32>
}}
"""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((6, 8, 4)).astype(np.float32), rng.standard_normal((32, 32)).astype(np.float32) * 0.2]
    executable = compile_graph(parse_graph(text), "cpu")
    mlir = executable.stages["mlir"]
    assert "memref.expand_shape %in0" not in mlir  # %10 is an output: copied there
    assert mlir.count("memref.expand_shape") >= 3  # %1 (and %2, %6 through it), %4, %8
    got = executable.run(inputs)
    for g, want in zip(got, interpret(parse_graph(text), inputs)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(lowering, "_reshape_aliases", lambda *args: {})
    copied = compile_graph(parse_graph(text), "cpu")

    def workspace(executable) -> int:
        return int(re.search(r"// workspace: (\d+) bytes", executable.stages["mlir"]).group(1))

    assert workspace(executable) < workspace(copied)  # no slots for the views
    for g, c in zip(got, copied.run(inputs)):
        np.testing.assert_array_equal(g, c)


# --- disk cache ------------------------------------------------------------------------------------

_CACHE_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, flowjit as fj, flowjit.numpy as fnp
    f = fj.jit(lambda x: fnp.tanh(x) * 3.0 + x.sum())
    x = np.linspace(-1, 1, 257, dtype=np.float32)
    y = f(x)
    assert np.allclose(y, np.tanh(x) * 3 + x.sum(), atol=1e-5), y
    print("mlir-imported" if "mlir" in sys.modules else "mlir-not-imported")
    """
)


def _run_cache_script(cache_dir, **env):
    environment = {**os.environ, "FLOWJIT_CACHE_DIR": str(cache_dir), **env}
    out = subprocess.run(
        [sys.executable, "-c", _CACHE_SCRIPT], env=environment, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_second_process_loads_from_disk_cache_without_mlir(tmp_path):
    assert _run_cache_script(tmp_path) == "mlir-imported"
    entries = [n for n in os.listdir(tmp_path) if n.endswith(".fjo")]
    assert len(entries) == 1
    assert _run_cache_script(tmp_path) == "mlir-not-imported"


def test_corrupt_or_truncated_entry_is_rebuilt(tmp_path):
    _run_cache_script(tmp_path)
    (entry,) = [tmp_path / n for n in os.listdir(tmp_path) if n.endswith(".fjo")]
    good = entry.read_bytes()
    for damaged in (good[: len(good) // 2], good[:-40] + bytes(40), b"garbage"):
        entry.write_bytes(damaged)
        assert cache.decode(damaged) is None
        assert _run_cache_script(tmp_path) == "mlir-imported"  # detected, recompiled
        assert entry.read_bytes() == good


def test_concurrent_writers_leave_one_intact_entry(tmp_path):
    environment = {**os.environ, "FLOWJIT_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CACHE_SCRIPT], env=environment, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    names = os.listdir(tmp_path)
    assert len(names) == 1 and names[0].endswith(".fjo"), names  # no temporary files left behind
    assert cache.decode((tmp_path / names[0]).read_bytes()) is not None


def test_stages_of_a_cache_hit_are_recomputed_on_demand(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    graph = parse_graph(
        "func @g(%x: tensor<64xf32>) -> (tensor<64xf32>) {\n  %0 = tanh %x : tensor<64xf32>\n"
        "  return %0 : tensor<64xf32>\n}\n"
    )
    first = compile_graph(graph, "cpu")
    second = compile_graph(graph, "cpu")  # loaded from the entry the first one wrote
    assert first.stages.parts and not second.stages.parts
    assert second.stages["asm"] == first.stages["asm"]
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    np.testing.assert_array_equal(second.run([x])[0], first.run([x])[0])


def test_cache_disabled_writes_nothing(tmp_path):
    assert _run_cache_script(tmp_path, FLOWJIT_CACHE="0") == "mlir-imported"
    assert os.listdir(tmp_path) == []


def test_entry_round_trip_and_checksum():
    entry = cache.Entry((b"\x7fELF-object", b"\x7fELF-second-part"), "fj_f", 128, (), ())
    data = cache.encode(entry)
    assert cache.decode(data) == entry
    flipped = bytearray(data)
    flipped[len(cache.MAGIC) + 12] ^= 1
    assert cache.decode(bytes(flipped)) is None


# --- calls -----------------------------------------------------------------------------------------


def test_concurrent_calls_never_share_a_workspace():
    f = fj.jit(lambda x: fnp.exp(x * 2.0).sum(axis=1) + 1.0)
    rng = np.random.default_rng(2)
    inputs = [rng.random((64, 300)).astype(np.float32) for _ in range(8)]
    expected = [np.exp(x * 2.0).sum(axis=1) + 1.0 for x in inputs]
    f(inputs[0])
    errors = []

    def worker(i):
        for _ in range(30):
            got = f(inputs[i])
            if not np.allclose(got, expected[i], rtol=1e-5):
                errors.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []


def test_executable_rejects_wrong_arguments():
    graph = parse_graph(
        "func @f(%x: tensor<3xf32>) -> (tensor<3xf32>) {\n"
        "  %0 = exp %x : tensor<3xf32>\n  return %0 : tensor<3xf32>\n}\n"
    )
    executable = compile_graph(graph, "cpu")
    with pytest.raises(FlowjitTypeError, match="expected an array of shape"):
        executable.run([np.zeros(4, np.float32)])
    with pytest.raises(FlowjitTypeError, match="expected 1 arrays"):
        executable.run([])
    strided = np.arange(6, dtype=np.float32)[::2]  # not contiguous: copied, still correct
    np.testing.assert_allclose(executable.run([strided])[0], np.exp(strided), rtol=1e-6)


def _compile_in_child(seed: int) -> float:
    x = np.random.default_rng(seed).standard_normal((256, 128)).astype(np.float32)
    w = np.random.default_rng(seed + 1).standard_normal((128, 256)).astype(np.float32)
    grad = fj.jit(fj.grad(lambda w, x: fnp.tanh(x @ w).sum()))
    return float(np.abs(grad(w, x)).sum())


def test_a_forked_child_compiles(monkeypatch):
    """A child forked after the parent compiled (multiprocessing's default on Linux) compiles new
    functions: no thread pool of the parent's (MLIR's, the LLVM part threads) is waited on. (The
    child's first parse hung on MLIR's pool before the context was made without one.)"""
    import multiprocessing

    monkeypatch.setenv("FLOWJIT_CACHE", "0")  # the children must compile, not load the parent's entry
    expected = _compile_in_child(0)  # the parent has compiled: its MLIR context and pools exist
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map_async(_compile_in_child, [0, 0]).get(timeout=240) == [expected, expected]


def test_machine_code_calling_a_missing_function_is_an_error_not_a_crash():
    """A symbol only code generation introduces (a helper for an operation the CPU lacks) shows in
    no IR declaration; the object's symbol table is checked before anything runs: MCJIT links an
    unresolved one to address 0. libgcc_s is loaded for the helpers LLVM calls (`__truncdfhf2`,
    double -> half without AVX512-FP16, as on Zen 4: tanh of float64 converted to float16)."""
    ir = textwrap.dedent(
        """
        declare void @flowjit_no_such_function()
        define void @calls_it() {
          call void @flowjit_no_such_function()
          ret void
        }
        """
    )
    code = toolchain.emit_object(ir, "calls_it")
    assert "flowjit_no_such_function" in toolchain.object_externals(code)[0]
    with pytest.raises(CompileError, match="flowjit_no_such_function"):
        toolchain.load_objects((code,), "calls_it")
    x = np.array([[-1.375], [0.3]])
    y = fj.jit(lambda x: fnp.tanh(x).astype("float16"))(x)
    np.testing.assert_array_equal(y, np.tanh(x).astype(np.float16))
