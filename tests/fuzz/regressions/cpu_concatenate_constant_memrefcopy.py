"""Fuzzer regression: CompileError: internal error: the generated code calls unresolved functions: memrefCopy

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
    'x0': np.array([6, 2, 0, -4, -3, -8, -7, -8, -6, 5, 3, 7, 0, 2, 8, 4, 2, 1, 1, 7, -4, 5, 3, -8], dtype=np.int32).reshape((2, 3, 4)),
    'x1': np.array([-0.875, 2.875, 0.5, -3.75, 2.125, 1.875, 2.875, -2.625, -3.375, 3.0, -3.875, 0.375, -3.375, -1.625, -0.125, -0.625, -0.75, -3.875, -4.0, -3.0, -4.0, 1.375, 0.25, 1.25], dtype=np.float32).reshape((2, 3, 4)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0, x1):
    v0 = M.floor(x1)
    v1 = x0 - x0
    v2 = M.floor(x1)
    v3 = M.floor(x1)
    v4 = M.concatenate([x0, v1], axis=1)
    return (v0, v2, v3, v4, )
'''
NUMPY_SOURCE = '''
def program(x0, x1):
    v0 = C(np.floor(W(x1)), 'f32')
    v1 = C(np.subtract(W(x0), W(x0)), 'i32')
    v2 = C(np.floor(W(x1)), 'f32')
    v3 = C(np.floor(W(x1)), 'f32')
    v4 = C(np.concatenate([W(x0), W(v1)], axis=1), 'i32')
    return (v0, v2, v3, v4, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<2x3x4xi32>, %x1: tensor<2x3x4xf32>) -> (tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x6x4xi32>) {
  %0 = floor %x1 : tensor<2x3x4xf32> loc("<fuzz program>":2)
  %1 = sub %x0, %x0 : tensor<2x3x4xi32> loc("<fuzz program>":3)
  %2 = floor %x1 : tensor<2x3x4xf32> loc("<fuzz program>":4)
  %3 = floor %x1 : tensor<2x3x4xf32> loc("<fuzz program>":5)
  %4 = concatenate %x0, %1 {axis = 1} : tensor<2x6x4xi32> loc("<fuzz program>":6)
  return %0, %2, %3, %4 : tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x6x4xi32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
