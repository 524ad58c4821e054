"""Runs a GPU launch plan on the CPU, for tests on machines without a GPU.

Each `gpu.func` kernel of the "gpu-mlir" stage is rewritten into a CPU function (its block and
thread ids become arguments; a wrapper loops over the grid and the block), lowered to LLVM with
MLIR and compiled with llvmlite. The plan is replayed by the runtime's own code (`runtime.pack`,
`runtime.replay`, `PackedLaunch.fill`): every launch calls its kernel's wrapper with the packed
parameter values, so buffers, views, offsets, loop variables, grid and block dimensions and the
parameter packing are exercised with real data.

What it does not check: the NVPTX code generation and the PTX (ptxas assembles it in
test_gpu_codegen.py), the driver, and anything about concurrency: the threads of a block run one
after another, which is faithful only because the kernels use no shared memory and no barriers
(`emulated_kernels` refuses any other gpu op). A kernel module's constant globals become globals of
the CPU module (renamed per kernel module).
"""

from __future__ import annotations

import contextlib
import ctypes
import re

import numpy as np

from flowjit.backends.gpu import compiler, lower_kernels, runtime
from flowjit.backends.gpu.plan import LaunchPlan
from flowjit.backends.mlir import pipeline

_FUNC = re.compile(r"^    gpu\.func @(\w+)\((.*)\) kernel(?: attributes \{.*\})? \{$")
_MODULE = re.compile(r"^  gpu\.module @(\w+)")
_GLOBAL = re.compile(r"^\s*(memref\.global .*?)@(\w+)(.*)$")
_IDS = re.compile(r"^\s*(%\w+) = gpu\.(block_id|thread_id)\s+([xyz])$")
_ARG = re.compile(r", (?=%\w+: )")
LOWER = (  # vector.load/store: the wide accesses of elementwise kernels (`wide_accesses.py`)
    "builtin.module(lower-affine,convert-scf-to-cf,convert-vector-to-llvm,expand-strided-metadata,lower-affine,"
    "convert-math-to-llvm,"
    "finalize-memref-to-llvm,convert-arith-to-llvm,convert-index-to-llvm,convert-func-to-llvm,"
    "convert-cf-to-llvm,reconcile-unrealized-casts)"
)
_GRID = ("gx", "gy", "gz", "dx", "dy", "dz")


@contextlib.contextmanager
def host_loops():
    """Inside: the GPU lowers reductions the simple way (one thread per result, the loops in the
    generic's own order), so a column sum becomes a serial loop over its rows, on the host, around a
    launch per row. The GPU's lowerings write no such loop otherwise (reductions go in two stages or
    keep their loops innermost), but a plan may hold serial loops around launches, and the tests of
    how plans, the runtime and AOT libraries keep and unroll them compile through this."""
    saved = lower_kernels.partials_per_result, compiler.contiguous_dimension_first
    lower_kernels.partials_per_result = lambda results, extent: 1
    compiler.contiguous_dimension_first = lambda module: None
    try:
        yield
    finally:
        lower_kernels.partials_per_result, compiler.contiguous_dimension_first = saved


def _cpu_functions(gpu_mlir: str) -> tuple[str, dict[str, str]]:
    """The kernels as CPU functions and their grid wrappers (MLIR text), and each kernel module's
    wrapper symbol."""
    lines = gpu_mlir.splitlines()
    functions, wrappers, module = [], {}, None
    constants: dict[str, dict[str, str]] = {}  # kernel module -> its globals' names in the CPU module
    for line in lines:  # the constants kernels read (after their functions in each gpu.module)
        if m := _MODULE.match(line):
            module = m.group(1)
        elif m := _GLOBAL.match(line):
            renamed = constants.setdefault(module, {})[m.group(2)] = f"{module}__{m.group(2)}"
            functions.append(f"  {m.group(1)}@{renamed}{m.group(3)}")
    i = 0
    while i < len(lines):
        if m := _MODULE.match(lines[i]):
            module = m.group(1)
        m = _FUNC.match(lines[i])
        if m is None:
            i += 1
            continue
        name, args = f"{module}__{m.group(1)}", _ARG.split(m.group(2))
        body, renames = [], {}
        i += 1
        while lines[i] != "    }":
            ids = _IDS.match(lines[i])
            if ids:
                renames[ids.group(1)] = f"%fj_{'b' if ids.group(2) == 'block_id' else 't'}{ids.group(3)}"
            elif "gpu." in lines[i] and "gpu.return" not in lines[i]:
                raise NotImplementedError(f"the emulator cannot run {lines[i].strip()}")
            else:
                body.append(lines[i].replace("gpu.return", "return"))
            i += 1
        text = "\n".join(body)
        for old, new in renames.items():
            text = re.sub(re.escape(old) + r"\b", new, text)
        for old, new in constants.get(module, {}).items():
            text = re.sub(rf"@{re.escape(old)}\b", f"@{new}", text)
        ids = ", ".join(f"%fj_{k}{a}: index" for k in "bt" for a in "xyz")
        functions.append(f"  func.func @{name}({', '.join(args)}, {ids}) {{\n{text}\n  }}")
        names = [a.split(":")[0] for a in args]
        types = [a.split(": ", 1)[1] for a in args]
        loops, close = [], []
        for var, bound in (("bz", "gz"), ("by", "gy"), ("bx", "gx"), ("tz", "dz"), ("ty", "dy"), ("tx", "dx")):
            loops.append(f"    scf.for %fj_{var} = %c0 to %{bound} step %c1 {{")
            close.append("    }")
        call_args = ", ".join([*names, *(f"%fj_{k}{a}" for k in "bt" for a in "xyz")])
        call_types = ", ".join([*types, *["index"] * 6])
        wrapper = f"{name}__grid"
        grid = ", ".join(f"%{g}: index" for g in _GRID)
        functions.append(
            f"  func.func @{wrapper}({', '.join(args)}, {grid}) {{\n"
            "    %c0 = arith.constant 0 : index\n    %c1 = arith.constant 1 : index\n"
            + "\n".join(loops)
            + f"\n    func.call @{name}({call_args}) : ({call_types}) -> ()\n"
            + "\n".join(close)
            + "\n    return\n  }"
        )
        wrappers[module] = wrapper
    return "module {\n" + "\n".join(functions) + "\n}", wrappers


