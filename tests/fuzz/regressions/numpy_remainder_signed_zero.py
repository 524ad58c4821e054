"""Fuzzer regression: flowjit.numpy.remainder: a zero remainder kept the dividend's sign (-3.0 % 3 gave -0.0; numpy gives +0.0), visible through arctan2 (-pi instead of pi)

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
    'x0': np.array([-3.0, 3.0, -1.5, 0.0, 6.0, -4.5], dtype=np.float32).reshape((6,)),
}
VARIABLES = {}
FLOWJIT_SOURCE = '''
def program(x0):
    v0 = M.arctan2(x0 % 3, -1.0)
    v1 = M.arctan2(M.fmod(x0, 3) % -3, -1.0)
    return (v0, v1, )
'''
NUMPY_SOURCE = '''
def program(x0):
    v0 = C(np.arctan2(np.remainder(W(x0), 3), -1.0), 'f32')
    v1 = C(np.arctan2(np.remainder(np.fmod(W(x0), 3), -3), -1.0), 'f32')
    return (v0, v1, )
'''
TRACED_IR = '''
// stage: traced
func @program(%x0: tensor<6xf32>) -> (tensor<6xf32>, tensor<6xf32>) {
  %0 = constant {value = array<tensor<f32>, [3.0]>} : tensor<f32> loc("<fuzz program>":2)
  %1 = broadcast %0 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":2)
  %2 = rem %x0, %1 : tensor<6xf32> loc("<fuzz program>":2)
  %3 = constant {value = array<tensor<f32>, [0.0]>} : tensor<f32> loc("<fuzz program>":2)
  %4 = broadcast %3 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":2)
  %5 = ne %2, %4 : tensor<6xbool> loc("<fuzz program>":2)
  %6 = constant {value = array<tensor<f32>, [0.0]>} : tensor<f32> loc("<fuzz program>":2)
  %7 = broadcast %6 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":2)
  %8 = lt %2, %7 : tensor<6xbool> loc("<fuzz program>":2)
  %9 = constant {value = array<tensor<bool>, [false]>} : tensor<bool> loc("<fuzz program>":2)
  %10 = broadcast %9 {dims = [], shape = [6]} : tensor<6xbool> loc("<fuzz program>":2)
  %11 = ne %8, %10 : tensor<6xbool> loc("<fuzz program>":2)
  %12 = logical_and %5, %11 : tensor<6xbool> loc("<fuzz program>":2)
  %13 = constant {value = array<tensor<f32>, [3.0]>} : tensor<f32> loc("<fuzz program>":2)
  %14 = broadcast %13 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":2)
  %15 = add %2, %14 : tensor<6xf32> loc("<fuzz program>":2)
  %16 = select %12, %15, %2 : tensor<6xf32> loc("<fuzz program>":2)
  %17 = constant {value = array<tensor<f32>, [0.0]>} : tensor<f32> loc("<fuzz program>":2)
  %18 = broadcast %17 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":2)
  %19 = eq %16, %18 : tensor<6xbool> loc("<fuzz program>":2)
  %20 = abs %16 : tensor<6xf32> loc("<fuzz program>":2)
  %21 = constant {value = array<tensor<f32>, [1.0]>} : tensor<f32> loc("<fuzz program>":2)
  %22 = broadcast %21 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":2)
  %23 = mul %20, %22 : tensor<6xf32> loc("<fuzz program>":2)
  %24 = select %19, %23, %16 : tensor<6xf32> loc("<fuzz program>":2)
  %25 = constant {value = array<tensor<f32>, [-1.0]>} : tensor<f32> loc("<fuzz program>":2)
  %26 = broadcast %25 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":2)
  %27 = atan2 %24, %26 : tensor<6xf32> loc("<fuzz program>":2)
  %28 = constant {value = array<tensor<f32>, [3.0]>} : tensor<f32> loc("<fuzz program>":3)
  %29 = broadcast %28 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %30 = rem %x0, %29 : tensor<6xf32> loc("<fuzz program>":3)
  %31 = constant {value = array<tensor<f32>, [-3.0]>} : tensor<f32> loc("<fuzz program>":3)
  %32 = broadcast %31 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %33 = rem %30, %32 : tensor<6xf32> loc("<fuzz program>":3)
  %34 = constant {value = array<tensor<f32>, [0.0]>} : tensor<f32> loc("<fuzz program>":3)
  %35 = broadcast %34 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %36 = ne %33, %35 : tensor<6xbool> loc("<fuzz program>":3)
  %37 = constant {value = array<tensor<f32>, [0.0]>} : tensor<f32> loc("<fuzz program>":3)
  %38 = broadcast %37 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %39 = lt %33, %38 : tensor<6xbool> loc("<fuzz program>":3)
  %40 = constant {value = array<tensor<bool>, [true]>} : tensor<bool> loc("<fuzz program>":3)
  %41 = broadcast %40 {dims = [], shape = [6]} : tensor<6xbool> loc("<fuzz program>":3)
  %42 = ne %39, %41 : tensor<6xbool> loc("<fuzz program>":3)
  %43 = logical_and %36, %42 : tensor<6xbool> loc("<fuzz program>":3)
  %44 = constant {value = array<tensor<f32>, [-3.0]>} : tensor<f32> loc("<fuzz program>":3)
  %45 = broadcast %44 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %46 = add %33, %45 : tensor<6xf32> loc("<fuzz program>":3)
  %47 = select %43, %46, %33 : tensor<6xf32> loc("<fuzz program>":3)
  %48 = constant {value = array<tensor<f32>, [0.0]>} : tensor<f32> loc("<fuzz program>":3)
  %49 = broadcast %48 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %50 = eq %47, %49 : tensor<6xbool> loc("<fuzz program>":3)
  %51 = abs %47 : tensor<6xf32> loc("<fuzz program>":3)
  %52 = constant {value = array<tensor<f32>, [-1.0]>} : tensor<f32> loc("<fuzz program>":3)
  %53 = broadcast %52 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %54 = mul %51, %53 : tensor<6xf32> loc("<fuzz program>":3)
  %55 = select %50, %54, %47 : tensor<6xf32> loc("<fuzz program>":3)
  %56 = constant {value = array<tensor<f32>, [-1.0]>} : tensor<f32> loc("<fuzz program>":3)
  %57 = broadcast %56 {dims = [], shape = [6]} : tensor<6xf32> loc("<fuzz program>":3)
  %58 = atan2 %55, %57 : tensor<6xf32> loc("<fuzz program>":3)
  return %27, %58 : tensor<6xf32>, tensor<6xf32>
}
'''


def check():
    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""
    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)


if __name__ == "__main__":
    check()
    print("all oracles agree")
