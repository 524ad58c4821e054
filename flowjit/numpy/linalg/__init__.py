"""numpy.linalg for flowjit: products and norms (`products.py`); the decompositions and solvers
(`cholesky.py`, `lu.py`, `qr.py`, `eigh.py`, `svd.py`, `triangular.py`) are composites of existing
ops under a trace and call LAPACK through numpy outside one. Algorithms, costs and gradients:
docs/linalg.md."""

from flowjit.numpy.linalg.cholesky import cholesky  # noqa: F401 (the public namespace)
from flowjit.numpy.linalg.eigh import EighResult, eigh  # noqa: F401
from flowjit.numpy.linalg.lu import SlogdetResult, det, inv, slogdet, solve  # noqa: F401
from flowjit.numpy.linalg.operands import LinAlgError  # noqa: F401
from flowjit.numpy.linalg.products import (  # noqa: F401
    dot,
    einsum,
    inner,
    kron,
    matmul,
    norm,
    outer,
    tensordot,
    trace,
    vdot,
)
from flowjit.numpy.linalg.qr import QRResult, qr  # noqa: F401
from flowjit.numpy.linalg.svd import SVDResult, svd  # noqa: F401
