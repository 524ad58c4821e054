"""Forward mode and Jacobians: `jvp`, `linearize`, `jacfwd`, `jacrev` (`jacobian`), `hessian`.

    y, y_dot = fj.jvp(f, (x,), (x_dot,))       # y_dot = J(x) @ x_dot
    y, f_jvp = fj.linearize(f, x); f_jvp(x_dot)
    fj.jacfwd(f)(x), fj.jacrev(f)(x)           # shape f(x).shape + x.shape; argnums as in grad
    fj.hessian(f)(x)                           # jacfwd(jacrev(f))

Forward mode is built on the reverse mode by the "double VJP" trick: the VJP function
`ct -> J^T ct` is linear in its cotangent, so its own VJP at any point (zeros) maps a tangent `t` to
`(J^T)^T t = J t`. Both VJPs are graphs inlined into the caller's trace, so the canonicalize pass
removes what the tangent does not need; under `fj.jit` the result is one compiled program.
A custom_vjp's `bwd` is transposed the same way, which is right when it is linear in its cotangent
(as a VJP is). Jacobians apply the VJP (jacrev) or JVP (jacfwd) to every unit vector at once with
`vmap` over an identity basis, so the program's size does not grow with the element count; the
work does (n products of the linear map). Outside any trace the whole computation is traced and
compiled once per graph, as `grad` is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from flowjit.errors import FlowjitTypeError
from flowjit.frontend.grad import _graph_name, _leaf_type, _needs_eager_run, _normalize_argnums, _run_compiled, vjp
from flowjit.frontend.pytree import tree_flatten, tree_unflatten
from flowjit.frontend.trace import array_library
from flowjit.frontend.vmap import vmap
from flowjit.ir.location import user_location


def linearize(fun: Callable, *primals):
    """`(fun(*primals), jvp_fn)`: `jvp_fn(*tangents)` (one per primal, each of the primal's
    structure, shapes and dtypes) returns the tangent of the output, `J @ tangents`. Every primal
    leaf must be a float; integer and bool outputs get zero tangents."""
    if _needs_eager_run(primals):
        out = _run_compiled(fun, primals)

        def eager_jvp_fn(*tangents):
            if not _needs_eager_run(tangents):  # under a trace: into the caller's graph
                return linearize(fun, *primals)[1](*tangents)
            return _run_compiled(lambda p, t: linearize(fun, *p)[1](*t), (primals, tangents))

        return out, eager_jvp_fn
    fnp = array_library()
    out, vjp_fn = vjp(fun, *primals)
    out_leaves, out_tree = tree_flatten(out)
    out_types = [_leaf_type(fnp.asarray(o)) for o in out_leaves]
    floats = [i for i, t in enumerate(out_types) if t.dtype.is_float]

    def transposed(*float_cotangents):  # linear in its arguments: its VJP is the JVP
        cts = [fnp.zeros(t.shape, t.dtype) for t in out_types]
        for i, ct in zip(floats, float_cotangents):
            cts[i] = ct
        return vjp_fn(tree_unflatten(out_tree, cts))

    _, transpose_fn = vjp(transposed, *(fnp.zeros(out_types[i].shape, out_types[i].dtype) for i in floats))
    primal_leaves, primal_tree = tree_flatten(list(primals))
    name = _graph_name(fun)

    def jvp_fn(*tangents):
        tangent_leaves, tangent_tree = tree_flatten(list(tangents))
        if tangent_tree != primal_tree:
            raise FlowjitTypeError(
                f"{user_location()}: the tangents of {name} must have the structure of its primals {primal_tree}; "
                f"found {tangent_tree}"
            )
        cast = []
        for k, (t, p) in enumerate(zip(tangent_leaves, primal_leaves)):
            expected, found = _leaf_type(p), _leaf_type(fnp.asarray(t))
            if expected.shape != found.shape:
                raise FlowjitTypeError(
                    f"{user_location()}: tangent leaf {k} of {name} must have the primal's shape {expected.shape}; "
                    f"found {found.shape}"
                )
            cast.append(fnp.astype(fnp.asarray(t), expected.dtype))
        float_tangents = transpose_fn(tuple(tree_unflatten(primal_tree, cast)))
        leaves = [fnp.zeros(t.shape, t.dtype) for t in out_types]
        for i, tangent in zip(floats, float_tangents):
            leaves[i] = tangent
        return tree_unflatten(out_tree, leaves)

    return out, jvp_fn


def jvp(fun: Callable, primals: Sequence, tangents: Sequence):
    """`(fun(*primals), J @ tangents)`, JAX's `jvp`: `primals` and `tangents` are sequences of the
    same structure (one tangent per primal, of its shape and dtype)."""
    if not isinstance(primals, tuple | list) or not isinstance(tangents, tuple | list):
        raise FlowjitTypeError(
            f"{user_location()}: jvp takes primals and tangents as tuples (jvp(f, (x,), (t,))); found "
            f"{type(primals).__name__} and {type(tangents).__name__}"
        )
    if len(primals) != len(tangents):
        raise FlowjitTypeError(
            f"{user_location()}: jvp needs one tangent per primal; found {len(primals)} primal(s) and "
            f"{len(tangents)} tangent(s)"
        )
    if _needs_eager_run((primals, tangents)):
        return _run_compiled(lambda p, t: jvp(fun, p, t), (tuple(primals), tuple(tangents)))
    out, jvp_fn = linearize(fun, *primals)
    return out, jvp_fn(*tangents)


def _with_args(fun: Callable, args: tuple, argnums: tuple[int, ...], has_aux: bool):
    """`fun` as a function of `args[argnums]` alone (the output only, without aux)."""

    def partial_fun(*diff_args):
        call_args = list(args)
        for i, x in zip(argnums, diff_args):
            call_args[i] = x
        out = fun(*call_args)
        return out[0] if has_aux else out

    return partial_fun


def _basis(types) -> list:
    """For leaves of `types` (n elements in all): one array per leaf of shape (n,) + its shape whose
    row e is the e-th unit vector of the flattened leaves."""
    fnp = array_library()
    total = sum(t.size for t in types)
    eye = fnp.equal(fnp.iota((total, total), 0), fnp.iota((total, total), 1))  # traced: never a literal
    out, start = [], 0
    for t in types:
        out.append(fnp.astype(fnp.reshape(eye[:, start : start + t.size], (total, *t.shape)), t.dtype))
        start += t.size
    return out


def _jacobian_transform(fun: Callable, argnums, has_aux: bool, forward: bool) -> Callable:
    name = _graph_name(fun)

    @functools.wraps(fun)
    def jacobian_fn(*args):
        if _needs_eager_run(args):
            return _run_compiled(jacobian_fn, args)
        fnp = array_library()
        nums = _normalize_argnums(argnums, len(args), name)
        diff_args = tuple(args[i] for i in nums)
        partial_fun = _with_args(fun, args, nums, has_aux)
        in_leaves, in_tree = tree_flatten(list(diff_args))
        in_types = [_leaf_type(x) for x in in_leaves]
        if forward:
            out, jvp_fn = linearize(partial_fun, *diff_args)
            out_leaves, out_tree = tree_flatten(out)
            out_types = [_leaf_type(fnp.asarray(o)) for o in out_leaves]
            # one JVP per input element, batched: column e of every output block
            columns = _batched(lambda *t: jvp_fn(*tree_unflatten(in_tree, list(t))), in_types, out_types)
            blocks = [
                [_block(c, o, t, columns_first=True) for c, t in zip(_split(col, in_types), in_types)]
                for col, o in zip(columns, out_types)
            ]
        else:
            out, vjp_fn = vjp(partial_fun, *diff_args)
            out_leaves, out_tree = tree_flatten(out)
            out_types = [_leaf_type(fnp.asarray(o)) for o in out_leaves]
            # one VJP per output element, batched: row e of every block
            rows = _batched(lambda *c: tuple(vjp_fn(tree_unflatten(out_tree, list(c)))), out_types, in_types)
            by_output = [_split(r, out_types) for r in rows]  # [input leaf][output leaf]
            blocks = [
                [_block(by_output[j][i], o, t, columns_first=False) for j, t in enumerate(in_types)]
                for i, o in enumerate(out_types)
            ]
        per_input = [tree_unflatten(in_tree, row) for row in blocks]
        jac = tree_unflatten(out_tree, [p[0] if isinstance(argnums, int) else tuple(p) for p in per_input])
        return (jac, fun(*args)[1]) if has_aux else jac

    return jacobian_fn


def _batched(linear_fn, in_types, out_types) -> list:
    """`linear_fn` applied to every unit vector of its inputs at once (vmap over the basis): one
    array per output leaf, of shape (number of input elements,) + the leaf's shape."""
    fnp = array_library()
    total = sum(t.size for t in in_types)
    if total == 0:
        return [fnp.zeros((0, *t.shape), t.dtype) for t in out_types]
    return list(tree_flatten(vmap(linear_fn)(*_basis(in_types)))[0])


