"""Fuzzer regression: a fori_loop carrying a zero-size array whose final value is unused (fj.scan's ys buffer with length=0, or its ys not read): KeyError in the CPU control-flow lowering

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
    'x0': np.array([2.875], dtype=np.float32).reshape(()),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0):
    v0 = FJ.fori_loop(0, 2, lambda i, c: ((c[0] * 0.5 + 1).astype('f32'), c[1] + M.sin(c[0])), (x0, M.zeros((0,), 'f32')))[0]
    return (v0, )
'''
NUMPY_SOURCE = '''
def program(x0):
    v0 = R.fori_loop(0, 2, lambda i, c: (C(W(c[0]) * 0.5 + 1, 'f32'), c[1]), (x0, np.zeros((0,), np.float32)))[0]
    return (v0, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<f32>) -> (tensor<f32>) {
  %0 = constant {value = array<tensor<i64>, [0]>} : tensor<i64> loc("<fuzz program>":2)
  %1 = constant {value = array<tensor<i64>, [2]>} : tensor<i64> loc("<fuzz program>":2)
  %2 = constant {value = array<tensor<0xf32>, []>} : tensor<0xf32> loc("<fuzz program>":2)
  %3:2 = for %0, %1, %x0, %2 {num_carry = 2} ({
  ^body(%a4_0: tensor<i64>, %a4_1: tensor<f32>, %a4_2: tensor<0xf32>):
    %4 = constant {value = array<tensor<f32>, [0.5]>} : tensor<f32> loc("<fuzz program>":2)
    %5 = mul %a4_1, %4 : tensor<f32> loc("<fuzz program>":2)
    %6 = constant {value = array<tensor<f32>, [1.0]>} : tensor<f32> loc("<fuzz program>":2)
    %7 = add %5, %6 : tensor<f32> loc("<fuzz program>":2)
    %8 = sin %a4_1 : tensor<f32> loc("<fuzz program>":2)
    %9 = broadcast %8 {dims = [], shape = [0]} : tensor<0xf32> loc("<fuzz program>":2)
    %10 = add %a4_2, %9 : tensor<0xf32> loc("<fuzz program>":2)
    yield %7, %10 : tensor<f32>, tensor<0xf32>
  }) : tensor<f32>, tensor<0xf32> loc("<fuzz program>":2)
  return %3#0 : tensor<f32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
