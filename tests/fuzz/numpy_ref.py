"""The numpy side of fuzz programs: what `numpy_source()` statements run against.

Floats are widened to float64 (`W`) and results cast to flowjit's dtype (`C`), so the reference is
independent of flowjit's own implementations. Functions numpy lacks (clamped gather, dynamic_slice,
convolution, pooling, control flow, `scan`, `.at[]` updates, variables) are written here from
their documented semantics.
"""

from __future__ import annotations

import math

import numpy as np

from flowjit.ir import dtypes as dt

_erf = np.vectorize(math.erf, otypes=[np.float64])


def W(x):  # noqa: N802  (one letter keeps rendered statements short)
    """`x` as an array, floats widened to float64."""
    a = np.asarray(x)
    return a.astype(np.float64) if dt.dtype(a.dtype).is_float else a


def C(x, name: str):  # noqa: N802
    """`x` cast to the flowjit dtype called `name`."""
    return np.asarray(x).astype(dt.dtype(name).np_dtype)


def erf(x):
    return _erf(W(x))


def clamp_index(idx, n: int):
    """flowjit's index rule: negative counts from the end, then clamp into [0, n-1]."""
    idx = np.where(idx < 0, idx + n, idx)
    return np.clip(idx, 0, n - 1)


def take(x, idx, axis):
    return np.take(x, clamp_index(np.asarray(idx), x.shape[axis]), axis=axis)


def scatter_add(x, idx, updates, axis):
    out = np.array(x, copy=True)
    idx = clamp_index(np.asarray(idx), x.shape[axis])
    moved = np.moveaxis(out, axis, 0)
    upd = np.moveaxis(np.broadcast_to(updates, x.shape[:axis] + idx.shape + x.shape[axis + 1 :]), axis, 0)
    np.add.at(moved, idx, upd.astype(out.dtype))
    return out


def dynamic_slice(x, starts, sizes):
    index = []
    for s, size, n in zip(starts, sizes, x.shape):
        s = int(np.clip(int(s), 0, n - size))
        index.append(slice(s, s + size))
    return x[tuple(index)]


def right_shift_logical(x, s):
    x = np.asarray(x)
    unsigned = x.view(np.dtype(f"u{x.dtype.itemsize}"))
    return (unsigned >> np.asarray(s, unsigned.dtype)).view(x.dtype)


def conv2d(x, w, stride, padding):
    """NCHW x OIHW, float64."""
    x = np.pad(W(x), ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    w = W(w)
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
    out = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = x[:, :, i * stride : i * stride + kh, j * stride : j * stride + kw]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w)
    return out


def max_pool2d(x, window, stride):
    n, c, h, wd = x.shape
    oh, ow = (h - window) // stride + 1, (wd - window) // stride + 1
    out = np.empty((n, c, oh, ow), x.dtype)
    for i in range(oh):
        for j in range(ow):
            out[:, :, i, j] = x[:, :, i * stride : i * stride + window, j * stride : j * stride + window].max(
                axis=(2, 3)
            )
    return out


def cond(pred, true_fn, false_fn, *operands):
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def fori_loop(lo, hi, body, init):
    val = init
    for i in range(lo, hi):
        val = body(np.int64(i), val)
    return val


def while_loop(cond_fn, body_fn, init):
    val = init
    while bool(cond_fn(val)):
        val = body_fn(val)
    return val


def scan(f, init, xs, length=None, reverse=False):
    """JAX's `lax.scan` by a Python loop: `(final carry, ys stacked)`; `ys[t]` is the step that
    read `xs[t]` (also with `reverse`, which visits the steps from the last)."""
    steps = len(xs) if xs is not None else length
    carry, ys = init, {}
    for t in reversed(range(steps)) if reverse else range(steps):
        carry, ys[t] = f(carry, None if xs is None else xs[t])
    if steps:
        return carry, np.stack([np.asarray(ys[t]) for t in range(steps)])
    y = np.asarray(f(init, None if xs is None else np.zeros(xs.shape[1:], xs.dtype))[1])
    return carry, np.zeros((0, *y.shape), y.dtype)


# How one update combines with the element it reaches, for `x.at[index].<kind>(values)`.
_AT_COMBINE = {
    "set": lambda old, u: u,
    "add": np.add,
    "multiply": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
}


def at_positions(shape, index, traced: bool):
    """The flat position of each element `x[index]` reaches (x of `shape`), -1 where an update is
    dropped. With `traced`, entry 0 of `index` is traced (JAX's mode='drop'): a negative entry
    counts from the end once, and whatever is then out of range is dropped."""
    positions = np.arange(math.prod(shape)).reshape(shape)
    if not traced:
        return positions[index]
    n = shape[0]
    first = np.asarray(index[0])
    first = np.where(first < 0, first + n, first)
    inside = (first >= 0) & (first < n)
    picked = positions[(np.clip(first, 0, n - 1), *index[1:])]
    inside = inside.reshape(inside.shape + (1,) * (picked.ndim - inside.ndim))
    return np.where(inside, picked, -1)


def at_update(x, index, values, kind: str, traced: bool = False):
    """JAX's `x.at[index].<kind>(values)` one update at a time, in order: `set` keeps the last of
    repeated positions, the others combine them all. `values` already has x's dtype."""
    out = np.array(x, copy=True)
    flat = out.reshape(-1)
    positions = at_positions(out.shape, index, traced)
    updates = np.broadcast_to(values, positions.shape)
    for p, u in zip(positions.reshape(-1), updates.reshape(-1)):
        if p >= 0:
            flat[p] = _AT_COMBINE[kind](flat[p], u)
    return out


def stop_gradient(x):
    return x


class Var:
    """A variable as plain numpy: `.value` reads a copy, updates cast to the variable's dtype."""

    def __init__(self, value: np.ndarray):
        self.buffer = np.array(value, copy=True)

    @property
    def value(self):
        return self.buffer.copy()

    def assign(self, x):
        self.buffer[...] = np.asarray(x).astype(self.buffer.dtype)

    def assign_add(self, x):
        self.buffer[...] = (W(self.buffer) + W(x)).astype(self.buffer.dtype)

    def assign_sub(self, x):
        self.buffer[...] = (W(self.buffer) - W(x)).astype(self.buffer.dtype)


def namespace() -> dict:
    """Globals for `numpy_source()` (variables are added by the caller)."""
    import fuzz.numpy_ref as ref

    return {"np": np, "R": ref, "W": W, "C": C}
