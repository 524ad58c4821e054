"""CPU lowering of reduce_window (max and average pooling): the input padded with the reduction's
identity, windows of at most `MAX_UNROLLED_TAPS` taps as vector code along the output rows
(`_window_taps`), larger ones as one generic over (output dims, window dims). `pool_window` is the
pooling that ends a fused conv epilogue (`contraction.Epilogue.pool`). Choices and measurements:
docs/cpu-kernels.md, "reduce_window".
"""

from __future__ import annotations

import itertools

import numpy as np

from flowjit.backends.cpu import host, schedule
from flowjit.backends.cpu.contraction import accumulator_elem, combine, const, loop_dims, narrow, widen
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.row_writers import close_loops, read_every_step, row_major_strides, row_of_vectors
from flowjit.backends.cpu.target import lowering
from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, tensor_type
from flowjit.backends.mlir.lower_movement import fill, pad_tensor, reshape
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op
from flowjit.ir.ops.reduction import reduction_identity
from flowjit.ir.types import TensorType


def _window_rows_then_columns(
    w,
    source: str,
    flat_in: TensorType,
    base: str,
    attrs,
    in_strides,
    pad: str,
    lanes: int,
    elem: str,
    acc: str,
    used: str | None = None,
) -> str:
    """`lanes` outputs of a window as wide as its step along the last axis (2x2/2, 3x3/3: the
    windows tile the row): per window row one read of the `step * lanes` inputs they cover (in
    bounds: its last element is the last window's), the rows combined element by
    element, then each of the `step` columns picked out of that by a shuffle and combined. Tap by
    tap (`read_every_step`), 2x2 max pooling read every input twice, as four wide reads and four
    shuffles per vector of outputs, the reads masked on short rows (14 outputs in a 16-lane vector).
    `used` (an index; a row shorter than a vector): how many of the read's elements feed outputs that
    are stored; the read is masked to them, in bounds, instead of to the tensor's end, whose mask
    would take a compare per read (the CNN's 28-wide rows)."""
    em = w.em
    kind, window, step = attrs["kind"], attrs["window"], attrs["strides"][-1]
    is_int = acc.startswith("i")
    wide_type, wide_acc = f"vector<{step * lanes}x{elem}>", f"vector<{step * lanes}x{acc}>"
    if used is not None:
        mask = em.op(f"vector.create_mask {used} : vector<{step * lanes}xi1>")
    rows = None
    for tap in itertools.product(*(range(n) for n in window[:-1])):
        where = w.add(base, w.index(sum(t * st for t, st in zip(tap, in_strides))))
        masked = "" if used is None else f", {mask}"
        wide = em.op(
            f"vector.transfer_read {source}[{where}], {pad}{masked} {{in_bounds = [true]}} "
            f": {tensor_type(flat_in)}, {wide_type}"
        )
        if elem != acc:
            wide = em.op(f"arith.extf {wide} : {wide_type} to {wide_acc}")
        rows = wide if rows is None else combine(em, kind, rows, wide, wide_acc, is_int)
    total, vec = None, f"vector<{lanes}x{acc}>"
    for kw in range(window[-1]):
        picks = ", ".join(str(i * step + kw) for i in range(lanes))
        value = em.op(f"vector.shuffle {rows}, {rows} [{picks}] : {wide_acc}, {wide_acc}")
        total = value if total is None else combine(em, kind, total, value, vec, is_int)
    return total


def _window_pad_value(kind: str, dtype: dt.DType):
    return reduction_identity("max", dtype) if kind == "max" else 0


