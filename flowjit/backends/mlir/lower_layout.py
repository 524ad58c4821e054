"""Lowerings of the layout ops, for any target: broadcast, reshape, transpose. A target adds them to
its table with `register`; their copies take the target's schedules (`em.target.schedules`).

reshape is a view (collapse to 1-D, expand to the new shape): it costs nothing unless its result
must be stored. broadcast and transpose are `linalg.generic` copies with a non-identity input map;
a broadcast of a splat constant is a fill.
"""

from __future__ import annotations

import math

from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, tensor_type
from flowjit.backends.mlir.lower_elementwise import filled, reshape_tensor
from flowjit.backends.mlir.lowering import bool_from_bytes, bool_to_bytes, can_collapse, splat_value
from flowjit.backends.mlir.target import LoweringTable
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType


def _storage(t: TensorType) -> str:
    return "i8" if t.dtype.is_bool else elem_type(t.dtype)


def _on_bytes(fn):
    """Run a layout lowering on numpy's bool bytes instead of i1 tensors: a scheduled (vectorized)
    kernel between the driver's i1 <-> byte conversions would need an i1 buffer, which MLIR
    cannot store."""

    def wrapped(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
        if not op.result.type.dtype.is_bool:
            return fn(em, op, operands)
        as_bytes = [bool_to_bytes(em, x, v.type) for x, v in zip(operands, op.operands)]
        return [bool_from_bytes(em, r, op.result.type) for r in fn(em, op, as_bytes)]

    wrapped.__doc__ = fn.__doc__
    return wrapped


def _copy_with_map(em: KernelEmitter, x: str, source: TensorType, result: TensorType, input_map: str) -> str:
    e = _storage(result)
    out_map = em.identity_map(result.rank)
    return em.generic(
        [(x, tensor_type(source, e))],
        (em.empty(result, e), tensor_type(result, e)),
        [input_map, out_map],
        ["parallel"] * result.rank,
        lambda b, args: args[0],
        [e],
        e,
    )


def row_copy(
    em: KernelEmitter, x: str, source: TensorType, result: TensorType, input_map: str, parallel_min: int | None = None
) -> str:
    """A copy reading whole rows of `x` (its last dim maps to the result's: a broadcast, a transpose
    keeping rows, a slice of unit last stride): above ROW_COPY_MIN_ELEMENTS a vector copy of rows
    (`copy_nd`), split over the cores from `parallel_min` elements (default
    ROW_COPY_PARALLEL_MIN_ELEMENTS). As plain loops only LLVM's O3 vectorized such copies, which held
    their whole function off the light pipeline."""
    out = _copy_with_map(em, x, source, result, input_map)
    if result.rank >= 1 and result.size > ROW_COPY_MIN_ELEMENTS:
        parallel = result.size >= (ROW_COPY_PARALLEL_MIN_ELEMENTS if parallel_min is None else parallel_min)
        em.schedule(out, em.target.schedules.copy_nd(result.shape, result.dtype.bits, parallel))
    return out


@_on_bytes
def lower_broadcast(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A copy with a broadcasting input map (size-1 operand dims read at index 0); a fill for splats."""
    (x,) = op.operands
    result = op.result.type
    e = _storage(result)
    splat = splat_value(x)
    if splat is not None and result.size > 0:
        return [filled(em, splat, result, e)]
    dims = ", ".join(f"d{i}" for i in range(result.rank))
    source_dims = []
    for i, d in enumerate(op.attrs["dims"]):
        source_dims.append("0" if x.type.shape[i] == 1 and result.shape[d] != 1 else f"d{d}")
    input_map = em.affine_map(f"({dims}) -> ({', '.join(source_dims)})")
    # Large broadcasts split over the cores from PARALLEL_MIN_ELEMENTS, as elementwise kernels do (not
    # tuned for broadcasts on their own).
    return [row_copy(em, operands[0], x.type, result, input_map, em.target.schedules.PARALLEL_MIN_ELEMENTS)]


@_on_bytes
def lower_reshape(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A view: collapse to 1-D, expand to the new shape."""
    source, result = op.operands[0].type, op.result.type
    return [reshape_tensor(em, operands[0], source, result, _storage(result))]


@_on_bytes
def lower_transpose(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A copy with a permuted input map, on the fewest dims: input dims that stay next to each other
    in the output are one dim (NCHW -> NHWC is (N, C, H*W) -> (N, H*W, C)). Large enough, it moves
    in blocks (`_in_blocks`)."""
    (x,) = op.operands
    perm = op.attrs["perm"]
    if list(perm) == sorted(perm):
        return [operands[0]]
    return [permute(em, operands[0], x.type, perm, _storage(op.result.type))]


def permute(em: KernelEmitter, tensor: str, t: TensorType, perm, e: str) -> str:
    """`tensor` (of type `t`, elements `e`) with its dims permuted by `perm` (see `lower_transpose`)."""
    result = t.with_shape(tuple(t.shape[p] for p in perm))
    source_shape, perm = _merged_dims(t.shape, perm)
    source = t.with_shape(source_shape)
    moved = result.with_shape(tuple(source_shape[p] for p in perm))
    operand = reshape_tensor(em, tensor, t, source, e)
    dims = ", ".join(f"d{i}" for i in range(moved.rank))
    # moved[d0..dn] = source[...] where source's dim perm[i] is moved's dim i.
    reads = [""] * moved.rank
    for i, p in enumerate(perm):
        reads[p] = f"d{i}"
    input_map = em.affine_map(f"({dims}) -> ({', '.join(reads)})")
    source_last = list(perm).index(moved.rank - 1)  # the output dim reading the input's last dim
    bits = moved.dtype.bits
    schedules = em.target.schedules
    if source_last == moved.rank - 1:  # rows stay rows (split heads: (B, T, H, D) -> (B, H, T, D))
        out = row_copy(em, operand, source, moved, input_map)
    elif _in_blocks(em, moved, source_last) and moved.rank == 2 and moved.shape[0] % schedules.transpose_block(bits):
        out = _transposed_in_two(em, operand, source, moved, e, bits)
    else:
        out = _copy_with_map(em, operand, source, moved, input_map)
        if _in_blocks(em, moved, source_last):
            em.schedule(out, schedules.transpose_blocks(moved.shape, source_last, moved.dtype.bits))
    return written_through(em, out, moved, result.shape, e)


def _transposed_in_two(em: KernelEmitter, x: str, source: TensorType, moved: TensorType, e: str, bits: int) -> str:
    """A 2-D transpose (K, R) -> (R, K) whose R is no multiple of the block side: the whole blocks
    of rows (`transpose_blocks`), then the R % side rows left in tiles of all of them
    (`transpose_short_rows`), each into its rows of the output. As one kernel, the last
    block of rows would store its rows past R under all-false masks, into pages past the output's
    end (a large output is a mapping of its own), where AVX-512's masked stores take a microcode
    assist each on Zen 4: twenty to thirty times numpy's time."""
    rows, k = moved.shape
    schedules = em.target.schedules
    main = rows - rows % schedules.transpose_block(bits)
    out_type = tensor_type(moved, e)
    out = em.empty(moved, e)
    for first, count, steps in (
        (0, main, lambda t: schedules.transpose_blocks(t.shape, 0, bits)),
        (main, rows - main, lambda t: schedules.transpose_short_rows(t.shape, bits)),
    ):
        if not count:
            continue
        part = moved.with_shape((count, k))
        part_in = source.with_shape((k, count))
        where_in = f"[0, {first}] [{k}, {count}] [1, 1] : {tensor_type(source, e)} to {tensor_type(part_in, e)}"
        where = f"[{first}, 0] [{count}, {k}] [1, 1]"
        transposed = em.affine_map("(d0, d1) -> (d1, d0)")
        piece = _copy_with_map(em, em.op(f"tensor.extract_slice {x}{where_in}"), part_in, part, transposed)
        em.schedule(piece, steps(part))
        out = em.op(f"tensor.insert_slice {piece} into {out}{where} : {tensor_type(part, e)} into {out_type}")
    return out


def written_through(em: KernelEmitter, loops: str, kernel: TensorType, shape: tuple[int, ...], elem: str) -> str:
    """The tensor `loops` (of type `kernel`) that copy loops filled, reshaped to the result's
    `shape`, and stored through a view of the result's buffer with `kernel`'s shape
    (`em.store_through`): through the reshape empty-tensor elimination gives up, and each call
    would fill a temporary of the result's size and copy it out (a stack of three 16 MiB arrays
    runs four times as fast through the view)."""
    shaped = reshape_tensor(em, loops, kernel, kernel.with_shape(shape), elem)
    if shaped != loops and can_collapse(shape, kernel.shape):
        em.store_through(shaped, loops, kernel.shape)
    return shaped


# Copies of whole rows (`row_copy`) are vector copies from this size on (smaller ones stay plain
# loops, which `compiler.PLAIN_LOOP_MAX_ELEMENTS` lets LLVM's light pipeline take)...
ROW_COPY_MIN_ELEMENTS = 4096
# ... split over the cores from this size on: a copy is memory-bound, and on a 2-core AMD EPYC Zen 4
# VM two threads run it no faster up to 8M float32 elements, and 3.5x slower at 256K.
ROW_COPY_PARALLEL_MIN_ELEMENTS = 1 << 23


def _merged_dims(shape: tuple[int, ...], perm) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, perm) of the same permuted copy with each run of input dims that the output keeps
    together, in order, merged into one dim."""
    runs: list[list[int]] = []  # input dims, in output order
    for p in perm:
        if runs and runs[-1][-1] + 1 == p:
            runs[-1].append(p)
        else:
            runs.append([p])
    order = sorted(range(len(runs)), key=lambda r: runs[r][0])  # the runs in input order
    merged = tuple(math.prod(shape[d] for d in runs[r]) for r in order)
    return merged, tuple(order.index(r) for r in range(len(runs)))


# Permuted copies of at least this many elements move in blocks (`transpose_blocks`).
TRANSPOSE_BLOCKS_MIN_ELEMENTS = 1 << 14


def _in_blocks(em: KernelEmitter, result: TensorType, source_last: int) -> bool:
    """Whether a permuted copy moves in blocks: when the input's last dim is not the output's, and
    the copy is large enough. Above rank 2 only when both blocked dims are whole multiples of the
    block side: masked edge blocks of rank 4 (an NCHW -> NHWC copy of 56x56 images) came out
    wrong from MLIR's masked, permuted transfers, while rank 2 is right with any edges (tested)."""
    if source_last == result.rank - 1 or result.size < TRANSPOSE_BLOCKS_MIN_ELEMENTS:
        return False
    vl = em.target.schedules.transpose_block(result.dtype.bits)  # lanes() counts bools as bytes
    return result.rank == 2 or (result.shape[source_last] % vl == 0 and result.shape[-1] % vl == 0)


def register(table: LoweringTable) -> None:
    """Add the broadcast, reshape and transpose lowerings to `table`."""
    table.tensor.update({"broadcast": lower_broadcast, "reshape": lower_reshape, "transpose": lower_transpose})
