"""Differentiation for users: `grad`, `value_and_grad`, `vjp`, `stop_gradient` (user-defined rules,
`custom_vjp` and `custom_jvp`, are in `custom_derivatives.py`).

    loss_grad = fj.grad(loss, argnums=0)          # d loss / d params, same pytree as params
    (loss, aux), g = fj.value_and_grad(loss, has_aux=True)(params, batch)
    out, vjp_fn = fj.vjp(f, x, y); gx, gy = vjp_fn(ct)

Each call traces the function into a fresh graph (a `GradTrace`), runs the autodiff pass
(`flowjit.passes.autodiff.vjp_graph`) on it, and inlines the resulting gradient graph into the
caller's trace, so under `fj.jit` the gradient is part of the compiled program and nested `grad`
differentiates ordinary ops. Outside any trace, the same steps run inside a fresh trace whose graph is
optimized and compiled for the default target; compiled graphs are cached by their text, so a
training loop that calls `grad(f)(params, batch)` eagerly compiles once.

Arguments: the leaves of the differentiated arguments (`argnums`) must be float arrays or Python
floats. The other arguments are passed through: their arrays become inputs of the compiled graph,
Python scalars and other objects stay Python values (use them for configuration).
"""

from __future__ import annotations

import collections
import functools
import inspect
import re
import threading
from collections.abc import Callable, Sequence

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.autodiff import GradTrace, VJPSpec, emit_traced, under_differentiation, vjp_graph
from flowjit.frontend.pytree import TreeDef, leaf_paths, tree_flatten, tree_map, tree_unflatten
from flowjit.frontend.trace import Trace, Tracer, array_library, bind, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import make_op
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.location import UNKNOWN, user_location
from flowjit.ir.printer import print_graph
from flowjit.ir.types import TensorType

# --- inlining a graph into the caller ------------------------------------------------------------------

# Marker ops that only matter to a later autodiff pass: outside a differentiated trace they are
# identities and are not emitted, so compiled graphs do not contain them.
_MARKERS = ("stop_gradient", "custom_vjp_call")


def inline_graph(graph: Graph, inputs: Sequence) -> list:
    """Emit `graph`'s ops into the current trace with `inputs` (tracers or arrays) for its
    parameters; returns the tracers of its results."""
    trace = current_trace()
    keep_markers = under_differentiation()
    env = {p: x if isinstance(x, Tracer) else _constant(trace, x, p.type) for p, x in zip(graph.params, inputs)}
    for op in graph.ops:
        if op.name in _MARKERS and not keep_markers:
            env.update(zip(op.results, [env[v] for v in _marker_passes(op)]))
            continue
        regions = op.regions if keep_markers else [_without_markers(r) for r in op.regions]
        operands = [env[v] for v in op.operands]
        env.update(zip(op.results, emit_traced(trace, op.name, operands, op.attrs, op.loc, regions, op.device)))
    return [env[r] for r in graph.results]


def _constant(trace: Trace, x, ttype: TensorType) -> Tracer:
    """A literal input as one constant op. Its location is unknown on purpose: it comes from the
    caller's line, which must not make otherwise equal graphs differ (the compile cache is keyed by text)."""
    value = np.asarray(x, ttype.dtype.np_dtype)
    return emit_traced(trace, "constant", [], {"value": value}, UNKNOWN)[0]


def _marker_passes(op: Op) -> list[Value]:
    """The operands a marker op passes through as its results."""
    return op.operands[len(op.operands) - len(op.results) :]


def _without_markers(region: Graph) -> Graph:
    """A copy of `region` with marker ops replaced by the values they pass through (the original may
    still be differentiated later, so it is left alone)."""
    env: dict[Value, Value] = {}
    out = Graph(region.name, region.params)
    for op in region.ops:
        if op.name in _MARKERS:
            env.update(zip(op.results, [env.get(v, v) for v in _marker_passes(op)]))
            continue
        regions = [_without_markers(r) for r in op.regions]
        operands = [env.get(v, v) for v in op.operands]
        new = out.append(make_op(op.name, operands, op.attrs, op.loc, regions, op.device, [r.type for r in op.results]))
        env.update(zip(op.results, new.results))
    out.results = [env.get(v, v) for v in region.results]
    return out


