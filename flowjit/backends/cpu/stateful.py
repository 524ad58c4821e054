"""Compiled functions that read and update `fj.Variable`s.

The graph is functionalized (`flowjit.passes.state`): each variable becomes an extra input, each
updated variable an extra output. At call time the variable's live buffer is passed as that input
AND as that output, and the lowering writes such outputs last (`late_outputs`), after every read of
the old value: the update happens in place, inside native code, with no copy through Python.
"""

from __future__ import annotations

import numpy as np

from flowjit.backends import Executable
from flowjit.errors import CompileError
from flowjit.ir.graph import Graph
from flowjit.ir.ops import STATEFUL, get_opdef
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph
from flowjit.passes.state import StateLayout, functionalize_state


def has_state(graph: Graph) -> bool:
    return any(get_opdef(op.name).family == STATEFUL for op in graph.walk())


class StatefulExecutable(Executable):
    """A CPU executable plus the binding of its extra inputs/outputs to variable buffers."""

    fresh_outputs = True  # the results are the inner executable's fresh arrays; variable buffers are not returned

    def __init__(self, inner, layout: StateLayout, num_results: int):
        self.inner = inner
        self.layout = layout
        self.num_results = num_results
        self.backend = inner.backend
        self.stages = inner.stages

    def run(self, args, variables=None):
        variables = variables or {}
        missing = [name for name, _ in self.layout.inputs if name not in variables]
        if missing:
            raise CompileError(f"internal error: no buffer for variable(s) {', '.join(missing)} in this call")
        # Variable buffers are C-contiguous by construction; check_args checks their shapes and dtypes.
        buffers = [variables[name] for name, _ in self.layout.inputs]
        provided = {self.num_results + j: variables[name] for j, name in enumerate(self.layout.outputs)}
        arrays = [np.ascontiguousarray(a) if not a.flags.c_contiguous else a for a in args]
        self.inner.check_args(arrays + buffers)
        outs = self.inner.run_trusted(arrays + buffers, provided)
        return outs[: self.num_results]


def compile_stateful(graph: Graph, options):
    from dataclasses import replace

    from flowjit.backends.cpu.compiler import compile_cpu

    num_results = len(graph.results)
    functional, layout = functionalize_state(parse_graph(print_graph(graph)))
    late = tuple(range(num_results, num_results + len(layout.outputs)))
    inner = compile_cpu(functional, replace(options, late_outputs=late))
    return StatefulExecutable(inner, layout, num_results)
