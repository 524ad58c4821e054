"""`fj.jit`: trace a Python function on abstract values, optimize the graph, compile it, cache it.

    @fj.jit
    def f(x, w): return fnp.tanh(x @ w)

    f(x, w)                      # numpy in, numpy out; traced and compiled once per signature
    lo = f.lower(x, w)           # or fj.ShapeDtype((256, 784), "float32") per argument
    lo.as_text("optimized")      # any stage: traced, optimized, and the backend's (mlir, llvm, asm)
    lo.compile()(x, w)

A call's signature is the pytree structure of its arguments, each leaf's shape and dtype, and the
type and value of each static argument; a new signature retraces. The cache belongs to the
function and the jit options, not the wrapper: `fj.jit(f)(x)` in a loop traces once. As in JAX, a
trace reads globals and closures once (see docs/transforms.md). `FLOWJIT_LOG_COMPILES=1` prints
why. Arguments are pytrees (tuples, lists, dicts, namedtuples, None) whose leaves are numpy arrays of
a flowjit dtype or Python scalars (bool -> bool, int -> i64, float -> f32). Arrays of other dtypes
(uint8, int16, complex64, ...) are rejected with a FlowjitTypeError, not converted: convert them yourself
(`x.astype(np.int32)`) so the compiled signature says what runs. Numpy arrays a traced function
reads from its closure or globals, or returns, become constants of the graph, converted as
`flowjit.numpy.asarray` does (other integer dtypes -> int64; complex is an error).

This module holds `jit`, the `Jitted` wrapper (splitting a call into its signature and leaves,
tracing, the call paths) and the caches its wrappers share. A call's `Signature` and argument
leaves are `signature.py`; the stages `Lowered` and `Compiled` and the pipelines are `lowered.py`;
the traceback filter of user-facing errors is `tracebacks.py`.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable

import numpy as np

from flowjit.backends import checked_target
from flowjit.errors import FlowjitError, FlowjitMemoryError, FlowjitTypeError, FlowjitValueError
from flowjit.frontend.lowered import PIPELINE, Compiled, Lowered
from flowjit.frontend.pytree import TreeDef, is_pytree_node, leaf_paths, tree_flatten, tree_unflatten
from flowjit.frontend.signature import Signature, VariableArg, _abstract, _array_key, _keyed_by_identity
from flowjit.frontend.trace import Trace, Tracer, array_library, current_trace
from flowjit.frontend.tracebacks import _user_traceback, user_errors
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph
from flowjit.ir.location import user_location
from flowjit.passes import dump
from flowjit.passes.registry import run_pipeline
from flowjit.runtime.devices import DeviceSpec, placement_devices

# Jitted wrappers of one function with equal options share one cache, as JAX's do, so `fj.jit(f)(x)`
# written inside a loop traces once: function -> {options: its cache}. Weak: a cache lives as long as
# its function.
_shared_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_shared_caches_lock = threading.Lock()


class JitCache:
    """The compiled entries of one (function, options): signature -> Compiled, the array-key fast
    path, the last signature traced (for FLOWJIT_LOG_COMPILES), and the lock tracing holds."""

    def __init__(self):
        self.entries: dict[Signature, Compiled] = {}
        self.fast_calls: dict[tuple, Callable] = {}  # _array_key -> that signature's Compiled.call_arrays
        self.last: Signature | None = None
        # Reentrant: a jitted function may call itself on concrete values while being traced.
        self.lock = threading.RLock()


def _cache_for(fun, options: tuple) -> JitCache:
    """The cache shared by every wrapper of `fun` with these options; a private one when `fun`
    cannot be weakly referenced or hashed."""
    try:
        with _shared_caches_lock:
            return _shared_caches.setdefault(fun, {}).setdefault(options, JitCache())
    except TypeError:
        return JitCache()


def _graph_name(fun) -> str:
    """A function name the text IR can print and parse back (`<lambda>` -> `lambda`)."""
    name = getattr(fun, "__name__", None) or type(fun).__name__
    return re.sub(r"[^A-Za-z0-9_.$]", "_", name.strip("<>")) or "function"


class Jitted:
    """A function compiled on first call per signature. Created by `fj.jit`.

    Calls with tracers (inside another jit, grad, cond, ...) inline the function into the caller's
    graph. As a method (`@fj.jit` on a `def` in a class), `self` is either a pytree (a class
    registered with `fj.tree_util`: its arrays are traced arguments, its other fields key the cache
    by value) or a static argument keyed by its own `__hash__`/`__eq__`; an object that hashes by
    identity is refused, since its attributes could change behind the cache's back.

    Wrappers of one function with equal options share one cache (`fj.jit(f)(x)` in a loop traces
    once). As in JAX, a trace reads globals and closed-over values once: rebinding them later does
    not retrace; pass such values as arguments, or call `clear_cache()`.
    """

    def __init__(
        self,
        fun,
        static_argnums=(),
        static_argnames=(),
        device=None,
        donate_argnums=(),
        target=None,
        donate_argnames=(),
        keep_on_device=False,
    ):
        if not callable(fun):
            raise FlowjitTypeError(f"{user_location()}: jit expects a function; found {type(fun).__name__}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.name = _graph_name(fun)
        try:
            self.signature = inspect.signature(fun)
        except (TypeError, ValueError) as e:
            raise FlowjitTypeError(f"{user_location()}: jit cannot read the signature of {fun!r}: {e}") from None
        self.static_argnums = _as_tuple(static_argnums)
        self.static_argnames = _as_tuple(static_argnames)
        self.device = device
        self.donate_argnums = _as_tuple(donate_argnums)
        self.donate_argnames = _as_tuple(donate_argnames)
        try:
            self.target = target = checked_target(target)
        except FlowjitValueError as e:
            raise FlowjitValueError(f"{user_location()}: jit: {e}") from None
        self.keep_on_device = bool(keep_on_device)
        options = (
            self.static_argnums,
            self.static_argnames,
            None if device is None else str(device),
            self.donate_argnums,
            self.donate_argnames,
            target,
            self.keep_on_device,
            tuple(d.name for d in placement_devices()),  # the devices (local, a cluster's) code was placed on
        )
        self._shared = _cache_for(fun, options)
        self._cache, self._fast_calls, self._lock = self._shared.entries, self._shared.fast_calls, self._shared.lock
        params = list(self.signature.parameters.values())
        for i in self.static_argnums:
            if not isinstance(i, int) or not -len(params) <= i < len(params):
                raise FlowjitValueError(
                    f"{user_location()}: static_argnums {i!r} is out of range for {self.name}{self.signature}"
                )
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
        for name in self.static_argnames:
            if name not in self.signature.parameters and not takes_kwargs:
                raise FlowjitValueError(
                    f"{user_location()}: static_argnames '{name}' is not a parameter of {self.name}{self.signature}"
                )
        self._static_names = {params[i].name for i in self.static_argnums} | set(self.static_argnames)
        self._donated_names = self._check_donation(params)
        self._self_name = params[0].name if params else None

    def _check_donation(self, params) -> frozenset[str]:
        """The names of the donated parameters (donate_argnums and donate_argnames)."""
        names = set()
        for i in self.donate_argnums:
            if not isinstance(i, int) or not -len(params) <= i < len(params):
                raise FlowjitValueError(
                    f"{user_location()}: donate_argnums {i!r} is out of range for {self.name}{self.signature}"
                )
            names.add(params[i].name)
        for name in self.donate_argnames:
            if name not in self.signature.parameters:
                raise FlowjitValueError(
                    f"{user_location()}: donate_argnames '{name}' is not a parameter of {self.name}{self.signature}"
                )
            names.add(name)
        if names & self._static_names:
            raise FlowjitValueError(
                f"{user_location()}: argument(s) {', '.join(sorted(names & self._static_names))} of {self.name} are "
                "both static and donated; only array arguments can be donated"
            )
        return frozenset(names)

    def _donated_leaves(self, paths) -> tuple[int, ...]:
        """Indices of the dynamic leaves that belong to donated arguments (a path starts with its name)."""
        if not self._donated_names:
            return ()
        return tuple(i for i, path in enumerate(paths) if re.match(r"\w+", path).group(0) in self._donated_names)

    def __repr__(self) -> str:
        return f"<flowjit.jit {getattr(self.fun, '__qualname__', self.name)}>"

    def __get__(self, obj, objtype=None):
        return self if obj is None else BoundJitted(self, obj)

    # --- splitting a call into its signature and dynamic leaves ----------------------------------
    def _split(self, args, kwargs, bound_self: bool):
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise FlowjitTypeError(f"{user_location()}: {self.name}{self.signature}: {e}") from None
        # Omitted parameters keep their Python defaults (not traced), as if the function were called
        # directly: `fj.jit(fnp.sum)(x)` leaves keepdims=False a Python bool. Omitted *static*
        # parameters take their defaults explicitly, so f(x) and f(x, k=<default>) share an entry.
        for name, param in self.signature.parameters.items():
            if name in self._static_names and name not in bound.arguments and param.default is not param.empty:
                bound.arguments[name] = param.default
        statics, dynamic, names = [], [], []
        for name, value in bound.arguments.items():
            if bound_self and name == self._self_name and not is_pytree_node(value):
                statics.append((name, type(value), self._static_self(name, value)))
            elif name in self._static_names:
                statics.append((name, type(value), self._static_value(name, value)))
            else:
                dynamic.append(value)
                names.append(name)
        leaves, treedef = tree_flatten(dynamic)
        paths = [names[int(p[1 : p.index("]")])] + p[p.index("]") + 1 :] for p in leaf_paths(dynamic)]
        return bound, tuple(names), tuple(statics), leaves, treedef, paths

    def _static_value(self, name: str, value):
        """A static argument's cache key: its value, which must be hashable by value (never by
        identity: a changed attribute would reuse a stale trace)."""
        try:
            hash(value)
        except TypeError:
            raise FlowjitTypeError(
                f"{user_location()}: static argument '{name}' of {self.name} must be hashable (its value keys "
                f"the compile cache); found {type(value).__name__}. Use a tuple instead of a list, or a frozen "
                "dataclass."
            ) from None
        if _keyed_by_identity(value):
            raise FlowjitTypeError(
                f"{user_location()}: static argument '{name}' of {self.name} is a {type(value).__name__}, which "
                "hashes by identity: the compiled code would be reused after its attributes change (a stale "
                "result). Give its class __eq__ and __hash__ by value (e.g. @dataclass(frozen=True)), or pass "
                "its arrays as dynamic arguments (register the class with fj.tree_util.register_dataclass)"
            )
        return value

    def _static_self(self, name: str, obj):
        """A bound method's `self` that is not a pytree: static, keyed by its value's hash, never by
        identity (`c.calc(3)`, then `c.mul = False`, must not reuse the trace of `c.calc`)."""
        cls = type(obj).__name__
        try:
            by_value = hash(obj) is not None and not _keyed_by_identity(obj)
        except TypeError:  # a frozen dataclass holding an array, say
            by_value = False
        if not by_value:
            raise FlowjitTypeError(
                f"{user_location()}: the jitted method {self.name} of {cls}: '{name}' is neither an array pytree "
                f"nor hashable by value, so the compiled code could not tell when its attributes change and "
                f"would return stale results. Either register {cls} as a pytree "
                f"(@fj.tree_util.register_dataclass, or fj.tree_util.register_pytree_node_class with "
                f"tree_flatten/tree_unflatten): its arrays are then traced and its other fields key the cache "
                f"by value; or give {cls} __eq__ and __hash__ by value over every field the method reads "
                f"(e.g. @dataclass(frozen=True)); or jit a function that takes the arrays as arguments"
            )
        return obj

    def _signature_of(self, args, kwargs, bound_self: bool = False):
        bound, names, statics, leaves, treedef, paths = self._split(args, kwargs, bound_self)
        avals = tuple(_abstract(leaf, path) for leaf, path in zip(leaves, paths))
        return Signature(names, treedef, avals, statics), bound, leaves, paths

    # --- tracing ----------------------------------------------------------------------------------
    def _trace(self, sig: Signature, bound, paths) -> tuple[Graph, TreeDef, dict]:
        with Trace(self.name) as trace:
            if self.device is not None:
                trace.device_stack.append(str(DeviceSpec.parse(self.device)))
            tracers = [
                aval.variable if isinstance(aval, VariableArg) else trace.new_param(aval, path)
                for aval, path in zip(sig.avals, paths)
            ]
            dynamic = dict(zip(sig.names, tree_unflatten(sig.treedef, tracers)))
            arguments = {name: dynamic.get(name, value) for name, value in bound.arguments.items()}
            call_args, call_kwargs = _rebind(self.signature, arguments)
            out = self.fun(*call_args, **call_kwargs)
            out_leaves, out_tree = tree_flatten(out)
            results = []
            for leaf, path in zip(out_leaves, leaf_paths(out, "output")):
                results.append(trace.lift(self._output_value(leaf, path)))
            trace.graph.results = results
        return trace.graph, out_tree, dict(trace.variables)

    def _output_value(self, leaf, path: str):
        """A returned leaf as a Tracer or a constant array; anything else names the output's path."""
        if isinstance(leaf, Tracer):
            return leaf
        if not isinstance(leaf, np.ndarray | np.generic | bool | int | float):
            raise FlowjitTypeError(
                f"{self._where()}: {self.name} returned a {type(leaf).__name__} at {path}; functions "
                "under jit must return arrays, Python scalars or tuples/lists/dicts of them"
            )
        if np.asarray(leaf).dtype.kind not in "biuf":
            raise FlowjitTypeError(
                f"{self._where()}: {self.name} returned an array of dtype {np.asarray(leaf).dtype} at {path}; "
                f"flowjit supports {', '.join(d.np_dtype.name for d in dt.ALL_DTYPES)}"
            )
        return array_library().asarray(leaf)

    def _where(self) -> str:
        code = getattr(self.fun, "__code__", None)
        return f"{code.co_filename}:{code.co_firstlineno}" if code else self.name

    def _log_compile(self, sig: Signature, paths, for_lower: bool = False) -> None:
        if os.environ.get("FLOWJIT_LOG_COMPILES", "") in ("", "0"):
            return
        if for_lower:
            reason = "lower() was called"
        elif self._shared.last is None:
            reason = "first call"
        else:
            reason = sig.explain_change(self._shared.last, paths)
        print(f"flowjit: tracing {self.name} ({self._where()}) because {reason}", file=sys.stderr)

    def _lower(self, args, kwargs, bound_self: bool) -> Lowered:
        if current_trace() is not None:
            raise FlowjitTypeError(f"{user_location()}: {self.name}.lower() called while tracing; call it outside jit")
        sig, bound, _, paths = self._signature_of(args, kwargs, bound_self)
        with self._lock:
            self._log_compile(sig, paths, for_lower=True)
            graph, out_tree, variables = self._trace(sig, bound, paths)
        binder = functools.partial(self._signature_of, bound_self=bound_self)
        target = self.target
        donated = self._donated_leaves(paths)
        return Lowered(graph, sig, out_tree, paths, target, binder, variables, donated, self.keep_on_device)

    def _call(self, args, kwargs, bound_self: bool):
        if current_trace() is not None:
            return self.fun(*args, **kwargs)  # inside another trace: inline into its graph
        array_key = None if kwargs or bound_self else _array_key(args)
        sig, bound, leaves, paths = self._signature_of(args, kwargs, bound_self)
        compiled = self._cache.get(sig)
        if compiled is None:
            with self._lock:
                compiled = self._cache.get(sig)
                if compiled is None:
                    self._log_compile(sig, paths)
                    graph, out_tree, variables = self._trace(sig, bound, paths)
                    binder = functools.partial(self._signature_of, bound_self=bound_self)
                    target = self.target
                    donated = self._donated_leaves(paths)
                    lowered = Lowered(
                        graph, sig, out_tree, paths, target, binder, variables, donated, self.keep_on_device
                    )
                    compiled = lowered.compile()
                    self._cache[sig] = compiled
                    self._shared.last = sig
        # Positional arrays that are exactly the dynamic leaves (no statics, pytrees or defaults
        # among them) determine the signature by their shapes and dtypes alone: remember that.
        if array_key is not None and len(leaves) == len(args) and all(a is b for a, b in zip(leaves, args)):
            self._fast_calls[array_key] = compiled.call_arrays
        return compiled.call_leaves(leaves)

    @user_errors
    def lower(self, *args, **kwargs) -> Lowered:
        """Trace and optimize for these arguments (arrays or `ShapeDtype`s) without running."""
        return self._lower(args, kwargs, bound_self=False)

    def __call__(self, *args, **kwargs):
        # `user_errors` by hand: a decorator's frame is a tenth of a small call's cost.
        try:
            if not kwargs:
                call = self._fast_calls.get(_array_key(args))
                if call is not None and current_trace() is None:
                    return call(args)
            return self._call(args, kwargs, bound_self=False)
        except FlowjitError as e:
            if os.environ.get("FLOWJIT_FULL_TRACEBACK"):
                raise
            raise e.with_traceback(_user_traceback(e.__traceback__)) from e.__cause__
        except MemoryError as e:  # numpy could not allocate the results or the workspace
            raise FlowjitMemoryError(f"{user_location()}: {self.name}: out of memory for this call: {e}") from None

    def clear_cache(self) -> None:
        """Forget every compiled signature (of every wrapper of this function with these options);
        the next call traces again."""
        with self._lock:
            self._cache.clear()
            self._fast_calls.clear()
            self._shared.last = None


