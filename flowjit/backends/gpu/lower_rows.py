"""A fused region that works row by row (softmax, log_softmax, layer and RMS norm, logsumexp, the
row sums of their gradients) as ONE kernel: a block per row, its threads holding the row.

Which regions: those the targets' shared recognition (`mlir/row_regions.py`) finds to be a row
part as a whole: every op of the body but its splat constants is a member, the body's results
are the row part's outputs, its inputs are the region's operands, its reductions are over float
values (or 32- and 64-bit integers). A totals stage (a fusion marked `row_stage = "totals"` by
`row_stages.py`: reductions over all the rows of row values, and ops on their one-element results)
is one row whose elements are the row values: one block. Any other region keeps the whole-tensor
lowering (`target.lower_fusion`), which `lowering.call_lowering` falls back to when `plan` says
None.

The kernel (`emit`, a `gpu.launch` on the region's buffers, written at the "mlir" stage):
- block b computes row b (of A = prod(lead) rows of R = prod(row) elements) with T threads, T a
  multiple of 32 (one warp for rows of at most 32, at most `MAX_THREADS`); thread t holds the
  columns t, t + T, t + 2T, ... (consecutive threads read consecutive elements);
- a full value (one per element) is computed where it is needed, from the inputs: rows of at most
  `HELD_PER_THREAD` x T elements keep every full value of a thread's columns in registers (the
  code is unrolled over them, so each input is read from memory once); longer rows run a loop per
  sweep that reads the row again (from L2) instead of spilling;
- a reduction: each thread combines its columns (those past the row's end masked to the identity),
  the lanes of a warp combine theirs with `gpu.shuffle xor` (5 steps, every lane ending with the
  same value), lane 0 of each warp stores its warp's value in workgroup memory (one buffer per
  reduction, so one `gpu.barrier` each), and after the barrier every thread combines the warps'
  values in the same order: the row value is then known to every thread, rounded to its dtype;
- outputs are written once: full ones at the columns each thread holds, row ones by thread 0.

The scalar code of every pointwise op is the one-op lowerings' (`mlir/pointwise.py`), rounding
after every op as they do; the sums are combined in another order than the whole-tensor kernels'
(within the op table's tolerances).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowjit.backends.gpu.launch import load_element, mlir_location, store_element, workgroup_launch
from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder, memref_type, scalar_literal
from flowjit.backends.mlir.lower_elementwise import compute_elem, convert_scalar, extend, narrow
from flowjit.backends.mlir.lower_reduction import COMBINE, accumulator_dtype
from flowjit.backends.mlir.lowering import call_buffers, splat_value
from flowjit.backends.mlir.pointwise import is_pointwise, scalar_code
from flowjit.backends.mlir.row_regions import (
    COL,
    FULL,
    REDUCE_KINDS,
    ROW,
    SCALAR,
    RowRegion,
    is_splat,
    members,
    row_shape,
)
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op, Value
from flowjit.ir.ops.reduction import reduction_identity

# The mark of a totals stage (`row_stages.py`): a fusion attribute `row_stage = TOTALS_STAGE`.
TOTALS_STAGE = "totals"
WARP = 32
# Threads per row block: enough to cover a row of 256 floats with one column each; longer rows
# give each thread several columns.
MAX_THREADS = 256
# Columns per thread whose full values stay in registers (unrolled code); longer rows re-read.
HELD_PER_THREAD = 16


@dataclass(frozen=True)
class RowKernel:
    """How a fused region runs as a row kernel: its row part, threads per block, and whether each
    thread holds its columns in registers (else one loop per sweep, re-reading the row)."""

    region: RowRegion
    threads: int
    held: int  # columns per thread in registers; 0: loops that re-read

    @property
    def warps(self) -> int:
        return self.threads // WARP


def plan(op: Op) -> RowKernel | None:
    """The row kernel of fusion `op`, or None when its region is not a row part as a whole."""
    if op.name != "fusion" or len(op.regions) != 1:
        return None
    body = op.regions[0]
    shape = _totals_shape(body) if op.attrs.get("row_stage") == TOTALS_STAGE else row_shape(body)
    if shape is None:
        return None
    lead, row = shape
    if math.prod(lead) < 1 or math.prod(row) < 1:
        return None
    region = members(body, lead, row, is_pointwise)
    if isinstance(region, str):
        return None
    inside = set(region.ops)
    if any(o not in inside and not (o.name == "constant" and is_splat(o.result)) for o in body.ops):
        return None
    if list(dict.fromkeys(body.results)) != list(body.results) or set(region.outputs) != set(body.results):
        return None
    if any(v not in body.params for v in region.inputs):
        return None
    if any(o.name in REDUCE_KINDS and not _shuffles(o.result.dtype) for o in region.ops):
        return None
    length = region.length
    threads = min(MAX_THREADS, -(-length // WARP) * WARP)
    per_thread = -(-length // threads)
    return RowKernel(region, threads, per_thread if per_thread <= HELD_PER_THREAD else 0)


def _totals_shape(body) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A totals stage (`row_stages.py`): one row, the shape of its first reduction's operand."""
    first = next((o for o in body.ops if o.name in REDUCE_KINDS), None)
    return None if first is None else ((), first.operands[0].shape)


