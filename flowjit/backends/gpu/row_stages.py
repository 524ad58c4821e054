"""`split-row-stages` (GPU): a fused region whose row part is only part of it (cross-entropy: the
per-row losses, then their mean over the rows; its gradient: the count of labels, then the rows
again; a layer norm's gradient: the rows, then gamma's column sum) becomes a sequence of fused
regions, stages: a row stage is a row kernel (`lower_rows.py`, a block per row), a totals stage a
row kernel of one row holding every row value (one block), a columns stage the whole-tensor
lowering of its column reductions.

Assumes: the graph is fused (`passes/fuse.py`), its fusion bodies in topological order.
Guarantees: the graph computes the same values; a fusion op is replaced only when each of its row
and totals stages is a row kernel or has no reduction, so a split never trades a kernel for several.

Algorithm (`_stages`):
1. (lead, row) is the shape of the body's first reduction over trailing axes
   (`row_regions.row_shape`); a body that is a row part as a whole (`lower_rows.plan`), has no such
   reduction, or has a single row is left as it is.
2. A body op computed from the body's parameters without a reduction on the way is free (a label
   compare, a mask, their conversions): every stage that reads it computes it again.
3. Every other op, in body order, takes a stage of its kind (`_stage_kind`): a row op
   (`Kinds.member`: works row by row, reading totals as scalars) a row stage; a reduction of a row
   value over all the rows, or an op on one-element values, a totals stage; a reduction of a full
   value over the rows, or an elementwise op on such column values, a columns stage. Stage k is of
   kind STAGE_KINDS[k % 3], and an op takes the first stage of its kind not before its operands'.
   An op of no kind leaves the body as it is. A free op the body returns takes a stage as well.
4. Each stage becomes a fusion op (`_split`): its ops, the free ops and constants they read and,
   in a row stage, the non-reductions of earlier row stages that it reads (computed again from the
   inputs and row values rather than written and read back; without them when that stage would be
   no row kernel), transitively; its operands what it reads from the body's parameters and earlier
   stages, its results what later stages read or the body returns. Totals stages carry
   `row_stage = "totals"`, which `lower_rows.plan` reads as one row over the row values' shape.
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
    docstring); `graph` itself when there is none. `graph` is left as it is."""
    if all(_stages(op) is None for op in graph.ops):
        return graph
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
    for recompute in (True, False):
        split = _split(op, stage_of, recompute)
        if split is not None:
            return split
    return None


def _split(fusion: Op, stage_of: dict[Op, int], recompute: bool) -> tuple[list[Op], list[Value]] | None:
    """Step 4: the stage fusions, if each is one kernel (a columns stage: its reductions' kernels)."""
    body = fusion.regions[0]
    stages = sorted(set(stage_of.values()))
    members = {stage: _stage_members(body, stage, stage_of, recompute) for stage in stages}
    reads = {stage: {v for op in ops for v in op.operands if v.producer not in ops} for stage, ops in members.items()}
    returned = set(body.results)
    outer: dict[Value, Value] = dict(zip(body.params, fusion.operands))
    fusions = []
    for stage in stages:
        read_elsewhere = set().union(*(reads[other] for other in stages if other != stage))
        staged = [op for op in body.ops if stage_of.get(op) == stage]
        results = [v for op in staged for v in op.results if v in returned or v in read_elsewhere]
        op = _stage_fusion(fusion, stage, members[stage], results, outer)
        if STAGE_KINDS[stage % len(STAGE_KINDS)] != COLUMNS and not _one_kernel(op):
            return None
        fusions.append(op)
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


def _stage_members(body: Graph, stage: int, stage_of: dict[Op, int], recompute: bool) -> set[Op]:
    """The ops of `stage` and those it computes again: free ops, constants and, in a row stage with
    `recompute`, the non-reductions of earlier row stages (a full value from the inputs and row
    values, `exp(x - max)`, instead of writing and reading it), transitively."""
    again = recompute and STAGE_KINDS[stage % len(STAGE_KINDS)] == ROWS
    members = {op for op in body.ops if stage_of.get(op) == stage}
    for op in reversed(body.ops):
        if op not in members:
            continue
        for v in op.operands:
            producer = v.producer
            if producer is None or producer in members:
                continue
            earlier = stage_of.get(producer)
            if earlier is None or (
                again and STAGE_KINDS[earlier % len(STAGE_KINDS)] == ROWS and producer.name not in REDUCE_KINDS
            ):
                members.add(producer)
    return members


def _stage_fusion(fusion: Op, stage: int, members: set[Op], results: list[Value], outer: dict[Value, Value]) -> Op:
    """The fusion op of `stage` computing `results` with `members`; records the outer values of its
    results in `outer`, and reads its operands from there."""
    body = fusion.regions[0]
    sub = Graph("fused")
    inner: dict[Value, Value] = {}
    operands: list[Value] = []
    ordered = [op for op in body.ops if op in members]
    for op in ordered:
        for v in op.operands:
            if v not in inner and v.producer not in members:
                operands.append(outer[v])
                inner[v] = sub.add_param(v.type, v.name_hint)
    for op in ordered:
        clone = sub.append(
            Op(op.name, [inner[v] for v in op.operands], [r.type for r in op.results], op.attrs, op.loc, op.device)
        )
        inner.update(zip(op.results, clone.results))
    sub.results = [inner[v] for v in results]
    attrs = {"kind": "reduction" if any(op.name in REDUCE_KINDS for op in ordered) else "loop"}
    if STAGE_KINDS[stage % len(STAGE_KINDS)] == TOTALS:
        attrs["row_stage"] = lower_rows.TOTALS_STAGE
    op = Op("fusion", operands, [v.type for v in results], attrs, fusion.loc, fusion.device, [sub])
    outer.update(zip(results, op.results))
    return op


def _one_kernel(fusion: Op) -> bool:
    """Whether the GPU lowers `fusion` as one kernel: a row kernel, or no reduction."""
    body = fusion.regions[0]
    return lower_rows.plan(fusion) is not None or not any(op.name in REDUCE_KINDS for op in body.ops)
