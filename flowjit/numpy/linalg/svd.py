"""numpy.linalg.svd: a = U diag(S) Vh, singular values descending.

Compiled: one-sided (Hestenes) Jacobi on the columns of a (of a^T when m < n, then U and Vh swap
roles): rotations B <- B J, V <- V J (jacobi.py) make the columns of B = a V orthogonal, until
every pair has |b_p . b_q| <= sqrt(m) eps |b_p| |b_q| (LAPACK's dgesvj test). Singular values are
the column norms, so small ones keep their relative accuracy (the Gram matrix a^T a would square
the condition number). O(m n^2) per sweep. The columns are sorted by norm and U comes from a
Householder QR of B (B = Q R with R diagonal up to rounding): U = Q times the signs of R's
diagonal, which also completes U to m columns (full_matrices) and to zero singular values. Each
pair (u_i, v_i) is flipped so that u_i's largest-magnitude entry is positive, eagerly too.

Gradient: a custom_vjp with the closed-form formula (`_tall_svd_with_gradient`), as JAX's.
"""

from __future__ import annotations

import functools
from collections import namedtuple

import numpy as np

from flowjit.errors import FlowjitTypeError, op_error
from flowjit.frontend.control_flow import fori_loop, while_loop
from flowjit.frontend.custom_derivatives import custom_vjp
from flowjit.ir.location import user_location
from flowjit.numpy.creation import eye, ones
from flowjit.numpy.elementwise import (
    abs,
    add,
    divide,
    equal,
    greater,
    less,
    logical_and,
    maximum,
    multiply,
    negative,
    not_equal,
    sqrt,
    subtract,
    where,
)
from flowjit.numpy.indexing import diagonal, take_along_axis
from flowjit.numpy.linalg.eigh import largest_entry_signs
from flowjit.numpy.linalg.jacobi import (
    MAX_SWEEPS,
    broadcast_index,
    pair_values,
    rotate_columns,
    rotation,
    signed_sine,
    step_partners,
)
from flowjit.numpy.linalg.operands import float_matrices, index_column, index_row, is_traced, lapack, zero_unless
from flowjit.numpy.linalg.products import matmul
from flowjit.numpy.linalg.qr import accumulate_q, householder
from flowjit.numpy.promotion import _dtype_of, broadcast_to
from flowjit.numpy.reductions import max, sum
from flowjit.numpy.shapes import concatenate, expand_dims, pad, shape, swapaxes
from flowjit.numpy.sorting import argsort

SVDResult = namedtuple("SVDResult", ["U", "S", "Vh"])


def svd(a, full_matrices: bool = True, compute_uv: bool = True, hermitian: bool = False):
    """numpy.linalg.svd of each matrix of `a` (..., m, n), k = min(m, n): (U, S, Vh) with U
    (..., m, m) and Vh (..., n, n) (full_matrices) or (..., m, k) and (..., k, n); only S (..., k)
    descending with compute_uv=False. `hermitian` is accepted and ignored (the result is the same)."""
    a = float_matrices(a, "svd", square=False)
    if not is_traced(a):
        if not compute_uv:
            return lapack("svd", lambda x: np.linalg.svd(x, compute_uv=False), a)
        u, s, vh = lapack("svd", lambda x: np.linalg.svd(x, full_matrices=full_matrices), a)
        return SVDResult(*_normalized_pairs(u, s, vh))
    m, n = shape(a)[-2:]
    if m < n:
        out = _tall_svd_with_gradient(full_matrices, compute_uv)(swapaxes(a, -1, -2))
        if not compute_uv:
            return out
        u, s, vh = out
        return SVDResult(*_normalized_pairs(swapaxes(vh, -1, -2), s, swapaxes(u, -1, -2)))
    out = _tall_svd_with_gradient(full_matrices, compute_uv)(a)
    return SVDResult(*_normalized_pairs(*out)) if compute_uv else out


def _normalized_pairs(u, s, vh):
    """(u, s, vh) with each pair (u_i, vh_i) flipped to make u_i's largest entry positive."""
    k = shape(s)[-1]
    signs = largest_entry_signs(u[..., :k])
    if shape(u)[-1] > k:
        signs = concatenate([signs, ones(shape(signs)[:-1] + (shape(u)[-1] - k,), _dtype_of(u).np_dtype)], axis=-1)
    vh_signs = swapaxes(signs[..., :k], -1, -2)
    if shape(vh)[-2] > k:
        vh_signs = concatenate(
            [vh_signs, ones(shape(vh_signs)[:-2] + (shape(vh)[-2] - k, 1), _dtype_of(u).np_dtype)], axis=-2
        )
    return multiply(u, signs), s, multiply(vh, vh_signs)


