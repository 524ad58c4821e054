"""`split-row-stages` (GPU): a fused region whose row part is only part of it (cross-entropy: the
per-row losses, then their mean over the rows; its gradient: the count of labels, then the rows
again) becomes a sequence of fused regions, stages, each lowered as one kernel: a row stage as a
row kernel (`lower_rows.py`, a block per row), a totals stage as a row kernel of one row holding
every row value (one block), a stage without reductions as one elementwise kernel.

Assumes: the graph is fused (`passes/fuse.py`), its fusion bodies in topological order.
Guarantees: the graph computes the same values; a fusion op is replaced only when every stage it
becomes is a row kernel or has no reduction, so the split never trades one kernel for several.

Algorithm (`_stages`):
1. (lead, row) is the shape of the body's first reduction over trailing axes
   (`row_regions.row_shape`); a body that is a row part as a whole (`lower_rows.plan`), has no such
   reduction, or has a single row is left as it is.
2. A body op computed from the body's parameters without a reduction on the way is free (a label
   compare, a mask, their conversions): every stage that reads it computes it again.
3. Every other op, in body order, takes a stage: row stages are even, totals stages odd. A row op
   (`Kinds.member`: works row by row, reading totals as scalars) takes the first even stage not
   before its operands' stages, a totals op (a reduction of a row value over all the rows, an op on
   one-element values) the first odd one. Any other op leaves the body as it is. A free op the body
   returns takes a stage as well.
4. Each stage becomes a fusion op: its ops and the free ops they read (with the constants they
   read), its operands what it reads from the body's parameters and earlier stages, its results
   what later stages read or the body returns. Totals stages carry `row_stage = "totals"`, which
   `lower_rows.plan` reads as one row over the values' shape `lead`.
"""

from __future__ import annotations

import math

from flowjit.backends.gpu import lower_rows
from flowjit.backends.mlir.pointwise import is_pointwise
from flowjit.backends.mlir.row_regions import REDUCE_KINDS, Kinds, row_shape
from flowjit.ir.graph import Graph, Op, Value

# The kinds of stages, in the order of their numbers: stage k is of kind STAGE_KINDS[k % 3].
ROWS, TOTALS, COLUMNS = "rows", "totals", "columns"
STAGE_KINDS = (ROWS, TOTALS, COLUMNS)


def split_row_stages(graph: Graph) -> Graph:
    """A copy of `graph` whose fusion ops with a partial row part are split into stages (module
    docstring); `graph` itself is left as it is."""
    graph = graph.copy()
    replaced: dict[Value, Value] = {}
    ops: list[Op] = []
    for op in graph.ops:
        op.operands = [replaced.get(v, v) for v in op.operands]
        stages = _stages(op)
        if stages is None:
            ops.append(op)
            continue
        new_ops, results = stages
        ops.extend(new_ops)
        replaced.update(zip(op.results, results))
    graph.ops = ops
    graph.results = [replaced.get(v, v) for v in graph.results]
    return graph


def _stages(op: Op) -> tuple[list[Op], list[Value]] | None:
    """The stage fusions replacing fusion `op` and the values replacing its results, or None."""
    if op.name != "fusion" or len(op.regions) != 1 or lower_rows.plan(op) is not None:
        return None
    body = op.regions[0]
    shape = row_shape(body)
    if shape is None or math.prod(shape[0]) < 2:
        return None
    stage_of = _stage_numbers(body, Kinds(*shape, is_pointwise))
    if stage_of is None or len(set(stage_of.values())) < 2:
        return None
    outer: dict[Value, Value] = dict(zip(body.params, op.operands))
    users = body.uses()
    fusions = []
    for stage in sorted(set(stage_of.values())):
        fusion = _stage_fusion(op, body, stage, stage_of, outer, users)
        if STAGE_KINDS[stage % len(STAGE_KINDS)] != COLUMNS and not _one_kernel(fusion):
            return None
        fusions.append(fusion)
    if any(v not in outer for v in body.results):  # a constant the body returns: no stage computes it
        return None
    return fusions, [outer[v] for v in body.results]


