"""CPU lowerings of reduce_sum, reduce_max, reduce_min and reduce_prod.

A reduction over a contiguous group of axes is normalized to one of three shapes by collapsing
(free on contiguous buffers): a full reduction `(R) -> ()`, rows `(A, R) -> (A)` or columns
`(A, R, B) -> (A, B)` with B the contiguous trailing extent; each has a schedule in `schedule.py`
(vector accumulators, both cores when large). Other axis sets reduce with a plain generic.

max/min propagate nan like numpy (`arith.maximumf`/`minimumf`); half types accumulate in f32 and
round once; an empty reduction gives the identity (the accumulator's initial value).
"""

from __future__ import annotations

import math

from flowjit.backends.cpu import schedule
from flowjit.backends.cpu.emitter import KernelEmitter, elem_type, scalar_literal, tensor_type
from flowjit.backends.cpu.lower_elementwise import compute_elem, extend, map_elementwise, reshape_tensor
from flowjit.backends.cpu.lowering import lowering
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op, Value
from flowjit.ir.ops.reduction import reduction_identity
from flowjit.ir.types import TensorType

# kind -> (float combiner, integer combiner)
_COMBINE = {
    "sum": ("addf", "addi"),
    "prod": ("mulf", "muli"),
    "max": ("maximumf", "maxsi"),
    "min": ("minimumf", "minsi"),
}


def _normal_form(shape: tuple[int, ...], axes: list[int]) -> tuple[int, int, int] | None:
    """(A, R, B) when `axes` are one contiguous group of dimensions, else None."""
    if axes != list(range(axes[0], axes[-1] + 1)):
        return None
    return math.prod(shape[: axes[0]]), math.prod(shape[axes[0] : axes[-1] + 1]), math.prod(shape[axes[-1] + 1 :])


@lowering("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
def lower_reduce(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    (x,) = op.operands
    source, result = x.type, op.result.type
    axes = sorted(a % max(source.rank, 1) for a in op.attrs["axes"])
    if not axes:
        return [operands[0]]
    kind = op.name.removeprefix("reduce_")
    acc_dtype = dt.float32 if source.dtype in (dt.float16, dt.bfloat16) else source.dtype
    form = _normal_form(source.shape, axes) if source.size > 0 else None
    if form is None:
        in_shape, reduced = source.shape, axes
    else:
        a, r, b = form
        in_shape = tuple(d for d, keep in ((a, a > 1), (r, True), (b, b > 1)) if keep)
        reduced = [1 if a > 1 else 0]
    in_type = source.with_shape(in_shape)
    out_shape = tuple(d for i, d in enumerate(in_shape) if i not in reduced)
    acc_type = TensorType(out_shape, acc_dtype)
    x_in = reshape_tensor(em, operands[0], source, in_type)
    acc = _reduce(em, kind, x_in, in_type, reduced, acc_type)
    if form is not None and in_type.size >= 2:
        em.schedule(acc, schedule.reduction(in_shape, reduced[0], acc_dtype.bits))
    if acc_dtype != result.dtype:
        acc = map_elementwise(em, acc_type.with_dtype(result.dtype), [(acc, Value(acc_type))], lambda b, v: v[0])
    return [reshape_tensor(em, acc, acc_type.with_dtype(result.dtype), result)]


def _reduce(em: KernelEmitter, kind: str, x: str, source: TensorType, reduced: list[int], acc: TensorType) -> str:
    e = compute_elem(acc.dtype)
    identity = em.op(f"arith.constant {scalar_literal(reduction_identity(kind, acc.dtype), acc.dtype)} : {e}")
    init = em.op(f"linalg.fill ins({identity} : {e}) outs({em.empty(acc)} : {tensor_type(acc)}) -> {tensor_type(acc)}")
    dims = [f"d{i}" for i in range(source.rank)]
    in_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(dims)})")
    kept = [d for i, d in enumerate(dims) if i not in reduced]
    out_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(kept)})")
    combine = _COMBINE[kind][0 if acc.dtype.is_float else 1]

    def body(b, args):
        value = extend(b, args[0], source.dtype)
        return b.op(f"arith.{combine} {value}, {args[1]} : {e}")

    iterators = ["reduction" if i in reduced else "parallel" for i in range(source.rank)]
    inputs = [(x, tensor_type(source))]
    return em.generic(
        inputs, (init, tensor_type(acc)), [in_map, out_map], iterators, body, [elem_type(source.dtype)], e
    )
