"""`vmap`: vectorizing a function over a batch axis, as JAX's `jax.vmap`.

    fj.vmap(f)(xs)                                   # f applied to each xs[i], stacked
    fj.vmap(fj.grad(loss), in_axes=(None, 0, 0))(params, xs, ys)   # per-example gradients
    fj.vmap(f, in_axes=1, out_axes=1)(x)             # map over columns

`f` is traced once on one example (the mapped axis removed from every batched argument) and the
graph is rewritten for the batch by `flowjit.frontend.batching` (one rule per op), then inlined
into the caller's trace: under `fj.jit` a vmapped function is part of one compiled program, and it
composes with `grad`, `jvp`, control flow and itself. Outside any trace the batched program is
compiled once per graph and run, as `grad` is.

`in_axes` is an int, None (the argument is the same for every example), or a tuple with one entry
per positional argument, each an int, None or a pytree prefix of that argument; keyword arguments
are mapped over axis 0. `out_axes` is the same for the output. `axis_size` gives the batch size
when no argument is mapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.batching import batch_into
from flowjit.frontend.grad import _graph_name, _needs_eager_run, _run_compiled, set_results
from flowjit.frontend.pytree import TreeDef, leaf_paths, tree_flatten, tree_unflatten
from flowjit.frontend.trace import Trace, Tracer, array_library, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.ir.types import TensorType


def vmap(fun: Callable, in_axes=0, out_axes=0, axis_size: int | None = None) -> Callable:
    """`fun` mapped over an axis of its arguments (see the module doc)."""
    if not callable(fun):
        raise FlowjitTypeError(f"{user_location()}: vmap needs a function; found {type(fun).__name__}")
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    name = _graph_name(fun)

    @functools.wraps(fun)
    def vmapped(*args, **kwargs):
        if _needs_eager_run((args, kwargs)):
            return _run_compiled(lambda a, k: vmapped(*a, **k), (args, kwargs))
        return _vmap_traced(fun, name, in_axes, out_axes, axis_size, args, kwargs)

    return vmapped


def _vmap_traced(fun, name, in_axes, out_axes, axis_size, args, kwargs):
    fnp = array_library()
    if isinstance(in_axes, tuple) and len(in_axes) != len(args):
        raise FlowjitValueError(
            f"{user_location()}: vmap({name}): in_axes has {len(in_axes)} entries but {name} was called with "
            f"{len(args)} positional argument(s); give one entry per argument (an int, None or a pytree)"
        )
    leaves, tree = tree_flatten((args, kwargs))
    arg_axes = _prefix_axes(in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args), args, name, "in_axes")
    axes = arg_axes + [0] * (len(leaves) - len(arg_axes))
    paths = leaf_paths((args, kwargs))
    size = _batch_size(leaves, axes, paths, axis_size, name)
    trace = current_trace()
    inputs, mapped = [], []  # the batched arguments, batch axis first, in the caller's trace
    for k, (leaf, axis) in enumerate(zip(leaves, axes)):
        if axis is None:
            continue
        x = leaf if isinstance(leaf, Tracer) else fnp.asarray(leaf)
        rank = len(x.shape)
        x = fnp.moveaxis(x, axis % rank, 0) if axis % rank else x
        inputs.append(x if isinstance(x, Tracer) else Tracer(trace.lift(x), trace))
        mapped.append(k)
    call_leaves = list(leaves)
    with Trace(name) as inner:
        for k, x in zip(mapped, inputs):
            call_leaves[k] = inner.new_param(TensorType(tuple(x.shape[1:]), dt.dtype(x.dtype)), f"arg{k}")
        call_args, call_kwargs = tree_unflatten(tree, call_leaves)
        out = fun(*call_args, **call_kwargs)
        out_tree = set_results(
            inner,
            out,
            lambda i, leaf: (
                f"vmap({name}): output leaf {i} is a {type(leaf).__name__}; a vmapped function must "
                "return arrays (or pytrees of them)"
            ),
        )
    captured = [outer for outer, _ in inner.captures]
    outs, out_flags = batch_into(
        inner.graph, [*inputs, *captured], [True] * len(inputs) + [False] * len(captured), size
    )
    out_axes_flat = _prefix_axes(out_axes, out, name, "out_axes")
    final = []
    for i, (x, batched, axis) in enumerate(zip(outs, out_flags, out_axes_flat)):
        if axis is None:
            if batched:
                raise FlowjitValueError(
                    f"{user_location()}: vmap({name}): out_axes is None for output {leaf_paths(out, 'out')[i]}, "
                    "but that output differs per example; give it an axis, or make it independent of the "
                    "mapped arguments"
                )
            final.append(x)
            continue
        if not batched:
            x = fnp.broadcast_to(x, (size,) + tuple(x.shape))
        rank = len(x.shape)
        if not -rank <= axis < rank:
            raise FlowjitValueError(
                f"{user_location()}: vmap({name}): out_axes {axis} is out of range for output "
                f"{leaf_paths(out, 'out')[i]} of rank {rank} (with the mapped axis)"
            )
        final.append(fnp.moveaxis(x, 0, axis % rank) if axis % rank else x)
    return tree_unflatten(out_tree, final)


def _batch_size(leaves, axes, paths, axis_size, name) -> int:
    sizes = {}
    for leaf, axis, path in zip(leaves, axes, paths):
        if axis is None:
            continue
        shape = tuple(np.shape(leaf)) if not isinstance(leaf, Tracer) else leaf.shape
        if not isinstance(leaf, Tracer | np.ndarray | np.generic | bool | int | float):
            raise FlowjitTypeError(
                f"{user_location()}: vmap({name}): argument {path} is a {type(leaf).__name__}, which cannot be "
                "mapped over; give it in_axes None"
            )
        if not -len(shape) <= axis < len(shape) or not shape:
            raise FlowjitValueError(
                f"{user_location()}: vmap({name}) maps argument {path} over axis {axis}, but it has shape {shape}"
                + (" (a scalar: give it in_axes None)" if not shape else "")
            )
        sizes.setdefault(shape[axis % len(shape)], []).append(path)
    if len(sizes) > 1:
        found = "; ".join(f"size {n}: {', '.join(p)}" for n, p in sizes.items())
        raise FlowjitValueError(
            f"{user_location()}: vmap({name}): the mapped axes have different sizes ({found}); they must be equal"
        )
    if sizes:
        (size,) = sizes
        if axis_size is not None and axis_size != size:
            raise FlowjitValueError(
                f"{user_location()}: vmap({name}): axis_size={axis_size} but the mapped axes have size {size}"
            )
        return size
    if axis_size is None:
        raise FlowjitValueError(
            f"{user_location()}: vmap({name}): no argument is mapped (every in_axes entry is None); pass "
            "axis_size= to give the batch size"
        )
    return int(axis_size)


def _prefix_axes(spec, tree, name: str, what: str) -> list:
    """One axis (int or None) per leaf of `tree`, from `spec`, a pytree prefix of it."""
    spec_leaves, spec_def = tree_flatten(spec)
    for leaf in spec_leaves:
        if not isinstance(leaf, int) or isinstance(leaf, bool):
            raise FlowjitTypeError(
                f"{user_location()}: vmap({name}): {what} entries must be ints or None; found {leaf!r}"
            )
    out: list = []
    _match(spec_def, iter(spec_leaves), tree_flatten(tree)[1], out, name, what)
    return out


def _match(spec_def: TreeDef, spec_leaves, tree_def: TreeDef, out: list, name: str, what: str) -> None:
    if spec_def.kind in ("leaf", "none"):
        axis = next(spec_leaves) if spec_def.kind == "leaf" else None
        out.extend([axis] * tree_def.num_leaves)
        return
    same = (
        spec_def.kind == tree_def.kind
        and spec_def.node_type is tree_def.node_type
        and spec_def.keys == tree_def.keys
        and len(spec_def.children) == len(tree_def.children)
    )
    if not same:
        raise FlowjitValueError(
            f"{user_location()}: vmap({name}): {what} of structure {spec_def} is not a prefix of the "
            f"{'arguments' if what == 'in_axes' else 'output'} {tree_def}"
        )
    for s, t in zip(spec_def.children, tree_def.children):
        _match(s, spec_leaves, t, out, name, what)
