"""Kernels that the contraction lowerings write row by row as vector code.

`row_of_vectors` writes one output row as vectors (whole ones, the last overlapping the one before,
or masked when the row is shorter than a vector); `read_every_step` makes such a vector from every
`step`-th input; `close_loops` ends the loop nest over the rows around them. Written with them:
`transpose` (copies of contiguous blocks) and `window_rows` (the row copies behind im2col and
im2row). `over_cores` and `per_row` fill a flat output in chunks of rows, one per core.
"""

from __future__ import annotations

from flowjit.backends.cpu import host, schedule
from flowjit.backends.cpu.contraction import size_of
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, tensor_type
from flowjit.backends.mlir.lower_layout import permute
from flowjit.backends.mlir.lower_movement import reshape
from flowjit.ir.types import TensorType


def transpose(
    em: KernelEmitter, x: str, t: TensorType, perm: list[int], elem: str, into: str | None = None
) -> tuple[str, TensorType]:
    """`x` with its dims permuted (a copy), unless `perm` is the identity; written into the tensor
    `into` (of the permuted shape, contiguous: a run of whole images of a conv's output) when
    given, else into a new one. When trailing dims stay in place (the conv output's (O, N, OH, OW)
    -> (N, O, OH, OW)), a copy of contiguous blocks (`_copy_blocks`)."""
    if perm == sorted(perm):
        return x, t
    out = TensorType(tuple(t.shape[p] for p in perm), t.dtype)
    kept = 0  # trailing dims in place
    while perm[t.rank - 1 - kept] == t.rank - 1 - kept:
        kept += 1
    block = size_of(range(t.rank - kept, t.rank), t.shape)
    if kept and elem in ("f32", "f64", "i32", "i64") and block >= host.vector_bits() // int(elem[1:]):
        return _copy_blocks(em, x, t, perm[: t.rank - kept], block, elem, into), out
    if into is None:  # rows shorter than a vector (a 3x3 weight gradient): the transpose op's copies
        return permute(em, x, TensorType(t.shape, elem), perm, elem), out
    moved = em.op(
        f"linalg.transpose ins({x} : {tensor_type(t, elem)}) outs({into} : {tensor_type(out, elem)}) "
        f"permutation = [{', '.join(map(str, perm))}]"
    )
    return moved, out


def _copy_blocks(
    em: KernelEmitter, x: str, t: TensorType, outer: list[int], block: int, elem: str, into: str | None = None
) -> str:
    """`x` with its leading dims permuted by `outer`, the trailing ones (`block` elements, contiguous
    on both sides) kept: loops over the leading output dims, vector copies along the block, into
    `into` (contiguous, of the permuted shape) when given. (As a `linalg.transpose`, reshaped to
    (leading dims, block) or not, the fusion pass expands it back and the inner loop ran over OW
    only: 28-element rows, which LLVM vectorized behind a runtime alias check with a scalar
    remainder loop.)"""
    lanes = host.vector_bits() // int(elem[1:])
    vec = f"vector<{lanes}x{elem}>"
    flat = TensorType((t.size,), t.dtype)
    flat_type = tensor_type(flat, elem)
    source = reshape(em, x, t, flat.shape, elem)
    in_strides = row_major_strides(t.shape)
    out_shape = [t.shape[p] for p in outer] + list(t.shape[len(outer) :])
    out_strides = row_major_strides(out_shape)
    w = LoopWriter(em)
    pad = em.op(f"arith.constant {'0.0' if elem.startswith('f') else '0'} : {elem}")
    start = (
        em.empty(flat, elem)
        if into is None
        else reshape(em, into, TensorType(tuple(out_shape), t.dtype), flat.shape, elem)
    )
    carried, loops, src, dst = start, [], w.index(0), w.index(0)
    for d, p in enumerate(outer):
        loop, iv, (carried,) = w.open_for(w.index(0), w.index(out_shape[d]), w.index(1), [(carried, flat_type)])
        loops.append(loop)
        src = w.add(src, w.mul(iv, w.index(in_strides[p])))
        dst = w.add(dst, w.mul(iv, w.index(out_strides[d])))

    def value_at(column: str, inside: bool) -> str:
        return em.op(
            f"vector.transfer_read {source}[{w.add(src, column)}], {pad} {{in_bounds = [{str(inside).lower()}]}} "
            f": {flat_type}, {vec}"
        )

    moved = close_loops(w, row_of_vectors(w, carried, flat_type, dst, (block, lanes, elem), value_at), flat_type, loops)
    result = reshape(em, moved, flat, tuple(out_shape), elem)
    if into is None:
        em.store_through(result, moved, flat.shape)
    return result


