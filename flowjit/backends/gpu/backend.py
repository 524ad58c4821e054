"""The GPU backend as a `Backend`: graphs compiled to PTX (one kernel per fused region or op) and a
launch plan (`plan.py`), run through the CUDA driver API (`runtime.py`).

Compiling needs MLIR (imported with `compiler.py` on the first compile that misses the disk
cache) and, for cubins, `ptxas`; running needs `cuda-bindings`, a driver and a device, and no
MLIR: an executable is made from a cache entry alone (`cache.py`), so code compiled on a build
machine runs on a GPU machine whose cache folder holds it.

Variables: `compile` functionalizes the graph's state (`passes/state.py`): each variable is an
extra input, each updated one an extra output; the executable binds them to the variables' copies
in device memory (`resident.py`) or, for callers that do not keep homes, to their host buffers.

Targets: 'cuda' (sm_80, or the chip of the device it compiles for: `fj.jit(f, device="gpu:0")`
compiles for that GPU's compute capability) and 'cuda-<chip>' for every chip of `pipeline.CHIPS`
('cuda-sm_90').
"""

from __future__ import annotations

import weakref

import numpy as np

from flowjit.backends.base import Backend, Executable
from flowjit.backends.gpu import cache, cubin, driver, resident, staging
from flowjit.backends.gpu import placement as _placement  # noqa: F401 (registers the GPU's model with placement)
from flowjit.backends.gpu.arrays import DeviceArray
from flowjit.backends.gpu.driver import GpuRuntimeError
from flowjit.backends.gpu.pipeline import CHIPS, GpuOptions
from flowjit.backends.gpu.plan import BUFFER_ALIGNMENT
from flowjit.backends.gpu.runtime import KernelImage, PlanRunner
from flowjit.errors import FlowjitTypeError
from flowjit.ir import dtypes as dt
from flowjit.ir.devices import DeviceSpec
from flowjit.ir.graph import Graph
from flowjit.ir.location import user_location
from flowjit.ir.printer import print_graph
from flowjit.passes import dump
from flowjit.passes.state import StateLayout, functionalize_state, touched_variables

__all__ = ["BACKENDS", "CudaBackend", "GpuExecutable", "GpuRuntimeError", "compile_entry"]


