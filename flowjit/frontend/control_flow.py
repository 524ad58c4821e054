"""Structured control flow for traced code: `cond`, `while_loop`, `fori_loop`.

Bodies are traced once into regions of a single op (compiled as real branches and loops, never
unrolled). Values a body uses from the enclosing function are captured and passed in as operands.
Outside any trace (plain numpy arguments) they simply run the Python functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flowjit.errors import FlowjitTypeError
from flowjit.frontend.pytree import TreeDef, tree_flatten, tree_unflatten
from flowjit.frontend.trace import Trace, Tracer, array_library, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph, Value
from flowjit.ir.location import user_location
from flowjit.ir.types import TensorType


def _aval(x) -> TensorType:
    if isinstance(x, Tracer):
        return x.value.type
    return TensorType(np.shape(x), dt.dtype(np.asarray(x).dtype))


def _as_operands(leaves: list) -> list:
    """Leaves as tracers or arrays of flowjit dtypes, converted as `flowjit.numpy` converts them: a
    lone Python float is float32 (numpy would make it float64), a Python int int64, lists arrays."""
    fnp = array_library()
    return [x if isinstance(x, Tracer) else fnp.asarray(x) for x in leaves]


def _traced_region(fn: Callable, name: str, arg_types: Sequence[TensorType]):
    """Trace `fn(flat_params)` on fresh parameters of `arg_types` into a region graph. Returns the
    region, its output tree, and the outer tracers it captured (in the order of its extra params)."""
    with Trace(name) as trace:
        out = fn([trace.new_param(t) for t in arg_types])
        leaves, out_tree = tree_flatten(out)
        trace.graph.results = [trace.lift(leaf) for leaf in _as_operands(leaves)]
    return trace.graph, out_tree, [outer for outer, _ in trace.captures]


def _add_capture_params(region: Graph, num_explicit: int, captured: list, union: list) -> None:
    """Make `region`'s parameters: its explicit ones, then one per value in `union` (in order)."""
    explicit = region.params[:num_explicit]
    by_outer = {id(outer.value): param for outer, param in zip(captured, region.params[num_explicit:])}
    extra = []
    for outer in union:
        param = by_outer.get(id(outer.value))
        extra.append(param if param is not None else Value(outer.value.type, None, 0, "unused"))
    region.params = explicit + extra
    for i, p in enumerate(region.params):
        p.index = i


def _union(*lists):
    seen, out = set(), []
    for items in lists:
        for t in items:
            if id(t.value) not in seen:
                seen.add(id(t.value))
                out.append(t)
    return out


def _is_traced(*trees) -> bool:
    return current_trace() is not None or any(isinstance(x, Tracer) for x in tree_flatten(list(trees))[0])


def _check_same_tree(a: TreeDef, b: TreeDef, what: str) -> None:
    if a != b:
        raise FlowjitTypeError(f"{user_location()}: {what} must return the same structure; found {a} and {b}")


def cond(pred, true_fn: Callable, false_fn: Callable, *operands):
    """`true_fn(*operands)` if `pred` else `false_fn(*operands)`, as one op with two regions.

    `pred` is a bool (or number) scalar; both branches must return the same pytree of the same types.
    """
    if not _is_traced(pred, operands):
        return true_fn(*operands) if bool(np.asarray(pred)) else false_fn(*operands)
    fnp = array_library()
    pred = fnp.asarray(pred)
    if tuple(pred.shape) != ():
        raise FlowjitTypeError(f"{user_location()}: cond's predicate must be a scalar; found shape {pred.shape}")
    pred = fnp.astype(pred, dt.bool_) if fnp.asarray(pred).dtype != np.bool_ else pred
    leaves, in_tree = tree_flatten(list(operands))
    leaves = _as_operands(leaves)
    types = [_aval(x) for x in leaves]
    true_g, true_tree, true_caps = _traced_region(lambda p: true_fn(*tree_unflatten(in_tree, p)), "true", types)
    false_g, false_tree, false_caps = _traced_region(lambda p: false_fn(*tree_unflatten(in_tree, p)), "false", types)
    _check_same_tree(true_tree, false_tree, "both branches of fj.cond")
    if true_g.result_types != false_g.result_types:
        found = ", ".join(str(t) for t in true_g.result_types), ", ".join(str(t) for t in false_g.result_types)
        raise FlowjitTypeError(
            f"{user_location()}: both branches of fj.cond must return the same types; the true branch returns "
            f"({found[0]}), the false branch ({found[1]})"
        )
    union = _union(true_caps, false_caps)
    _add_capture_params(true_g, len(types), true_caps, union)
    _add_capture_params(false_g, len(types), false_caps, union)
    outs = _bind_region_op("cond", [pred, *leaves, *union], {}, [true_g, false_g])
    return tree_unflatten(true_tree, outs)


