"""scipy.linalg's triangular and Cholesky solvers, with scipy's signatures, traced or eager.

    c, lower = cho_factor(a); x = cho_solve((c, lower), b)
    x = solve_triangular(l, b, lower=True)

Built on flowjit.numpy.linalg (docs/linalg.md): compiled loops under a trace, LAPACK through numpy
outside one; gradients through `b` and the matrix. Leading dimensions of a are batch dimensions; b
is a vector per matrix when it has one dimension fewer than a.
"""

from __future__ import annotations

import numpy as np

from flowjit.errors import FlowjitValueError, op_error
from flowjit.ir.location import user_location
from flowjit.numpy.linalg.cholesky import cholesky as _numpy_cholesky
from flowjit.numpy.linalg.operands import float_matrices, is_traced, lapack
from flowjit.numpy.linalg.triangular import eager_triangular_solve, triangular_solve
from flowjit.numpy.promotion import _cast_all, asarray, broadcast_shapes, broadcast_to, result_type
from flowjit.numpy.shapes import expand_dims, ndim, reshape, shape, swapaxes

_TRANS = {0: False, "N": False, 1: True, "T": True, 2: True, "C": True}


def solve_triangular(
    a,
    b,
    trans=0,
    lower: bool = False,
    unit_diagonal: bool = False,
    overwrite_b: bool = False,
    check_finite: bool = True,
):
    """scipy.linalg.solve_triangular: x with op(a) x = b, op(a) = a (trans 0, "N") or a^T (1, "T",
    2, "C"), reading only a's lower (upper) triangle, its diagonal taken as ones with
    `unit_diagonal`. `overwrite_b` and `check_finite` are accepted and ignored."""
    if trans not in _TRANS:
        raise op_error(
            FlowjitValueError,
            user_location(),
            "solve_triangular",
            f"trans must be 0, 1, 2, 'N', 'T' or 'C'; found {trans!r}",
        )
    a, b, vector = _matrix_and_rhs(a, b, "solve_triangular")
    if not is_traced(a, b):
        x = lapack("solve_triangular", eager_triangular_solve, a, b, lower, _TRANS[trans], unit_diagonal)
    else:
        x = triangular_solve(a, b, lower, _TRANS[trans], unit_diagonal)
    return reshape(x, shape(x)[:-1]) if vector else x


def cholesky(a, lower: bool = False, overwrite_a: bool = False, check_finite: bool = True):
    """scipy.linalg.cholesky: the upper U with a = U^T U (reading a's upper triangle), or the
    lower L with a = L L^T (reading the lower one) when `lower`."""
    a = float_matrices(a, "cholesky")
    if lower:
        return _numpy_cholesky(a)
    return swapaxes(_numpy_cholesky(swapaxes(a, -1, -2)), -1, -2)


def cho_factor(a, lower: bool = False, overwrite_a: bool = False, check_finite: bool = True):
    """scipy.linalg.cho_factor: (c, lower) for `cho_solve`. Unlike scipy, the other triangle of c
    is zero (scipy leaves whatever a held there), as in JAX."""
    return cholesky(a, lower=lower), lower


def cho_solve(c_and_lower, b, overwrite_b: bool = False, check_finite: bool = True):
    """scipy.linalg.cho_solve: x with a x = b from `cho_factor(a)`'s (c, lower): two triangular
    solves."""
    c, lower = c_and_lower
    first = solve_triangular(c, b, trans=0 if lower else 1, lower=lower)
    return solve_triangular(c, first, trans=1 if lower else 0, lower=lower)


def _matrix_and_rhs(a, b, op: str):
    """(a, b as (..., n, k) with a's leading dims broadcast, whether b was a vector per matrix)."""
    a = float_matrices(a, op)
    b = asarray(b)
    a, b = _cast_all([a, b], result_type(a, b))
    vector = ndim(b) == ndim(a) - 1
    n = shape(a)[-1]
    if ndim(b) == 0 or shape(b)[-1 if vector else -2] != n or (not vector and ndim(b) < 2):
        raise op_error(
            FlowjitValueError,
            user_location(),
            op,
            f"b must have shape (..., {n}) or (..., {n}, K) for a of shape {shape(a)}; found {shape(b)}",
        )
    if vector:
        b = expand_dims(b, -1)
    batch = broadcast_shapes(shape(a)[:-2], shape(b)[:-2], op=op)
    if is_traced(a, b):
        return broadcast_to(a, batch + shape(a)[-2:]), broadcast_to(b, batch + shape(b)[-2:]), vector
    return np.broadcast_to(a, batch + shape(a)[-2:]), np.broadcast_to(b, batch + shape(b)[-2:]), vector
