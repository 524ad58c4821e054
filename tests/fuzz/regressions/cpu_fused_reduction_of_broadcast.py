"""Fuzzer regression: CPU fusion: a reduction over a dimension that only a fused broadcast reads emitted a linalg.generic with non-invertible indexing maps (MLIR did not parse); found by the gradient sample (d/dx sum(sin(broadcast_to(x, (1,)))))

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
    'x0': np.array([1.0956935], dtype=np.float64).reshape(()),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0):
    v0 = M.sum(M.cos(M.broadcast_to(x0, (1,))), axis=None, keepdims=False)
    return (v0, )
'''
NUMPY_SOURCE = '''
def program(x0):
    v0 = C(np.sum(np.cos(np.broadcast_to(W(x0), (1,))), axis=None, keepdims=False), 'f64')
    return (v0, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<f64>) -> (tensor<f64>) {
  %0 = broadcast %x0 {dims = [], shape = [1]} : tensor<1xf64> loc("<fuzz program>":2)
  %1 = cos %0 : tensor<1xf64> loc("<fuzz program>":2)
  %2 = reduce_sum %1 {axes = [0]} : tensor<f64> loc("<fuzz program>":2)
  return %2 : tensor<f64>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
