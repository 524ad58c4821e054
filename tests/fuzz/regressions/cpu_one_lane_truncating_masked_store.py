"""Fuzzer regression: the process died (exit status -6): corrupted size vs. prev_size in fastbins. A bool row of int64 comparisons ending one element past a vector: LLVM stored that one-lane masked store 8 bytes wide (fixed by single_lane.py).

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
    'x0': np.array([-1.75, 3.875, -2.625, -0.75, 1.5, 0.625, 1.375, -3.5, 0.25, 1.375, -1.25, -3.25, 0.0, -3.25, 1.5, -1.0, 3.375, 2.25, 1.125, 1.125, -1.5, 0.125, 2.125, 2.0, -0.125, 0.5, -1.25, -1.5, -2.625, 2.0, -1.75, 3.125, 3.0, 3.75, -1.875, 3.25, -3.75, 3.75, 1.125, 3.375, 3.375, 1.875, -1.5, 4.0, -1.75, -3.25, -3.75, -4.0, 2.375, -3.25, -3.75, -1.875, -2.25, -3.125, 1.75, -2.0, -1.625, 0.5, 1.375, 3.875, -1.625, -0.25, -3.625, -2.25, 2.125, 4.0, -2.5, -1.875, 0.625, 0.875, -1.625, -2.125, 2.75, 3.625, 2.125, 2.375, 1.875, -1.25, 3.875, 2.625, 1.375, 0.125, 0.5, 0.875, -0.375, 1.5, 2.0, -3.375, -3.75, 0.375, 3.875, -0.625, -2.75, -3.875, 4.0, -0.5, -3.125, -0.75, 3.875, -1.375, -2.25, 3.75, 3.75, -1.25, 0.875, 1.875, -2.125, -2.25, -2.0, 1.625, -1.375, -1.0, -0.875, 0.875, -3.5, 1.75, -3.75, 3.375, -0.875, -0.125, -3.125, -1.625, -3.75, 3.875, 3.125, 3.625, 2.125, -3.375, 1.0, 3.0, -2.875, 3.25, -1.75, -3.125, 1.125, 1.375, 0.25, -2.25, 2.125, -3.125, 0.125, -2.0, 1.5, -1.25, -1.5, 1.0, -0.5, 2.625, 1.125, -3.5, 3.75, -1.375, -3.375, -1.25, -0.375, 2.625, 0.25, -3.5, -3.0, -3.625, 3.625, -2.125, -2.125, 3.0, -2.75, 2.75, -3.375, 2.625, 1.875, -1.625, 2.125, 3.875, -3.25, -3.0, 0.625, 2.625, -0.375, 3.375, 3.375, 0.5, 1.625, -1.625, 0.625, 3.875, 3.625, 3.375, -0.875, 1.75, -1.5, -0.5, -2.5, -3.0, 1.5, 4.0, -0.25, -1.875, -2.25, 2.375, -3.25, -2.875, -3.875, 1.125, -1.25, 2.875, 1.75, 3.875, -1.625, 2.875, -2.375, 2.0, 0.0, -0.5, -3.875, 1.5, 1.75, 1.25, -2.75, -1.0, 0.375, 2.5, 3.25, -2.625, -2.5, -3.375, -2.375, 1.5, 0.0, 2.875, 1.375, 4.0, -2.375, 0.25, 0.625, 2.625, 0.75, 0.75, 3.5, -1.25, 1.0, 3.5, -3.25, 3.0, 0.75, 0.125, -0.375, 2.875, -3.75, -1.625, 0.5, -2.5, 0.25, -0.125, -2.5, 3.125, 4.0, 1.625, -0.75, 1.0, -1.375, -2.875, -1.25, -2.375, 2.125, -0.375, 3.5, 1.75, -3.25, 2.125, 3.25, 3.875, 1.0, -2.375, 1.0, 3.125, -1.75, 3.875, -1.0, -1.5, -1.0, 2.625, -0.875, -4.0, 1.375, -2.625, 1.625, 0.375, -1.875, -2.125, -2.25, 0.625, 0.875, 0.75, 0.375, 2.5, 0.75, 0.0, 2.75, -1.125, -3.75, -0.625, -2.375, -1.625, 1.375, 2.875, 0.125, 3.0, -1.25, 2.0, -0.625, 1.5, -3.75, -3.375, -0.625, -1.5, -3.625, 0.875, 3.875, 3.375, 1.75, -3.875, 0.875, 0.875, -0.375, -0.125, -1.0, -1.875, 0.875, -0.875, 2.75, 3.125, -0.875, 2.875, -1.0, 3.625, 3.5, -0.125, 1.75, -2.875, -2.25, -0.125, 0.625, 3.125, 3.625, 2.625, 3.875, -3.25, 2.875, 0.75, -2.75, -3.625, 3.875, 1.25, -2.5, 0.0, -2.25, -3.375, -2.875, -3.25, 1.625, 0.75], dtype=np.float32).reshape((40, 9)),
}
VARIABLES = {
    'var0': np.array([0, 2, -3, 2, 2, 2, -4, 1, -4], dtype=np.int64).reshape((9,)),
}
FLOWJIT_SOURCE = '''
def program(x0):
    v0 = x0.astype('i32')
    v1 = M.pad(v0, ((0, 0), (1, 2)))
    v2 = M.sign(v1)
    v3 = v2 & v1
    v4 = v0 ^ v0
    v5 = M.argmax(x0, axis=0)
    v6 = M.tanh(x0)
    v7 = M.sin(v6)
    v8 = M.erf(v6)
    v9 = x0.T
    v10 = v5 < v4
    v11 = M.power(M.abs(x0) + 0.5, M.tanh(v8) * 2)
    FJ.cond(M.max(v2) > 0, lambda c: (var0.assign_sub(c), c)[1], lambda c: c, v5)
    v13 = var0.value
    return (v0, v1, v3, v4, v5, v6, v7, v9, v10, v11, v13, )
'''
NUMPY_SOURCE = '''
def program(x0):
    v0 = C(x0, 'i32')
    v1 = np.pad(v0, ((0, 0), (1, 2)))
    v2 = C(np.sign(W(v1)), 'i32')
    v3 = C(np.bitwise_and(v2, v1), 'i32')
    v4 = C(np.bitwise_xor(v0, v0), 'i32')
    v5 = C(np.argmax(x0, axis=0), 'i64')
    v6 = C(np.tanh(W(x0)), 'f32')
    v7 = C(np.sin(W(v6)), 'f32')
    v8 = C(R.erf(W(v6)), 'f32')
    v9 = x0.T
    v10 = np.less(W(v5), W(v4))
    v11 = C(np.power(np.abs(W(x0)) + 0.5, np.tanh(W(v8)) * 2), 'f32')
    R.cond(np.max(v2) > 0, lambda c: (var0.assign_sub(c), c)[1], lambda c: c, v5)
    v13 = var0.value
    return (v0, v1, v3, v4, v5, v6, v7, v9, v10, v11, v13, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<40x9xf32>) -> (tensor<40x9xi32>, tensor<40x12xi32>, tensor<40x12xi32>, tensor<40x9xi32>, tensor<9xi64>, tensor<40x9xf32>, tensor<40x9xf32>, tensor<9x40xf32>, tensor<40x9xbool>, tensor<40x9xf32>, tensor<9xi64>) {
  %0 = convert %x0 {dtype = i32} : tensor<40x9xi32> loc("<fuzz program>":2)
  %1 = constant {value = array<tensor<i32>, [0]>} : tensor<i32> loc("<fuzz program>":3)
  %2 = pad %0, %1 {high = [0, 2], interior = [0, 0], low = [0, 1]} : tensor<40x12xi32> loc("<fuzz program>":3)
  %3 = sign %2 : tensor<40x12xi32> loc("<fuzz program>":4)
  %4 = bitwise_and %3, %2 : tensor<40x12xi32> loc("<fuzz program>":5)
  %5 = bitwise_xor %0, %0 : tensor<40x9xi32> loc("<fuzz program>":6)
  %6 = argmax %x0 {axis = 0, index_dtype = i64} : tensor<9xi64> loc("<fuzz program>":7)
  %7 = tanh %x0 : tensor<40x9xf32> loc("<fuzz program>":8)
  %8 = sin %7 : tensor<40x9xf32> loc("<fuzz program>":9)
  %9 = erf %7 : tensor<40x9xf32> loc("<fuzz program>":10)
  %10 = transpose %x0 {perm = [1, 0]} : tensor<9x40xf32> loc("<fuzz program>":11)
  %11 = convert %5 {dtype = i64} : tensor<40x9xi64> loc("<fuzz program>":12)
  %12 = broadcast %6 {dims = [1], shape = [40, 9]} : tensor<40x9xi64> loc("<fuzz program>":12)
  %13 = lt %12, %11 : tensor<40x9xbool> loc("<fuzz program>":12)
  %14 = abs %x0 : tensor<40x9xf32> loc("<fuzz program>":13)
  %15 = constant {value = array<tensor<f32>, [0.5]>} : tensor<f32> loc("<fuzz program>":13)
  %16 = broadcast %15 {dims = [], shape = [40, 9]} : tensor<40x9xf32> loc("<fuzz program>":13)
  %17 = add %14, %16 : tensor<40x9xf32> loc("<fuzz program>":13)
  %18 = tanh %9 : tensor<40x9xf32> loc("<fuzz program>":13)
  %19 = constant {value = array<tensor<f32>, [2.0]>} : tensor<f32> loc("<fuzz program>":13)
  %20 = broadcast %19 {dims = [], shape = [40, 9]} : tensor<40x9xf32> loc("<fuzz program>":13)
  %21 = mul %18, %20 : tensor<40x9xf32> loc("<fuzz program>":13)
  %22 = pow %17, %21 : tensor<40x9xf32> loc("<fuzz program>":13)
  %23 = reduce_max %3 {axes = [0, 1]} : tensor<i32> loc("<fuzz program>":14)
  %24 = constant {value = array<tensor<i32>, [0]>} : tensor<i32> loc("<fuzz program>":14)
  %25 = gt %23, %24 : tensor<bool> loc("<fuzz program>":14)
  %26 = cond %25, %6 ({
  ^true(%a27_0: tensor<9xi64>):
    assign_sub %a27_0 {dtype = i64, shape = [9], var = "var"} : () loc("<fuzz program>":14)
    yield %a27_0 : tensor<9xi64>
  }, {
  ^false(%a27_0_1: tensor<9xi64>):
    yield %a27_0_1 : tensor<9xi64>
  }) : tensor<9xi64> loc("<fuzz program>":14)
  %27 = read_variable {dtype = i64, shape = [9], var = "var"} : tensor<9xi64> loc("<fuzz program>":15)
  return %0, %2, %4, %5, %6, %7, %8, %10, %13, %22, %27 : tensor<40x9xi32>, tensor<40x12xi32>, tensor<40x12xi32>, tensor<40x9xi32>, tensor<9xi64>, tensor<40x9xf32>, tensor<40x9xf32>, tensor<9x40xf32>, tensor<40x9xbool>, tensor<40x9xf32>, tensor<9xi64>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
