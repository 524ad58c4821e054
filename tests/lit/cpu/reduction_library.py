"""Functions traced by reduction-library.fj (`flowjit dump FILE.py:FUNCTION`)."""

import flowjit.numpy as fnp


def total(x):
    return fnp.sum(x)


def largest(x):
    return fnp.max(x)


def column_totals(x):
    return fnp.sum(x, axis=0)
