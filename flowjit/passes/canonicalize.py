"""`canonicalize`: constant folding, algebraic simplification, CSE and DCE.

Assumes a verified graph. Guarantees the same results for every input (float identities that
change nan/inf behaviour, like x*0 -> 0, are applied to integers only), never touches effectful
ops (state, send/recv) beyond remapping their operands, and keeps the graph topologically ordered.
Regions are canonicalized recursively; values from enclosing graphs stay visible inside them.
"""

from __future__ import annotations

import numpy as np

from flowjit.ir.builder import make_op
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.interpreter import eval_op
from flowjit.ir.ops import get_opdef
from flowjit.passes.registry import register

# Fold only small results, or elementwise ops that do not grow their operands: folding a broadcast
# of a scalar into a huge literal would trade a cheap op for a big constant in every compile.
FOLD_SIZE_LIMIT = 1024


def _splat(value: Value, constants: dict[Value, np.ndarray]):
    """The scalar every element of `value` equals, if it is a constant splat; else None."""
    array = constants.get(value)
    if array is None or array.size == 0:
        return None
    first = array.reshape(-1)[0]
    return first if np.all(array == first) else None


def _is(value: Value, constants, scalar) -> bool:
    s = _splat(value, constants)
    return s is not None and bool(s == scalar)


# --- local rewrites: (op name) -> list of rules; a rule returns a replacement Value or None ----------


def _identity_binary(op, c):
    x, y = op.operands
    if op.name == "add" and _is(y, c, 0):
        return x  # x + 0 -> x
    if op.name == "add" and _is(x, c, 0):
        return y  # 0 + x -> x
    if op.name == "sub" and _is(y, c, 0):
        return x  # x - 0 -> x
    if op.name == "mul" and _is(y, c, 1):
        return x  # x * 1 -> x
    if op.name == "mul" and _is(x, c, 1):
        return y  # 1 * x -> x
    if op.name == "div" and _is(y, c, 1):
        return x  # x / 1 -> x
    if op.name == "pow" and _is(y, c, 1):
        return x  # x ** 1 -> x
    return None


def _involution(op, c):
    (x,) = op.operands
    p = x.producer
    if p is not None and p.name == op.name:
        return p.operands[0]  # neg(neg(x)) -> x, not(not(x)) -> x
    return None


def _reshape_rules(op, c):
    (x,) = op.operands
    if x.type == op.result.type:
        return x  # reshape to own shape -> x
    p = x.producer
    if p is not None and p.name == "reshape":
        return _emit_like(
            op, "reshape", [p.operands[0]], {"shape": op.attrs["shape"]}
        )  # reshape(reshape(x)) -> reshape(x)
    return None


def _transpose_rules(op, c):
    (x,) = op.operands
    perm = op.attrs["perm"]
    if perm == tuple(range(len(perm))):
        return x  # transpose(x, identity) -> x
    p = x.producer
    if p is not None and p.name == "transpose":
        inner = p.attrs["perm"]
        composed = tuple(inner[i] for i in perm)
        if composed == tuple(range(len(perm))):
            return p.operands[0]  # transpose(transpose(x, p), p^-1) -> x
        return _emit_like(op, "transpose", [p.operands[0]], {"perm": composed})  # two transposes -> one
    return None


def _convert_rules(op, c):
    (x,) = op.operands
    if x.type == op.result.type:
        return x  # convert to own dtype -> x
    return None


def _broadcast_rules(op, c):
    (x,) = op.operands
    if x.type == op.result.type:
        return x  # broadcast to own shape -> x
    p = x.producer
    if p is not None and p.name == "broadcast":
        dims = tuple(op.attrs["dims"][d] for d in p.attrs["dims"])
        return _emit_like(op, "broadcast", [p.operands[0]], {"shape": op.attrs["shape"], "dims": dims})
    return None


def _slice_rules(op, c):
    (x,) = op.operands
    if x.type == op.result.type and all(s == 1 for s in op.attrs["stride"]):
        return x  # full slice -> x
    return None


def _int_zero_product(op, c):
    x, y = op.operands
    if op.result.type.dtype.is_int and (_is(x, c, 0) or _is(y, c, 0)):
        return _emit_like(op, "constant", [], {"value": np.zeros(op.result.type.shape, op.result.type.dtype.np_dtype)})
    return None  # int: x * 0 -> 0 (not for floats: inf * 0 is nan)


def _select_rules(op, c):
    pred, a, b = op.operands
    if a is b:
        return a  # select(p, x, x) -> x
    if _is(pred, c, True):
        return a  # select(true, a, b) -> a
    if _is(pred, c, False):
        return b  # select(false, a, b) -> b
    return None


