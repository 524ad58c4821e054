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


@lowering("broadcast")
@_on_bytes
def lower_broadcast(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A copy with a broadcasting input map (size-1 operand dims read at index 0); a fill for splats."""
    (x,) = op.operands
    result = op.result.type
    e = _storage(result)
    splat = splat_value(x)
    if splat is not None and result.size > 0:
        literal = int(bool(splat)) if result.dtype.is_bool else scalar_literal(splat, result.dtype)
        fill = em.op(f"arith.constant {literal} : {e}")
        flat = TensorType((result.size,), result.dtype) if result.rank > 1 else result
        init = collapse(em, em.empty(result, e), result, e)
        filled = em.op(f"linalg.fill ins({fill} : {e}) outs({init} : {tensor_type(flat, e)}) -> {tensor_type(flat, e)}")
        return [expand(em, filled, result, e)]
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
@_on_bytes
def lower_reshape(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A view: collapse to 1-D, expand to the new shape."""
    source, result = op.operands[0].type, op.result.type
    return [reshape_tensor(em, operands[0], source, result, _storage(result))]


@lowering("transpose")
@_on_bytes
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
