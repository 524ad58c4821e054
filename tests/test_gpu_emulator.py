"""The CPU emulator of GPU kernels (tests/gpu_emulator.py) on hand-written kernels whose threads
cooperate: a block reduction through warp shuffles and workgroup memory, each shuffle mode, and the
errors it must report. The kernels are written as `gpu.launch`es and outlined by the GPU pipeline's
own "gpu-kernels" stage, so the emulator reads them in the form the compiler gives it."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest

pytest.importorskip("mlir")
pytest.importorskip("llvmlite")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_emulator  # noqa: E402

from flowjit.backends.gpu.pipeline import GpuOptions, stage_pipeline  # noqa: E402
from flowjit.backends.mlir import pipeline  # noqa: E402

THREADS = 128

# Sums each row of x (rows x cols) in one block of THREADS threads: each thread adds its strided
# part of the row, each warp combines its lanes with xor shuffles, lane 0 of every warp stores its
# warp's sum in workgroup memory, and after the barrier warp 0 combines those and thread 0 stores.
BLOCK_SUM = """
module {{
  func.func @f(%x: memref<{rows}x{cols}xf32>, %y: memref<{rows}xf32>) {{
    %c1 = arith.constant 1 : index
    %rows = arith.constant {rows} : index
    %threads = arith.constant {threads} : index
    gpu.launch blocks(%bx, %by, %bz) in (%gx = %rows, %gy = %c1, %gz = %c1)
               threads(%tx, %ty, %tz) in (%sx = %threads, %sy = %c1, %sz = %c1)
               workgroup(%partial : memref<{warps}xf32, #gpu.address_space<workgroup>>) {{
      %c0 = arith.constant 0 : index
      %c32 = arith.constant 32 : index
      %cols = arith.constant {cols} : index
      %zero = arith.constant 0.0 : f32
      %width = arith.constant 32 : i32
      %own = scf.for %j = %tx to %cols step %threads iter_args(%acc = %zero) -> (f32) {{
        %v = memref.load %x[%bx, %j] : memref<{rows}x{cols}xf32>
        %s = arith.addf %acc, %v : f32
        scf.yield %s : f32
      }}
      {own_sum}
      %warp = arith.divui %tx, %c32 : index
      %lane = arith.remui %tx, %c32 : index
      %first = arith.cmpi eq, %lane, %c0 : index
      scf.if %first {{
        memref.store %a16, %partial[%warp] : memref<{warps}xf32, #gpu.address_space<workgroup>>
      }}
      {barrier}
      %warps = arith.constant {warps} : index
      %mine = arith.cmpi ult, %lane, %warps : index
      %lane_value = scf.if %mine -> (f32) {{
        %p = memref.load %partial[%lane] : memref<{warps}xf32, #gpu.address_space<workgroup>>
        scf.yield %p : f32
      }} else {{
        scf.yield %zero : f32
      }}
      {lane_sum}
      %thread0 = arith.cmpi eq, %tx, %c0 : index
      scf.if %thread0 {{
        memref.store %b16, %y[%bx] : memref<{rows}xf32>
      }}
      gpu.terminator
    }}
    return
  }}
}}
"""


def _warp_sum(value: str, prefix: str) -> str:
    """The sum over a warp of `value`, by xor shuffles: in %{prefix}16."""
    lines = []
    for offset in (1, 2, 4, 8, 16):
        lines.append(f"%{prefix}o{offset} = arith.constant {offset} : i32")
        lines.append(
            f"%{prefix}r{offset}, %{prefix}ok{offset} = gpu.shuffle xor {value}, %{prefix}o{offset}, %width : f32"
        )
        lines.append(f"%{prefix}{offset} = arith.addf {value}, %{prefix}r{offset} : f32")
        value = f"%{prefix}{offset}"
    return "\n      ".join(lines)


def _outlined(text: str) -> str:
    """The gpu-mlir text of `text`'s launches, as the compiler's "gpu-kernels" stage writes it."""
    with pipeline.lock(), pipeline.mlir_context():
        module = pipeline.parse(text)
        pipeline.run_pipeline(module, stage_pipeline("gpu-kernels", options=GpuOptions()), lambda: text)
        return str(module)


def _descriptor(array: np.ndarray) -> list:
    """The kernel parameters of a contiguous array's memref: pointers, offset, sizes, strides."""
    strides = [s // array.itemsize for s in array.strides]
    return [ctypes.c_uint64(v) for v in (array.ctypes.data, array.ctypes.data, 0, *array.shape, *strides)]


def _block_sums(x: np.ndarray, barrier: bool = True) -> np.ndarray:
    rows, cols = x.shape
    text = BLOCK_SUM.format(
        rows=rows,
        cols=cols,
        threads=THREADS,
        warps=THREADS // 32,
        barrier="gpu.barrier" if barrier else "",
        own_sum=_warp_sum("%own", "a"),
        lane_sum=_warp_sum("%lane_value", "b"),
    )
    gpu_mlir = _outlined(text)
    assert "gpu.barrier" in gpu_mlir if barrier else "gpu.barrier" not in gpu_mlir
    kernels = gpu_emulator.EmulatedKernels(gpu_mlir)
    y = np.full(rows, np.nan, np.float32)
    kernels.call("f_kernel", [*_descriptor(x), *_descriptor(y)], (rows, 1, 1), (THREADS, 1, 1))
    return y


def test_block_reduction_through_shuffles_and_workgroup_memory():
    x = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    np.testing.assert_allclose(_block_sums(x), x.sum(axis=1, dtype=np.float64), rtol=1e-5, atol=1e-4)


def test_a_dropped_barrier_is_caught():
    """Without the barrier, warp 0 reads the other warps' partial sums before they are stored:
    the emulator runs it on, deterministically, and the workgroup memory it reads is still NaN."""
    x = np.ones((2, 300), np.float32)
    assert np.isnan(_block_sums(x, barrier=False)).all()
    np.testing.assert_array_equal(_block_sums(x), [300.0, 300.0])


SHUFFLE = """
module {{
  func.func @f(%x: memref<64xi32>, %y: memref<64xi32>, %valid: memref<64xi32>) {{
    %c1 = arith.constant 1 : index
    %c64 = arith.constant 64 : index
    gpu.launch blocks(%bx, %by, %bz) in (%gx = %c1, %gy = %c1, %gz = %c1)
               threads(%tx, %ty, %tz) in (%sx = %c64, %sy = %c1, %sz = %c1) {{
      %v = memref.load %x[%tx] : memref<64xi32>
      %offset = arith.constant {offset} : i32
      %width = arith.constant 32 : i32
      %r, %ok = gpu.shuffle {mode} %v, %offset, %width : i32
      memref.store %r, %y[%tx] : memref<64xi32>
      %flag = arith.extui %ok : i1 to i32
      memref.store %flag, %valid[%tx] : memref<64xi32>
      gpu.terminator
    }}
    return
  }}
}}
"""


@pytest.mark.parametrize(("mode", "offset"), [("xor", 5), ("down", 3), ("up", 7), ("idx", 9)])
def test_shuffle_modes(mode, offset):
    """Each lane receives the value of the lane PTX's shfl.sync names (bfly, down, up, idx); where
    that lane is outside the warp, its own value and a false `valid`."""
    kernels = gpu_emulator.EmulatedKernels(_outlined(SHUFFLE.format(mode=mode, offset=offset)))
    x = np.arange(100, 164, dtype=np.int32)
    y, valid = np.zeros(64, np.int32), np.zeros(64, np.int32)
    kernels.call("f_kernel", [*_descriptor(x), *_descriptor(y), *_descriptor(valid)], (1, 1, 1), (64, 1, 1))
    lane = np.arange(64) % 32
    source = {"xor": lane ^ offset, "down": lane + offset, "up": lane - offset, "idx": np.full(64, offset)}[mode]
    inside = (source >= 0) & (source < 32)
    expected = np.where(inside, x[np.arange(64) - lane + np.clip(source, 0, 31)], x)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(valid, inside.astype(np.int32))


EARLY_EXIT = """
module {
  func.func @f(%y: memref<64xf32>) {
    %c1 = arith.constant 1 : index
    %c64 = arith.constant 64 : index
    gpu.launch blocks(%bx, %by, %bz) in (%gx = %c1, %gy = %c1, %gz = %c1)
               threads(%tx, %ty, %tz) in (%sx = %c64, %sy = %c1, %sz = %c1) {
      %c40 = arith.constant 40 : index
      %low = arith.cmpi ult, %tx, %c40 : index
      scf.if %low {
        gpu.barrier
      }
      %one = arith.constant 1.0 : f32
      memref.store %one, %y[%tx] : memref<64xf32>
      gpu.terminator
    }
    return
  }
}
"""


def test_a_barrier_some_threads_skip_is_an_error():
    kernels = gpu_emulator.EmulatedKernels(_outlined(EARLY_EXIT))
    y = np.zeros(64, np.float32)
    with pytest.raises(RuntimeError, match="barrier"):
        kernels.call("f_kernel", _descriptor(y), (1, 1, 1), (64, 1, 1))