RULES = {
    "add": [_identity_binary],
    "sub": [_identity_binary],
    "div": [_identity_binary],
    "pow": [_identity_binary],
    "mul": [_identity_binary, _int_zero_product],
    "neg": [_involution],
    "logical_not": [_involution],
    "reshape": [_reshape_rules],
    "transpose": [_transpose_rules],
    "convert": [_convert_rules],
    "broadcast": [_broadcast_rules],
    "slice": [_slice_rules],
    "select": [_select_rules],
}


class _Rewriter:
    def __init__(self):
        self.replace: dict[Value, Value] = {}
        self.constants: dict[Value, np.ndarray] = {}
        self.pending: list[Op] = []

    def resolve(self, v: Value) -> Value:
        while v in self.replace:
            v = self.replace[v]
        return v


_current: list[_Rewriter] = []


def _emit_like(op: Op, name: str, operands, attrs) -> Value:
    """A new op with `op`'s location and device, queued before `op`'s position."""
    new = make_op(name, operands, attrs, op.loc, device=op.device)
    _current[-1].pending.append(new)
    return new.result


def _cse_key(op: Op):
    attrs = tuple(
        (k, (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v)
        for k, v in sorted(op.attrs.items())
    )
    return op.name, tuple(id(v) for v in op.operands), attrs, op.device


def _pure(op: Op) -> bool:
    return not get_opdef(op.name).effectful and not op.regions


def _foldable(op: Op, rw: _Rewriter) -> bool:
    if not _pure(op) or op.name == "constant" or not all(v in rw.constants for v in op.operands):
        return False
    out_size = sum(r.type.size for r in op.results)
    biggest_in = max((v.type.size for v in op.operands), default=0)
    return out_size <= max(FOLD_SIZE_LIMIT, biggest_in if get_opdef(op.name).elementwise else 0)


def _simplify(graph: Graph, rw: _Rewriter, cse: dict) -> None:
    new_ops: list[Op] = []
    for op in graph.ops:
        op.operands = [rw.resolve(v) for v in op.operands]
        for region in op.regions:
            _simplify(region, rw, dict(cse))
        if op.name == "constant":
            rw.constants[op.result] = op.attrs["value"]
        if _foldable(op, rw):
            values = eval_op(op, [rw.constants[v] for v in op.operands], None)
            for r, v in zip(op.results, values):
                const = make_op("constant", [], {"value": np.asarray(v)}, op.loc, device=op.device)
                new_ops.append(const)
                rw.constants[const.result] = const.attrs["value"]
                rw.replace[r] = const.result
            continue
        replacement = None
        for rule in RULES.get(op.name, ()):
            replacement = rule(op, rw.constants)
            if replacement is not None:
                break
        if rw.pending:
            for p in rw.pending:
                p.operands = [rw.resolve(v) for v in p.operands]
                key = _cse_key(p)
                if key in cse:
                    rw.replace[p.result] = cse[key].result
                else:
                    cse[key] = p
                    new_ops.append(p)
            rw.pending.clear()
        if replacement is not None:
            rw.replace[op.result] = rw.resolve(replacement)
            continue
        if _pure(op):
            key = _cse_key(op)
            if key in cse:
                for a, b in zip(op.results, cse[key].results):
                    rw.replace[a] = b
                continue
            cse[key] = op
        new_ops.append(op)
    graph.ops = new_ops
    graph.results = [rw.resolve(v) for v in graph.results]


def _dce(graph: Graph, live: set) -> None:
    live.update(graph.results)
    kept: list[Op] = []
    for op in reversed(graph.ops):
        if _pure(op) and not any(r in live for r in op.results):
            continue
        kept.append(op)
        for region in op.regions:
            _dce(region, live)
        live.update(op.operands)
    graph.ops = kept[::-1]


@register("canonicalize")
def canonicalize(graph: Graph) -> Graph:
    """Fold constants, simplify algebra (`x*1`, `x+0`, double transpose, reshape of reshape, ...),
    merge identical pure ops (CSE) and remove unused pure ops (DCE), to a fixed point."""
    for _ in range(8):
        before = _fingerprint(graph)
        rw = _Rewriter()
        _current.append(rw)
        try:
            _simplify(graph, rw, {})
        finally:
            _current.pop()
        _dce(graph, set())
        if _fingerprint(graph) == before:
            break
    return graph


def _fingerprint(graph: Graph):
    return [(op.name, tuple(id(v) for v in op.operands)) for op in graph.walk()], [id(v) for v in graph.results]
