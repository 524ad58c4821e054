"""The stages of a jitted function for one signature: `Lowered` (the traced graph, the optimized
and placed graphs, the backend's texts: `as_text`) and `Compiled` (the executable, called with
arguments of that signature). `PIPELINE` and `PLACEMENT_PIPELINE` are the optimization pipelines
every target runs.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import numpy as np

from flowjit.backends import Executable, backend_for
from flowjit.backends.gpu.arrays import DeviceArray
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import TreeDef, tree_unflatten
from flowjit.frontend.signature import Binder, Signature, VariableArg, _to_host
from flowjit.frontend.tracebacks import user_errors
from flowjit.ir.graph import Graph
from flowjit.ir.location import user_location
from flowjit.ir.printer import print_graph
from flowjit.passes import dump
from flowjit.passes.fuse import fusion_summary
from flowjit.passes.partition import graph_devices, placement_report, split_partitions
from flowjit.passes.registry import run_pipeline
from flowjit.runtime.devices import placement_devices
from flowjit.runtime.executor import PartitionedExecutable
from flowjit.runtime.tasks import bring_home, is_local, set_variable_home, variable_home

# The optimization pipeline for every target, top to bottom.
PIPELINE = (
    "canonicalize",  # fold constants, simplify algebra, CSE, DCE
    "fuse",  # elementwise chains, reductions with their neighbours, contraction epilogues -> one kernel each
)
# Then, on a copy of the optimized graph (stage "placement"):
PLACEMENT_PIPELINE = (
    "place",  # a device for every op: constraints, variable colocation, cost model
    "partition",  # send/recv on every cross-device edge (nothing to do with one device)
)


class Lowered:
    """A traced function for one signature: its stages, and `compile()`."""

    def __init__(
        self,
        graph: Graph,
        sig: Signature,
        out_tree: TreeDef,
        paths,
        target: str,
        binder: Binder,
        variables=None,
        donated: tuple[int, ...] = (),
        keep_on_device: bool = False,
    ):
        self.signature = sig
        self.keep_on_device = keep_on_device  # results stay in the device's memory (DeviceArray)
        self.donated = donated  # indices of the dynamic leaves whose buffers the caller donated
        self.variables = dict(variables or {})  # name -> Variable the function reads or updates
        self.out_tree = out_tree
        self.paths = list(paths)
        self.target = target
        self.name = graph.name
        self._binder = binder
        self._graphs = {"traced": graph}
        if dump.dump_dir() is not None:  # printing costs: a large constant is written out in hex
            dump.write_stage(self.name, "traced", print_graph(graph))
        self._executable: Executable | None = None

    def graph(self, stage: str = "optimized") -> Graph:
        """The IR at `stage` ('traced', 'optimized', or 'placement': placed and partitioned)."""
        if stage == "optimized" and stage not in self._graphs:
            # Passes rewrite in place: optimize a copy so the traced stage stays as traced.
            copy = self._graphs["traced"].copy()
            copy.devices = tuple(d.name for d in placement_devices())  # local devices and a cluster's tasks'
            if isinstance(self.target, str):  # it compiles every partition: unconstrained ops stay on CPUs
                copy.unconstrained_device_types = ("cpu",)
            self._graphs["optimized"] = run_pipeline(copy, PIPELINE, dump_name=self.name)
        if stage == "placement" and stage not in self._graphs:
            copy = self.graph("optimized").copy()
            self._graphs["placement"] = run_pipeline(copy, PLACEMENT_PIPELINE, dump_name=self.name)
        if stage not in self._graphs:
            raise FlowjitValueError(f"no IR stage '{stage}'; IR stages are 'traced', 'optimized' and 'placement'")
        return self._graphs[stage]

    @property
    def stages(self) -> list[str]:
        """The stage names `as_text` accepts for this function and backend."""
        backend = list(self._compile_executable().stages) if self._executable or self.target != "interpreter" else []
        return ["traced", "optimized", "placement", *backend]

    def _compile_executable(self) -> Executable:
        if self._executable is None:
            placed = self.graph("placement")
            used = graph_devices(placed)
            if len(used) > 1 or (used and not is_local(used[0])):  # another task's device: run there
                self._executable = PartitionedExecutable(split_partitions(placed), self.target)
            else:  # one device: the optimized graph as is, by that device's backend (or the target's)
                graph = self.graph("optimized")
                device = used[0] if used else None
                backend = backend_for(device, self.target)
                self._executable = backend.compile(graph, device, aliases=self._aliases(graph))
        return self._executable

    def _aliases(self, graph: Graph) -> dict[int, int]:
        """Donation: each donated input leaf pairs with the first unpaired result of its type that an
        op computes. Output index -> input index. An input also returned as is is not donated: that
        result is copied from it at the end of the call, after the donated results are written."""
        inputs = [i for i, aval in enumerate(self.signature.avals) if not isinstance(aval, VariableArg)]
        returned = {graph.params.index(v) for v in graph.results if v in graph.params}
        aliases: dict[int, int] = {}
        for leaf in self.donated:
            if leaf not in inputs or inputs.index(leaf) in returned:
                continue  # a Variable argument is updated in place anyway
            for j, value in enumerate(graph.results):
                computed = value.producer is not None and value.producer.name != "constant"
                if j not in aliases and computed and value.type == self.signature.avals[leaf]:
                    aliases[j] = inputs.index(leaf)
                    break
        return aliases

    @user_errors
    def as_text(self, stage: str = "optimized") -> str:
        """The text of one stage: 'traced', 'optimized', 'placement' (each op's device and why, each
        transfer), or a backend stage ('mlir', 'llvm', 'asm')."""
        if stage in ("traced", "optimized"):
            header = f"stage: {stage}"
            if stage == "optimized":
                header += f"\npipeline: {', '.join(PIPELINE)}\n{fusion_summary(self.graph(stage))}"
                executable = self._compile_executable()
                header += f"\nbackend: {_backend_note(executable)}"
            return print_graph(self.graph(stage), header)
        if stage == "placement":
            placed = self.graph("placement")
            header = f"stage: placement\npipeline: {', '.join(PLACEMENT_PIPELINE)}\n{placement_report(placed)}"
            return print_graph(placed, header)
        executable = self._compile_executable()
        if stage not in executable.stages:
            available = ", ".join(["traced", "optimized", "placement", *executable.stages])
            raise FlowjitValueError(
                f"{user_location()}: no stage '{stage}' for backend '{executable.backend}'; available: {available}"
            )
        return executable.stages[stage]

    @user_errors
    def compile(self) -> Compiled:
        """The executable for this signature; call it with arguments of that signature."""
        return Compiled(
            self._compile_executable(),
            self.signature,
            self.out_tree,
            self.paths,
            self.name,
            self._binder,
            self.variables,
            self.keep_on_device,
        )


def _output_builder(out_tree: TreeDef) -> Callable[[list], object]:
    """Rebuilds a call's result from the executable's outputs; one leaf or a flat tuple without
    walking the tree (a third of a small call's cost)."""
    if out_tree.kind == "leaf":
        return operator.itemgetter(0)
    if out_tree.kind == "tuple" and all(child.kind == "leaf" for child in out_tree.children):
        return tuple
    return functools.partial(tree_unflatten, out_tree)


def _backend_note(executable: Executable) -> str:
    if executable.backend == "interpreter":
        return (
            "reference interpreter (numpy, op by op): this function is NOT compiled to native code "
            "because target='interpreter' was chosen or no native backend is available"
        )
    return executable.backend


# Up to this many (donated array, other argument) pairs, `_overlapping` compares them one by one
# (numpy's bounds check, a quarter of a microsecond a pair); above, it sorts every argument's span
# (a microsecond and a half an argument to read its address, so only worth it for many donations).
PAIRWISE_OVERLAP_CHECKS = 32


def _overlapping(arrays: Sequence[np.ndarray], donated: Sequence[int]) -> set[int]:
    """The indices in `donated` of the C-contiguous `arrays` whose bytes overlap another argument's."""
    if len(donated) * len(arrays) <= PAIRWISE_OVERLAP_CHECKS:
        share = np.may_share_memory
        return {k for k in donated if any(j != k and share(arrays[k], a) for j, a in enumerate(arrays))}
    return _overlapping_spans(arrays) & set(donated)


def _overlapping_spans(arrays: Sequence[np.ndarray]) -> set[int]:
    """Indices of the C-contiguous `arrays` whose bytes overlap another's. Sorted by start, an array
    overlaps an earlier one exactly when it starts before the furthest end so far, and then overlaps
    the array reaching that end too. An array that overlaps only later ones overlaps the next one,
    which marks it, or marks the reacher whose span holds it (so it was marked on its own turn)."""
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes, i) for i, a in enumerate(arrays) if a.nbytes)
    found: set[int] = set()
    reach, reacher = -1, -1
    for start, end, i in spans:
        if start < reach:
            found.update((i, reacher))
        if end > reach:
            reach, reacher = end, i
    return found


