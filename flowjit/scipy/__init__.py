"""scipy-compatible functions for flowjit (`flowjit.scipy.linalg`), as `jax.scipy` is to JAX."""

from flowjit.scipy import linalg  # noqa: F401
