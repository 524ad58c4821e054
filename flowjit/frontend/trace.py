"""Tracing: `Tracer` values stand for tensors while a Python function runs, and every operation on
them appends an op to the innermost `Trace`'s graph. `bind` is the single entry point: with no
tracer among its operands it evaluates the op eagerly with the reference implementation, so
`flowjit.numpy` behaves the same on plain arrays and on traced values.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from flowjit.errors import FlowjitAttributeError, FlowjitTypeError, TracerControlFlowError
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import infer_types, make_op, normalize_attr, single_value
from flowjit.ir.graph import Graph, Value
from flowjit.ir.location import Location, user_location
from flowjit.ir.ops import get_opdef
from flowjit.ir.types import TensorType

_state = threading.local()


def trace_stack() -> list[Trace]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def current_trace() -> Trace | None:
    stack = trace_stack()
    return stack[-1] if stack else None


class Trace:
    """One function being traced: its graph under construction, and the outer values it captured.

    Use as a context manager; traces nest (a `cond` branch inside a `jit`). A tracer of an
    enclosing trace used here becomes a new parameter of this graph (a capture), recorded in
    `captures` so the caller can pass the outer value in.
    """

    def __init__(self, name: str = "main"):
        self.graph = Graph(name)
        self.captures: list[tuple[Tracer, Value]] = []
        self._captured: dict[Value, Value] = {}
        self.parent: Trace | None = None
        self.device_stack: list[str] = []
        self.active = False
        self.variables: dict = {}  # name -> Variable read or updated while tracing (root trace only)
        # (id of a large array, device) -> (the array, the copy the constant holds, its value): an
        # array read again is the same constant (a weight used twice was two copies in the graph)
        self._large_constants: dict[tuple[int, str | None], tuple[np.ndarray, np.ndarray, Value]] = {}

    def __enter__(self) -> Trace:
        stack = trace_stack()
        self.parent = stack[-1] if stack else None
        if self.parent is not None:
            self.device_stack = list(self.parent.device_stack)
        stack.append(self)
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        trace_stack().pop()
        self.active = False

    def new_param(self, type: TensorType, name: str | None = None) -> Tracer:
        return Tracer(self.graph.add_param(type, name), self)

    def lift(self, x) -> Value:
        """The value of `x` in this graph: its own tracer, a capture of an outer one, or a constant."""
        if isinstance(x, Tracer):
            if x.trace is self:
                return x.value
            if not x.trace.active:
                raise escaped_tracer_error()
            if x.value not in self._captured:
                param = self.graph.add_param(x.value.type, f"capture{len(self.captures)}")
                self._captured[x.value] = param
                self.captures.append((x, param))
            return self._captured[x.value]
        return self.constant(x)

    def constant(self, x) -> Value:
        """A constant op holding `x` (an array the traced function closed over, or returned); a large
        array of one value (`fnp.zeros((4096, 4096))`) is that scalar broadcast (`splat_constant`)."""
        array = np.asarray(x)
        if not dt.is_supported_numpy_dtype(array.dtype):
            raise unsupported_constant_error(array)
        key = (id(x), self.device)
        seen = self._large_constants.get(key) if isinstance(x, np.ndarray) else None
        if seen is not None and seen[0] is x and _same_bits(x, seen[1]):  # unchanged since it was read
            return seen[2]
        ops = splat_constant(array, user_location(), self.device)
        for op in ops:
            self.graph.append(op)
        if isinstance(x, np.ndarray) and array.size > SPLAT_MIN_ELEMENTS and ops[-1].name == "constant":
            self._large_constants[key] = (x, ops[-1].attrs["value"], ops[-1].result)
        return ops[-1].result

    @property
    def root(self) -> Trace:
        """The outermost enclosing trace (the function being compiled)."""
        trace = self
        while trace.parent is not None:
            trace = trace.parent
        return trace

    @property
    def device(self) -> str | None:
        """The device constraint for ops traced now: the jit's `device=` merged with the
        enclosing `with fj.device(...)` scopes (inner fields win)."""
        from flowjit.runtime.devices import DeviceSpec, current_device_spec

        scope = current_device_spec()
        if not self.device_stack:
            return None if scope is None else str(scope)
        base = DeviceSpec.parse(self.device_stack[-1])
        return str(base if scope is None else base.merged_with(scope))


# Arrays of more elements than this whose elements all have one value become a scalar constant and
# a broadcast. As a literal, a (4096, 4096) f32 of zeros went through every compile as 64 MiB:
# printed in hex into the graph's text (the compile cache's key) and the dumps, copied into the
# module, and stored whole on a cache hit; its first call took 2.5 s against 0.12 s for the same
# function with a scalar.
SPLAT_MIN_ELEMENTS = 1024


def splat_constant(array: np.ndarray, loc: Location, device: str | None = None) -> list:
    """The ops of a constant holding `array`: one `constant`, or, for a large array of a single
    value (bit for bit: -0.0 is not 0.0, a nan payload is kept), a scalar `constant` and its
    `broadcast`."""
    if array.size > SPLAT_MIN_ELEMENTS and single_value(array):
        scalar = make_op("constant", [], {"value": np.array(array.reshape(-1)[0])}, loc, device=device)
        attrs = {"shape": array.shape, "dims": ()}
        return [scalar, make_op("broadcast", [scalar.result], attrs, loc, device=device)]
    return [make_op("constant", [], {"value": np.array(array)}, loc, device=device)]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes (nan payloads and the sign of zero included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) == memoryview(b.reshape(-1).view(np.uint8))


def escaped_tracer_error() -> FlowjitTypeError:
    """The error for a tracer used after the trace that created it ended."""
    return FlowjitTypeError(
        f"{user_location()}: a traced value escaped the function that created it (stored in a global, "
        "a closure or an attribute during an earlier trace) and is used after that trace ended; return "
        "it from the jitted function, or pass it in as an argument"
    )


def unsupported_constant_error(array: np.ndarray) -> FlowjitTypeError:
    supported = ", ".join(d.np_dtype.name for d in dt.ALL_DTYPES)
    return FlowjitTypeError(
        f"{user_location()}: an array of dtype {array.dtype} (shape {array.shape}) is used in a traced "
        f"function; flowjit supports {supported}. Convert it first, e.g. with .astype(np.float32)"
    )


def _innermost(tracers: Sequence[Tracer]) -> Trace:
    trace = current_trace()
    if trace is None:
        raise escaped_tracer_error()  # no trace is running, so these tracers outlived theirs
    return trace


def bind(
    name: str, operands: Sequence, attrs: dict | None = None, loc: Location | None = None, device: str | None = None
):
    """Apply op `name`: trace it if any operand is a Tracer, else evaluate it eagerly.

    A traced op is constrained to `device` when given (a variable's ops go where it lives), else
    to the device scope it is traced in. Returns one Tracer/array for one-result ops, else a list.
    """
    attrs = {k: normalize_attr(v) for k, v in (attrs or {}).items()}
    tracers = [x for x in operands if isinstance(x, Tracer)]
    loc = loc or user_location()
    if not tracers and not _traced_without_tracers(name):
        return _eval_eager(name, operands, attrs, loc)
    trace = _innermost(tracers) if tracers else current_trace()
    values = [trace.lift(x) for x in operands]
    op = make_op(name, values, attrs, loc, device=device or trace.device)
    trace.graph.append(op)
    outs = [Tracer(r, trace) for r in op.results]
    return outs[0] if len(outs) == 1 else outs


def _traced_without_tracers(name: str) -> bool:
    """Inside a trace, effectful ops (state) and operand-less ops (iota) become ops even with no
    traced operand: state must be ordered, and a traced iota never becomes a big literal."""
    if current_trace() is None:
        return False
    opdef = get_opdef(name)
    return opdef.effectful or opdef.arity == 0


def _eval_eager(name, operands, attrs, loc):
    arrays = [np.asarray(x) for x in operands]
    for a in arrays:
        if not dt.is_supported_numpy_dtype(a.dtype):
            raise unsupported_constant_error(a)
    opdef = get_opdef(name)
    full = {**opdef.defaults, **attrs}
    types = infer_types(name, [TensorType(a.shape, dt.dtype(a.dtype)) for a in arrays], full, loc)
    out = opdef.impl(*arrays, **full)
    outs = [np.asarray(o) for o in (out if isinstance(out, tuple) else (out,))]
    for o, t in zip(outs, types):
        assert o.shape == t.shape and o.dtype == t.dtype.np_dtype, (name, o.shape, o.dtype, t)
    return outs[0] if len(outs) == 1 else outs


def _control_flow_error(what: str, fix: str) -> TracerControlFlowError:
    return TracerControlFlowError(
        f"{user_location()}: {what} of a traced value: its value is not known while tracing. {fix}"
    )


class Tracer:
    """A tensor inside a traced function: numpy-like, with static shape and dtype."""

    __slots__ = ("value", "trace")
    __array_priority__ = 1000  # numpy defers `ndarray op Tracer` to our reflected operators

    def __init__(self, value: Value, trace: Trace):
        self.value = value
        self.trace = trace

    # --- static facts --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.type.shape

    @property
    def dtype(self) -> np.dtype:
        return self.value.type.dtype.np_dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self.value.type.size

    def __len__(self) -> int:
        if not self.shape:
            raise FlowjitTypeError(f"{user_location()}: len() of a scalar (shape ())")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise FlowjitTypeError(f"{user_location()}: iteration over a scalar (shape ())")
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self) -> str:
        return f"Tracer<{self.value.type}>"

    # --- Python control flow is an error ----------------------------------------------------------
    def __bool__(self):
        raise _control_flow_error(
            "Python `if`, `while`, `and`/`or` or bool()",
            "Use fj.cond(pred, true_fn, false_fn, *operands) for a branch, fj.while_loop or "
            "fj.fori_loop for a loop, or fnp.where(pred, a, b) to select elementwise.",
        )

    def __int__(self):
        raise _control_flow_error("int()", "Keep it a tensor, or mark the argument static (static_argnums).")

    def __float__(self):
        raise _control_flow_error("float()", "Keep it a tensor, or mark the argument static (static_argnums).")

    def __index__(self):
        raise _control_flow_error(
            "use as a Python index", "Index with the tensor itself (x[i] gathers), or mark it static."
        )

    def __array__(self, *args, **kwargs):
        raise _control_flow_error(
            "conversion to a numpy array (np.asarray, np.* functions)",
            "Use flowjit.numpy (import flowjit.numpy as fnp) inside traced functions.",
        )

    def __hash__(self):
        raise FlowjitTypeError(f"{user_location()}: traced values are not hashable")

    def item(self):
        raise _control_flow_error("item()", "Keep it a tensor, or return it from the jitted function.")

    def tolist(self):
        raise _control_flow_error("tolist()", "Keep it a tensor, or return it from the jitted function.")

    def __setitem__(self, index, value):
        raise FlowjitTypeError(
            f"{user_location()}: traced values are immutable, so x[...] = v cannot update one; write "
            "x = x.at[...].set(v) (or .add, .multiply, .min, .max), which returns the updated array"
        )

    def __getattr__(self, name: str):
        # Only reached for attributes the class lacks (operators and array methods are installed by
        # flowjit.numpy); dunder lookups stay plain so numpy's protocol probes see a normal miss.
        if name.startswith("__"):
            raise AttributeError(name)
        raise FlowjitAttributeError(
            f"{user_location()}: traced values have no attribute '{name}'; see flowjit.numpy for the "
            "supported array functions and methods"
        )

    # Arithmetic operators and array methods (`+`, `@`, `.sum`, `.T`, ...) are installed on this
    # class by flowjit.numpy, next to the functions they call.


# --- the array library -----------------------------------------------------------------------------------

_array_library = None


def install_array_library(module) -> None:
    """Called by flowjit.numpy when it is imported: the library traced code is written with. The
    frontend converts user values with it (`asarray`, `astype`, `broadcast_to`, ...), so that they
    follow the same dtype rules, without importing a layer above its own."""
    global _array_library
    _array_library = module


def array_library():
    """flowjit.numpy (installed by `import flowjit`, which every use of the frontend goes through)."""
    if _array_library is None:
        raise RuntimeError("internal error: flowjit.numpy is not loaded; import flowjit first")
    return _array_library
