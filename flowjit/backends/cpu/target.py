"""The CPU as a target of the shared lowering (`backends/mlir`): its lowering table and its policies.

The CPU's kernel schedules are `schedule.py` and its float math `mathlib.py`: the shared lowerings
(`backends/mlir/lower_*.py`: control flow, elementwise, reductions, layout, slices) write them into
their kernels, registered below. The CPU's own lowerings (the `lower_*` modules of this folder,
imported by `compiler.load_lowerings`) register on top through the names below, which are the
parts of `CPU.lowerings`.
"""

from __future__ import annotations

from flowjit.backends.cpu import nontemporal, schedule
from flowjit.backends.mlir import (
    lower_control,
    lower_elementwise,
    lower_layout,
    lower_movement,
    lower_reduction,
    mathlib,
)
from flowjit.backends.mlir.target import MathLibrary, Target


class CpuTarget(Target):
    """The host CPU: non-temporal stores into large outputs that a function only writes."""

    def output_attribute(self, nbytes: int, read_bytes: int, written_bytes: int) -> str | None:
        """`nontemporal.ARG_ATTR` on the outputs `nontemporal.wants_streaming` picks."""
        return nontemporal.ARG_ATTR if nontemporal.wants_streaming(nbytes, read_bytes, written_bytes) else None


# The shared lowerings' schedules are `schedule.py` itself (its functions and constants, read at
# each call, so tests that patch them reach every kernel); their float math is `mathlib.py`'s.
CPU = CpuTarget(
    "cpu",
    schedules=schedule,
    math=MathLibrary(unary=mathlib.MATH, binary=mathlib.MATH_BINARY, truncate_to_bf16=mathlib.truncate_to_bf16),
)
lower_control.register(CPU.lowerings)
lower_elementwise.register(CPU.lowerings, CPU.math)
lower_reduction.register(CPU.lowerings)
lower_layout.register(CPU.lowerings)
lower_movement.register(CPU.lowerings)

lowering = CPU.lowerings.lowering
LOWERINGS = CPU.lowerings.tensor
BUFFER_LOWERINGS = CPU.lowerings.buffer
CALL_LOWERINGS = CPU.lowerings.call
VIEWS = CPU.lowerings.views
SCRATCH = CPU.lowerings.scratch
INLINES_SPLATS = CPU.lowerings.inlines_splats
INLINES_SPLAT_OPERANDS = CPU.lowerings.inlines_splat_operands
