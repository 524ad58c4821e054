"""Activations, softmax and friends, and vector similarity.

Branches that would overflow in the branch `where` does not pick (exp of a large positive input in
elu) are fed clamped inputs: `where` routes a zero cotangent there, and 0 * inf would be nan.
"""

from __future__ import annotations

import math

import numpy as np

from flowjit import numpy as fnp
from flowjit.errors import FlowjitValueError
from flowjit.frontend.grad import stop_gradient
from flowjit.ir.location import user_location

# SELU's fixed point constants (Klambauer et al. 2017), as in PyTorch and JAX.
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def relu(x):
    """max(x, 0), nan kept, with the derivative 0 at 0 (as PyTorch's and JAX's relu). As
    `maximum(x, 0)` the tie at 0 split the gradient (0.5 there), the rule for `maximum` itself."""
    x = fnp.asarray(x)
    return fnp.where(fnp.less_equal(x, 0), np.zeros((), fnp.result_type(x).np_dtype), x)


def relu6(x):
    """min(max(x, 0), 6), nan kept, derivative 0 at 0 and 6 (as PyTorch's)."""
    return hard_tanh(x, 0.0, 6.0)


def leaky_relu(x, negative_slope: float = 0.01):
    """x for x > 0, negative_slope * x otherwise."""
    return fnp.where(fnp.greater(x, 0), x, fnp.multiply(x, negative_slope))


def elu(x, alpha: float = 1.0):
    """x for x > 0, alpha * (exp(x) - 1) otherwise."""
    x = fnp.asarray(x)
    positive = fnp.greater(x, 0)
    # expm1 of x where x <= 0 (0 elsewhere, so it never overflows): not of minimum(x, 0), whose tie
    # at 0 would split the gradient there (elu'(0) would be alpha / 2; it is alpha, as in PyTorch and JAX).
    return fnp.where(positive, x, fnp.multiply(alpha, fnp.expm1(fnp.where(positive, 0, x))))


def selu(x):
    """Scaled ELU with the self-normalizing constants (scale 1.0507, alpha 1.6733)."""
    return fnp.multiply(_SELU_SCALE, elu(x, _SELU_ALPHA))


def celu(x, alpha: float = 1.0):
    """max(x, 0) + min(alpha * (exp(x / alpha) - 1), 0)."""
    x = fnp.asarray(x)
    positive = fnp.greater(x, 0)
    negative = fnp.multiply(alpha, fnp.expm1(fnp.divide(fnp.where(positive, 0, x), alpha)))  # as in `elu`
    return fnp.where(positive, x, negative)


def sigmoid(x):
    """1 / (1 + exp(-x)), computed without overflow."""
    return fnp.logistic(x)


def log_sigmoid(x):
    """log(sigmoid(x)) = -softplus(-x), finite for large negative x."""
    return fnp.negative(softplus(fnp.negative(x)))


def hard_sigmoid(x):
    """relu6(x + 3) / 6, the piecewise-linear sigmoid of MobileNetV3 (PyTorch's and JAX's)."""
    return fnp.divide(relu6(fnp.add(x, 3.0)), 6.0)


def hard_tanh(x, min_val: float = -1.0, max_val: float = 1.0):
    """x clipped to [min_val, max_val] (nan kept), derivative 0 at the bounds (as PyTorch's; a clip's
    ties split it there)."""
    x = fnp.asarray(x)
    kind = fnp.result_type(x).np_dtype
    low, high = np.asarray(min_val).astype(kind), np.asarray(max_val).astype(kind)
    return fnp.where(fnp.less_equal(x, low), low, fnp.where(fnp.greater_equal(x, high), high, x))


def hard_swish(x):
    """x * hard_sigmoid(x)."""
    return fnp.multiply(x, hard_sigmoid(x))


hard_silu = hard_swish


def silu(x):
    """x * sigmoid(x) (swish)."""
    return fnp.multiply(x, sigmoid(x))


swish = silu


def softplus(x):
    """log(1 + exp(x)), stable for large |x|."""
    x = fnp.asarray(x)
    return fnp.add(fnp.maximum(x, 0), fnp.log1p(fnp.exp(fnp.negative(fnp.abs(x)))))


def softsign(x):
    """x / (1 + |x|)."""
    x = fnp.asarray(x)
    return fnp.divide(x, fnp.add(fnp.abs(x), 1.0))


def mish(x):
    """x * tanh(softplus(x))."""
    return fnp.multiply(x, fnp.tanh(softplus(x)))


