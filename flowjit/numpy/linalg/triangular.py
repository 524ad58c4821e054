"""Triangular solves, the building block of every other solver here.

`substitute` is forward (lower) or back (upper) substitution as one loop of n iterations, each
solving one row for all right-hand sides at once: x_i = (b_i - a_i . x) / a_ii, where the rows of x
not solved yet are still zero. O(n^2 k) for k right-hand sides. It reads only a's triangle.

`triangular_solve` is the same with a gradient (a custom_vjp, so autodiff never differentiates the
loop): for x = a^-1 b, b_bar = a^-T x_bar (one more triangular solve) and a_bar = -b_bar x^T,
restricted to the triangle the solve reads.
"""

from __future__ import annotations

import functools

import numpy as np

from flowjit.frontend.control_flow import fori_loop
from flowjit.frontend.custom_derivatives import custom_vjp
from flowjit.numpy.creation import _tri_mask, zeros_like
from flowjit.numpy.elementwise import divide, equal, logical_not, negative, subtract, where
from flowjit.numpy.linalg.operands import entry, index_column, row, zero_unless
from flowjit.numpy.linalg.products import matmul
from flowjit.numpy.shapes import shape, swapaxes


def triangle_mask(n: int, lower: bool, unit_diagonal: bool = False):
    """Where an (n, n) triangular solve reads its matrix: the lower (upper) triangle, without the
    diagonal when it is known to be ones."""
    offset = -1 if unit_diagonal else 0
    if lower:
        return _tri_mask(n, n, offset)
    return logical_not(_tri_mask(n, n, -offset - 1))


def substitute(a, b, lower: bool, unit_diagonal: bool = False):
    """x with a x = b for triangular `a` (..., n, n) and `b` (..., n, k) of the same leading shape
    (traced values). Only a's triangle (and diagonal unless `unit_diagonal`) is read."""
    n = shape(a)[-1]
    rows = index_column(n)
    a = zero_unless(triangle_mask(n, lower, unit_diagonal), a)  # the other triangle may hold nan

    def solve_row(t, x):
        i = t if lower else n - 1 - t
        xi = subtract(row(b, i), matmul(row(a, i), x))
        if not unit_diagonal:
            xi = divide(xi, entry(a, i, i))
        return where(equal(rows, i), xi, x)

    return fori_loop(0, n, solve_row, zeros_like(b))


@functools.cache
def _differentiable_solver(lower: bool, unit_diagonal: bool) -> custom_vjp:
    """`substitute` for one (lower, unit_diagonal) with its gradient."""

    @custom_vjp
    def solve(a, b):
        return substitute(a, b, lower, unit_diagonal)

    def solve_fwd(a, b):
        x = substitute(a, b, lower, unit_diagonal)
        return x, (a, x)

    def solve_bwd(residuals, x_bar):
        a, x = residuals
        b_bar = _differentiable_solver(not lower, unit_diagonal)(swapaxes(a, -1, -2), x_bar)
        a_bar = negative(matmul(b_bar, swapaxes(x, -1, -2)))
        return zero_unless(triangle_mask(shape(a)[-1], lower, unit_diagonal), a_bar), b_bar

    solve.defvjp(solve_fwd, solve_bwd)
    return solve


def triangular_solve(a, b, lower: bool, transpose: bool = False, unit_diagonal: bool = False):
    """x with op(a) x = b, op(a) = a or a^T, for traced triangular `a` (..., n, n) and `b`
    (..., n, k) of the same leading shape; differentiable in both."""
    if transpose:
        a, lower = swapaxes(a, -1, -2), not lower
    return _differentiable_solver(lower, unit_diagonal)(a, b)


def eager_triangular_solve(a: np.ndarray, b: np.ndarray, lower: bool, transpose: bool, unit_diagonal: bool):
    """The same with LAPACK on numpy arrays (numpy has no triangular solver: its LU solve on the
    triangle, which raises LinAlgError for a singular one)."""
    n = a.shape[-1]
    tri = np.where(np.asarray(triangle_mask(n, lower, unit_diagonal)), a, np.zeros((), a.dtype))
    if unit_diagonal:
        tri = tri + np.eye(n, dtype=a.dtype)
    if transpose:
        tri = np.swapaxes(tri, -1, -2)
    return np.linalg.solve(tri, b)
