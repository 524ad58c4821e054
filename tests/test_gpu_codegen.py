"""The GPU target, compile-only (flowjit/backends/gpu): PTX for sm_80 and sm_90, assembled by ptxas.

No GPU is needed: each test lowers graphs to PTX and hands every kernel to `ptxas -arch=sm_XX`
(`toolchain.find_ptxas`: the `test` extra's nvidia-cuda-nvcc wheel; skipped, with the reason, where
there is none). Every row of the op table and the gradient graph of every differentiable row
either assembles or names a CPU-only op with its reason; the values of the GPU's own lowerings come
from its MLIR run on the host; fused regions (softmax, layer norm), constants, atomics and the
user-facing entry points (`as_text("ptx")`, `flowjit dump --stage ptx --target cuda`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.cpu import toolchain as cpu_toolchain
from flowjit.backends.cpu.pipeline import CompileOptions
from flowjit.backends.cpu.pipeline import stage_pipeline as cpu_stage_pipeline
from flowjit.backends.gpu import lower_kernels, lower_matmul
from flowjit.backends.gpu.backend import GpuRuntimeError
from flowjit.backends.gpu.compiler import copies_as_kernels, generate_mlir, lower_to_ptx
from flowjit.backends.gpu.driver import unavailable_reason
from flowjit.backends.gpu.pipeline import GpuOptions, stage_pipeline
from flowjit.backends.gpu.plan import Loop
from flowjit.backends.gpu.target import CPU_ONLY, FUNCTIONALIZED, GPU, cpu_only_reason
from flowjit.backends.gpu.toolchain import find_ptxas
from flowjit.backends.mlir import pipeline as mlir_pipeline
from flowjit.backends.mlir.target import LoweringTable
from flowjit.backends.registry import get_backend
from flowjit.cli import main
from flowjit.errors import CompileError
from flowjit.frontend.autodiff import VJPSpec, is_non_differentiable, vjp_graph
from flowjit.ir import dtypes as dt
from flowjit.ir.interpreter import interpret
from flowjit.ir.ops import REGISTRY
from flowjit.passes.state import functionalize_state, touched_variables

sys.path.insert(0, os.path.dirname(__file__))
from op_table import ROWS, assert_close, build_case, single_op_graph, tolerance  # noqa: E402

CHIPS = ("sm_80", "sm_90")
PTXAS = find_ptxas()
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas (CUDA toolkit or the nvidia-cuda-nvcc wheel) not found")


def assemble(ptx: str, chip: str) -> None:
    """`ptxas -arch=chip` accepts `ptx` (the assertion shows its message otherwise)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([PTXAS, f"-arch={chip}", path, "-o", os.devnull], capture_output=True, text=True)
    assert done.returncode == 0, f"ptxas -arch={chip} rejected the PTX:\n{done.stderr}\n{ptx[:2000]}"


def assemble_all(kernels, chip: str, empty: bool = False) -> None:
    """Every kernel is PTX for `chip` without calls and assembles; there is one at least unless
    the results are `empty` (zero-size: nothing to compute)."""
    assert kernels or empty, "no kernel"
    for kernel in kernels:
        assert f".target {chip}" in kernel.ptx
        assert ".extern" not in kernel.ptx and "__nv_" not in kernel.ptx, f"{kernel.name} calls libdevice"
        assemble(kernel.ptx, chip)


# --- op table rows and their gradient graphs ----------------------------------------------------
#
# Every row of the op table, and the gradient graph of every differentiable row, either lowers to
# PTX that ptxas assembles or names an op the GPU leaves to the CPU (`CPU_ONLY`, float64 math) in a
# CompileError quoting the reason. Within the file's time budget (about 55 ms to compile a graph and
# 40 ms per ptxas run): every row in float32 (or its first dtype) for sm_80; the first row of each
# op in every dtype for sm_80; the first row of each op (and each gradient) for sm_90 too, in
# float32 and in bfloat16, whose sm_90 code differs most (native bf16 instructions).


def _expected_refusal(graph):
    """The reason the GPU refuses `graph`, from its first CPU-only op (None if it has none)."""
    for op in graph.walk():
        reason = cpu_only_reason(op)
        if reason is not None:
            return op.name, reason
    return None


