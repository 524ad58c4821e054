"""Which part of a fused region works row by row (softmax, log_softmax, logsumexp, layer and RMS
norm, cross-entropy's forward, the row sums of their gradients): the recognition both targets'
row lowerings share (the CPU's row loop nest, `cpu/lower_rows.py`; the GPU's row kernels,
`gpu/lower_rows.py`).

Values of the row part have one of four kinds, relative to the shape F = lead + row of the first
reduction over trailing axes (A = prod(lead) rows of R = prod(row) elements):
- full: shape F, viewed as (A, R);
- row: one value per row: shape `lead` (a reduction's result) or lead + 1s (keepdims);
- col: one value per column, broadcast over the rows (gamma, beta), viewed as (R,);
- scalar: one element (splats and scalars), unchanged.

Algorithm (`members`):
1. F is the operand shape of the first reduction over trailing axes (`row_shape`).
2. Walk the body in order. An op joins the row part when its kind rule holds (pointwise ops of full
   or row values, broadcasts from row, col or scalar values, reshapes between row forms, iotas
   along a single row axis, reductions of full values over the row axes) and it reads nothing
   computed after the row part; what it reads from outside (parameters, other members, non-splat
   constants) becomes an input of the kind it is read as (splat constants are not inputs: each
   lowering writes them in).
3. The outputs are the members read after the row part or returned; a bool output computed
   without a reduction is left to its readers to recompute (none can store a bool tile).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from flowjit.backends.mlir import lower_reduction
from flowjit.backends.mlir.lowering import splat_value
from flowjit.ir.graph import Graph, Op, Value

REDUCE_KINDS = lower_reduction.REDUCE_OPS
FULL, ROW, COL, SCALAR = "full", "row", "col", "scalar"


@dataclass
class RowRegion:
    """The members of a fused body that work row by row, their kinds, inputs and outputs."""

    lead: tuple[int, ...]
    row: tuple[int, ...]
    ops: list[Op]
    kinds: dict[Value, str]  # kind of every input and member result
    inputs: list[Value]  # read from outside the row part, in first-use order
    outputs: list[Value]  # members read after the row part or returned

    @property
    def rows(self) -> int:
        return math.prod(self.lead)

    @property
    def length(self) -> int:
        return math.prod(self.row)


class Kinds:
    """Kind rules of step 2 for one shape F = lead + row."""

    def __init__(self, lead: tuple[int, ...], row: tuple[int, ...], pointwise: Callable[[Op], bool]):
        self.lead, self.row = lead, row
        self.pointwise = pointwise

    def of_shape(self, shape: tuple[int, ...]) -> str | None:
        if shape == self.lead + self.row:
            return FULL
        n = len(self.lead)
        if shape[:n] == self.lead and all(d == 1 for d in shape[n:]):
            return ROW
        return None

    def member(self, op: Op) -> tuple[str, list[str]] | None:
        """(kind of the result, kinds its operands are read as) if `op` can join the row part."""
        if len(op.results) != 1 or op.regions:
            return None
        kind = self.of_shape(op.result.shape)
        if op.name in REDUCE_KINDS:
            (x,) = op.operands
            axes = sorted(a % max(x.type.rank, 1) for a in op.attrs["axes"])
            trailing = list(range(len(self.lead), x.type.rank))
            if self.of_shape(x.shape) == FULL and axes == trailing and op.result.shape == self.lead:
                return ROW, [FULL]
            return None
        if kind is None:
            return None
        if op.name == "broadcast":
            source = self.broadcast_source(op, kind)
            if source is None or (source == COL and kind != FULL):
                return None
            return kind, [source]
        if op.name == "reshape":
            return (ROW, [ROW]) if kind == ROW and self.of_shape(op.operands[0].shape) == ROW else None
        if op.name == "iota":  # positions along a single row axis: the same in every row
            along_row = len(self.row) == 1 and op.attrs["dimension"] == len(self.lead)
            return (FULL, []) if kind == FULL and along_row else None
        if self.pointwise(op) and all(v.shape == op.result.shape for v in op.operands):
            return kind, [kind] * len(op.operands)
        return None

    def broadcast_source(self, op: Op, kind: str) -> str | None:
        """How a broadcast into a `kind` value reads its source, if a row can express it."""
        (x,) = op.operands
        dims = tuple(op.attrs["dims"])
        n = len(self.lead)
        if self.of_shape(x.shape) == ROW and dims[:n] == tuple(range(n)):
            return ROW  # before the scalars: with a single row, a row value has one element
        if x.type.size == 1:
            return SCALAR if x.type.rank <= (2 if kind == FULL or op.result.shape != self.lead else 1) else None
        leading_ones = next((i for i, d in enumerate(x.shape) if d != 1), x.type.rank)
        if x.shape[leading_ones:] == self.row and dims[leading_ones:] == tuple(range(n, n + len(self.row))):
            return COL
        return None


def row_shape(body: Graph) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(lead, row) of the first reduction over trailing axes of `body` (step 1), or None."""
    for op in body.ops:
        if op.name not in REDUCE_KINDS:
            continue
        shape = op.operands[0].shape
        axes = sorted(a % max(len(shape), 1) for a in op.attrs["axes"])
        if axes and 0 < axes[0] and axes == list(range(axes[0], len(shape))):
            return shape[: axes[0]], shape[axes[0] :]
    return None


