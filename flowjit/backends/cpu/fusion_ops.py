"""What the fusion lowering (`lower_fusion`) knows of a member op: whether it is pointwise (inlined
into the generics that need its value, never a kernel of its own), its scalar code, and its cost.

The scalar code is the one-op lowerings' own (`lower_elementwise`, through `mlir/pointwise.py`,
which the GPU's row kernels share), rounding after every op as they do, so fused and unfused
results are bit-identical. `generic_body` writes the body of a fused
generic from them, for `lower_fusion`'s generics and for a contraction's epilogue
(`fusion_epilogue`).
"""

from __future__ import annotations

from flowjit.backends.mlir.emitter import ScalarBuilder, elem_type
from flowjit.backends.mlir.lower_elementwise import compute_elem, extend, iota_scalar, narrow
from flowjit.backends.mlir.lower_reduction import COMBINE
from flowjit.backends.mlir.lowering import splat_value
from flowjit.backends.mlir.mathlib import MATH, MATH_BINARY
from flowjit.backends.mlir.pointwise import is_pointwise, scalar_code
from flowjit.ir.graph import Op, Value

__all__ = ["generic_body", "is_pointwise", "op_weight", "scalar_code"]


# `op_weight` of a math function (exp, tanh, ...).
MATH_WEIGHT = 8


def op_weight(op: Op) -> int:
    """Rough cost of one element of `op`, in simple arithmetic instructions."""
    if op.name in MATH or op.name in MATH_BINARY or op.name == "pow":
        return MATH_WEIGHT
    return 2 if op.name in ("div", "rem") else 1


def generic_body(b: ScalarBuilder, ops, leaf_args: dict, splats, targets, reduction: Op | None, acc: str) -> list[str]:
    """The scalar code of the generic: leaves in compute types, the ops, the yielded values."""
    value: dict[Value, str] = {}
    for v, arg in leaf_args.items():
        if v.dtype.is_bool:
            arg = b.op(f"arith.cmpi ne, {arg}, {b.const(0, 'i8')} : i8")
        value[v] = extend(b, arg, v.dtype)
    for v in splats:
        if v.producer is not None and v.producer.name == "iota":  # a position (`_emit_generic`)
            value[v] = extend(b, iota_scalar(b, v.producer.attrs["dimension"], v.dtype), v.dtype)
        else:
            value[v] = b.const(splat_value(v), compute_elem(v.dtype))
    for op in ops:
        value[op.result] = scalar_code(b, op, [value[v] for v in op.operands])
    if reduction is None:
        return [
            b.op(f"arith.extui {value[v]} : i1 to i8") if v.dtype.is_bool else narrow(b, value[v], v.dtype)
            for v in targets
        ]
    combine = COMBINE[reduction.name.removeprefix("reduce_")][0]
    e = elem_type(reduction.result.dtype)
    return [b.op(f"arith.{combine} {value[targets[0]]}, {acc} : {e}")]
