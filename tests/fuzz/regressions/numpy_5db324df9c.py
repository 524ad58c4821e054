"""Fuzzer regression: Mismatch: interpreter vs numpy, output #8: 1 of 8 elements differ; at index [1, 1, 1]: expected 0.0961914, found -0.0288086

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
    'x0': np.array([2.875, 1.125, 0.125, -1.875, -1.5, -3.75, -3.5, -3.875], dtype=ml_dtypes.bfloat16).reshape((2, 2, 2)),
    'x1': np.array([-2.625, 2.5, 1.25, 3.375, 0.0, 0.875, 3.875, 1.875], dtype=np.float32).reshape((2, 2, 2)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0, x1):
    v0 = M.sqrt(M.abs(x0) + 0.25)
    v1 = M.floor(x0)
    v2 = M.floor(x0)
    v3 = M.power(M.abs(x0) + 0.5, M.tanh(v0) * 2)
    v4 = M.floor(x0)
    v5 = M.floor(x0)
    v6 = M.floor(x0)
    v7 = M.floor(x0)
    v8 = M.floor(x0)
    v9 = M.floor(x0)
    v10 = M.cos(v3)
    return (v1, v2, v4, v5, v6, v7, v8, v9, v10, )
'''
NUMPY_SOURCE = '''
def program(x0, x1):
    v0 = C(np.sqrt(np.abs(W(x0)) + 0.25), 'bf16')
    v1 = C(np.floor(W(x0)), 'bf16')
    v2 = C(np.floor(W(x0)), 'bf16')
    v3 = C(np.power(np.abs(W(x0)) + 0.5, np.tanh(W(v0)) * 2), 'bf16')
    v4 = C(np.floor(W(x0)), 'bf16')
    v5 = C(np.floor(W(x0)), 'bf16')
    v6 = C(np.floor(W(x0)), 'bf16')
    v7 = C(np.floor(W(x0)), 'bf16')
    v8 = C(np.floor(W(x0)), 'bf16')
    v9 = C(np.floor(W(x0)), 'bf16')
    v10 = C(np.cos(W(v3)), 'bf16')
    return (v1, v2, v4, v5, v6, v7, v8, v9, v10, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<2x2x2xbf16>, %x1: tensor<2x2x2xf32>) -> (tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>) {
  %0 = abs %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":2)
  %1 = constant {value = array<tensor<bf16>, [0.25]>} : tensor<bf16> loc("<fuzz program>":2)
  %2 = broadcast %1 {dims = [], shape = [2, 2, 2]} : tensor<2x2x2xbf16> loc("<fuzz program>":2)
  %3 = add %0, %2 : tensor<2x2x2xbf16> loc("<fuzz program>":2)
  %4 = sqrt %3 : tensor<2x2x2xbf16> loc("<fuzz program>":2)
  %5 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":3)
  %6 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":4)
  %7 = abs %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":5)
  %8 = constant {value = array<tensor<bf16>, [0.5]>} : tensor<bf16> loc("<fuzz program>":5)
  %9 = broadcast %8 {dims = [], shape = [2, 2, 2]} : tensor<2x2x2xbf16> loc("<fuzz program>":5)
  %10 = add %7, %9 : tensor<2x2x2xbf16> loc("<fuzz program>":5)
  %11 = tanh %4 : tensor<2x2x2xbf16> loc("<fuzz program>":5)
  %12 = constant {value = array<tensor<bf16>, [2.0]>} : tensor<bf16> loc("<fuzz program>":5)
  %13 = broadcast %12 {dims = [], shape = [2, 2, 2]} : tensor<2x2x2xbf16> loc("<fuzz program>":5)
  %14 = mul %11, %13 : tensor<2x2x2xbf16> loc("<fuzz program>":5)
  %15 = pow %10, %14 : tensor<2x2x2xbf16> loc("<fuzz program>":5)
  %16 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":6)
  %17 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":7)
  %18 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":8)
  %19 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":9)
  %20 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":10)
  %21 = floor %x0 : tensor<2x2x2xbf16> loc("<fuzz program>":11)
  %22 = cos %15 : tensor<2x2x2xbf16> loc("<fuzz program>":12)
  return %5, %6, %16, %17, %18, %19, %20, %21, %22 : tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>, tensor<2x2x2xbf16>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
