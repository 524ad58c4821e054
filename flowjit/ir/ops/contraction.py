"""Contractions: `dot_general` (batched matmul with named contracting/batch dims) and `conv2d`."""

from __future__ import annotations

import math

import numpy as np

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import CONTRACTION, defop
from flowjit.ir.ops.rules import check_dtype, fmt_shape, int_tuple
from flowjit.ir.types import TensorType


def dot_dims(attrs):
    return (
        int_tuple(attrs["lhs_contract"], "lhs_contract"),
        int_tuple(attrs["rhs_contract"], "rhs_contract"),
        int_tuple(attrs["lhs_batch"], "lhs_batch"),
        int_tuple(attrs["rhs_batch"], "rhs_batch"),
    )


def _free_dims(rank, contract, batch):
    return [i for i in range(rank) if i not in contract and i not in batch]


def _dot_general_rule(types, attrs):
    a, b = types
    check_dtype(a, dt.NUMERIC_DTYPES, "lhs")
    if a.dtype != b.dtype:
        raise ShapeError(f"lhs and rhs must have equal dtypes; found {a.dtype} and {b.dtype}")
    lc, rc, lb, rb = dot_dims(attrs)
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ShapeError("lhs and rhs need the same number of contracting and batch dimensions")
    for dims, t, side in ((lc + lb, a, "lhs"), (rc + rb, b, "rhs")):
        if len(set(dims)) != len(dims) or any(not 0 <= d < t.rank for d in dims):
            raise ShapeError(f"bad {side} dimension numbers {dims} for a rank-{t.rank} operand")
    for x, y in zip(lc, rc):
        if a.shape[x] != b.shape[y]:
            raise ShapeError(
                f"contracting dimension mismatch: lhs {fmt_shape(a.shape)} dim {x} is {a.shape[x]}, "
                f"rhs {fmt_shape(b.shape)} dim {y} is {b.shape[y]}"
            )
    for x, y in zip(lb, rb):
        if a.shape[x] != b.shape[y]:
            raise ShapeError(f"batch dimension mismatch: lhs dim {x} is {a.shape[x]}, rhs dim {y} is {b.shape[y]}")
    shape = (
        [a.shape[d] for d in lb]
        + [a.shape[d] for d in _free_dims(a.rank, lc, lb)]
        + [b.shape[d] for d in _free_dims(b.rank, rc, rb)]
    )
    return [TensorType(shape, a.dtype)]


def _dot_general(a, b, *, lhs_contract, rhs_contract, lhs_batch, rhs_batch):
    # As (batch, M, K) @ (batch, K, N): np.matmul calls BLAS gemm for floats (np.einsum does not: a
    # (1437, 784) @ (784, 1024) float64 product took 347 ms against 27).
    lf = _free_dims(a.ndim, lhs_contract, lhs_batch)
    rf = _free_dims(b.ndim, rhs_contract, rhs_batch)
    batch = [a.shape[d] for d in lhs_batch]
    m, k, n = (
        math.prod(a.shape[d] for d in lf),
        math.prod(a.shape[d] for d in lhs_contract),
        math.prod(b.shape[d] for d in rf),
    )
    acc = np.float32 if a.dtype in (dt.float16.np_dtype, dt.bfloat16.np_dtype) else a.dtype
    lhs = a.transpose([*lhs_batch, *lf, *lhs_contract]).astype(acc, copy=False).reshape(*batch, m, k)
    rhs = b.transpose([*rhs_batch, *rhs_contract, *rf]).astype(acc, copy=False).reshape(*batch, k, n)
    out = np.matmul(lhs, rhs).reshape(batch + [a.shape[d] for d in lf] + [b.shape[d] for d in rf])
    return out.astype(a.dtype, copy=False)


defop(
    "dot_general",
    CONTRACTION,
    _dot_general_rule,
    _dot_general,
    2,
    attrs=("lhs_contract", "rhs_contract", "lhs_batch", "rhs_batch"),
    doc="sum over contracting dims; result dims: batch, lhs free, rhs free (half types accumulate in f32)",
)


def conv_params(attrs):
    stride = int_tuple(attrs["stride"], "stride", 2)
    dilation = int_tuple(attrs["dilation"], "dilation", 2)
    padding = tuple(int_tuple(p, "padding", 2) for p in attrs["padding"])
    if len(padding) != 2:
        raise ShapeError(f"'padding' needs 2 (low, high) pairs; found {len(padding)}")
    return stride, padding, dilation


def _conv2d_rule(types, attrs):
    x, w = types
    check_dtype(x, dt.FLOAT_DTYPES, "input")
    if x.rank != 4 or w.rank != 4:
        raise ShapeError(f"expects NCHW input and OIHW weights; found {x} and {w}")
    if x.dtype != w.dtype:
        raise ShapeError(f"input and weights must have equal dtypes; found {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[1]:
        raise ShapeError(
            f"input has {x.shape[1]} channels (NCHW {fmt_shape(x.shape)}) but weights expect "
            f"{w.shape[1]} (OIHW {fmt_shape(w.shape)})"
        )
    stride, padding, dilation = conv_params(attrs)
    out = [x.shape[0], w.shape[0]]
    for i in range(2):
        span = x.shape[2 + i] + sum(padding[i]) - dilation[i] * (w.shape[2 + i] - 1) - 1
        if span < 0 or stride[i] < 1 or dilation[i] < 1 or min(padding[i]) < 0:
            raise ShapeError(f"the kernel does not fit spatial dimension {i} of {fmt_shape(x.shape)}")
        out.append(span // stride[i] + 1)
    return [x.with_shape(out)]


def _conv2d(x, w, *, stride, padding, dilation):
    acc = np.float32 if x.dtype in (dt.float16.np_dtype, dt.bfloat16.np_dtype) else x.dtype
    xp = np.pad(x.astype(acc), ((0, 0), (0, 0), tuple(padding[0]), tuple(padding[1])))
    n, c, h, wd = xp.shape
    o, _, kh, kw = w.shape
    oh = (h - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow), acc)
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilation[0], j * dilation[1]
            patch = xp[
                :, :, r0 : r0 + stride[0] * (oh - 1) + 1 : stride[0], c0 : c0 + stride[1] * (ow - 1) + 1 : stride[1]
            ]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j].astype(acc))
    return out.astype(x.dtype)


defop(
    "conv2d",
    CONTRACTION,
    _conv2d_rule,
    _conv2d,
    2,
    attrs=("stride", "padding", "dilation"),
    doc="2-D convolution (cross-correlation), NCHW input, OIHW weights",
)
