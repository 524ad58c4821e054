"""The CPU as a target of the shared lowering (`backends/mlir`): its lowering table and its policies.

The table is filled by the `lower_*` modules of this folder (imported by `compiler.load_lowerings`)
and by the generic control-flow lowerings (`mlir/lower_control.py`). The lowering modules register
through the names below, which are the parts of `CPU.lowerings`.
"""

from __future__ import annotations

from flowjit.backends.cpu import nontemporal
from flowjit.backends.mlir import lower_control
from flowjit.backends.mlir.target import Target


class CpuTarget(Target):
    """The host CPU: non-temporal stores into large outputs that a function only writes."""

    def output_attribute(self, nbytes: int, read_bytes: int, written_bytes: int) -> str | None:
        """`nontemporal.ARG_ATTR` on the outputs `nontemporal.wants_streaming` picks."""
        return nontemporal.ARG_ATTR if nontemporal.wants_streaming(nbytes, read_bytes, written_bytes) else None


CPU = CpuTarget("cpu")
lower_control.register(CPU.lowerings)

lowering = CPU.lowerings.lowering
LOWERINGS = CPU.lowerings.tensor
BUFFER_LOWERINGS = CPU.lowerings.buffer
CALL_LOWERINGS = CPU.lowerings.call
SCRATCH = CPU.lowerings.scratch
INLINES_SPLATS = CPU.lowerings.inlines_splats
INLINES_SPLAT_OPERANDS = CPU.lowerings.inlines_splat_operands
