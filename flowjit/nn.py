"""Neural-network building blocks written with flowjit ops: activations, normalization, losses,
convolution and pooling, embeddings, dropout and initializers. Everything works under `fj.jit` and
`fj.grad`, and eagerly on numpy arrays.

Layouts follow the paper's era and PyTorch: images are NCHW, convolution weights OIHW.
"""

from __future__ import annotations

import math

import numpy as np

from flowjit import numpy as fnp
from flowjit import random
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.grad import stop_gradient
from flowjit.frontend.trace import bind
from flowjit.ir.location import user_location

# --- activations -------------------------------------------------------------------------------------


def relu(x):
    """max(x, 0)."""
    return fnp.maximum(x, 0)


def relu6(x):
    return fnp.clip(x, 0, 6)


def leaky_relu(x, negative_slope: float = 0.01):
    return fnp.where(fnp.greater(x, 0), x, fnp.multiply(x, negative_slope))


def sigmoid(x):
    """1 / (1 + exp(-x)), computed without overflow."""
    return fnp.logistic(x)


def silu(x):
    """x * sigmoid(x) (swish)."""
    return fnp.multiply(x, sigmoid(x))


def softplus(x):
    """log(1 + exp(x)), stable for large |x|."""
    x = fnp.asarray(x)
    return fnp.add(fnp.maximum(x, 0), fnp.log1p(fnp.exp(fnp.negative(fnp.abs(x)))))


def gelu(x, approximate: bool = False):
    """Gaussian error linear unit: x * Phi(x), exact (erf) by default, tanh approximation if asked."""
    x = fnp.asarray(x)
    if approximate:
        inner = fnp.multiply(math.sqrt(2.0 / math.pi), fnp.add(x, fnp.multiply(0.044715, fnp.power(x, 3))))
        return fnp.multiply(fnp.multiply(0.5, x), fnp.add(1.0, fnp.tanh(inner)))
    return fnp.multiply(fnp.multiply(0.5, x), fnp.add(1.0, fnp.erf(fnp.multiply(x, 1.0 / math.sqrt(2.0)))))


def logsumexp(x, axis=-1, keepdims: bool = False):
    """log(sum(exp(x))) along `axis`, shifted by the maximum so it never overflows."""
    x = fnp.asarray(x)
    # The shift cancels in value and in gradient; stop_gradient saves differentiating the max.
    peak = stop_gradient(fnp.max(x, axis=axis, keepdims=True))
    peak = fnp.where(fnp.isfinite(peak), peak, 0.0)
    out = fnp.add(fnp.log(fnp.sum(fnp.exp(fnp.subtract(x, peak)), axis=axis, keepdims=True)), peak)
    return out if keepdims else fnp.squeeze(out, axis=axis)


def softmax(x, axis=-1):
    """exp(x) / sum(exp(x)) along `axis`, max-shifted for stability."""
    x = fnp.asarray(x)
    shifted = fnp.subtract(x, stop_gradient(fnp.max(x, axis=axis, keepdims=True)))
    e = fnp.exp(shifted)
    return fnp.divide(e, fnp.sum(e, axis=axis, keepdims=True))


def log_softmax(x, axis=-1):
    """x - logsumexp(x) along `axis`."""
    x = fnp.asarray(x)
    shifted = fnp.subtract(x, stop_gradient(fnp.max(x, axis=axis, keepdims=True)))
    return fnp.subtract(shifted, fnp.log(fnp.sum(fnp.exp(shifted), axis=axis, keepdims=True)))


# --- normalization and losses ---------------------------------------------------------------------------


def layer_norm(x, gamma=None, beta=None, eps: float = 1e-5, axis=-1):
    """(x - mean) / sqrt(var + eps) over `axis`, then scaled by `gamma` and shifted by `beta`."""
    x = fnp.asarray(x)
    mean = fnp.mean(x, axis=axis, keepdims=True)
    centered = fnp.subtract(x, mean)
    var = fnp.mean(fnp.multiply(centered, centered), axis=axis, keepdims=True)
    out = fnp.multiply(centered, fnp.rsqrt(fnp.add(var, eps)))
    if gamma is not None:
        out = fnp.multiply(out, gamma)
    if beta is not None:
        out = fnp.add(out, beta)
    return out


def one_hot(labels, num_classes: int, dtype="float32"):
    """labels[..., None] == arange(num_classes), as `dtype`."""
    labels = fnp.asarray(labels)
    classes = fnp.iota(tuple(fnp.shape(labels)) + (num_classes,), fnp.ndim(labels), "i64")
    return fnp.astype(fnp.equal(fnp.expand_dims(fnp.astype(labels, "i64"), -1), classes), dtype)