def window_rows(em: KernelEmitter, source, size: int, levels, row, acc: str, base=None) -> str:
    """A flat tensor of `size` elements (in `acc`) made of rows copied out of the padded input
    `source` = (tensor, type), the copy behind im2col and im2row: nested loops, one per `levels`
    entry (bound, offsets), where offsets is (input, output) elements per step or, for a step that
    is not linear, a function (LoopWriter, induction variable) -> (input, output) offsets; at the
    innermost, `row` = (width, step) elements read every `step`-th from the input offset (`base(w)`
    plus the levels' offsets) with vectors (a contiguous read on a 1-D view of the whole input, a
    shuffle for step > 1) and stored masked to the width at the output offset."""
    padded, padded_type = source
    width, step = row
    elem = elem_type(padded_type.dtype)
    lanes = host.vector_bits() // int(acc[1:])
    flat_in = TensorType((padded_type.size,), padded_type.dtype)
    flat_source = reshape(em, padded, padded_type, flat_in.shape)
    flat_t = TensorType((size,), padded_type.dtype)
    flat_type = tensor_type(flat_t, acc)
    w = LoopWriter(em)
    pad = em.op(f"arith.constant 0.0 : {elem}")
    carried, loops = em.empty(flat_t, acc), []
    in_offset, out_offset = (base(w) if base else w.index(0)), w.index(0)
    for bound, offsets in levels:
        loop, iv, (carried,) = w.open_for(w.index(0), w.index(bound), w.index(1), [(carried, flat_type)])
        loops.append(loop)
        if callable(offsets):
            read, write = offsets(w, iv)
        else:
            read, write = (w.mul(iv, w.index(k)) for k in offsets)
        in_offset, out_offset = w.add(in_offset, read), w.add(out_offset, write)

    def value_at(column: str, inside: bool) -> str:
        where = w.add(in_offset, w.mul(column, w.index(step)))
        return read_every_step(em, flat_source, flat_in, where, pad, step, lanes, elem, acc, inside)

    row_out = row_of_vectors(w, carried, flat_type, out_offset, (width, lanes, acc), value_at)
    return close_loops(w, row_out, flat_type, loops)


