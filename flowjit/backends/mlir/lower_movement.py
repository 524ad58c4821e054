"""Lowerings of the data-movement ops slice and dynamic_slice, for any target, and the movement
helpers every target's lowerings share (views, fills, strided inserts, pads, clamped indices). A
target adds the lowerings to its table with `register`; pads take the target's schedules
(`em.target.schedules`).

Slices are `tensor.extract_slice` views copied with `linalg.copy` (whole rows: `row_copy`); pads
are a fill followed by a strided insert. bool data moves as bytes (`on_bytes`). dynamic_slice
starts are clamped into `[0, dim - size]` in the generated code, as in the reference
implementation: no generated load or store can leave its buffer.

pad, concatenate, gather and scatter_add are each target's own (`backends/cpu/lower_movement.py`,
whose vector copy loops read the host's vector width and core count; `backends/gpu/lower_kernels.py`),
and so is the GPU's dynamic_slice, which reads its starts inside the kernel.
"""

from __future__ import annotations

import functools

from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder, elem_type, memory_elem_type, tensor_type
from flowjit.backends.mlir.lower_layout import row_copy
from flowjit.backends.mlir.lowering import bool_from_bytes, bool_to_bytes
from flowjit.backends.mlir.target import LoweringTable
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType


def moved_type(t) -> str:
    """Tensor type of a moved value: bool data moves as numpy's bytes (see `on_bytes`)."""
    return tensor_type(t, memory_elem_type(t.dtype))