def check_lowers_or_is_cpu_only(graph, chips) -> None:
    if touched_variables(graph):  # as CudaBackend.compile does: variables become inputs and outputs
        graph, _ = functionalize_state(graph.copy())
    refusal = _expected_refusal(graph)
    empty = not any(r.type.size for r in graph.results)
    for chip in chips:
        if refusal is not None:
            name, reason = refusal
            with pytest.raises(CompileError, match=re.escape(f"op '{name}': is CPU-only on target 'cuda': {reason}")):
                lower_to_ptx(graph, GpuOptions(chip=chip))
            continue
        assemble_all(lower_to_ptx(graph, GpuOptions(chip=chip)).kernels, chip, empty)


def _main_dtype(row):
    return dt.float32 if dt.float32 in row.dtypes else row.dtypes[0]


def _first_rows():
    seen = set()
    for row in ROWS:
        if row.op not in seen:
            seen.add(row.op)
            yield row


def _row_params():
    first = {id(row) for row in _first_rows()}
    for row in ROWS:
        chips = CHIPS if id(row) in first else ("sm_80",)
        yield pytest.param(row, _main_dtype(row), chips, id=f"{row.name}-{_main_dtype(row).name}".replace(" ", ""))
    for row in _first_rows():
        for dtype in row.dtypes:
            if dtype is not _main_dtype(row):
                chips = CHIPS if dtype is dt.bfloat16 else ("sm_80",)
                yield pytest.param(row, dtype, chips, id=f"{row.name}-{dtype.name}".replace(" ", ""))


ROW_PARAMS = list(_row_params())


@needs_ptxas
@pytest.mark.parametrize("row,dtype,chips", ROW_PARAMS)
def test_op_row_lowers_or_is_cpu_only(row, dtype, chips):
    check_lowers_or_is_cpu_only(build_case(row, dtype).graph, chips)


def test_rows_cover_the_table():
    covered = {(param.values[0].name, param.values[0].op) for param in ROW_PARAMS}
    assert covered == {(row.name, row.op) for row in ROWS}
    on_sm90 = {param.values[0].op for param in ROW_PARAMS if "sm_90" in param.values[2]}
    assert on_sm90 == {row.op for row in ROWS}


def _gradient_params():
    """(row, float dtype, chips) for every row whose op is differentiable in a float dtype, with
    a float operand to differentiate. Rows without a gradient graph: fusion (made after autodiff),
    for/while (refused by autodiff), custom_vjp_call (its rule lives in the process that defined it)."""
    first = set()
    for row in ROWS:
        if is_non_differentiable(row.op) or row.op in ("fusion", "for", "while", "custom_vjp_call"):
            continue
        floats = [d for d in row.dtypes if d.is_float]
        if not floats:
            continue
        dtype = dt.float32 if dt.float32 in floats else floats[0]
        chips = CHIPS if row.op not in first else ("sm_80",)
        first.add(row.op)
        yield pytest.param(row, dtype, chips, id=f"grad-{row.name}-{dtype.name}".replace(" ", ""))


GRADIENT_PARAMS = list(_gradient_params())


@needs_ptxas
@pytest.mark.parametrize("row,dtype,chips", GRADIENT_PARAMS)
def test_gradient_graph_lowers_or_is_cpu_only(row, dtype, chips):
    graph = vjp_graph(build_case(row, dtype).graph, VJPSpec(primal_outputs=False))
    check_lowers_or_is_cpu_only(graph, chips)


def test_gradients_cover_the_differentiable_ops():
    ops = {param.values[0].op for param in GRADIENT_PARAMS}
    assert {"dot_general", "conv2d", "reduce_window", "gather", "scatter_add", "sort", "cumsum", "pad"} <= ops
    assert {"linear_recurrence", "concatenate", "dynamic_slice", "cond", "exp", "reduce_max"} <= ops


