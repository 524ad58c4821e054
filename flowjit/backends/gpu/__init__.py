"""The NVIDIA GPU target: flowjit graphs -> PTX through the shared MLIR layer (`backends/mlir`).

    target.py     `GPU`, the GPU's `Target`: plain-loop schedules, the shared math library, the
                  shared lowerings plus the GPU's own (fused regions, whole-array reductions)
    pipeline.py   the stage table: `GpuOptions` (chip, block size), `mlir_stages(options)`
    compiler.py   runs the stages and reads each kernel's PTX out of the `gpu.binary`
    backend.py    `CudaBackend` ('cuda', device type 'gpu') and its compile-only `GpuExecutable`

Compiling needs MLIR only (no CUDA toolkit, no GPU); running needs the runtime, which does not
exist yet (docs/gpu-backend.md).
"""