def tanh(x):
    """The hyperbolic tangent (as `flowjit.numpy.tanh`)."""
    return fnp.tanh(x)


def gelu(x, approximate: bool = False):
    """Gaussian error linear unit: x * Phi(x), exact (erf) by default, tanh approximation if asked.
    The cube is x * x * x, as JAX and PyTorch compute it: a general power costs a logarithm and an
    exponential in float64 per element."""
    x = fnp.asarray(x)
    if approximate:
        cube = fnp.multiply(fnp.multiply(x, x), x)
        inner = fnp.multiply(math.sqrt(2.0 / math.pi), fnp.add(x, fnp.multiply(0.044715, cube)))
        return fnp.multiply(fnp.multiply(0.5, x), fnp.add(1.0, fnp.tanh(inner)))
    return fnp.multiply(fnp.multiply(0.5, x), fnp.add(1.0, fnp.erf(fnp.multiply(x, 1.0 / math.sqrt(2.0)))))


def glu(x, axis: int = -1):
    """Gated linear unit: the first half of `axis` times the sigmoid of the second half."""
    x = fnp.asarray(x)
    size = fnp.shape(x)[axis]
    if size % 2:
        raise FlowjitValueError(
            f"{user_location()}: glu splits axis {axis} in two halves; found an odd size {size} in shape {fnp.shape(x)}"
        )
    a, b = fnp.split(x, 2, axis=axis)
    return fnp.multiply(a, sigmoid(b))


def logsumexp(x, axis=-1, keepdims: bool = False):
    """log(sum(exp(x))) along `axis`, shifted by the maximum so it never overflows."""
    x = fnp.asarray(x)
    # The shift cancels in value and in gradient; stop_gradient saves differentiating the max.
    peak = stop_gradient(fnp.max(x, axis=axis, keepdims=True))
    peak = fnp.where(fnp.isfinite(peak), peak, 0.0)
    out = fnp.add(fnp.log(fnp.sum(fnp.exp(fnp.subtract(x, peak)), axis=axis, keepdims=True)), peak)
    return out if keepdims else fnp.squeeze(out, axis=axis)


def softmax(x, axis=-1):
    """exp(x) / sum(exp(x)) along `axis`, max-shifted for stability.

    exp(x) is multiplied by the sum's reciprocal (as PyTorch does), not divided by the sum: one
    division per row instead of one per element (a vector division takes 16 cycles per 16 floats
    on Intel's AVX-512 cores). Within 1.5 ulp of the division."""
    x = fnp.asarray(x)
    shifted = fnp.subtract(x, stop_gradient(fnp.max(x, axis=axis, keepdims=True)))
    e = fnp.exp(shifted)
    return fnp.multiply(e, fnp.reciprocal(fnp.sum(e, axis=axis, keepdims=True)))


def log_softmax(x, axis=-1):
    """x - logsumexp(x) along `axis`."""
    x = fnp.asarray(x)
    shifted = fnp.subtract(x, stop_gradient(fnp.max(x, axis=axis, keepdims=True)))
    return fnp.subtract(shifted, fnp.log(fnp.sum(fnp.exp(shifted), axis=axis, keepdims=True)))


def _norm(x, axis, eps):
    """The L2 norm along `axis` (kept), at least `eps`. The clamp is inside the square root so that a
    zero vector has a zero gradient, not the nan of sqrt's derivative at 0."""
    squares = fnp.sum(fnp.multiply(x, x), axis=axis, keepdims=True)
    return fnp.sqrt(fnp.maximum(squares, eps * eps))


def normalize(x, axis: int = -1, eps: float = 1e-12):
    """x / max(||x||_2, eps) along `axis` (PyTorch's `F.normalize` with p=2)."""
    x = fnp.asarray(x)
    return fnp.divide(x, _norm(x, axis, eps))


def cosine_similarity(x1, x2, axis: int = -1, eps: float = 1e-8):
    """sum(x1 * x2) / (max(||x1||, eps) * max(||x2||, eps)) along `axis` (PyTorch's definition)."""
    x1, x2 = fnp.asarray(x1), fnp.asarray(x2)
    dots = fnp.sum(fnp.multiply(x1, x2), axis=axis, keepdims=True)
    out = fnp.divide(dots, fnp.multiply(_norm(x1, axis, eps), _norm(x2, axis, eps)))
    return fnp.squeeze(out, axis=axis)