# --- running outside any trace: trace, compile once per graph text, run -------------------------------

# (traced graph text, output structure, target) -> Compiled, least recently used first. Bounded: a
# closure over a changing Python value gives a new graph (and a compile) on every call.
_compiled: collections.OrderedDict[tuple[str, str, str], object] = collections.OrderedDict()
_COMPILED_LIMIT = 64
_compiled_lock = threading.Lock()


def _graph_name(fun) -> str:
    """The function's name as the text IR can print and parse it back (`<lambda>` -> `lambda`)."""
    name = getattr(fun, "__name__", None) or type(fun).__name__
    return re.sub(r"[^A-Za-z0-9_.$]", "_", name.strip("<>")) or "function"


def _is_array_leaf(leaf) -> bool:
    return isinstance(leaf, np.ndarray | np.generic)


def _leaf_type(leaf) -> TensorType:
    if isinstance(leaf, Tracer):
        return leaf.value.type
    if isinstance(leaf, float):
        return TensorType((), dt.float32)
    array = np.asarray(leaf)
    return TensorType(array.shape, dt.dtype(array.dtype))


def _needs_eager_run(tree) -> bool:
    return current_trace() is None and not any(isinstance(x, Tracer) for x in tree_flatten(tree)[0])


def _run_compiled(traced_fn: Callable, args: tuple):
    """Run `traced_fn(*args)` (which needs a trace) through `fj.jit` with the array leaves of `args`
    as the dynamic arguments. It is traced on every call (closures and Python values may have
    changed) but compiled once per traced graph."""
    from flowjit.frontend.jit import jit

    leaves, tree = tree_flatten(list(args))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array_leaf(leaf)]

    def with_arrays(*arrays):
        filled = list(leaves)
        for i, array in zip(dynamic, arrays):
            filled[i] = array
        return traced_fn(*tree_unflatten(tree, filled))

    with_arrays.__name__ = _graph_name(traced_fn)
    arrays = [leaves[i] for i in dynamic]
    lowered = jit(with_arrays).lower(*arrays)
    key = (print_graph(lowered.graph("traced")), str(lowered.out_tree), lowered.target)
    with _compiled_lock:
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = _compiled[key] = lowered.compile()
            if len(_compiled) > _COMPILED_LIMIT:
                _compiled.popitem(last=False)
        _compiled.move_to_end(key)
    return compiled.call_leaves(arrays)


# --- tracing the function to differentiate ---------------------------------------------------------------


def _argument_names(fun: Callable, count: int) -> list[str]:
    """Names of the first `count` positional parameters of `fun` (`args[i]` where unknown)."""
    try:
        params = [
            p
            for p in inspect.signature(fun).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i].name if i < len(params) else f"args[{i}]" for i in range(count)]


def _check_float_leaves(fun: Callable, args: tuple, argnums: tuple[int, ...], how: str) -> None:
    """Every leaf of the differentiated arguments must be a float array or a Python float."""
    names = _argument_names(fun, len(args))
    for i in argnums:
        leaves = tree_flatten(args[i])[0]
        for leaf, path in zip(leaves, leaf_paths(args[i], names[i])):
            if isinstance(leaf, Tracer | np.ndarray | np.generic | float) and not isinstance(leaf, bool):
                dtype = _leaf_type(leaf).dtype
                if dtype.is_float:
                    continue
                found = f"of dtype {dtype}"
            else:
                found = f"a Python {type(leaf).__name__}"
            raise FlowjitTypeError(
                f"{user_location()}: {how} {_graph_name(fun)} with respect to argument {path}, which is {found}; "
                "only float arrays have gradients. Convert it with .astype(float32), or pass it as an argument not "
                "in argnums (or close over it) if it should not be differentiated"
            )


