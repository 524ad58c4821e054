"""What placement knows of GPUs (`passes.place.register_device_type_model`): which ops a GPU
cannot run and why, how fast it runs the rest, and what a copy between host and GPU costs.

The numbers are estimates, not measurements (nothing of this backend has run on a GPU yet,
docs/gpu-backend.md): against one CPU core (`passes.place.ELEMENTS_PER_US`, `FLOPS_PER_US`), a GPU
runs elementwise work ~50x and contractions ~20x faster (the simple kernels of `lower_kernels.py`:
no shared-memory tiles, no tensor cores), each kernel costs ~5 us to launch (one `cuLaunchKernel`
from Python), and a copy between host and GPU ~10 us plus its bytes at ~20 GB/s (PCIe through the
runner's pinned block).
"""

from __future__ import annotations

from flowjit.backends.gpu.target import FUNCTIONALIZED, GPU, cpu_only_reason
from flowjit.ir.graph import Op
from flowjit.passes.place import DeviceTypeModel, register_device_type_model


def cannot_run_on_gpu(op: Op) -> str | None:
    """Why the GPU backend cannot compile `op` (a fused region: the first of its ops it cannot), or
    None when it can: `target.cpu_only_reason`, then the GPU's lowering table (state ops need none:
    the backend functionalizes them, `target.FUNCTIONALIZED`)."""
    if op.name == "fusion":
        for inner in (o for region in op.regions for o in region.walk()):
            reason = cannot_run_on_gpu(inner)
            if reason is not None:
                return f"its op '{inner.name}' ({inner.loc}): {reason}"
        return None
    reason = cpu_only_reason(op)
    if reason is not None:
        return reason
    if op.name in FUNCTIONALIZED:  # variables become the GPU program's inputs and outputs
        return None
    if op.name != "constant" and not GPU.lowerings.has(op.name):
        return f"the GPU backend has no lowering for '{op.name}'"
    return None


GPU_MODEL = DeviceTypeModel(
    cannot_run=cannot_run_on_gpu,
    elementwise_speedup=50.0,
    contraction_speedup=20.0,
    launch_us=5.0,
    transfer_latency_us=10.0,
    transfer_bytes_per_us=20_000.0,  # ~20 GB/s
    host_memory=False,
)

register_device_type_model("gpu", GPU_MODEL)
