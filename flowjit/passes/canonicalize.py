"""`canonicalize`: constant folding, algebraic simplification (`RULES`), CSE and DCE.

Assumes a verified graph. Guarantees bit-identical results for every input: float rules hold in
IEEE arithmetic including nan, inf and the sign of zero (`x + -0.0 -> x` but not `x + 0.0`), and
rules that do not (`x*0 -> 0`, `x-x -> 0`) are applied to integers only. A reduction over the
stacked axis of a stack becomes its parts combined in order, as numpy sums them (not where it may
sum pairwise: 8 or more floats along its innermost axis), so that they fuse (`_reduce_rules`); so
does a reduction over an axis of at most 8 positions of pointwise ops whose leaves are each
constant along it or a broadcast of a value that has it (`_small_axis_rule`: an isin against a few
values, distances over 3 coordinates).
Constant folding runs the ops' reference implementations and stops at `FOLD_SIZE_LIMIT`
elements. Only pure ops (no effects, no regions) are folded or merged; DCE deletes them and region
ops whose bodies hold no effects when their results are unused. Effectful ops only see their
operands remapped. New ops keep the location and device of the op they replace, and the graph
stays topologically ordered. Regions are canonicalized recursively, each on its own (CSE never reaches across them).
"""

from __future__ import annotations

import numpy as np

from flowjit.ir import dtypes as dt
from flowjit.ir.builder import make_op, single_value
from flowjit.ir.dtypes import DType
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.interpreter import eval_op
from flowjit.ir.ops import CREATION, get_opdef
from flowjit.ir.ops.contraction import dot_dims
from flowjit.passes.registry import register

# Fold only small results, or elementwise ops that do not grow their operands: folding a broadcast
# of a scalar into a huge literal would trade a cheap op for a big constant in every compile.
FOLD_SIZE_LIMIT = 1024


def _splat(value: Value, rw: _Rewriter):
    """The scalar every element of `value` equals, if it is a constant splat; else None."""
    array = rw.constants.get(value)
    if array is None or array.size == 0:
        return None
    return array.reshape(-1)[0] if single_value(array) else None


def _is(value: Value, rw: _Rewriter, scalar) -> bool:
    s = _splat(value, rw)
    return s is not None and bool(s == scalar)


def _is_zero(value: Value, rw: _Rewriter, negative: bool) -> bool:
    """A splat zero; for floats it must also have the given sign (x + -0.0 is x, x + 0.0 is not)."""
    s = _splat(value, rw)
    if s is None or s != 0:
        return False
    return not value.type.dtype.is_float or bool(np.signbit(s)) == negative


def _zeros(op: Op, rw: _Rewriter) -> Value:
    """Zeros of `op`'s result type: a constant, or a broadcast scalar when a literal would be large."""
    ttype = op.result.type
    if ttype.size <= FOLD_SIZE_LIMIT:
        return rw.emit_like(op, "constant", [], {"value": np.zeros(ttype.shape, ttype.dtype.np_dtype)})
    scalar = rw.emit_like(op, "constant", [], {"value": np.zeros((), ttype.dtype.np_dtype)})
    return rw.emit_like(op, "broadcast", [scalar], {"shape": ttype.shape, "dims": ()})


# --- local rewrites: (op name) -> list of rules; a rule returns a replacement Value or None ----------
# Float rules are exact in IEEE arithmetic (nan, inf and the sign of zero included); rules that are
# not (x*0 -> 0, x-x -> 0) are applied to integers only.


def _add_rules(op, rw):
    x, y = op.operands
    if _is_zero(y, rw, negative=True):
        return x  # x + -0 -> x (x + +0.0 is +0.0 for x = -0.0, so floats need -0.0)
    if _is_zero(x, rw, negative=True):
        return y  # -0 + x -> x
    return None


def _sub_rules(op, rw):
    x, y = op.operands
    if _is_zero(y, rw, negative=False):
        return x  # x - +0 -> x (x - -0.0 is +0.0 for x = -0.0, so floats need +0.0)
    if x is y and op.result.type.dtype.is_int:
        return _zeros(op, rw)  # int: x - x -> 0 (float: inf - inf is nan)
    return None


