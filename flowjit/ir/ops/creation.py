"""Ops that create tensors (`constant`, `iota`) and the dtype conversion `convert`."""

from __future__ import annotations

import numpy as np

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import CONVERSION, CREATION, defop
from flowjit.ir.ops.rules import check_axis, int_tuple
from flowjit.ir.types import TensorType


def _constant_rule(types, attrs):
    value = attrs["value"]
    if not isinstance(value, np.ndarray):
        raise ShapeError(f"attribute 'value' must be a numpy array; found {type(value).__name__}")
    return [TensorType(value.shape, dt.dtype(value.dtype))]


defop("constant", CREATION, _constant_rule, lambda *, value: value.copy(), 0, attrs=("value",), doc="a literal tensor")


def _iota_rule(types, attrs):
    shape = int_tuple(attrs["shape"], "shape")
    check_axis(attrs["dimension"], len(shape), "dimension")
    dtype = dt.dtype(attrs["dtype"])
    if dtype.is_bool:
        raise ShapeError("iota needs a numeric dtype; found bool")
    return [TensorType(shape, dtype)]


def _iota(*, shape, dtype, dimension):
    shape = tuple(shape)
    ramp = np.arange(shape[dimension], dtype=dt.dtype(dtype).np_dtype)
    view = [1] * len(shape)
    view[dimension] = shape[dimension]
    return np.broadcast_to(ramp.reshape(view), shape).copy()


defop(
    "iota",
    CREATION,
    _iota_rule,
    _iota,
    0,
    attrs=("shape", "dtype", "dimension"),
    doc="0, 1, 2, ... along `dimension`, broadcast to `shape`",
)


def _convert_rule(types, attrs):
    return [types[0].with_dtype(dt.dtype(attrs["dtype"]))]


def convert_array(x: np.ndarray, to: dt.DType) -> np.ndarray:
    """numpy cast with flowjit's defined semantics: float -> int saturates and maps nan to 0;
    anything -> bool is `x != 0`."""
    if to.is_bool:
        return x != 0
    if to.is_int and dt.dtype(x.dtype).is_float:  # bfloat16's numpy kind is 'V', not 'f'
        info = np.iinfo(to.np_dtype)
        wide = x.astype(np.float64)
        wide = np.where(np.isnan(wide), 0.0, np.trunc(wide))
        # float(info.max) rounds up past the range for int64; compare before casting.
        out = np.where(wide >= float(info.max), info.max, 0).astype(to.np_dtype)
        low = wide <= float(info.min)
        mid = ~low & (wide < float(info.max))
        out[low] = info.min
        out[mid] = wide[mid].astype(to.np_dtype)
        return out
    return x.astype(to.np_dtype)


defop(
    "convert",
    CONVERSION,
    _convert_rule,
    lambda x, *, dtype: convert_array(x, dt.dtype(dtype)),
    1,
    attrs=("dtype",),
    doc="elementwise dtype conversion (float->int saturates, nan->0)",
)