def test_every_registered_op_lowers_or_is_cpu_only():
    # constant is lowered by the driver itself (an inline literal or a global the kernels hold).
    known = CPU_ONLY.keys() | FUNCTIONALIZED
    missing = sorted(n for n in REGISTRY if n != "constant" and not GPU.lowerings.has(n) and n not in known)
    assert not missing, f"ops with neither a GPU lowering nor a CPU_ONLY reason: {missing}"
    assert not set(CPU_ONLY) - set(REGISTRY), "CPU_ONLY names ops that do not exist"
    assert not set(CPU_ONLY) & set(GPU.lowerings.tensor), "an op is both lowered and CPU-only"


# --- values: the GPU's lowering run on the host ---------------------------------------------------
#
# No GPU runs here, so the values of the GPU's own lowerings (`gpu/lower_kernels.py`), of constants
# and of rank-0 bool ops are checked by running the MLIR the GPU target writes, after its "bufferize"
# stage and before the mapping to blocks and threads (upstream MLIR's), on the host through the
# CPU's "llvm-dialect" stage with serial loops: every row of those ops, in every dtype, against the
# op table's expected values.


@contextlib.contextmanager
def untiled_products():
    """Inside: every dot_general is one thread per element (`lower_kernels.lower_dot_general`);
    the tiled kernel (`lower_matmul`) is a `gpu.launch` that only the GPU pipeline compiles (its
    values come from the emulator: tests/test_gpu_matmul.py)."""
    saved = lower_matmul.uses_tiles
    lower_matmul.uses_tiles = lambda product: False
    try:
        yield
    finally:
        lower_matmul.uses_tiles = saved


def run_on_host(graph, inputs):
    """The GPU target's bufferized MLIR for `graph`, compiled for the host and run on `inputs`."""
    with untiled_products():
        mlir = generate_mlir(graph)
    with mlir_pipeline.lock(), mlir_pipeline.mlir_context():
        module = mlir_pipeline.parse(mlir.text)
        mlir_pipeline.run_pipeline(module, stage_pipeline("bufferize", options=GpuOptions()), lambda: mlir.text)
        text = copies_as_kernels(module.operation.get_asm())
        module = mlir_pipeline.parse(text)
        to_llvm = cpu_stage_pipeline("llvm-dialect", options=CompileOptions(openmp=False))
        mlir_pipeline.run_pipeline(module, to_llvm, lambda: text)
        llvm_ir = mlir_pipeline.translate(module)
    native = cpu_toolchain.jit_compile(*cpu_toolchain.optimize(llvm_ir, graph.name, opt=1))
    arrays = [np.ascontiguousarray(x) for x in inputs] + [np.empty(t.shape, t.dtype.np_dtype) for t in mlir.outputs]
    spare = np.zeros(max(mlir.workspace_bytes, 64), np.uint8)  # the workspace; and what zero-size arrays get
    pointers = [a.ctypes.data if a.size else spare.ctypes.data for a in arrays] + [spare.ctypes.data]
    ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * len(pointers))(native.address(mlir.entry))(*pointers)
    return arrays[len(inputs) :]


