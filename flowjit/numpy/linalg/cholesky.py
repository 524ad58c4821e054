"""numpy.linalg.cholesky: a = L L^T for symmetric positive definite a, reading a's lower triangle.

Compiled: right-looking Cholesky, one loop iteration per column j: with c the column j of the
updated matrix, L[:, j] = c / sqrt(c_j) below the diagonal (sqrt(c_j) on it), then the rank-1
update W -= L[:, j] L[:, j]^T. O(n^2) vectorized work per iteration, O(n^3) in all. A matrix that
is not positive definite gives nan (numpy raises LinAlgError; so does an eager call here).

Gradient (a custom_vjp, Murray 2016, "Differentiation of the Cholesky decomposition"): with
Phi(X) the lower triangle of X with its diagonal halved, S = L^-T Phi(L^T L_bar) L^-1 (two
triangular solves) and a_bar = Phi(S + S^T): the gradient of a function of a's lower triangle.
"""

from __future__ import annotations

import numpy as np

from flowjit.frontend.control_flow import fori_loop
from flowjit.frontend.custom_derivatives import custom_vjp
from flowjit.numpy.creation import _tri_mask, zeros_like
from flowjit.numpy.elementwise import add, divide, equal, greater_equal, multiply, sqrt, subtract, where
from flowjit.numpy.linalg.operands import (
    column,
    entry,
    float_matrices,
    index_column,
    index_row,
    is_traced,
    lapack,
    zero_unless,
)
from flowjit.numpy.linalg.products import matmul
from flowjit.numpy.linalg.triangular import triangular_solve
from flowjit.numpy.shapes import shape, swapaxes


def cholesky(a, /, *, upper: bool = False):
    """numpy.linalg.cholesky: the lower-triangular L with a = L @ L.T (L.T with `upper=True`) of
    each matrix of `a` (..., n, n); only a's lower triangle is read."""
    a = float_matrices(a, "cholesky")
    if not is_traced(a):
        return lapack("cholesky", lambda x: np.linalg.cholesky(x, upper=upper), a)
    factor = lower_cholesky(a)
    return swapaxes(factor, -1, -2) if upper else factor


def _right_looking(a):
    n = shape(a)[-1]
    rows, cols = index_column(n), index_row(n)

    def eliminate_column(j, carry):
        work, factor = carry
        c = column(work, j)
        pivot = sqrt(entry(work, j, j))
        col = zero_unless(greater_equal(rows, j), divide(c, pivot))
        work = subtract(work, multiply(col, swapaxes(col, -1, -2)))
        return work, where(equal(cols, j), col, factor)

    return fori_loop(0, n, eliminate_column, (a, zeros_like(a)))[1]


def _phi(x):
    """The lower triangle of x with its diagonal halved."""
    n = shape(x)[-1]
    halved = where(equal(index_column(n), index_row(n)), multiply(x, 0.5), x)
    return zero_unless(_tri_mask(n, n, 0), halved)


def _cholesky_fwd(a):
    factor = _right_looking(a)
    return factor, factor


def _cholesky_bwd(factor, factor_bar):
    p = _phi(matmul(swapaxes(factor, -1, -2), factor_bar))
    s = triangular_solve(factor, p, lower=True, transpose=True)  # L^-T P
    s = swapaxes(triangular_solve(factor, swapaxes(s, -1, -2), lower=True, transpose=True), -1, -2)  # (.) L^-1
    return (_phi(add(s, swapaxes(s, -1, -2))),)


lower_cholesky = custom_vjp(_right_looking)
lower_cholesky.defvjp(_cholesky_fwd, _cholesky_bwd)
