"""Counter-based pseudo-random numbers with explicit keys, traceable and reproducible.

    key = fj.random.key(0)
    k1, k2 = fj.random.split(key)
    x = fj.random.normal(k1, (256, 784))

A key is an int64 scalar. Every value is a pure function of (key, position), computed by the
SplitMix64 finalizer (Steele, Lea, Flood 2014) with wrapping 64-bit arithmetic and logical shifts:
the same key gives the same numbers eagerly, under jit, and in compiled code, on every machine.
Never reuse a key for two purposes; `split` it.
"""

from __future__ import annotations

import math

import numpy as np

from flowjit import numpy as fnp
from flowjit.errors import FlowjitValueError
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location

_GOLDEN = np.int64(0x9E3779B97F4A7C15 - (1 << 64))
_MIX1 = np.int64(0xBF58476D1CE4E5B9 - (1 << 64))
_MIX2 = np.int64(0x94D049BB133111EB - (1 << 64))


def _mix(z):
    """SplitMix64's finalizer: a bijective avalanche of 64-bit words."""
    z = fnp.bitwise_xor(z, fnp.right_shift_logical(z, 30))
    z = fnp.multiply(z, _MIX1)
    z = fnp.bitwise_xor(z, fnp.right_shift_logical(z, 27))
    z = fnp.multiply(z, _MIX2)
    return fnp.bitwise_xor(z, fnp.right_shift_logical(z, 31))


def _as_int64(value):
    """An int64 scalar from a Python int (wrapped to 64 bits), a numpy integer or a traced one."""
    if isinstance(value, int | np.integer):
        return fnp.asarray(np.array(int(value) % (1 << 64), np.uint64).astype(np.int64))
    return fnp.astype(value, dt.int64)


def key(seed):
    """A key from an integer seed (a Python int, or an integer scalar, traced or not)."""
    return _mix(fnp.add(_as_int64(seed), _GOLDEN))


PRNGKey = key


