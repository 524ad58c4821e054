"""Contractions: matmul, dot, tensordot, einsum and friends."""

from __future__ import annotations

import builtins
import string

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import bind
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.elementwise import abs, multiply, not_equal, power, sqrt
from flowjit.numpy.promotion import (
    _cast_all,
    _dtype_of,
    _float_operand,
    asarray,
    astype,
    broadcast_shapes,
    broadcast_to,
    result_type,
)
from flowjit.numpy.reductions import max, min, sum
from flowjit.numpy.shapes import _norm_axis, expand_dims, moveaxis, ndim, ravel, reshape, shape, transpose

# --- contractions -----------------------------------------------------------------------------------


def matmul(a, b):
    """numpy.matmul: 1-D operands are promoted to matrices; batch dims broadcast."""
    target = result_type(a, b)
    a, b = _cast_all([a, b], target)
    if target.is_bool:  # numpy: a logical or of ands
        return not_equal(matmul(astype(a, dt.int32), astype(b, dt.int32)), 0)
    sa, sb = shape(a), shape(b)
    if not sa or not sb:
        raise op_error(
            FlowjitTypeError,
            user_location(),
            "matmul",
            f"operands must have rank >= 1; found shapes {sa} and {sb} (use * for scalars)",
        )
    a2 = reshape(a, (1,) + sa) if len(sa) == 1 else a
    b2 = reshape(b, sb + (1,)) if len(sb) == 1 else b
    sa2, sb2 = shape(a2), shape(b2)
    if sa2[-1] != sb2[-2]:
        raise op_error(
            FlowjitTypeError,
            user_location(),
            "matmul",
            f"contracting dimension mismatch: {sa} @ {sb}: {sa2[-1]} != {sb2[-2]}",
        )
    batch = broadcast_shapes(sa2[:-2], sb2[:-2], op="matmul")
    if len(sb2) == 2 and batch:
        # A stack of matrices times one matrix ((B, T, D) @ (D, F)): a's leading dims are free dims of
        # one product, M = B * T rows; b is not broadcast into a batch (a copy of it per matrix).
        out = bind(
            "dot_general",
            [a2, b2],
            {"lhs_contract": (len(sa2) - 1,), "rhs_contract": (0,), "lhs_batch": (), "rhs_batch": ()},
        )
        final = batch + ((sa2[-2],) if len(sa) > 1 else ()) + ((sb2[-1],) if len(sb) > 1 else ())
        return reshape(out, final) if final != shape(out) else out
    a3 = broadcast_to(a2, batch + sa2[-2:])
    b3 = broadcast_to(b2, batch + sb2[-2:])
    nb = len(batch)
    out = bind(
        "dot_general",
        [a3, b3],
        {
            "lhs_contract": (nb + 1,),
            "rhs_contract": (nb,),
            "lhs_batch": tuple(range(nb)),
            "rhs_batch": tuple(range(nb)),
        },
    )
    final = batch + ((sa2[-2],) if len(sa) > 1 else ()) + ((sb2[-1],) if len(sb) > 1 else ())
    return reshape(out, final) if final != shape(out) else out


def dot(a, b):
    """numpy.dot for the common cases: scalars multiply, otherwise contract a's last axis with b's
    second-to-last (b's only axis when 1-D)."""
    if ndim(a) == 0 or ndim(b) == 0:
        return multiply(a, b)
    if ndim(b) <= 2:
        return matmul(a, b)
    return tensordot(a, b, axes=([ndim(a) - 1], [ndim(b) - 2]))


def tensordot(a, b, axes=2):
    target = result_type(a, b)
    a, b = _cast_all([a, b], target)
    if isinstance(axes, int):
        ax_a = list(range(ndim(a) - axes, ndim(a)))
        ax_b = list(range(axes))
    else:
        ax_a = [_norm_axis(x, ndim(a)) for x in (axes[0] if not isinstance(axes[0], int) else [axes[0]])]
        ax_b = [_norm_axis(x, ndim(b)) for x in (axes[1] if not isinstance(axes[1], int) else [axes[1]])]
    for x, y in zip(ax_a, ax_b):
        if shape(a)[x] != shape(b)[y]:
            raise op_error(
                FlowjitTypeError,
                user_location(),
                "tensordot",
                f"shape mismatch: {shape(a)} axis {x} vs {shape(b)} axis {y}",
            )
    return bind("dot_general", [a, b], {"lhs_contract": ax_a, "rhs_contract": ax_b, "lhs_batch": (), "rhs_batch": ()})


def inner(a, b):
    return tensordot(a, b, axes=([ndim(a) - 1], [ndim(b) - 1]))


