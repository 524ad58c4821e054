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
    """`num` new independent keys derived from `key` (returned as a list)."""
    derived = _mix(fnp.add(_bits(key, (num,)), _MIX2))
    return [derived[i] for i in range(num)]


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


def permutation(key, n: int):
    """A random permutation of range(n): the rank of each element's 64 random bits (argsort-free,
    O(n^2) compares). Equal bits are ranked by index, so the result is a permutation even on a tie."""
    scores = _bits(key, (n,))
    index = fnp.iota((n,), 0, "i64")
    before = fnp.logical_or(
        fnp.less(scores[None, :], scores[:, None]),
        fnp.logical_and(fnp.equal(scores[None, :], scores[:, None]), fnp.less(index[None, :], index[:, None])),
    )
    return fnp.astype(fnp.sum(before, axis=1), dt.int64)