def _mul_rules(op, rw):
    x, y = op.operands
    if _is(y, rw, 1):
        return x  # x * 1 -> x
    if _is(x, rw, 1):
        return y  # 1 * x -> x
    if op.result.type.dtype.is_int and _is(y, rw, 0):
        return y  # int: x * 0 -> 0 (float: inf * 0 is nan, -1 * 0 is -0)
    if op.result.type.dtype.is_int and _is(x, rw, 0):
        return x  # int: 0 * x -> 0
    return None


def _div_rules(op, rw):
    x, y = op.operands
    if _is(y, rw, 1):
        return x  # x / 1 -> x
    return None


def _pow_rules(op, rw):
    x, y = op.operands
    if _is(y, rw, 1):
        return x  # x ** 1 -> x
    return None


def _idempotent(op, rw):
    x, y = op.operands
    if x is y:
        return x  # max(x, x) -> x, min(x, x) -> x, and(x, x) -> x, or(x, x) -> x
    return None


def _involution(op, rw):
    (x,) = op.operands
    p = x.producer
    if p is not None and p.name == op.name:
        return p.operands[0]  # neg(neg(x)) -> x, not(not(x)) -> x
    return None


def _reshape_rules(op, rw):
    (x,) = op.operands
    if x.type == op.result.type:
        return x  # reshape(x, shape(x)) -> x
    p = x.producer
    if p is not None and p.name == "reshape":
        return rw.emit_like(op, "reshape", [p.operands[0]], op.attrs)  # reshape(reshape(x)) -> reshape(x)
    return None


def _transpose_rules(op, rw):
    (x,) = op.operands
    perm = op.attrs["perm"]
    if perm == tuple(range(len(perm))):
        return x  # transpose(x, identity) -> x
    p = x.producer
    if p is None or p.name != "transpose":
        return None
    composed = tuple(p.attrs["perm"][i] for i in perm)
    if composed == tuple(range(len(perm))):
        return p.operands[0]  # transpose(transpose(x, p), p^-1) -> x
    return rw.emit_like(
        op, "transpose", [p.operands[0]], {"perm": composed}
    )  # transpose(transpose(x, p), q) -> transpose(x, p∘q)


def _dot_general_rules(op, rw):
    """dot_general(transpose(x), transpose(y)) -> dot_general(x, y) with the dims renamed, for each
    transposed operand whose free dims keep their order (so do the result's): backends read it in
    place (`a @ b.T`, `a.T @ b` with no copy)."""
    operands, attrs = list(op.operands), dict(op.attrs)
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = dot_dims(op.attrs)
    for side, (value, contract, batch) in enumerate(
        zip(op.operands, (lhs_contract, rhs_contract), (lhs_batch, rhs_batch))
    ):
        p = value.producer
        if p is None or p.name != "transpose":
            continue
        perm = p.attrs["perm"]
        prefix = ("lhs_", "rhs_")[side]
        free = [perm[d] for d in range(len(perm)) if d not in contract and d not in batch]
        if free != sorted(free):
            continue
        attrs[prefix + "contract"] = tuple(perm[d] for d in contract)
        attrs[prefix + "batch"] = tuple(perm[d] for d in batch)
        operands[side] = p.operands[0]
    if operands == list(op.operands):
        return None
    return rw.emit_like(op, "dot_general", operands, attrs)


def _widens_exactly(src: DType, dst: DType) -> bool:
    """Every `src` value is exactly representable in `dst` (and conversions from it keep their value)."""
    if src.is_bool:
        return True
    if src.kind != dst.kind:
        return False
    if src.is_int:
        return dst.bits >= src.bits
    return dst.bits > src.bits or src is dst  # f16/bf16 -> f32 -> f64; f16 and bf16 do not nest


def _convert_rules(op, rw):
    (x,) = op.operands
    if x.type == op.result.type:
        return x  # convert(x: T, T) -> x
    p = x.producer
    if p is not None and p.name == "convert" and _widens_exactly(p.operands[0].type.dtype, x.type.dtype):
        return rw.emit_like(op, "convert", [p.operands[0]], op.attrs)  # convert(convert(x, wider), T) -> convert(x, T)
    return None


def _broadcast_rules(op, rw):
    (x,) = op.operands
    if x.type == op.result.type:
        return x  # broadcast(x, shape(x)) -> x
    p = x.producer
    if p is not None and p.name == "broadcast":
        dims = tuple(op.attrs["dims"][d] for d in p.attrs["dims"])
        attrs = {"shape": op.attrs["shape"], "dims": dims}
        return rw.emit_like(op, "broadcast", [p.operands[0]], attrs)  # broadcast(broadcast(x)) -> broadcast(x)
    return None


