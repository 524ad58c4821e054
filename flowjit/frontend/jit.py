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
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.backends import Executable, backend_for_device, default_target, get_backend
from flowjit.errors import FlowjitError, FlowjitMemoryError, FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import TreeDef, is_pytree_node, leaf_paths, tree_flatten, tree_unflatten
from flowjit.frontend.trace import Trace, Tracer, array_library, current_trace, escaped_tracer_error
from flowjit.frontend.variables import Variable
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph
from flowjit.ir.location import is_internal_file, user_location
from flowjit.ir.printer import print_graph
from flowjit.ir.types import TensorType
from flowjit.passes import dump
from flowjit.passes.fuse import fusion_summary
from flowjit.passes.partition import graph_devices, placement_report, split_partitions
from flowjit.passes.registry import run_pipeline
from flowjit.runtime.devices import DeviceSpec, placement_devices
from flowjit.runtime.executor import PartitionedExecutable
from flowjit.runtime.tasks import is_local

# The optimization pipeline for every target, top to bottom.
PIPELINE = (
    "canonicalize",  # fold constants, simplify algebra, CSE, DCE
    "fuse",  # elementwise chains, reductions with their neighbours, contraction epilogues -> one kernel each
)
# Then, on a copy of the optimized graph (stage "placement"):
PLACEMENT_PIPELINE = (
    "place",  # a device for every op: constraints, variable colocation, cost model
    "partition",  # send/recv on every cross-device edge (nothing to do with one device)
)

_INT64_RANGE = range(-(2**63), 2**63)


