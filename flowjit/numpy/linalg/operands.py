"""What the decompositions and solvers share: checking their operands, running LAPACK (through
numpy) outside a trace, and the row/column reads and index masks their compiled loops are made of."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import Tracer
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location
from flowjit.numpy.creation import iota
from flowjit.numpy.elementwise import where
from flowjit.numpy.indexing import dynamic_slice
from flowjit.numpy.promotion import _dtype_of, asarray, astype
from flowjit.numpy.shapes import ndim, shape


class LinAlgError(FlowjitValueError, np.linalg.LinAlgError):
    """numpy.linalg.LinAlgError raised by an eager call (a singular matrix in `solve`, a matrix that is
    not positive definite in `cholesky`); under `jit` those results are inf or nan instead."""


def is_traced(*xs) -> bool:
    """Whether any operand is a traced value (then the compiled composite runs, else LAPACK)."""
    return any(isinstance(x, Tracer) for x in xs)


def float_matrices(x, op: str, square: bool = True):
    """`x` as an array of matrices (rank >= 2, square unless `square=False`) of float32 or float64:
    integers become float32 as in the rest of flowjit.numpy; bool and 16-bit floats are refused."""
    x = asarray(x)
    dtype = _dtype_of(x)
    if dtype.is_bool or dtype in (dt.float16, dt.bfloat16):
        raise op_error(
            FlowjitTypeError,
            user_location(),
            op,
            f"needs float32 or float64 matrices; found dtype {dtype}. Convert with .astype(np.float32)",
        )
    if not dtype.is_float:
        x = astype(x, dt.float32)
    if ndim(x) < 2:
        raise op_error(
            FlowjitValueError,
            user_location(),
            op,
            f"needs a matrix or a stack of matrices (rank >= 2); found shape {shape(x)}",
        )
    if square and shape(x)[-1] != shape(x)[-2]:
        raise op_error(
            FlowjitValueError,
            user_location(),
            op,
            f"needs square matrices in the last two dimensions; found shape {shape(x)}",
        )
    return x


def lapack(op: str, fn: Callable, *arrays):
    """`fn(*arrays)` (a numpy.linalg function) with numpy's LinAlgError re-raised as flowjit's,
    naming the user's line."""
    try:
        return fn(*arrays)
    except np.linalg.LinAlgError as err:
        raise op_error(LinAlgError, user_location(), op, f"{err} (under jit the result is inf or nan)") from None


def index_column(n: int):
    """0..n-1 as an (n, 1) column (an iota op under a trace)."""
    return iota((n, 1), 0)


def index_row(n: int):
    """0..n-1 as a (1, n) row."""
    return iota((1, n), 1)


def row(x, i):
    """Row `i` (a traced scalar) of every matrix of `x`, keeping its axis: shape (..., 1, n)."""
    starts = [0] * (ndim(x) - 2) + [i, 0]
    return dynamic_slice(x, starts, shape(x)[:-2] + (1, shape(x)[-1]))


def column(x, j):
    """Column `j` of every matrix of `x`, keeping its axis: shape (..., m, 1)."""
    starts = [0] * (ndim(x) - 1) + [j]
    return dynamic_slice(x, starts, shape(x)[:-1] + (1,))


def entry(x, i, j):
    """x[..., i, j] with its two axes kept: shape (..., 1, 1)."""
    starts = [0] * (ndim(x) - 2) + [i, j]
    return dynamic_slice(x, starts, shape(x)[:-2] + (1, 1))


def zero_unless(mask, x):
    """x where `mask`, else 0 in x's dtype."""
    return where(mask, x, np.zeros((), _dtype_of(x).np_dtype))