def _slice_rules(op, rw):
    (x,) = op.operands
    if x.type == op.result.type and all(s == 1 for s in op.attrs["stride"]):
        return x  # x[0:n:1, ...] -> x
    return None


def _select_rules(op, rw):
    pred, a, b = op.operands
    if a is b:
        return a  # select(p, x, x) -> x
    if _is(pred, rw, True):
        return a  # select(true, a, b) -> a
    if _is(pred, rw, False):
        return b  # select(false, a, b) -> b
    return None


def _pairwise(op: Op, x: Value, parts: int) -> bool:
    """Whether numpy's float sum of `parts` values along `op`'s axis of `x` (the reference) may add
    them pairwise, not in order: 8 or more along what is its innermost axis."""
    axis = op.attrs["axes"][0] % x.type.rank
    return op.name == "reduce_sum" and x.type.dtype.is_float and parts >= 8 and np.prod(x.type.shape[axis + 1 :]) == 1


# reduce over the stacked axis of a stack -> its parts combined in order, by this elementwise op
_STACK_COMBINE = {"reduce_sum": "add", "reduce_prod": "mul", "reduce_max": "max", "reduce_min": "min"}
STACK_REDUCE_MAX_PARTS = 64


def _reduce_rules(op, rw):
    (x,) = op.operands
    axes = op.attrs["axes"]
    if not axes:
        return x  # reduce(x, axes=[]) -> x
    p = x.producer
    if (
        p is not None
        and p.name == "concatenate"
        and len(axes) == 1
        and p.attrs["axis"] % x.type.rank == axes[0] % x.type.rank
        and all(v.type.shape[axes[0]] == 1 for v in p.operands)
        and len(p.operands) <= STACK_REDUCE_MAX_PARTS
        and x.type.dtype not in (dt.float16, dt.bfloat16)  # those reduce in f32, round once
        and not _pairwise(op, x, len(p.operands))
    ):
        # sum(stack(parts), axis) -> parts[0] + parts[1] + ..., in numpy's order: the parts fuse into
        # one kernel (taps of a convolution written as a stack) instead of a stored stack reduced.
        shape = {"shape": tuple(op.result.type.shape)}
        parts = [rw.emit_like(op, "reshape", [v], shape) for v in p.operands]
        total = parts[0]
        for part in parts[1:]:
            total = rw.emit_like(op, _STACK_COMBINE[op.name], [total, part], {})
        return total
    return _small_axis_rule(op, rw)


# A reduction over an axis of at most this many positions, of pointwise ops on values that are each
# constant along that axis or a broadcast whose source has it, becomes the ops repeated once per
# position and combined (`_small_axis_rule`); the ops (at most SMALL_AXIS_MAX_OPS) are repeated that
# often.
SMALL_AXIS_MAX_POSITIONS = 8
SMALL_AXIS_MAX_OPS = 24


def _small_axis_rule(op, rw):
    """reduce(f(broadcast(u), broadcast(w), ..), axis) over a short axis -> f at position 0
    combined with f at position 1, ..., each on its leaves' positions along the axis: a leaf
    broadcast along it is its source (`(a[:, :, None] == values).any(-1)`, an isin against 8 values,
    reads `a` once instead of reducing (1024, 1024, 8) booleans over rows of 8); one whose source has
    the axis takes that position of the source (a slice of the small table). In numpy's order, as
    the stack rule (not for sums numpy may add pairwise, nor half types); other leaves (stored
    values varying along the axis) leave the reduction as it is."""
    (x,) = op.operands
    axes = op.attrs["axes"]
    if len(axes) != 1:
        return None
    axis = axes[0] % x.type.rank
    k = x.type.shape[axis]
    if not 2 <= k <= SMALL_AXIS_MAX_POSITIONS or _pairwise(op, x, k):
        return None
    if op.name in ("reduce_sum", "reduce_prod") and x.type.dtype in (dt.float16, dt.bfloat16):
        return None
    ops, leaves = _pointwise_expression(x)
    if not ops or len(ops) > SMALL_AXIS_MAX_OPS or not all(map(_indexable, leaves)):
        return None
    total = None
    for position in range(k):
        values = {v: _leaf_at(v, axis, position, rw, op) for v in leaves}
        for inner in ops:
            values[inner.result] = rw.emit_like(op, inner.name, [values[v] for v in inner.operands], inner.attrs)
        part = values[x]
        total = part if total is None else rw.emit_like(op, _STACK_COMBINE[op.name], [total, part], {})
    return total


