"""`fj.device_put(x, "gpu:0")`: an array copied into a GPU's memory, as an `fj.DeviceArray`;
`fj.from_dlpack(t)`: another library's GPU tensor (PyTorch, CuPy, JAX) as one, without a copy.

    w = fj.device_put(np.ones((784, 10), np.float32), "gpu:0")
    f = fj.jit(step, device="gpu:0", keep_on_device=True)
    y = f(x, w)            # w is read where it is; y stays on the GPU too
    np.asarray(y)          # the one copy to the host

    t = torch.randn(4096, 784, device="cuda")
    y = f(fj.from_dlpack(t), w)   # t's memory, read in place

docs/gpu-backend.md ("Results that stay on the device") describes the handle.
"""

from __future__ import annotations

import numpy as np

from flowjit.backends.gpu import driver, runtime
from flowjit.backends.gpu.arrays import KDL_CUDA, DeviceArray, imported, put
from flowjit.backends.gpu.driver import GpuRuntimeError
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.trace import Tracer
from flowjit.frontend.tracebacks import user_errors
from flowjit.ir import dtypes as dt
from flowjit.ir.devices import LOCAL_JOB
from flowjit.ir.location import user_location
from flowjit.runtime.devices import DeviceSpec, current_device_spec, devices


@user_errors
def device_put(x, device=None):
    """`x` (an array, a Python scalar or a DeviceArray) in the memory of `device`: a DeviceArray
    for a GPU of this process; for a CPU device, a host (numpy) array. Without `device`, the
    default device, as JAX's: the one an enclosing `with fj.device(...)` names, else GPU 0 when this
    process has a GPU, else the CPU."""
    if isinstance(x, Tracer):
        raise FlowjitTypeError(
            f"{user_location()}: device_put needs a concrete array, not a traced value; call it outside jit"
        )
    spec = DeviceSpec.parse(device) if device is not None else _default_device()
    if spec.device_type == "cpu":
        return np.asarray(x)
    if spec.device_type != "gpu" or spec.job not in (None, LOCAL_JOB) or spec.task not in (None, 0):
        raise FlowjitValueError(
            f"{user_location()}: device_put: {device!r} is not a GPU of this process; use 'gpu:N' (or 'cpu:0')"
        )
    ordinal = spec.index or 0
    if isinstance(x, DeviceArray):
        if x.address_on(ordinal) is not None:
            return x
        x = x.numpy()  # another GPU's: through the host
    array = np.asarray(x)
    if not dt.is_supported_numpy_dtype(array.dtype):
        raise FlowjitTypeError(
            f"{user_location()}: device_put: unsupported dtype {array.dtype}; flowjit supports "
            f"{', '.join(d.np_dtype.name for d in dt.ALL_DTYPES)}"
        )
    return put(_context(ordinal, f"cannot put an array on GPU {ordinal}"), array)


def _default_device() -> DeviceSpec:
    scoped = current_device_spec()
    if scoped is not None and scoped.device_type is not None:
        return scoped
    return DeviceSpec.parse("gpu:0" if devices("gpu") else "cpu:0")


def _context(ordinal: int, doing: str) -> runtime.DeviceContext:
    """The context of GPU `ordinal`, or a GpuRuntimeError at the user's line: `doing` and why not."""
    reason = driver.unavailable_reason()
    if reason is not None:
        raise GpuRuntimeError(f"{user_location()}: {doing}: {reason.rstrip('.')}")
    return runtime.context(ordinal)


# DLPack device types of host memory: kDLCPU, kDLCUDAHost (pinned).
_HOST_DEVICES = (1, 3)


@user_errors
def from_dlpack(x):
    """`x` (an array of another library: anything with `__dlpack__` and `__dlpack_device__`) without
    a copy: a DeviceArray over its memory for a CUDA tensor of one of this process's GPUs (kept
    alive, and handed back to its library, with the DeviceArray), a numpy array for a host one. The
    tensor must be C-contiguous. Its library's pending work on it is waited for first (it is asked
    to order that work before the legacy default stream, which flowjit waits on, within the
    timeout FLOWJIT_GPU_TIMEOUT_S)."""
    if isinstance(x, DeviceArray):
        return x
    if not (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")):
        raise FlowjitTypeError(
            f"{user_location()}: from_dlpack needs an object with __dlpack__ and __dlpack_device__ "
            f"(a PyTorch, CuPy or JAX array); found {type(x).__name__}"
        )
    kind, ordinal = (int(v) for v in x.__dlpack_device__())
    if kind in _HOST_DEVICES:
        return np.from_dlpack(x)
    if kind != KDL_CUDA:
        raise FlowjitValueError(
            f"{user_location()}: from_dlpack: the array is on DLPack device type {kind}; flowjit takes "
            f"host memory ({', '.join(map(str, _HOST_DEVICES))}) and CUDA GPUs ({KDL_CUDA})"
        )
    ctx = _context(ordinal, f"cannot take an array of GPU {ordinal}")
    capsule = x.__dlpack__(stream=1)  # its work on the array ordered before the legacy default stream
    ctx.copier().after_legacy_stream(f"the work of {type(x).__name__} on the array")
    try:
        return imported(ctx, capsule)
    except BufferError as error:
        raise FlowjitValueError(f"{user_location()}: from_dlpack: {error}") from None