class GpuExecutable(Executable):
    """A compiled function for one GPU chip: the launch plan, each kernel's PTX (and cubin where
    ptxas made one), and the stage texts ('mlir', 'gpu-mlir', 'ptx', 'launch-plan'). `run` copies
    the inputs to device `ordinal`, replays the plan and copies the outputs back; `run_resident`
    keeps the variables (`layout`: the entry's inputs and outputs after the function's own) in
    device memory and may keep the results there too."""

    fresh_outputs = True
    takes_device_arrays = True

    def __init__(
        self, entry: cache.Entry, ordinal: int = 0, origin: str = "compiled", layout: StateLayout | None = None
    ):
        self.entry = entry
        self.name = entry.function
        self.ordinal = ordinal
        self.plan = entry.plan
        self.kernels = entry.kernels
        self.backend = f"cuda (MLIR -> NVVM -> PTX, {entry.chip}; launch plan run through the CUDA driver)"
        self.origin = origin  # 'compiled' or 'disk cache'
        self.stages = {**entry.stages, "launch-plan": self._plan_text()}
        self.layout = layout = layout or StateLayout()
        self._in_types = [(tuple(shape), dt.dtype(name).np_dtype) for shape, name in entry.inputs]
        self._out_types = [(tuple(shape), dt.dtype(name).np_dtype) for shape, name in entry.outputs]
        del self._in_types[len(self._in_types) - len(layout.inputs) :]  # the variables' are the last ones
        del self._out_types[len(self._out_types) - len(layout.outputs) :]
        self._runner: PlanRunner | None = None

    def _plan_text(self, loading: dict[str, str] | None = None) -> str:
        ptxas = self.entry.toolchain.get("ptxas")
        if ptxas:
            code = f"kernels: PTX and cubins for {self.entry.chip} (ptxas {ptxas})"
        else:
            code = "kernels: PTX only (ptxas was not found when this was compiled): the driver JIT-compiles them"
        lines = [self.plan.text(), code, f"from: {self.origin}"]
        for name, how in (loading or {}).items():
            lines.append(f"loaded {name}: {how}")
        return "\n".join(lines)

    def runner(self) -> PlanRunner:
        """The plan's runner on this executable's device, made on first use; a GpuRuntimeError
        saying exactly what is missing where no GPU can be used."""
        if self._runner is None:
            reason = driver.unavailable_reason()
            if reason is not None:
                raise GpuRuntimeError(
                    f"{user_location()}: cannot run '{self.name}' on GPU {self.ordinal}: {reason.rstrip('.')}. "
                    "Its PTX is in `.lower(...).as_text('ptx')`; use target='cpu' to run it on this machine"
                )
            self._runner = PlanRunner(self.plan, self.kernels, self.ordinal)
            weakref.finalize(self, _close_quietly, self._runner)  # its stream and pinned block go with it
            self.stages["launch-plan"] = self._plan_text(self._runner.loading_report())
            if dump.dump_dir() is not None:  # how each kernel was loaded (cubin or the driver's JIT)
                dump.write_stage(self.name, "launch-plan", self.stages["launch-plan"])
        return self._runner

    def check_arguments(self, args) -> list[np.ndarray | int]:
        """The arguments as C-contiguous host arrays, or as device addresses for `DeviceArray`s on
        this executable's GPU (one on another device, or not starting at a multiple of
        `plan.BUFFER_ALIGNMENT` bytes, as an imported view may, comes through the host); a
        FlowjitTypeError unless they match the signature."""
        if len(args) != len(self._in_types):
            raise FlowjitTypeError(f"expected {len(self._in_types)} arrays; found {len(args)}")
        arrays = []
        for i, (arg, (shape, dtype)) in enumerate(zip(args, self._in_types)):
            on_device = isinstance(arg, DeviceArray)
            if not on_device:
                arg = np.asarray(arg)
            if tuple(arg.shape) != shape or arg.dtype != dtype:
                raise FlowjitTypeError(
                    f"argument {i}: expected an array of shape {shape} and dtype {dtype}; "
                    f"found shape {tuple(arg.shape)} and dtype {arg.dtype}"
                )
            address = arg.address_on(self.ordinal) if on_device else None
            if address is not None and address % BUFFER_ALIGNMENT == 0:
                arrays.append(address)
            else:
                arrays.append(np.ascontiguousarray(arg.numpy() if on_device else arg))
        return arrays

    def run(self, args, variables=None, outputs=None):
        """One call on host arrays (or this GPU's `DeviceArray`s); the variables' host buffers hold
        their values before and after it (their device copies are used only when current and
        newer, and are stale afterwards)."""
        results, _ = self._call(args, variables or {}, keep_state=False, keep_results=False)
        return results

    def run_resident(self, args, variables=None, outputs=None, keep_results=False):
        """One call whose variables live in device memory (see `Executable.run_resident`): each
        is copied in only when its device copy is not current, and updated where it is."""
        return self._call(args, variables or {}, keep_state=True, keep_results=keep_results)

    def keeps(self, home) -> bool:
        return isinstance(home, resident.DeviceVariable) and home.ctx.ordinal == self.ordinal and not home.ctx.closed

    def _call(self, args, variables, keep_state: bool, keep_results: bool):
        names = [name for name, _ in self.layout.inputs]
        missing = sorted(set(names) - variables.keys())
        if missing:
            raise GpuRuntimeError(
                f"internal error: '{self.name}' was called without the variable(s) {', '.join(missing)}"
            )
        inputs = self.check_arguments(args)
        runner = self.runner()
        copies = {}
        for name in names:  # each variable's device copy (made on first use when it is kept there)
            host = variables[name]
            copy = copies[name] = resident.device_variable(runner.ctx, name, host, create=keep_state)
            if keep_state:
                inputs.append(copy.address_for_call())
            elif copy is not None and copy.device_current and not copy.host_current:
                inputs.append(copy.address)  # the host buffer is stale: the device holds the value
            else:
                inputs.append(host)
        results = [None if keep_results else np.empty(shape, dtype) for shape, dtype in self._out_types]
        updates = [None if keep_state else variables[name] for name in self.layout.outputs]
        kept = iter(runner.run(inputs, results + updates, self.name))
        if keep_results:
            results = [DeviceArray(runner.ctx, next(kept), shape, dtype) for shape, dtype in self._out_types]
        for name in self.layout.outputs:
            if keep_state:
                copies[name].updated(next(kept))
            elif copies[name] is not None:
                copies[name].written_to_host()
        return results, ({name: copies[name] for name in names} if keep_state else {})

    def run_trusted(self, args):
        return self.run(args)

    def run_step(self, args, variables, channel):
        return self.run(args, variables)