def _split(stacked, types) -> list:
    """The rows of `stacked` (one per element of the leaves of `types`, in order) per leaf."""
    out, start = [], 0
    for t in types:
        out.append(stacked[start : start + t.size])
        start += t.size
    return out


def _block(part, o_type, i_type, columns_first: bool):
    """A Jacobian block of shape out.shape + in.shape from the rows of one batched result: jacfwd's
    rows are input elements (each an output-shaped tangent), jacrev's output elements."""
    fnp = array_library()
    if columns_first:  # (in.size, *out.shape) -> out.shape + in.shape
        flat = fnp.reshape(part, (i_type.size, o_type.size))
        return fnp.reshape(fnp.transpose(flat), o_type.shape + i_type.shape)
    return fnp.reshape(part, o_type.shape + i_type.shape)  # (out.size, *in.shape)


def jacfwd(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """The Jacobian of `fun` with respect to `args[argnums]` by forward mode (one JVP per input
    element): for an array input and output, shape `out.shape + in.shape`; for pytrees, the output's
    structure holding the input's (a tuple of them when `argnums` is a tuple)."""
    return _jacobian_transform(fun, argnums, has_aux, forward=True)


def jacrev(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """The Jacobian of `fun` by reverse mode (one VJP per output element); see `jacfwd`."""
    return _jacobian_transform(fun, argnums, has_aux, forward=False)


jacobian = jacrev


def hessian(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """The Hessian of a scalar `fun`: `jacfwd(jacrev(fun))`, shape `in.shape + in.shape`."""
    return jacfwd(jacrev(fun, argnums, has_aux), argnums, has_aux)
