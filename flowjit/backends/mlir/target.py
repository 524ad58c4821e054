"""What a target gives the shared lowering: its table of op lowerings and its policies.

A backend makes one `Target` (the CPU's: `backends/cpu/target.py`), registers its lowerings into
`target.lowerings`, the generic ones included (`lower_control.register`), and passes the target to
`lowering.lower_graph`. Two targets hold two tables, so each may lower the same op its own way.
"""

from __future__ import annotations

from collections.abc import Callable

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


class Target:
    """A target of the shared lowering: its name, its lowering table and the policies the driver
    asks it about. Backends subclass it to override the policies."""

    def __init__(self, name: str):
        self.name = name
        self.lowerings = LoweringTable(name)

    def output_attribute(self, nbytes: int, read_bytes: int, written_bytes: int) -> str | None:
        """An attribute for the function argument of an output of `nbytes` in a function that reads
        `read_bytes` and writes `written_bytes` in all (the CPU's non-temporal stores mark large
        outputs), or None."""
        return None
