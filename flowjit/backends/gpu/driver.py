"""The CUDA driver API, thinly: `call` runs one driver function and turns a failure into a
`GpuRuntimeError` naming the call and the error (its name and the driver's description).

`cuda-bindings` (the extra `flowjit[gpu]`) is imported on the first call, never on `import
flowjit`, so flowjit imports and runs on machines without it or without a driver. What stands in
the way of running on a GPU is one exact reason (`unavailable_reason`): the package is missing,
`cuInit` failed (no driver: cuda-bindings raises instead of returning a CUresult when it finds no
`libcuda.so`), or the driver sees no device.

Tested here without a GPU: what the messages say when the package or the driver is missing
(tests/test_gpu_runtime.py). No driver call has been made on a real device yet.
"""

from __future__ import annotations

import functools
import threading

from flowjit.errors import FlowjitError


class GpuRuntimeError(FlowjitError, RuntimeError):
    """Running GPU code failed or cannot start: the message names the driver call and its error, or
    what is missing (the package cuda-bindings, a driver, a device)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code  # the CUresult's name ('CUDA_ERROR_OUT_OF_MEMORY'), when a driver call failed


_lock = threading.Lock()


@functools.cache
def _bindings():
    """The module `cuda.bindings.driver`, or the GpuRuntimeError saying why it cannot be imported
    (returned, so that the same reason is given every time)."""
    try:
        from cuda.bindings import driver
    except ImportError as error:
        return GpuRuntimeError(
            "running on a GPU needs the package cuda-bindings (`pip install 'flowjit[gpu]'`), which cannot be "
            f"imported: {error}"
        )
    return driver


def bindings():
    """`cuda.bindings.driver`, imported on first use; a GpuRuntimeError when it cannot be."""
    module = _bindings()
    if isinstance(module, GpuRuntimeError):
        raise GpuRuntimeError(str(module))  # a new one each time: raising one object again grows its traceback
    return module


def error_text(driver, result) -> str:
    """'CUDA_ERROR_NAME: the driver's description' for a CUresult."""
    name_err, name = driver.cuGetErrorName(result)
    text_err, text = driver.cuGetErrorString(result)
    ok = driver.CUresult.CUDA_SUCCESS
    name = name.decode() if name_err == ok and name else getattr(result, "name", str(result))
    return f"{name}: {text.decode()}" if text_err == ok and text else name


def call(name: str, *args):
    """`driver.<name>(*args)` with its CUresult checked: the values it returns after the CUresult
    (None, one value, or a tuple). Raises GpuRuntimeError naming the call and the error."""
    driver = bindings()
    try:
        returned = getattr(driver, name)(*args)
    except GpuRuntimeError:
        raise
    except Exception as error:  # cuda-bindings raises, e.g. when it cannot load libcuda.so
        raise GpuRuntimeError(f"{name} failed: {type(error).__name__}: {error}") from error
    result, values = returned[0], returned[1:]
    if result != driver.CUresult.CUDA_SUCCESS:
        code = getattr(result, "name", str(result))
        raise GpuRuntimeError(f"{name} failed: {error_text(driver, result)}", code)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def query(name: str, *args) -> bool:
    """`cuStreamQuery`/`cuEventQuery`: True when the work is done, False while it is pending; any
    other result raises GpuRuntimeError."""
    driver = bindings()
    (result,) = getattr(driver, name)(*args)
    if result == driver.CUresult.CUDA_SUCCESS:
        return True
    if result == driver.CUresult.CUDA_ERROR_NOT_READY:
        return False
    raise GpuRuntimeError(f"{name} failed: {error_text(driver, result)}", getattr(result, "name", str(result)))


_initialized: GpuRuntimeError | bool = False


def initialize() -> None:
    """`cuInit(0)`, once per process; its failure is kept and raised again on every later call, so
    every caller sees the same reason."""
    global _initialized
    bindings()  # a missing package is its own reason, not the driver's
    with _lock:
        if _initialized is False:
            try:
                call("cuInit", 0)
                _initialized = True
            except GpuRuntimeError as error:
                _initialized = GpuRuntimeError(f"no usable CUDA driver: {error}", error.code)
    if isinstance(_initialized, GpuRuntimeError):
        raise GpuRuntimeError(str(_initialized), _initialized.code)


def device_count() -> int:
    """How many CUDA devices the driver shows; raises GpuRuntimeError when there is no driver."""
    initialize()
    return call("cuDeviceGetCount")


def unavailable_reason() -> str | None:
    """Why this process cannot run on a GPU (the package, the driver, no device), or None."""
    try:
        if device_count() == 0:
            return "no CUDA device: the driver reports 0 devices (CUDA_VISIBLE_DEVICES may hide them)"
    except GpuRuntimeError as error:
        return str(error)
    return None


def local_gpu_count() -> int:
    """The GPUs this process can use, 0 when it cannot use any (for `fj.devices()`): asked of the
    driver once per process."""
    return _local_gpu_count()


@functools.cache
def _local_gpu_count() -> int:
    if unavailable_reason() is not None:
        return 0
    return device_count()


def compute_capability(ordinal: int) -> tuple[int, int]:
    """(major, minor) of CUDA device `ordinal`."""
    driver = bindings()
    initialize()
    device = call("cuDeviceGet", ordinal)
    attribute = driver.CUdevice_attribute
    major = call("cuDeviceGetAttribute", attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    minor = call("cuDeviceGetAttribute", attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
    return major, minor


def device_name(ordinal: int) -> str:
    initialize()
    device = call("cuDeviceGet", ordinal)
    raw = call("cuDeviceGetName", 256, device)
    return raw.split(b"\0", 1)[0].decode(errors="replace")
