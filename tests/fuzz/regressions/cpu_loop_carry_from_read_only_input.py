"""Fuzzer regression: CPU control flow: a loop whose initial carried value is a function input (a
read-only buffer) was updated in place; bufferization refused (would write to read-only buffer)

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
    'x0': np.array([2.875, 1.125, 0.125, -1.875, -1.5, -3.75], dtype=np.float32).reshape((2, 3)),
    'x1': np.array([-3.5, -3.875, -2.625, 2.5, 1.25, 3.375], dtype=np.float32).reshape((2, 3)),
    'x2': np.array([0.0, 0.875, 3.875, 1.875, 1.125, 0.375], dtype=np.float32).reshape((2, 3)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0, x1, x2):
    v0 = FJ.fori_loop(0, 1, lambda i, c: (c * 0.5 + M.tanh(x0) + i).astype('f32'), x0)
    return (v0, )
'''
NUMPY_SOURCE = '''
def program(x0, x1, x2):
    v0 = R.fori_loop(0, 1, lambda i, c: C(W(c) * 0.5 + np.tanh(W(x0)) + i, 'f32'), x0)
    return (v0, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<2x3xf32>, %x1: tensor<2x3xf32>, %x2: tensor<2x3xf32>) -> (tensor<2x3xf32>) {
  %0 = constant {value = array<tensor<i64>, [0]>} : tensor<i64> loc("<fuzz program>":2)
  %1 = constant {value = array<tensor<i64>, [1]>} : tensor<i64> loc("<fuzz program>":2)
  %2 = for %0, %1, %x0, %x0 {num_carry = 1} ({
  ^body(%a3_0: tensor<i64>, %a3_1: tensor<2x3xf32>, %capture0: tensor<2x3xf32>):
    %3 = constant {value = array<tensor<f32>, [0.5]>} : tensor<f32> loc("<fuzz program>":2)
    %4 = broadcast %3 {dims = [], shape = [2, 3]} : tensor<2x3xf32> loc("<fuzz program>":2)
    %5 = mul %a3_1, %4 : tensor<2x3xf32> loc("<fuzz program>":2)
    %6 = tanh %capture0 : tensor<2x3xf32> loc("<fuzz program>":2)
    %7 = add %5, %6 : tensor<2x3xf32> loc("<fuzz program>":2)
    %8 = convert %a3_0 {dtype = f32} : tensor<f32> loc("<fuzz program>":2)
    %9 = broadcast %8 {dims = [], shape = [2, 3]} : tensor<2x3xf32> loc("<fuzz program>":2)
    %10 = add %7, %9 : tensor<2x3xf32> loc("<fuzz program>":2)
    yield %10 : tensor<2x3xf32>
  }) : tensor<2x3xf32> loc("<fuzz program>":2)
  return %2 : tensor<2x3xf32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
