"""numpy.linalg.qr: a = Q R with orthonormal Q and upper-triangular R, by Householder reflections.

Compiled: one loop iteration per column j < k = min(m, n): the reflection H = I - 2 v v^T maps the
column's part on and below the diagonal, x, to beta e_j with beta = -sign(x_j) |x| (LAPACK's
dlarfg: so R's signs are LAPACK's and numpy's), and R <- H R; a column already zero below the
diagonal gets no reflection, as in LAPACK. The unit vectors v are kept, and Q = H_0 ... H_{k-1} I
is accumulated backwards by a second loop, on only the k (reduced) or m (complete) columns needed.
O(mn) + O(m k) per iteration. No custom gradient: autodiff differentiates the loops.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.frontend.control_flow import fori_loop
from flowjit.ir.location import user_location
from flowjit.numpy.creation import eye, triu, zeros
from flowjit.numpy.elementwise import (
    add,
    divide,
    equal,
    greater,
    greater_equal,
    less,
    multiply,
    sqrt,
    subtract,
    where,
)
from flowjit.numpy.linalg.operands import column, entry, float_matrices, index_column, index_row, is_traced
from flowjit.numpy.linalg.products import matmul
from flowjit.numpy.promotion import _dtype_of, broadcast_to
from flowjit.numpy.reductions import sum
from flowjit.numpy.shapes import shape, swapaxes

QRResult = namedtuple("QRResult", ["Q", "R"])

_MODES = ("reduced", "complete", "r")


def qr(a, mode: str = "reduced"):
    """numpy.linalg.qr of each matrix of `a` (..., m, n), k = min(m, n): mode "reduced" gives Q
    (..., m, k) and R (..., k, n), "complete" Q (..., m, m) and R (..., m, n), "r" only R (..., k, n)."""
    a = float_matrices(a, "qr", square=False)
    if mode not in _MODES:
        raise op_error(
            FlowjitValueError, user_location(), "qr", f"mode must be one of {', '.join(_MODES)}; found {mode!r}"
        )
    if not is_traced(a):
        out = np.linalg.qr(a, mode=mode)
        return out if mode == "r" else QRResult(*out)
    m, n = shape(a)[-2:]
    k = min(m, n)
    r, reflectors = householder(a)
    if mode == "r":
        return r[..., :k, :]
    q = accumulate_q(reflectors, m if mode == "complete" else k)
    return QRResult(q, r if mode == "complete" else r[..., :k, :])


def householder(a):
    """(R (..., m, n), the unit Householder vectors (..., m, k)) of traced `a`."""
    m, n = shape(a)[-2:]
    k = min(m, n)
    rows, reflector_cols = index_column(m), index_row(k)
    dtype = _dtype_of(a).np_dtype

    def reflect_column(j, carry):
        r, reflectors = carry
        x = where(greater_equal(rows, j), column(r, j), np.zeros((), dtype))
        alpha = entry(x, j, 0)
        tail = sum(where(greater(rows, j), multiply(x, x), np.zeros((), dtype)), axis=-2, keepdims=True)
        beta = multiply(where(less(alpha, 0), 1.0, -1.0), sqrt(add(multiply(alpha, alpha), tail)))
        v = where(equal(rows, j), subtract(alpha, beta), x)
        no_reflection = equal(tail, 0)
        length = sqrt(sum(multiply(v, v), axis=-2, keepdims=True))
        v = where(no_reflection, np.zeros((), dtype), divide(v, where(no_reflection, 1.0, length)))
        r = subtract(r, multiply(2.0, matmul(v, matmul(swapaxes(v, -1, -2), r))))
        return r, where(equal(reflector_cols, j), v, reflectors)

    r, reflectors = fori_loop(0, k, reflect_column, (a, zeros(shape(a)[:-1] + (k,), dtype)))
    return triu(r), reflectors


def accumulate_q(reflectors, columns: int):
    """The first `columns` columns of Q = H_0 ... H_{k-1}, applied backwards to I's columns."""
    m, k = shape(reflectors)[-2:]
    start = broadcast_to(eye(m, columns, dtype=_dtype_of(reflectors).np_dtype), shape(reflectors)[:-2] + (m, columns))

    def apply_reflection(t, q):
        v = column(reflectors, k - 1 - t)
        return subtract(q, multiply(2.0, matmul(v, matmul(swapaxes(v, -1, -2), q))))

    return fori_loop(0, k, apply_reflection, start)
