"""Parallel Jacobi rotations, shared by `eigh` (two-sided) and `svd` (one-sided).

A sweep meets every pair of indices once, in m - 1 steps of m / 2 disjoint pairs (the round-robin
"circle" schedule; m is even: an odd size is padded with a zero row and column, which is never
rotated because its off-diagonal entries are exactly zero). A step rotates all its pairs at once:
with partner(i) the index paired with i, row i of a matrix becomes c_i x_i + s'_i x_partner(i), a
gather and two multiplies, O(size) per step and O(n^3) per sweep for an n x n matrix. The
rotation of pair (p, q) diagonalizes the symmetric 2 x 2 matrix [[a_pp, a_pq], [a_pq, a_qq]]
(Golub and Van Loan's sym.schur2); both rows of a pair compute it from the same three numbers,
so it is exactly orthogonal. Sweeps repeat in a while_loop until the off-diagonal part is below
the tolerance (convergence is quadratic: typically 6 to 10 sweeps), at most `MAX_SWEEPS`.
"""

from __future__ import annotations

import functools

import numpy as np

from flowjit.numpy.elementwise import (
    abs,
    add,
    divide,
    equal,
    greater_equal,
    less,
    multiply,
    negative,
    rsqrt,
    sqrt,
    subtract,
    where,
)
from flowjit.numpy.indexing import dynamic_slice, take_along_axis
from flowjit.numpy.linalg.operands import index_row
from flowjit.numpy.shapes import expand_dims, reshape, shape

MAX_SWEEPS = 40


@functools.cache
def round_robin(m: int) -> np.ndarray:
    """(m - 1, m) table: row r holds each index's partner in step r (the circle method, m even)."""
    table = np.zeros((m - 1, m), np.int64)
    for r in range(m - 1):
        pairs = [(r, m - 1)] + [((r + k) % (m - 1), (r - k) % (m - 1)) for k in range(1, m // 2)]
        for p, q in pairs:
            table[r, p], table[r, q] = q, p
    return table


def step_partners(m: int, step):
    """The partner of every index in sweep step `step` (traced): shape (m,), and whether each
    index is the first of its pair (p < q)."""
    partner = reshape(dynamic_slice(round_robin(m), [step, 0], (1, m)), (m,))
    return partner, less(reshape(index_row(m), (m,)), partner)


def pair_values(values, partner, first):
    """For each index i of a pair (p, q), per-index `values` (..., m) of its pair's first index p
    (where `first`) and of q: (v_p, v_q) for both i = p and i = q."""
    other = take_along_axis(values, broadcast_index(partner, values, -1), -1)
    return where(first, values, other), where(first, other, values)


def broadcast_index(partner, x, axis: int):
    """`partner` (m,) shaped to index `x` along `axis` (-1 or -2) with take_along_axis."""
    m, rank = shape(partner)[0], len(shape(x))
    if axis == -1:
        return reshape(partner, (1,) * (rank - 1) + (m,))
    return reshape(partner, (1,) * (rank - 2) + (m, 1))


def rotation(app, aqq, apq):
    """(c, s) with [[c, s], [-s, c]]^T [[app, apq], [apq, aqq]] [[c, s], [-s, c]] diagonal; the
    identity where apq is zero."""
    zero = equal(apq, 0)
    tau = divide(subtract(aqq, app), multiply(2.0, where(zero, 1.0, apq)))
    t = divide(where(greater_equal(tau, 0), 1.0, -1.0), add(abs(tau), sqrt(add(1.0, multiply(tau, tau)))))
    t = where(zero, 0.0, t)
    c = rsqrt(add(1.0, multiply(t, t)))
    return c, multiply(t, c)


def signed_sine(s, first):
    """The coefficient of the partner's row: -s for the first index of a pair, s for the second."""
    return where(first, negative(s), s)


def rotate_columns(x, partner, c, s_signed):
    """Column i of x (..., r, m) becomes c_i x_i + s'_i x_partner(i)."""
    gathered = take_along_axis(x, broadcast_index(partner, x, -1), -1)
    return add(multiply(x, expand_dims(c, -2)), multiply(gathered, expand_dims(s_signed, -2)))


def rotate_rows(x, partner, c, s_signed):
    """Row i of x (..., m, r) becomes c_i x_i + s'_i x_partner(i)."""
    gathered = take_along_axis(x, broadcast_index(partner, x, -2), -2)
    return add(multiply(x, expand_dims(c, -1)), multiply(gathered, expand_dims(s_signed, -1)))
