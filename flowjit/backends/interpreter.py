"""The reference-interpreter backend: runs a graph op by op with the numpy implementations.
It is the oracle for the compiled backends and what `target='interpreter'` selects."""

from __future__ import annotations

from flowjit.backends import Executable
from flowjit.ir.graph import Graph
from flowjit.ir.interpreter import RunContext, interpret


class InterpreterExecutable(Executable):
    backend = "interpreter"

    def __init__(self, graph: Graph):
        self.graph = graph
        self.stages = {}

    def run(self, args, variables=None, outputs=None):
        return interpret(self.graph, args, RunContext(variables or {}))