def _trace_for_vjp(fun: Callable, args: tuple, kwargs: dict, argnums: tuple[int, ...]):
    """Trace `fun` with the leaves of `args[argnums]` as the graph's first parameters. Returns the
    graph, the output tree, the differentiated leaves and the outer values the graph captured."""
    diff_leaves, diff_tree = tree_flatten([args[i] for i in argnums])
    with GradTrace(_graph_name(fun)) as trace:
        params = [trace.new_param(_leaf_type(leaf), f"arg{k}") for k, leaf in enumerate(diff_leaves)]
        call_args = list(args)
        for i, sub in zip(argnums, tree_unflatten(diff_tree, params)):
            call_args[i] = sub
        out_tree = set_results(
            trace,
            fun(*call_args, **kwargs),
            lambda i, leaf: (
                f"{getattr(fun, '__name__', 'the function')} returned a {type(leaf).__name__} "
                f"(output leaf {i}); differentiated functions must return arrays"
            ),
        )
    return trace.graph, out_tree, diff_leaves, [outer for outer, _ in trace.captures]


def set_results(trace: Trace, out, refusal: Callable) -> TreeDef:
    """Make the leaves of `out` the results of `trace`'s graph (numpy arrays and Python scalars
    become constants, converted as `fj.jit` converts a returned value: a Python float is float32);
    returns the output's tree. A leaf that is not an array is a
    `FlowjitTypeError` with the message `refusal(leaf index, leaf)`."""
    out_leaves, out_tree = tree_flatten(out)
    results = []
    for i, leaf in enumerate(out_leaves):
        if not isinstance(leaf, Tracer | np.ndarray | np.generic | bool | int | float):
            raise FlowjitTypeError(f"{user_location()}: {refusal(i, leaf)}")
        results.append(trace.lift(leaf if isinstance(leaf, Tracer) else array_library().asarray(leaf)))
    trace.graph.results = results
    return out_tree


