"""Ahead-of-time compilation: a traced function -> `NAME.so` (or `NAME.a`), `NAME.h`, `NAME.json`.

    optimized graph  --lower_graph, MLIR pipelines, llvmlite O3 (reloc=pic)-->  kernel object
    kernel object + generated C wrapper (aot_c.py)  --system C compiler-->      shared/static library

The library needs no Python, MLIR or LLVM at run time: libc, libm and, unless built with
`threads="serial"`, the OpenMP runtime `libiomp5.so` (linked with an rpath to `$ORIGIN` and to the
build environment's lib folder, so copying it next to the library is enough to ship it). With
`threads="serial"` the parallel loops are compiled as plain loops and no OpenMP call remains.

A function placed on several CPU devices is partitioned as `fj.jit` does it: one kernel object per
partition, and the wrapper (`aot_c.partitioned_wrapper`, with the rendezvous of `aot_runtime.c`)
runs them concurrently per call; the library then also needs libpthread.

Variables: with `frozen` values (name -> array) they are constants of the code; otherwise each
becomes an input (its value before the call) and, when the function updates it, an output (its
value after), named after the variable, so the C caller owns the state.

With a CUDA target (`build_cuda_library`) the same graph and ports are compiled by the GPU backend
(PTX, cubins where ptxas is found, the launch plan), and the library is one generated C file
(`backends/gpu/aot_c.py`) embedding the kernels and the plan, which loads the CUDA driver with
dlopen at run time: it needs libc, libdl and libpthread to link, and the driver to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import numpy as np

from flowjit.backends import c_abi
from flowjit.backends.cpu import aot_c, host, library, toolchain
from flowjit.backends.cpu.compiler import generate_mlir
from flowjit.backends.cpu.pipeline import CompileOptions
from flowjit.backends.gpu import aot_c as cuda_c
from flowjit.backends.gpu.backend import BACKENDS as GPU_BACKENDS
from flowjit.backends.gpu.backend import compile_entry
from flowjit.errors import CompileError, FlowjitValueError
from flowjit.frontend.lowered import PIPELINE, PLACEMENT_PIPELINE
from flowjit.frontend.pytree import leaf_paths, tree_unflatten
from flowjit.frontend.signature import VariableArg
from flowjit.ir.builder import make_op
from flowjit.ir.graph import Graph, Value
from flowjit.passes.partition import PartitionPlan, graph_devices, short_device_name, split_partitions
from flowjit.passes.registry import run_pipeline
from flowjit.passes.state import functionalize_state
from flowjit.version import __version__

THREADS = ("openmp", "serial")
# The rendezvous functions partition kernels call (lower_communication.py); a partitioned library
# defines them (aot_runtime.c).
COMMUNICATION_SYMBOLS = ("flowjit_send", "flowjit_recv", "flowjit_send_done")
# What the wrapper of a partitioned library and its rendezvous runtime call (libc; pthread_* are in
# libc since glibc 2.34, in libpthread before).
RUNTIME_SYMBOLS = (
    "clock_gettime", "free", "getenv", "malloc", "memcpy", "memmove", "memset", "strcmp", "strtod",
    "pthread_attr_destroy", "pthread_attr_init", "pthread_attr_setstacksize", "pthread_cond_broadcast",
    "pthread_cond_destroy", "pthread_cond_init", "pthread_cond_timedwait", "pthread_cond_wait",
    "pthread_condattr_destroy", "pthread_condattr_init", "pthread_condattr_setclock", "pthread_create",
    "pthread_getspecific", "pthread_join", "pthread_key_create", "pthread_mutex_destroy", "pthread_mutex_init",
    "pthread_mutex_lock", "pthread_mutex_unlock", "pthread_once", "pthread_setspecific",
)  # fmt: skip


@dataclass(frozen=True)
class AotOptions:
    """How to build the library: its C name, threading, shared (.so) or static (.a), and its
    target: 'cpu', or 'cuda' / 'cuda-<chip>' (a library running the GPU code through the driver;
    `threads` does not apply)."""

    name: str
    threads: str = "openmp"
    static_lib: bool = False
    target: str = "cpu"

    def __post_init__(self):
        if not self.name.isidentifier() or not self.name.isascii():
            raise FlowjitValueError(f"--name '{self.name}': expected a C identifier (letters, digits, _)")
        if self.threads not in THREADS:
            raise FlowjitValueError(f"--threads '{self.threads}': expected one of {', '.join(THREADS)}")
        if self.target not in aot_targets():
            raise FlowjitValueError(f"--target '{self.target}': expected one of {', '.join(aot_targets())}")


def aot_targets() -> tuple[str, ...]:
    """The targets `flowjit compile` builds libraries for: cpu, cuda and cuda-<chip>."""
    return ("cpu", *GPU_BACKENDS)


@dataclass(frozen=True)
class Library:
    """The files written by `build_library`."""

    library: str
    header: str
    manifest: str


def kernel_object(graph: Graph, kernel: str, threads: str, runtime_prefix: str = ""):
    """Compile `graph` to a position-independent object defining `kernel` (hidden visibility);
    returns (object bytes, the MlirModule, the external functions it calls). Its calls of the
    rendezvous (`flowjit_send`...) go to `runtime_prefix` + that name, defined by the library."""
    with library.disabled():  # a library stands alone: products and row functions get their own kernels
        mlir = generate_mlir(graph)
    llvm_ir = toolchain.lower_to_llvm_ir(mlir.text, CompileOptions(openmp=threads == "openmp")).llvm_ir
    module = host.llvm().parse_assembly(llvm_ir)
    # Two libraries from functions of the same name may be linked into one program: the kernel
    # gets the library's name and stays out of the dynamic symbol table.
    entry = module.get_function(mlir.entry)
    entry.name = kernel
    entry.visibility = "hidden"
    for function in module.functions:
        if function.name in COMMUNICATION_SYMBOLS:
            function.name = runtime_prefix + function.name
            function.visibility = "hidden"
    externals = toolchain.undefined_symbols(module)
    lsr, cmov = toolchain.codegen_settings(mlir.kernel_kinds)
    return toolchain.emit_object(str(module), kernel, lsr, cmov), mlir, externals


def ports(lowered, graph: Graph, state_inputs: tuple[str, ...], state_outputs: tuple[str, ...]):
    """The C inputs and outputs: the function's own, named after their pytree paths, then the
    variables (`functionalize-state` appends them: `state_inputs` are the last parameters,
    `state_outputs` the last results)."""
    arg_paths = [p for p, a in zip(lowered.paths, lowered.signature.avals) if not isinstance(a, VariableArg)]
    if len(graph.params) != len(arg_paths) + len(state_inputs):
        raise CompileError(f"internal error: {len(graph.params)} parameters for {len(arg_paths)} arguments")
    n_results = len(graph.results) - len(state_outputs)
    out_paths = leaf_paths(tree_unflatten(lowered.out_tree, list(range(n_results))), "out")
    # (C name stem, description, variable) per parameter and per result, in the graph's order.
    inputs = [(p, p, None) for p in arg_paths] + [(v, f"variable {v}", v) for v in state_inputs]
    outputs = [(p, p, None) for p in out_paths] + [(f"{v}_out", f"variable {v}", v) for v in state_outputs]
    taken: set[str] = set()

    def port(stem, path, variable, t) -> c_abi.Port:
        return c_abi.Port(c_abi.c_identifier(stem, taken), path, tuple(t.shape), t.dtype, variable)

    return (
        [port(*names, t) for names, t in zip(inputs, graph.param_types)],
        [port(*names, t) for names, t in zip(outputs, graph.result_types)],
    )


def functional_graph(lowered, frozen: dict | None):
    """The graph to compile and the variables behind its last parameters and results (names).
    Without variables, the optimized graph; with them, the traced graph with state made explicit
    (`functionalize-state`), frozen variables replaced by constants, then optimized."""
    if not lowered.variables:
        return lowered.graph("optimized"), (), ()
    graph = lowered.graph("traced").copy()  # passes rewrite in place
    n_params = len(graph.params)
    graph, layout = functionalize_state(graph)
    state_inputs = tuple(name for name, _ in layout.inputs)
    if frozen is not None:
        if layout.outputs:
            raise FlowjitValueError(
                f"--freeze-variables: {lowered.name} updates variable(s) {', '.join(layout.outputs)}; frozen "
                "variables are constants. Compile without --freeze-variables to pass them as arguments"
            )
        values = {n_params + i: _frozen_value(frozen, name, vtype) for i, (name, vtype) in enumerate(layout.inputs)}
        _freeze_parameters(graph, values)
        state_inputs = ()
    return run_pipeline(graph, PIPELINE), state_inputs, layout.outputs


def _frozen_value(frozen: dict, name: str, vtype):
    if name not in frozen:
        listed = ", ".join(sorted(map(str, frozen))) or "none"
        raise FlowjitValueError(f"--checkpoint has no value for variable '{name}'; it holds: {listed}")
    value = np.asarray(frozen[name])
    if tuple(value.shape) != tuple(vtype.shape) or value.dtype != vtype.dtype.np_dtype:
        raise FlowjitValueError(
            f"--checkpoint: variable '{name}' is {vtype.dtype.name}{list(vtype.shape)} in the function; the "
            f"checkpoint holds {value.dtype}{list(value.shape)}"
        )
    return np.ascontiguousarray(value)


def _freeze_parameters(graph: Graph, values: dict[int, np.ndarray]) -> None:
    """Replace the parameters at the indices of `values` by constants holding those values."""
    replace: dict[Value, Value] = {}
    constants = []
    for index, value in values.items():
        op = make_op("constant", [], {"value": value})
        constants.append(op)
        replace[graph.params[index]] = op.results[0]
    graph.ops[:0] = constants
    for op in graph.walk():
        op.operands = [replace.get(v, v) for v in op.operands]
    graph.results = [replace.get(v, v) for v in graph.results]
    graph.params = [p for i, p in enumerate(graph.params) if i not in values]
    for i, p in enumerate(graph.params):
        p.index = i


def load_frozen_variables(path: str) -> dict:
    """Variable name -> value from a checkpoint of a dict (`fj.save_checkpoint(path, {name: value
    or Variable})`)."""
    from flowjit.frontend.checkpoint import load_checkpoint

    tree = load_checkpoint(path)
    if not isinstance(tree, dict):
        raise FlowjitValueError(
            f"--checkpoint '{path}': expected a checkpoint of a dict variable name -> value (e.g. "
            f"fj.save_checkpoint(path, {{v.name: v for v in variables}})); found a {type(tree).__name__}"
        )
    return tree


def c_compiler() -> list[str]:
    """The system C compiler (`$CC`, else `cc`), as an argv prefix."""
    command = shlex.split(os.environ.get("CC", "cc"))
    if not command or shutil.which(command[0]) is None:
        raise CompileError(
            f"no C compiler found ('{' '.join(command)}'): flowjit compile links the generated object with "
            "the system C compiler; install one (e.g. gcc) or set CC"
        )
    return command


def _run(argv: list[str]) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except OSError as e:  # e.g. no `ar` on the PATH
        raise CompileError(
            f"cannot run '{argv[0]}': {e.strerror or e}; the AOT build needs binutils and a C compiler"
        ) from None
    if proc.returncode != 0:
        raise CompileError(f"internal error: '{shlex.join(argv)}' failed:\n{proc.stderr}")


def link(
    workdir: str,
    name: str,
    object_paths: list[str],
    c_path: str,
    options: AotOptions,
    out_path: str,
    openmp: bool,
    pthread: bool = False,
    libraries: tuple[str, ...] = (),
):
    """Compile the wrapper and link it with the kernel objects into `out_path` (.so or .a); with
    `openmp`, against libiomp5; with `pthread` (a partitioned function, a CUDA library), against
    libpthread; with `libraries` (`-ldl`), against those too."""
    cc = c_compiler()
    threads = ["-pthread"] if pthread else []
    if options.static_lib:
        wrapper_object = os.path.join(workdir, f"{name}_wrapper.o")
        _run([*cc, "-c", "-O2", "-fPIC", *threads, "-o", wrapper_object, c_path])
        _run(["ar", "rcs", out_path, wrapper_object, *object_paths])
        return
    argv = [*cc, "-shared", "-O2", "-fPIC", *threads, f"-Wl,-soname,{name}.so", "-Wl,-z,noexecstack", "-o", out_path]
    argv += [c_path, *object_paths, *libraries, "-lm"]
    if openmp:
        lib_dir = os.path.dirname(host.openmp_library())
        argv += [f"-L{lib_dir}", "-liomp5", f"-Wl,-rpath,$ORIGIN:{lib_dir}"]
    _run(argv)


def partition_plan(graph: Graph) -> PartitionPlan | None:
    """`graph` placed and partitioned as `fj.jit` does it (stage "placement"), split per device;
    None when it runs on one device."""
    from flowjit.runtime.devices import devices

    graph = graph.copy()
    graph.devices = tuple(d.name for d in devices())
    placed = run_pipeline(graph, PLACEMENT_PIPELINE)
    return split_partitions(placed) if len(graph_devices(placed)) > 1 else None


def _compile_partitions(plan: PartitionPlan, name: str, threads: str):
    """Compile each partition's kernel. Returns the (kernel, object bytes) pairs, the wrapper's C
    source, the total workspace, the external symbols and the manifest's list of partitions."""
    objects, kernels, externals, described, keys = [], [], set(RUNTIME_SYMBOLS), [], []
    for n, part in enumerate(plan.partitions):
        kernel = f"{name}_kernel{n}"
        code, mlir, calls = kernel_object(part.graph, kernel, threads, runtime_prefix=f"{name}_")
        objects.append((kernel, code))
        kernels.append(aot_c.PartitionKernel(kernel, tuple(part.inputs), tuple(part.outputs), mlir.workspace_bytes))
        externals.update(s for s in calls if not s.startswith(f"{name}_flowjit_"))
        keys += [op.attrs["key"] for op in part.graph.ops if op.name == "send"]
        described.append(
            {
                "device": short_device_name(part.device),
                "inputs": list(part.inputs),
                "outputs": list(part.outputs),
                "workspace_bytes": mlir.workspace_bytes,
            }
        )
    passthrough = [(k, source[1]) for k, source in enumerate(plan.result_sources) if source[0] == "param"]
    workspace = aot_c.partitioned_workspace_bytes(kernels) + aot_c.WORKSPACE_ALIGNMENT
    return objects, (kernels, keys, passthrough), workspace, sorted(externals), described


