"""The VJP rules of the ops, written with `flowjit.numpy` on tracers and registered into the
autodiff transformation's table (`flowjit.frontend.autodiff.VJP_RULES`) when flowjit.numpy is
imported: the rules are written with this layer's API, so they are registered from it, as JAX's
libraries register rules on their primitives.

Rule signature: `rule(op, cts, operands, results) -> one cotangent (or None) per operand`, where
`cts` holds one cotangent tracer (or None) per result of `op`.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence

import numpy as np

from flowjit import numpy as fnp
from flowjit.frontend.autodiff import VJP_RULES, zeros
from flowjit.frontend.trace import bind, current_trace
from flowjit.ir import dtypes as dt

# --- rules: helpers ------------------------------------------------------------------------------------


def _sum_to(ct, shape: tuple[int, ...], axes: Sequence[int]):
    """reduce_sum of `ct` over `axes`, reshaped to `shape`."""
    if axes:
        ct = bind("reduce_sum", [ct], {"axes": tuple(axes)})
    return ct if tuple(ct.shape) == tuple(shape) else bind("reshape", [ct], {"shape": tuple(shape)})


def _broadcast_back(ct, shape: tuple[int, ...], reduced: Sequence[int]):
    """Broadcast a reduction's cotangent (reduced `axes` removed) back to the operand's `shape`."""
    kept = tuple(i for i in range(len(shape)) if i not in reduced)
    return bind("broadcast", [ct], {"shape": tuple(shape), "dims": kept})


def _where(pred, x, y):
    return fnp.where(pred, x, y)


def _zeros_like(x):
    return zeros(current_trace(), x.value.type)


def _unary(derivative: Callable) -> Callable:
    """A rule for y = f(x) given dy/dx as a function of (x, y)."""

    def rule(op, cts, operands, results):
        return [cts[0] * derivative(operands[0], results[0])]

    return rule


def _binary(dx: Callable, dy: Callable) -> Callable:
    """A rule for z = f(x, y) given the cotangent maps (ct, x, y, z) -> ct_x and -> ct_y."""

    def rule(op, cts, operands, results):
        (ct,), (x, y), (z,) = cts, operands, results
        return [dx(ct, x, y, z), dy(ct, x, y, z)]

    return rule


def _trunc(q):
    return _where(q < 0, fnp.ceil(q), fnp.floor(q))


# --- rules: elementwise -----------------------------------------------------------------------------------

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

VJP_RULES.update(
    {
        "exp": _unary(lambda x, y: y),
        "log": _unary(lambda x, y: 1.0 / x),
        "log1p": _unary(lambda x, y: 1.0 / (1.0 + x)),
        "expm1": _unary(lambda x, y: y + 1.0),
        "tanh": _unary(lambda x, y: 1.0 - y * y),
        "logistic": _unary(lambda x, y: y * (1.0 - y)),
        "sqrt": _unary(lambda x, y: 0.5 / y),
        "rsqrt": _unary(lambda x, y: -0.5 * y / x),
        "sin": _unary(lambda x, y: fnp.cos(x)),
        "cos": _unary(lambda x, y: -fnp.sin(x)),
        "erf": _unary(lambda x, y: _TWO_OVER_SQRT_PI * fnp.exp(-(x * x))),
        "abs": _unary(lambda x, y: fnp.sign(x)),  # 0 at x == 0, as JAX
        "neg": lambda op, cts, operands, results: [-cts[0]],
        "add": _binary(lambda ct, x, y, z: ct, lambda ct, x, y, z: ct),
        "sub": _binary(lambda ct, x, y, z: ct, lambda ct, x, y, z: -ct),
        "mul": _binary(lambda ct, x, y, z: ct * y, lambda ct, x, y, z: ct * x),
        "div": _binary(lambda ct, x, y, z: ct / y, lambda ct, x, y, z: -ct * z / y),
        "rem": _binary(lambda ct, x, y, z: ct, lambda ct, x, y, z: -ct * _trunc(x / y)),
        # x ** y: the y == 0 and x == 0 cases follow JAX (no 0 * inf nans from x**(y-1) or log(0)).
        "pow": _binary(
            lambda ct, x, y, z: ct * _where(y == 0, 0.0, y * fnp.power(x, y - 1.0)),
            lambda ct, x, y, z: ct * fnp.log(_where(x == 0, 1.0, x)) * z,
        ),
        # max/min: on ties each operand gets half the cotangent, as in JAX.
        "max": _binary(
            lambda ct, x, y, z: ct * _where(x > y, 1.0, _where(x == y, 0.5, 0.0)),
            lambda ct, x, y, z: ct * _where(y > x, 1.0, _where(x == y, 0.5, 0.0)),
        ),
        "min": _binary(
            lambda ct, x, y, z: ct * _where(x < y, 1.0, _where(x == y, 0.5, 0.0)),
            lambda ct, x, y, z: ct * _where(y < x, 1.0, _where(x == y, 0.5, 0.0)),
        ),
        # z = atan2(x, y): dz/dx = y / (x^2 + y^2), dz/dy = -x / (x^2 + y^2)
        "atan2": _binary(
            lambda ct, x, y, z: ct * y / (x * x + y * y),
            lambda ct, x, y, z: -ct * x / (x * x + y * y),
        ),
    }
)


def _select_vjp(op, cts, operands, results):
    (ct,), (pred, _, _) = cts, operands
    zero = _zeros_like(ct)
    return [None, _where(pred, ct, zero), _where(pred, zero, ct)]


def _convert_vjp(op, cts, operands, results):
    x = operands[0]
    return [fnp.astype(cts[0], x.dtype) if dt.dtype(x.dtype).is_float else None]


VJP_RULES["select"] = _select_vjp
VJP_RULES["convert"] = _convert_vjp

# --- rules: movement -------------------------------------------------------------------------------------


def _broadcast_vjp(op, cts, operands, results):
    (ct,), (x,) = cts, operands
    shape, dims = op.attrs["shape"], op.attrs["dims"]
    new = [d for d in range(len(shape)) if d not in dims]
    stretched = [d for i, d in enumerate(dims) if x.shape[i] == 1 and shape[d] != 1]
    return [_sum_to(ct, x.shape, sorted(new + stretched))]


def _reshape_vjp(op, cts, operands, results):
    return [bind("reshape", [cts[0]], {"shape": tuple(operands[0].shape)})]


def _transpose_vjp(op, cts, operands, results):
    perm = op.attrs["perm"]
    inverse = tuple(perm.index(i) for i in range(len(perm)))
    return [bind("transpose", [cts[0]], {"perm": inverse})]


def _slice_vjp(op, cts, operands, results):
    (ct,), (x,) = cts, operands
    start, stride = op.attrs["start"], op.attrs["stride"]
    high = []
    for d, s, st, n in zip(x.shape, start, stride, ct.shape):
        used = (n - 1) * st + 1 if n > 0 else 0
        high.append(d - s - used)
    interior = tuple(st - 1 if n > 1 else 0 for st, n in zip(stride, ct.shape))
    zero = np.zeros((), ct.dtype)
    return [bind("pad", [ct, zero], {"low": tuple(start), "high": tuple(high), "interior": interior})]


def _dynamic_slice_vjp(op, cts, operands, results):
    # Pad the cotangent by (d - n) on both sides, then cut a window of the operand's size that puts
    # it at the (clamped) start: a dynamic update expressed with existing ops.
    (ct,), (x, *starts) = cts, operands
    spare = [d - n for d, n in zip(x.shape, ct.shape)]
    zero = np.zeros((), ct.dtype)
    padded = bind("pad", [ct, zero], {"low": tuple(spare), "high": tuple(spare), "interior": (0,) * len(spare)})
    flipped = [fnp.asarray(m, s.dtype) - fnp.clip(s, 0, m) for s, m in zip(starts, spare)]
    out = bind("dynamic_slice", [padded, *flipped], {"sizes": tuple(x.shape)})
    return [out] + [None] * len(starts)


def _pad_vjp(op, cts, operands, results):
    (ct,), (x, _) = cts, operands
    low, interior = op.attrs["low"], op.attrs["interior"]
    limit = [lo + (d - 1) * (it + 1) + 1 if d > 0 else lo for d, lo, it in zip(x.shape, low, interior)]
    stride = tuple(it + 1 if d > 1 else 1 for d, it in zip(x.shape, interior))
    ct_x = bind("slice", [ct], {"start": tuple(low), "limit": tuple(limit), "stride": stride})
    all_axes = tuple(range(len(x.shape)))
    ct_value = bind("reduce_sum", [ct], {"axes": all_axes}) - bind("reduce_sum", [ct_x], {"axes": all_axes})
    return [ct_x, ct_value]


def _concatenate_vjp(op, cts, operands, results):
    (ct,) = cts
    axis = op.attrs["axis"] % len(ct.shape)
    out, offset = [], 0
    for x in operands:
        start = [0] * len(ct.shape)
        limit = list(ct.shape)
        start[axis], limit[axis] = offset, offset + x.shape[axis]
        out.append(bind("slice", [ct], {"start": tuple(start), "limit": tuple(limit), "stride": (1,) * len(start)}))
        offset += x.shape[axis]
    return out


def _gather_vjp(op, cts, operands, results):
    (ct,), (x, idx) = cts, operands
    return [bind("scatter_add", [_zeros_like(x), idx, ct], {"axis": op.attrs["axis"]}), None]


def _scatter_add_vjp(op, cts, operands, results):
    (ct,), (_, idx, _) = cts, operands
    return [ct, None, bind("gather", [ct, idx], {"axis": op.attrs["axis"]})]


def _sort_vjp(op, cts, operands, results):
    # Each cotangent goes back to where its element came from: scattered by the permutation. The
    # permutation is the result of an `iota` payload along the axis (argsort), else a second sort.
    axis = op.attrs["axis"] % len(operands[0].shape)
    perm = None
    for operand, result in zip(operands[1:], results[1 : len(operands)]):
        producer = operand.value.producer
        if producer is not None and producer.name == "iota" and producer.attrs["dimension"] == axis:
            perm = result
    if perm is None:
        positions = fnp.iota(operands[0].shape, axis)
        perm = bind("sort", [operands[0], positions], {"axis": axis})[1]
    return [None if ct is None else fnp.scatter_add_along_axis(_zeros_like(ct), perm, ct, axis) for ct in cts]


VJP_RULES.update(
    {
        "sort": _sort_vjp,
        "broadcast": _broadcast_vjp,
        "reshape": _reshape_vjp,
        "transpose": _transpose_vjp,
        "slice": _slice_vjp,
        "dynamic_slice": _dynamic_slice_vjp,
        "pad": _pad_vjp,
        "concatenate": _concatenate_vjp,
        "gather": _gather_vjp,
        "scatter_add": _scatter_add_vjp,
    }
)


# --- rules: reductions ---------------------------------------------------------------------------------


def _reduce_sum_vjp(op, cts, operands, results):
    return [_broadcast_back(cts[0], operands[0].shape, op.attrs["axes"])]


def _reduce_extreme_vjp(op, cts, operands, results):
    # The cotangent goes to the elements equal to the extreme, split evenly between ties (as JAX).
    (ct,), (x,), (y,) = cts, operands, results
    axes = op.attrs["axes"]
    hits = fnp.astype(x == _broadcast_back(y, x.shape, axes), x.dtype)
    count = bind("reduce_sum", [hits], {"axes": axes})
    return [_broadcast_back(ct / count, x.shape, axes) * hits]


def _shift_last(y, k: int, toward_end: bool):
    """`y` moved by k along its last axis, filled with ones (the product's identity)."""
    n, rank = y.shape[-1], len(y.shape)
    lead = (0,) * (rank - 1)
    low, high, start = (k, 0, 0) if toward_end else (0, k, k)
    padded = bind(
        "pad", [y, np.ones((), y.dtype)], {"low": lead + (low,), "high": lead + (high,), "interior": (0,) * rank}
    )
    return bind(
        "slice",
        [padded],
        {"start": lead + (start,), "limit": tuple(y.shape[:-1]) + (start + n,), "stride": (1,) * rank},
    )


def _exclusive_products(y, toward_end: bool):
    """prod_{j<i} y_j (toward_end) or prod_{j>i} y_j along the last axis: a log-depth scan of shifted
    products, so it is exact with zeros and differentiable again."""
    y = _shift_last(y, 1, toward_end)
    k = 1
    while k < y.shape[-1]:
        y = y * _shift_last(y, k, toward_end)
        k *= 2
    return y


def _reduce_prod_vjp(op, cts, operands, results):
    # d prod / d x_i = (product of the elements before i) * (product of the elements after i), with the
    # reduced axes moved last and flattened; no division, so zeros are handled exactly.
    (ct,), (x,) = cts, operands
    axes = tuple(sorted(op.attrs["axes"]))
    kept = [i for i in range(len(x.shape)) if i not in axes]
    perm = (*kept, *axes)
    moved = bind("transpose", [x], {"perm": perm})
    n = math.prod(x.shape[i] for i in axes)
    if n == 0:
        return [_zeros_like(x)]
    flat = bind("reshape", [moved], {"shape": (*(x.shape[i] for i in kept), n)})
    partial = _exclusive_products(flat, True) * _exclusive_products(flat, False)
    partial = bind("reshape", [partial], {"shape": tuple(moved.shape)})
    partial = bind("transpose", [partial], {"perm": tuple(perm.index(i) for i in range(len(perm)))})
    return [_broadcast_back(ct, x.shape, axes) * partial]


def _cumsum_vjp(op, cts, operands, results):
    # Linear: each element adds to every running sum from its position on, so its cotangent is the
    # running sum of the cotangents taken from the other end of the axis.
    attrs = {"axis": op.attrs["axis"], "reverse": not op.attrs["reverse"]}
    return [bind("cumsum", [cts[0]], attrs)]


def _shifted(x, axis: int, toward_end: bool):
    """`x` moved one position along `axis` (toward its end when `toward_end`), the vacated position 0."""
    n = x.shape[axis]
    rank = len(x.shape)
    start = [0] * rank
    limit = list(x.shape)
    if toward_end:
        limit[axis] = n - 1
    else:
        start[axis] = 1
    kept = bind("slice", [x], {"start": tuple(start), "limit": tuple(limit), "stride": (1,) * rank})
    edge = list(x.shape)
    edge[axis] = 1
    zero = bind("broadcast", [fnp.asarray(np.zeros((), x.dtype))], {"dims": (), "shape": tuple(edge)})
    # a concatenation, not a pad: its vector copies keep the function on LLVM's light pipeline
    parts = [zero, kept] if toward_end else [kept, zero]
    return bind("concatenate", parts, {"axis": axis})


def _linear_recurrence_vjp(op, cts, operands, results):
    # h[i] = a[i] h[i-1] + b[i]: the cotangent lambda of h[i] is g[i] + a[i+1] lambda[i+1], the same
    # recurrence run the other way with the coefficients moved by one; db = lambda and
    # da[i] = lambda[i] h[i-1] (a at the first position is unused: 0 there exactly).
    a, _ = operands
    (h,) = results
    axis, reverse = op.attrs["axis"], op.attrs["reverse"]
    attrs = {"axis": axis, "reverse": not reverse}
    lam = bind("linear_recurrence", [_shifted(a, axis, toward_end=reverse), cts[0]], attrs)
    first = fnp.iota(a.shape, axis, dt.int32) == (a.shape[axis] - 1 if reverse else 0)
    return [_where(first, 0, lam * _shifted(h, axis, toward_end=not reverse)), lam]


VJP_RULES.update(
    {
        "linear_recurrence": _linear_recurrence_vjp,
        "cumsum": _cumsum_vjp,
        "reduce_sum": _reduce_sum_vjp,
        "reduce_max": _reduce_extreme_vjp,
        "reduce_min": _reduce_extreme_vjp,
        "reduce_prod": _reduce_prod_vjp,
    }
)


# --- rules: contractions ---------------------------------------------------------------------------------


def _dot(lhs, rhs, lhs_contract, rhs_contract, lhs_batch, rhs_batch):
    attrs = {"lhs_contract": lhs_contract, "rhs_contract": rhs_contract, "lhs_batch": lhs_batch, "rhs_batch": rhs_batch}
    return bind("dot_general", [lhs, rhs], {k: tuple(v) for k, v in attrs.items()})


def _to_layout(x, source: list[int]):
    """Transpose `x`, whose dim k is dim source[k] of the target, into the target's dim order."""
    return bind("transpose", [x], {"perm": tuple(source.index(i) for i in range(len(source)))})


def _dot_general_vjp(op, cts, operands, results):
    # ct dims: batch, lhs free, rhs free. Each operand's cotangent contracts ct with the other operand
    # over the other's free dims; ct goes first for the lhs and second for the rhs, so for a plain
    # matmul both come out in the operand's layout (ct @ b.T and a.T @ ct) and the transposes fold away.
    (ct,), (a, b) = cts, operands
    lc, rc = list(op.attrs["lhs_contract"]), list(op.attrs["rhs_contract"])
    lb, rb = list(op.attrs["lhs_batch"]), list(op.attrs["rhs_batch"])
    lf = [i for i in range(len(a.shape)) if i not in lc and i not in lb]
    rf = [i for i in range(len(b.shape)) if i not in rc and i not in rb]
    nb = len(lb)
    batch = list(range(nb))
    ct_lf = list(range(nb, nb + len(lf)))
    ct_rf = list(range(nb + len(lf), nb + len(lf) + len(rf)))
    # dims of ct_a: batch, lhs free (from ct), then b's contracting dims in b's order
    ct_a = _dot(ct, b, ct_rf, rf, batch, rb)
    ct_a = _to_layout(ct_a, lb + lf + [lc[rc.index(d)] for d in sorted(rc)])
    # dims of ct_b: batch, a's contracting dims in a's order, then rhs free (from ct)
    ct_b = _dot(a, ct, lf, ct_lf, lb, batch)
    ct_b = _to_layout(ct_b, rb + [rc[lc.index(d)] for d in sorted(lc)] + rf)
    return [ct_a, ct_b]


def _conv2d_vjp(op, cts, operands, results):
    (ct,), (x, w) = cts, operands
    stride, padding, dilation = op.attrs["stride"], op.attrs["padding"], op.attrs["dilation"]
    kernel = tuple(w.shape[2:])
    if max(stride) > 1 and tuple(dilation) == (1, 1) and STRIDED_INPUT_GRADIENT_BY_PHASES:
        ct_x = conv2d_input_grad_by_phases(ct, w, tuple(x.shape[2:]), stride, padding)
    else:
        # Input gradient: a stride-1 conv of the stride-dilated, padded cotangent with the spatially
        # flipped kernel, in and out channels swapped; then cut to the input's extent.
        low, high, start = zip(
            *(
                _transposed_padding(
                    x.shape[2 + i], padding[i], ct.shape[2 + i], stride[i], dilation[i] * (kernel[i] - 1)
                )
                for i in range(2)
            )
        )
        dilated = _dilate_and_pad(ct, 2, low, high, stride)
        flipped = fnp.flip(bind("transpose", [w], {"perm": (1, 0, 2, 3)}), axis=(2, 3))
        full = bind("conv2d", [dilated, flipped], {"stride": (1, 1), "padding": ((0, 0), (0, 0)), "dilation": dilation})
        ct_x = _cut(full, start, x.shape[2:])
    # Weight gradient: a conv with batch and channels swapped and stride and dilation swapped:
    # ct_w[o, c, k] = sum_{n, i} x_padded[n, c, i*stride + k*dilation] * ct[n, o, i].
    x_t = bind("transpose", [x], {"perm": (1, 0, 2, 3)})
    ct_t = bind("transpose", [ct], {"perm": (1, 0, 2, 3)})
    ct_w = bind("conv2d", [x_t, ct_t], {"stride": dilation, "padding": padding, "dilation": stride})
    ct_w = _cut(ct_w, (0, 0), kernel)
    return [ct_x, bind("transpose", [ct_w], {"perm": (1, 0, 2, 3)})]


# The input gradient of a strided conv as s0*s1 stride-1 convs (below) rather than one over the
# stride-dilated cotangent, whose zeros (3/4 at stride 2) the conv multiplies all the same: for
# 8x64x56x56 3x3/2 -> 128, fj.grad w.r.t. x 16.3 -> 10.8 ms (docs/autodiff.md). False: the
# dilated form (the tests compare the two).
STRIDED_INPUT_GRADIENT_BY_PHASES = True


def conv2d_input_grad_by_phases(ct, w, spatial, stride, padding):
    """The input cotangent of conv2d(x, w, stride, padding) (dilation 1) from its cotangent `ct`,
    `spatial` = x's (H, W) (also `nn.conv_transpose2d`, the same adjoint as a layer).

    Position h of the padded input receives ct[o] * w[k] for every o*s + k = h: for h = r + s*m
    (r = h mod s), the taps k = r + s*j, so dx_p[r + s*m] = sum_j ct[m - j] * w[r + s*j], a
    stride-1 conv of `ct` (padded by J - 1 before it) with the flipped sub-kernel w[:, :, r::s]
    (channels swapped), per dim. Every phase is computed over phase 0's M = ceil(Hp / s) positions
    (those past the padded input are cut at the end), so stacking the phases and one transpose
    interleave them: (sh, sw, N, C, Mh, Mw) -> (N, C, Mh, sh, Mw, sw). (Spreading each phase with a
    pad of interior zeros and summing wrote s^2 full-size tensors: 10-14% slower.)"""
    n, o, *out = ct.shape
    c = w.shape[1]
    kernel = tuple(w.shape[2:])
    padded = tuple(spatial[i] + padding[i][0] + padding[i][1] for i in range(2))
    rows = tuple(-(-padded[i] // stride[i]) for i in range(2))  # positions of phase 0 (the most)
    swapped = bind("transpose", [w], {"perm": (1, 0, 2, 3)})  # (C, O, KH, KW)
    phases = []
    for r in np.ndindex(*stride):
        taps = tuple(-(-(kernel[i] - r[i]) // stride[i]) for i in range(2))  # J per dim
        if min(taps) <= 0:  # no tap lands on this phase: its positions get nothing
            phases.append(fnp.zeros((n, c, *rows), ct.dtype))
            continue
        sub = bind("slice", [swapped], {"start": (0, 0, *r), "limit": (c, o, *kernel), "stride": (1, 1, *stride)})
        pads = tuple((taps[i] - 1, max(0, rows[i] - out[i])) for i in range(2))
        phase = bind(
            "conv2d", [ct, fnp.flip(sub, axis=(2, 3))], {"stride": (1, 1), "padding": pads, "dilation": (1, 1)}
        )
        phases.append(_cut(phase, (0, 0), rows))
    # phase (rh, rw) holds positions (rh + sh*m, rw + sw*m'): interleave by one transpose
    stacked = fnp.reshape(fnp.stack(phases), (*stride, n, c, *rows))
    interleaved = bind("transpose", [stacked], {"perm": (2, 3, 4, 0, 5, 1)})
    interleaved = fnp.reshape(interleaved, (n, c, rows[0] * stride[0], rows[1] * stride[1]))
    return _cut(interleaved, (padding[0][0], padding[1][0]), spatial)


VJP_RULES.update({"dot_general": _dot_general_vjp, "conv2d": _conv2d_vjp})


# --- rules: windows ----------------------------------------------------------------------------------------


def _transposed_padding(in_size, pad, out_size, stride, reach):
    """For one spatial dim of a strided window op (conv or pooling) with `reach` = extent of the window
    minus one: the (low, high) padding of the stride-dilated cotangent such that a stride-1 window over
    it covers every input position, and where the input's extent starts in that result."""
    lo = reach - pad[0]
    hi = in_size + pad[0] - (out_size - 1) * stride - 1
    return max(lo, 0), max(hi, 0), max(-lo, 0)


def _dilate_and_pad(ct, spatial, low, high, strides):
    """Pad the trailing `spatial` dims of `ct` by low/high with stride-1 zeros between elements."""
    lead = len(ct.shape) - spatial
    zero = np.zeros((), ct.dtype)
    attrs = {
        "low": (0,) * lead + tuple(low),
        "high": (0,) * lead + tuple(high),
        "interior": (0,) * lead + tuple(s - 1 for s in strides),
    }
    return bind("pad", [ct, zero], attrs)


def _cut(x, start, sizes):
    """x[..., start:start+sizes] on the trailing dims."""
    lead = len(x.shape) - len(start)
    begin = (0,) * lead + tuple(start)
    limit = tuple(x.shape[:lead]) + tuple(s + n for s, n in zip(start, sizes))
    return bind("slice", [x], {"start": begin, "limit": limit, "stride": (1,) * len(begin)})


def _window_sum_vjp(ct, x_shape, window, strides, padding):
    """The input cotangent of a sliding-window sum: a window sum (stride 1) over the dilated cotangent."""
    low, high, start = zip(
        *(_transposed_padding(d, p, n, s, w - 1) for d, p, n, s, w in zip(x_shape, padding, ct.shape, strides, window))
    )
    dilated = _dilate_and_pad(ct, len(x_shape), low, high, strides)
    no_pad = tuple((0, 0) for _ in window)
    summed = bind(
        "reduce_window", [dilated], {"kind": "sum", "window": window, "strides": (1,) * len(window), "padding": no_pad}
    )
    return _cut(summed, start, x_shape)


def _window_max_vjp(ct, x, y, window, strides, padding):
    """Each window sends its cotangent to the positions equal to its maximum, split evenly between
    ties: for each offset k in the window, output o sees input o*stride + k - pad_low."""
    low, high = tuple(p[0] for p in padding), tuple(p[1] for p in padding)
    fill = np.asarray(-np.inf, x.dtype)
    padded = bind("pad", [x, fill], {"low": low, "high": high, "interior": (0,) * len(window)})
    hits = {}
    for offset in np.ndindex(*window):
        limit = tuple(k + (n - 1) * s + 1 for k, n, s in zip(offset, y.shape, strides))
        seen = bind("slice", [padded], {"start": tuple(offset), "limit": limit, "stride": tuple(strides)})
        hits[offset] = fnp.astype(seen == y, x.dtype)
    share = ct / functools.reduce(operator.add, hits.values())
    total = None
    for offset, hit in hits.items():
        low, high, start = [], [], []
        for d, n, (pl, _), s, k in zip(x.shape, y.shape, padding, strides, offset):
            first = k - pl  # the input position output 0 sees at this offset
            low.append(max(first, 0))
            high.append(max(d - first - (n - 1) * s - 1, 0))
            start.append(max(-first, 0))
        placed = _cut(_dilate_and_pad(share * hit, len(window), low, high, strides), start, x.shape)
        total = placed if total is None else total + placed
    return total


def _reduce_window_vjp(op, cts, operands, results):
    (ct,), (x,), (y,) = cts, operands, results
    kind, window, strides, padding = (op.attrs[k] for k in ("kind", "window", "strides", "padding"))
    if kind == "max":
        return [_window_max_vjp(ct, x, y, window, strides, padding)]
    if kind == "avg":
        ct = ct / float(math.prod(window))
    return [_window_sum_vjp(ct, x.shape, window, strides, padding)]


VJP_RULES["reduce_window"] = _reduce_window_vjp