def cross_entropy(logits, labels, reduction: str = "mean"):
    """Softmax cross-entropy of `logits` [..., classes] against integer class `labels` [...].

    reduction: 'mean' (default), 'sum' or 'none'.
    """
    logits = fnp.asarray(logits)
    labels = fnp.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise FlowjitTypeError(
            f"{user_location()}: cross_entropy expects integer class labels; found {labels.dtype}. "
            "For one-hot or soft targets use -sum(targets * log_softmax(logits), axis=-1)"
        )
    if tuple(fnp.shape(labels)) != tuple(fnp.shape(logits))[:-1]:
        raise FlowjitTypeError(
            f"{user_location()}: cross_entropy: labels of shape {fnp.shape(labels)} do not match logits of shape "
            f"{fnp.shape(logits)} (expected labels of shape {fnp.shape(logits)[:-1]})"
        )
    logp = log_softmax(logits, axis=-1)
    # Select, not multiply by the one-hot: a -inf logit elsewhere in the row would give -inf * 0 = nan.
    picked = fnp.sum(fnp.where(one_hot(labels, fnp.shape(logits)[-1], "bool"), logp, 0.0), axis=-1)
    losses = fnp.negative(picked)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return fnp.sum(losses)
    if reduction != "mean":
        raise FlowjitValueError(f"{user_location()}: reduction must be 'mean', 'sum' or 'none'; found {reduction!r}")
    return fnp.mean(losses)


def mse_loss(pred, target):
    diff = fnp.subtract(pred, target)
    return fnp.mean(fnp.multiply(diff, diff))


def accuracy(logits, labels):
    """Fraction of rows whose argmax equals the label."""
    return fnp.mean(fnp.astype(fnp.equal(fnp.argmax(logits, axis=-1), labels), "float32"))


# --- convolution and pooling --------------------------------------------------------------------------


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if len(v) != 2:
        raise FlowjitValueError(f"{user_location()}: {what} must be an int or a pair; found {v!r}")
    return (int(v[0]), int(v[1]))