def _one_sided_jacobi(a):
    """(B = a V with orthogonal columns, V) for traced `a` (..., m, n), m >= n."""
    m, n = shape(a)[-2:]
    width = n + n % 2
    dtype = _dtype_of(a).np_dtype
    b = pad(a, [(0, 0)] * (len(shape(a)) - 1) + [(0, width - n)]) if width != n else a
    v = broadcast_to(eye(width, dtype=dtype), shape(b)[:-2] + (width, width))
    tolerance = float(np.sqrt(m) * np.finfo(dtype).eps)

    def rotate_pairs(step, carry):
        b, v, worst = carry
        partner, first = step_partners(width, step)
        norms2 = sum(multiply(b, b), axis=-2)
        app, aqq = pair_values(norms2, partner, first)
        dots = sum(multiply(b, take_along_axis(b, broadcast_index(partner, b, -1), -1)), axis=-2)
        apq, _ = pair_values(dots, partner, first)
        scale = sqrt(multiply(app, aqq))
        worst = maximum(worst, max(divide(abs(apq), where(equal(scale, 0), 1.0, scale))))
        c, s = rotation(app, aqq, apq)
        s = signed_sine(s, first)
        return rotate_columns(b, partner, c, s), rotate_columns(v, partner, c, s), worst

    def sweep(carry):
        count, b, v, _ = carry
        b, v, worst = fori_loop(0, width - 1, rotate_pairs, (b, v, np.zeros((), dtype)))
        return add(count, 1), b, v, worst

    def unconverged(carry):
        count, _, _, worst = carry
        return logical_and(less(count, MAX_SWEEPS), greater(worst, tolerance))

    start = (np.asarray(0, np.int64), b, v, np.asarray(np.inf, dtype))
    _, b, v, _ = while_loop(unconverged, sweep, start)
    return b[..., :n], v[..., :n, :n]


def _tall_svd(a, full_matrices: bool, compute_uv: bool):
    m, n = shape(a)[-2:]
    b, v = _one_sided_jacobi(a)
    s = sqrt(sum(multiply(b, b), axis=-2))
    order = argsort(negative(s), axis=-1)
    s = take_along_axis(s, order, -1)
    if not compute_uv:
        return s
    b = take_along_axis(b, expand_dims(order, -2), -1)
    v = take_along_axis(v, expand_dims(order, -2), -1)
    r, reflectors = householder(b)
    q = accumulate_q(reflectors, m if full_matrices else n)
    dtype = _dtype_of(a).np_dtype
    signs = where(less(diagonal(r, 0, -2, -1), 0), np.asarray(-1, dtype), np.asarray(1, dtype))
    if full_matrices and m > n:
        signs = concatenate([signs, ones(shape(signs)[:-1] + (m - n,), dtype)], axis=-1)
    u = multiply(q, expand_dims(signs, -2))
    return u, s, swapaxes(v, -1, -2)


@functools.cache
def _tall_svd_with_gradient(full_matrices: bool, compute_uv: bool) -> custom_vjp:
    """`_tall_svd` (m >= n) with the closed-form gradient, so the Jacobi loop is never differentiated:
    with F_ij = 1 / (s_j^2 - s_i^2) off the diagonal (0 on it),

        dA = U [ (F o (U^T dU - dU^T U)) S + diag(dS) + S (F o (V^T dV - dV^T V)) ] V^T
             + (I - U U^T) dU S^-1 V^T

    (Townsend's formula; the last term is zero for square A). Singular values must be distinct (and
    non-zero when m > n) for U and V to be differentiable, as in JAX; only S is differentiable
    with repeated or zero singular values. U of full_matrices=True has columns no derivative
    determines: its gradient is an error, as in JAX."""

    def tall_svd(a):
        return _tall_svd(a, full_matrices, compute_uv)

    def forward(a):
        return tall_svd(a), _tall_svd(a, False, True)

    def backward(residuals, cotangents):
        u, s, vh = residuals
        if not compute_uv:
            return (matmul(multiply(u, expand_dims(cotangents, -2)), vh),)
        if full_matrices and shape(cotangents[0])[-1] != shape(u)[-1]:  # a full U has extra columns
            raise op_error(
                FlowjitTypeError,
                user_location(),
                "svd",
                "the gradient of svd's U needs full_matrices=False (the extra columns of a full U are not "
                "determined by a); pass full_matrices=False, as JAX requires",
            )
        u_bar, s_bar, vh_bar = cotangents
        v, v_bar = swapaxes(vh, -1, -2), swapaxes(vh_bar, -1, -2)
        n = shape(s)[-1]
        squares = multiply(s, s)
        gaps = subtract(expand_dims(squares, -2), expand_dims(squares, -1))  # s_j^2 - s_i^2
        off = not_equal(index_column(n), index_row(n))
        f = zero_unless(off, divide(1.0, where(off, gaps, 1.0)))
        ut_du = matmul(swapaxes(u, -1, -2), u_bar)
        vt_dv = matmul(swapaxes(v, -1, -2), v_bar)
        j = multiply(f, subtract(ut_du, swapaxes(ut_du, -1, -2)))
        k = multiply(f, subtract(vt_dv, swapaxes(vt_dv, -1, -2)))
        inner = add(
            add(multiply(j, expand_dims(s, -2)), multiply(eye(n, dtype=_dtype_of(s).np_dtype), expand_dims(s_bar, -1))),
            multiply(expand_dims(s, -1), k),
        )
        grad = matmul(u, matmul(inner, vh))
        if shape(u)[-2] > n:  # the part of dU outside U's columns
            outside = subtract(u_bar, matmul(u, ut_du))
            grad = add(grad, matmul(divide(outside, expand_dims(s, -2)), vh))
        return (grad,)

    differentiable = custom_vjp(tall_svd)
    differentiable.defvjp(forward, backward)
    return differentiable
