"""The NVIDIA GPU target: flowjit graphs -> PTX through the shared MLIR layer (`backends/mlir`),
run through the CUDA driver API.

    target.py     `GPU`, the GPU's `Target`: plain-loop schedules, the shared math library, the
                  shared lowerings plus the GPU's own (fused regions, whole-array reductions)
    pipeline.py   the stage table: `GpuOptions` (chip, block size), `mlir_stages(options)`
    compiler.py   runs the stages and reads each kernel's PTX out of the `gpu.binary`
    plan.py       the launch plan: the host function as data (buffers, launches, loops)
    cubin.py      cubins from ptxas at compile time, where it is installed
    cache.py      the disk cache entry (plan, PTX, cubins) and its key
    driver.py     the CUDA driver API through cuda-bindings, imported lazily; `GpuRuntimeError`
    runtime.py    contexts, the caching allocator, pinned staging, `PlanRunner` (launch, wait)
    resident.py   `DeviceVariable`: a variable's copy in device memory between calls, and its home
    arrays.py     `DeviceArray` (`fj.DeviceArray`): a result kept on the device; DLPack export
    backend.py    `CudaBackend` ('cuda', device type 'gpu') and `GpuExecutable`
    staging.py    a GPU partition's send/recv on the host around its GPU calls (`StagedExecutable`)
    placement.py  what placement knows of GPUs: the ops they cannot run, their speed, copy costs

Compiling needs MLIR (no CUDA toolkit, no GPU); running needs cuda-bindings, a driver and a
device, and no MLIR (docs/gpu-backend.md). Nothing here has run on a GPU yet.
"""
