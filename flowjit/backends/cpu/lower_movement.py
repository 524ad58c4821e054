"""The CPU's lowerings of the data-movement ops pad, concatenate, gather and scatter_add, registered on
top of the shared movement lowerings (`backends/mlir/lower_movement.py`: slice, dynamic_slice and
the helpers). Their vector copy loops are written here, sized by the host's vector width and core
count (`host.vector_bits`, `host.cores`) with `LoopWriter`.

Each function has the `LOWERINGS` signature `fn(em, op, operands) -> [result tensor]` and works on
tensors: pads are a fill followed by strided inserts (the shared `pad_tensor`); gather is a generic
reading the operand with `tensor.extract`, and scatter_add a loop nest over the updates. When the
block an index (or a concatenated operand) moves is at least a vector long, gather, scatter_add
and concatenate are vector copy loops instead. A gather of constant, descending columns (reversed
columns: `x[..., ::-1]`, `flip`) reads vectors backwards and reverses their lanes, and so does the
scatter_add into zeros that is its gradient. bool data moves as bytes (`on_bytes`).

Indices are clamped in the generated code, as in the reference implementations: gather/scatter_add
indices into `[0, dim - 1]`. No generated load or store can leave its buffer, whatever the index
values are.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from flowjit.backends.cpu import host, schedule
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.target import INLINES_SPLAT_OPERANDS, INLINES_SPLATS, lowering
from flowjit.backends.mlir.emitter import (
    KernelEmitter,
    ScalarBuilder,
    memory_elem_type,
)
from flowjit.backends.mlir.lower_elementwise import filled, memory_scalar
from flowjit.backends.mlir.lower_layout import written_through
from flowjit.backends.mlir.lower_movement import (
    clamp_index,
    copy_tensor,
    moved_type,
    on_bytes,
    pad_tensor,
    reshape,
)
from flowjit.backends.mlir.lowering import splat_value
from flowjit.errors import CompileError, op_error
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType


@lowering("pad")
@on_bytes
def lower_pad(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Fill with the padding value, then insert x with `low` offsets and `interior + 1` strides."""
    x, value = operands
    source, result = op.operands[0].type, op.result.type
    elem = memory_elem_type(source.dtype)
    scalar = em.op(f"tensor.extract {value}[] : tensor<{elem}>")
    if source.rank == 0:
        return [x]
    if pads_edges(op):
        return [_pad_blocks(em, x, op, scalar)]
    return [pad_tensor(em, x, source, result, scalar, op.attrs["low"], op.attrs["interior"])]


