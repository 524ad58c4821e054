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
    'x0': np.array([2.875, 1.125, 0.125, -1.875, -1.5, -3.75, -3.5, -3.875, -2.625, 2.5, 1.25, 3.375, 0.0, 0.875, 3.875, 1.875, 1.125, 0.375, 0.5, 3.5, -1.75, 2.625, 1.375, -4.0], dtype=np.float32).reshape((2, 3, 4)),
    'x1': np.array([-2, 6, 1, -8, 5, 4, 6, -6, -7, 6, -8, 1, -7, -3, 0, -1, -2, -8, -8, -6, -8, 3, 0, 3], dtype=np.int32).reshape((2, 3, 4)),
    'x2': np.array([-4, 2, 4, -2, -1, 8, 5, 8, -2, 3, 8, 3, 6, 3, 3, -2, 6, -6, 1, 4, 6, 0, -2, -3], dtype=np.int32).reshape((2, 3, 4)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0, x1, x2):
    v0 = M.argmax(x0, axis=None)
    v1 = x1[0:1, 0:2, 0:1]
    v2 = M.floor(x0)
    v3 = M.floor(x0)
    v4 = M.floor(x0)
    v5 = M.floor(x0)
    v6 = v1 << 0
    return (v0, v2, v3, v4, v5, v6, )
'''
NUMPY_SOURCE = '''
def program(x0, x1, x2):
    v0 = C(np.argmax(x0, axis=None), 'i64')
    v1 = x1[0:1, 0:2, 0:1]
    v2 = C(np.floor(W(x0)), 'f32')
    v3 = C(np.floor(W(x0)), 'f32')
    v4 = C(np.floor(W(x0)), 'f32')
    v5 = C(np.floor(W(x0)), 'f32')
    v6 = C(np.left_shift(v1, 0), 'i32')
    return (v0, v2, v3, v4, v5, v6, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<2x3x4xf32>, %x1: tensor<2x3x4xi32>, %x2: tensor<2x3x4xi32>) -> (tensor<i64>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<1x2x1xi32>) {
  %0 = reshape %x0 {shape = [24]} : tensor<24xf32> loc("<fuzz program>":2)
  %1 = argmax %0 {axis = 0, index_dtype = i64} : tensor<i64> loc("<fuzz program>":2)
  %2 = slice %x1 {limit = [1, 2, 1], start = [0, 0, 0], stride = [1, 1, 1]} : tensor<1x2x1xi32> loc("<fuzz program>":3)
  %3 = floor %x0 : tensor<2x3x4xf32> loc("<fuzz program>":4)
  %4 = floor %x0 : tensor<2x3x4xf32> loc("<fuzz program>":5)
  %5 = floor %x0 : tensor<2x3x4xf32> loc("<fuzz program>":6)
  %6 = floor %x0 : tensor<2x3x4xf32> loc("<fuzz program>":7)
  %7 = constant {value = array<tensor<i32>, [0]>} : tensor<i32> loc("<fuzz program>":8)
  %8 = broadcast %7 {dims = [], shape = [1, 2, 1]} : tensor<1x2x1xi32> loc("<fuzz program>":8)
  %9 = shift_left %2, %8 : tensor<1x2x1xi32> loc("<fuzz program>":8)
  return %1, %3, %4, %5, %6, %9 : tensor<i64>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<2x3x4xf32>, tensor<1x2x1xi32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
