"""Lowerings of reduce_sum, reduce_max, reduce_min and reduce_prod, for any target: a target adds
them to its table with `register`.

A reduction over a contiguous group of axes is normalized to one of three shapes by collapsing
(free on contiguous buffers): a full reduction `(R) -> ()`, rows `(A, R) -> (A)` or columns
`(A, R, B) -> (A, B)` with B the contiguous trailing extent; each has the target's schedule
(`em.target.schedules.reduction`; the CPU's `schedule.py`: vector accumulators, both cores when
large). Other axis sets reduce one contiguous group at a
time, in the accumulator type.

max/min propagate nan like numpy (`arith.maximumf`/`minimumf`); half types accumulate in f32 and
round once; an empty reduction gives the identity (the accumulator's initial value).
"""

from __future__ import annotations

import itertools
import math

from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, scalar_literal, tensor_type
from flowjit.backends.mlir.lower_elementwise import compute_elem, extend, map_elementwise, reshape_tensor
from flowjit.backends.mlir.target import LoweringTable
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op, Value
from flowjit.ir.ops.reduction import reduction_identity
from flowjit.ir.types import TensorType

# The reduction ops these lowerings serve (a target's own lowerings and recognitions take them from here).
REDUCE_OPS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")

# kind -> (float combiner, integer combiner)
COMBINE = {
    "sum": ("addf", "addi"),
    "prod": ("mulf", "muli"),
    "max": ("maximumf", "maxsi"),
    "min": ("minimumf", "minsi"),
}


def accumulator_dtype(dtype: dt.DType) -> dt.DType:
    """The dtype a reduction of `dtype` values combines in: half types in float32, as the reference."""
    return dt.float32 if dtype in (dt.float16, dt.bfloat16) else dtype


def normal_form(shape: tuple[int, ...], axes: list[int]) -> tuple[int, int, int]:
    """(A, R, B): the extents before, of and after the contiguous group of dimensions `axes`."""
    return math.prod(shape[: axes[0]]), math.prod(shape[axes[0] : axes[-1] + 1]), math.prod(shape[axes[-1] + 1 :])