def members(body: Graph, lead: tuple[int, ...], row: tuple[int, ...], pointwise: Callable[[Op], bool]):
    """The row part of `body` over rows `lead` + `row` (steps 2 and 3), or why there is none."""
    kinds = Kinds(lead, row, pointwise)
    found: list[Op] = []
    kind_of: dict[Value, str] = {}
    inputs: list[Value] = []
    computed: set[Value] = set()
    after: set[Value] = set()  # values that depend on the row part without being in it
    for op in body.ops:
        rule = None if any(v in after for v in op.operands) else kinds.member(op)
        if rule is None or not _admit(op, rule, kind_of, inputs):
            if any(v in after or v in computed for v in op.operands):
                after.update(op.results)
            continue
        found.append(op)
        computed.add(op.result)
    if sum(op.name in REDUCE_KINDS for op in found) == 0:
        return "no reduction of full rows"
    users = body.uses()
    outputs = [
        v for op in found for v in op.results if v in body.results or any(u not in found for u in users.get(v, ()))
    ]
    for v in [v for v in outputs if v.dtype.is_bool]:
        # No row lowering stores a bool tile. One computed without a reduction (cross-entropy's one-hot
        # compare `labels == iota`, read again by its gradient after the batch mean) is cheap to
        # compute a second time: the ops outside the row part that read it recompute it from its sources.
        if not _without_reductions(v, computed):
            return "a bool output"
        outputs.remove(v)
    if not outputs:
        return "no outputs"
    return RowRegion(lead, row, found, kind_of, inputs, outputs)


def _without_reductions(v: Value, computed: set[Value]) -> bool:
    """Whether the row part computes `v` from its inputs with no reduction on the way."""
    stack, seen = [v], set()
    while stack:
        value = stack.pop()
        if value in seen or value not in computed:
            continue
        seen.add(value)
        if value.producer.name in REDUCE_KINDS:
            return False
        stack.extend(value.producer.operands)
    return True


def _admit(op: Op, rule: tuple[str, list[str]], kind_of: dict, inputs: list) -> bool:
    """Record `op`'s operands and result kinds if they agree with what the row part already has."""
    kind, operand_kinds = rule
    new_inputs = []
    for v, want in zip(op.operands, operand_kinds):
        if is_splat(v):
            continue
        have = kind_of.get(v)
        if have is not None and have != want:
            return False
        if have is None:
            new_inputs.append((v, want))
    for v, want in new_inputs:
        kind_of[v] = want
        inputs.append(v)
    kind_of[op.result] = kind
    return True


def is_splat(v: Value) -> bool:
    """Whether `v` is a splat constant (written into the row code, never an input)."""
    return v.producer is not None and v.producer.name == "constant" and splat_value(v) is not None


def memory_itemsize(v: Value) -> int:
    return 1 if v.dtype.is_bool else v.dtype.itemsize