@lowering("concatenate")
@on_bytes
def lower_concatenate(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Copy each operand's blocks to their offset along `axis` in one new tensor with vector loops
    (`_concatenate_blocks`); an empty result is just that."""
    result = op.result.type
    if result.size == 0:
        return [em.empty(result, memory_elem_type(result.dtype))]
    return [_concatenate_blocks(em, operands, op)]


def _check_nonempty_axis(op: Op, what: str) -> None:
    x = op.operands[0].type
    axis = op.attrs["axis"]
    if x.shape[axis] == 0 and op.operands[1].type.size > 0:
        raise op_error(
            CompileError, op.loc, op.name, f"cannot {what} along axis {axis} of {x}: it has no elements to index"
        )


@lowering("gather")
@on_bytes
def lower_gather(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """numpy.take with clamped indices: a vector copy per index for blocks of a vector or more,
    reversed vectors for constant, descending columns, else a generic over the result reading x
    with `tensor.extract`."""
    x, idx = operands
    source, indices, result = op.operands[0].type, op.operands[1].type, op.result.type
    axis = op.attrs["axis"]
    _check_nonempty_axis(op, "gather")
    if result.size == 0:
        return [em.empty(result, memory_elem_type(result.dtype))]
    lanes = host.vector_bits() // max(8, source.dtype.bits)
    if math.prod(source.shape[axis + 1 :]) >= lanes:
        return [_gather_rows(em, x, idx, op)]
    start = _reversal_start(op)
    if start is not None and axis == source.rank - 1:
        return [_reversed_columns(em, x, source, indices.size, start)]
    dims = [f"d{i}" for i in range(result.rank)]
    idx_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(dims[axis : axis + indices.rank])})")
    int_elem = memory_elem_type(indices.dtype)
    elem = memory_elem_type(source.dtype)

    def body(b: ScalarBuilder, args):
        loop = [b.op(f"linalg.index {i} : index") for i in range(result.rank)]
        picked = clamp_index(b, args[0], int_elem, 0, source.shape[axis] - 1)
        where = loop[:axis] + [picked] + loop[axis + indices.rank :]
        return b.op(f"tensor.extract {x}[{', '.join(where)}] : {moved_type(source)}")

    out = em.empty(result, memory_elem_type(result.dtype))
    return [
        em.generic(
            [(idx, moved_type(indices))],
            (out, moved_type(result)),
            [idx_map, em.identity_map(result.rank)],
            ["parallel"] * result.rank,
            body,
            [int_elem],
            elem,
        )
    ]


def _gather_rows(em: KernelEmitter, x: str, idx: str, op: Op) -> str:
    """gather when each index selects a contiguous block of at least a vector (embedding rows):
    x as (outer, dim, inner), one clamped index per block, the block copied with whole vectors
    and one masked tail vector."""
    source, indices, result = op.operands[0].type, op.operands[1].type, op.result.type
    axis = op.attrs["axis"]
    outer, dim = math.prod(source.shape[:axis]), source.shape[axis]
    inner, count = math.prod(source.shape[axis + 1 :]), indices.size
    elem, int_elem = memory_elem_type(source.dtype), memory_elem_type(indices.dtype)
    blocks = TensorType((outer, dim, inner), source.dtype)
    x = reshape(em, x, source, blocks.shape, elem)
    idx = reshape(em, idx, indices, (count,))
    out_type = TensorType((outer, count, inner), source.dtype)
    w = LoopWriter(em)
    pad = em.op(f"arith.constant {0 if elem.startswith('i') else 0.0} : {elem}")
    carried = em.empty(out_type, elem)
    threads = host.cores()
    if outer == 1 and threads > 1 and count >= 2 * threads and result.size >= schedule.PARALLEL_MIN_ELEMENTS:
        gathered = _gather_rows_in_parallel(em, w, (x, blocks, idx, int_elem), carried, out_type, threads, pad)
    else:
        gathered, o, (t1,) = w.open_for(w.index(0), w.index(outer), w.index(1), [(carried, moved_type(out_type))])
        index_loop, i, (t2,) = w.open_for(w.index(0), w.index(count), w.index(1), [(t1, moved_type(out_type))])
        raw = em.op(f"tensor.extract {idx}[{i}] : tensor<{count}x{int_elem}>")
        row = clamp_index(em, raw, int_elem, 0, dim - 1)
        done = _copy_block(em, w, (x, blocks, o, row), (t2, moved_type(out_type), o, i), pad)
        w.close_for([done], [moved_type(out_type)])
        w.close_for([index_loop], [moved_type(out_type)])
    return written_through(em, gathered, out_type, result.shape, elem)


def _reversal_start(op: Op) -> int | None:
    """`start` when the gather's indices are the constant `start, start - 1, ..., start - count + 1`
    inside the axis (`x[..., b:a:-1]`, `flip`: both trace to such a gather), else None."""
    index = op.operands[1]
    if index.producer is None or index.producer.name != "constant" or index.type.rank != 1:
        return None
    values = np.asarray(index.producer.attrs["value"]).astype(np.int64, copy=False)
    count, dim = values.size, op.operands[0].type.shape[op.attrs["axis"]]
    if count < 2 or not 0 <= values[-1] <= values[0] < dim:
        return None
    return int(values[0]) if np.array_equal(values, np.arange(values[0], values[0] - count, -1)) else None


def _reversed_columns(em: KernelEmitter, x: str, source: TensorType, count: int, start: int) -> str:
    """The `count` columns `start, start - 1, ...` of `x` (of type `source`) along its last axis:
    per row, whole vectors read backwards from `start` and their lanes reversed (`vector.shuffle`),
    then one masked tail; rows split over the cores when large. A generic reading one element at a
    time is ten times slower, where reversing the columns should cost as much as reversing the
    rows."""
    dim = source.shape[-1]
    result = TensorType((*source.shape[:-1], count), source.dtype)
    outer = result.size // count
    elem = memory_elem_type(source.dtype)
    rows, out_type = TensorType((outer, dim), source.dtype), TensorType((outer, count), source.dtype)
    x = reshape(em, x, source, rows.shape, elem)
    lanes = host.vector_bits() // max(8, source.dtype.bits)
    vec = f"vector<{lanes}x{elem}>"
    w = LoopWriter(em)
    pad = em.op(f"arith.constant {0 if elem.startswith('i') else 0.0} : {elem}")

    def reversed_row(row: str, into: str, into_type: str, out_row: str) -> str:
        def move(column: int | str, source_column: str, size: int, into: str) -> str:
            in_bounds = "true" if size == lanes else "false"
            value = em.op(
                f"vector.transfer_read {x}[{row}, {source_column}], {pad} {{in_bounds = [{in_bounds}]}} "
                f": {moved_type(rows)}, {vec}"
            )
            mask = ", ".join(str(max(size - 1 - k, 0)) for k in range(lanes))
            flipped = em.op(f"vector.shuffle {value}, {value} [{mask}] : {vec}, {vec}")
            return em.op(
                f"vector.transfer_write {flipped}, {into}[{out_row}, {column}] {{in_bounds = [{in_bounds}]}} "
                f": {vec}, {into_type}"
            )

        full, tail = divmod(count, lanes)
        loop, c, (t,) = w.open_for(w.index(0), w.index(full), w.index(1), [(into, into_type)])
        column = w.mul(c, w.index(lanes))
        source_column = em.op(f"arith.subi {w.index(start - lanes + 1)}, {column} : index")
        w.close_for([move(column, source_column, lanes, t)], [into_type])
        if not tail:
            return loop
        return move(w.index(full * lanes), w.index(start - count + 1), tail, loop)

    return _each_row(em, w, out_type, result.shape, reversed_row)


def _copy_block(em: KernelEmitter, w, source, dest, pad: str) -> str:
    """dest[o', i, :] = x[o, row, :] with whole vectors and one masked tail vector; `source` = (x,
    its (outer, dim, inner) type, o, row), `dest` = (tensor, its type, o', i)."""
    x, blocks, o, row = source
    into, into_type, o_out, i = dest
    inner = blocks.shape[2]
    elem = memory_elem_type(blocks.dtype)
    lanes = host.vector_bits() // max(8, blocks.dtype.bits)
    vec = f"vector<{lanes}x{elem}>"

    def copy(column: str, in_bounds: str, into: str) -> str:
        value = em.op(
            f"vector.transfer_read {x}[{o}, {row}, {column}], {pad} {{in_bounds = [{in_bounds}]}} "
            f": {moved_type(blocks)}, {vec}"
        )
        return em.op(
            f"vector.transfer_write {value}, {into}[{o_out}, {i}, {column}] {{in_bounds = [{in_bounds}]}} "
            f": {vec}, {into_type}"
        )

    full = inner // lanes
    chunk_loop, c, (t3,) = w.open_for(w.index(0), w.index(full), w.index(1), [(into, into_type)])
    w.close_for([copy(w.mul(c, w.index(lanes)), "true", t3)], [into_type])
    return chunk_loop if inner % lanes == 0 else copy(w.index(full * lanes), "false", chunk_loop)


def _gather_rows_in_parallel(em: KernelEmitter, w, source, carried: str, out_type: TensorType, threads: int, pad: str):
    """`_gather_rows` with one `scf.forall` chunk of the indices per core (outer == 1): a large
    gather is bound by memory latency, which more cores hide."""
    x, blocks, idx, int_elem = source
    count = out_type.shape[1]

    def gathered_row(index: str, cur: str, tile_type: str, i: str) -> str:
        raw = em.op(f"tensor.extract {idx}[{index}] : tensor<{count}x{int_elem}>")
        row = clamp_index(em, raw, int_elem, 0, blocks.shape[1] - 1)
        zero = w.index(0)
        return _copy_block(em, w, (x, blocks, zero, row), (cur, tile_type, zero, i), pad)

    return _rows_per_core(em, w, carried, out_type, 1, threads, gathered_row)


def _each_row(em: KernelEmitter, w, out_type: TensorType, shape: tuple[int, ...], row) -> str:
    """The (outer, columns) tensor of `out_type` that `row` (as in `_rows_per_core`) fills row by
    row: rows over the cores when large, else one loop; written through to the result's `shape`."""
    elem = memory_elem_type(out_type.dtype)
    carried = em.empty(out_type, elem)
    outer, threads = out_type.shape[0], host.cores()
    if threads > 1 and outer >= 2 * threads and out_type.size >= schedule.PARALLEL_MIN_ELEMENTS:
        done = _rows_per_core(em, w, carried, out_type, 0, threads, row)
    else:
        done, o, (cur,) = w.open_for(w.index(0), w.index(outer), w.index(1), [(carried, moved_type(out_type))])
        w.close_for([row(o, cur, moved_type(out_type), o)], [moved_type(out_type)])
    return written_through(em, done, out_type, shape, elem)


def _rows_per_core(em: KernelEmitter, w, carried: str, out_type: TensorType, axis: int, threads: int, row) -> str:
    """An `scf.forall` with one chunk of `out_type`'s dim `axis` per core, each chunk a loop over its
    rows; `row(index, tile, tile type, index in the tile)` emits one row into the chunk's tile and
    returns the new tile. Returns the filled tensor."""
    count = out_type.shape[axis]
    per = -(-count // threads)
    elem = memory_elem_type(out_type.dtype)
    dims = ["?" if d == axis else str(n) for d, n in enumerate(out_type.shape)]
    tile_type = f"tensor<{'x'.join(dims)}x{elem}>"
    done, t, shared = w.open_forall(-(-count // per), carried, moved_type(out_type))
    first = w.mul(t, w.index(per))
    rows = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(count)}, {first} : index')}, {w.index(per)} : index")
    offsets = ", ".join(first if d == axis else "0" for d in range(out_type.rank))
    sizes = ", ".join(rows if d == axis else str(n) for d, n in enumerate(out_type.shape))
    where = f"[{offsets}] [{sizes}] [{', '.join(['1'] * out_type.rank)}]"
    tile = em.op(f"tensor.extract_slice {shared}{where} : {moved_type(out_type)} to {tile_type}")
    loop, i, (cur,) = w.open_for(w.index(0), rows, w.index(1), [(tile, tile_type)])
    w.close_for([row(w.add(first, i), cur, tile_type, i)], [tile_type])
    w.close_forall(loop, shared, where, tile_type, moved_type(out_type))
    return done


def _add(b: ScalarBuilder | KernelEmitter, a: str, c: str, elem: str, is_bool: bool) -> str:
    if is_bool:  # numpy adds bools as logical or (the bytes hold 0 or 1)
        return b.op(f"arith.ori {a}, {c} : {elem}")
    if elem.startswith("i"):
        return b.op(f"arith.addi {a}, {c} : {elem}")
    return b.op(f"arith.addf {a}, {c} : {elem}")


INLINES_SPLAT_OPERANDS["scatter_add"] = {0}


@lowering("scatter_add")
@on_bytes
def lower_scatter_add(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A copy of x, then a sequential loop nest over the updates adding each one at its clamped
    index (sequential, so duplicate indices accumulate); whole blocks with vectors when the
    indexed block holds a vector or more (embedding gradients)."""
    x, idx, updates = operands
    source, indices, upd = op.operands[0].type, op.operands[1].type, op.operands[2].type
    axis = op.attrs["axis"]
    _check_nonempty_axis(op, "scatter into")
    ttype = moved_type(source)
    splat = splat_value(op.operands[0])
    dim = source.shape[axis]
    reversal = splat == 0 and axis == source.rank - 1 and upd.rank == source.rank and upd.shape[axis] == dim
    if reversal and _reversal_start(op) == dim - 1:
        # the gradient of reversed columns (`x[..., ::-1]`, `flip`): the updates' columns reversed
        # (an update of -0.0 stays -0.0, as in JAX)
        return [_reversed_columns(em, updates, upd, dim, dim - 1)]
    if op in em.updated_in_place:  # a loop's carried buffer (`lower_control.in_place_updates`)
        copy = x
    elif splat is not None and source.size > 0:  # zeros (a gather's gradient): filled, not copied
        copy = filled(em, splat, source, memory_elem_type(source.dtype))
    else:
        copy = copy_tensor(em, x, source)
    if upd.size == 0:
        return [copy]
    if math.prod(source.shape[axis + 1 :]) >= host.vector_bits() // max(8, source.dtype.bits):
        return [_scatter_rows(em, copy, idx, updates, op)]
    elem, int_elem = memory_elem_type(source.dtype), memory_elem_type(indices.dtype)
    zero, one = em.op("arith.constant 0 : index"), em.op("arith.constant 1 : index")
    ivs, carried, results = [], copy, []
    indent = em.indent
    for d in upd.shape:
        bound = em.op(f"arith.constant {d} : index")
        iv, acc, res = em.fresh("i"), em.fresh("acc"), em.fresh()
        em.line(f"{res} = scf.for {iv} = {zero} to {bound} step {one} iter_args({acc} = {carried}) -> ({ttype}) {{")
        em.indent += "  "
        ivs.append(iv)
        results.append(res)
        carried = acc
    position = ", ".join(ivs[axis : axis + indices.rank])
    raw = em.op(f"tensor.extract {idx}[{position}] : {moved_type(indices)}")
    picked = clamp_index(em, raw, int_elem, 0, source.shape[axis] - 1)
    target = ", ".join(ivs[:axis] + [picked] + ivs[axis + indices.rank :])
    update = em.op(f"tensor.extract {updates}[{', '.join(ivs)}] : {moved_type(upd)}")
    current = em.op(f"tensor.extract {carried}[{target}] : {ttype}")
    total = _add(em, current, update, elem, source.dtype.is_bool)
    inserted = em.op(f"tensor.insert {total} into {carried}[{target}] : {ttype}")
    yielded = inserted
    for res in reversed(results):
        em.line(f"scf.yield {yielded} : {ttype}")
        em.indent = em.indent[:-2]
        em.line("}")
        yielded = res
    em.indent = indent
    return [results[0] if results else inserted]


def _scatter_rows(em: KernelEmitter, out: str, idx: str, updates: str, op: Op) -> str:
    """scatter_add into `out` (a copy of x) when each index selects a contiguous block of at least
    a vector: x as (outer, dim, inner); for each update block in order (so duplicates accumulate),
    read-add-write the clamped target block with whole vectors and one masked tail vector."""
    source, indices = op.operands[0].type, op.operands[1].type
    axis = op.attrs["axis"]
    outer, dim = math.prod(source.shape[:axis]), source.shape[axis]
    inner, count = math.prod(source.shape[axis + 1 :]), indices.size
    elem, int_elem = memory_elem_type(source.dtype), memory_elem_type(indices.dtype)
    lanes = host.vector_bits() // max(8, source.dtype.bits)
    vec = f"vector<{lanes}x{elem}>"
    blocks, update_blocks = (
        TensorType((outer, dim, inner), source.dtype),
        TensorType((outer, count, inner), source.dtype),
    )
    out = reshape(em, out, source, blocks.shape, elem)
    updates = reshape(em, updates, op.operands[2].type, update_blocks.shape, elem)
    idx = reshape(em, idx, indices, (count,))
    add = "ori" if source.dtype.is_bool else "addi" if elem.startswith("i") else "addf"
    w = LoopWriter(em)
    pad = em.op(f"arith.constant {0 if elem.startswith('i') else 0.0} : {elem}")
    out_type = moved_type(blocks)
    outer_loop, o, (t1,) = w.open_for(w.index(0), w.index(outer), w.index(1), [(out, out_type)])
    index_loop, i, (t2,) = w.open_for(w.index(0), w.index(count), w.index(1), [(t1, out_type)])
    raw = em.op(f"tensor.extract {idx}[{i}] : tensor<{count}x{int_elem}>")
    row = clamp_index(em, raw, int_elem, 0, dim - 1)

    def accumulate(column: str, in_bounds: str, into: str) -> str:
        flags = f"{{in_bounds = [{in_bounds}]}}"
        current = em.op(f"vector.transfer_read {into}[{o}, {row}, {column}], {pad} {flags} : {out_type}, {vec}")
        update = em.op(
            f"vector.transfer_read {updates}[{o}, {i}, {column}], {pad} {flags} : {moved_type(update_blocks)}, {vec}"
        )
        total = em.op(f"arith.{add} {current}, {update} : {vec}")
        return em.op(f"vector.transfer_write {total}, {into}[{o}, {row}, {column}] {flags} : {vec}, {out_type}")

    full = inner // lanes
    chunk_loop, c, (t3,) = w.open_for(w.index(0), w.index(full), w.index(1), [(t2, out_type)])
    w.close_for([accumulate(w.mul(c, w.index(lanes)), "true", t3)], [out_type])
    done = chunk_loop if inner % lanes == 0 else accumulate(w.index(full * lanes), "false", chunk_loop)
    w.close_for([done], [out_type])
    w.close_for([index_loop], [out_type])
    return reshape(em, outer_loop, blocks, source.shape, elem)


class _Block(NamedTuple):
    """One operand's part of every row of a (outer, total) result (`_rows_of_blocks`): `size`
    elements read from column `skip` on of `tensor` (an (outer, columns) tensor of `type`), or, with
    `tensor` None, `size` copies of the scalar `splat`."""

    tensor: str | None
    type: TensorType | None
    size: int
    skip: int = 0
    splat: str | None = None


def _concatenate_blocks(em: KernelEmitter, operands: list[str], op: Op) -> str:
    """concatenate as (outer, size) views, each operand's contiguous block per outer index copied
    into its column range of the (outer, total) result (`_rows_of_blocks`). An operand that is a
    slice no kernel computed (`em.operand_slices`, see `lowering._slice_views`) is read from its
    source, viewed as (outer, the source's columns), from the slice's first column on: a masked
    tail read there may take the source's elements after the slice, which land where the padding
    did, overwritten by the next block or past the row's end. A splat operand (zeros, a constant
    edge: `autodiff._shifted`'s) is written as its scalar, never read; read only by concatenates
    (`INLINES_SPLATS`) it is never stored either (`concatenate([zeros((1024, 3)), x], 1)`,
    cumprod's gradient)."""
    result, axis = op.result.type, op.attrs["axis"]
    outer = math.prod(result.shape[:axis])
    elem = memory_elem_type(result.dtype)
    blocks = []
    for i, (x, value) in enumerate(zip(operands, op.operands)):
        size = value.type.size // max(outer, 1)
        splat = splat_value(value)
        if splat is not None:  # written, not read (never stored when only concatenates read it)
            blocks.append(_Block(None, None, size, splat=memory_scalar(em, splat, result.dtype, elem)))
            continue
        view = em.operand_slices.get(i)  # a slice read from its source (`lowering._slice_views`)
        source = value.type if view is None else view.source.type
        block_type = TensorType((outer, source.size // max(outer, 1)), result.dtype)
        skip = 0 if view is None else view.start[axis] * math.prod(source.shape[axis + 1 :])
        blocks.append(_Block(reshape(em, x, source, block_type.shape, elem), block_type, size, skip))
    return _rows_of_blocks(em, blocks, result, axis)


INLINES_SPLATS.add("concatenate")


class _Repeat(NamedTuple):
    """`count` runs of `blocks` one after the other in a row (`_rows_of_blocks`), run j reading its
    source from `j * source_step` columns further on (a pad along two or more axes: one run per row
    of the inner padded axis)."""

    count: int
    source_step: int
    blocks: list


def pads_edges(op: Op) -> bool:
    """Whether pad `op` is written as rows of blocks (`_pad_blocks`, all vector code, on LLVM's light
    pipeline: `compiler._light_op`): edge padding (no interior, nothing cut off) of a non-empty
    operand, along one axis, or along several when the result's rows before the first padded axis
    are enough to split over the cores or the result is below the parallel size (a pad of a matrix
    along both axes is one row: large, it keeps the fill and copy, which run on every core). A
    slice's gradient is such a pad."""
    source, result = op.operands[0].type, op.result.type
    low, high, interior = op.attrs["low"], op.attrs["high"], op.attrs["interior"]
    padded = _padded_axes(op)
    if source.size == 0 or any(interior) or not padded or min(*low, *high) < 0:
        return False
    outer = math.prod(result.shape[: padded[0]])
    return len(padded) == 1 or result.size < schedule.PARALLEL_MIN_ELEMENTS or outer >= 2 * host.cores()


def _padded_axes(op: Op) -> list[int]:
    """The axes pad `op` pads at either end."""
    low, high = op.attrs["low"], op.attrs["high"]
    return [d for d in range(op.operands[0].type.rank) if low[d] or high[d]]


def _pad_blocks(em: KernelEmitter, x: str, op: Op, scalar: str) -> str:
    """A pad of edges (`pads_edges`) as rows of blocks: for the first padded axis `low` runs of the
    padding value, the operand's part, `high` runs of the value; the operand's part is one block
    when no later axis is padded, else one `_Repeat` of the same per index of the axes up to the
    next padded one. A fill and a copy into its interior view would be plain loops below
    `schedule.PLAIN_LOOP_MAX_ELEMENTS`, which keep the function on LLVM's O3 pipeline (every
    gradient of a slice)."""
    source, result = op.operands[0].type, op.result.type
    low, high = op.attrs["low"], op.attrs["high"]
    padded = _padded_axes(op)
    elem = memory_elem_type(result.dtype)
    outer = math.prod(result.shape[: padded[0]])
    block_type = TensorType((outer, source.size // max(outer, 1)), result.dtype)
    x = reshape(em, x, source, block_type.shape, elem)

    def row(k: int) -> list:  # one index of every axis before padded[k]: its blocks
        a = padded[k]
        per_index = math.prod(result.shape[a + 1 :])
        if k + 1 == len(padded):
            middle = [_Block(x, block_type, source.shape[a] * per_index)]
        else:
            b = padded[k + 1]
            middle = [_Repeat(math.prod(source.shape[a:b]), math.prod(source.shape[b:]), row(k + 1))]
        edges = [_Block(None, None, n * per_index, splat=scalar) for n in (low[a], high[a])]
        return [e for e in edges[:1] if e.size] + middle + [e for e in edges[1:] if e.size]

    return _rows_of_blocks(em, row(0), result, padded[0])


def _rows_of_blocks(em: KernelEmitter, blocks: list, result: TensorType, axis: int) -> str:
    """The result viewed as (outer, total), outer the product of its dims before `axis`: each row the
    `blocks` one after the other, copied (or, for a splat block, written) with whole vectors and a
    masked tail; a `_Repeat` is a loop over runs of its blocks, whose reads start `source_step`
    columns further on from one run to the next. The
    loops write every element once, so the result needs no fill. Large results split their rows over
    the cores: one core does not reach the memory bandwidth of several. A block shorter than a
    vector is one masked copy per row, not a fill of the result and strided copies: its masked
    write may set the columns after its block to the read's padding, which the blocks after it
    overwrite (in order, in the same row) and the row's end bounds (`roll` by 3 along the rows,
    narrow columns side by side)."""
    outer = math.prod(result.shape[:axis])
    total = result.size // max(outer, 1)
    elem = memory_elem_type(result.dtype)
    lanes = host.vector_bits() // max(8, result.dtype.bits)
    vec = f"vector<{lanes}x{elem}>"
    out_type = TensorType((outer, total), result.dtype)
    w = LoopWriter(em)
    pad = em.op(f"arith.constant {0 if elem.startswith('i') else 0.0} : {elem}")

    def splats(items) -> set[str]:
        found = set()
        for item in items:
            found |= splats(item.blocks) if isinstance(item, _Repeat) else {item.splat} - {None}
        return found

    broadcast = {scalar: em.op(f"vector.broadcast {scalar} : {elem} to {vec}") for scalar in sorted(splats(blocks))}

    def at(base: str | None, offset: int, column: str) -> str:
        """base + offset + column (base None: 0)."""
        shifted = w.add(column, w.index(offset)) if offset else column
        return w.add(base, shifted) if base is not None else shifted

    def run(items, o: str, out: str, out_tensor: str, at_row: str, bases: tuple[str | None, str | None]) -> str:
        """Write `items` into row `at_row` of `out` from column `bases[0]` on (None: 0), reading the
        blocks' tensors from `bases[1]` columns further on (None: 0; a `_Repeat`'s run)."""
        out_base, source_base = bases
        offset = 0
        for item in items:
            if isinstance(item, _Repeat):
                width = _row_width(item.blocks)
                loop, j, (t,) = w.open_for(w.index(0), w.index(item.count), w.index(1), [(out, out_tensor)])
                out_at = at(out_base, offset, w.mul(j, w.index(width)))
                source_at = at(source_base, 0, w.mul(j, w.index(item.source_step)))
                w.close_for([run(item.blocks, o, t, out_tensor, at_row, (out_at, source_at))], [out_tensor])
                out, offset = loop, offset + item.count * width
                continue

            def copy(column: str, in_bounds: str, into: str, block=item, offset=offset) -> str:
                flags = f"{{in_bounds = [{in_bounds}]}}"
                if block.tensor is None:
                    got = broadcast[block.splat]
                else:
                    where = f"{block.tensor}[{o}, {at(source_base, block.skip, column)}]"
                    got = em.op(f"vector.transfer_read {where}, {pad} {flags} : {moved_type(block.type)}, {vec}")
                write_at = at(out_base, offset, column)
                return em.op(f"vector.transfer_write {got}, {into}[{at_row}, {write_at}] {flags} : {vec}, {out_tensor}")

            full = item.size // lanes
            loop, c, (t,) = w.open_for(w.index(0), w.index(full), w.index(1), [(out, out_tensor)])
            w.close_for([copy(w.mul(c, w.index(lanes)), "true", t)], [out_tensor])
            out = loop if item.size % lanes == 0 else copy(w.index(full * lanes), "false", loop)
            offset += item.size
        return out

    def row(o: str, out: str, out_tensor: str, at_row: str) -> str:
        return run(blocks, o, out, out_tensor, at_row, (None, None))

    return _each_row(em, w, out_type, result.shape, row)


def _row_width(items) -> int:
    """Elements of a row that `items` (blocks and repeats) write."""
    return sum(item.count * _row_width(item.blocks) if isinstance(item, _Repeat) else item.size for item in items)
