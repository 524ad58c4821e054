"""Shared shape/dtype rules and attribute checks used by op definitions."""

from __future__ import annotations

from collections.abc import Sequence

from flowjit.errors import ShapeError
from flowjit.ir.dtypes import DType
from flowjit.ir.types import TensorType


def fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ",".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def check_dtype(t: TensorType, allowed: Sequence[DType], what: str = "operand") -> None:
    if t.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise ShapeError(f"{what} has dtype {t.dtype.name}; expected one of {names}")


def check_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1) or (rank == 0):
        raise ShapeError(f"{what} {axis} is out of range for a rank-{rank} operand")
    return axis % rank


def check_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    norm = []
    for a in axes:
        if not -rank <= a < rank:
            raise ShapeError(f"axis {a} is out of range for a rank-{rank} operand")
        norm.append(a % rank)
    if len(set(norm)) != len(norm):
        raise ShapeError(f"repeated axis in {tuple(axes)}")
    return tuple(norm)


def same_types(types: Sequence[TensorType], what: str = "operands") -> TensorType:
    first = types[0]
    for t in types[1:]:
        if t.shape != first.shape:
            raise ShapeError(f"{what} must have equal shapes; found {fmt_shape(first.shape)} and {fmt_shape(t.shape)}")
        if t.dtype != first.dtype:
            raise ShapeError(f"{what} must have equal dtypes; found {first.dtype} and {t.dtype}")
    return first


def int_tuple(value, name: str, length: int | None = None) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except TypeError as e:
        raise ShapeError(f"attribute '{name}' must be a sequence of ints; found {value!r}") from e
    if length is not None and len(out) != length:
        raise ShapeError(f"attribute '{name}' must have {length} entries; found {len(out)}")
    return out
