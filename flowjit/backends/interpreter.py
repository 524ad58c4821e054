"""The reference-interpreter backend: runs a graph op by op with the numpy implementations.
It is the oracle for the compiled backends and what `target='interpreter'` selects."""

from __future__ import annotations

from flowjit.backends.base import Backend, Executable
from flowjit.errors import FlowjitError
from flowjit.ir.channel import TransferError
from flowjit.ir.graph import Graph
from flowjit.ir.interpreter import RunContext, check_array, eval_op, interpret
from flowjit.passes.partition import short_device_name


class PartitionError(FlowjitError):
    """An op of one partition failed while running."""


class InterpreterExecutable(Executable):
    backend = "interpreter"

    def __init__(self, graph: Graph, device: str | None = None):
        self.graph = graph
        self.device = short_device_name(device) if device else "the default device"
        self.stages = {}

    def run(self, args, variables=None, outputs=None):
        return interpret(self.graph, args, RunContext(variables or {}))

    def run_step(self, args, variables, channel):
        """Op by op, with each op's failure named by its source line and device."""
        context = RunContext(variables, channel)
        env = dict(zip(self.graph.params, args))
        for op in self.graph.ops:
            try:
                outs = eval_op(op, [env[v] for v in op.operands], context)
            except (FlowjitError, TransferError):
                raise
            except Exception as e:
                raise PartitionError(
                    f"{op.loc}: op '{op.name}' on {self.device} failed: {type(e).__name__}: {e}"
                ) from e
            for result, value in zip(op.results, outs):
                check_array(value, result.type, f"internal error: result of op '{op.name}' at {op.loc}")
                env[result] = value
        return [env[r] for r in self.graph.results]


class InterpreterBackend(Backend):
    """Any device's graph, run by the reference interpreter (results are fresh arrays: donation
    has nothing to save)."""

    name = "interpreter"

    def compile(self, graph, device=None, options=None, aliases=None) -> InterpreterExecutable:
        return InterpreterExecutable(graph, device)
