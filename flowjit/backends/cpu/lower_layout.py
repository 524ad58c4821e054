"""CPU lowerings of the layout ops: broadcast, reshape, transpose.

reshape is a view (collapse to 1-D, expand to the new shape): it costs nothing unless its result
must be stored. broadcast and transpose are `linalg.generic` copies with a non-identity input map;
a broadcast of a splat constant is a fill.
"""

from __future__ import annotations

from flowjit.backends.cpu import schedule
from flowjit.backends.cpu.emitter import KernelEmitter, elem_type, scalar_literal, tensor_type
from flowjit.backends.cpu.lower_elementwise import collapse, expand, reshape_tensor
from flowjit.backends.cpu.lowering import bool_from_bytes, bool_to_bytes, lowering, splat_value
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType


def _copy_with_map(em: KernelEmitter, x: str, source: TensorType, result: TensorType, input_map: str) -> str:
    e = elem_type(result.dtype)
    out_map = em.identity_map(result.rank)
    return em.generic(
        [(x, tensor_type(source))],
        (em.empty(result), tensor_type(result)),
        [input_map, out_map],
        ["parallel"] * result.rank,
        lambda b, args: args[0],
        [e],
        e,
    )


@lowering("broadcast")
def lower_broadcast(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A copy with a broadcasting input map (size-1 operand dims read at index 0); a fill for splats."""
    (x,) = op.operands
    result = op.result.type
    splat = splat_value(x)
    if splat is not None and result.size > 0:
        e = elem_type(result.dtype)
        fill = em.op(f"arith.constant {scalar_literal(splat, result.dtype)} : {e}")
        flat = TensorType((result.size,), result.dtype) if result.rank > 1 else result
        filled = em.op(
            f"linalg.fill ins({fill} : {e}) outs({collapse(em, em.empty(result), result)} : {tensor_type(flat)}) "
            f"-> {tensor_type(flat)}"
        )
        return [expand(em, filled, result)]
    dims = ", ".join(f"d{i}" for i in range(result.rank))
    source_dims = []
    for i, d in enumerate(op.attrs["dims"]):
        source_dims.append("0" if x.type.shape[i] == 1 and result.shape[d] != 1 else f"d{d}")
    input_map = em.affine_map(f"({dims}) -> ({', '.join(source_dims)})")
    out = _copy_with_map(em, operands[0], x.type, result, input_map)
    if result.rank >= 1 and result.size >= schedule.PARALLEL_MIN_ELEMENTS:
        em.schedule(out, schedule.copy_nd(result.shape, result.dtype.bits))
    return [out]


@lowering("reshape")
def lower_reshape(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A view: collapse to 1-D, expand to the new shape."""
    source, result = op.operands[0].type, op.result.type
    if not source.dtype.is_bool:
        return [reshape_tensor(em, operands[0], source, result)]
    # A reshape sits between the i1 <-> byte conversions and keeps them from fusing, which would
    # leave an i1 buffer (MLIR cannot store those): reshape the bytes instead.
    as_bytes = bool_to_bytes(em, operands[0], source)
    moved = reshape_tensor(em, as_bytes, source, result, elem="i8")
    return [bool_from_bytes(em, moved, result)]


@lowering("transpose")
def lower_transpose(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A copy with a permuted input map."""
    (x,) = op.operands
    result = op.result.type
    perm = op.attrs["perm"]
    if list(perm) == sorted(perm):
        return [operands[0]]
    dims = ", ".join(f"d{i}" for i in range(result.rank))
    # result[d0..dn] = x[...] where x's dim perm[i] is result dim i.
    source = [""] * result.rank
    for i, p in enumerate(perm):
        source[p] = f"d{i}"
    input_map = em.affine_map(f"({dims}) -> ({', '.join(source)})")
    return [_copy_with_map(em, operands[0], x.type, result, input_map)]
