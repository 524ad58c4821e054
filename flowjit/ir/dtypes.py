"""Element types of flowjit tensors, their numpy equivalents and numpy-style promotion.

A `DType` is an interned, immutable descriptor; compare with `is` or `==`. Short names (`f32`,
`i64`, `bool`) are what the text IR prints; `np_dtype` is the host representation (bfloat16 comes
from `ml_dtypes`, as in JAX).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    """One element type: its IR name, numpy dtype, kind ('b', 'i', 'f') and width in bits."""

    name: str
    np_dtype: np.dtype
    kind: str
    bits: int

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind == "i"

    @property
    def is_bool(self) -> bool:
        return self.kind == "b"

    @property
    def itemsize(self) -> int:
        return max(1, self.bits // 8)

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


bool_ = DType("bool", np.dtype(np.bool_), "b", 8)
int32 = DType("i32", np.dtype(np.int32), "i", 32)
int64 = DType("i64", np.dtype(np.int64), "i", 64)
float16 = DType("f16", np.dtype(np.float16), "f", 16)
bfloat16 = DType("bf16", np.dtype(ml_dtypes.bfloat16), "f", 16)
float32 = DType("f32", np.dtype(np.float32), "f", 32)
float64 = DType("f64", np.dtype(np.float64), "f", 64)

ALL_DTYPES = (bool_, int32, int64, float16, bfloat16, float32, float64)
FLOAT_DTYPES = (float16, bfloat16, float32, float64)
INT_DTYPES = (int32, int64)
NUMERIC_DTYPES = INT_DTYPES + FLOAT_DTYPES

_BY_NAME = {d.name: d for d in ALL_DTYPES}
_ALIASES = {
    "bool": bool_,
    "i1": bool_,
    "int32": int32,
    "int64": int64,
    "float16": float16,
    "half": float16,
    "bfloat16": bfloat16,
    "float32": float32,
    "float": float32,
    "float64": float64,
    "double": float64,
}
_BY_NP = {d.np_dtype: d for d in ALL_DTYPES}


def dtype(spec) -> DType:
    """Return the `DType` for a name (`'f32'`, `'float32'`), numpy dtype, Python type or `DType`.

    Raises ValueError naming the supported dtypes when `spec` is not one of them.
    """
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        found = _BY_NAME.get(spec) or _ALIASES.get(spec)
        if found is not None:
            return found
    if spec is bool:
        return bool_
    if spec is int:
        return int64
    if spec is float:
        return float32
    try:
        np_dt = np.dtype(spec)
    except TypeError:
        np_dt = None
    if np_dt is not None and np_dt in _BY_NP:
        return _BY_NP[np_dt]
    supported = ", ".join(f"{d.name} ({d.np_dtype.name})" for d in ALL_DTYPES)
    raise ValueError(f"unsupported dtype {spec!r}; flowjit supports {supported}")


def is_supported_numpy_dtype(np_dt: np.dtype) -> bool:
    return np.dtype(np_dt) in _BY_NP


# Promotion lattice in the style of JAX's: bool < ints < floats; within a kind, the wider wins.
# Mixing bf16 and f16 gives f32. Python scalars are "weak": they take the other operand's dtype
# when their kind is not higher (float32 * 2.0 -> float32, int32 + 1 -> int32).
_KIND_RANK = {"b": 0, "i": 1, "f": 2}


def promote(a: DType, b: DType) -> DType:
    """The result dtype of a binary op on two strongly typed operands."""
    if a is b:
        return a
    if _KIND_RANK[a.kind] != _KIND_RANK[b.kind]:
        return a if _KIND_RANK[a.kind] > _KIND_RANK[b.kind] else b
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if a.bits >= b.bits else b


def promote_weak(strong: DType, weak_kind: str) -> DType:
    """The dtype of `strong op scalar` where the Python scalar has kind 'b', 'i' or 'f'."""
    if _KIND_RANK[weak_kind] <= _KIND_RANK[strong.kind]:
        return strong
    return float32 if weak_kind == "f" else int64 if weak_kind == "i" else bool_


def default_for_kind(kind: str) -> DType:
    """The dtype a lone Python scalar of this kind becomes (float -> f32, int -> i64, as in JAX x32 off)."""
    return {"b": bool_, "i": int64, "f": float32}[kind]