@dataclass(frozen=True)
class ShapeDtype:
    """An abstract argument for `lower`: a shape and a dtype, no data."""

    shape: tuple[int, ...]
    dtype: object

    def __post_init__(self):
        if not all(isinstance(d, int | np.integer) and d >= 0 for d in self.shape):
            raise FlowjitValueError(
                f"{user_location()}: ShapeDtype: a shape is a tuple of non-negative ints; found {self.shape!r}"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        try:
            object.__setattr__(self, "dtype", dt.dtype(self.dtype).np_dtype)
        except ValueError as e:
            raise FlowjitTypeError(f"{user_location()}: ShapeDtype: {e}") from None


# --- user-facing tracebacks --------------------------------------------------------------------------


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without flowjit's own frames, so the user's lines are what they see."""
    frames = []
    while tb is not None:
        if not is_internal_file(tb.tb_frame.f_code.co_filename):
            frames.append(tb)
        tb = tb.tb_next
    new = None
    for t in reversed(frames):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new


def user_errors(fn):
    """Decorator: FlowjitErrors leave with compiler frames hidden from the traceback
    (`FLOWJIT_FULL_TRACEBACK=1` keeps them)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlowjitError as e:
            if os.environ.get("FLOWJIT_FULL_TRACEBACK"):
                raise
            # Keep an explicit cause (a toolchain's diagnostics), drop the implicit context.
            raise e.with_traceback(_user_traceback(e.__traceback__)) from e.__cause__

    return wrapper


# --- argument handling -------------------------------------------------------------------------------


def _unsupported_dtype(path: str, np_dtype) -> FlowjitTypeError:
    np_dtype = np.dtype(np_dtype)
    supported = ", ".join(d.np_dtype.name for d in dt.ALL_DTYPES)
    # '>f4' is named float32 too: say what differs.
    found = np_dtype.name if np_dtype.isnative else f"{np_dtype.name} in non-native byte order ('{np_dtype.str}')"
    if np_dtype.kind == "c":
        fix = f"flowjit has no complex dtypes: pass {path}.real and {path}.imag as float32 arrays"
    else:
        fix = f"convert it before the call, e.g. {path}.astype(np.{'int32' if np_dtype.kind in 'iu' else 'float32'})"
    return FlowjitTypeError(
        f"{user_location()}: argument {path}: unsupported dtype {found}; flowjit supports {supported}; {fix}"
    )


@functools.lru_cache(maxsize=4096)
def _tensor_type(shape: tuple[int, ...], np_dtype: np.dtype) -> TensorType | None:
    """Interned argument types (every call builds its signature: this is the hot path); None for a
    dtype flowjit does not support."""
    if not dt.is_supported_numpy_dtype(np_dtype):
        return None
    return TensorType(shape, dt.dtype(np_dtype))


def _array_type(leaf, path: str) -> TensorType:
    ttype = _tensor_type(tuple(leaf.shape), np.dtype(leaf.dtype))
    if ttype is None:
        raise _unsupported_dtype(path, leaf.dtype)
    return ttype


def _abstract(leaf, path: str) -> TensorType:
    """The abstract value (shape, dtype) of one argument leaf."""
    if isinstance(leaf, np.ndarray | np.generic):
        return _array_type(leaf, path)
    if isinstance(leaf, bool | int | float):
        if isinstance(leaf, int) and not isinstance(leaf, bool) and leaf not in _INT64_RANGE:
            raise FlowjitValueError(f"{user_location()}: argument {path}: Python int {leaf} does not fit in int64")
        kind = "b" if isinstance(leaf, bool) else "i" if isinstance(leaf, int) else "f"
        return _tensor_type((), dt.default_for_kind(kind).np_dtype)
    if isinstance(leaf, ShapeDtype):
        return TensorType(leaf.shape, dt.dtype(leaf.dtype))
    if isinstance(leaf, Variable):
        return VariableArg(leaf)
    if isinstance(leaf, Tracer):
        raise escaped_tracer_error()  # calls inside a trace inline, so this tracer outlived its trace
    if hasattr(leaf, "__array__") and hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return _array_type(leaf, path)
    raise FlowjitTypeError(
        f"{user_location()}: argument {path}: expected an array, a Python scalar or a tuple/list/dict of them; "
        f"found {type(leaf).__name__}. Mark it static (static_argnums/static_argnames) if it configures "
        "the computation."
    )


class VariableArg:
    """A `Variable` passed as an argument: not a value but a reference to state, so it is passed to
    the traced function as is and the signature holds it by identity (another Variable retraces)."""

    __slots__ = ("variable",)

    def __init__(self, variable: Variable):
        self.variable = variable

    def __eq__(self, other) -> bool:
        return isinstance(other, VariableArg) and other.variable is self.variable

    def __hash__(self) -> int:
        return id(self.variable)

    def __str__(self) -> str:
        return f"variable '{self.variable.name}'"

    __repr__ = __str__


def _array_key(args: tuple) -> tuple | None:
    """The fast-path cache key of a call whose arguments are all numpy arrays: their shapes and
    dtypes (shape0, dtype0, shape1, ...). It skips binding and flattening, the cost that dominates
    calls on small arrays. The dtype objects, not their names, so byte order counts."""
    key = []
    for a in args:
        if type(a) is not np.ndarray:
            return None
        key += (a.shape, a.dtype)
    return tuple(key)


def _to_host(leaf, ttype: TensorType) -> np.ndarray:
    """A C-contiguous host array of the argument's signature dtype (what `Executable.run` takes)."""
    array = np.asarray(leaf, dtype=ttype.dtype.np_dtype)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)  # (which makes 0-d arrays 1-d)


def _keyed_by_identity(value) -> bool:
    """Whether `value` hashes by identity (or not at all), so a cache keyed by it would miss every
    change of its attributes. Functions, classes, modules and ufuncs are code, not state: they key
    by identity, as the jitted function itself does."""
    if value is None or value is Ellipsis or value is NotImplemented:  # singletons: identity is their value
        return False
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | type | types.ModuleType | np.ufunc):
        return False
    if isinstance(value, types.MethodType):
        return _keyed_by_identity(value.__self__)
    if isinstance(value, functools.partial) or hasattr(value, "__wrapped__"):  # partial, fj.jit, custom_vjp
        return False
    hash_fn = type(value).__hash__
    return hash_fn is None or hash_fn is object.__hash__


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