class Compiled:
    """A compiled function for one signature: call it with arguments of that signature, passed as
    to the jitted function (static arguments included, with the values it was lowered for)."""

    def __init__(
        self,
        executable: Executable,
        sig: Signature,
        out_tree: TreeDef,
        paths,
        name: str,
        binder: Binder,
        variables=None,
        keep_on_device: bool = False,
    ):
        self.executable = executable
        self.keep_on_device = keep_on_device
        # Variables in a fixed (name) order: locks are always taken in this order, so concurrent calls
        # of functions sharing variables cannot deadlock.
        self.variables = [v for _, v in sorted((variables or {}).items())]
        self._locks = [v.lock for v in self.variables]
        self._buffers = {v.name: v.buffer for v in self.variables}  # a Variable keeps one buffer for life
        # variables the executable runs in other tasks of a cluster; the others must be here
        self._remote_variables = getattr(executable, "remote_variables", frozenset())
        self.signature = sig
        self.out_tree = out_tree
        self.paths = paths
        self.name = name
        self._binder = binder
        self._fresh_outputs = executable.fresh_outputs
        self._aliases = executable.aliases
        self._donated_inputs = tuple(self._aliases.values())
        self._build_output = _output_builder(out_tree)
        # The call fast path: `call_arrays(args)` for numpy arrays of exactly the signature's shapes
        # and dtypes (the jitted function's array-key cache vouches for that): no conversion or
        # re-check, and for one result no Python frame between the jitted function and the backend.
        # An executable with device memory gets device arrays as they are (not copied to the host).
        self._device_arrays = executable.takes_device_arrays
        if self.variables or self._aliases or keep_on_device:
            self.call_arrays = self.call_leaves
        elif out_tree.kind == "leaf":
            self.call_arrays = executable.caller(single_output=True)
        else:
            run, build = executable.caller(single_output=False), self._build_output
            self.call_arrays = lambda args: build(run(args))

    def call_leaves(self, leaves: Sequence) -> object:
        """Run on the flattened dynamic arguments (already checked against the signature)."""
        arrays = [
            leaf if self._device_arrays and isinstance(leaf, DeviceArray) else _to_host(leaf, aval)
            for leaf, aval in zip(leaves, self.signature.avals)
            if not isinstance(aval, VariableArg)
        ]
        donated = self._donated_buffers(arrays) if self._aliases else None
        if self.variables:
            outs = self._run_with_variables(arrays, donated)
        elif self.keep_on_device:
            outs, _ = self.executable.run_resident(arrays, None, donated, keep_results=True)
        else:
            outs = self.executable.run(arrays, outputs=donated)
        if not self._fresh_outputs:  # an input passed through must not alias the caller's array
            outs = [np.array(o) if any(o is a for a in arrays) else o for o in outs]
        return self._build_output(outs)

    def _donated_buffers(self, arrays) -> dict[int, np.ndarray]:
        """Output index -> the donated argument's buffer to write it into. A donated array whose
        memory overlaps another argument's (the same array passed twice) is not used: the result may
        be written in place while the kernel computing it still reads the other argument, and no
        two results may share memory."""
        shared = _overlapping(arrays, self._donated_inputs)
        return {out: arrays[index] for out, index in self._aliases.items() if index not in shared}

    def _run_with_variables(self, arrays, donated=None):
        # Locks in a fixed order (see __init__); by hand, as an ExitStack costs more than the native call.
        taken = 0
        try:
            for lock in self._locks:
                lock.acquire()
                taken += 1
            # a variable a cluster's task or another device held (this executable's device keeps its own)
            bring_home(self._buffers, self._remote_variables, self.executable.keeps)
            outs, homes = self.executable.run_resident(arrays, self._buffers, donated, self.keep_on_device)
            for name, home in homes.items():  # the variable lives there now: host accesses go through it
                if variable_home(name) is not home:
                    set_variable_home(name, home)
            return outs
        finally:
            for lock in reversed(self._locks[:taken]):
                lock.release()

    @user_errors
    def __call__(self, *args, **kwargs):
        sig, _, leaves, paths = self._binder(args, kwargs)
        if sig != self.signature:
            raise FlowjitTypeError(
                f"{user_location()}: {self.name} was compiled for {self.signature.describe(self.paths)}; called "
                f"with {sig.describe(paths)}: {sig.explain_change(self.signature, paths)}. Lower it again for "
                "these arguments, or call the jitted function, which compiles once per signature"
            )
        return self.call_leaves(leaves)