@lowering("reduce_window")
def lower_reduce_window(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Pad with the reduction's identity, then reduce each window: unrolled in the body for small
    windows, as window loops otherwise; avg divides by the full window size afterwards."""
    (x,) = operands
    tx, result = op.operands[0].type, op.result.type
    kind, window, padding = op.attrs["kind"], op.attrs["window"], op.attrs["padding"]
    acc = accumulator_elem(tx.dtype)
    padded_type, padded = tx, x
    if any(lo or hi for lo, hi in padding):
        padded_type = tx.with_shape(tuple(d + lo + hi for d, (lo, hi) in zip(tx.shape, padding)))
        pad_value = const(em, _window_pad_value(kind, tx.dtype), tx.dtype)
        padded = pad_tensor(em, x, tx, padded_type, pad_value, [lo for lo, _ in padding], [0] * tx.rank)
    acc_dtype = dt.float32 if acc == "f32" else tx.dtype
    if int(np.prod(window)) <= MAX_UNROLLED_TAPS:
        return [narrow(em, _window_taps(em, padded, padded_type, result, op.attrs, acc), result, acc)]
    reduced = _window_loops(em, padded, padded_type, result, op.attrs, acc)
    if kind == "avg":
        count = const(em, float(np.prod(window)), acc_dtype)
        ident = em.identity_map(tx.rank)
        reduced = em.generic(
            [(reduced, tensor_type(result, acc))],
            (em.empty(result, acc), tensor_type(result, acc)),
            [ident, ident],
            ["parallel"] * tx.rank,
            lambda b, args: b.op(f"arith.divf {args[0]}, {count} : {acc}"),
            [acc],
            acc,
        )
    return [narrow(em, reduced, result, acc)]


# Windows with at most this many elements are unrolled into vector code (see `_window_taps`).
MAX_UNROLLED_TAPS = 16


def pool_window(em: KernelEmitter, source, onhw: bool, result: TensorType, attrs, into, serial: bool) -> str:
    """The pooling `attrs` (windows that tile the image: `fuse._tiling_pool`) of a conv output window
    `source` = (tensor, type) in the accumulator type, laid out (O, N, H, W) when `onhw` else
    (N, O, H, W), as `result` (N, O, H / window, W / window) computed into `into` (a slice of the
    output; None: a new tensor); `serial`: on the calling thread. The end of a conv epilogue
    (`Epilogue.pool`)."""
    tensor, layout = source
    strides = row_major_strides(layout.shape)
    if onhw:  # the result's (n, o) are the source's dimensions (1, 0)
        strides = [strides[1], strides[0], *strides[2:]]
    acc = accumulator_elem(result.dtype)
    return _window_taps(em, tensor, layout, result, attrs, acc, in_strides=strides, into=into, serial=serial)


def _window_taps(
    em: KernelEmitter,
    padded: str,
    padded_type: TensorType,
    result: TensorType,
    attrs,
    acc,
    in_strides: list[int] | None = None,
    into: str | None = None,
    serial: bool = False,
) -> str:
    """A small window as vector code along the last output dimension.

    Loops over the leading output dims; for each chunk of `lanes` outputs in a row and each
    window tap, one contiguous read of `stride * lanes` inputs (on a 1-D view of the padded
    input), a shuffle keeping every stride-th element, and a lane-wise max/add. Reads past the
    end of a row only feed lanes that are never stored; the buffer's end is masked. Each output
    is written once, by a store masked to the row's length. For `pool_window`: `in_strides`, the
    input's elements apart per step along each output dimension's window (default: the padded
    input's row-major strides), `into`, a tensor of `result`'s shape to write the result into, and
    `serial`, whether it stays on the calling thread.
    """
    kind, window, strides = attrs["kind"], attrs["window"], attrs["strides"]
    rank, elem = result.rank, elem_type(result.dtype)
    is_int = acc.startswith("i")
    lanes = host.vector_bits() // int(acc[1:])
    width, step = result.shape[-1], strides[-1]
    w = LoopWriter(em)
    flat_in = TensorType((padded_type.size,), result.dtype)
    flat_out = TensorType((result.size,), result.dtype)
    source = reshape(em, padded, padded_type, flat_in.shape)
    in_strides = in_strides or row_major_strides(padded_type.shape)
    out_strides = row_major_strides(result.shape)
    vec = f"vector<{lanes}x{acc}>"
    acc_dtype = dt.float32 if acc == "f32" else result.dtype
    pad = em.op(f"arith.constant {0 if is_int else 0.0} : {elem}")
    count = None
    if kind == "avg":
        count = em.op(f"vector.broadcast {const(em, float(np.prod(window)), acc_dtype)} : {acc} to {vec}")
    out_type = tensor_type(flat_out, acc)
    if into is not None:
        everything = f"[{', '.join(map(str, range(rank)))}]"
        carried = em.op(f"tensor.collapse_shape {into} [{everything}] : {tensor_type(result, acc)} into {out_type}")
    else:
        carried = em.empty(flat_out, acc)
    loops, in_offset, out_offset = [], w.index(0), w.index(0)
    # Split over the cores along the first output dimension longer than 1 (images, else channels):
    # one chunk of whole output planes per core, written into its slice of the shared output.
    split = next((d for d in range(rank - 1) if result.shape[d] > 1), None)
    work = result.size * int(np.prod(window))
    parallel = split is not None and schedule.threads() > 1 and work >= schedule.PARALLEL_MIN_ELEMENTS
    parallel = parallel and not serial
    outer = range(rank - 1)
    if parallel:
        chunk = _pooling_chunk(w, split, result.shape[split], out_strides[split], (carried, out_type))
        done, shared, where, carried, out_type, first, end = chunk
        loop, iv, (carried,) = w.open_for(first, end, w.index(1), [(carried, out_type)])
        loops.append(loop)
        in_offset = w.mul(iv, w.index(strides[split] * in_strides[split]))
        out_offset = w.mul(em.op(f"arith.subi {iv}, {first} : index"), w.index(out_strides[split]))
        outer = range(split + 1, rank - 1)  # the dimensions before `split` have one element
    for d in outer:
        loop, iv, (carried,) = w.open_for(w.index(0), w.index(result.shape[d]), w.index(1), [(carried, out_type)])
        loops.append(loop)
        in_offset = w.add(in_offset, w.mul(iv, w.index(strides[d] * in_strides[d])))
        out_offset = w.add(out_offset, w.mul(iv, w.index(out_strides[d])))

    def value_at(column: str, inside: bool) -> str:
        base = w.add(in_offset, w.mul(column, w.index(step)))
        if window[-1] == step > 1:
            # Outside the row's whole vectors, the inputs of the columns in the row (a short row's
            # 14 outputs of 16 lanes: 28 inputs), read under a mask that keeps them in the tensor.
            used = None if inside else w.mul(em.op(f"arith.subi {w.index(width)}, {column} : index"), w.index(step))
            total = _window_rows_then_columns(w, source, flat_in, base, attrs, in_strides, pad, lanes, elem, acc, used)
        else:
            total = None
            for tap in itertools.product(*(range(n) for n in window)):
                where = w.add(base, w.index(sum(t * st for t, st in zip(tap, in_strides))))
                value = read_every_step(em, source, flat_in, where, pad, step, lanes, elem, acc, inside)
                total = value if total is None else combine(em, kind, total, value, vec, is_int)
        return total if count is None else em.op(f"arith.divf {total}, {count} : {vec}")

    row_out = row_of_vectors(w, carried, out_type, out_offset, (width, lanes, acc), value_at)
    result_flat = close_loops(w, row_out, out_type, loops)
    if parallel:
        w.close_forall(result_flat, shared, where, out_type, tensor_type(flat_out, acc))
        result_flat = done
    pooled = reshape(em, result_flat, flat_out, result.shape, acc)
    if into is None:
        em.store_through(pooled, result_flat, flat_out.shape)
    return pooled


def _pooling_chunk(w, dim: int, extent: int, stride: int, output: tuple[str, str]):
    """Open an `scf.forall` over chunks of output dimension `dim` (`extent` long, `stride` elements
    apart in the flat output `output` = (tensor, type)), one per core. Returns (the forall's result,
    its shared output, the chunk's "[offset] [size] [1]" in it, the chunk's slice and its type,
    the chunk's first and end index along `dim`)."""
    em = w.em
    per = -(-extent // schedule.threads())
    tensor, flat_type = output
    done, t, shared = w.open_forall(-(-extent // per), tensor, flat_type)
    first = w.mul(t, w.index(per))
    count = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(extent)}, {first} : index')}, {w.index(per)} : index")
    elem = flat_type.rsplit("x", 1)[1][:-1]
    static = extent % per == 0  # equal chunks: a static slice
    size = str(per * stride) if static else w.mul(count, w.index(stride))
    chunk_type = f"tensor<{per * stride if static else '?'}x{elem}>"
    where = f"[{w.mul(first, w.index(stride))}] [{size}] [1]"
    part = em.op(f"tensor.extract_slice {shared}{where} : {flat_type} to {chunk_type}")
    return done, shared, where, part, chunk_type, first, w.add(first, count)


def _window_loops(em: KernelEmitter, padded: str, padded_type: TensorType, result: TensorType, attrs, acc) -> str:
    """A generic over (output dims, window dims); a shape-only window tensor gives the window loops
    their bounds, as linalg's pooling ops do."""
    kind, window, strides = attrs["kind"], attrs["window"], attrs["strides"]
    rank, elem = result.rank, elem_type(result.dtype)
    domain = ", ".join(loop_dims(2 * rank))
    x_exprs = ", ".join(f"d{i} * {s} + d{rank + i}" for i, s in enumerate(strides))
    window_type = TensorType(window, result.dtype)
    maps = [
        em.affine_map(f"({domain}) -> ({x_exprs})"),
        em.affine_map(f"({domain}) -> ({', '.join(loop_dims(rank, rank))})"),
        em.affine_map(f"({domain}) -> ({', '.join(loop_dims(rank))})"),
    ]
    acc_dtype = dt.float32 if acc == "f32" else result.dtype
    init_value = reduction_identity("max", acc_dtype) if kind == "max" else 0
    init = fill(em, const(em, init_value, acc_dtype), result, acc)
    return em.generic(
        [(padded, tensor_type(padded_type)), (em.empty(window_type), tensor_type(window_type))],
        (init, tensor_type(result, acc)),
        maps,
        ["parallel"] * rank + ["reduction"] * rank,
        lambda b, args: combine(b, kind, args[2], widen(b, args[0], elem, acc), acc, acc.startswith("i")),
        [elem, elem],
        acc,
    )
