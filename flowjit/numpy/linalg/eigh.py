"""numpy.linalg.eigh: eigenvalues (ascending) and orthonormal eigenvectors of symmetric matrices.

Compiled: two-sided parallel Jacobi (jacobi.py) on the symmetric matrix built from a's lower
(UPLO="L") or upper triangle: rotations W <- J^T W J, V <- V J until the off-diagonal Frobenius
norm is below n eps |W|_F. O(n^3) per sweep. Eigenvalues come out as accurate as LAPACK's (to
n eps |a|), eigenvectors to eps |a| / gap. Each eigenvector's largest-magnitude entry is made
positive (the first such entry on ties), eagerly too, so results do not depend on where they ran.

Gradient (a custom_vjp, the usual formula for distinct eigenvalues): with F_ij = 1 / (w_j - w_i)
off the diagonal and 0 on it, a_bar = V (diag(w_bar) + F o (V^T V_bar)) V^T, mapped onto the
triangle that was read. Repeated eigenvalues give inf/nan gradients (as in JAX).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.frontend.control_flow import fori_loop, while_loop
from flowjit.frontend.custom_derivatives import custom_vjp
from flowjit.ir.location import user_location
from flowjit.numpy.creation import _tri_mask, eye
from flowjit.numpy.elementwise import (
    abs,
    add,
    divide,
    equal,
    greater,
    less,
    logical_and,
    multiply,
    not_equal,
    subtract,
    where,
)
from flowjit.numpy.indexing import diagonal, take_along_axis
from flowjit.numpy.linalg.jacobi import (
    MAX_SWEEPS,
    broadcast_index,
    pair_values,
    rotate_columns,
    rotate_rows,
    rotation,
    signed_sine,
    step_partners,
)
from flowjit.numpy.linalg.operands import float_matrices, index_column, index_row, is_traced, lapack, zero_unless
from flowjit.numpy.linalg.products import matmul
from flowjit.numpy.promotion import _dtype_of, broadcast_to
from flowjit.numpy.reductions import argmax, max, sum
from flowjit.numpy.shapes import expand_dims, pad, reshape, shape, swapaxes
from flowjit.numpy.sorting import argsort

EighResult = namedtuple("EighResult", ["eigenvalues", "eigenvectors"])


def eigh(a, UPLO: str = "L"):  # noqa: N803 (numpy's name)
    """numpy.linalg.eigh of each matrix of `a` (..., n, n), reading its lower (UPLO="L") or upper
    ("U") triangle: (eigenvalues (..., n) ascending, eigenvectors (..., n, n) as columns)."""
    a = float_matrices(a, "eigh")
    if UPLO not in ("L", "U"):
        raise op_error(FlowjitValueError, user_location(), "eigh", f"UPLO must be 'L' or 'U'; found {UPLO!r}")
    if not is_traced(a):
        w, v = lapack("eigh", np.linalg.eigh, a, UPLO)
        return EighResult(w, multiply(v, largest_entry_signs(v)))
    n = shape(a)[-1]
    lower = _tri_mask(n, n, 0)
    symmetric = where(lower, a, swapaxes(a, -1, -2)) if UPLO == "L" else where(lower, swapaxes(a, -1, -2), a)
    return EighResult(*_symmetric_eigh(symmetric))


def largest_entry_signs(vectors):
    """+-1 per column of `vectors` (..., n, k): the sign of its largest-magnitude entry (+1 for 0)."""
    biggest = take_along_axis(vectors, argmax(abs(vectors), axis=-2, keepdims=True), -2)
    dtype = _dtype_of(vectors).np_dtype
    return where(less(biggest, 0), np.asarray(-1, dtype), np.asarray(1, dtype))


def _off_diagonal_ratio(w):
    """The largest |offdiag(w)|_F^2 / |w|_F^2 over the stack (0 for zero matrices)."""
    m = shape(w)[-1]
    squares = multiply(w, w)
    off = sum(zero_unless(not_equal(index_column(m), index_row(m)), squares), axis=(-2, -1))
    total = sum(squares, axis=(-2, -1))
    return max(divide(off, where(equal(total, 0), 1.0, total)))


def _jacobi(a):
    """(eigenvalues unsorted (..., n), eigenvectors (..., n, n)) of traced symmetric `a`."""
    n = shape(a)[-1]
    m = n + n % 2
    dtype = _dtype_of(a).np_dtype
    w = pad(a, [(0, 0)] * (len(shape(a)) - 2) + [(0, m - n), (0, m - n)]) if m != n else a
    v = broadcast_to(eye(m, dtype=dtype), shape(w))
    tolerance = float(n * np.finfo(dtype).eps) ** 2

    def rotate_pairs(step, carry):
        w, v = carry
        partner, first = step_partners(m, step)
        at_partner = take_along_axis(w, broadcast_index(partner, w, -2), -1)  # w[i, partner(i)]
        app, aqq = pair_values(diagonal(w, 0, -2, -1), partner, first)
        apq, _ = pair_values(reshape(at_partner, shape(at_partner)[:-1]), partner, first)
        c, s = rotation(app, aqq, apq)
        s = signed_sine(s, first)
        return rotate_columns(rotate_rows(w, partner, c, s), partner, c, s), rotate_columns(v, partner, c, s)

    def sweep(carry):
        count, w, v, _ = carry
        w, v = fori_loop(0, m - 1, rotate_pairs, (w, v))
        return add(count, 1), w, v, _off_diagonal_ratio(w)

    def unconverged(carry):
        count, _, _, ratio = carry
        return logical_and(less(count, MAX_SWEEPS), greater(ratio, tolerance))

    start = (np.asarray(0, np.int64), w, v, _off_diagonal_ratio(w))
    _, w, v, _ = while_loop(unconverged, sweep, start)
    return diagonal(w, 0, -2, -1)[..., :n], v[..., :n, :n]


def _eigh_fwd(a):
    w, v = _jacobi(a)
    order = argsort(w, axis=-1)
    w = take_along_axis(w, order, -1)
    v = take_along_axis(v, expand_dims(order, -2), -1)
    v = multiply(v, largest_entry_signs(v))
    return (w, v), (w, v)


def _eigh_bwd(residuals, cotangents):
    w, v = residuals
    w_bar, v_bar = cotangents
    n = shape(w)[-1]
    gaps = subtract(expand_dims(w, -2), expand_dims(w, -1))  # w_j - w_i
    off = not_equal(index_column(n), index_row(n))
    f = zero_unless(off, divide(1.0, where(off, gaps, 1.0)))
    inner = add(
        multiply(f, matmul(swapaxes(v, -1, -2), v_bar)),
        multiply(eye(n, dtype=_dtype_of(w).np_dtype), expand_dims(w_bar, -1)),
    )
    return (matmul(v, matmul(inner, swapaxes(v, -1, -2))),)


@custom_vjp
def _symmetric_eigh(a):
    return _eigh_fwd(a)[0]


_symmetric_eigh.defvjp(_eigh_fwd, _eigh_bwd)
