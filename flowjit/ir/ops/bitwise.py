"""Bitwise ops on integers (and bool for and/or/xor/not): the building blocks of the counter-based
random number generator in `flowjit.random`. Shifts are logical or arithmetic on the two's-complement
bits; a shift by >= the bit width gives 0 (logical/left) or the sign fill (arithmetic), never UB."""

from __future__ import annotations

import numpy as np

from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY, defop
from flowjit.ir.ops.rules import check_dtype, same_types

_INT_OR_BOOL = (dt.bool_, *dt.INT_DTYPES)


def _binary_rule(allowed):
    def infer(types, attrs):
        t = same_types(types)
        check_dtype(t, allowed)
        return [t]

    return infer


def _unsigned(x):
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint64)


def _shift_amount(x, y):
    bits = x.dtype.itemsize * 8
    return np.clip(y, 0, bits).astype(np.int64), bits


def _shift_left(x, y):
    amount, bits = _shift_amount(x, y)
    u = _unsigned(x)
    out = np.where(amount >= bits, 0, u << np.minimum(amount, bits - 1).astype(u.dtype))
    return out.astype(u.dtype).view(x.dtype)


def _shift_right_logical(x, y):
    amount, bits = _shift_amount(x, y)
    u = _unsigned(x)
    out = np.where(amount >= bits, 0, u >> np.minimum(amount, bits - 1).astype(u.dtype))
    return out.astype(u.dtype).view(x.dtype)


def _shift_right_arithmetic(x, y):
    amount, bits = _shift_amount(x, y)
    return (x >> np.minimum(amount, bits - 1).astype(x.dtype)).astype(x.dtype)


for _name, _fn, _doc in (
    ("bitwise_and", np.bitwise_and, "x & y"),
    ("bitwise_or", np.bitwise_or, "x | y"),
    ("bitwise_xor", np.bitwise_xor, "x ^ y"),
):
    defop(_name, ELEMENTWISE_BINARY, _binary_rule(_INT_OR_BOOL), _fn, 2, doc=_doc)

for _name, _fn, _doc in (
    ("shift_left", _shift_left, "x << y (0 when y >= bit width)"),
    ("shift_right_logical", _shift_right_logical, "x >>> y on the unsigned bits (0 when y >= bit width)"),
    ("shift_right_arithmetic", _shift_right_arithmetic, "x >> y with sign fill"),
):
    defop(_name, ELEMENTWISE_BINARY, _binary_rule(dt.INT_DTYPES), _fn, 2, doc=_doc)


def _not_rule(types, attrs):
    check_dtype(types[0], _INT_OR_BOOL)
    return [types[0]]


defop("bitwise_not", ELEMENTWISE_UNARY, _not_rule, np.invert, 1, doc="~x")
