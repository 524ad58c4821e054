"""Pointwise ops on scalars: which member ops of a fused region are pointwise, and their scalar code,
the one-op lowerings' own (`lower_elementwise`), rounding after every op as they do. The CPU's
fused generics (`cpu/fusion_ops.py`) and the GPU's row kernels (`gpu/lower_rows.py`) write their
bodies with it, so fused and unfused results round alike.
"""

from __future__ import annotations

from flowjit.backends.mlir.emitter import ScalarBuilder
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
    narrow,
    unary_scalar,
)
from flowjit.backends.mlir.mathlib import MATH
from flowjit.ir.graph import Op


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
