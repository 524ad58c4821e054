"""`fj.jit`: trace a Python function on abstract values, optimize the graph, compile it, cache it.

    @fj.jit
    def f(x, w): return fnp.tanh(x @ w)

    f(x, w)                      # numpy in, numpy out; traced and compiled once per signature
    lo = f.lower(x, w)           # or fj.ShapeDtype((256, 784), "float32") per argument
    lo.as_text("optimized")      # any stage: traced, optimized, and the backend's (mlir, llvm, asm)
    lo.compile()(x, w)

A call's signature is the pytree structure of its arguments, each leaf's shape and dtype, and the
values of static arguments; a new signature retraces. `FLOWJIT_LOG_COMPILES=1` prints why.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.backends import Executable, compile_graph, default_target
from flowjit.errors import FlowjitError, FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import TreeDef, leaf_paths, tree_flatten, tree_unflatten
from flowjit.frontend.trace import Trace, Tracer
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph
from flowjit.ir.location import is_internal_file
from flowjit.ir.printer import print_graph
from flowjit.ir.types import TensorType
from flowjit.passes import dump
from flowjit.passes.registry import run_pipeline

# The optimization pipeline for every target, top to bottom.
PIPELINE = (
    "canonicalize",  # fold constants, simplify algebra, CSE, DCE
)


@dataclass(frozen=True)
class ShapeDtype:
    """An abstract argument for `lower`: a shape and a dtype, no data."""

    shape: tuple[int, ...]
    dtype: object

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", dt.dtype(self.dtype).np_dtype)


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
    """Decorator: FlowjitErrors leave with compiler frames hidden from the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlowjitError as e:
            if os.environ.get("FLOWJIT_FULL_TRACEBACK"):
                raise
            raise e.with_traceback(_user_traceback(e.__traceback__)) from None

    return wrapper


# --- argument handling -------------------------------------------------------------------------------


def _abstract(leaf, path: str) -> TensorType:
    """The abstract value (shape, dtype) of one argument leaf."""
    if isinstance(leaf, ShapeDtype):
        return TensorType(leaf.shape, dt.dtype(leaf.dtype))
    if isinstance(leaf, Tracer):
        return leaf.value.type
    if isinstance(leaf, bool | int | float):
        kind = "b" if isinstance(leaf, bool) else "i" if isinstance(leaf, int) else "f"
        return TensorType((), dt.default_for_kind(kind))
    if isinstance(leaf, np.ndarray | np.generic):
        try:
            return TensorType(np.shape(leaf), dt.dtype(leaf.dtype))
        except ValueError as e:
            raise FlowjitTypeError(f"argument {path}: {e}") from None
    if hasattr(leaf, "__array__") and hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return TensorType(tuple(leaf.shape), dt.dtype(np.dtype(leaf.dtype)))
    raise FlowjitTypeError(
        f"argument {path}: expected an array, a Python scalar or a tuple/list/dict of them; found "
        f"{type(leaf).__name__}. Mark it static (static_argnums/static_argnames) if it configures "
        "the computation."
    )


def _to_host(leaf, ttype: TensorType) -> np.ndarray:
    array = np.asarray(leaf)
    if array.dtype != ttype.dtype.np_dtype:
        array = array.astype(ttype.dtype.np_dtype)
    return array


@dataclass(frozen=True)
class Signature:
    """What a compiled entry is specialized on."""

    treedef: TreeDef
    avals: tuple[TensorType, ...]
    statics: tuple

    def explain_change(self, old: Signature, paths: Sequence[str]) -> str:
        if self.treedef != old.treedef:
            return f"the argument structure changed: {old.treedef} -> {self.treedef}"
        for path, a, b in zip(paths, old.avals, self.avals):
            if a != b:
                return f"argument {path} changed from {a} to {b}"
        for (name, a), (_, b) in zip(old.statics, self.statics):
            if a != b:
                return f"static argument '{name}' changed from {a!r} to {b!r}"
        return "a new signature"