def _shuffles(dtype: dt.DType) -> bool:
    """Whether a reduction of `dtype` combines across lanes with `gpu.shuffle` (32 or 64 bits)."""
    acc = accumulator_dtype(dtype)
    return (acc.is_float or acc.is_int) and acc.itemsize in (4, 8)


def lower_row_fusion(fl, op: Op) -> bool:
    """`LoweringTable.call` entry for "fusion": the region as one row kernel on its buffers, or
    False (the region gets `target.lower_fusion`)."""
    kernel = plan(op)
    buffers = call_buffers(fl, op) if kernel is not None else None
    if buffers is None:
        return False
    emit(fl.em, kernel, op, buffers)
    return True


# --- the kernel ----------------------------------------------------------------------------------


def _collapsed(em: KernelEmitter, buffer: str, t, shape: tuple[int, ...], groups: list[list[int]]) -> str:
    """`buffer` (of type `t`) viewed as `shape` by merging the dimension `groups`; an empty first
    group is a leading unit dimension (the row axis of a one-row kernel's values)."""
    if tuple(t.shape) == shape:
        return buffer
    unit = bool(groups) and not groups[0]
    core, groups = (shape[1:], groups[1:]) if unit else (shape, groups)
    if tuple(t.shape) != core:
        text = ", ".join(f"[{', '.join(map(str, g))}]" for g in groups)
        into = f"{memref_type(t)} into {memref_type(t.with_shape(core))}"
        buffer = em.op(f"memref.collapse_shape {buffer} [{text}] : {into}")
    if not unit:
        return buffer
    into = f"{memref_type(t.with_shape(core))} into {memref_type(t.with_shape(shape))}"
    text = "[[0, 1]]" if core else "[]"
    return em.op(f"memref.expand_shape {buffer} {text} output_shape [{', '.join(map(str, shape))}] : {into}")


class _Column:
    """One column a thread holds: its index (clamped into the row for loads), whether it lies in
    the row (None: always), and the full values computed for it."""

    def __init__(self, index: str, load_index: str, valid: str | None):
        self.index, self.load_index, self.valid = index, load_index, valid
        self.values: dict[Value, str] = {}


