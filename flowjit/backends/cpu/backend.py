"""The CPU backend as a `Backend`: graphs of `cpu` devices compiled to native code in this process.
The compiler (`compiler.py`, which loads MLIR and LLVM) is imported on the first compile."""

from __future__ import annotations

from dataclasses import replace

from flowjit.backends.base import Backend, Executable


class CpuBackend(Backend):
    name = "cpu"

    def compile(self, graph, device=None, options=None, aliases=None) -> Executable:
        """Every CPU device of this process runs the same host code: `device` only names it. A graph
        with state ops is functionalized first and bound to the variables' buffers at call time
        (`stateful.py`)."""
        from flowjit.backends.cpu.compiler import CompileOptions, compile_cpu
        from flowjit.backends.cpu.stateful import compile_stateful, has_state

        options = options or CompileOptions()
        aliases = dict(aliases or {})
        if aliases:  # donated outputs are written last, after every read of the inputs they alias
            options = replace(options, late_outputs=tuple(sorted({*options.late_outputs, *aliases})))
        executable = compile_stateful(graph, options) if has_state(graph) else compile_cpu(graph, options)
        executable.aliases = aliases
        executable.recv_locations = {op.attrs["key"]: str(op.loc) for op in graph.ops if op.name == "recv"}
        return executable