def outer(a, b):
    return multiply(reshape(ravel(a), (-1, 1)), reshape(ravel(b), (1, -1)))


def vdot(a, b):
    return sum(multiply(ravel(a), ravel(b)))


def einsum(subscripts: str, *operands):
    """numpy.einsum: any number of operands (contracted left to right, two at a time, each pair a
    dot_general), '...' for broadcast leading dims, repeated indices inside one operand (its
    diagonal: 'ii->i', 'ii' is the trace), size-1 dims broadcasting against the other operand's,
    an implicit output (the indices that appear once, sorted, after the '...' dims)."""
    terms, output = _einsum_terms(subscripts.replace(" ", ""), operands)
    xs = [asarray(x) for x in operands]
    for i, t in enumerate(terms):
        xs[i], terms[i] = _einsum_diagonals(xs[i], t)
    sizes: dict[str, int] = {}
    for t, x in zip(terms, xs):
        for c, d in zip(t, shape(x)):
            if sizes.get(c, 1) not in (1, d) and d != 1:
                raise FlowjitValueError(
                    f"{user_location()}: einsum {subscripts!r}: index {c!r} has sizes {sizes[c]} and {d}"
                )
            sizes[c] = builtins.max(sizes.get(c, 1), d)
    x, t = xs[0], terms[0]
    for k in range(1, len(xs)):
        later = "".join(terms[k + 1 :]) + output
        x, t = _einsum_pair(x, t, xs[k], terms[k], later, sizes)
    x, t = _einsum_pair(x, t, None, "", output, sizes)
    return transpose(x, [t.index(c) for c in output])


def _einsum_terms(spec: str, operands) -> tuple[list[str], str]:
    """The operands' index strings with '...' spelled out as letters no term uses (right-aligned:
    the broadcast dims), and the output's."""
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands) or not operands:
        raise FlowjitValueError(
            f"{user_location()}: einsum {spec!r} names {len(terms)} operands; found {len(operands)}"
        )
    free = [c for c in string.ascii_letters if c not in spec]
    widest = 0
    for i, (t, x) in enumerate(zip(terms, operands)):
        named = len(t.replace("...", ""))
        if not builtins.all(c in string.ascii_letters for c in t.replace("...", "")) or t.count("...") > 1:
            raise FlowjitValueError(f"{user_location()}: einsum term {t!r}: letters and at most one '...'")
        if "..." in t:
            width = ndim(x) - named
            if width < 0:
                raise FlowjitValueError(
                    f"{user_location()}: einsum term {t!r} names more dims than the operand's shape {shape(x)}"
                )
            widest = builtins.max(widest, width)
            terms[i] = t.replace("...", "".join(free[len(free) - width :]) if width else "")
        if len(terms[i]) != ndim(x):
            raise FlowjitValueError(
                f"{user_location()}: einsum term {t!r} does not fit an operand of shape {shape(x)} "
                f"({len(terms[i])} indices for {ndim(x)} dims)"
            )
    ellipsis = "".join(free[len(free) - widest :]) if widest else ""
    if arrow:
        output = output.replace("...", ellipsis)
    else:
        letters = "".join(terms)
        output = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ellipsis))
    if len(set(output)) != len(output) or builtins.any(c not in "".join(terms) for c in output):
        raise FlowjitValueError(
            f"{user_location()}: einsum output {output!r} repeats an index or names one no input has"
        )
    return terms, output


def _einsum_diagonals(x, t: str):
    """x and its term with every index repeated inside the term reduced to its diagonal."""
    from flowjit.numpy.indexing import diagonal

    while len(set(t)) != len(t):
        c = next(c for c in t if t.count(c) > 1)
        first, second = t.index(c), t.index(c, t.index(c) + 1)
        x = diagonal(x, 0, first, second)  # the two axes go, their diagonal is last
        t = "".join(ch for j, ch in enumerate(t) if j not in (first, second)) + c
    return x, t