def _conv_padding(padding, size, kernel, stride, dilation):
    """'VALID', 'SAME', an int, a pair, or ((top, bottom), (left, right)) -> ((lo, hi), (lo, hi)).

    'SAME' is TensorFlow's and XLA's: the output has ceil(size / stride) positions and the odd pixel
    of padding goes at the end, so strided layers match models ported from those frameworks."""
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "VALID":
            return ((0, 0), (0, 0))
        if mode == "SAME":
            pads = []
            for n, k, s, d in zip(size, kernel, stride, dilation):
                total = max((-(-n // s) - 1) * s + d * (k - 1) + 1 - n, 0)
                pads.append((total // 2, total - total // 2))
            return tuple(pads)
        raise FlowjitValueError(f"{user_location()}: padding must be 'SAME', 'VALID' or numbers; found {padding!r}")
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    if all(isinstance(p, int) for p in padding):
        return ((padding[0], padding[0]), (padding[1], padding[1]))
    return tuple((int(lo), int(hi)) for lo, hi in padding)


def conv2d(x, w, b=None, stride=1, padding=0, dilation=1):
    """2-D convolution of NCHW `x` with OIHW `w` (plus bias `b` of shape (O,))."""
    x, w = fnp.asarray(x), fnp.asarray(w)
    target = fnp.result_type(x, w)
    if not target.is_float:
        raise FlowjitTypeError(f"{user_location()}: conv2d needs float inputs; found {target}")
    x, w = fnp.astype(x, target), fnp.astype(w, target)
    dilation, stride = _pair(dilation, "dilation"), _pair(stride, "stride")
    if fnp.ndim(x) != 4 or fnp.ndim(w) != 4:
        raise FlowjitTypeError(
            f"{user_location()}: conv2d expects NCHW input and OIHW weights; found shapes {fnp.shape(x)} and "
            f"{fnp.shape(w)}"
        )
    pads = _conv_padding(padding, fnp.shape(x)[2:], fnp.shape(w)[2:], stride, dilation)
    out = bind("conv2d", [x, w], {"stride": stride, "padding": pads, "dilation": dilation})
    if b is not None:
        out = fnp.add(out, fnp.reshape(b, (1, -1, 1, 1)))
    return out


def _pool(kind, x, window, stride, padding):
    x = fnp.asarray(x)
    if fnp.ndim(x) != 4:
        raise FlowjitTypeError(f"{user_location()}: {kind} pooling expects NCHW input; found shape {fnp.shape(x)}")
    window = _pair(window, "window")
    stride = window if stride is None else _pair(stride, "stride")
    pad = _conv_padding(padding, fnp.shape(x)[2:], window, stride, (1, 1))
    return bind(
        "reduce_window",
        [x],
        {"kind": kind, "window": (1, 1, *window), "strides": (1, 1, *stride), "padding": ((0, 0), (0, 0), *pad)},
    )


def max_pool2d(x, window=2, stride=None, padding=0):
    """Max over `window` (default stride = window) of NCHW `x`."""
    return _pool("max", x, window, stride, padding)


def avg_pool2d(x, window=2, stride=None, padding=0):
    """Average over `window` of NCHW `x` (padding counts toward the divisor)."""
    return _pool("avg", x, window, stride, padding)


# --- embeddings, dropout, linear ---------------------------------------------------------------------


def embedding(table, ids):
    """Rows of `table` [vocab, dim] for integer `ids` (any shape) -> [*ids.shape, dim].

    PyTorch's `F.embedding(ids, table)` order is accepted too: a float `ids` with an integer `table`
    can only mean the arguments were swapped."""
    table, ids = fnp.asarray(table), fnp.asarray(ids)
    if np.issubdtype(table.dtype, np.integer) and np.issubdtype(ids.dtype, np.floating):
        table, ids = ids, table
    return fnp.take(table, ids, axis=0)


def dropout(key, x, rate: float, deterministic: bool = False):
    """Zero each element with probability `rate` and scale survivors by 1/(1-rate) (inverted dropout).
    `deterministic=True` (evaluation) returns x unchanged."""
    if deterministic or rate == 0.0:
        return x
    if not 0.0 <= rate < 1.0:
        raise FlowjitValueError(f"{user_location()}: dropout rate must be in [0, 1); found {rate}")
    keep = random.bernoulli(key, 1.0 - rate, fnp.shape(x))
    return fnp.where(keep, fnp.divide(x, 1.0 - rate), 0.0)


def linear(x, w, b=None):
    """x @ w + b."""
    out = fnp.matmul(x, w)
    return out if b is None else fnp.add(out, b)


# --- initializers -------------------------------------------------------------------------------------


def _fans(shape):
    if len(shape) < 2:
        return shape[0] if shape else 1, shape[0] if shape else 1
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    if len(shape) > 2:  # OIHW conv weights
        return shape[1] * receptive, shape[0] * receptive
    return shape[0], shape[1]


class initializers:  # noqa: N801  (a namespace, as `jax.nn.initializers`)
    """Weight initializers: `fn(key, shape, dtype='float32') -> array`."""

    @staticmethod
    def zeros(key, shape, dtype="float32"):
        return fnp.zeros(shape, dtype)

    @staticmethod
    def ones(key, shape, dtype="float32"):
        return fnp.ones(shape, dtype)

    @staticmethod
    def normal(stddev: float = 0.01):
        return lambda key, shape, dtype="float32": random.normal(key, shape, dtype, stddev=stddev)

    @staticmethod
    def uniform(scale: float = 0.01):
        return lambda key, shape, dtype="float32": random.uniform(key, shape, dtype, -scale, scale)

    @staticmethod
    def glorot_uniform(key, shape, dtype="float32"):
        fan_in, fan_out = _fans(tuple(shape))
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return random.uniform(key, shape, dtype, -limit, limit)

    xavier_uniform = glorot_uniform

    @staticmethod
    def glorot_normal(key, shape, dtype="float32"):
        fan_in, fan_out = _fans(tuple(shape))
        return random.normal(key, shape, dtype, stddev=math.sqrt(2.0 / (fan_in + fan_out)))

    @staticmethod
    def he_normal(key, shape, dtype="float32"):
        fan_in, _ = _fans(tuple(shape))
        return random.normal(key, shape, dtype, stddev=math.sqrt(2.0 / fan_in))

    kaiming_normal = he_normal

    @staticmethod
    def he_uniform(key, shape, dtype="float32"):
        fan_in, _ = _fans(tuple(shape))
        limit = math.sqrt(6.0 / fan_in)
        return random.uniform(key, shape, dtype, -limit, limit)

    @staticmethod
    def lecun_normal(key, shape, dtype="float32"):
        fan_in, _ = _fans(tuple(shape))
        return random.normal(key, shape, dtype, stddev=math.sqrt(1.0 / fan_in))