def on_bytes(fn):
    """Run a movement lowering on numpy's bool bytes (i8) instead of i1 tensors.

    Movement ops materialize their data in buffers, and MLIR 22 cannot load or store i1 memrefs
    (MemRefToLLVM asserts), so bool operands are widened to bytes first and results narrowed back.
    """

    @functools.wraps(fn)
    def wrapped(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
        operands = [bool_to_bytes(em, x, v.type) if v.dtype.is_bool else x for x, v in zip(operands, op.operands)]
        results = fn(em, op, operands)
        return [bool_from_bytes(em, r, v.type) if v.dtype.is_bool else r for r, v in zip(results, op.results)]

    return wrapped


def index_list(values) -> str:
    return ", ".join(str(v) for v in values)


def clamp_index(b: ScalarBuilder | KernelEmitter, value: str, int_elem: str, low: int, high: int) -> str:
    """`value` (an integer of MLIR type `int_elem`) as an `index` clamped into [low, high]."""
    index = b.op(f"arith.index_cast {value} : {int_elem} to index")
    low_c = b.op(f"arith.constant {low} : index")
    high_c = b.op(f"arith.constant {high} : index")
    above = b.op(f"arith.maxsi {index}, {low_c} : index")
    return b.op(f"arith.minsi {above}, {high_c} : index")


def copy_tensor(em: KernelEmitter, x: str, t) -> str:
    """A fresh copy of `x` as a `linalg.copy` (lowered to loops): a strided view stored with
    `memref.copy` would need the MLIR C runner's `memrefCopy`, which native code cannot call."""
    ttype = moved_type(t)
    return em.op(f"linalg.copy ins({x} : {ttype}) outs({em.empty(t, memory_elem_type(t.dtype))} : {ttype}) -> {ttype}")


@on_bytes
def lower_slice(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """x[start:limit:stride]: a strided `tensor.extract_slice`, copied."""
    (x,) = operands
    source, result = op.operands[0].type, op.result.type
    if source.rank == 0:
        return [x]
    if result.size == 0:
        return [em.empty(result, memory_elem_type(result.dtype))]
    start, stride = op.attrs["start"], op.attrs["stride"]
    view = em.op(
        f"tensor.extract_slice {x}[{index_list(start)}] [{index_list(result.shape)}] "
        f"[{index_list(stride)}] : {moved_type(source)} to {moved_type(result)}"
    )
    if stride[-1] == 1:  # whole runs of rows
        return [row_copy(em, view, result, result, em.identity_map(result.rank))]
    return [copy_tensor(em, view, result)]


@on_bytes
def lower_dynamic_slice(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A window at runtime starts, each clamped into [0, dim - size] so the window always fits."""
    x, *starts = operands
    source, result = op.operands[0].type, op.result.type
    if source.rank == 0:
        return [x]
    if result.size == 0:
        return [em.empty(result, memory_elem_type(result.dtype))]
    offsets = []
    for start, start_value, dim, size in zip(starts, op.operands[1:], source.shape, result.shape):
        int_elem = memory_elem_type(start_value.dtype)
        scalar = em.op(f"tensor.extract {start}[] : tensor<{int_elem}>")
        offsets.append(clamp_index(em, scalar, int_elem, 0, dim - size))
    view = em.op(
        f"tensor.extract_slice {x}[{', '.join(offsets)}] [{index_list(result.shape)}] "
        f"[{index_list([1] * source.rank)}] : {moved_type(source)} to {moved_type(result)}"
    )
    return [copy_tensor(em, view, result)]


def reshape(em: KernelEmitter, x: str, t: TensorType, shape: tuple[int, ...], elem: str | None = None) -> str:
    """Row-major reshape of `x` as views: collapse to 1-D, then expand to `shape` (rank 0 <-> (1,))."""
    if tuple(t.shape) == tuple(shape):
        return x
    elem = elem or elem_type(t.dtype)
    flat = TensorType((t.size,), t.dtype)
    if t.rank == 0:
        x = em.op(
            f"tensor.expand_shape {x} [] output_shape [1] : {tensor_type(t, elem)} into {tensor_type(flat, elem)}"
        )
    elif t.rank > 1:
        groups = ", ".join(str(i) for i in range(t.rank))
        x = em.op(f"tensor.collapse_shape {x} [[{groups}]] : {tensor_type(t, elem)} into {tensor_type(flat, elem)}")
    target = TensorType(shape, t.dtype)
    if len(shape) == 0:
        return em.op(f"tensor.collapse_shape {x} [] : {tensor_type(flat, elem)} into {tensor_type(target, elem)}")
    if len(shape) == 1:
        return x
    groups = ", ".join(str(i) for i in range(len(shape)))
    return em.op(
        f"tensor.expand_shape {x} [[{groups}]] output_shape [{', '.join(map(str, shape))}] "
        f": {tensor_type(flat, elem)} into {tensor_type(target, elem)}"
    )


def fill(em: KernelEmitter, scalar: str, t, elem: str | None = None) -> str:
    """A new tensor of type `t` filled with the scalar SSA value `scalar`."""
    elem = elem or memory_elem_type(t.dtype)
    empty = em.empty(t, elem)
    ttype = tensor_type(t, elem)
    return em.op(f"linalg.fill ins({scalar} : {elem}) outs({empty} : {ttype}) -> {ttype}")


def insert_into(em: KernelEmitter, x: str, source, dest: str, dest_type, offsets, strides) -> str:
    """`dest` with `x` (type `source`) written at `offsets` with `strides`.

    Written as extract_slice -> linalg.copy -> insert_slice of the same slice, which bufferizes to
    an in-place copy loop; a bare insert_slice into a strided view would become a `memref.copy`
    that needs the C runner's `memrefCopy`. MLIR folds the copy of a literal (`em.literal`) into
    just such a `memref.copy` from its global, so a literal is first copied into a buffer of its own
    (concatenate([x, x - x]), conv2d of a constant input with padding)."""
    where = f"[{index_list(offsets)}] [{index_list(source.shape)}] [{index_list(strides)}]"
    view_types = f"{moved_type(dest_type)} to {moved_type(source)}"
    view = em.op(f"tensor.extract_slice {dest}{where} : {view_types}")
    ttype = moved_type(source)
    if x in em.literals:
        x = em.op(f"bufferization.alloc_tensor() copy({x}) : {ttype}")
    copied = em.op(f"linalg.copy ins({x} : {ttype}) outs({view} : {ttype}) -> {ttype}")
    return em.op(f"tensor.insert_slice {copied} into {dest}{where} : {ttype} into {moved_type(dest_type)}")


def pad_tensor(em: KernelEmitter, x: str, source, result, scalar: str, low, interior) -> str:
    """`x` (type `source`) placed at offsets `low` with steps `interior + 1` in a `result` tensor
    filled with `scalar`: edge and interior padding in one strided insert. A pad without interior
    padding (a convolution's input) above `PLAIN_LOOP_MAX_ELEMENTS` (the target's) fills and copies with
    vector loops, split over the cores when large (`_vector_pad`)."""
    if source.rank > 1 and not any(interior) and source.size > em.target.schedules.PLAIN_LOOP_MAX_ELEMENTS:
        return _vector_pad(em, x, source, result, scalar, low)
    filled = fill(em, scalar, result)
    if source.size == 0:
        return filled
    return insert_into(em, x, source, filled, result, low, [i + 1 for i in interior])


def _vector_pad(em: KernelEmitter, x: str, source, result, scalar: str, low) -> str:
    """`pad_tensor` as two n-d generics with the target's `copy_nd`: the fill, then the copy into the
    interior view (in place), over the cores from `PARALLEL_MIN_ELEMENTS` on. As a fill and
    a strided insert they would be a memset and a copy loop on one thread, a noticeable part of a
    convolution's time; and below the parallel size a scalar
    copy loop would keep the whole function on LLVM's O3 pipeline (a conv weight gradient's
    32x8x28x28 input padded to 30x30: `compiler.light_pipeline`)."""
    schedules = em.target.schedules
    elem = memory_elem_type(result.dtype)
    bits = max(8, result.dtype.bits)
    parallel = source.size >= schedules.PARALLEL_MIN_ELEMENTS
    ttype = tensor_type(result, elem)
    ident = em.identity_map(result.rank)
    iterators = ["parallel"] * result.rank
    filled = em.generic([], (em.empty(result, elem), ttype), [ident], iterators, lambda b, args: scalar, [], elem)
    em.schedule(filled, schedules.copy_nd(result.shape, bits, parallel))
    where = f"[{index_list(low)}] [{index_list(source.shape)}] [{index_list([1] * source.rank)}]"
    view_type = moved_type(source)
    view = em.op(f"tensor.extract_slice {filled}{where} : {ttype} to {view_type}")
    copied = em.generic(
        [(x, view_type)], (view, view_type), [ident, ident], iterators, lambda b, args: args[0], [elem], elem
    )
    em.schedule(copied, schedules.copy_nd(source.shape, bits, parallel))
    return em.op(f"tensor.insert_slice {copied} into {filled}{where} : {view_type} into {ttype}")


def register(table: LoweringTable) -> None:
    """Add the slice and dynamic_slice lowerings to `table`."""
    table.tensor.update({"slice": lower_slice, "dynamic_slice": lower_dynamic_slice})