class BoundJitted:
    """A jitted method looked up on an instance (`obj.method`): `obj` is bound as a static `self`."""

    def __init__(self, jitted: Jitted, obj):
        self.jitted = jitted
        self.obj = obj

    def __repr__(self) -> str:
        return f"<bound flowjit.jit {self.jitted.name} of {self.obj!r}>"

    @user_errors
    def lower(self, *args, **kwargs) -> Lowered:
        """Trace and optimize for these arguments (arrays or `ShapeDtype`s) without running."""
        return self.jitted._lower((self.obj, *args), kwargs, bound_self=True)

    @user_errors
    def __call__(self, *args, **kwargs):
        return self.jitted._call((self.obj, *args), kwargs, bound_self=True)


def _rebind(signature: inspect.Signature, arguments: dict):
    """(args, kwargs) that call the function with `arguments`; once a parameter is omitted (it keeps
    its default), later ones go by keyword so they cannot shift into its place."""
    args, kwargs = [], {}
    skipped = False
    for name, param in signature.parameters.items():
        if name not in arguments:
            skipped = skipped or param.kind is not param.VAR_POSITIONAL
            continue
        value = arguments[name]
        if param.kind is param.VAR_POSITIONAL:
            args.extend(value)
        elif param.kind is param.VAR_KEYWORD:
            kwargs.update(value)
        elif param.kind is param.KEYWORD_ONLY or (skipped and param.kind is param.POSITIONAL_OR_KEYWORD):
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, int | str) else tuple(x)