_OWN_OPS = {"dot_general", "conv2d", "reduce_window", "argmax", "argmin", "cumsum", "linear_recurrence", "sort"}
_OWN_OPS |= {"pad", "concatenate", "gather", "scatter_add", "dynamic_slice", "constant", "custom_vjp_call"}
_OWN_OPS |= {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"}
_F64_MATH = {"sin", "cos", "erf", "atan2", "pow"}  # `mlir/mathlib_f64.py`, the GPU's only
VALUE_PARAMS = [
    pytest.param(row, dtype, id=f"{row.name}-{dtype.name}".replace(" ", ""))
    for row in ROWS
    if row.op not in CPU_ONLY.keys() | FUNCTIONALIZED
    for dtype in row.dtypes
    if row.op in _OWN_OPS
    or ("scalar" in row.name and dt.bool_ in row.dtypes)
    or (row.op in _F64_MATH and dtype is dt.float64)
]


@pytest.mark.parametrize("row,dtype", VALUE_PARAMS)
def test_gpu_lowering_computes_the_op_table_values(row, dtype):
    case = build_case(row, dtype)
    for got, expected in zip(run_on_host(case.graph, case.inputs), case.expected):
        assert_close(got, expected, case.tol)


@pytest.mark.parametrize("row,dtype", [p for p in VALUE_PARAMS if p.values[0].op == "sort"])
def test_sorts_by_a_bitonic_network_compute_the_op_table_values(row, dtype, monkeypatch):
    """Every sort row with the bitonic network forced (non-empty rows longer than 1 element), on
    the host."""
    monkeypatch.setattr(lower_kernels, "RANK_SORT_MAX", 1)
    case = build_case(row, dtype)
    keys = next(op for op in case.graph.ops if op.name == "sort")
    longer = keys.operands[0].type.size > 0 and keys.operands[0].type.shape[keys.attrs["axis"]] > 1
    assert ("scf.for %pass" in generate_mlir(case.graph).text) == longer
    for got, expected in zip(run_on_host(case.graph, case.inputs), case.expected):
        assert_close(got, expected, case.tol)


@pytest.mark.parametrize("fn", [fnp.sort, fnp.argsort])
def test_a_long_row_sorts_by_a_bitonic_network_on_the_emulator(fn):
    """5000 floats with nans and ties (argsort: the positions are a payload, so stability shows):
    the 91 passes of the network are one host loop around one launch; the same program at 4096
    elements sorts by rank, without a loop."""
    import gpu_emulator

    rng = np.random.default_rng(3)
    x = rng.integers(-20, 20, 5000).astype(np.float32)
    x[rng.integers(0, 5000, 30)] = np.nan
    for n, passes in ((5000, [91]), (4096, [])):
        module = lower_to_ptx(fj.jit(fn).lower(x[:n]).graph("optimized"), GpuOptions(chip="sm_90"))
        assert [step.trips for step in module.plan.steps if isinstance(step, Loop)] == passes
        assemble_all(module.kernels, "sm_90")
        want = np.asarray(fj.jit(fn, target="interpreter")(x[:n]))  # numpy's stable order, nans last
        kernels = gpu_emulator.EmulatedKernels(module.gpu_mlir)
        (got,) = gpu_emulator.run(module.plan, kernels, [x[:n]], [((n,), want.dtype)])
        np.testing.assert_array_equal(got, want)


def gradient_case(row, dtype):
    """The gradient graph of `row` in `dtype` (its cotangents as inputs) and arguments for it."""
    case = build_case(row, dtype)
    graph = vjp_graph(case.graph, VJPSpec(primal_outputs=False))
    rng = np.random.default_rng(0)
    results = [r.type for r in case.graph.results if r.type.dtype.is_float]
    return graph, [*case.inputs, *(rng.uniform(0.5, 1.5, t.shape).astype(t.dtype.np_dtype) for t in results)]


@pytest.mark.parametrize(
    "row,dtype,chips", [p for p in GRADIENT_PARAMS if "sm_90" in p.values[2] and p.values[0].op not in CPU_ONLY]
)
def test_gpu_lowering_computes_gradient_graphs(row, dtype, chips):
    """The first gradient row of each op (the others: same lowerings), against the interpreter."""
    graph, args = gradient_case(row, dtype)
    for got, expected in zip(run_on_host(graph, args), interpret(graph, args)):
        assert_close(got, np.asarray(expected), tolerance(dtype, 8.0))


def test_values_cover_the_gpus_own_lowerings():
    ops = {param.values[0].op for param in VALUE_PARAMS}
    assert set(lower_kernels_table()) <= ops


def lower_kernels_table():
    table = LoweringTable("probe")
    lower_kernels.register(table)
    return table.tensor


# --- fused regions, whole-array reductions, gradients ------------------------------------------


def softmax(x):
    m = fnp.max(x, axis=1, keepdims=True)
    e = fnp.exp(x - m)
    return e / fnp.sum(e, axis=1, keepdims=True)


def layer_norm(x, g):
    mean = fnp.mean(x, axis=-1, keepdims=True)
    var = fnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / fnp.sqrt(var + 1e-5) * g


def chain(x, y):
    return fnp.tanh(x * y + 1.0) * fnp.exp(-x) + fnp.log(y * y + 1.0)


def whole_sum(x):
    return fnp.sum(x), fnp.max(x)


def loss(w, x):
    return fnp.sum(fnp.tanh(x * w + 0.5) ** 2)


_X = np.ones((33, 100), np.float32)
_PROGRAMS = {
    "softmax": (softmax, (_X,)),
    "layer_norm": (layer_norm, (_X, np.ones(100, np.float32))),
    "chain": (chain, (_X, _X)),
    "whole_sum": (whole_sum, (np.ones((7, 1000), np.float32),)),
    "grad": (fj.grad(loss), (np.ones(100, np.float32), _X)),
}


@needs_ptxas
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("name", list(_PROGRAMS))
def test_program_assembles_with_kernels_named_by_line(name, chip):
    fn, args = _PROGRAMS[name]
    lowered = fj.jit(fn, target=f"cuda-{chip}").lower(*args)
    kernels = get_backend(f"cuda-{chip}").compile(lowered.graph("optimized")).kernels
    assemble_all(kernels, chip)
    text = lowered.as_text("ptx")
    headers = re.findall(r"^// ---- kernel (\w+): (.*)$", text, re.MULTILINE)
    assert [h[0] for h in headers] == [k.name for k in kernels]
    assert any(os.path.basename(__file__) in members for _, members in headers)


def test_elementwise_chain_is_one_kernel_plus_its_output_copy():
    graph = fj.jit(chain).lower(*_PROGRAMS["chain"][1]).graph("optimized")
    kernels = get_backend("cuda").compile(graph).kernels
    computing = [k for k in kernels if k.members]
    assert len(computing) == 1 and len(kernels) <= 2
    # Its members: the chain's line only.
    line = chain.__code__.co_firstlineno + 1
    assert len(computing[0].members) == 1 and computing[0].members[0].endswith(f"{os.path.basename(__file__)}:{line}")


def test_whole_array_reduction_is_two_stage():
    graph = fj.jit(lambda x: fnp.sum(x)).lower(np.ones(4096, np.float32)).graph("optimized")
    gpu = get_backend("cuda").compile(graph)
    launches = re.findall(r"gpu.launch_func\s+@(\w+)::\S+ blocks in \((%\w+)", gpu.stages["gpu-mlir"])
    assert len(launches) >= 2  # partials, then their total
    assert "memref<1x512xf32>" in gpu.stages["gpu-mlir"]  # 512 partials of 8 elements


# --- errors --------------------------------------------------------------------------------------


def test_cpu_only_op_names_op_line_and_reason():
    def loop(x):
        return fj.while_loop(lambda c: c[0] < 10.0, lambda c: (c[0] * 2.0,), (x,))

    line = loop.__code__.co_firstlineno + 1
    with pytest.raises(CompileError, match=r"while': is CPU-only on target 'cuda': control flow") as info:
        fj.jit(loop, target="cuda").lower(np.float32(1.0)).as_text("ptx")
    assert f"{os.path.basename(__file__)}:{line}" in str(info.value)
    assert CPU_ONLY["while"] in str(info.value)


@needs_ptxas
def test_constants_of_several_values_live_in_the_kernels_module():
    table = np.arange(300, dtype=np.float32).reshape(100, 3)  # above the inline limit: a global of bytes

    def f(x):
        return x * np.float32([1.0, 2.0, 3.0]) + table

    graph = fj.jit(f, target="cuda").lower(np.ones((100, 3), np.float32)).graph("optimized")
    kernels = get_backend("cuda").compile(graph).kernels
    assemble_all(kernels, "sm_80")
    assert any(re.search(r"^\.global \.align \d+ \.b8 \w+\[1200\]", k.ptx, re.MULTILINE) for k in kernels)


@needs_ptxas
def test_scatter_add_adds_atomically_and_dynamic_slice_reads_its_start_in_the_kernel():
    def f(x, i, u):
        return x.at[i].add(u), fnp.dynamic_slice(x, (i[0],), (2,))

    args = (np.zeros(8, np.float32), np.array([1, 1, 7], np.int32), np.ones(3, np.float32))
    graph = fj.jit(f, target="cuda").lower(*args).graph("optimized")
    assert {"scatter_add", "dynamic_slice"} <= {op.name for op in graph.walk()}
    module = lower_to_ptx(graph, GpuOptions())
    assemble_all(module.kernels, "sm_80")
    assert any("atom.global.add.f32" in k.ptx or "red.global.add.f32" in k.ptx for k in module.kernels)


def test_find_ptxas_prefers_the_environment_then_the_wheel(tmp_path, monkeypatch):
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FLOWJIT_PTXAS", str(fake))
    assert find_ptxas() == str(fake)
    monkeypatch.setenv("FLOWJIT_PTXAS", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="FLOWJIT_PTXAS"):
        find_ptxas()
    monkeypatch.delenv("FLOWJIT_PTXAS")
    if importlib.util.find_spec("nvidia") is None:
        pytest.skip("the nvidia-cuda-nvcc-cu12 wheel (the `test` extra) is not installed")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # the wheel's binary is found without PATH
    assert find_ptxas().endswith(os.path.join("nvidia", "cuda_nvcc", "bin", "ptxas"))


@needs_ptxas
def test_float64_math_makes_no_calls():
    def f(x, y):
        return fnp.sin(x) + fnp.cos(y) + fnp.arctan2(x, y) + fnp.power(fnp.abs(x), y) + fnp.erf(x)

    graph = fj.jit(f).lower(np.ones(8), np.ones(8)).graph("optimized")
    assert {"sin", "cos", "atan2", "pow", "erf"} <= {op.name for op in graph.walk()}
    for chip in CHIPS:
        assemble_all(lower_to_ptx(graph, GpuOptions(chip=chip)).kernels, chip)


def test_float64_math_is_accurate_over_wide_ranges():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-10, 10, 4000), np.exp(rng.uniform(-40, 33, 4000)) * rng.choice([-1, 1], 4000)])
    y = rng.permutation(x)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, 355.0, 2.0**47, 1.0, -1.0]
    x, y = np.concatenate([x, specials]), np.concatenate([y, specials[::-1]])
    with np.errstate(all="ignore"):  # inf and nan operands
        base, exponent = np.abs(x) % 50, rng.uniform(-20, 20, x.size)
        cases = {
            "sin": ([x], np.sin(x)),
            "cos": ([x], np.cos(x)),
            "erf": ([x], np.array([math.erf(v) for v in x])),
            "atan2": ([x, y], np.arctan2(x, y)),
            "pow": ([base, exponent], np.power(base, exponent)),
        }
    for name, (args, expected) in cases.items():
        (got,) = run_on_host(single_op_graph(name, args, {}), args)
        # sin/cos: |x| < 2^48 reduced (x = 2^47 included); no Payne-Hanek reduction beyond
        np.testing.assert_allclose(got, expected, rtol=1e-13 if name == "pow" else 1e-15, atol=1e-16, err_msg=name)


