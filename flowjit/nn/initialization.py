"""Weight initializers, `fn(key, shape, dtype='float32') -> array`, under the `nn.initializers`
namespace (as `jax.nn.initializers`). Fans follow the layouts of flowjit.nn: a matrix is (in, out)
as `linear` uses it, a convolution kernel OIHW."""

from __future__ import annotations

import math

from flowjit import numpy as fnp
from flowjit import random
from flowjit.errors import FlowjitValueError
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location


def _fans(shape):
    if len(shape) < 2:
        return shape[0] if shape else 1, shape[0] if shape else 1
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    if len(shape) > 2:  # OIHW conv weights
        return shape[1] * receptive, shape[0] * receptive
    return shape[0], shape[1]


# The standard deviation of a standard normal truncated to [-2, 2]: dividing by it keeps the
# truncated draws at the variance asked for (as JAX's variance_scaling does).
_TRUNCATED_STDDEV = 0.87962566103423978


def _orthonormal_columns(a):
    """Q of the QR factorization of a tall (n, k) matrix with a positive diagonal R, by modified
    Gram-Schmidt with one re-orthogonalization pass (twice is enough; Giraud et al. 2005)."""
    n, k = fnp.shape(a)
    q = None
    for j in range(k):
        v = a[:, j : j + 1]
        if q is not None:
            for _ in range(2):
                v = fnp.subtract(v, fnp.matmul(q, fnp.matmul(fnp.transpose(q), v)))
        v = fnp.divide(v, fnp.sqrt(fnp.sum(fnp.multiply(v, v))))
        q = v if q is None else fnp.concatenate([q, v], axis=1)
    return q


class initializers:  # noqa: N801  (a namespace, as `jax.nn.initializers`)
    """Weight initializers: `fn(key, shape, dtype='float32') -> array`. The names taking
    hyperparameters (`constant`, `normal`, `uniform`, `truncated_normal`, `orthogonal`,
    `variance_scaling`) return such a function."""

    @staticmethod
    def zeros(key, shape, dtype="float32"):
        """All zeros (the key is unused)."""
        return fnp.zeros(shape, dtype)

    @staticmethod
    def ones(key, shape, dtype="float32"):
        """All ones (the key is unused)."""
        return fnp.ones(shape, dtype)

    @staticmethod
    def constant(value: float):
        """All `value`."""
        return lambda key, shape, dtype="float32": fnp.full(shape, value, dtype)

    @staticmethod
    def normal(stddev: float = 0.01):
        """Normal draws with standard deviation `stddev`."""
        return lambda key, shape, dtype="float32": random.normal(key, shape, dtype, stddev=stddev)

    @staticmethod
    def uniform(scale: float = 0.01):
        """Uniform draws in [-scale, scale)."""
        return lambda key, shape, dtype="float32": random.uniform(key, shape, dtype, -scale, scale)

    @staticmethod
    def truncated_normal(stddev: float = 0.01, lower: float = -2.0, upper: float = 2.0):
        """stddev times a standard normal truncated to [lower, upper] (bounds in standard deviations)."""
        return lambda key, shape, dtype="float32": fnp.multiply(
            random.truncated_normal(key, lower, upper, shape, dtype), stddev
        )

    @staticmethod
    def variance_scaling(scale: float, mode: str = "fan_in", distribution: str = "truncated_normal"):
        """Draws with variance scale / fan, fan = fan_in, fan_out or their average ('fan_avg'), from a
        'truncated_normal' (within 2 standard deviations), 'normal' or 'uniform' distribution."""
        if mode not in ("fan_in", "fan_out", "fan_avg") or distribution not in (
            "truncated_normal",
            "normal",
            "uniform",
        ):
            raise FlowjitValueError(
                f"{user_location()}: variance_scaling: mode must be 'fan_in', 'fan_out' or 'fan_avg' and "
                f"distribution 'truncated_normal', 'normal' or 'uniform'; found {mode!r} and {distribution!r}"
            )

        def init(key, shape, dtype="float32"):
            fan_in, fan_out = _fans(tuple(shape))
            fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
            variance = scale / fan
            if distribution == "uniform":
                limit = math.sqrt(3.0 * variance)
                return random.uniform(key, shape, dtype, -limit, limit)
            if distribution == "normal":
                return random.normal(key, shape, dtype, stddev=math.sqrt(variance))
            draws = random.truncated_normal(key, -2.0, 2.0, shape, dtype)
            return fnp.multiply(draws, math.sqrt(variance) / _TRUNCATED_STDDEV)

        return init

    @staticmethod
    def glorot_uniform(key, shape, dtype="float32"):
        """Uniform in +-sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio; alias xavier_uniform)."""
        fan_in, fan_out = _fans(tuple(shape))
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return random.uniform(key, shape, dtype, -limit, limit)

    xavier_uniform = glorot_uniform

    @staticmethod
    def glorot_normal(key, shape, dtype="float32"):
        """Normal with variance 2 / (fan_in + fan_out) (alias xavier_normal)."""
        fan_in, fan_out = _fans(tuple(shape))
        return random.normal(key, shape, dtype, stddev=math.sqrt(2.0 / (fan_in + fan_out)))

    xavier_normal = glorot_normal

    @staticmethod
    def he_normal(key, shape, dtype="float32"):
        """Normal with variance 2 / fan_in (He et al.; alias kaiming_normal, as PyTorch's default gain)."""
        fan_in, _ = _fans(tuple(shape))
        return random.normal(key, shape, dtype, stddev=math.sqrt(2.0 / fan_in))

    kaiming_normal = he_normal

    @staticmethod
    def he_uniform(key, shape, dtype="float32"):
        """Uniform in +-sqrt(6 / fan_in), variance 2 / fan_in (alias kaiming_uniform)."""
        fan_in, _ = _fans(tuple(shape))
        limit = math.sqrt(6.0 / fan_in)
        return random.uniform(key, shape, dtype, -limit, limit)

    kaiming_uniform = he_uniform

    @staticmethod
    def lecun_normal(key, shape, dtype="float32"):
        """Normal with variance 1 / fan_in."""
        fan_in, _ = _fans(tuple(shape))
        return random.normal(key, shape, dtype, stddev=math.sqrt(1.0 / fan_in))

    @staticmethod
    def lecun_uniform(key, shape, dtype="float32"):
        """Uniform in +-sqrt(3 / fan_in), variance 1 / fan_in."""
        fan_in, _ = _fans(tuple(shape))
        limit = math.sqrt(3.0 / fan_in)
        return random.uniform(key, shape, dtype, -limit, limit)

    @staticmethod
    def orthogonal(scale: float = 1.0):
        """A (semi-)orthogonal matrix times `scale`, Haar-distributed: shape[0] rows against the product
        of the other dimensions (PyTorch's `orthogonal_` flattening); orthonormal columns when taller
        than wide, orthonormal rows otherwise."""

        def init(key, shape, dtype="float32"):
            shape = tuple(shape)
            if len(shape) < 2:
                raise FlowjitValueError(f"{user_location()}: orthogonal needs at least 2 dimensions; found {shape}")
            rows, cols = shape[0], math.prod(shape[1:])
            work = "float64" if dt.dtype(dtype) is dt.float64 else "float32"
            gaussian = random.normal(key, (max(rows, cols), min(rows, cols)), work)
            q = _orthonormal_columns(gaussian)
            if rows < cols:
                q = fnp.transpose(q)
            return fnp.astype(fnp.reshape(fnp.multiply(q, scale), shape), dtype)

        return init