def _pointwise_expression(x: Value) -> tuple[list[Op], list[Value]]:
    """The elementwise ops computing `x` (in program order) and the values they read."""
    ops: list[Op] = []
    leaves: list[Value] = []
    seen: set[Value] = set()

    def walk(v: Value) -> None:
        if v in seen:
            return
        seen.add(v)
        p = v.producer
        if p is None or not get_opdef(p.name).elementwise or len(p.results) != 1 or len(seen) > 4 * SMALL_AXIS_MAX_OPS:
            leaves.append(v)
            return
        for u in p.operands:
            walk(u)
        ops.append(p)

    walk(x)
    return ops, leaves


def _indexable(v: Value) -> bool:
    """Whether `_leaf_at` can take `v` apart along any axis: a broadcast, or a small constant."""
    p = v.producer
    return p is not None and (p.name == "broadcast" or (p.name == "constant" and v.type.size <= FOLD_SIZE_LIMIT))


def _leaf_at(v: Value, axis: int, position: int, rw, op) -> Value:
    """`_indexable` leaf `v` at `position` along `axis`, with that axis dropped: a broadcast of its
    source (or of the source's position along the axis, when the source has it), or a constant's
    position."""
    p = v.producer
    shape = tuple(d for i, d in enumerate(v.type.shape) if i != axis)
    if p.name == "constant":
        return _position(v, axis, position, rw, op)
    (source,) = p.operands
    dims = list(p.attrs["dims"])
    if axis in dims:  # the source has the axis, of size 1 or of the reduced length
        j = dims.index(axis)
        source = _position(source, j, position if source.type.shape[j] != 1 else 0, rw, op)
    kept = tuple(d - (d > axis) for d in dims if d != axis)
    return rw.emit_like(op, "broadcast", [source], {"dims": kept, "shape": shape})


def _position(v: Value, axis: int, position: int, rw, op) -> Value:
    """v[.., position, ..] along `axis`, that axis dropped (a slice and a reshape)."""
    start, limit = [0] * v.type.rank, list(v.type.shape)
    start[axis], limit[axis] = position, position + 1
    if v.type.shape[axis] != 1:
        attrs = {"start": tuple(start), "limit": tuple(limit), "stride": (1,) * v.type.rank}
        v = rw.emit_like(op, "slice", [v], attrs)
    return rw.emit_like(op, "reshape", [v], {"shape": tuple(d for i, d in enumerate(v.type.shape) if i != axis)})


def _concatenate_rules(op, rw):
    if len(op.operands) == 1:
        return op.operands[0]  # concatenate(x) -> x
    return None


RULES = {
    "add": [_add_rules],
    "sub": [_sub_rules],
    "mul": [_mul_rules],
    "div": [_div_rules],
    "pow": [_pow_rules],
    "max": [_idempotent],
    "min": [_idempotent],
    "logical_and": [_idempotent],
    "logical_or": [_idempotent],
    "neg": [_involution],
    "logical_not": [_involution],
    "reshape": [_reshape_rules],
    "transpose": [_transpose_rules],
    "dot_general": [_dot_general_rules],
    "convert": [_convert_rules],
    "broadcast": [_broadcast_rules],
    "slice": [_slice_rules],
    "select": [_select_rules],
    "reduce_sum": [_reduce_rules],
    "reduce_max": [_reduce_rules],
    "reduce_min": [_reduce_rules],
    "reduce_prod": [_reduce_rules],
    "concatenate": [_concatenate_rules],
}


class _Rewriter:
    """State of one sweep: value replacements, known constants, and ops the rules create."""

    def __init__(self):
        self.replace: dict[Value, Value] = {}
        self.constants: dict[Value, np.ndarray] = {}
        self.pending: list[Op] = []

    def resolve(self, v: Value) -> Value:
        while v in self.replace:
            v = self.replace[v]
        return v

    def emit_like(self, op: Op, name: str, operands, attrs) -> Value:
        """A new op with `op`'s location and device, placed just before `op`."""
        new = make_op(name, operands, attrs, op.loc, device=op.device)
        self.pending.append(new)
        return new.result