class _RowKernelWriter:
    """Writes the body of one row kernel's `gpu.launch` (`emit`)."""

    def __init__(self, b: ScalarBuilder, kernel: RowKernel, views: dict[Value, tuple[str, str]], shared: list[str]):
        self.b, self.kernel, self.region = b, kernel, kernel.region
        self.views = views  # input or output -> (its view, the view's memref type)
        self.shared = shared  # one workgroup buffer per reduction, in order
        self.rows: dict[Value, str] = {}  # row and scalar values (the same in every thread)
        self.row_index = self.tid = ""
        self.reductions_done = 0

    # Reading values.
    def load(self, v: Value, indices: list[str]) -> str:
        return load_element(self.b, *self.views[v], indices, v.dtype)

    def value(self, v: Value, column: _Column | None) -> str:
        """`v` in its compute type: a row or scalar value, or a full one at `column`."""
        if v in self.rows:
            return self.rows[v]
        if self.region.kinds.get(v) != FULL:
            raise AssertionError(f"row value {v} used before it is computed")
        if v in column.values:
            return column.values[v]
        if v in self.region.inputs:
            result = self.load(v, [self.row_index, column.load_index])
        else:
            result = self.full_op(v.producer, column)
        column.values[v] = result
        return result

    def full_op(self, op: Op, column: _Column) -> str:
        b = self.b
        start = len(b.lines)
        if op.name == "broadcast":
            (x,) = op.operands
            if self.region.kinds.get(x) == COL:
                result = self.load(x, [column.load_index])
            else:
                result = self.value(x, column)
        elif op.name == "iota":
            position = b.op(f"arith.index_cast {column.index} : index to i64")
            result = extend(b, convert_scalar(b, position, dt.int64, op.result.dtype), op.result.dtype)
        else:
            result = scalar_code(b, op, [self.value(x, column) for x in op.operands])
        self.locate(start, op)
        return result

    def locate(self, start: int, op: Op) -> None:
        loc = mlir_location(op)
        loc = f" {loc}" if loc else ""
        for i in range(start, len(self.b.lines)):
            line = self.b.lines[i]
            if loc and "loc(" not in line and line.lstrip().startswith("%") and not line.endswith("{"):
                self.b.lines[i] += loc

    # The row values, in the body's order.
    def row_op(self, op: Op, columns: list[_Column]) -> None:
        start = len(self.b.lines)
        if op.name in REDUCE_KINDS:
            result = self.reduction(op, columns)
        elif op.name in ("broadcast", "reshape"):
            result = self.rows[op.operands[0]]
        else:
            result = scalar_code(self.b, op, [self.rows[x] for x in op.operands])
        self.rows[op.result] = result
        self.locate(start, op)

    def reduction(self, op: Op, columns: list[_Column]) -> str:
        b = self.b
        kind = op.name.removeprefix("reduce_")
        dtype = op.result.dtype
        acc = accumulator_dtype(dtype)
        e = compute_elem(acc)
        combine = COMBINE[kind][0 if acc.is_float else 1]
        identity = b.op(f"arith.constant {scalar_literal(reduction_identity(kind, acc), acc)} : {e}")
        (x,) = op.operands
        if columns:  # held in registers
            own = None
            for column in columns:
                v = self.value(x, column)
                if column.valid is not None:
                    v = b.op(f"arith.select {column.valid}, {v}, {identity} : {e}")
                own = v if own is None else b.op(f"arith.{combine} {own}, {v} : {e}")
        else:  # a loop over the thread's columns, reading the row again
            own = self.sweep(lambda column: self.value(x, column), identity, combine, e)
        total = self.across_block(own, combine, e, self.shared[self.reductions_done])
        self.reductions_done += 1
        return extend(b, narrow(b, total, dtype), dtype)

    def sweep(self, element, identity: str, combine: str, e: str) -> str:
        """`combine` of `element(column)` over the thread's columns, in a loop that re-reads them."""
        b = self.b
        result, j, acc = b.emitter.fresh(), b.emitter.fresh("j"), b.emitter.fresh("acc")
        length, step = b.const(self.region.length, "index"), b.const(self.kernel.threads, "index")
        b.line(f"{result} = scf.for {j} = {self.tid} to {length} step {step} iter_args({acc} = {identity}) -> ({e}) {{")
        b.indent += "  "
        v = element(_Column(j, j, None))
        b.line(f"scf.yield {b.op(f'arith.{combine} {acc}, {v} : {e}')} : {e}")
        b.indent = b.indent[:-2]
        b.line("}")
        return result

    def across_block(self, own: str, combine: str, e: str, shared: str) -> str:
        """`own` combined over the block: xor shuffles within each warp, then the warps' values
        through workgroup memory; every thread gets the same result."""
        b = self.b
        width = b.const(WARP, "i32")
        value = own
        for offset in (16, 8, 4, 2, 1):
            shuffled = b.emitter.fresh("s")
            b.line(f"{shuffled}:2 = gpu.shuffle xor {value}, {b.const(offset, 'i32')}, {width} : {e}")
            value = b.op(f"arith.{combine} {value}, {shuffled}#0 : {e}")
        if self.kernel.warps == 1:
            return value
        mtype = f"memref<{self.kernel.warps}x{e}, #gpu.address_space<workgroup>>"
        lane = b.op(f"arith.remui {self.tid}, {b.const(WARP, 'index')} : index")
        warp = b.op(f"arith.divui {self.tid}, {b.const(WARP, 'index')} : index")
        first = b.op(f"arith.cmpi eq, {lane}, {b.const(0, 'index')} : index")
        b.line(f"scf.if {first} {{")
        b.line(f"  memref.store {value}, {shared}[{warp}] : {mtype}")
        b.line("}")
        b.line("gpu.barrier")
        total = None
        for w in range(self.kernel.warps):
            part = b.op(f"memref.load {shared}[{b.const(w, 'index')}] : {mtype}")
            total = part if total is None else b.op(f"arith.{combine} {total}, {part} : {e}")
        return total

    # Writing the outputs.
    def store(self, v: Value, value: str, indices: list[str]) -> None:
        store_element(self.b, value, *self.views[v], indices, v.dtype)

    def write_outputs(self, columns: list[_Column]) -> None:
        b = self.b
        full = [v for v in self.region.outputs if self.region.kinds[v] == FULL]
        if columns:
            for column in columns:
                values = [self.value(v, column) for v in full]
                if column.valid is not None:
                    b.line(f"scf.if {column.valid} {{")
                    b.indent += "  "
                for v, value in zip(full, values):
                    self.store(v, value, [self.row_index, column.index])
                if column.valid is not None:
                    b.indent = b.indent[:-2]
                    b.line("}")
        elif full:
            j = b.emitter.fresh("j")
            length, step = b.const(self.region.length, "index"), b.const(self.kernel.threads, "index")
            b.line(f"scf.for {j} = {self.tid} to {length} step {step} {{")
            b.indent += "  "
            column = _Column(j, j, None)
            for v in full:
                self.store(v, self.value(v, column), [self.row_index, j])
            b.indent = b.indent[:-2]
            b.line("}")
        rows = [v for v in self.region.outputs if self.region.kinds[v] == ROW]
        if rows:
            first = b.op(f"arith.cmpi eq, {self.tid}, {b.const(0, 'index')} : index")
            b.line(f"scf.if {first} {{")
            b.indent += "  "
            for v in rows:
                self.store(v, self.rows[v], [self.row_index])
            b.indent = b.indent[:-2]
            b.line("}")

    def write(self, block_id: str, thread_id: str) -> None:
        b, region, kernel = self.b, self.region, self.kernel
        self.row_index, self.tid, self.reductions_done = block_id, thread_id, 0
        for v in region.inputs:  # scalars and row values: read once
            kind = region.kinds[v]
            if kind == SCALAR:
                self.rows[v] = self.load(v, [b.const(0, "index")] * v.type.rank)
            elif kind == ROW:
                self.rows[v] = self.load(v, [self.row_index])
        for op in region.ops:  # splat constants, in their compute types
            for x in op.operands:
                if is_splat(x) and x not in self.rows:
                    self.rows[x] = b.const(splat_value(x), compute_elem(x.dtype))
        columns = []
        for k in range(kernel.held):
            index = b.op(f"arith.addi {self.tid}, {b.const(k * kernel.threads, 'index')} : index")
            if (k + 1) * kernel.threads <= region.length:
                columns.append(_Column(index, index, None))
                continue
            last = b.const(region.length - 1, "index")
            valid = b.op(f"arith.cmpi ult, {index}, {b.const(region.length, 'index')} : index")
            columns.append(_Column(index, b.op(f"arith.minui {index}, {last} : index"), valid))
        for op in region.ops:
            if region.kinds[op.result] != FULL:
                self.row_op(op, columns)
        self.write_outputs(columns)


