"""CPU lowerings of reduce_sum, reduce_max, reduce_min and reduce_prod.

A reduction over a contiguous group of axes is normalized to one of three shapes by collapsing
(free on contiguous buffers): a full reduction `(R) -> ()`, rows `(A, R) -> (A)` or columns
`(A, R, B) -> (A, B)` with B the contiguous trailing extent; each has a schedule in `schedule.py`
(vector accumulators, both cores when large). Other axis sets reduce one contiguous group at a
time, in the accumulator type.

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


def _normal_form(shape: tuple[int, ...], axes: list[int]) -> tuple[int, int, int]:
    """(A, R, B): the extents before, of and after the contiguous group of dimensions `axes`."""
    return math.prod(shape[: axes[0]]), math.prod(shape[axes[0] : axes[-1] + 1]), math.prod(shape[axes[-1] + 1 :])


@lowering("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
def lower_reduce(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """reduce_sum/max/min/prod over `axes` (see the module docstring)."""
    (x,) = op.operands
    source, result = x.type, op.result.type
    axes = sorted(a % max(source.rank, 1) for a in op.attrs["axes"])
    if not axes:
        return [operands[0]]
    kind = op.name.removeprefix("reduce_")
    acc_dtype = dt.float32 if source.dtype in (dt.float16, dt.bfloat16) else source.dtype
    if source.size == 0:  # nothing to read: the identity, from one plain generic
        acc_type = TensorType(result.shape, acc_dtype)
        acc = _reduce(em, kind, operands[0], source, axes, acc_type)
    else:
        # One contiguous group of axes at a time, the last first (earlier axes keep their numbers):
        # each step is a scheduled normal form, e.g. axes (0, 2) are a row then a column reduction.
        acc, acc_type = operands[0], source
        for group in reversed(_contiguous_groups(axes)):
            acc, acc_type = _reduce_group(em, kind, acc, acc_type, group, acc_dtype)
    if acc_dtype != result.dtype:
        acc = map_elementwise(em, acc_type.with_dtype(result.dtype), [(acc, Value(acc_type))], lambda b, v: v[0])
    return [reshape_tensor(em, acc, acc_type.with_dtype(result.dtype), result)]


def _contiguous_groups(axes: list[int]) -> list[list[int]]:
    groups = [[axes[0]]]
    for a in axes[1:]:
        if a == groups[-1][-1] + 1:
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def _reduce_group(em: KernelEmitter, kind: str, x: str, source: TensorType, group: list[int], acc_dtype):
    """Reduce the contiguous axes `group` of a non-empty `x` in normal form (A, R, B) with its
    schedule; returns the accumulator tensor and its type (`source` without the group's axes)."""
    a, r, b = _normal_form(source.shape, group)
    in_shape = tuple(d for d, keep in ((a, a > 1), (r, True), (b, b > 1)) if keep)
    reduced = 1 if a > 1 else 0
    in_type = source.with_shape(in_shape)
    flat_acc = TensorType(tuple(d for i, d in enumerate(in_shape) if i != reduced), acc_dtype)
    acc = _reduce(em, kind, reshape_tensor(em, x, source, in_type), in_type, [reduced], flat_acc)
    if in_type.size >= 2:
        em.schedule(acc, schedule.reduction(in_shape, reduced, acc_dtype.bits))
    kept = TensorType(tuple(d for i, d in enumerate(source.shape) if i not in group), acc_dtype)
    return reshape_tensor(em, acc, flat_acc, kept), kept


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
