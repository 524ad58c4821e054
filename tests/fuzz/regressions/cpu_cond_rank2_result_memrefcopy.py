"""Fuzzer regression: CPU control flow: fj.cond with a rank-2 result: the bufferized scf.if result has a fully dynamic layout, so writing it to the output calls memrefCopy, which the JIT cannot resolve

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
    'x0': np.array([1.5, -2.0, 0.25, 3.0, -0.5, 1.0], dtype=np.float32).reshape((2, 3)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0):
    v0 = FJ.cond(M.max(x0) > 0, lambda a: a - 1, lambda a: a * 0.5, x0)
    return (v0, )
'''
NUMPY_SOURCE = '''
def program(x0):
    v0 = C(R.cond(np.max(x0) > 0, lambda a: W(a) - 1, lambda a: W(a) * 0.5, x0), 'f32')
    return (v0, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<2x3xf32>) -> (tensor<2x3xf32>) {
  %0 = reduce_max %x0 {axes = [0, 1]} : tensor<f32> loc("<fuzz program>":2)
  %1 = constant {value = array<tensor<f32>, [0.0]>} : tensor<f32> loc("<fuzz program>":2)
  %2 = gt %0, %1 : tensor<bool> loc("<fuzz program>":2)
  %3 = cond %2, %x0 ({
  ^true(%a4_0: tensor<2x3xf32>):
    %4 = constant {value = array<tensor<f32>, [1.0]>} : tensor<f32> loc("<fuzz program>":2)
    %5 = broadcast %4 {dims = [], shape = [2, 3]} : tensor<2x3xf32> loc("<fuzz program>":2)
    %6 = sub %a4_0, %5 : tensor<2x3xf32> loc("<fuzz program>":2)
    yield %6 : tensor<2x3xf32>
  }, {
  ^false(%a7_0: tensor<2x3xf32>):
    %7 = constant {value = array<tensor<f32>, [0.5]>} : tensor<f32> loc("<fuzz program>":2)
    %8 = broadcast %7 {dims = [], shape = [2, 3]} : tensor<2x3xf32> loc("<fuzz program>":2)
    %9 = mul %a7_0, %8 : tensor<2x3xf32> loc("<fuzz program>":2)
    yield %9 : tensor<2x3xf32>
  }) : tensor<2x3xf32> loc("<fuzz program>":2)
  return %3 : tensor<2x3xf32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