def build_library(lowered, out_dir: str, options: AotOptions, source: str, frozen: dict | None = None) -> Library:
    """Compile `lowered` (a `fj.jit(...).lower(...)` result) into a C library in `out_dir`. A
    function placed on several devices becomes one kernel per partition, run concurrently by the
    entry point (see docs/aot.md). A CUDA target builds `build_cuda_library`'s library instead."""
    if options.target != "cpu":
        return build_cuda_library(lowered, out_dir, options, source, frozen)
    graph, state_inputs, state_outputs = functional_graph(lowered, frozen)
    inputs, outputs = ports(lowered, graph, state_inputs, state_outputs)
    plan = partition_plan(graph)
    if plan is None:
        kernel = f"{options.name}_kernel"
        object_code, mlir, externals = kernel_object(graph, kernel, options.threads)
        objects = [(kernel, object_code)]
        workspace = mlir.workspace_bytes + aot_c.WORKSPACE_ALIGNMENT
        wrapper = aot_c.wrapper(options.name, kernel, inputs, outputs, mlir.workspace_bytes)
        partitions = None
    else:
        objects, (kernels, keys, passthrough), workspace, externals, partitions = _compile_partitions(
            plan, options.name, options.threads
        )
        wrapper = aot_c.partitioned_wrapper(options.name, kernels, keys, passthrough, inputs, outputs)
    manifest = _manifest(lowered, options, source, inputs, outputs, workspace, externals, partitions)
    paths = Library(
        os.path.join(out_dir, options.name + (".a" if options.static_lib else ".so")),
        os.path.join(out_dir, f"{options.name}.h"),
        os.path.join(out_dir, f"{options.name}.json"),
    )
    with open(paths.header, "w", encoding="utf-8") as f:
        f.write(aot_c.header(options.name, inputs, outputs, manifest))
    with tempfile.TemporaryDirectory(prefix="flowjit-aot-") as workdir:
        object_paths = []
        for kernel, code in objects:
            object_paths.append(os.path.join(workdir, f"{kernel}.o"))
            with open(object_paths[-1], "wb") as f:
                f.write(code)
        c_path = os.path.join(workdir, f"{options.name}.c")
        with open(c_path, "w", encoding="utf-8") as f:
            f.write(wrapper)
        # The wrapper includes NAME.h: a copy sits next to it.
        shutil.copy(paths.header, workdir)
        openmp = "libiomp5" in manifest["runtime_libraries"]
        link(workdir, options.name, object_paths, c_path, options, paths.library, openmp, plan is not None)
    with open(paths.manifest, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return paths


def build_cuda_library(lowered, out_dir: str, options: AotOptions, source: str, frozen: dict | None = None) -> Library:
    """Compile `lowered` for the GPU (`options.target`: PTX, cubins where ptxas is found, the
    launch plan) into a C library that embeds the kernels and replays the plan through the CUDA
    driver, which it loads with dlopen at run time (`backends/gpu/aot_c.py`, docs/aot.md)."""
    graph, state_inputs, state_outputs = functional_graph(lowered, frozen)
    inputs, outputs = ports(lowered, graph, state_inputs, state_outputs)
    entry = compile_entry(graph, GPU_BACKENDS[options.target].options)
    where = cuda_c.layout(entry.plan, inputs, outputs)
    manifest = _cuda_manifest(options, source, inputs, outputs, entry, where)
    paths = Library(
        os.path.join(out_dir, options.name + (".a" if options.static_lib else ".so")),
        os.path.join(out_dir, f"{options.name}.h"),
        os.path.join(out_dir, f"{options.name}.json"),
    )
    with open(paths.header, "w", encoding="utf-8") as f:
        f.write(cuda_c.header(options.name, inputs, outputs, manifest))
    with tempfile.TemporaryDirectory(prefix="flowjit-aot-") as workdir:
        c_path = os.path.join(workdir, f"{options.name}.c")
        with open(c_path, "w", encoding="utf-8") as f:
            f.write(cuda_c.source(options.name, inputs, outputs, entry.plan, entry.kernels))
        shutil.copy(paths.header, workdir)
        link(workdir, options.name, [], c_path, options, paths.library, False, pthread=True, libraries=("-ldl",))
    with open(paths.manifest, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return paths


def _cuda_manifest(options: AotOptions, source: str, inputs, outputs, entry, where) -> dict:
    launched = set(entry.plan.kernels())
    kernels = [k for k in entry.kernels if k.name in launched]
    cubins = {k.cubin_chip for k in kernels if k.cubin}
    return {
        "name": options.name,
        "source": source,
        "flowjit_version": __version__,
        "library": options.name + (".a" if options.static_lib else ".so"),
        "header": f"{options.name}.h",
        "entry_points": [
            options.name,
            *(f"{options.name}_{s}" for s in ("set_device", "release", "last_error", "status_string")),
        ],
        "inputs": [_port_json(p) for p in inputs],
        "outputs": [_port_json(p) for p in outputs],
        "variables": sorted({p.variable for p in inputs + outputs if p.variable}),
        "runtime_libraries": ["libc", "libdl", "libpthread"],
        "driver": "libcuda.so.1, loaded with dlopen at the first call (FLOWJIT_LIBCUDA=path loads that file)",
        "external_symbols": sorted(cuda_c.RUNTIME_SYMBOLS),
        "target": {
            "kind": "cuda",
            "chip": entry.chip,
            "cubin": cubins.pop() if cubins else None,
            "ptxas": entry.toolchain.get("ptxas"),
        },
        "kernels": [
            {
                "module": k.name,
                "function": k.function,
                "members": list(k.members),
                "ptx_bytes": len(k.ptx.encode()),
                "ptx_sha256": hashlib.sha256(k.ptx.encode()).hexdigest(),
                "cubin_bytes": len(k.cubin) if k.cubin else 0,
            }
            for k in kernels
        ],
        "launches": entry.plan.launch_count(),
        "device_bytes": where.arena_bytes,
        "device_buffers": [
            {"kind": b.kind, "index": b.index, "bytes": b.nbytes, "offset": offset}
            for b, offset in zip(entry.plan.buffers, where.buffer_offsets)
        ],
        "pinned_bytes": where.staging_bytes,
        "launch_plan": entry.plan.to_json(),
    }


def _port_json(port: c_abi.Port) -> dict:
    entry = {
        "name": port.c_name,
        "path": port.path,
        "shape": list(port.shape),
        "dtype": port.dtype.name,
        "c_type": port.c_type,
        "layout": "C-contiguous",
        "bytes": port.nbytes,
    }
    if port.variable is not None:
        entry["variable"] = port.variable
    return entry


def _manifest(
    lowered, options: AotOptions, source: str, inputs, outputs, workspace: int, externals, partitions
) -> dict:
    cpu = host.host_cpu()
    runtime = ["libc", "libm"] + (["libpthread"] if partitions else [])
    runtime += ["libiomp5"] if any(s.startswith("__kmpc") for s in externals) else []
    manifest = {
        "name": options.name,
        "source": source,
        "flowjit_version": __version__,
        "library": options.name + (".a" if options.static_lib else ".so"),
        "header": f"{options.name}.h",
        "entry_points": [
            options.name,
            *(f"{options.name}_{s}" for s in ("with_workspace", "workspace_size", "status_string")),
        ],
        "inputs": [_port_json(p) for p in inputs],
        "outputs": [_port_json(p) for p in outputs],
        "variables": sorted({p.variable for p in inputs + outputs if p.variable}),
        "workspace_bytes": workspace,
        "threads": options.threads,
        "runtime_libraries": runtime,
        "external_symbols": externals,
        "target": {"triple": cpu.triple, "cpu": cpu.name, "features": cpu.features},
    }
    if partitions:
        manifest["partitions"] = partitions
    return manifest
