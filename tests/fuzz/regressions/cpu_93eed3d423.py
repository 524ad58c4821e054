"""Fuzzer regression: Mismatch: cpu vs interpreter, output #3: 1 of 1 elements differ; at index []: expected np.float64(0.0), found np.float64(nan)

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
    'x0': np.array([False], dtype=np.bool).reshape(()),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0):
    v0 = x0 ^ x0
    v1 = M.logical_and(x0, x0)
    v2 = ~x0
    v3 = v0.astype('f64')
    v4 = M.floor(v3)
    v5 = M.arctan2(v3, v3)
    return (v1, v2, v4, v5, )
'''
NUMPY_SOURCE = '''
def program(x0):
    v0 = C(np.bitwise_xor(x0, x0), 'bool')
    v1 = np.logical_and(x0, x0)
    v2 = np.invert(x0)
    v3 = C(v0, 'f64')
    v4 = C(np.floor(W(v3)), 'f64')
    v5 = C(np.arctan2(W(v3), W(v3)), 'f64')
    return (v1, v2, v4, v5, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<bool>) -> (tensor<bool>, tensor<bool>, tensor<f64>, tensor<f64>) {
  %0 = bitwise_xor %x0, %x0 : tensor<bool> loc("<fuzz program>":2)
  %1 = logical_and %x0, %x0 : tensor<bool> loc("<fuzz program>":3)
  %2 = bitwise_not %x0 : tensor<bool> loc("<fuzz program>":4)
  %3 = convert %0 {dtype = f64} : tensor<f64> loc("<fuzz program>":5)
  %4 = floor %3 : tensor<f64> loc("<fuzz program>":6)
  %5 = atan2 %3, %3 : tensor<f64> loc("<fuzz program>":7)
  return %1, %2, %4, %5 : tensor<bool>, tensor<bool>, tensor<f64>, tensor<f64>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
