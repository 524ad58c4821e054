"""`fj.Variable`: state that persists across calls, the TensorFlow paper's mutable variables.

    v = fj.Variable(np.zeros((784, 10), np.float32), name="w")
    v.value; v.assign(x); v.assign_add(x); v.assign_sub(x)      # inside or outside jit

Inside a traced function these become ordered `read_variable`/`assign*` ops; compiled code reads and
updates the variable's own buffer in place. Each variable has a lock: a compiled call holds the
locks of every variable it touches, so concurrent calls never tear a variable.

A variable created inside `with fj.device(spec):` (or with `device=spec`, or inside a cluster's
`shard_variables()`, which spreads variables over the PS tasks) lives there: every op
that reads or updates it is placed on that device, whatever scope it is traced in (TensorFlow's
colocation of a variable's ops). When that device belongs to another task of a cluster, the value
lives in that task's process, and `.value`/`assign` outside jit go there
(`flowjit.runtime.tasks.variable_home`). A variable a jitted GPU program uses lives in that GPU's
memory between calls in the same way (docs/gpu-backend.md, "Variables in device memory").
"""

from __future__ import annotations

import itertools
import threading
import weakref

import numpy as np

from flowjit.errors import FlowjitError, FlowjitTypeError, FlowjitValueError
from flowjit.frontend.trace import Tracer, array_library, bind, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.ir.types import TensorType
from flowjit.runtime.devices import DeviceSpec, current_device_spec, variable_device
from flowjit.runtime.tasks import set_variable_home, variable_home

_names_lock = threading.Lock()
_counter = itertools.count()
_LIVE: weakref.WeakValueDictionary[str, Variable] = weakref.WeakValueDictionary()


def _unique_name(requested: str | None) -> str:
    base = requested or "var"
    with _names_lock:
        if base not in _LIVE:
            return base
        while True:
            candidate = f"{base}_{next(_counter)}"
            if candidate not in _LIVE:
                return candidate


def _as_host_array(value, dtype=None) -> np.ndarray:
    if isinstance(value, Tracer):
        raise FlowjitTypeError(
            f"{user_location()}: a Variable's initial value must be concrete, not a traced value; create "
            "variables outside jit-compiled functions"
        )
    if dtype is not None:
        return np.array(value, dtype=dt.dtype(dtype).np_dtype)
    if isinstance(value, np.ndarray | np.generic):
        try:
            dt.dtype(value.dtype)
        except ValueError as e:
            raise FlowjitTypeError(f"{user_location()}: Variable: {e}") from None
        return np.asarray(value)
    fnp = array_library()
    return np.asarray(fnp.asarray(value))  # Python scalars and lists: float32 / int64 defaults


class Variable:
    """A named, typed buffer that outlives calls; read and updated by ordered ops in traced code."""

    def __init__(self, value, name: str | None = None, dtype=None, device=None):
        self._buffer = np.array(_as_host_array(value, dtype), order="C")
        spec = DeviceSpec.parse(device) if device is not None else current_device_spec()
        if spec is None:  # a sharding scope (`cluster.shard_variables()`) may choose
            chosen = variable_device(self._buffer.nbytes)
            spec = None if chosen is None else DeviceSpec.parse(chosen)
        self.device = None if spec is None else str(spec)  # where its ops are placed (None: anywhere)
        self.type = TensorType(self._buffer.shape, dt.dtype(self._buffer.dtype))
        self.name = _unique_name(name)
        self.lock = threading.RLock()
        _LIVE[self.name] = self
        if variable_home(self.name) is not None:  # left by a variable of this name that is gone
            set_variable_home(self.name, None)

    # --- facts ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> np.dtype:
        return self.type.dtype.np_dtype

    @property
    def buffer(self) -> np.ndarray:
        """The live buffer compiled code updates in place (runtime use; prefer `.value`)."""
        return self._buffer

    def __repr__(self) -> str:
        return f"Variable(name={self.name!r}, type={self.type})"

    def _attrs(self) -> dict:
        return {"var": self.name, "shape": self.type.shape, "dtype": self.type.dtype}

    def _register(self) -> None:
        current_trace().root.variables[self.name] = self

    # --- reads and updates -----------------------------------------------------------------------
    @property
    def value(self):
        """The current value: a traced read inside jit, a copy of the buffer outside."""
        if current_trace() is not None:
            self._register()
            return bind("read_variable", [], self._attrs(), device=self.device)
        return self.numpy()

    def __array__(self, dtype=None, copy=None):
        value = self.value
        if isinstance(value, Tracer):
            return value.__array__()
        return value if dtype is None else value.astype(dtype)

    def _update(self, op: str, x) -> Variable:
        if current_trace() is not None:
            fnp = array_library()
            x = fnp.asarray(x)
            if tuple(fnp.shape(x)) != self.shape:
                try:
                    fits = fnp.broadcast_shapes(tuple(fnp.shape(x)), self.shape) == self.shape
                except FlowjitError:
                    fits = False
                if not fits:
                    raise self._shape_error(FlowjitTypeError, op, fnp.shape(x))  # as traced ops report shapes
                x = fnp.broadcast_to(x, self.shape)
            x = fnp.astype(x, self.type.dtype)
            self._register()
            bind(op, [x], self._attrs(), device=self.device)
            return self
        array = np.asarray(x)
        try:
            array = np.broadcast_to(array, self.shape)
        except ValueError:
            raise self._shape_error(FlowjitValueError, op, array.shape) from None  # as numpy reports them
        with self.lock, np.errstate(over="ignore"):
            home = variable_home(self.name)
            current = self._buffer if home is None else home.read()
            if op == "assign":
                new = array
            elif op == "assign_add":
                new = current + array
            else:
                new = current - array
            if home is None:
                np.copyto(self._buffer, new, casting="unsafe")
            else:
                home.write(np.array(np.broadcast_to(new, self.shape), dtype=self.dtype))
        return self

    def _shape_error(self, kind: type[FlowjitError], op: str, shape) -> FlowjitError:
        return kind(
            f"{user_location()}: {op} to variable '{self.name}' of shape {self.shape}: value has shape "
            f"{tuple(shape)}, which does not broadcast to it"
        )

    def assign(self, x) -> Variable:
        """Set the variable to `x` (broadcast and cast to its shape and dtype)."""
        return self._update("assign", x)

    def assign_add(self, x) -> Variable:
        """Add `x` to the variable in place."""
        return self._update("assign_add", x)

    def assign_sub(self, x) -> Variable:
        """Subtract `x` from the variable in place."""
        return self._update("assign_sub", x)

    def numpy(self) -> np.ndarray:
        """A copy of the current value (outside traced code), fetched from the task it lives in."""
        with self.lock:
            home = variable_home(self.name)
            return self._buffer.copy() if home is None else home.read()