def _normalize_argnums(argnums, num_args: int, fn_name: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums:
        raise FlowjitValueError(f"{user_location()}: argnums of grad({fn_name}) is empty")
    out = []
    for i in nums:
        if not -num_args <= i < num_args:
            raise FlowjitValueError(
                f"{user_location()}: argnums {i} is out of range: {fn_name} was called with {num_args} positional "
                "argument(s); keyword arguments are never differentiated"
            )
        out.append(i % num_args)
    return tuple(out)


# --- public API ---------------------------------------------------------------------------------------------


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """A function returning `(fun(*args), gradient)`: the gradient of the scalar float output with
    respect to `args[argnums]`, with the same pytree structure (a tuple of them when `argnums` is a
    tuple). With `has_aux`, `fun` returns `(loss, aux)` and the value is `(loss, aux)`."""
    name = _graph_name(fun)

    @functools.wraps(fun)
    def value_and_grad_fn(*args, **kwargs):
        if _needs_eager_run((args, kwargs)):
            return _run_compiled(functools.partial(value_and_grad_fn, **kwargs), args)
        nums = _normalize_argnums(argnums, len(args), name)
        _check_float_leaves(fun, args, nums, "cannot differentiate")
        graph, out_tree, diff_leaves, captured = _trace_for_vjp(fun, args, kwargs, nums)
        loss_index = _check_loss(graph, out_tree, has_aux, name)
        spec = VJPSpec(wrt=tuple(range(len(diff_leaves))), seeds=(loss_index,))
        seed = np.ones((), graph.results[loss_index].type.dtype.np_dtype)
        outs = inline_graph(vjp_graph(graph, spec), [*diff_leaves, *captured, seed])
        value = tree_unflatten(out_tree, outs[: len(graph.results)])
        grads = tree_unflatten(tree_flatten([args[i] for i in nums])[1], outs[len(graph.results) :])
        return value, (grads[0] if isinstance(argnums, int) else tuple(grads))

    return value_and_grad_fn


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """A function returning the gradient of `fun`'s scalar float output with respect to
    `args[argnums]` (see `value_and_grad`); with `has_aux` it returns `(gradient, aux)`."""
    value_and_grad_fn = value_and_grad(fun, argnums, has_aux)

    @functools.wraps(fun)
    def grad_fn(*args, **kwargs):
        value, grads = value_and_grad_fn(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return grad_fn


def _check_loss(graph: Graph, out_tree, has_aux: bool, name: str) -> int:
    """The index of the loss among the graph's results, after checking it is a float scalar."""
    if has_aux and not (out_tree.kind in ("tuple", "list") and len(out_tree.children) == 2):
        raise FlowjitTypeError(
            f"{user_location()}: with has_aux=True, {name} must return a pair (loss, aux); found a result of "
            f"structure {out_tree}"
        )
    loss_tree = out_tree.children[0] if has_aux else out_tree
    if loss_tree.kind != "leaf":
        raise FlowjitTypeError(
            f"{user_location()}: grad needs {name} to return one scalar; found a result of structure {loss_tree}"
            + ("" if has_aux else ". If it returns (loss, aux), pass has_aux=True")
        )
    loss = graph.results[0]
    if loss.type.shape != () or not loss.type.dtype.is_float:
        raise FlowjitTypeError(
            f"{user_location()}: grad needs {name} to return a float scalar; found {loss.type}. Reduce it "
            "(e.g. .sum() or .mean()), or use fj.vjp for the gradient of a non-scalar output"
        )
    return 0


def vjp(fun: Callable, *primals):
    """`(fun(*primals), vjp_fn)`: `vjp_fn(cotangent)` (a pytree like the output) returns one
    cotangent per primal, each with the primal's structure. Every primal leaf must be a float."""
    name = _graph_name(fun)
    _check_float_leaves(fun, primals, tuple(range(len(primals))), "cannot take the vjp of")
    if _needs_eager_run(primals):
        out = _run_compiled(fun, primals)

        def eager_vjp_fn(cotangent):
            if not _needs_eager_run(cotangent):  # under fj.jit (or grad): trace it into the caller's graph
                return vjp(fun, *primals)[1](cotangent)
            return _run_compiled(lambda p, c: vjp(fun, *p)[1](c), (primals, cotangent))

        return out, eager_vjp_fn
    graph, out_tree, diff_leaves, captured = _trace_for_vjp(fun, primals, {}, tuple(range(len(primals))))
    out = tree_unflatten(out_tree, inline_graph(graph, [*diff_leaves, *captured]))
    spec = VJPSpec(wrt=tuple(range(len(diff_leaves))), primal_outputs=False)
    seeds = [i for i, r in enumerate(graph.results) if r.type.dtype.is_float]
    primal_tree = tree_flatten(list(primals))[1]

    def vjp_fn(cotangent):
        ct_leaves, ct_tree = tree_flatten(cotangent)
        if ct_tree != out_tree:
            raise FlowjitTypeError(
                f"{user_location()}: the cotangent must have the structure of {name}'s output {out_tree}; "
                f"found {ct_tree}"
            )
        for i in seeds:
            expected, found = graph.results[i].type, _leaf_type(array_library().asarray(ct_leaves[i]))
            if expected != found:
                raise FlowjitTypeError(f"{user_location()}: cotangent leaf {i} must be {expected}; found {found}")
        grads = inline_graph(vjp_graph(graph, spec), [*diff_leaves, *captured, *(ct_leaves[i] for i in seeds)])
        return tuple(tree_unflatten(primal_tree, grads))

    return out, vjp_fn


def stop_gradient(x):
    """`x` unchanged, but differentiation treats it as a constant (works on pytrees)."""
    if not under_differentiation():
        return x

    def stop(leaf):
        if isinstance(leaf, Tracer) and leaf.value.type.dtype.is_float:
            return bind("stop_gradient", [leaf])
        return leaf

    return tree_map(stop, x)
