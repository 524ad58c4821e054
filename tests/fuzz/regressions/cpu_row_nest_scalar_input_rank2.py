"""Fuzzer regression: CPU row loop nest: a one-element input of rank 2 (x2 of shape (1, 1), broadcast
over 3 rows of 1 element) was "collapsed" to its own rank-2 type (MLIR did not parse:
'tensor.collapse_shape' expected collapsed rank (2) to equal the number of reassociation maps (1)).

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
    'x0': np.array([2.875, 1.125, 0.125], dtype=np.float32).reshape((3, 1)),
    'x1': np.array([-1.875, -1.5, -3.75], dtype=np.float32).reshape((3, 1)),
    'x2': np.array([-3.5], dtype=np.float32).reshape((1, 1)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0, x1, x2):
    v0 = M.floor(x0)
    v1 = M.erf(x0)
    v2 = M.log(M.abs(x0) + 0.5)
    v3 = M.floor(x0)
    v4 = M.sum(x0, axis=1, keepdims=False)
    v5 = v4 + v0
    v6 = M.log(M.abs(x0) + 0.5)
    v7 = x0 == x2
    v8 = M.floor(x0)
    v9 = M.floor(x0)
    v10 = M.where(v7, x0, v0)
    return (v1, v2, v3, v5, v6, v8, v9, v10, )
'''
NUMPY_SOURCE = '''
def program(x0, x1, x2):
    v0 = C(np.floor(W(x0)), 'f32')
    v1 = C(R.erf(W(x0)), 'f32')
    v2 = C(np.log(np.abs(W(x0)) + 0.5), 'f32')
    v3 = C(np.floor(W(x0)), 'f32')
    v4 = C(np.sum(W(x0), axis=1, keepdims=False), 'f32')
    v5 = C(np.add(W(v4), W(v0)), 'f32')
    v6 = C(np.log(np.abs(W(x0)) + 0.5), 'f32')
    v7 = np.equal(W(x0), W(x2))
    v8 = C(np.floor(W(x0)), 'f32')
    v9 = C(np.floor(W(x0)), 'f32')
    v10 = C(np.where(v7, W(x0), W(v0)), 'f32')
    return (v1, v2, v3, v5, v6, v8, v9, v10, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<3x1xf32>, %x1: tensor<3x1xf32>, %x2: tensor<1x1xf32>) -> (tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x3xf32>, tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x1xf32>) {
  %0 = floor %x0 : tensor<3x1xf32> loc("<fuzz program>":2)
  %1 = erf %x0 : tensor<3x1xf32> loc("<fuzz program>":3)
  %2 = abs %x0 : tensor<3x1xf32> loc("<fuzz program>":4)
  %3 = constant {value = array<tensor<f32>, [0.5]>} : tensor<f32> loc("<fuzz program>":4)
  %4 = broadcast %3 {dims = [], shape = [3, 1]} : tensor<3x1xf32> loc("<fuzz program>":4)
  %5 = add %2, %4 : tensor<3x1xf32> loc("<fuzz program>":4)
  %6 = log %5 : tensor<3x1xf32> loc("<fuzz program>":4)
  %7 = floor %x0 : tensor<3x1xf32> loc("<fuzz program>":5)
  %8 = reduce_sum %x0 {axes = [1]} : tensor<3xf32> loc("<fuzz program>":6)
  %9 = broadcast %8 {dims = [1], shape = [3, 3]} : tensor<3x3xf32> loc("<fuzz program>":7)
  %10 = broadcast %0 {dims = [0, 1], shape = [3, 3]} : tensor<3x3xf32> loc("<fuzz program>":7)
  %11 = add %9, %10 : tensor<3x3xf32> loc("<fuzz program>":7)
  %12 = abs %x0 : tensor<3x1xf32> loc("<fuzz program>":8)
  %13 = constant {value = array<tensor<f32>, [0.5]>} : tensor<f32> loc("<fuzz program>":8)
  %14 = broadcast %13 {dims = [], shape = [3, 1]} : tensor<3x1xf32> loc("<fuzz program>":8)
  %15 = add %12, %14 : tensor<3x1xf32> loc("<fuzz program>":8)
  %16 = log %15 : tensor<3x1xf32> loc("<fuzz program>":8)
  %17 = broadcast %x2 {dims = [0, 1], shape = [3, 1]} : tensor<3x1xf32> loc("<fuzz program>":9)
  %18 = eq %x0, %17 : tensor<3x1xbool> loc("<fuzz program>":9)
  %19 = floor %x0 : tensor<3x1xf32> loc("<fuzz program>":10)
  %20 = floor %x0 : tensor<3x1xf32> loc("<fuzz program>":11)
  %21 = select %18, %x0, %0 : tensor<3x1xf32> loc("<fuzz program>":12)
  return %1, %6, %7, %11, %16, %19, %20, %21 : tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x3xf32>, tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x1xf32>, tensor<3x1xf32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