def row_of_vectors(w, row_out: str, flat_type: str, out_offset: str, row, value_at) -> str:
    """`row_out` with one output row of `width` elements written at `out_offset` as vectors of
    `lanes` (`row` = (width, lanes, element)): `value_at(column, inside)` makes the vector of
    columns [column, column + lanes), `inside` when all of them are in the row. A row of at least a
    vector takes whole vectors only, the last one ending at the row's end (overlapping the one
    before): no masks, and a unit-step read of them stays inside its input row. A shorter row is
    stored masked. A short row's vectors (`schedule.short_row`) are written out here, constant
    columns, rather than a loop marked for LLVM's unrolling, which only its O3 pipeline does (a
    marked loop keeps the function off the light pipeline)."""
    em = w.em
    width, lanes, elem = row
    vec = f"vector<{lanes}x{elem}>"
    steps = -(-width // lanes)

    def store(value: str, column: str, into: str) -> str:
        if width >= lanes:
            return em.op(
                f"vector.transfer_write {value}, {into}[{w.add(out_offset, column)}] {{in_bounds = [true]}} "
                f": {vec}, {flat_type}"
            )
        # Masked to the row, every lane written is in the tensor: in bounds, so no mask of the
        # tensor's end is computed per store (the lanes masked off are not accessed).
        mask = em.op(
            f"vector.create_mask {em.op(f'arith.subi {w.index(width)}, {column} : index')} : vector<{lanes}xi1>"
        )
        return em.op(
            f"vector.transfer_write {value}, {into}[{w.add(out_offset, column)}], {mask} {{in_bounds = [true]}} "
            f": {vec}, {flat_type}"
        )

    if schedule.short_row(width, lanes):
        for j in range(steps):
            column = w.index(min(j * lanes, width - lanes) if width >= lanes else j * lanes)
            row_out = store(value_at(column, width >= lanes), column, row_out)
        return row_out
    loop, j, (cur,) = w.open_for(w.index(0), w.index(steps), w.index(1), [(row_out, flat_type)])
    column = w.mul(j, w.index(lanes))
    if width >= lanes:
        column = em.op(f"arith.minsi {column}, {w.index(width - lanes)} : index")
    w.close_for([store(value_at(column, width >= lanes), column, cur)], [flat_type])
    return loop


def read_every_step(
    em, source: str, flat_in: TensorType, where: str, pad: str, step: int, lanes: int, elem, acc, inside=False
):
    """`lanes` elements of the 1-D `source` from `where` on, every `step`-th one, widened to `acc`;
    `inside`: the caller knows that every element they take is in the tensor. One contiguous read
    of `step * lanes` (out-of-bounds lanes read `pad`) and a shuffle; for step 2 with `inside`,
    two reads of `lanes` that end at the last element taken (so both are in bounds: no masks) and
    one two-source shuffle. Otherwise the wide read past a row's last element must be masked at the
    tensor's end, its mask computed per read, which slows max pooling 2x2/2 down by half."""
    vec = f"vector<{lanes}x{elem}>"
    if step == 2 and inside:
        later = em.op(f"arith.addi {where}, {em.op(f'arith.constant {lanes - 1} : index')} : index")
        first, second = (
            em.op(f"vector.transfer_read {source}[{at}], {pad} {{in_bounds = [true]}} : {tensor_type(flat_in)}, {vec}")
            for at in (where, later)
        )
        # Elements 0, 2, .., lanes - 2 from the first; lanes, .., 2 * lanes - 2 are the second's odd ones.
        picks = [2 * i for i in range(lanes // 2)] + [lanes + 2 * i + 1 for i in range(lanes // 2)]
        value = em.op(f"vector.shuffle {first}, {second} [{', '.join(map(str, picks))}] : {vec}, {vec}")
    else:
        wide = f"vector<{step * lanes}x{elem}>"
        value = em.op(
            f"vector.transfer_read {source}[{where}], {pad} {{in_bounds = [{str(inside and step == 1).lower()}]}} "
            f": {tensor_type(flat_in)}, {wide}"
        )
        if step > 1:
            picks = ", ".join(str(i * step) for i in range(lanes))
            value = em.op(f"vector.shuffle {value}, {value} [{picks}] : {wide}, {wide}")
    if elem != acc:
        value = em.op(f"arith.extf {value} : {vec} to vector<{lanes}x{acc}>")
    return value


def close_loops(w, done: str, flat_type: str, loops) -> str:
    """Close the row loops `loops` (innermost last), each yielding the tensor `done` its body made;
    returns the outermost loop's result."""
    for loop in reversed(loops):
        w.close_for([done], [flat_type])
        done = loop
    return done


def row_major_strides(shape) -> list[int]:
    """Elements apart per step along each dim of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def over_cores(em: KernelEmitter, rows: int, elem: str, units: int, unit_rows: int, fill, parallel: bool) -> str:
    """A tensor<rows x elem> whose first `units * unit_rows` elements `fill(first_row, count, part,
    part_type)` writes into `part`: `count` units from row `first_row` on (None: the whole tensor,
    from row 0), in one `scf.forall` chunk of whole units per core when `parallel` (and there are
    units), else in one piece."""
    w = LoopWriter(em)
    flat_type = f"tensor<{rows}x{elem}>"
    out = em.op(f"tensor.empty() : {flat_type}")
    if not (parallel and units):
        return fill(None, w.index(units), out, flat_type) if units else out
    chunk = -(-units // host.cores())
    done, t, shared = w.open_forall(-(-units // chunk), out, flat_type)
    first = w.mul(t, w.index(chunk))
    count = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(units)}, {first} : index')}, {w.index(chunk)} : index")
    first_row, part_rows = first, count
    if unit_rows > 1:
        first_row, part_rows = w.mul(first, w.index(unit_rows)), w.mul(count, w.index(unit_rows))
    part_type = f"tensor<?x{elem}>"
    part = em.op(f"tensor.extract_slice {shared}[{first_row}] [{part_rows}] [1] : {flat_type} to {part_type}")
    filled = fill(first_row, count, part, part_type)
    w.close_forall(filled, shared, f"[{first_row}] [{part_rows}] [1]", part_type, flat_type)
    return done


def per_row(em: KernelEmitter, rows: int, elem: str, answer, parallel: bool) -> str:
    """A tensor<rows x elem> whose element r is the scalar `answer(r)` emits, rows split in one
    `scf.forall` chunk per core when `parallel` (`over_cores`)."""
    w = LoopWriter(em)

    def each_row(first_row: str | None, count: str, out: str, out_type: str) -> str:
        loop, local, (acc,) = w.open_for(w.index(0), count, w.index(1), [(out, out_type)])
        value = answer(local if first_row is None else w.add(first_row, local))
        w.close_for([em.op(f"tensor.insert {value} into {acc}[{local}] : {out_type}")], [out_type])
        return loop

    return over_cores(em, rows, elem, rows, 1, each_row, parallel)
