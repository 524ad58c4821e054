"""numpy.linalg.solve, inv, det and slogdet, on an LU factorization with partial pivoting.

Compiled: one loop iteration per column j (LAPACK's getf2, vectorized): the row p >= j of largest
|a_pj| is swapped with row j (two masked selects, the permutation and its parity carried along),
the multipliers l = a[j+1:, j] / a_jj are stored below the diagonal and the trailing block takes
the rank-1 update a -= l a[j, j+1:]. O(n^2) per iteration, O(n^3) in all. A zero pivot (a
singular matrix) leaves its column alone, so `det` is 0 and `solve` gives inf/nan (numpy raises
LinAlgError; so does an eager call). A solve is then P b, a unit-lower and an upper substitution.

Gradients (custom_vjps, the closed forms JAX uses): for x = a^-1 b, b_bar = a^-T x_bar and
a_bar = -b_bar x^T; inv is solve(a, I); for d = det(a), a_bar = d_bar d a^-T; for slogdet,
a_bar = logabsdet_bar a^-T (sign has no gradient). Each a^-T is a solve with the saved factors.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.frontend.control_flow import fori_loop
from flowjit.frontend.custom_derivatives import custom_vjp
from flowjit.ir.location import user_location
from flowjit.numpy.creation import eye, ones
from flowjit.numpy.elementwise import (
    abs,
    divide,
    equal,
    greater,
    greater_equal,
    log,
    logical_and,
    multiply,
    negative,
    sign,
    subtract,
    where,
)
from flowjit.numpy.indexing import diagonal
from flowjit.numpy.linalg.operands import (
    column,
    entry,
    float_matrices,
    index_column,
    index_row,
    is_traced,
    lapack,
    row,
    zero_unless,
)
from flowjit.numpy.linalg.products import matmul
from flowjit.numpy.linalg.triangular import substitute, triangular_solve
from flowjit.numpy.promotion import _cast_all, _dtype_of, asarray, broadcast_shapes, broadcast_to, result_type
from flowjit.numpy.reductions import argmax, prod, sum
from flowjit.numpy.shapes import expand_dims, ndim, reshape, shape, swapaxes

SlogdetResult = namedtuple("SlogdetResult", ["sign", "logabsdet"])


def solve(a, b):
    """numpy.linalg.solve: x with a @ x = b. `b` is a vector (M,) or a stack of matrices
    (..., M, K) (numpy 2's rule); leading dimensions broadcast."""
    a = float_matrices(a, "solve")
    b = asarray(b)
    a, b = _cast_all([a, b], result_type(a, b))
    vector = ndim(b) == 1
    if ndim(b) == 0 or shape(b)[-2 if not vector else 0] != shape(a)[-1]:
        wanted = f"({shape(a)[-1]},) or (..., {shape(a)[-1]}, K)"
        raise op_error(
            FlowjitValueError,
            user_location(),
            "solve",
            f"b must have shape {wanted} for a of shape {shape(a)}; found {shape(b)}. A stack of vectors is "
            "b[..., None] (numpy 2 reads a 2-D b as a matrix)",
        )
    if not is_traced(a, b):
        return lapack("solve", np.linalg.solve, np.asarray(a), np.asarray(b))
    b2 = reshape(b, (shape(b)[0], 1)) if vector else b
    batch = broadcast_shapes(shape(a)[:-2], shape(b2)[:-2], op="solve")
    x = _solve(broadcast_to(a, batch + shape(a)[-2:]), broadcast_to(b2, batch + shape(b2)[-2:]))
    return reshape(x, shape(x)[:-1]) if vector else x


def inv(a):
    """numpy.linalg.inv: the inverse of each matrix of `a` (..., n, n)."""
    a = float_matrices(a, "inv")
    if not is_traced(a):
        return lapack("inv", np.linalg.inv, a)
    n = shape(a)[-1]
    return _solve(a, broadcast_to(eye(n, dtype=_dtype_of(a).np_dtype), shape(a)))


def det(a):
    """numpy.linalg.det: the determinant of each matrix of `a` (..., n, n)."""
    a = float_matrices(a, "det")
    if not is_traced(a):
        return lapack("det", np.linalg.det, a)
    return _det(a)


def slogdet(a):
    """numpy.linalg.slogdet: (sign, log|det|) of each matrix of `a`; a singular matrix gives
    (0, -inf)."""
    a = float_matrices(a, "slogdet")
    if not is_traced(a):
        return SlogdetResult(*lapack("slogdet", np.linalg.slogdet, a))
    return SlogdetResult(*_slogdet(a))


# --- the factorization and its solves ---------------------------------------------------------------------


def lu_factor(a):
    """(lu, perm, parity) with P a = L U: L's multipliers below lu's diagonal, U on and above it;
    perm (..., n, 1) the original row of each row (P b = b[perm]); parity (..., 1, 1) is +-1."""
    n = shape(a)[-1]
    rows, cols = index_column(n), index_row(n)

    def eliminate_column(j, carry):
        work, perm, parity = carry
        p = argmax(where(greater_equal(rows, j), abs(column(work, j)), -1.0), axis=-2, keepdims=True)
        at_p, at_j = equal(rows, p), equal(rows, j)
        pivot_row = sum(zero_unless(at_p, work), axis=-2, keepdims=True)
        work = where(at_j, pivot_row, where(at_p, row(work, j), work))
        pivot_origin = sum(zero_unless(at_p, perm), axis=-2, keepdims=True)
        perm = where(at_j, pivot_origin, where(at_p, row(perm, j), perm))
        parity = where(equal(p, j), parity, negative(parity))
        pivot = entry(work, j, j)
        multipliers = zero_unless(greater(rows, j), divide(column(work, j), where(equal(pivot, 0), 1.0, pivot)))
        work = subtract(work, multiply(multipliers, zero_unless(greater(cols, j), pivot_row)))
        work = where(logical_and(greater(rows, j), equal(cols, j)), multipliers, work)
        return work, perm, parity

    start_perm = broadcast_to(rows, shape(a)[:-1] + (1,))
    start_parity = ones(shape(a)[:-2] + (1, 1), _dtype_of(a).np_dtype)
    return fori_loop(0, n, eliminate_column, (a, start_perm, start_parity))


def _permutation_matrix(perm, dtype):
    """P as a matrix: P[i, c] = 1 where perm[i] = c, so P b = b[perm]."""
    return where(equal(perm, index_row(shape(perm)[-2])), np.ones((), dtype), np.zeros((), dtype))


def lu_solve(lu, perm, b, transpose: bool = False, solve_triangle=substitute):
    """x with a x = b (a^T x = b with `transpose`) from a's factors; b is (..., n, k)."""
    p = _permutation_matrix(perm, _dtype_of(b).np_dtype)
    if not transpose:  # a = P^T L U
        y = solve_triangle(lu, matmul(p, b), lower=True, unit_diagonal=True)
        return solve_triangle(lu, y, lower=False)
    u_t = swapaxes(lu, -1, -2)  # a^T = U^T L^T P
    y = solve_triangle(u_t, b, lower=True)
    return matmul(swapaxes(p, -1, -2), solve_triangle(u_t, y, lower=False, unit_diagonal=True))


def _differentiable_triangle(a, b, lower: bool, unit_diagonal: bool = False):
    return triangular_solve(a, b, lower, unit_diagonal=unit_diagonal)


def _inverse_transpose(lu, perm):
    """a^-T from a's factors, differentiable (for the gradients of det and slogdet)."""
    n = shape(lu)[-1]
    identity = broadcast_to(eye(n, dtype=_dtype_of(lu).np_dtype), shape(lu))
    return lu_solve(lu, perm, identity, transpose=True, solve_triangle=_differentiable_triangle)


# --- the compiled functions, with their gradients ------------------------------------------------------------


def _solve_fwd(a, b):
    lu, perm, _ = lu_factor(a)
    x = lu_solve(lu, perm, b)
    return x, (lu, perm, x)


def _solve_bwd(residuals, x_bar):
    lu, perm, x = residuals
    b_bar = lu_solve(lu, perm, x_bar, transpose=True, solve_triangle=_differentiable_triangle)
    return negative(matmul(b_bar, swapaxes(x, -1, -2))), b_bar


@custom_vjp
def _solve(a, b):
    return _solve_fwd(a, b)[0]


_solve.defvjp(_solve_fwd, _solve_bwd)


def _det_fwd(a):
    lu, perm, parity = lu_factor(a)
    d = multiply(reshape(parity, shape(parity)[:-2]), prod(diagonal(lu, 0, -2, -1), axis=-1))
    return d, (lu, perm, d)


def _det_bwd(residuals, d_bar):
    lu, perm, d = residuals
    scale = expand_dims(multiply(d_bar, d), (-1, -2))
    return (multiply(scale, _inverse_transpose(lu, perm)),)


@custom_vjp
def _det(a):
    return _det_fwd(a)[0]


_det.defvjp(_det_fwd, _det_bwd)


def _slogdet_fwd(a):
    lu, perm, parity = lu_factor(a)
    pivots = diagonal(lu, 0, -2, -1)
    sign_ = multiply(reshape(parity, shape(parity)[:-2]), prod(sign(pivots), axis=-1))
    return (sign_, sum(log(abs(pivots)), axis=-1)), (lu, perm)


def _slogdet_bwd(residuals, cotangents):
    lu, perm = residuals
    _, logabsdet_bar = cotangents
    return (multiply(expand_dims(logabsdet_bar, (-1, -2)), _inverse_transpose(lu, perm)),)


@custom_vjp
def _slogdet(a):
    return _slogdet_fwd(a)[0]


_slogdet.defvjp(_slogdet_fwd, _slogdet_bwd)
