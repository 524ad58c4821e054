"""User-defined derivative rules: `custom_vjp` (`defvjp`) and `custom_jvp` (`defjvp`, `defjvps`).

Both become one `custom_vjp_call` marker op while a caller is differentiated (flowjit's autodiff is
reverse mode), whose gradient is a rule registered with `autodiff.add_custom_rule`:

- custom_vjp: the user's `bwd`.
- custom_jvp: the transpose of the user's tangent map. `t -> jvp_rule(primals, t)[1]` is linear in
  `t`, so its VJP at any point (zeros) maps a cotangent `ct` to `J^T ct`: the VJP the rule implies.
  `grad`, `vjp`, and forward mode (the double VJP of `forward.py`, which transposes it back to
  `J t`) then all use the user's rule.

`nondiff_argnums` follow JAX: those arguments get no cotangent; `bwd` receives them first
(`bwd(*nondiff, residuals, ct)`), and so does the JVP rule (`jvp(*nondiff, primals, tangents)`).
Python values among them (callables, ints, configuration) stay Python values and are part of the
rule's key (by value: they must be hashable); array values are passed to the rule as residuals.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.autodiff import add_custom_rule, under_differentiation
from flowjit.frontend.control_flow import _as_operands
from flowjit.frontend.grad import _leaf_type, vjp
from flowjit.frontend.pytree import tree_flatten, tree_map, tree_unflatten
from flowjit.frontend.trace import Tracer, array_library, bind
from flowjit.ir.location import user_location


def _is_array(x) -> bool:
    """Arrays among nondiff arguments are passed to the rule as residuals; Python values stay static."""
    return isinstance(x, Tracer | np.ndarray | np.generic)


def _flatten_arrays(tree) -> tuple[list, object]:
    """The leaves of `tree` as tracers or arrays converted as flowjit.numpy converts them (a Python
    float is float32), and its structure."""
    leaves, treedef = tree_flatten(tree)
    return _as_operands(leaves), treedef


class custom_vjp:  # noqa: N801  (lower-case like a function, as in JAX)
    """A function with a user-defined gradient:

        @fj.custom_vjp
        def clip_gradient(x): return x
        def fwd(x): return x, ()                      # (output, residuals for bwd)
        def bwd(residuals, ct): return (fnp.clip(ct, -1.0, 1.0),)   # one cotangent (or None) per argument
        clip_gradient.defvjp(fwd, bwd)

    Outside differentiation it calls the function itself. While a caller is being differentiated it
    runs `fwd` and records a `custom_vjp_call` op whose gradient is `bwd` (traced when the autodiff
    pass reaches it), so the function's own ops are never differentiated. Inside `fwd`, calling the
    function runs the function itself (`f.defvjp(lambda x: (f(x), fnp.cos(x)), bwd)`, as in JAX's docs).

    With `nondiff_argnums` (`functools.partial(fj.custom_vjp, nondiff_argnums=(0,))`), `fwd` takes
    all the arguments, `bwd(*nondiff_args, residuals, ct)` returns one cotangent per other argument.
    """

    def __init__(self, fun: Callable, nondiff_argnums: Sequence[int] = ()):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.nondiff_argnums = tuple(int(i) for i in nondiff_argnums)  # passed to the rules in this order, as in JAX
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None
        self._rule_ids: dict = {}
        self._in_fwd = threading.local()  # set while this thread runs `fwd`

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        """Set the forward function `fwd(*args) -> (out, residuals)` and the backward function
        `bwd(*nondiff_args, residuals, out_cotangent) -> tuple of one cotangent (or None) per
        differentiable argument`."""
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, *args):
        if self.fwd is None:
            raise FlowjitValueError(
                f"{user_location()}: custom_vjp function {self.__name__} has no rule; call "
                f"{self.__name__}.defvjp(fwd, bwd) first"
            )
        if not under_differentiation() or getattr(self._in_fwd, "active", False):
            return self.fun(*args)
        nondiff, diff_args = self._split(args)
        self._in_fwd.active = True
        try:
            pair = self.fwd(*args)
        finally:
            self._in_fwd.active = False
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise FlowjitTypeError(
                f"{user_location()}: the fwd of custom_vjp {self.__name__} must return (output, residuals)"
            )
        out, residuals = pair
        in_leaves, in_tree = _flatten_arrays(diff_args)
        nondiff_leaves, nondiff_tree = tree_flatten(list(nondiff))
        static = tuple((k, x) for k, x in enumerate(nondiff_leaves) if not _is_array(x))
        arrays = [x for x in nondiff_leaves if _is_array(x)]
        res_leaves, res_tree = _flatten_arrays(residuals)
        out_leaves, out_tree = _flatten_arrays(out)
        if not out_leaves:
            return out
        in_types = tuple(_leaf_type(x) for x in in_leaves)
        out_types = tuple(_leaf_type(x) for x in out_leaves)
        rule = self._rule_id((nondiff_tree, static), in_tree, in_types, res_tree, out_tree, out_types)
        attrs = {"rule": rule, "num_inputs": len(in_leaves), "num_residuals": len(arrays) + len(res_leaves)}
        results = bind("custom_vjp_call", [*in_leaves, *arrays, *res_leaves, *out_leaves], attrs)
        return tree_unflatten(out_tree, results if isinstance(results, list) else [results])

    def _split(self, args: tuple) -> tuple[list, list]:
        """(the nondiff_argnums arguments, the others), each in argument order."""
        for i in self.nondiff_argnums:
            if not 0 <= i < len(args):
                raise FlowjitValueError(
                    f"{user_location()}: nondiff_argnums {i} of {self.__name__} is out of range: it was called "
                    f"with {len(args)} positional argument(s)"
                )
        nondiff = [args[i] for i in self.nondiff_argnums]
        return nondiff, [x for i, x in enumerate(args) if i not in self.nondiff_argnums]

    def _rule_id(self, nondiff_key, in_tree, in_types, res_tree, out_tree, out_types) -> int:
        key = (nondiff_key, in_tree, in_types, res_tree, out_tree, out_types)
        try:
            hash(key)
        except TypeError:
            found = ", ".join(type(x).__name__ for _, x in nondiff_key[1])
            raise FlowjitTypeError(
                f"{user_location()}: the nondiff_argnums arguments of {self.__name__} that are not arrays must be "
                f"hashable (they key the rule, as static arguments do); found {found}. Pass a tuple for a list"
            ) from None
        if key not in self._rule_ids:
            self._rule_ids[key] = add_custom_rule(functools.partial(self._backward, *key))
        return self._rule_ids[key]

    def _backward(self, nondiff_key, in_tree, in_types, res_tree, out_tree, out_types, residuals, cts):
        """Call `bwd` on tracers; returns one cotangent (or None) per input leaf."""
        nondiff_tree, static = nondiff_key
        num_arrays = nondiff_tree.num_leaves - len(static)
        arrays = iter(residuals[:num_arrays])
        by_position = dict(static)
        nondiff_leaves = [by_position[k] if k in by_position else next(arrays) for k in range(nondiff_tree.num_leaves)]
        nondiff = tree_unflatten(nondiff_tree, nondiff_leaves)
        cts = [ct if ct is not None else array_library().zeros(t.shape, t.dtype) for ct, t in zip(cts, out_types)]
        user_residuals = tree_unflatten(res_tree, residuals[num_arrays:])
        arg_cts = self.bwd(*nondiff, user_residuals, tree_unflatten(out_tree, cts))
        return _input_cotangents(arg_cts, in_tree, in_types, f"the bwd of custom_vjp {self.__name__}")


def _input_cotangents(arg_cts, in_tree, in_types, what: str) -> list:
    """One cotangent (or None) per input leaf from a rule's tuple of one per argument, checked."""
    num_args = len(in_tree.children)
    if not isinstance(arg_cts, tuple | list) or len(arg_cts) != num_args:
        raise FlowjitTypeError(
            f"{user_location()}: {what} must return a tuple of {num_args} cotangent(s), one per "
            f"differentiable argument; found {type(arg_cts).__name__}"
        )
    flat = []
    for arg_ct, arg_tree in zip(arg_cts, in_tree.children):
        if arg_ct is None:
            flat.extend([None] * arg_tree.num_leaves)
            continue
        leaves, tree = tree_flatten(arg_ct)
        if tree != arg_tree:
            raise FlowjitTypeError(
                f"{user_location()}: {what} returned a cotangent of structure {tree} for an argument of structure "
                f"{arg_tree}"
            )
        flat.extend(leaves)
    out = []
    fnp = array_library()
    for ct, t in zip(flat, in_types):
        if ct is None or not t.dtype.is_float:
            out.append(None)
            continue
        ct = fnp.asarray(ct)
        if tuple(fnp.shape(ct)) != t.shape:
            raise FlowjitTypeError(
                f"{user_location()}: {what} returned a cotangent of shape {tuple(fnp.shape(ct))} for an input of "
                f"type {t}"
            )
        out.append(fnp.astype(ct, t.dtype))
    return out


class custom_jvp:  # noqa: N801  (lower-case like a function, as in JAX)
    """A function with a user-defined derivative, given as a JVP rule:

        @fj.custom_jvp
        def log1pexp(x): return fnp.log(1.0 + fnp.exp(x))

        @log1pexp.defjvp
        def log1pexp_jvp(primals, tangents):          # -> (primal_out, tangent_out)
            (x,), (x_dot,) = primals, tangents
            return log1pexp(x), x_dot * (1.0 - 1.0 / (1.0 + fnp.exp(x)))

    Outside differentiation it calls the function itself. Differentiated (`grad`, `vjp`, `jvp`,
    `jacfwd`, `jacrev`, `hessian`, under `jit` or not), its derivative is the rule's: the primal
    output is the rule's `primal_out`, and the gradient the transpose of the rule's tangent map,
    so `tangent_out` must be linear in the tangents (as a JVP is). Calls of the function inside the
    rule's primal computation run the function itself. Higher derivatives differentiate the rule.

    With `nondiff_argnums`, the rule is `jvp(*nondiff_args, primals, tangents)` where `primals`
    and `tangents` hold the other arguments only.
    """

    def __init__(self, fun: Callable, nondiff_argnums: Sequence[int] = ()):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.nondiff_argnums = tuple(int(i) for i in nondiff_argnums)  # passed to the rules in this order, as in JAX
        self.jvp: Callable | None = None
        self._as_vjp = custom_vjp(fun, nondiff_argnums)

    def defjvp(self, jvp: Callable) -> Callable:
        """Set the rule `jvp(*nondiff_args, primals, tangents) -> (primal_out, tangent_out)`; returns
        it, so it can be used as a decorator."""
        self.jvp = jvp
        self._as_vjp.defvjp(self._fwd, self._bwd)
        return jvp

    def defjvps(self, *jvps: Callable | None) -> None:
        """Set the rule by one function per argument, `jvp_i(tangent_i, primal_out, *primals)` (None
        for no dependence); the output tangent is their sum (JAX's `defjvps`)."""
        if self.nondiff_argnums:
            raise FlowjitTypeError(f"{user_location()}: defjvps cannot be used with nondiff_argnums; use defjvp")

        def jvp(primals, tangents):
            out = self.fun(*primals)
            terms = [rule(t, out, *primals) for rule, t in zip(jvps, tangents) if rule is not None]
            if not terms:
                return out, tree_map(array_library().zeros_like, out)
            return out, functools.reduce(lambda a, b: tree_map(lambda x, y: x + y, a, b), terms)

        self.defjvp(jvp)

    def __call__(self, *args):
        if self.jvp is None:
            raise FlowjitValueError(
                f"{user_location()}: custom_jvp function {self.__name__} has no rule; call "
                f"{self.__name__}.defjvp(jvp) first"
            )
        return self._as_vjp(*args)

    def _call_rule(self, nondiff: list, primals: list, tangents: list):
        pair = self.jvp(*nondiff, tuple(primals), tuple(tangents))
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise FlowjitTypeError(
                f"{user_location()}: the jvp rule of custom_jvp {self.__name__} must return (primal_out, tangent_out)"
            )
        return pair

    def _fwd(self, *args):
        # The rule's primal output, with zero tangents (its tangent ops are unused and removed).
        nondiff, primals = self._as_vjp._split(args)
        out, _ = self._call_rule(nondiff, primals, [tree_map(array_library().zeros_like, p) for p in primals])
        return out, tuple(primals)

    def _bwd(self, *args):
        *nondiff, primals, ct = args
        fnp = array_library()
        leaves, tree = tree_flatten(list(primals))
        floats = [k for k, x in enumerate(leaves) if _leaf_type(fnp.asarray(x)).dtype.is_float]

        def tangent_map(*float_tangents):  # linear in the tangents: its VJP is J^T
            tangents = [fnp.zeros_like(x) for x in leaves]
            for k, t in zip(floats, float_tangents):
                tangents[k] = t
            return self._call_rule(nondiff, primals, tree_unflatten(tree, tangents))[1]

        cts = [fnp.zeros_like(x) for x in leaves]  # integer primals get no cotangent (dropped later)
        if floats:
            tangent_out, transpose = vjp(tangent_map, *(fnp.zeros_like(leaves[k]) for k in floats))
            ct_leaves, ct_tree = tree_flatten(ct)
            t_leaves, t_tree = tree_flatten(tangent_out)
            if t_tree != ct_tree:
                raise FlowjitTypeError(
                    f"{user_location()}: the jvp rule of custom_jvp {self.__name__} returned a tangent_out of "
                    f"structure {t_tree}; it must have the structure of the output, {ct_tree}"
                )
            ct = tree_unflatten(ct_tree, [fnp.astype(c, fnp.asarray(t).dtype) for c, t in zip(ct_leaves, t_leaves)])
            for k, c in zip(floats, transpose(ct)):
                cts[k] = c
        return tuple(tree_unflatten(tree, cts))