def lower_reduce(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """reduce_sum/max/min/prod over `axes` (see the module docstring)."""
    (x,) = op.operands
    source, result = x.type, op.result.type
    axes = sorted(a % max(source.rank, 1) for a in op.attrs["axes"])
    if not axes:
        return [operands[0]]
    kind = op.name.removeprefix("reduce_")
    acc_dtype = accumulator_dtype(source.dtype)
    if source.size == 0:  # nothing to read: the identity, from one plain generic
        acc_type = TensorType(result.shape, acc_dtype)
        acc = reduce_generic(em, kind, operands[0], source, axes, acc_type)
    elif axes[-1] != source.rank - 1 and _as_views(em, source, axes, acc_dtype):
        acc, acc_type = _combine_views(em, kind, operands[0], source, axes, acc_dtype)
    elif len(contiguous_groups(axes)) > 1 and axes[-1] != source.rank - 1:
        acc, acc_type = _reduce_columns_at_once(em, kind, operands[0], source, axes, acc_dtype)
    else:
        # One contiguous group of axes at a time, the last first (earlier axes keep their numbers):
        # each step is a scheduled normal form, e.g. axes (0, 2) are a row then a column reduction.
        acc, acc_type = operands[0], source
        for group in reversed(contiguous_groups(axes)):
            acc, acc_type = _reduce_group(em, kind, acc, acc_type, group, acc_dtype)
    if acc_dtype != result.dtype:
        acc = map_elementwise(em, acc_type.with_dtype(result.dtype), [(acc, Value(acc_type))], lambda b, v: v[0])
    return [reshape_tensor(em, acc, acc_type.with_dtype(result.dtype), result)]


def contiguous_groups(axes: list[int]) -> list[list[int]]:
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
    a, r, b = normal_form(source.shape, group)
    in_shape = tuple(d for d, keep in ((a, a > 1), (r, True), (b, b > 1)) if keep)
    reduced = 1 if a > 1 else 0
    in_type = source.with_shape(in_shape)
    flat_acc = TensorType(tuple(d for i, d in enumerate(in_shape) if i != reduced), acc_dtype)
    acc = reduce_generic(em, kind, reshape_tensor(em, x, source, in_type), in_type, [reduced], flat_acc)
    if in_type.size >= 2:
        em.schedule(acc, em.target.schedules.reduction(in_shape, reduced, acc_dtype.bits, may_stay_plain=not em.loops))
    kept = TensorType(tuple(d for i, d in enumerate(source.shape) if i not in group), acc_dtype)
    return reshape_tensor(em, acc, flat_acc, kept), kept


# Column reductions over at most this many positions (the product of the reduced extents) combine
# that many strided views of x in one elementwise kernel (`_combine_views`).
VIEWS_MAX = 8


def _runs(source: TensorType, axes: list[int]) -> tuple[TensorType, list[int]]:
    """`source` with each run of reduced and of kept axes collapsed, and the reduced runs' positions."""
    runs: list[list] = []  # [extent, reduced]
    for i, d in enumerate(source.shape):
        if runs and runs[-1][1] == (i in axes):
            runs[-1][0] *= d
        else:
            runs.append([d, i in axes])
    return source.with_shape(tuple(d for d, _ in runs)), [i for i, (_, r) in enumerate(runs) if r]


def _as_views(em: KernelEmitter, source: TensorType, axes: list[int], acc_dtype) -> bool:
    """Whether the reduction (not over the last axis) is `_combine_views`' few views of whole vectors."""
    positions = math.prod(source.shape[a] for a in axes)
    width, vl = source.shape[-1], em.target.schedules.lanes(acc_dtype.bits)
    return 2 <= positions <= VIEWS_MAX and (width % vl == 0 or width >= 4 * vl) and source.size >= 2 * vl


def _combine_views(em: KernelEmitter, kind: str, x: str, source: TensorType, axes: list[int], acc_dtype):
    """A reduction over few positions, not over the last axis (`_as_views`): one elementwise kernel
    combining the strided views of x at each position, in order, with no accumulator to fill and
    read back. As a column reduction, summing a (256, 2, 2048) float32 over its middle axis would
    write the filled output, read it and write it again, twice the time."""
    collapsed, reduced = _runs(source, axes)
    x = reshape_tensor(em, x, source, collapsed)
    kept = TensorType(tuple(d for i, d in enumerate(collapsed.shape) if i not in reduced), source.dtype)
    elem = elem_type(source.dtype)
    views = []
    for position in itertools.product(*(range(collapsed.shape[i]) for i in reduced)):
        offsets, sizes, at = [], [], dict(zip(reduced, position))
        for i, d in enumerate(collapsed.shape):
            offsets.append(at.get(i, 0))
            sizes.append(1 if i in at else d)
        where = f"[{', '.join(map(str, offsets))}] [{', '.join(map(str, sizes))}] [{', '.join(['1'] * len(sizes))}]"
        views.append(em.op(f"tensor.extract_slice {x}{where} : {tensor_type(collapsed)} to {tensor_type(kept)}"))
    acc = kept.with_dtype(acc_dtype)
    e = compute_elem(acc_dtype)
    combine = COMBINE[kind][0 if acc_dtype.is_float else 1]

    def body(b, args):
        total = extend(b, args[0], source.dtype)
        for arg in args[1 : len(views)]:
            total = b.op(f"arith.{combine} {total}, {extend(b, arg, source.dtype)} : {e}")
        return total

    identity = em.identity_map(kept.rank)
    result = em.generic(
        [(v, tensor_type(kept)) for v in views],
        (em.empty(acc), tensor_type(acc)),
        [identity] * (len(views) + 1),
        ["parallel"] * kept.rank,
        body,
        [elem] * len(views),
        e,
    )
    if kept.rank == 1:
        em.schedule(result, em.target.schedules.elementwise(kept.size, acc_dtype.bits))
    else:
        schedules = em.target.schedules
        em.schedule(result, schedules.copy_nd(kept.shape, acc_dtype.bits, kept.size >= schedules.PARALLEL_MIN_ELEMENTS))
    shape = TensorType(tuple(d for i, d in enumerate(source.shape) if i not in axes), acc_dtype)
    return reshape_tensor(em, result, acc, shape), shape


def _reduce_columns_at_once(em: KernelEmitter, kind: str, x: str, source: TensorType, axes: list[int], acc_dtype):
    """Several groups of axes, not the last, in one kernel: runs of reduced and kept axes collapsed,
    (A, R1, B, R2, C) -> (A, B, C), each output vector summed over R1 and R2 (`schedule.reduction`
    with a tuple of axes). One group at a time, `x.reshape(n, h / 2, 2, w / 2, 2, c).mean((2, 4))`
    would take three kernels and two temporaries, several times as long."""
    in_type, reduced = _runs(source, axes)
    flat_acc = TensorType(tuple(d for i, d in enumerate(in_type.shape) if i not in reduced), acc_dtype)
    acc = reduce_generic(em, kind, reshape_tensor(em, x, source, in_type), in_type, reduced, flat_acc)
    em.schedule(acc, em.target.schedules.reduction(in_type.shape, tuple(reduced), acc_dtype.bits))
    kept = TensorType(tuple(d for i, d in enumerate(source.shape) if i not in axes), acc_dtype)
    return reshape_tensor(em, acc, flat_acc, kept), kept


def reduce_generic(
    em: KernelEmitter, kind: str, x: str, source: TensorType, reduced: list[int], acc: TensorType
) -> str:
    e = compute_elem(acc.dtype)
    identity = em.op(f"arith.constant {scalar_literal(reduction_identity(kind, acc.dtype), acc.dtype)} : {e}")
    init = em.op(f"linalg.fill ins({identity} : {e}) outs({em.empty(acc)} : {tensor_type(acc)}) -> {tensor_type(acc)}")
    dims = [f"d{i}" for i in range(source.rank)]
    in_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(dims)})")
    kept = [d for i, d in enumerate(dims) if i not in reduced]
    out_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(kept)})")
    combine = COMBINE[kind][0 if acc.dtype.is_float else 1]

    def body(b, args):
        value = extend(b, args[0], source.dtype)
        return b.op(f"arith.{combine} {value}, {args[1]} : {e}")

    iterators = ["reduction" if i in reduced else "parallel" for i in range(source.rank)]
    inputs = [(x, tensor_type(source))]
    return em.generic(
        inputs, (init, tensor_type(acc)), [in_map, out_map], iterators, body, [elem_type(source.dtype)], e
    )


def register(table: LoweringTable) -> None:
    """Add the reduction lowerings to `table`."""
    table.tensor.update(dict.fromkeys(REDUCE_OPS, lower_reduce))
