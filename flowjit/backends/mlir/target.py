"""What a target gives the shared lowering: its table of op lowerings and its policies.

A backend makes one `Target` (the CPU's: `backends/cpu/target.py`) with its kernel schedules
(`KernelSchedules`) and its math library (`MathLibrary`), registers its lowerings into
`target.lowerings`, the shared ones included (`lower_control.register`, `lower_elementwise.register`,
...), and passes the target to `lowering.lower_graph`. Two targets hold two tables, so each may lower
the same op its own way. The shared lowerings reach the target they lower for as `em.target`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from flowjit.errors import CompileError, op_error
from flowjit.ir.graph import Graph, Op

# fn(em: KernelEmitter, op, operand tensors) -> result tensors (MLIR SSA names)
TensorLowering = Callable[..., list[str]]


class LoweringTable:
    """One target's lowerings of flowjit ops, by op name.

    - `tensor`: `fn(em, op, operands) -> results`, on tensors (the usual kind).
    - `buffer`: `fn(function_lowering, op)` for ops lowered on buffers (send/recv call the runtime
      with pointers; control flow reads and writes its operands itself): writes its results itself.
    - `call`: `fn(function_lowering, op) -> bool` for ops that may run as a call into precompiled
      code (`lowering.call_lowering`); False and the op gets its tensor lowering.
    - `views`: `fn(op) -> bool` for buffer ops whose result, when it holds and the result is not
      a graph result, is memory the lowering finds at run time instead of a workspace slot (a recv
      reading a value from another task where the runtime holds it); nothing writes to it.
    - `scratch`: `fn(op) -> bytes` of temporaries the op's kernel keeps in the function's scratch
      area (`KernelEmitter.scratch`). The area is shared because kernels run one after another:
      code that lowers ops inside a parallel loop (several kernels of one op at once) must not let
      them use it.
    - `inlines_splats`: ops whose lowerings use splat operands as scalars (a splat value read only
      by them is never stored); `inlines_splat_operands`: ops that do so in some operand positions
      only (scatter_add's x: its lowering fills the output instead of copying x), by position.
    """

    def __init__(self, target: str):
        self.target = target
        self.tensor: dict[str, TensorLowering] = {}
        self.buffer: dict[str, Callable] = {}
        self.call: dict[str, Callable[..., bool]] = {}
        self.views: dict[str, Callable[[Op], bool]] = {}
        self.scratch: dict[str, Callable[[Op], int]] = {}
        self.inlines_splats: set[str] = set()
        self.inlines_splat_operands: dict[str, set[int]] = {}

    def lowering(self, *names: str):
        """Decorator: register a tensor lowering for each op in `names`."""

        def deco(fn):
            for name in names:
                self.tensor[name] = fn
            return fn

        return deco

    def has(self, name: str) -> bool:
        """Whether the table lowers op `name` (on tensors or on buffers)."""
        return name in self.tensor or name in self.buffer

    def check(self, graph: Graph) -> None:
        """Fail before emitting anything if some op has no lowering."""
        for op in graph.ops:
            if op.name != "constant" and not self.has(op.name):
                raise no_lowering_error(op, self.target)


def no_lowering_error(op: Op, target: str) -> CompileError:
    """The error for an op `target` cannot compile: names the op, its line and the target."""
    return op_error(
        CompileError,
        op.loc,
        op.name,
        f"has no lowering for target '{target}'; use target='interpreter' to run this function without compiling it",
    )


class KernelSchedules(Protocol):
    """How a target schedules the kernels the shared lowerings write (`lower_elementwise`,
    `lower_reduction`, `lower_layout`, `lower_movement`). Each method returns a schedule for
    `KernelEmitter.schedule` (the tag's transform-dialect lines) or None for plain loops; the CPU's
    is its `schedule.py`."""

    # Kernels of at least this many elements are split over the cores.
    PARALLEL_MIN_ELEMENTS: int
    # Kernels up to this many elements may stay plain loops (a pad's scalar copy).
    PLAIN_LOOP_MAX_ELEMENTS: int

    def lanes(self, elem_bits: int) -> int:
        """Vector length in elements for the widest element type of a kernel."""

    def elementwise(self, n: int, elem_bits: int, vectors: int = 1):
        """A 1-d elementwise kernel of `n` elements."""

    def reduction(
        self, shape: tuple[int, ...], axis: int | tuple[int, ...], acc_bits: int, may_stay_plain: bool = False
    ):
        """A reduction of `shape` over `axis` into accumulators of `acc_bits`; `may_stay_plain`:
        the kernel runs once per call (no loop around it), so a small one may stay plain loops."""

    def copy_nd(self, shape: tuple[int, ...], elem_bits: int, parallel: bool = True):
        """An n-d copy (or elementwise kernel) along its rows, over the cores when `parallel`."""

    def transpose_block(self, elem_bits: int) -> int:
        """The side of the square blocks a transpose moves."""

    def transpose_blocks(self, shape: tuple[int, ...], source_last: int, elem_bits: int, parallel: bool = True):
        """A permuted copy of `shape` in `transpose_block` blocks, `source_last` the output dim
        that was the input's last."""

    def transpose_short_rows(self, shape: tuple[int, int], elem_bits: int):
        """A transpose of fewer rows than a block, all of them in each tile."""


# fn(b: ScalarBuilder, x, elem) -> result; fn(b, x, y, elem) -> result (MLIR SSA names)
ScalarUnary = Callable[..., str]
ScalarBinary = Callable[..., str]


@dataclass(frozen=True)
class MathLibrary:
    """A target's scalar float math, written into the shared lowerings' kernel bodies (the CPU's:
    `mathlib.py`, vectorizable polynomials).

    - `unary`: op name -> `fn(b, x, elem)` for the float math ops (exp, log, tanh, ...): the
      elementwise lowering registers these names.
    - `binary`: op name -> `fn(b, x, y, elem)`; must hold "pow" (float operands) and "atan2".
    - `truncate_to_bf16`: `fn(b, x) -> bf16 scalar` rounding an f32 to bfloat16.
    """

    unary: Mapping[str, ScalarUnary]
    binary: Mapping[str, ScalarBinary]
    truncate_to_bf16: Callable[..., str]


class Target:
    """A target of the shared lowering: its name, its lowering table, the schedules and math its
    shared lowerings write, and the policies the driver asks it about. Backends subclass it to
    override the policies."""

    def __init__(self, name: str, schedules: KernelSchedules, math: MathLibrary):
        self.name = name
        self.lowerings = LoweringTable(name)
        self.schedules = schedules
        self.math = math
        # Whether a kernel of rank 0 (no loop) may be emitted; the GPU's may not (it would run on
        # the host), so the shared lowerings that would write one compute one element of rank 1.
        self.rank0_kernels = True
        # Whether a result computed by a flat (1-d) kernel is stored through a collapsed view of its
        # buffer (`KernelEmitter.store_through`); the GPU's is not: its elementwise fusion makes the
        # kernels n-d again, and bufferization writes an n-d kernel into the result's own buffer
        # only when the result is stored in its own shape.
        self.store_through_views = True

    def output_attribute(self, nbytes: int, read_bytes: int, written_bytes: int) -> str | None:
        """An attribute for the function argument of an output of `nbytes` in a function that reads
        `read_bytes` and writes `written_bytes` in all (the CPU's non-temporal stores mark large
        outputs), or None."""
        return None
