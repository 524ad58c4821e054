"""Tensor types: a static shape and an element dtype. `tensor<256x784xf32>`, `tensor<f32>` (scalar)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowjit.ir.dtypes import DType, dtype


@dataclass(frozen=True)
class TensorType:
    """The type of every IR value: a static shape (tuple of non-negative ints) and a `DType`."""

    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self):
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype(self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def with_dtype(self, dt) -> TensorType:
        return TensorType(self.shape, dtype(dt))

    def with_shape(self, shape) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def __str__(self) -> str:
        dims = "".join(f"{d}x" for d in self.shape)
        return f"tensor<{dims}{self.dtype.name}>"

    __repr__ = __str__