def _bits(key, shape):
    """64 random bits per element of `shape` for `key`."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    counter = (
        fnp.iota(shape if shape else (1,), 0, "i64")
        if len(shape) <= 1
        else fnp.reshape(fnp.iota((int(np.prod(shape)),), 0, "i64"), shape)
    )
    if not shape:
        counter = fnp.reshape(counter, ())
    return _mix(fnp.bitwise_xor(fnp.multiply(fnp.add(counter, 1), _GOLDEN), fnp.astype(key, dt.int64)))


def split(key, num: int = 2):
    """`num` new independent keys derived from `key`, as one array of shape (num,), as JAX returns
    them: unpack it (`k1, k2 = split(key)`), index it, or map over it (`fj.vmap(f)(split(key, n))`)."""
    return _mix(fnp.add(_bits(key, (num,)), _MIX2))


def fold_in(key, data):
    """A new key from `key` and an integer, traced or not (e.g. the step number inside a train step)."""
    return _mix(fnp.bitwise_xor(fnp.astype(key, dt.int64), _mix(fnp.add(_as_int64(data), _MIX1))))


def uniform(key, shape=(), dtype="float32", minval=0.0, maxval=1.0):
    """Uniform floats in [minval, maxval)."""
    target = dt.dtype(dtype)
    mantissa = 53 if target is dt.float64 else 24
    bits = fnp.right_shift_logical(_bits(key, shape), 64 - mantissa)
    unit = fnp.multiply(fnp.astype(bits, dt.float64 if target is dt.float64 else dt.float32), 2.0**-mantissa)
    out = fnp.astype(fnp.add(fnp.multiply(unit, maxval - minval), minval), target)
    # unit * span + minval, and the cast to a narrower dtype, can round up to maxval itself.
    below_max = np.nextafter(np.array(maxval, target.np_dtype), np.array(minval, target.np_dtype))
    return fnp.minimum(out, below_max)


def normal(key, shape=(), dtype="float32", mean=0.0, stddev=1.0):
    """Normally distributed floats (Box-Muller on two independent uniform streams)."""
    k1, k2 = split(key)
    work = "float64" if dt.dtype(dtype) is dt.float64 else "float32"
    u1 = fnp.subtract(1.0, uniform(k1, shape, work))  # (0, 1]: log is finite
    u2 = uniform(k2, shape, work)
    radius = fnp.sqrt(fnp.multiply(-2.0, fnp.log(u1)))
    z = fnp.multiply(radius, fnp.cos(fnp.multiply(u2, 2.0 * np.pi)))
    return fnp.astype(fnp.add(fnp.multiply(z, stddev), mean), dtype)


def bernoulli(key, p=0.5, shape=()):
    """Booleans that are True with probability `p`."""
    return fnp.less(uniform(key, shape), p)


def randint(key, shape, minval: int, maxval: int, dtype="int64"):
    """Integers uniform in [minval, maxval) (modulo bias below 2^-40 for ranges under 2^24)."""
    span = int(maxval) - int(minval)
    if span <= 0:
        raise FlowjitValueError(f"{user_location()}: randint needs minval < maxval; found [{minval}, {maxval})")
    bits = fnp.right_shift_logical(_bits(key, shape), 1)
    return fnp.astype(fnp.add(fnp.remainder(bits, span), minval), dtype)


def _ranks(scores):
    """The rank of each of the (n,) `scores` in increasing order, argsort-free with O(n^2) compares;
    equal scores are ranked by index, so the ranks are always a permutation of range(n)."""
    n = fnp.shape(scores)[0]
    index = fnp.iota((n,), 0, "i64")
    before = fnp.logical_or(
        fnp.less(scores[None, :], scores[:, None]),
        fnp.logical_and(fnp.equal(scores[None, :], scores[:, None]), fnp.less(index[None, :], index[:, None])),
    )
    return fnp.astype(fnp.sum(before, axis=1), dt.int64)


def permutation(key, x, axis: int = 0):
    """A random permutation of range(x) for an integer `x` (the rank of each element's 64 random bits),
    or the array `x` shuffled along `axis`."""
    if isinstance(x, int | np.integer):
        return _ranks(_bits(key, (int(x),)))
    x = fnp.asarray(x)
    if fnp.ndim(x) == 0:
        raise FlowjitValueError(f"{user_location()}: permutation needs an integer or an array; found a 0-d array")
    return fnp.take(x, _ranks(_bits(key, (fnp.shape(x)[axis],))), axis=axis)


def shuffle(key, x, axis: int = 0):
    """The array `x` with its slices along `axis` in a random order (permutation(key, x, axis))."""
    return permutation(key, fnp.asarray(x), axis)


def _work_dtype(dtype):
    return "float64" if dt.dtype(dtype) is dt.float64 else "float32"


def gumbel(key, shape=(), dtype="float32"):
    """Standard Gumbel draws -log(-log(u)), u uniform in (0, 1)."""
    work = _work_dtype(dtype)
    u = uniform(key, shape, work, float(np.finfo(work).tiny), 1.0)
    return fnp.astype(fnp.negative(fnp.log(fnp.negative(fnp.log(u)))), dtype)


def categorical(key, logits, axis: int = -1, shape=None):
    """Class indices drawn with probabilities softmax(logits) along `axis` (the Gumbel-max trick).
    The result has the shape of `logits` without `axis`, or `shape` (which that must broadcast to)."""
    logits = fnp.moveaxis(fnp.asarray(logits), axis, -1)
    batch = tuple(fnp.shape(logits)[:-1]) if shape is None else tuple(shape)
    noise = gumbel(key, (*batch, fnp.shape(logits)[-1]), _work_dtype(fnp.result_type(logits)))
    return fnp.argmax(fnp.add(noise, logits), axis=-1)


def choice(key, a, shape=(), replace: bool = True, p=None, axis: int = 0):
    """Random elements of `a` (an array, along `axis`) or of range(a) (an integer), as numpy's choice:
    with or without replacement, uniform or with probabilities `p`."""
    population = int(a) if isinstance(a, int | np.integer) else fnp.shape(a)[axis]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = int(np.prod(shape))
    if not replace and count > population:
        raise FlowjitValueError(
            f"{user_location()}: choice without replacement of {count} elements from a population of {population}"
        )
    if p is None:
        index = randint(key, shape, 0, population) if replace else permutation(key, population)[:count]
    elif replace:
        index = categorical(key, fnp.log(p), shape=shape)
    else:
        # The `count` largest of log(p) + Gumbel noise are a weighted draw without replacement.
        ranks = _ranks(fnp.negative(fnp.add(fnp.log(p), gumbel(key, (population,), _work_dtype(fnp.result_type(p))))))
        picked = fnp.equal(ranks[None, :], fnp.iota((count, population), 0, "i64"))
        index = fnp.sum(fnp.where(picked, fnp.iota((count, population), 1, "i64"), 0), axis=1)
    index = fnp.reshape(index, shape)
    return index if isinstance(a, int | np.integer) else fnp.take(fnp.asarray(a), index, axis=axis)


# Acklam's rational approximation of the normal quantile (relative error below 1.2e-9).
_ACKLAM_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
             -3.066479806614716e01, 2.506628277459239e00)  # fmt: skip
_ACKLAM_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
             -1.328068155288572e01)  # fmt: skip
_ACKLAM_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
             4.374664141464968e00, 2.938163982698783e00)  # fmt: skip
_ACKLAM_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
_ACKLAM_LOW = 0.02425


def _polynomial(coefficients, x):
    out = coefficients[0]
    for c in coefficients[1:]:
        out = fnp.add(fnp.multiply(out, x), c)
    return out


def _normal_cdf(x):
    return fnp.multiply(0.5, fnp.add(1.0, fnp.erf(fnp.multiply(x, 1.0 / np.sqrt(2.0)))))


def _normal_quantile(p):
    """The inverse of the standard normal CDF for float64 p in (0, 1): Acklam's approximation, refined
    by one Halley step in the central region (in the tails 1 + erf cancels and the step would not help)."""
    central = fnp.logical_and(fnp.greater_equal(p, _ACKLAM_LOW), fnp.less_equal(p, 1.0 - _ACKLAM_LOW))
    q = fnp.subtract(p, 0.5)
    r = fnp.multiply(q, q)
    middle = fnp.divide(fnp.multiply(_polynomial(_ACKLAM_A, r), q), _polynomial((*_ACKLAM_B, 1.0), r))
    tail_p = fnp.minimum(p, fnp.subtract(1.0, p))
    t = fnp.sqrt(fnp.multiply(-2.0, fnp.log(tail_p)))
    tail = fnp.divide(_polynomial(_ACKLAM_C, t), _polynomial((*_ACKLAM_D, 1.0), t))
    tail = fnp.where(fnp.less(p, 0.5), tail, fnp.negative(tail))
    error = fnp.subtract(_normal_cdf(middle), p)
    step = fnp.multiply(fnp.multiply(error, np.sqrt(2.0 * np.pi)), fnp.exp(fnp.multiply(0.5, fnp.square(middle))))
    refined = fnp.subtract(middle, fnp.divide(step, fnp.add(1.0, fnp.multiply(0.5, fnp.multiply(middle, step)))))
    return fnp.where(central, refined, tail)


def truncated_normal(key, lower, upper, shape=(), dtype="float32"):
    """Standard normal draws conditioned on [lower, upper] (Python floats, possibly infinite) by
    inverse-CDF sampling in float64; bounds beyond about 37 standard deviations collapse to the bound."""
    lower, upper = float(lower), float(upper)
    if not lower < upper:
        raise FlowjitValueError(f"{user_location()}: truncated_normal needs lower < upper; found [{lower}, {upper}]")
    if lower > 0.0:
        # Sample the mirrored interval: CDF values near 0 are far more precise than near 1.
        return fnp.negative(truncated_normal(key, -upper, -lower, shape, dtype))
    low_p, high_p = (0.5 * math.erfc(-bound / math.sqrt(2.0)) for bound in (lower, upper))
    u = uniform(key, shape, "float64", low_p, high_p)
    # Keep p inside (0, 1) where the quantile is finite; the clip to the bounds catches the rest.
    p = fnp.clip(u, np.finfo(np.float64).tiny, 1.0 - np.finfo(np.float64).epsneg)
    return fnp.astype(fnp.clip(_normal_quantile(p), lower, upper), dtype)