def _stage_numbers(body: Graph, kinds: Kinds) -> dict[Op, int] | None:
    """Steps 2 and 3: the stage of every op that is not free or a constant, or None."""
    free = _free_ops(body)
    returned = {v.producer for v in body.results if v.producer is not None}
    stage_of: dict[Op, int] = {}
    for op in body.ops:
        if op.name == "constant" or (op in free and op not in returned):
            continue
        kind = _stage_kind(op, kinds)
        if kind is None:
            return None
        after = max((stage_of.get(v.producer, 0) for v in op.operands), default=0)
        stage_of[op] = after + (STAGE_KINDS.index(kind) - after) % len(STAGE_KINDS)
    return stage_of


def _stage_kind(op: Op, kinds: Kinds) -> str | None:
    """The kind of stage `op` can be computed in (step 3), or None."""
    if kinds.member(op) is not None:
        return ROWS
    if len(op.results) != 1 or op.regions:
        return None
    lead = kinds.lead
    if op.name in REDUCE_KINDS:
        (x,) = op.operands
        over_rows = sorted(a % x.type.rank for a in op.attrs["axes"]) == list(range(len(lead)))
        if over_rows and x.shape == lead:
            return TOTALS
        if over_rows and x.shape == lead + kinds.row and op.result.shape == kinds.row:
            return COLUMNS
        return None
    if not (is_pointwise(op) or op.name in ("broadcast", "reshape")):
        return None
    if op.result.type.size == 1 and all(v.type.size == 1 for v in op.operands):
        return TOTALS
    return COLUMNS if all(v.shape == kinds.row for v in (*op.operands, op.result)) else None


def _free_ops(body: Graph) -> set[Op]:
    """Ops computed from the parameters and constants without a reduction (step 2)."""
    free: set[Op] = set()
    for op in body.ops:
        if op.name in REDUCE_KINDS or op.regions:
            continue
        if all(v.producer is None or v.producer.name == "constant" or v.producer in free for v in op.operands):
            free.add(op)
    return free


def _stage_fusion(
    fusion: Op, body: Graph, stage: int, stage_of: dict[Op, int], outer: dict[Value, Value], users: dict
) -> Op:
    """Step 4: the fusion op of `stage`; records its results' outer values in `outer`."""
    staged = [op for op in body.ops if stage_of.get(op) == stage]
    needed = set(staged)
    for op in reversed(body.ops):  # the free ops and constants they read, transitively
        if op in needed:
            needed.update(v.producer for v in op.operands if v.producer is not None and v.producer not in stage_of)
    members = [op for op in body.ops if op in needed]
    sub = Graph("fused")
    inner: dict[Value, Value] = {}
    operands: list[Value] = []
    for op in members:
        for v in op.operands:
            if v not in inner and (v.producer is None or v.producer not in needed):
                operands.append(outer[v])
                inner[v] = sub.add_param(v.type, v.name_hint)
    for op in members:
        clone = sub.append(
            Op(op.name, [inner[v] for v in op.operands], [r.type for r in op.results], op.attrs, op.loc, op.device)
        )
        inner.update(zip(op.results, clone.results))
    returned = set(body.results)
    results = [
        v
        for op in staged
        for v in op.results
        if v in returned or any(stage_of.get(u) != stage for u in users.get(v, ()))
    ]
    sub.results = [inner[v] for v in results]
    attrs = {"kind": "reduction" if any(op.name in REDUCE_KINDS for op in members) else "loop"}
    if STAGE_KINDS[stage % len(STAGE_KINDS)] == TOTALS:
        attrs["row_stage"] = TOTALS
    op = Op("fusion", operands, [v.type for v in results], attrs, fusion.loc, fusion.device, [sub])
    outer.update(zip(results, op.results))
    return op


def _one_kernel(fusion: Op) -> bool:
    """Whether the GPU lowers `fusion` as one kernel: a row kernel, or no reduction."""
    body = fusion.regions[0]
    return lower_rows.plan(fusion) is not None or not any(op.name in REDUCE_KINDS for op in body.ops)