def _einsum_pair(a, ta: str, b, tb: str, keep: str, sizes: dict[str, int]):
    """a (and b) contracted over the indices not in `keep`: (result, its index string). Size-1
    dims of one operand broadcast against the other's."""
    needed = keep + tb
    drop = [j for j, c in enumerate(ta) if c not in needed]
    if drop:
        a, ta = sum(a, axis=tuple(drop)), "".join(c for c in ta if c in needed)
    if b is None:
        return a, ta
    drop = [j for j, c in enumerate(tb) if c not in keep + ta]
    if drop:
        b, tb = sum(b, axis=tuple(drop)), "".join(c for c in tb if c in keep + ta)
    a = broadcast_to(a, tuple(sizes[c] if c in tb else d for c, d in zip(ta, shape(a))))
    b = broadcast_to(b, tuple(sizes[c] if c in ta else d for c, d in zip(tb, shape(b))))
    a, b = _cast_all([a, b], result_type(a, b))
    batch = [c for c in ta if c in tb and c in keep]
    contract = [c for c in ta if c in tb and c not in keep]
    out = bind(
        "dot_general",
        [a, b],
        {
            "lhs_contract": [ta.index(c) for c in contract],
            "rhs_contract": [tb.index(c) for c in contract],
            "lhs_batch": [ta.index(c) for c in batch],
            "rhs_batch": [tb.index(c) for c in batch],
        },
    )
    rest = [c for c in ta if c not in batch and c not in contract] + [
        c for c in tb if c not in batch and c not in contract
    ]
    return out, "".join(batch + rest)


def trace(x, offset=0, axis1=0, axis2=1, dtype=None):
    """numpy.trace: the sum of the `offset` diagonal of the (axis1, axis2) planes."""
    from flowjit.numpy.indexing import diagonal  # indexing's diagonal is the gather

    return sum(diagonal(x, offset, axis1, axis2), axis=-1, dtype=dtype)


def kron(a, b):
    """numpy.kron: the Kronecker product (blocks a[i, j] * b)."""
    a, b = asarray(a), asarray(b)
    rank = builtins.max(ndim(a), ndim(b))
    sa = (1,) * (rank - ndim(a)) + shape(a)
    sb = (1,) * (rank - ndim(b)) + shape(b)
    wide_a = reshape(a, [d for s in sa for d in (s, 1)])
    wide_b = reshape(b, [d for s in sb for d in (1, s)])
    return reshape(multiply(wide_a, wide_b), [x * y for x, y in zip(sa, sb)])


def norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002 (numpy's name)
    """numpy.linalg.norm for vectors (ord None/2, 1, inf, -inf, 0 or any p) and matrices (ord None/'fro',
    1, -1, inf, -inf, and from the singular values 2, -2 and 'nuc')."""
    x = _float_operand(x)
    if axis is None and (ord is None or ord == "fro"):
        return _keep_all(sqrt(sum(multiply(x, x))), x, keepdims)
    if axis is None:
        if ndim(x) not in (1, 2):
            raise FlowjitValueError(f"{user_location()}: norm with ord={ord!r} needs a 1-D or 2-D array or axis=")
        axis = tuple(range(ndim(x)))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(_norm_axis(a, ndim(x), "norm") for a in axes)
    if len(axes) == 1:
        a = abs(x)
        if ord is None or ord == 2:
            return sqrt(sum(multiply(x, x), axes, keepdims))
        if ord == np.inf:
            return max(a, axes, keepdims)
        if ord == -np.inf:
            return min(a, axes, keepdims)
        if ord == 0:
            return sum(astype(not_equal(x, 0), _dtype_of(x)), axes, keepdims)
        if ord == 1:
            return sum(a, axes, keepdims)
        return power(sum(power(a, ord), axes, keepdims), 1.0 / ord)
    if len(axes) != 2:
        raise FlowjitValueError(f"{user_location()}: norm takes one axis (vector) or two (matrix); found {axis}")
    row, col = axes
    a = abs(x)
    if ord is None or ord == "fro":
        return sqrt(sum(multiply(x, x), axes, keepdims))
    if ord in (1, -1):  # max (min) column sum
        sums = sum(a, row, keepdims=True)
        out = (max if ord == 1 else min)(sums, col, keepdims=True)
    elif ord in (np.inf, -np.inf):  # max (min) row sum
        sums = sum(a, col, keepdims=True)
        out = (max if ord == np.inf else min)(sums, row, keepdims=True)
    elif ord in (2, -2, "nuc"):  # the largest, the smallest or the sum of the singular values
        from flowjit.numpy.linalg.svd import svd  # svd multiplies with this module's matmul

        values = svd(moveaxis(x, (row, col), (-2, -1)), compute_uv=False)
        out = {2: max, -2: min, "nuc": sum}[ord](values, -1)
        return expand_dims(out, sorted(axes)) if keepdims else out
    else:
        raise FlowjitValueError(
            f"{user_location()}: matrix norm ord={ord!r} is not one of None, 'fro', 'nuc', 1, -1, 2, -2, inf, -inf"
        )
    return out if keepdims else reshape(out, [d for i, d in enumerate(shape(out)) if i not in axes])


def _keep_all(out, x, keepdims):
    return reshape(out, (1,) * ndim(x)) if keepdims else out
