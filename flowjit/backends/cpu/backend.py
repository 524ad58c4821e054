"""The CPU backend as a `Backend`: graphs of `cpu` devices compiled to native code in this process.
The compiler (`compiler.py`, which loads MLIR and LLVM) is imported on the first compile."""

from __future__ import annotations

from dataclasses import replace

from flowjit.backends.base import Backend, Executable
from flowjit.passes.fuse import FusionLimits, register_fusion_limits

# What one CPU kernel holds (`passes/fuse.py`).
FUSION_LIMITS = FusionLimits(
    # A temporary inside a kernel is a heap block only below glibc's mmap threshold (128 KiB); above
    # it every call maps fresh pages, which cost more than the fusion saves.
    max_internal_bytes=64 * 1024,
    # The im2col + matmul conv applies an epilogue to each chunk's product in cache (`lower_conv`).
    conv_epilogue_min_depth=8,
    # The tiled matmul kernel takes N of half a vector and more (8 float32 with AVX-512) and applies
    # an epilogue to each register tile (`lower_dot`).
    dot_epilogue_min_columns=16,
    # Pooling windows the conv epilogue unrolls (`lower_pooling`).
    max_pool_taps=16,
)


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
        if aliases:  # donated outputs are written last, after every read of the inputs they alias, or in place
            options = replace(
                options,
                late_outputs=tuple(sorted({*options.late_outputs, *aliases})),
                aliased_inputs=tuple(sorted({*options.aliased_inputs, *aliases.items()})),
            )
        executable = compile_stateful(graph, options) if has_state(graph) else compile_cpu(graph, options)
        executable.aliases = aliases
        executable.recv_locations = {op.attrs["key"]: str(op.loc) for op in graph.ops if op.name == "recv"}
        return executable


register_fusion_limits("cpu", FUSION_LIMITS)
