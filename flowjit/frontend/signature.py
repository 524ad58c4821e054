"""What a jitted call is specialized on: its `Signature` (the dynamic arguments' pytree structure
and leaf types, the static arguments by value), the abstract value of each argument leaf
(`_abstract`: arrays, Python scalars, `ShapeDtype`, `Variable` as `VariableArg`) with the errors
for what flowjit does not take, the array-only fast-path key (`_array_key`), and the conversion of
a leaf to the host array an executable runs on (`_to_host`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import TreeDef
from flowjit.frontend.trace import Tracer, escaped_tracer_error
from flowjit.frontend.variables import Variable
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.ir.types import TensorType

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


# Binds a call's (args, kwargs) like the jitted function: -> (Signature, bound arguments, leaves, paths).
Binder = Callable[[tuple, dict], tuple]