def _close_quietly(runner: PlanRunner) -> None:
    try:
        runner.close()
    except GpuRuntimeError:
        pass  # the context (or the driver, at exit) is gone already, and its resources with it


def compile_entry(graph: Graph, options: GpuOptions) -> cache.Entry:
    """Compile `graph` (MLIR -> PTX, the launch plan, cubins where ptxas is found) into what the
    cache keeps."""
    from flowjit.backends.gpu.compiler import lower_to_ptx

    module = lower_to_ptx(graph, options)
    ptxas = cubin.find_ptxas()
    functions = {launch.module: launch.function for launch, _ in module.plan.launches()}
    cubins = {}
    if ptxas is not None:
        cubins = cubin.assemble(ptxas, {k.name: k.ptx for k in module.kernels}, options.chip, options.opt_level)
    kernels = tuple(
        KernelImage(
            k.name,
            functions.get(k.name, ""),
            k.members,
            k.ptx,
            cubins.get(k.name),
            options.chip if k.name in cubins else None,
        )
        for k in module.kernels
    )
    return cache.Entry(
        function=graph.name,
        chip=options.chip,
        inputs=tuple((tuple(t.shape), t.dtype.name) for t in module.mlir.inputs),
        outputs=tuple((tuple(t.shape), t.dtype.name) for t in module.mlir.outputs),
        plan=module.plan,
        kernels=kernels,
        stages={"mlir": module.mlir.text, "gpu-mlir": module.gpu_mlir, "ptx": module.ptx_text()},
        toolchain={"mlir": cache.mlir_version(), "ptxas": cubin.ptxas_version(ptxas) if ptxas else None},
    )


def device_chip(ordinal: int) -> str | None:
    """The chip of `CHIPS` to compile for CUDA device `ordinal`: its own (sm_90 for compute
    capability 9.0), else the newest earlier one, whose PTX the driver JIT-compiles for it; None
    where the driver cannot say (no GPU here: the default chip is used)."""
    try:
        major, minor = driver.compute_capability(ordinal)
    except GpuRuntimeError:
        return None
    number = major * 10 + minor
    fitting = [chip for chip in CHIPS if int(chip.removeprefix("sm_")) <= number]
    return max(fitting, key=lambda chip: int(chip.removeprefix("sm_"))) if fitting else None


class CudaBackend(Backend):
    """Compiles graphs for one chip (`options.chip`); the generic 'cuda' target compiles for the
    chip of the device it is given, where the driver can say which."""

    def __init__(self, name: str, options: GpuOptions, follows_device: bool = False):
        self.name = name
        self.options = options
        self.follows_device = follows_device

    def compile(self, graph, device=None, options=None, aliases=None) -> Executable:
        """The executable for `graph` on `device` (a full device name; None: GPU 0), from the disk
        cache when it holds it (then MLIR is not imported). Donated buffers are not honoured
        (`aliases` stays empty). A partition with send/recv compiles to a `StagedExecutable`: its
        GPU calls with the rendezvous done on the host around them (`staging.py`)."""
        if staging.communicates(graph):
            return staging.StagedExecutable(graph, lambda stage: self.compile(stage, device, options))
        ordinal = 0
        if device is not None:
            ordinal = DeviceSpec.parse(device).index or 0
        if options is None:
            options = self.options
            chip = device_chip(ordinal) if self.follows_device and device is not None else None
            if chip is not None and chip != options.chip:
                options = GpuOptions(chip=chip, block_size=options.block_size, opt_level=options.opt_level)
        layout = StateLayout()
        if touched_variables(graph):  # variables become inputs and outputs (see the module docstring)
            graph, layout = functionalize_state(graph.copy())
        key = cache.cache_key(print_graph(graph), options)
        entry, origin = cache.load(key), "disk cache"
        if entry is None:
            entry, origin = compile_entry(graph, options), "compiled"
            cache.store(key, entry)
        executable = GpuExecutable(entry, ordinal, origin, layout)
        if dump.dump_dir() is not None:
            for stage, text in executable.stages.items():
                dump.write_stage(graph.name, stage, text)
        return executable


# 'cuda' and one 'cuda-<chip>' per chip, each with its options.
BACKENDS = {"cuda": CudaBackend("cuda", GpuOptions(), follows_device=True)} | {
    f"cuda-{chip}": CudaBackend(f"cuda-{chip}", GpuOptions(chip=chip)) for chip in CHIPS
}
