"""`fj.device_put(x, "gpu:0")`: an array copied into a GPU's memory, as an `fj.DeviceArray`.

    w = fj.device_put(np.ones((784, 10), np.float32), "gpu:0")
    f = fj.jit(step, device="gpu:0", keep_on_device=True)
    y = f(x, w)            # w is read where it is; y stays on the GPU too
    np.asarray(y)          # the one copy to the host

docs/gpu-backend.md ("Results that stay on the device") describes the handle.
"""

from __future__ import annotations

import numpy as np

from flowjit.backends.gpu import driver, runtime
from flowjit.backends.gpu.arrays import DeviceArray, put
from flowjit.backends.gpu.driver import GpuRuntimeError
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.trace import Tracer
from flowjit.frontend.tracebacks import user_errors
from flowjit.ir import dtypes as dt
from flowjit.ir.devices import LOCAL_JOB
from flowjit.ir.location import user_location
from flowjit.runtime.devices import DeviceSpec


@user_errors
def device_put(x, device="gpu:0"):
    """`x` (an array, a Python scalar or a DeviceArray) in the memory of `device`: a DeviceArray
    for a GPU of this process; for a CPU device, a host (numpy) array."""
    if isinstance(x, Tracer):
        raise FlowjitTypeError(
            f"{user_location()}: device_put needs a concrete array, not a traced value; call it outside jit"
        )
    spec = DeviceSpec.parse(device)
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
    reason = driver.unavailable_reason()
    if reason is not None:
        raise GpuRuntimeError(f"{user_location()}: cannot put an array on GPU {ordinal}: {reason.rstrip('.')}")
    return put(runtime.context(ordinal), array)
