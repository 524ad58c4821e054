"""Compiled functions that read and update `fj.Variable`s.

The graph is functionalized (`flowjit.passes.state`): each variable becomes an extra input, each
updated variable an extra output. At call time the variable's live buffer is passed as that input
AND as that output, and the lowering writes such outputs last (`late_outputs`), after every read of
the old value, or straight into the variable's buffer where that is safe (`aliased_inputs`,
`backends/mlir/in_place.py`): the update happens in place, inside native code, with no copy
through Python.
"""

from __future__ import annotations

import numpy as np

from flowjit.backends.base import Executable
from flowjit.backends.cpu.communication import run_in_step
from flowjit.errors import CompileError
from flowjit.ir.graph import Graph
from flowjit.ir.ops import STATEFUL, get_opdef
from flowjit.passes.state import StateLayout, functionalize_state


def has_state(graph: Graph) -> bool:
    return any(get_opdef(op.name).family == STATEFUL for op in graph.walk())


class StatefulExecutable(Executable):
    """A CPU executable plus the binding of its extra inputs/outputs to variable buffers."""

    fresh_outputs = True  # the results are the inner executable's fresh arrays; variable buffers are not returned
    recv_locations: dict[str, str] = {}  # rendezvous key -> its recv's source line (for errors)

    def run_step(self, args, variables, channel):
        """A partition's call: reads and updates `variables`; send/recv use `channel`."""
        return run_in_step(lambda: self.run(args, variables), channel, self.recv_locations)

    def __init__(self, inner, layout: StateLayout, num_results: int):
        self.inner = inner
        self.layout = layout
        self.num_results = num_results
        self.backend = inner.backend
        self.stages = inner.stages
        self._input_names = [name for name, _ in layout.inputs]
        self._output_slots = [(num_results + j, name) for j, name in enumerate(layout.outputs)]

    @property
    def aliases(self) -> dict[int, int]:  # donation: the results come first among the inner outputs
        return self.inner.aliases

    @aliases.setter
    def aliases(self, value: dict[int, int]) -> None:
        self.inner.aliases = value

    def run(self, args, variables=None, outputs=None):
        variables = variables or {}
        try:
            buffers = [variables[name] for name in self._input_names]
            provided = {index: variables[name] for index, name in self._output_slots}
        except KeyError:
            missing = sorted({*self._input_names, *(name for _, name in self._output_slots)} - variables.keys())
            raise CompileError(f"internal error: no buffer for variable(s) {', '.join(missing)} in this call") from None
        # Variable buffers are C-contiguous by construction; check_args checks their shapes and dtypes.
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args] + buffers
        self.inner.check_args(arrays)
        provided.update(self.inner.donated_buffers(outputs) or {})
        return self.inner.run_trusted(arrays, provided)[: self.num_results]


def compile_stateful(graph: Graph, options):
    from dataclasses import replace

    from flowjit.backends.cpu.compiler import compile_cpu

    num_results, num_params = len(graph.results), len(graph.params)
    functional, layout = functionalize_state(graph.copy())
    names = [name for name, _ in layout.inputs]
    # Updated variable j is output num_results + j, and its buffer input num_params + its position.
    updates = {num_results + j: num_params + names.index(name) for j, name in enumerate(layout.outputs)}
    late = tuple(sorted({*options.late_outputs, *updates}))
    aliased = tuple(sorted({*options.aliased_inputs, *updates.items()}))
    inner = compile_cpu(functional, replace(options, late_outputs=late, aliased_inputs=aliased))
    return StatefulExecutable(inner, layout, num_results)