def optimized_graph(fun, *args) -> Graph:
    """`fun`'s optimized graph for `args` (arrays or `ShapeDtype`s), traced for the compiler's own use
    (the CPU row library's reference graphs): no FLOWJIT_LOG_COMPILES line and no dumps, since it is
    not the user's function, and allowed while another function is being traced."""
    jitted = Jitted(fun, (), (), None, (), "interpreter", ())
    with dump.quiet():
        sig, bound, _, paths = jitted._signature_of(args, {}, False)
        graph, _, _ = jitted._trace(sig, bound, paths)
        return run_pipeline(graph, PIPELINE)


@user_errors
def jit(
    fun=None,
    *,
    static_argnums=(),
    static_argnames=(),
    device=None,
    donate_argnums=(),
    target=None,
    donate_argnames=(),
    keep_on_device=False,
):
    """Compile `fun` on first call per signature. Usable as `@jit` or `@jit(static_argnums=1)`.

    static_argnums / static_argnames: arguments that configure the computation (sizes, flags,
    callables); they must be hashable, and each new (type, value) traces again.
    donate_argnums / donate_argnames: array arguments the caller gives up: a result of the same
    shape and dtype may be written into a donated array's memory and returned as that very array
    (`params = step(params, batch)` then allocates nothing per call). Afterwards the donated array
    holds that result, not its old value. Honored by the CPU backend on one device.
    device: placement constraint for every op (e.g. "cpu:0"). target: the backend of every
    partition ('cpu', 'interpreter', 'cuda'), or a mapping {device type: backend} for the partitions
    of those types ({"cpu": "interpreter"}: CPU partitions on the reference interpreter, GPU ones
    compiled as usual).
    keep_on_device: results of a program that runs on a GPU stay in its memory, as `fj.DeviceArray`s
    (`np.asarray(r)` copies one to the host; passed to a program on that GPU, it is read where it
    is); a program on the CPU returns numpy arrays as always.
    """
    if fun is None:
        return functools.partial(
            jit,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            device=device,
            donate_argnums=donate_argnums,
            target=target,
            donate_argnames=donate_argnames,
            keep_on_device=keep_on_device,
        )
    return Jitted(fun, static_argnums, static_argnames, device, donate_argnums, target, donate_argnames, keep_on_device)