@dataclass(frozen=True)
class Signature:
    """What a compiled entry is specialized on: the dynamic arguments' names, their pytree
    structure and leaf types, and each static argument as (name, type, value)."""

    names: tuple[str, ...]
    treedef: TreeDef
    avals: tuple[TensorType | VariableArg, ...]
    statics: tuple[tuple[str, type, object], ...]

    def explain_change(self, old: Signature, paths: Sequence[str]) -> str:
        """Why this signature differs from `old`, in the words of FLOWJIT_LOG_COMPILES."""
        if self.names != old.names:
            return f"the dynamic arguments changed from ({', '.join(old.names)}) to ({', '.join(self.names)})"
        if self.treedef != old.treedef:
            for name, a, b in zip(self.names, old.treedef.children, self.treedef.children):
                if a != b:
                    return f"the structure of argument {name} changed from {a} to {b}"
        for path, a, b in zip(paths, old.avals, self.avals):
            if a != b:
                return f"argument {path} changed from {a} to {b}"
        old_statics = {name: (kind, value) for name, kind, value in old.statics}
        for name, kind, value in self.statics:
            old_kind, old_value = old_statics.get(name, (None, None))
            if old_kind is not kind:
                return (
                    f"static argument '{name}' changed from {old_value!r} ({getattr(old_kind, '__name__', None)}) "
                    f"to {value!r} ({kind.__name__})"
                )
            if old_value != value:
                return f"static argument '{name}' changed from {old_value!r} to {value!r}"
        return "a new signature"

    def describe(self, paths: Sequence[str]) -> str:
        parts = [f"{p}: {a}" for p, a in zip(paths, self.avals)]
        parts += [f"{name}={value!r}" for name, _, value in self.statics]
        return "(" + ", ".join(parts) + ")"


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
        self.target = target
        options = (
            self.static_argnums,
            self.static_argnames,
            None if device is None else str(device),
            self.donate_argnums,
            self.donate_argnames,
            target,
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
        return Lowered(graph, sig, out_tree, paths, target, binder, variables, self._donated_leaves(paths))

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
                    lowered = Lowered(graph, sig, out_tree, paths, target, binder, variables, donated)
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


# Binds a call's (args, kwargs) like the jitted function: -> (Signature, bound arguments, leaves, paths).
Binder = Callable[[tuple, dict], tuple]


class Lowered:
    """A traced function for one signature: its stages, and `compile()`."""

    def __init__(
        self,
        graph: Graph,
        sig: Signature,
        out_tree: TreeDef,
        paths,
        target: str,
        binder: Binder,
        variables=None,
        donated: tuple[int, ...] = (),
    ):
        self.signature = sig
        self.donated = donated  # indices of the dynamic leaves whose buffers the caller donated
        self.variables = dict(variables or {})  # name -> Variable the function reads or updates
        self.out_tree = out_tree
        self.paths = list(paths)
        self.target = target
        self.name = graph.name
        self._binder = binder
        self._graphs = {"traced": graph}
        if dump.dump_dir() is not None:  # printing costs: a large constant is written out in hex
            dump.write_stage(self.name, "traced", print_graph(graph))
        self._executable: Executable | None = None

    def graph(self, stage: str = "optimized") -> Graph:
        """The IR at `stage` ('traced', 'optimized', or 'placement': placed and partitioned)."""
        if stage == "optimized" and stage not in self._graphs:
            # Passes rewrite in place: optimize a copy so the traced stage stays as traced.
            copy = self._graphs["traced"].copy()
            copy.devices = tuple(d.name for d in placement_devices())  # local devices and a cluster's tasks'
            self._graphs["optimized"] = run_pipeline(copy, PIPELINE, dump_name=self.name)
        if stage == "placement" and stage not in self._graphs:
            copy = self.graph("optimized").copy()
            self._graphs["placement"] = run_pipeline(copy, PLACEMENT_PIPELINE, dump_name=self.name)
        if stage not in self._graphs:
            raise FlowjitValueError(f"no IR stage '{stage}'; IR stages are 'traced', 'optimized' and 'placement'")
        return self._graphs[stage]

    @property
    def stages(self) -> list[str]:
        """The stage names `as_text` accepts for this function and backend."""
        backend = list(self._compile_executable().stages) if self._executable or self.target != "interpreter" else []
        return ["traced", "optimized", "placement", *backend]

    def _compile_executable(self) -> Executable:
        if self._executable is None:
            placed = self.graph("placement")
            used = graph_devices(placed)
            if len(used) > 1 or (used and not is_local(used[0])):  # another task's device: run there
                self._executable = PartitionedExecutable(split_partitions(placed), self.target)
            else:  # one device: the optimized graph as is, by that device's backend (or the target's)
                graph = self.graph("optimized")
                device = used[0] if used else None
                if self.target is not None:
                    backend = get_backend(self.target)
                else:
                    backend = backend_for_device(device) if device else get_backend(default_target())
                self._executable = backend.compile(graph, device, aliases=self._aliases(graph))
        return self._executable

    def _aliases(self, graph: Graph) -> dict[int, int]:
        """Donation: each donated input leaf pairs with the first unpaired result of its type that an
        op computes. Output index -> input index. An input also returned as is is not donated: that
        result is copied from it at the end of the call, after the donated results are written."""
        inputs = [i for i, aval in enumerate(self.signature.avals) if not isinstance(aval, VariableArg)]
        returned = {graph.params.index(v) for v in graph.results if v in graph.params}
        aliases: dict[int, int] = {}
        for leaf in self.donated:
            if leaf not in inputs or inputs.index(leaf) in returned:
                continue  # a Variable argument is updated in place anyway
            for j, value in enumerate(graph.results):
                computed = value.producer is not None and value.producer.name != "constant"
                if j not in aliases and computed and value.type == self.signature.avals[leaf]:
                    aliases[j] = inputs.index(leaf)
                    break
        return aliases

    @user_errors
    def as_text(self, stage: str = "optimized") -> str:
        """The text of one stage: 'traced', 'optimized', 'placement' (each op's device and why, each
        transfer), or a backend stage ('mlir', 'llvm', 'asm')."""
        if stage in ("traced", "optimized"):
            header = f"stage: {stage}"
            if stage == "optimized":
                header += f"\npipeline: {', '.join(PIPELINE)}\n{fusion_summary(self.graph(stage))}"
                executable = self._compile_executable()
                header += f"\nbackend: {_backend_note(executable)}"
            return print_graph(self.graph(stage), header)
        if stage == "placement":
            placed = self.graph("placement")
            header = f"stage: placement\npipeline: {', '.join(PLACEMENT_PIPELINE)}\n{placement_report(placed)}"
            return print_graph(placed, header)
        executable = self._compile_executable()
        if stage not in executable.stages:
            available = ", ".join(["traced", "optimized", "placement", *executable.stages])
            raise FlowjitValueError(
                f"{user_location()}: no stage '{stage}' for backend '{executable.backend}'; available: {available}"
            )
        return executable.stages[stage]

    @user_errors
    def compile(self) -> Compiled:
        """The executable for this signature; call it with arguments of that signature."""
        return Compiled(
            self._compile_executable(),
            self.signature,
            self.out_tree,
            self.paths,
            self.name,
            self._binder,
            self.variables,
        )


def _output_builder(out_tree: TreeDef) -> Callable[[list], object]:
    """Rebuilds a call's result from the executable's outputs; one leaf or a flat tuple without
    walking the tree (a third of a small call's cost)."""
    if out_tree.kind == "leaf":
        return operator.itemgetter(0)
    if out_tree.kind == "tuple" and all(child.kind == "leaf" for child in out_tree.children):
        return tuple
    return functools.partial(tree_unflatten, out_tree)


def _backend_note(executable: Executable) -> str:
    if executable.backend == "interpreter":
        return (
            "reference interpreter (numpy, op by op): this function is NOT compiled to native code "
            "because target='interpreter' was chosen or no native backend is available"
        )
    return executable.backend


class Compiled:
    """A compiled function for one signature: call it with arguments of that signature, passed as
    to the jitted function (static arguments included, with the values it was lowered for)."""

    def __init__(
        self,
        executable: Executable,
        sig: Signature,
        out_tree: TreeDef,
        paths,
        name: str,
        binder: Binder,
        variables=None,
    ):
        self.executable = executable
        # Variables in a fixed (name) order: locks are always taken in this order, so concurrent calls
        # of functions sharing variables cannot deadlock.
        self.variables = [v for _, v in sorted((variables or {}).items())]
        self._locks = [v.lock for v in self.variables]
        self._buffers = {v.name: v.buffer for v in self.variables}  # a Variable keeps one buffer for life
        self.signature = sig
        self.out_tree = out_tree
        self.paths = paths
        self.name = name
        self._binder = binder
        self._fresh_outputs = executable.fresh_outputs
        self._aliases = executable.aliases
        self._build_output = _output_builder(out_tree)
        # The call fast path: `call_arrays(args)` for numpy arrays of exactly the signature's shapes
        # and dtypes (the jitted function's array-key cache vouches for that): no conversion or
        # re-check, and for one result no Python frame between the jitted function and the backend.
        if self.variables or self._aliases:
            self.call_arrays = self.call_leaves
        elif out_tree.kind == "leaf":
            self.call_arrays = executable.caller(single_output=True)
        else:
            run, build = executable.caller(single_output=False), self._build_output
            self.call_arrays = lambda args: build(run(args))

    def call_leaves(self, leaves: Sequence) -> object:
        """Run on the flattened dynamic arguments (already checked against the signature)."""
        arrays = [
            _to_host(leaf, aval)
            for leaf, aval in zip(leaves, self.signature.avals)
            if not isinstance(aval, VariableArg)
        ]
        donated = self._donated_buffers(arrays) if self._aliases else None
        if self.variables:
            outs = self._run_with_variables(arrays, donated)
        else:
            outs = self.executable.run(arrays, outputs=donated)
        if not self._fresh_outputs:  # an input passed through must not alias the caller's array
            outs = [np.array(o) if any(o is a for a in arrays) else o for o in outs]
        return self._build_output(outs)

    def _donated_buffers(self, arrays) -> dict[int, np.ndarray]:
        """Output index -> the donated argument's buffer to write it into; an array donated twice (or
        overlapping another donated one) is used once, so no two results share memory."""
        chosen: dict[int, np.ndarray] = {}
        for out, index in self._aliases.items():
            buffer = arrays[index]
            if not any(np.may_share_memory(buffer, other) for other in chosen.values()):
                chosen[out] = buffer
        return chosen

    def _run_with_variables(self, arrays, donated=None):
        # Locks in a fixed order (see __init__); by hand, as an ExitStack costs more than the native call.
        taken = 0
        try:
            for lock in self._locks:
                lock.acquire()
                taken += 1
            return self.executable.run(arrays, self._buffers, donated)
        finally:
            for lock in reversed(self._locks[:taken]):
                lock.release()

    @user_errors
    def __call__(self, *args, **kwargs):
        sig, _, leaves, paths = self._binder(args, kwargs)
        if sig != self.signature:
            raise FlowjitTypeError(
                f"{user_location()}: {self.name} was compiled for {self.signature.describe(self.paths)}; called "
                f"with {sig.describe(paths)}: {sig.explain_change(self.signature, paths)}. Lower it again for "
                "these arguments, or call the jitted function, which compiles once per signature"
            )
        return self.call_leaves(leaves)


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
):
    """Compile `fun` on first call per signature. Usable as `@jit` or `@jit(static_argnums=1)`.

    static_argnums / static_argnames: arguments that configure the computation (sizes, flags,
    callables); they must be hashable, and each new (type, value) traces again.
    donate_argnums / donate_argnames: array arguments the caller gives up: a result of the same
    shape and dtype may be written into a donated array's memory and returned as that very array
    (`params = step(params, batch)` then allocates nothing per call). Afterwards the donated array
    holds that result, not its old value. Honored by the CPU backend on one device.
    device: placement constraint for every op (e.g. "cpu:0"). target: backend ('cpu', 'interpreter').
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
        )
    return Jitted(fun, static_argnums, static_argnames, device, donate_argnums, target, donate_argnames)
