"""Fuzzer regression: CPU elementwise lowering: integer abs of a broadcast (an n-d kernel vectorized as 2-d vectors by `copy_nd`) was `math.absi`, which MathToLLVM left unconverted ("failed to legalize operation 'math.absi'"); large n-d kernels had it before small ones got the schedule too.

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
    'x0': np.array([6, 2, 0, -4], dtype=np.int32).reshape((4,)),
    'x1': np.array([True, True, False, False], dtype=np.bool).reshape((4,)),
    'x2': np.array([0.0, 0.875, 3.875, 1.875], dtype=np.float32).reshape((4,)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0, x1, x2):
    v0 = M.floor(x2)
    v1 = M.broadcast_to(x0, (1, 4))
    v2 = M.abs(v1)
    return (v0, v2, )
'''
NUMPY_SOURCE = '''
def program(x0, x1, x2):
    v0 = C(np.floor(W(x2)), 'f32')
    v1 = np.broadcast_to(x0, (1, 4))
    v2 = C(np.abs(W(v1)), 'i32')
    return (v0, v2, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<4xi32>, %x1: tensor<4xbool>, %x2: tensor<4xf32>) -> (tensor<4xf32>, tensor<1x4xi32>) {
  %0 = floor %x2 : tensor<4xf32> loc("<fuzz program>":2)
  %1 = broadcast %x0 {dims = [1], shape = [1, 4]} : tensor<1x4xi32> loc("<fuzz program>":3)
  %2 = abs %1 : tensor<1x4xi32> loc("<fuzz program>":4)
  return %0, %2 : tensor<4xf32>, tensor<1x4xi32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