@pytest.mark.skipif(unavailable_reason() is None, reason="a CUDA device is present: the function runs")
def test_running_without_a_gpu_says_why():
    with pytest.raises(GpuRuntimeError, match="cannot run 'chain' on GPU 0: .*use target='cpu'"):
        fj.jit(chain, target="cuda")(_X, _X)


def test_options_are_validated():
    with pytest.raises(ValueError, match="chip"):
        GpuOptions(chip="sm_75")
    with pytest.raises(ValueError, match="block_size"):
        GpuOptions(block_size=100)
    assert "{chip=sm_90 " in stage_pipeline("nvvm", options=GpuOptions(chip="sm_90"))


# --- the CLI -------------------------------------------------------------------------------------


@needs_ptxas
def test_cli_dump_ptx(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text("import flowjit.numpy as fnp\n\ndef f(x):\n    return fnp.exp(x) + 1.0\n")
    assert main(["dump", f"{model}:f", "--arg", "f32[64,64]", "--stage", "ptx", "--target", "cuda-sm_90"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^// ---- kernel \w+: .*model.py:4", out, re.MULTILINE)
    assert ".target sm_90" in out
    ptx = out[out.index("//\n// Generated by LLVM NVPTX") :].split("// ---- kernel")[0]
    assemble(ptx, "sm_90")