def _bind_region_op(name, operands, attrs, regions):
    from flowjit.ir.builder import make_op

    trace = current_trace()
    values = [trace.lift(x) for x in operands]
    op = make_op(name, values, attrs, user_location(), regions=regions, device=trace.device)
    trace.graph.append(op)
    return [Tracer(r, trace) for r in op.results]


def while_loop(cond_fn: Callable, body_fn: Callable, init_val):
    """`while cond_fn(val): val = body_fn(val)`, compiled as one loop op. `val` is a pytree whose
    structure and types the body must preserve. Not reverse-differentiable: use `fori_loop`."""
    if not _is_traced(init_val):
        val = init_val
        while bool(np.asarray(cond_fn(val))):
            val = body_fn(val)
        return val
    leaves, tree = tree_flatten(init_val)
    leaves = _as_operands(leaves)
    types = [_aval(x) for x in leaves]
    cond_g, cond_tree, cond_caps = _traced_region(lambda p: cond_fn(tree_unflatten(tree, p)), "cond", types)
    if cond_g.result_types != [TensorType((), dt.bool_)]:
        raise FlowjitTypeError(
            f"{user_location()}: while_loop's cond_fn must return a bool scalar; found "
            f"({', '.join(str(t) for t in cond_g.result_types)})"
        )
    body_g, body_tree, body_caps = _traced_region(lambda p: body_fn(tree_unflatten(tree, p)), "body", types)
    _check_carry(tree, types, body_tree, body_g, "while_loop's body_fn")
    union = _union(cond_caps, body_caps)
    _add_capture_params(cond_g, len(types), cond_caps, union)
    _add_capture_params(body_g, len(types), body_caps, union)
    outs = _bind_region_op("while", [*leaves, *union], {"num_carry": len(types)}, [cond_g, body_g])
    return tree_unflatten(tree, outs)


def _check_carry(tree, types, body_tree, body_g, what):
    _check_same_tree(tree, body_tree, f"{what} and the initial value")
    if body_g.result_types != list(types):
        raise FlowjitTypeError(
            f"{user_location()}: {what} must keep the carry's types ({', '.join(str(t) for t in types)}); "
            f"it returns ({', '.join(str(t) for t in body_g.result_types)}). Cast with .astype() to keep the dtype."
        )


def fori_loop(lower, upper, body_fn: Callable, init_val):
    """`for i in range(lower, upper): val = body_fn(i, val)`, compiled as one loop op."""
    for what, bound in (("lower", lower), ("upper", upper)):
        aval = _aval(_as_operands([bound])[0])
        if aval.dtype.np_dtype.kind not in "iub" or aval.shape != ():
            where = user_location()
            raise FlowjitTypeError(f"{where}: fori_loop's {what} bound must be an integer scalar; found {aval}")
    if not _is_traced(lower, upper, init_val):
        val = init_val
        for i in range(int(lower), int(upper)):
            val = body_fn(np.asarray(i, np.int64), val)
        return val
    fnp = array_library()
    index_dtype = dt.int64
    lo = fnp.astype(fnp.asarray(lower), index_dtype)
    hi = fnp.astype(fnp.asarray(upper), index_dtype)
    leaves, tree = tree_flatten(init_val)
    leaves = _as_operands(leaves)
    types = [_aval(x) for x in leaves]
    in_types = [TensorType((), index_dtype), *types]
    body_g, body_tree, caps = _traced_region(lambda p: body_fn(p[0], tree_unflatten(tree, p[1:])), "body", in_types)
    _check_carry(tree, types, body_tree, body_g, "fori_loop's body_fn")
    _add_capture_params(body_g, len(in_types), caps, caps)
    outs = _bind_region_op("for", [lo, hi, *leaves, *caps], {"num_carry": len(types)}, [body_g])
    return tree_unflatten(tree, outs)