def emit(em: KernelEmitter, kernel: RowKernel, op: Op, buffers: list[tuple[str, str]]) -> None:
    """The row kernel of fusion `op` as a `gpu.launch` reading and writing `buffers` (its operands'
    then its results', as `lowering.call_buffers` gives them)."""
    region = kernel.region
    body = op.regions[0]
    n = len(region.lead)
    a, r = region.rows, region.length
    outer = {p: (buffer, v.type) for p, v, (buffer, _) in zip(body.params, op.operands, buffers)}
    outer.update(
        {v: (buffer, res.type) for v, res, (buffer, _) in zip(body.results, op.results, buffers[len(op.operands) :])}
    )
    views: dict[Value, tuple[str, str]] = {}
    for v in [*region.inputs, *region.outputs]:
        buffer, t = outer[v]
        kind = region.kinds[v]
        if kind == FULL:
            shape, groups = (a, r), [list(range(n)), list(range(n, t.rank))]
        elif kind in (ROW, COL):
            shape, groups = ((a,) if kind == ROW else (r,)), [list(range(t.rank))]
        else:
            shape, groups = tuple(t.shape), []
        views[v] = (_collapsed(em, buffer, t, shape, groups), memref_type(t.with_shape(shape)))
    reductions = [o for o in region.ops if o.name in REDUCE_KINDS]
    shared = [em.fresh("shared") for _ in reductions]
    one, rows, threads = (em.op(f"arith.constant {k} : index") for k in (1, a, kernel.threads))
    workgroup = []
    if kernel.warps > 1 and shared:
        acc = [compute_elem(accumulator_dtype(o.result.dtype)) for o in reductions]
        workgroup = [f"{s} : memref<{kernel.warps}x{e}, #gpu.address_space<workgroup>>" for s, e in zip(shared, acc)]
    workgroup_launch(
        em,
        op,
        (rows, one, one),
        (threads, one, one),
        workgroup,
        lambda b, blocks, thread_ids: _RowKernelWriter(b, kernel, views, shared).write(blocks[0], thread_ids[0]),
    )
