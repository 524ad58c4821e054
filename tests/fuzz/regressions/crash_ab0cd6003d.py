"""Fuzzer regression: the process died (exit status -11): no output

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
    'x0': np.array([-3, 4, 0, -8, -8, 7, -1, 5, 5, -3, -6, -5, -3, -6, -3, -3, -7, -3, -7, -6, -5, -2, 6, 2, 5, -5, -5, -5, 4, -7, -7, 3, -4, -2, 8, -7, -7, 6, -6, -7, -1, 0, 4, 4, 5, -2, -6, -4, -4, -6, -7, 0, -2, 8, 6, -1, 8, 6, -6, -6, 1, 7, 7, -2, 0, 6, 8, 7, -8, 2, -4, -3, 7, 7, -6, -8, -3, 1, 1, 1, 7, 4, -1, -8, 8, -3, -6, 3, 6, -6, 6, 1, -6, 8, -5, -7, -6, 8, -7], dtype=np.int64).reshape((3, 33)),
    'x1': np.array([-1.375], dtype=np.float64).reshape((1, 1)),
    'x2': np.array([False, False, False, False, False, True, False, False, False, True, False, False, False, True, True, True, True, True, False, True, False, True, False, True, True, False, True, False, False, True, False, False, False, True, True, False, False, True, False, False, False, True, True, True, True, True, False, False, True, False, False, True, True, True, True, False, False, True, False, False, True, True, False, False, False, True, True, False, True, True, True, True, False, True, True, True, False, False, False, True, False, True, False, True, True, True, True, False, False, False, True, True, False, False, False, True, True, True, True], dtype=np.bool).reshape((3, 33)),
}
VARIABLES = {
    'var0': np.array([2, -3, 1, -1, -4, -2, 3, -4, 2, -4, 4, -1, -4, -3, -4, 4, -1, -4, 4, 3, 1, -1, 3, 2, -2, 3, 1, -1, 2, -3, -4, 1, 0, -4, -2, 4, 2, -2, 2, -1, 2, -2, 4, -4, 0, 0, 3, 4, -3, -2, -4, 4, 1, -2, 3, 4, -3, -1, -3, -3, -3, 0, -1, -3, 2, 2, -3, -2, 3, 3, 4, -3, 4, -3, -4, -2, 2, -3, 1, -1, 0, -4, 3, -1, 0, -2, -3, -2, 0, 0, -4, -2, -4, 1, 3, -3, 1, -4, 1, 0, 4, -1, 3, 1, 4, 0, -1, 2, -4, 2, -2, -1, -2, -2, 4, 1, -4, -2, -4, -3, 0, 2, -3, -2, 2, -2, 2, 3, 1, 1, 1, 0, 3, 3, 1, -2, 4, 2, 1, 0, 2, -1, -4, 1, 4, -2, -1, -4, 2, 0, 3, 1, 0, 1, -3, 4, 3, 3, 4, -1, 4, -4, 3, 4, -3, -3, -3, -4, 3, 0, -2, -3, -4, 0, 1, 2, -4, 0, 0, 0], dtype=np.int64).reshape((5, 36)),
}
FLOWJIT_SOURCE = '''
def program(x0, x1, x2):
    v0 = M.concatenate([x2, x0], axis=0)
    v1 = M.pad(x0, ((0, 2), (2, 1)))
    v2 = M.argsort(v0, axis=-1)
    v3 = v2 < 2
    v4 = M.max(v0, axis=None, keepdims=False)
    v5 = M.argmax(v1, axis=1)
    v6 = M.tanh(x1)
    v7 = v6.astype('f16')
    FJ.fori_loop(0, 3, lambda i, c: (var0.assign_add(c * 2), c)[1], v1)
    v9 = var0.value
    v10 = M.log1p(M.abs(v7))
    v11 = x1 != 2
    v12 = M.round(x1)
    v13 = FJ.while_loop(lambda s: s[0] < 0, lambda s: (s[0] + 1, (s[1] * 0.5 + 1).astype('f16')), (M.asarray(0), v10))[1]
    return (v0, v2, v3, v4, v5, v9, v11, v12, v13, )
'''
NUMPY_SOURCE = '''
def program(x0, x1, x2):
    v0 = C(np.concatenate([W(x2), W(x0)], axis=0), 'i64')
    v1 = np.pad(x0, ((0, 2), (2, 1)))
    v2 = C(np.argsort(W(v0), axis=-1, kind='stable'), 'i64')
    v3 = np.less(W(v2), 2)
    v4 = C(np.max(W(v0), axis=None, keepdims=False), 'i64')
    v5 = C(np.argmax(v1, axis=1), 'i64')
    v6 = C(np.tanh(W(x1)), 'f64')
    v7 = C(v6, 'f16')
    R.fori_loop(0, 3, lambda i, c: (var0.assign_add(c * 2), c)[1], v1)
    v9 = var0.value
    v10 = C(np.log1p(np.abs(W(v7))), 'f16')
    v11 = np.not_equal(W(x1), 2)
    v12 = C(np.round(W(x1)), 'f64')
    v13 = R.while_loop(lambda s: s[0] < 0, lambda s: (s[0] + 1, C(W(s[1]) * 0.5 + 1, 'f16')), (0, v10))[1]
    return (v0, v2, v3, v4, v5, v9, v11, v12, v13, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<3x33xi64>, %x1: tensor<1x1xf64>, %x2: tensor<3x33xbool>) -> (tensor<6x33xi64>, tensor<6x33xi64>, tensor<6x33xbool>, tensor<i64>, tensor<5xi64>, tensor<5x36xi64>, tensor<1x1xbool>, tensor<1x1xf64>, tensor<1x1xf16>) {
  %0 = convert %x2 {dtype = i64} : tensor<3x33xi64> loc("<fuzz program>":2)
  %1 = concatenate %0, %x0 {axis = 0} : tensor<6x33xi64> loc("<fuzz program>":2)
  %2 = constant {value = array<tensor<i64>, [0]>} : tensor<i64> loc("<fuzz program>":3)
  %3 = pad %x0, %2 {high = [2, 1], interior = [0, 0], low = [0, 2]} : tensor<5x36xi64> loc("<fuzz program>":3)
  %4 = iota {dimension = 1, dtype = i64, shape = [6, 33]} : tensor<6x33xi64> loc("<fuzz program>":4)
  %5:2 = sort %1, %4 {axis = 1} : tensor<6x33xi64>, tensor<6x33xi64> loc("<fuzz program>":4)
  %6 = constant {value = array<tensor<i64>, [2]>} : tensor<i64> loc("<fuzz program>":5)
  %7 = broadcast %6 {dims = [], shape = [6, 33]} : tensor<6x33xi64> loc("<fuzz program>":5)
  %8 = lt %5#1, %7 : tensor<6x33xbool> loc("<fuzz program>":5)
  %9 = reduce_max %1 {axes = [0, 1]} : tensor<i64> loc("<fuzz program>":6)
  %10 = argmax %3 {axis = 1, index_dtype = i64} : tensor<5xi64> loc("<fuzz program>":7)
  %11 = tanh %x1 : tensor<1x1xf64> loc("<fuzz program>":8)
  %12 = convert %11 {dtype = f16} : tensor<1x1xf16> loc("<fuzz program>":9)
  %13 = constant {value = array<tensor<i64>, [0]>} : tensor<i64> loc("<fuzz program>":10)
  %14 = constant {value = array<tensor<i64>, [3]>} : tensor<i64> loc("<fuzz program>":10)
  %15 = for %13, %14, %3 {num_carry = 1} ({
  ^body(%a16_0: tensor<i64>, %a16_1: tensor<5x36xi64>):
    %16 = constant {value = array<tensor<i64>, [2]>} : tensor<i64> loc("<fuzz program>":10)
    %17 = broadcast %16 {dims = [], shape = [5, 36]} : tensor<5x36xi64> loc("<fuzz program>":10)
    %18 = mul %a16_1, %17 : tensor<5x36xi64> loc("<fuzz program>":10)
    assign_add %18 {dtype = i64, shape = [5, 36], var = "var"} : () loc("<fuzz program>":10)
    yield %a16_1 : tensor<5x36xi64>
  }) : tensor<5x36xi64> loc("<fuzz program>":10)
  %19 = read_variable {dtype = i64, shape = [5, 36], var = "var"} : tensor<5x36xi64> loc("<fuzz program>":11)
  %20 = abs %12 : tensor<1x1xf16> loc("<fuzz program>":12)
  %21 = log1p %20 : tensor<1x1xf16> loc("<fuzz program>":12)
  %22 = constant {value = array<tensor<f64>, [2.0]>} : tensor<f64> loc("<fuzz program>":13)
  %23 = broadcast %22 {dims = [], shape = [1, 1]} : tensor<1x1xf64> loc("<fuzz program>":13)
  %24 = ne %x1, %23 : tensor<1x1xbool> loc("<fuzz program>":13)
  %25 = round %x1 : tensor<1x1xf64> loc("<fuzz program>":14)
  %26 = constant {value = array<tensor<i64>, [0]>} : tensor<i64> loc("<fuzz program>":15)
  %27:2 = while %26, %21 {num_carry = 2} ({
  ^cond(%a28_0: tensor<i64>, %a28_1: tensor<1x1xf16>):
    %28 = constant {value = array<tensor<i64>, [0]>} : tensor<i64> loc("<fuzz program>":15)
    %29 = lt %a28_0, %28 : tensor<bool> loc("<fuzz program>":15)
    yield %29 : tensor<bool>
  }, {
  ^body(%a30_0: tensor<i64>, %a30_1: tensor<1x1xf16>):
    %30 = constant {value = array<tensor<i64>, [1]>} : tensor<i64> loc("<fuzz program>":15)
    %31 = add %a30_0, %30 : tensor<i64> loc("<fuzz program>":15)
    %32 = constant {value = array<tensor<f16>, [0.5]>} : tensor<f16> loc("<fuzz program>":15)
    %33 = broadcast %32 {dims = [], shape = [1, 1]} : tensor<1x1xf16> loc("<fuzz program>":15)
    %34 = mul %a30_1, %33 : tensor<1x1xf16> loc("<fuzz program>":15)
    %35 = constant {value = array<tensor<f16>, [1.0]>} : tensor<f16> loc("<fuzz program>":15)
    %36 = broadcast %35 {dims = [], shape = [1, 1]} : tensor<1x1xf16> loc("<fuzz program>":15)
    %37 = add %34, %36 : tensor<1x1xf16> loc("<fuzz program>":15)
    yield %31, %37 : tensor<i64>, tensor<1x1xf16>
  }) : tensor<i64>, tensor<1x1xf16> loc("<fuzz program>":15)
  return %1, %5#1, %8, %9, %10, %19, %24, %25, %27#1 : tensor<6x33xi64>, tensor<6x33xi64>, tensor<6x33xbool>, tensor<i64>, tensor<5xi64>, tensor<5x36xi64>, tensor<1x1xbool>, tensor<1x1xf64>, tensor<1x1xf16>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
