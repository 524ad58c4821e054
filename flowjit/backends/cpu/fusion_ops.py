"""What the fusion lowering (`lower_fusion`) knows of a member op: whether it is pointwise (inlined
into the generics that need its value, never a kernel of its own), its scalar code, and its cost.

The scalar code is the one-op lowerings' own (`lower_elementwise`), rounding after every op as they
do, so fused and unfused results are bit-identical. `generic_body` writes the body of a fused
generic from them, for `lower_fusion`'s generics and for a contraction's epilogue
(`fusion_epilogue`).
"""

from __future__ import annotations

from flowjit.backends.mlir.emitter import ScalarBuilder, elem_type
from flowjit.backends.mlir.lower_elementwise import (
    _BINARY,
    _BOOL_PREDICATE,
    _FLOAT_PREDICATE,
    _FLOAT_UNARY,
    _INT_PREDICATE,
    _UNARY,
    compute_elem,
    convert_scalar,
    extend,
    iota_scalar,
    narrow,
    unary_scalar,
)
from flowjit.backends.mlir.lower_reduction import COMBINE
from flowjit.backends.mlir.lowering import splat_value
from flowjit.backends.mlir.mathlib import MATH, MATH_BINARY
from flowjit.ir.graph import Op, Value


def is_pointwise(op: Op) -> bool:
    """Whether `op` is elementwise (a convert, a unary or binary op, a comparison, a select)."""
    if op.name == "convert":
        return True
    if op.name in _UNARY or op.name in _FLOAT_UNARY or op.name in MATH or op.name in _BINARY or op.name == "select":
        return True
    return op.name in _FLOAT_PREDICATE


def scalar_code(b: ScalarBuilder, op: Op, args: list[str]) -> str:
    """`op` on scalars in their compute types (see `compute_elem`; bool is i1); the result is in
    the compute type of `op`'s result, rounded to its dtype first, as the one-op kernels do."""
    out = op.result.type.dtype
    if op.name == "convert":
        src = op.operands[0].type.dtype
        return extend(b, convert_scalar(b, args[0], src, out), out)
    e = compute_elem(op.operands[-1].type.dtype)
    if op.name in _FLOAT_PREDICATE:
        x = op.operands[0].type.dtype
        if x.is_float:
            return b.op(f"arith.cmpf {_FLOAT_PREDICATE[op.name]}, {args[0]}, {args[1]} : {e}")
        predicate = (_BOOL_PREDICATE if x.is_bool else _INT_PREDICATE)[op.name]
        return b.op(f"arith.cmpi {predicate}, {args[0]}, {args[1]} : {e}")
    if op.name == "select":
        result = b.op(f"arith.select {args[0]}, {args[1]}, {args[2]} : {e}")
    elif op.name in _BINARY:
        result = _BINARY[op.name](b, args[0], args[1], e)
    else:
        result = unary_scalar(b.emitter.target.math, op.name)(b, args[0], e)
    return extend(b, narrow(b, result, out), out)


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
