"""Structured control flow for traced code: `cond`, `while_loop`, `fori_loop`, `scan`.

Bodies are traced once into regions of a single op (compiled as real branches and loops, never
unrolled). Values a body uses from the enclosing function are captured and passed in as operands.
Outside any trace (plain numpy arguments) `cond` and the loops run the Python functions; `scan` is
traced and compiled once per graph (as `grad` is), so its stacked outputs have the compiled dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import TreeDef, leaf_paths, tree_flatten, tree_unflatten
from flowjit.frontend.trace import Trace, Tracer, array_library, bind, current_trace
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


def scan(f: Callable, init, xs=None, length: int | None = None, reverse: bool = False, unroll: int | bool = 1):
    """JAX's `lax.scan`: `carry, y = f(carry, x)` for each `x` along the leading axis of `xs`,
    returning `(final carry, ys)` with the `y`s stacked along a new leading axis.

    `init`, `xs` and the `y`s are pytrees; with `xs=None`, `f` gets `None` and `length` steps run.
    `reverse=True` visits `xs` from the last step to the first and writes `ys` in the same order
    (`ys[t]` is the step that read `xs[t]`). Compiled as one `for` op whose body reads `x_t` with
    a `gather` at the step and adds `y_t` into a carried (length, ...) buffer with a `scatter_add`
    (both in place, one row per step). `unroll` is accepted for JAX compatibility; the loop is
    never unrolled.
    """
    if not isinstance(unroll, bool) and not (isinstance(unroll, int) and unroll >= 1):
        raise FlowjitValueError(f"{user_location()}: scan's unroll must be a positive int or a bool; found {unroll!r}")
    if not _is_traced(init, xs):
        from flowjit.frontend.grad import _run_compiled  # grad.py holds the eager path of every transformation

        def traced_scan(init, xs):
            return scan(f, init, xs, length, reverse)

        traced_scan.__name__ = f"scan_{getattr(f, '__name__', 'f')}"
        return _run_compiled(traced_scan, (init, xs))
    trace = current_trace()
    xs_leaves, xs_tree = tree_flatten(xs)
    xs_leaves = [x if isinstance(x, Tracer) else Tracer(trace.lift(x), trace) for x in _as_operands(xs_leaves)]
    steps = _scan_length(xs, xs_leaves, length)
    init_leaves, carry_tree = tree_flatten(init)
    init_leaves = _as_operands(init_leaves)
    carry_types = [_aval(x) for x in init_leaves]
    body, y_types, y_tree, captured = _scan_body(f, carry_tree, carry_types, xs_leaves, xs_tree, steps, reverse)
    fnp = array_library()
    buffers = [fnp.zeros((steps, *t.shape), t.dtype.np_dtype) for t in y_types]
    bounds = [np.asarray(0, np.int64), np.asarray(steps, np.int64)]
    attrs = {"num_carry": len(carry_types) + len(y_types)}
    outs = _bind_region_op("for", [*bounds, *init_leaves, *buffers, *captured], attrs, [body])
    return tree_unflatten(carry_tree, outs[: len(carry_types)]), tree_unflatten(y_tree, outs[len(carry_types) :])


def _scan_length(xs, xs_leaves: list, length) -> int:
    """The number of steps: the common leading length of the `xs` leaves, or `length`."""
    if length is not None and (isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 0):
        raise FlowjitValueError(f"{user_location()}: scan's length must be a non-negative Python int; found {length!r}")
    if not xs_leaves:
        if length is None:
            raise FlowjitValueError(
                f"{user_location()}: scan needs the number of steps: pass length= when xs is None (or has no arrays)"
            )
        return int(length)
    paths = leaf_paths(xs, "xs")
    for path, x in zip(paths, xs_leaves):
        if x.ndim == 0:
            raise FlowjitValueError(
                f"{user_location()}: scan's {path} is a scalar; every leaf of xs needs a leading axis to scan over"
            )
    lengths = [x.shape[0] for x in xs_leaves]
    if any(n != lengths[0] for n in lengths):
        found = ", ".join(f"{path} of length {n}" for path, n in zip(paths, lengths))
        raise FlowjitValueError(f"{user_location()}: scan's xs must all have the same leading length; found {found}")
    if length is not None and int(length) != lengths[0]:
        raise FlowjitValueError(
            f"{user_location()}: scan's length={length} does not match the leading length {lengths[0]} of {paths[0]}"
        )
    return lengths[0]


def _row(x: Tracer, position: Tracer) -> Tracer:
    """x[position] for a 1-element index vector: one row, read in place."""
    return bind("reshape", [bind("gather", [x, position], {"axis": 0})], {"shape": x.shape[1:]})


def _scan_body(f: Callable, carry_tree, carry_types, xs_leaves, xs_tree, steps: int, reverse: bool):
    """The `for` body `(i, *carry, *ys_buffers, *captured) -> (*carry, *ys_buffers)`: reads row t of
    each xs leaf (t = i, or steps-1-i when reversed), calls `f`, adds y into row t of its buffer.
    Returns the region, the types and tree of y, and the outer tracers it captured."""
    with Trace("body") as trace:
        i = trace.new_param(TensorType((), dt.int64))
        carry = [trace.new_param(t) for t in carry_types]
        t = np.asarray(steps - 1, np.int64) - i if reverse else i
        position = bind("reshape", [t], {"shape": (1,)})
        x = [_row(leaf, position) if steps else array_library().zeros(leaf.shape[1:], leaf.dtype) for leaf in xs_leaves]
        out = f(tree_unflatten(carry_tree, carry), tree_unflatten(xs_tree, x))
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise FlowjitTypeError(
                f"{user_location()}: scan's f must return a pair (carry, y); found {type(out).__name__}"
                + (f" of length {len(out)}" if isinstance(out, tuple | list) else "")
            )
        new_carry, new_tree = tree_flatten(out[0])
        _check_same_tree(carry_tree, new_tree, "scan's f (its carry) and the initial carry")
        new_carry, y = _as_operands(new_carry), out[1]
        found = [_aval(c) for c in new_carry]
        if found != list(carry_types):
            raise FlowjitTypeError(
                f"{user_location()}: scan's f must keep the carry's types ({', '.join(str(t) for t in carry_types)}); "
                f"it returns ({', '.join(str(t) for t in found)}). Cast with .astype() to keep the dtype."
            )
        y_leaves, y_tree = tree_flatten(y)
        y_leaves = _as_operands(y_leaves)
        y_types = [_aval(v) for v in y_leaves]
        buffers = [trace.new_param(TensorType((steps, *v.shape), v.dtype), "ys") for v in y_types]
        rows = [bind("reshape", [v], {"shape": (1, *v.shape)}) for v in y_leaves]
        written = [bind("scatter_add", [b, position, r], {"axis": 0}) if steps else b for b, r in zip(buffers, rows)]
        trace.graph.results = [trace.lift(v) for v in [*new_carry, *written]]
    region = trace.graph
    captured_params = [param for _, param in trace.captures]
    region.params = [i.value, *(c.value for c in carry), *(b.value for b in buffers), *captured_params]
    for k, p in enumerate(region.params):
        p.index = k
    return region, y_types, y_tree, [outer for outer, _ in trace.captures]