def _attr_key(value):
    """Attributes are equal for CSE only when they print the same: 0.0 and -0.0, 1 and 1.0 and True differ."""
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.shape, value.tobytes()
    if isinstance(value, tuple):
        return tuple(_attr_key(v) for v in value)
    return type(value).__name__, repr(value)


def _cse_key(op: Op):
    attrs = tuple((k, _attr_key(v)) for k, v in sorted(op.attrs.items()))
    return op.name, tuple(id(v) for v in op.operands), attrs, op.device


def _pure(op: Op) -> bool:
    """Ops that may be merged, folded and deleted: no effects and no regions (which may hold effects)."""
    return not get_opdef(op.name).effectful and not op.regions


def _removable(op: Op) -> bool:
    """Ops DCE may delete when unused: pure ops, and region ops whose bodies hold no effects."""
    if get_opdef(op.name).effectful:
        return False
    return all(not get_opdef(inner.name).effectful for region in op.regions for inner in region.walk())


def _foldable(op: Op, rw: _Rewriter) -> bool:
    opdef = get_opdef(op.name)
    if not _pure(op) or opdef.family == CREATION or opdef.impl is None:
        return False
    if not all(v in rw.constants for v in op.operands):
        return False
    out_size = sum(r.type.size for r in op.results)
    biggest_in = max((v.type.size for v in op.operands), default=0)
    return out_size <= max(FOLD_SIZE_LIMIT, biggest_in if opdef.elementwise else 0)


def _fold(op: Op, rw: _Rewriter) -> list[Op]:
    """Constants holding `op`'s results, evaluated by the reference implementation."""
    with np.errstate(all="ignore"):  # log(0) = -inf is a value here, not a warning
        values = eval_op(op, [rw.constants[v] for v in op.operands], None)
    return [make_op("constant", [], {"value": np.asarray(v)}, op.loc, device=op.device) for v in values]


def _simplify(graph: Graph, rw: _Rewriter, cse: dict) -> None:
    new_ops: list[Op] = []

    def place(new: Op) -> Op:
        """Append `new`, or reuse an identical pure op already placed (CSE); returns the op kept."""
        if not _pure(new):
            new_ops.append(new)
            return new
        key = _cse_key(new)
        if key in cse:
            return cse[key]
        cse[key] = new
        new_ops.append(new)
        if new.name == "constant":
            rw.constants[new.result] = new.attrs["value"]
        return new

    for op in graph.ops:
        op.operands = [rw.resolve(v) for v in op.operands]
        for region in op.regions:
            # A fresh CSE scope: merging with an outer op would make the region read an enclosing
            # value, and regions are self-contained (outer values come in as operands).
            _simplify(region, rw, {})
        if _foldable(op, rw):
            for result, const in zip(op.results, _fold(op, rw)):
                rw.replace[result] = place(const).result
            continue
        replacement = None
        for rule in RULES.get(op.name, ()):
            replacement = rule(op, rw)
            if replacement is not None:
                break
        for new in rw.pending:
            new.operands = [rw.resolve(v) for v in new.operands]
            kept = place(new)
            if kept is not new:
                rw.replace[new.result] = kept.result
        rw.pending.clear()
        if replacement is not None:
            rw.replace[op.result] = rw.resolve(replacement)
            continue
        kept = place(op)
        for a, b in zip(op.results, kept.results):
            if a is not b:
                rw.replace[a] = b
    graph.ops = new_ops
    graph.results = [rw.resolve(v) for v in graph.results]


def _dce(graph: Graph, live: set) -> None:
    live.update(graph.results)
    kept: list[Op] = []
    for op in reversed(graph.ops):
        if _removable(op) and not any(r in live for r in op.results):
            continue
        kept.append(op)
        for region in op.regions:
            _dce(region, live)
        live.update(op.operands)
    graph.ops = kept[::-1]


@register("canonicalize")
def canonicalize(graph: Graph) -> Graph:
    """Fold constants, simplify algebra (`x*1`, `x + -0.0`, double transpose, reshape of reshape, ...),
    merge identical pure ops (CSE) and remove unused pure ops (DCE), repeated to a fixed point."""
    for _ in range(8):
        before = _fingerprint(graph)
        _simplify(graph, _Rewriter(), {})
        _dce(graph, set())
        if _fingerprint(graph) == before:
            break
    return graph


def _fingerprint(graph: Graph):
    return [(op.name, tuple(id(v) for v in op.operands)) for op in graph.walk()], [id(v) for v in graph.results]
