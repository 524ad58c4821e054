"""The row part of a fused region as ONE loop nest over tiles of rows (softmax, log_softmax,
logsumexp, layer norm, cross-entropy's forward, the row sums of their gradients).

Lowered as whole-tensor kernels, such a region streams its input from memory once per dependent
reduction and once more for the elementwise tail (softmax: max, sum, divide = three sweeps). Here
the members that work row by row run inside one loop over tiles of `T` rows (split over the cores
when large): each tile is read from memory by its first kernel and from cache by the others, and
each output tile is written once.

Values of the nest have one of four kinds, relative to the shape F = lead + row of the first
reduction over trailing axes (A = prod(lead) rows of R = prod(row) elements):
- full: shape F, viewed as (A, R); a tile is (T, R);
- row: one value per row: shape `lead` (a reduction's result) or lead + 1s (keepdims); a tile is
  (T,) or (T, 1);
- col: one value per column, broadcast over the rows (gamma, beta): read whole by every tile, (R,);
- scalar: one element (splats and scalars), unchanged.

Algorithm (steps 1 and 2 are the targets' shared recognition, `mlir/row_regions.py`):
1. F is the operand shape of the first reduction over trailing axes (rows of at most
   `MAX_ROW_BYTES`).
2. Walk the body in order. An op joins the nest when its kind rule holds (pointwise ops of full or
   row values, broadcasts from row, col or scalar values, reshapes between row forms, reductions of
   full values over the row axes) and it reads nothing computed after the nest; what it reads from
   outside (parameters, other members, non-splat constants) becomes a nest input of the kind it is
   read as (splat constants are copied in). Members outside the nest are lowered before it (what
   the nest reads) or after it (what reads the nest) by the whole-tensor lowering.
3. The nest is worth it when it saves sweeps (two reductions or more, or a full-sized output),
   or above two dimensions, where a whole-tensor reduction over several trailing axes that reads a
   broadcast is a plain, unvectorized loop. Not for one sweep over the last axis that reads a
   broadcast the tiles cannot express (`a[:, None] - b[None]`, made before the nest and stored
   whole): the whole-tensor reduction reads it through its map, vectorized.
4. The body is rebuilt on tile shapes (`tile_graph`) and lowered by the caller's whole-tensor
   lowering (same scalar code, same schedules per kernel, hence the same summation order as the
   unfused reductions) inside `scf.forall` (or `scf.for` below the parallel threshold) over the
   tiles; a last tile of T + A % T rows runs after the loop. Full-sized outputs are 1-D views
   (A * R), each tile's last kernel writing straight into its slice.

A region that is exactly softmax, log-softmax, layer or RMS norm over rows of 512 to 16384 floats is not
compiled at all: it calls the row library's precompiled function (`row_library.py`), which gives
the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flowjit.backends.cpu import schedule
from flowjit.backends.mlir.emitter import KernelEmitter, memory_elem_type, tensor_type
from flowjit.backends.mlir.lower_elementwise import reshape_tensor
from flowjit.backends.mlir.lowering import bool_from_bytes, bool_to_bytes, splat_value
from flowjit.backends.mlir.row_regions import (
    COL,
    FULL,
    REDUCE_KINDS,
    ROW,
    SCALAR,
    Kinds,
    RowRegion,
    memory_itemsize,
    row_shape,
)
from flowjit.backends.mlir.row_regions import members as row_members
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.types import TensorType

# Rows per tile: about this many bytes of the widest full value, so a tile stays in L1 between the
# sweeps (8 KiB tiles run 15% slower on one core of a 2-core AMD EPYC Zen 4 VM, 128 KiB no faster:
# docs/cpu-fusion.md).
TILE_BYTES = 32 * 1024
# Longer rows are not tiled: one row would not stay in cache between the sweeps.
MAX_ROW_BYTES = 64 * 1024


@dataclass
class RowNest(RowRegion):
    """The members of a fused body that run in the row loop nest (the row part the targets'
    shared recognition finds), and how it is tiled."""

    tile: int = 1  # rows per tile
    parallel: bool = False  # tiles split over the cores (`scf.forall`)

    def describe(self) -> str:
        reductions = sum(op.name in REDUCE_KINDS for op in self.ops)
        where = "forall" if self.parallel else "for"
        return (
            f"row loop nest ({where}): {self.rows} rows of {self.length}, tiles of {self.tile} rows, "
            f"{len(self.ops)} ops, {reductions} reductions"
        )


def _tile_shape(kind: str, v: Value, kinds: Kinds, tile: int) -> tuple[int, ...]:
    if kind == FULL:
        return (tile, math.prod(kinds.row))
    if kind == ROW:
        return (tile,) if v.shape == kinds.lead else (tile, 1)
    if kind == COL:
        return (math.prod(kinds.row),)
    return v.shape


def plan(body: Graph, pointwise: Callable[[Op], bool]) -> RowNest | str:
    """The row loop nest of fused `body` (see the module docstring), or why there is none."""
    shape = row_shape(body)
    if shape is None:
        return "no reduction over trailing axes"
    lead, row = shape
    rows, length = math.prod(lead), math.prod(row)
    if rows < 2 or length < 1:
        return f"{rows} rows of {length}"
    region = row_members(body, lead, row, pointwise)
    if isinstance(region, str):
        return region
    members, kind_of, inputs, outputs = region.ops, region.kinds, region.inputs, region.outputs
    computed = {op.result for op in members}
    full_values = [v for v in (*inputs, *computed) if kind_of[v] == FULL]
    widest = max(memory_itemsize(v) for v in full_values)
    if length * widest > MAX_ROW_BYTES:
        return f"rows of {length * widest} bytes (above {MAX_ROW_BYTES})"
    sweeps = sum(op.name in REDUCE_KINDS for op in members) + any(kind_of[v] == FULL for v in outputs)
    if sweeps < 2 and len(lead) + len(row) <= 2:  # above 2-d, whole-tensor kernels may not vectorize
        return "one sweep already"
    if sweeps < 2 and len(row) == 1 and any(_broadcast_in(v, body) for v in inputs if kind_of[v] == FULL):
        # A broadcast the tiles cannot read would be stored whole before the nest; the whole-tensor
        # reduction over the last axis reads it through its indexing map, vectorized
        # (`schedule._row_reduction`): pairwise distances `sum((a[:, None] - b[None]) ** 2, -1)`.
        return "one sweep over a broadcast input"
    parallel = rows * length >= schedule.PARALLEL_MIN_ELEMENTS and schedule.threads() > 1
    tile = _tile_rows(rows, length * widest, schedule.threads() if parallel else 1)
    return RowNest(lead, row, members, kind_of, inputs, outputs, tile=tile, parallel=parallel)


def _broadcast_in(v: Value, body: Graph) -> bool:
    """Whether nest input `v` is a broadcast the fused body computes (not a parameter)."""
    return v.producer is not None and v.producer.name == "broadcast" and v not in body.params


def _tile_rows(rows: int, row_bytes: int, threads: int) -> int:
    """Rows per tile: ~TILE_BYTES, a multiple of 8 (the reduction kernels' row block) when that
    large, at least 2 (one row would reduce as a full reduction, in another summation order), at
    most a share of the rows per thread; a divisor of `rows` near that when there is one."""
    tile = max(2, min(TILE_BYTES // row_bytes, max(2, rows // threads)))
    if tile >= 8:
        tile -= tile % 8
    tile = min(tile, rows)
    for t in range(tile, max(1, tile // 2), -1):
        if rows % t == 0 and (t % 8 == 0 or tile < 8):
            return t
    return tile


def tile_graph(nest: RowNest, tile: int) -> Graph:
    """The nest's members rebuilt on tiles of `tile` rows: inputs are parameters in
    `nest.inputs` order, results are `nest.outputs` in order."""
    kinds = Kinds(nest.lead, nest.row, lambda op: True)
    graph = Graph("tile")
    mapped: dict[tuple[Value, str], Value] = {}
    for v in nest.inputs:
        kind = nest.kinds[v]
        mapped[v, kind] = graph.add_param(v.type.with_shape(_tile_shape(kind, v, kinds, tile)), v.name_hint)

    def operand(v: Value, kind: str) -> Value:
        if (v, kind) not in mapped:  # a splat constant, copied in
            shape = _tile_shape(kind, v, kinds, tile)
            value = np.full(shape, splat_value(v), dtype=v.producer.attrs["value"].dtype)
            mapped[v, kind] = graph.append(Op("constant", [], [v.type.with_shape(shape)], {"value": value})).result
        return mapped[v, kind]

    for op in nest.ops:
        kind, operand_kinds = kinds.member(op)
        result = op.result.type.with_shape(_tile_shape(kind, op.result, kinds, tile))
        attrs = dict(op.attrs)
        if op.name in REDUCE_KINDS:
            attrs["axes"] = (1,)
        elif op.name == "broadcast":
            attrs["shape"] = result.shape
            source = operand_kinds[0]
            rank = len(_tile_shape(source, op.operands[0], kinds, tile))
            # row sources fill the leading dimensions, columns the last, scalars the trailing ones
            attrs["dims"] = {ROW: tuple(range(rank)), COL: (1,)}.get(
                source, tuple(range(result.rank - rank, result.rank))
            )
        elif op.name == "reshape":
            attrs["shape"] = result.shape
        elif op.name == "iota":
            attrs["shape"], attrs["dimension"] = result.shape, 1
        operands = [operand(v, k) for v, k in zip(op.operands, operand_kinds)]
        new = graph.append(Op(op.name, operands, [result], attrs, op.loc, op.device))
        mapped[op.result, kind] = new.result
    graph.results = [mapped[v, nest.kinds[v]] for v in nest.outputs]
    return graph


def _whole_type(v: Value, kind: str, nest: RowNest) -> TensorType:
    """The nest's view of an input: (A, R), (A,), (R,) or its own type."""
    if kind == FULL:
        return v.type.with_shape((nest.rows, nest.length))
    if kind == ROW:
        return v.type.with_shape((nest.rows,))
    if kind == COL:
        return v.type.with_shape((nest.length,))
    return v.type


def _output_type(v: Value, nest: RowNest) -> TensorType:
    """The nest's view of an output: 1-D, so that it is stored through a 1-D view of its
    destination (`em.store_through`); through any other reshape, empty-tensor elimination gives up
    and each call pays a temporary and a copy."""
    return v.type.with_shape((nest.rows * nest.length if nest.kinds[v] == FULL else nest.rows,))


def _grouped(em: KernelEmitter, tensor: str, v: Value, nest: RowNest) -> str:
    """Input `tensor` viewed as the nest reads it: leading axes merged into rows, row axes into one."""
    kind, t = nest.kinds[v], v.type
    lead = len(nest.lead)
    groups = [list(range(lead)), list(range(lead, t.rank))] if kind == FULL else [list(range(t.rank))]
    if t.rank == 0 or kind == SCALAR or all(len(g) == 1 for g in groups):
        return tensor  # a scalar (one element of any rank) is read as it is
    elem = memory_elem_type(v.dtype)
    reassociation = ", ".join(f"[{', '.join(str(i) for i in g)}]" for g in groups)
    view = tensor_type(_whole_type(v, kind, nest), elem)
    return em.op(f"tensor.collapse_shape {tensor} [{reassociation}] : {tensor_type(t, elem)} into {view}")


LowerTile = Callable[[Graph, list[str], dict[Value, tuple[str, str]]], list[str]]


def emit(em: KernelEmitter, nest: RowNest, tensors: list[str], lower_tile: LowerTile) -> list[str]:
    """The loop nest reading `tensors` (one per `nest.inputs`); returns the outputs' tensors.
    `lower_tile(graph, operands, destinations)` lowers a tile graph on the tile operands, writing
    the results in `destinations` (tile result -> its slice of the output, 1-D and tile-shaped)
    into them."""
    em.kernel_kinds.add("row_nest")  # their tile loops run faster with loop strength reduction
    views = []
    for v, t in zip(nest.inputs, tensors):
        views.append(_grouped(em, bool_to_bytes(em, t, v.type) if v.dtype.is_bool else t, v, nest))
    results = [em.empty(_output_type(v, nest), memory_elem_type(v.dtype)) for v in nest.outputs]
    rows, tile = nest.rows, nest.tile
    count = rows // tile - (1 if rows % tile else 0)
    last = tile + rows % tile if rows % tile else 0  # the rows after the loop
    if count == 1 and not last:  # one tile: no loop
        count, last = 0, tile
    if count > 0:
        results = _loop(em, nest, views, results, count, lower_tile)
    if last:
        offset = em.op(f"arith.constant {count * tile} : index")
        tiles = _tile_body(em, nest, views, results, offset, last, lower_tile)
        results = [em.op(f"tensor.insert_slice {t} into {r}{slice_}") for r, (t, slice_) in zip(results, tiles)]
    return [
        reshape_tensor(em, r, _output_type(v, nest), v.type, elem=memory_elem_type(v.dtype))
        for r, v in zip(results, nest.outputs)
    ]


def _loop(em: KernelEmitter, nest: RowNest, views, inits: list[str], count: int, lower_tile) -> list[str]:
    types = [tensor_type(_output_type(v, nest), memory_elem_type(v.dtype)) for v in nest.outputs]
    result, iv = em.fresh(), em.fresh("i")
    carried = [em.fresh("o") for _ in inits]
    name = f"{result}:{len(inits)}" if len(inits) > 1 else result
    init = ", ".join(f"{c} = {i}" for c, i in zip(carried, inits))
    if nest.parallel:
        em.line(f"{name} = scf.forall ({iv}) in ({count}) shared_outs({init}) -> ({', '.join(types)}) {{")
    else:
        lo, hi, step = (em.op(f"arith.constant {n} : index") for n in (0, count, 1))
        em.line(f"{name} = scf.for {iv} = {lo} to {hi} step {step} iter_args({init}) -> ({', '.join(types)}) {{")
    em.indent += "  "
    offset = em.op(f"arith.muli {iv}, {em.op(f'arith.constant {nest.tile} : index')} : index")
    em.loops += 1
    tiles = _tile_body(em, nest, views, carried, offset, nest.tile, lower_tile)
    em.loops -= 1
    if nest.parallel:
        em.line("scf.forall.in_parallel {")
        for c, (t, slice_) in zip(carried, tiles):
            em.line(f"  tensor.parallel_insert_slice {t} into {c}{slice_}")
        em.line("}")
    else:
        inserted = [em.op(f"tensor.insert_slice {t} into {c}{slice_}") for c, (t, slice_) in zip(carried, tiles)]
        em.line(f"scf.yield {', '.join(inserted)} : {', '.join(types)}")
    em.indent = em.indent[:-2]
    em.line("}")
    return [f"{result}#{k}" for k in range(len(inits))] if len(inits) > 1 else [result]


def _input_tile(em: KernelEmitter, nest: RowNest, v: Value, view: str, offset: str, rows: int, param: Value) -> str:
    elem = memory_elem_type(v.dtype)
    if nest.kinds[v] in (COL, SCALAR):
        return view
    whole = _whole_type(v, nest.kinds[v], nest)
    if nest.kinds[v] == FULL:
        where, part = f"[{offset}, 0] [{rows}, {nest.length}] [1, 1]", whole.with_shape((rows, nest.length))
    else:
        where, part = f"[{offset}] [{rows}] [1]", whole.with_shape((rows,))
    tile = em.op(f"tensor.extract_slice {view}{where} : {tensor_type(whole, elem)} to {tensor_type(part, elem)}")
    return reshape_tensor(em, tile, part, param.type, elem=elem)


def _tile_body(em: KernelEmitter, nest: RowNest, views, outs, offset: str, rows: int, lower_tile):
    """The members on the tile of `rows` rows at `offset`, full-sized results written into their
    slices of `outs`; returns each output tile with the slice clause (`[..] [..] [..] : tile type
    into whole type`) that stores it."""
    graph = tile_graph(nest, rows)
    operands = []
    for v, view, param in zip(nest.inputs, views, graph.params):
        tile = _input_tile(em, nest, v, view, offset, rows, param)
        operands.append(bool_from_bytes(em, tile, param.type) if v.dtype.is_bool else tile)
    slices, destinations = [], {}
    for v, out, r in zip(nest.outputs, outs, graph.results):
        elem = memory_elem_type(v.dtype)
        whole = _output_type(v, nest)
        if nest.kinds[v] == FULL:
            start = em.op(f"arith.muli {offset}, {em.op(f'arith.constant {nest.length} : index')} : index")
            part = whole.with_shape((rows * nest.length,))
            where = f"[{start}] [{part.size}] [1]"
            flat = em.op(f"tensor.extract_slice {out}{where} : {tensor_type(whole, elem)} to {tensor_type(part, elem)}")
            destinations[r] = (flat, reshape_tensor(em, flat, part, r.type, elem=elem))
        else:
            part, where = whole.with_shape((rows,)), f"[{offset}] [{rows}] [1]"
        slices.append((part, f"{where} : {tensor_type(part, elem)} into {tensor_type(whole, elem)}"))
    results = lower_tile(graph, operands, destinations)
    return [
        (reshape_tensor(em, t, r.type, part, elem=memory_elem_type(r.dtype)), clause)
        for t, r, (part, clause) in zip(results, graph.results, slices)
    ]


__all__ = ["RowNest", "emit", "plan", "tile_graph"]