class Jitted:
    """A function compiled on first call per signature. Created by `fj.jit`."""

    def __init__(self, fun, static_argnums=(), static_argnames=(), device=None, donate_argnums=(), target=None):
        if not callable(fun):
            raise FlowjitTypeError(f"jit expects a function; found {type(fun).__name__}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.signature = inspect.signature(fun)
        self.static_argnums = _as_tuple(static_argnums)
        self.static_argnames = _as_tuple(static_argnames)
        self.device = device
        self.donate_argnums = _as_tuple(donate_argnums)
        self.target = target
        self._cache: dict[Signature, Compiled] = {}
        self._last: Signature | None = None
        self._lock = threading.Lock()
        params = list(self.signature.parameters.values())
        for i in self.static_argnums:
            if not -len(params) <= i < len(params):
                raise FlowjitValueError(f"static_argnums {i} is out of range for {fun.__name__}{self.signature}")
        self._static_names = {params[i].name for i in self.static_argnums} | set(self.static_argnames)

    def __repr__(self) -> str:
        return f"<flowjit.jit {getattr(self.fun, '__qualname__', self.fun)}>"

    def __get__(self, obj, objtype=None):
        return self if obj is None else functools.partial(self, obj)

    # --- splitting a call into its signature and dynamic leaves ----------------------------------
    def _split(self, args, kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise FlowjitTypeError(f"{self.fun.__name__}{self.signature}: {e}") from None
        bound.apply_defaults()
        statics, dynamic, names = [], [], []
        for name, value in bound.arguments.items():
            if name in self._static_names:
                try:
                    hash(value)
                except TypeError:
                    raise FlowjitTypeError(
                        f"static argument '{name}' of {self.fun.__name__} must be hashable (it keys the "
                        f"compile cache); found {type(value).__name__}. Use a tuple instead of a list, "
                        "or a frozen dataclass."
                    ) from None
                statics.append((name, value))
            else:
                dynamic.append(value)
                names.append(name)
        leaves, treedef = tree_flatten(dynamic)
        paths = [names[int(p[1 : p.index("]")])] + p[p.index("]") + 1 :] for p in leaf_paths(dynamic)]
        return bound, statics, leaves, treedef, paths

    def _signature_of(self, args, kwargs):
        bound, statics, leaves, treedef, paths = self._split(args, kwargs)
        avals = tuple(_abstract(leaf, path) for leaf, path in zip(leaves, paths))
        return Signature(treedef, avals, tuple(statics)), bound, leaves, paths

    # --- tracing ----------------------------------------------------------------------------------
    def _trace(self, sig: Signature, bound, paths) -> tuple[Graph, TreeDef]:
        with Trace(self.fun.__name__) as trace:
            if self.device is not None:
                trace.device_stack.append(str(self.device))
            tracers = [trace.new_param(aval, path) for aval, path in zip(sig.avals, paths)]
            dynamic = iter(tree_unflatten(sig.treedef, tracers))
            arguments = {}
            statics = dict(sig.statics)
            for name in bound.arguments:
                arguments[name] = statics[name] if name in statics else next(dynamic)
            call_args, call_kwargs = _rebind(self.signature, arguments)
            out = self.fun(*call_args, **call_kwargs)
            out_leaves, out_tree = tree_flatten(out)
            results = []
            for i, leaf in enumerate(out_leaves):
                if not isinstance(leaf, Tracer | np.ndarray | np.generic | bool | int | float):
                    raise FlowjitTypeError(
                        f"{self.fun.__name__} returned a {type(leaf).__name__} (output leaf {i}); "
                        "functions under jit must return arrays or tuples/lists/dicts of arrays"
                    )
                results.append(trace.lift(leaf if isinstance(leaf, Tracer) else np.asarray(leaf)))
            trace.graph.results = results
        return trace.graph, out_tree

    def _log_compile(self, sig: Signature, paths) -> None:
        if os.environ.get("FLOWJIT_LOG_COMPILES", "") in ("", "0"):
            return
        reason = "first call" if self._last is None else sig.explain_change(self._last, paths)
        code = getattr(self.fun, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
        print(f"flowjit: tracing {self.fun.__name__}{where} because {reason}", file=sys.stderr)

    @user_errors
    def lower(self, *args, **kwargs) -> Lowered:
        """Trace and optimize for these arguments (arrays or `ShapeDtype`s) without running."""
        sig, bound, _, paths = self._signature_of(args, kwargs)
        self._log_compile(sig, paths)
        graph, out_tree = self._trace(sig, bound, paths)
        return Lowered(graph, sig, out_tree, paths, self.target or default_target())

    @user_errors
    def __call__(self, *args, **kwargs):
        if any(isinstance(leaf, Tracer) for leaf in tree_flatten((args, kwargs))[0]):
            return self.fun(*args, **kwargs)  # inside another trace: inline
        sig, bound, leaves, paths = self._signature_of(args, kwargs)
        compiled = self._cache.get(sig)
        if compiled is None:
            with self._lock:
                compiled = self._cache.get(sig)
                if compiled is None:
                    self._log_compile(sig, paths)
                    graph, out_tree = self._trace(sig, bound, paths)
                    compiled = Lowered(graph, sig, out_tree, paths, self.target or default_target()).compile()
                    self._cache[sig] = compiled
                    self._last = sig
        return compiled.call_leaves(leaves)

    def clear_cache(self) -> None:
        self._cache.clear()
        self._last = None


def _rebind(signature: inspect.Signature, arguments: dict):
    args, kwargs = [], {}
    for name, param in signature.parameters.items():
        if name not in arguments:
            continue
        value = arguments[name]
        if param.kind is param.VAR_POSITIONAL:
            args.extend(value)
        elif param.kind is param.VAR_KEYWORD:
            kwargs.update(value)
        elif param.kind is param.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, int | str) else tuple(x)


class Lowered:
    """A traced function for one signature: its stages, and `compile()`."""

    def __init__(self, graph: Graph, sig: Signature, out_tree: TreeDef, paths, target: str):
        self.signature = sig
        self.out_tree = out_tree
        self.paths = list(paths)
        self.target = target
        self.name = graph.name
        self._graphs = {"traced": graph}
        dump.write_stage(self.name, "traced", print_graph(graph))
        self._executable: Executable | None = None

    def graph(self, stage: str = "optimized") -> Graph:
        """The IR at `stage` ('traced' or 'optimized')."""
        if stage == "optimized" and stage not in self._graphs:
            from flowjit.ir.parser import parse_graph

            # Passes rewrite in place: optimize a copy so the traced stage stays as traced.
            copy = parse_graph(print_graph(self._graphs["traced"]))
            self._graphs["optimized"] = run_pipeline(copy, PIPELINE, dump_name=self.name)
        if stage not in self._graphs:
            raise FlowjitValueError(f"no IR stage '{stage}'; IR stages are 'traced' and 'optimized'")
        return self._graphs[stage]

    @property
    def stages(self) -> list[str]:
        backend = list(self._compile_executable().stages) if self._executable or self.target != "interpreter" else []
        return ["traced", "optimized", *backend]

    def _compile_executable(self) -> Executable:
        if self._executable is None:
            self._executable = compile_graph(self.graph("optimized"), self.target)
        return self._executable

    def as_text(self, stage: str = "optimized") -> str:
        """The text of one stage: 'traced', 'optimized', or a backend stage ('mlir', 'llvm', 'asm')."""
        if stage in ("traced", "optimized"):
            header = f"stage: {stage}"
            if stage == "optimized":
                header += f"\npipeline: {', '.join(PIPELINE)}"
                executable = self._compile_executable()
                header += f"\nbackend: {_backend_note(executable)}"
            return print_graph(self.graph(stage), header)
        executable = self._compile_executable()
        if stage not in executable.stages:
            available = ", ".join(["traced", "optimized", *executable.stages])
            raise FlowjitValueError(f"no stage '{stage}' for backend '{executable.backend}'; available: {available}")
        return executable.stages[stage]

    def compile(self) -> Compiled:
        return Compiled(self._compile_executable(), self.signature, self.out_tree, self.paths, self.name)


def _backend_note(executable: Executable) -> str:
    if executable.backend == "interpreter":
        return (
            "reference interpreter (numpy, op by op): this function is NOT compiled to native code "
            "because target='interpreter' was chosen or no native backend is available"
        )
    return executable.backend


class Compiled:
    """A compiled function for one signature: call it with arrays of that signature."""

    def __init__(self, executable: Executable, sig: Signature, out_tree: TreeDef, paths, name: str):
        self.executable = executable
        self.signature = sig
        self.out_tree = out_tree
        self.paths = paths
        self.name = name

    def call_leaves(self, leaves: Sequence) -> object:
        arrays = [_to_host(leaf, aval) for leaf, aval in zip(leaves, self.signature.avals)]
        outs = self.executable.run(arrays)
        return tree_unflatten(self.out_tree, outs)

    @user_errors
    def __call__(self, *args, **kwargs):
        leaves, treedef = tree_flatten([a for a in args] + list(kwargs.values()))
        avals = tuple(_abstract(leaf, path) for leaf, path in zip(leaves, self.paths))
        if avals != self.signature.avals:
            expected = ", ".join(str(a) for a in self.signature.avals)
            found = ", ".join(str(a) for a in avals)
            raise FlowjitTypeError(f"{self.name} was compiled for ({expected}); called with ({found})")
        return self.call_leaves(leaves)


def jit(fun=None, *, static_argnums=(), static_argnames=(), device=None, donate_argnums=(), target=None):
    """Compile `fun` on first call per signature. Usable as `@jit` or `@jit(static_argnums=1)`."""
    if fun is None:
        return functools.partial(
            jit,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            device=device,
            donate_argnums=donate_argnums,
            target=target,
        )
    return Jitted(fun, static_argnums, static_argnames, device, donate_argnums, target)
