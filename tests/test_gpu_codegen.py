"""The GPU target, compile-only (flowjit/backends/gpu): PTX for sm_80 and sm_90, assembled by ptxas.

No GPU is needed: each test lowers graphs to PTX and hands every kernel to `ptxas -arch=sm_XX`
(skipped, with the reason, where ptxas is missing). Rows of the op table (elementwise ops with
their math functions, broadcasts, layout, reductions), fused regions (softmax, layer norm), a
gradient graph and the user-facing entry points (`as_text("ptx")`, `flowjit dump --stage ptx
--target cuda`); ops the GPU cannot lower yet fail with a CompileError naming the op and its line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.gpu.backend import GpuRuntimeError
from flowjit.backends.gpu.compiler import lower_to_ptx
from flowjit.backends.gpu.pipeline import GpuOptions, stage_pipeline
from flowjit.backends.gpu.toolchain import find_ptxas
from flowjit.backends.registry import get_backend
from flowjit.cli import main
from flowjit.errors import CompileError
from flowjit.ir import dtypes as dt

sys.path.insert(0, os.path.dirname(__file__))
from op_table import ROWS, build_case  # noqa: E402

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


# --- op table rows -----------------------------------------------------------------------------

# Ops the GPU lowers: every row in float32, the first row of each op in float16 (computed in
# float32) and int32, within the file's time budget.
_MATH = ("exp", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "sin", "cos", "erf", "floor", "round")
_ELEMENTWISE = ("add", "sub", "mul", "div", "max", "min", "pow", "atan2", "neg", "abs", "lt", "eq", "select")
_LAYOUT = ("broadcast", "reshape", "transpose", "convert", "iota", "slice")
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
_FIRST_ROW_DTYPES = (dt.float16, dt.int32)


def _rows():
    seen = set()
    for row in ROWS:
        if row.op not in (*_MATH, *_ELEMENTWISE, *_LAYOUT, *_REDUCTIONS) or "scalar" in row.name:
            continue
        for dtype in row.dtypes:
            if dtype == dt.float32 or (dtype in _FIRST_ROW_DTYPES and (row.op, dtype) not in seen):
                seen.add((row.op, dtype))
                yield pytest.param(row, dtype, id=f"{row.name}-{dtype.name}".replace(" ", ""))


ROW_PARAMS = list(_rows())


@needs_ptxas
@pytest.mark.parametrize("row,dtype", ROW_PARAMS)
def test_op_row_assembles(row, dtype):
    graph = build_case(row, dtype).graph
    empty = not any(r.type.size for r in graph.results)
    for chip in CHIPS:
        assemble_all(lower_to_ptx(graph, GpuOptions(chip=chip)).kernels, chip, empty)


def test_rows_cover_the_op_families():
    ops = {param.values[0].op for param in ROW_PARAMS}
    assert {"exp", "tanh", "log", "sin", "add", "pow", "broadcast", "transpose", "reduce_sum", "reduce_max"} <= ops
    assert len(ROW_PARAMS) >= 100


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
    assert "memref<1024xf32>" in gpu.stages["gpu-mlir"]  # 1024 partials of 4 elements


# --- errors --------------------------------------------------------------------------------------


def test_unsupported_op_names_op_and_line():
    def matmul(a, b):
        return a @ b

    line = matmul.__code__.co_firstlineno + 1
    with pytest.raises(CompileError, match=r"dot_general.*target 'cuda'") as info:
        fj.jit(matmul, target="cuda").lower(_X, _X.T).as_text("ptx")
    assert f"{os.path.basename(__file__)}:{line}" in str(info.value)


def test_float64_libm_math_is_refused_with_its_line():
    def f(x):
        return fnp.sin(x)

    with pytest.raises(CompileError, match=r"sin.*float64.*libdevice") as info:
        fj.jit(f, target="cuda").lower(np.ones(8)).as_text("ptx")
    assert f"{os.path.basename(__file__)}:{f.__code__.co_firstlineno + 1}" in str(info.value)


def test_running_says_it_needs_the_gpu_runtime():
    with pytest.raises(GpuRuntimeError, match="CUDA device and the GPU runtime"):
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
