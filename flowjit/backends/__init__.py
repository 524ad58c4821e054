"""Backends turn an optimized graph into an `Executable`. The table `BACKENDS` maps a target name
to its compile function; `compile_graph` picks one and records what it did in the stage texts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flowjit.errors import FlowjitValueError
from flowjit.ir.graph import Graph


class Executable:
    """A compiled function: `run(arrays) -> arrays`, plus the text of each backend stage."""

    backend: str = ""
    stages: dict[str, str]
    fresh_outputs: bool = False  # True: results are always new arrays, never an argument passed through
    # Donation: output index -> input index. The call may write that output into the input's buffer
    # (`run(..., outputs={j: buffer})`); the backend then reads the input completely first.
    aliases: dict[int, int] = {}

    def run(
        self,
        args: Sequence[np.ndarray],
        variables: dict[str, np.ndarray] | None = None,
        outputs: dict[int, np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """Run on host arrays; `variables` maps each variable name the graph uses to its live buffer,
        which the call reads and updates in place. `outputs` maps output indices in `aliases` to
        donated buffers to write them into (backends without donation return fresh arrays)."""
        raise NotImplementedError

    def run_trusted(self, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`run` for C-contiguous arrays already known to match the signature (the jit fast path);
        backends with a cheaper unchecked call override it."""
        return self.run(args)

    def caller(self, single_output: bool) -> Callable[[Sequence[np.ndarray]], object]:
        """The jit fast path's call: a function of arrays known to match the signature (any layout)
        returning the list of outputs, or with `single_output` the one output; never an argument
        itself. Backends whose `run_trusted` costs more than the call's own work override it."""

        def call(args):
            arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args]
            outs = self.run_trusted(arrays)
            if not self.fresh_outputs:  # an input passed through must not alias the caller's array
                outs = [np.array(o) if any(o is a for a in args) else o for o in outs]
            return outs[0] if single_output else outs

        return call


def _compile_interpreter(graph: Graph, options, aliases: dict[int, int]) -> Executable:
    from flowjit.backends.interpreter import InterpreterExecutable

    return InterpreterExecutable(graph)  # results are fresh arrays: donation has nothing to save


def _compile_cpu(graph: Graph, options, aliases: dict[int, int]) -> Executable:
    from dataclasses import replace

    from flowjit.backends.cpu.compiler import CompileOptions, compile_cpu

    if aliases:  # donated outputs are written last, after every read of the inputs they alias
        options = options or CompileOptions()
        options = replace(options, late_outputs=tuple(sorted({*options.late_outputs, *aliases})))
    executable = compile_cpu(graph, options)
    executable.aliases = dict(aliases)
    return executable


BACKENDS: dict[str, Callable[[Graph, object, dict[int, int]], Executable]] = {
    "interpreter": _compile_interpreter,
    "cpu": _compile_cpu,
}


def compile_graph(graph: Graph, target: str = "cpu", options=None, aliases: dict[int, int] | None = None) -> Executable:
    """Compile `graph` for `target` ('cpu', 'interpreter'). `aliases` (output index -> input index of
    the same type) are the outputs callers may have written into donated inputs' buffers; the
    executable's `aliases` says which ones the backend honors."""
    compile_fn = BACKENDS.get(target)
    if compile_fn is None:
        raise FlowjitValueError(f"unknown target '{target}'; available: {', '.join(sorted(BACKENDS))}")
    return compile_fn(graph, options, dict(aliases or {}))


def default_target() -> str:
    return "cpu" if "cpu" in BACKENDS else "interpreter"