class EmulatedKernels:
    """The kernels of one compiled GPU function, compiled for this CPU."""

    def __init__(self, gpu_mlir: str):
        import llvmlite.binding as llvm

        from flowjit.backends.cpu import toolchain

        text, wrappers = _cpu_functions(gpu_mlir)
        with pipeline.lock(), pipeline.mlir_context():
            module = pipeline.parse(text)
            pipeline.run_pipeline(module, LOWER, lambda: text)
            llvm_ir = pipeline.translate(module)
        toolchain.llvm()  # llvmlite initialized as the CPU backend does it
        self._module = llvm.parse_assembly(llvm_ir)
        target = llvm.Target.from_default_triple().create_target_machine()
        self._engine = llvm.create_mcjit_compiler(self._module, target)
        self._engine.finalize_object()
        self._wrappers = {module: self._engine.get_function_address(name) for module, name in wrappers.items()}
        self._calls: dict[str, object] = {}

    def launch(self, packed: runtime.PackedLaunch) -> None:
        """Run one packed launch on the CPU (the runtime's `replay` calls it)."""
        launch = packed.launch
        self.call(launch.module, packed.values, launch.grid, launch.block)

    def call(self, module: str, values, grid, block) -> None:
        """Run kernel module `module` with parameter `values` (ctypes scalars of its parameters'
        types) over `grid` blocks of `block` threads."""
        call = self._calls.get(module)
        if call is None:
            types = [type(v) for v in values] + [ctypes.c_uint64] * 6
            call = self._calls[module] = ctypes.CFUNCTYPE(None, *types)(self._wrappers[module])
        call(*[v.value for v in values], *grid, *block)


_HOOK = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_char_p, *[ctypes.c_uint] * 6, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
)


def run_launches_of(fake_driver: ctypes.CDLL, executables) -> object:
    """Make the fake driver (tests/fake_cuda) run every launch of `executables` (GpuExecutables
    compiled without cubins) on the CPU, so that their `run` computes real results through the
    whole runtime. Returns the hook, which must be kept alive."""
    by_ptx = {}
    for executable in executables:
        kernels = EmulatedKernels(executable.stages["gpu-mlir"])
        kinds = {launch.module: launch.param_kinds() for launch, _ in executable.plan.launches()}
        for image in executable.kernels:
            by_ptx[image.ptx.encode()] = (kernels, image.name, kinds[image.name])

    def hook(ptx, name, gx, gy, gz, bx, by, bz, params, count):
        kernels, module, kinds = by_ptx[ptx]
        values = [runtime._PARAM_CTYPES[k].from_address(params[i]) for i, k in enumerate(kinds)]
        kernels.call(module, values, (gx, gy, gz), (bx, by, bz))

    callback = _HOOK(hook)
    fake_driver.fake_cuda_set_launch_hook(callback)
    return callback


def run(plan: LaunchPlan, kernels: EmulatedKernels, inputs: list[np.ndarray], outputs: list[tuple]) -> list:
    """Replay `plan` on host buffers: inputs copied in, every launch emulated, outputs copied out
    (`outputs`: (shape, dtype) of each). Buffers start filled with 0xFF bytes (NaN for floats), so
    a result that depends on memory nothing wrote is caught."""
    blocks = [np.full(max(b.nbytes, 1), 0xFF, np.uint8) for b in plan.buffers]
    addresses = [block.ctypes.data for block in blocks]
    inputs_at = {b.index: i for i, b in enumerate(plan.buffers) if b.kind == "input"}
    outputs_at = {b.index: i for i, b in enumerate(plan.buffers) if b.kind == "output"}
    for index, array in enumerate(inputs):
        blocks[inputs_at[index]][: array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    runtime.replay(runtime.pack(plan.steps), addresses, kernels.launch)
    results = []
    for index, (shape, dtype) in enumerate(outputs):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        results.append(blocks[outputs_at[index]][:nbytes].view(dtype).reshape(shape).copy())
    return results
