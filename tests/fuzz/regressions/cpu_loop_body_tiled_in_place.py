"""Fuzzer regression: CPU control flow: a loop body with a tiled (vectorized) kernel wrote its result in place into the carried buffer it was still reading; one-shot bufferization rejected the scf.for (cannot avoid RaW conflict) for vectors of 17+ elements

Written by tests/fuzz (see docs/fuzzing.md); run by tests/test_fuzz.py forever after.
"""

import os
import sys

import ml_dtypes  # noqa: F401  (bfloat16 literals)
import numpy as np

# tests/ (where the `fuzz` package lives): two levels up, or FLOWJIT_TESTS_DIR for a copy elsewhere
TESTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
sys.path.insert(0, os.environ.get('FLOWJIT_TESTS_DIR', TESTS_DIR))
from fuzz.oracles import check_sources  # noqa: E402

INPUTS = {
    'x0': np.array([-1.0, -0.875, -0.75, -0.625, -0.5, -0.375, -0.25, -0.125, 0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0], dtype=np.float64).reshape((17,)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0):
    v0 = FJ.fori_loop(0, 3, lambda i, c: (c * 0.5 + M.tanh(x0) + i).astype('f64'), x0)
    return (v0, )
'''
NUMPY_SOURCE = '''
def program(x0):
    v0 = R.fori_loop(0, 3, lambda i, c: C(W(c) * 0.5 + np.tanh(W(x0)) + i, 'f64'), x0)
    return (v0, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<17xf64>) -> (tensor<17xf64>) {
  %0 = constant {value = array<tensor<i64>, [0]>} : tensor<i64> loc("<fuzz program>":2)
  %1 = constant {value = array<tensor<i64>, [3]>} : tensor<i64> loc("<fuzz program>":2)
  %2 = for %0, %1, %x0, %x0 {num_carry = 1} ({
  ^body(%a3_0: tensor<i64>, %a3_1: tensor<17xf64>, %capture0: tensor<17xf64>):
    %3 = constant {value = array<tensor<f64>, [0.5]>} : tensor<f64> loc("<fuzz program>":2)
    %4 = broadcast %3 {dims = [], shape = [17]} : tensor<17xf64> loc("<fuzz program>":2)
    %5 = mul %a3_1, %4 : tensor<17xf64> loc("<fuzz program>":2)
    %6 = tanh %capture0 : tensor<17xf64> loc("<fuzz program>":2)
    %7 = add %5, %6 : tensor<17xf64> loc("<fuzz program>":2)
    %8 = convert %a3_0 {dtype = f64} : tensor<f64> loc("<fuzz program>":2)
    %9 = broadcast %8 {dims = [], shape = [17]} : tensor<17xf64> loc("<fuzz program>":2)
    %10 = add %7, %9 : tensor<17xf64> loc("<fuzz program>":2)
    yield %10 : tensor<17xf64>
  }) : tensor<17xf64> loc("<fuzz program>":2)
  return %2 : tensor<17xf64>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
