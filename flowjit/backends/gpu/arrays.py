"""`DeviceArray`: an array that lives in a GPU's memory (`fj.DeviceArray`).

Made by `fj.device_put(x, "gpu:0")` or returned by a function jitted with `keep_on_device=True`
whose program ran on a GPU. `np.asarray(a)` and `a.numpy()` copy it to the host; a GPU program on
the same device reads it where it is (no copy through the host); a program anywhere else gets a
host copy. It is immutable, and its block goes back to the device's allocator when the last
reference to it goes (or at `delete()`).

DLPack (`__dlpack__`, `__dlpack_device__`): the array as a kDLCUDA tensor (device type 2, the
device's ordinal), C-contiguous strides in elements, for `torch.from_dlpack`, `cupy.from_dlpack`
or `jax.dlpack.from_dlpack`. The legacy (unversioned) capsule only. Every flowjit call waits for
its GPU work before it returns, so the data is ready on any stream the consumer names.

The other way, `imported(ctx, capsule)` (`fj.from_dlpack`) wraps another library's kDLCUDA tensor
as a DeviceArray without copying it: the DeviceArray keeps the producer's tensor alive and calls
its deleter when it goes.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from flowjit.backends.gpu.driver import GpuRuntimeError
from flowjit.backends.gpu.runtime import DeviceContext
from flowjit.errors import FlowjitValueError
from flowjit.ir import dtypes as dt


class DeviceArray:
    """An immutable array in the memory of GPU `ordinal` (see the module docstring)."""

    __slots__ = ("_ctx", "_address", "shape", "dtype", "_release", "__weakref__")

    def __init__(self, ctx: DeviceContext, address: int, shape: tuple[int, ...], dtype, give_back=None):
        """`give_back()`, when given, hands the memory back to its owner (an imported tensor's
        deleter) instead of the context's allocator."""
        self._ctx = ctx
        self._address = address
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        if give_back is None:
            self._release = weakref.finalize(self, _release, ctx, address)
            self._release.atexit = False  # at exit the context's teardown frees every block
        else:
            self._release = weakref.finalize(self, give_back)

    # --- facts ---------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def device(self) -> str:
        return f"gpu:{self._ctx.ordinal}"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        state = "" if self._release.alive else ", deleted"
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device}{state})"

    # --- where it is -------------------------------------------------------------------------------
    def address_on(self, ordinal: int) -> int | None:
        """Its device address when it lives on GPU `ordinal` (in the context a call uses), else None."""
        self._check_alive()
        if self._ctx.ordinal != ordinal or self._ctx.closed:
            return None
        return self._address

    def _check_alive(self) -> None:
        if not self._release.alive:
            raise FlowjitValueError(f"{self!r} was deleted; its memory is gone")
        if self._ctx.closed:
            raise GpuRuntimeError(f"the context of {self.device} was closed (the process is exiting)")

    # --- to the host -------------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A host copy (numpy array)."""
        self._check_alive()
        out = np.empty(self.shape, self.dtype)
        self._ctx.copier().to_host(self._address, out, f"a {self.dtype} array of shape {self.shape} to the host")
        return out

    def __array__(self, dtype=None, copy=None):
        if copy is False:
            raise ValueError("a DeviceArray cannot be viewed as a host array without a copy")
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def delete(self) -> None:
        """Give its memory back now; using it afterwards is an error."""
        self._release()

    # --- DLPack ------------------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self._ctx.ordinal)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A 'dltensor' capsule of this array (kDLCUDA); the consumer keeps the array alive until
        it calls the capsule's deleter. `stream` is not waited on: the data is ready (every call
        finished its GPU work before it returned)."""
        self._check_alive()
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(
                f"{self!r} is on {self.__dlpack_device__()}, not {tuple(dl_device)}; no cross-device export"
            )
        if copy:
            raise BufferError("DeviceArray.__dlpack__ does not copy; pass copy=None or False")
        return _capsule(self)


def _release(ctx: DeviceContext, address: int) -> None:
    if not ctx.closed:  # a closed context freed every block already
        ctx.allocator.release(address)


def put(ctx: DeviceContext, array: np.ndarray) -> DeviceArray:
    """A DeviceArray holding a copy of the host `array` on `ctx`'s device."""
    array = np.ascontiguousarray(array)
    address = ctx.allocator.allocate(array.nbytes)
    try:
        ctx.copier().to_device(address, array, f"a {array.dtype} array of shape {array.shape} to the device")
    except BaseException:
        ctx.allocator.release(address)
        raise
    return DeviceArray(ctx, address, array.shape, array.dtype)


# --- the DLPack capsule (dlpack.h, v0.8 ABI of DLManagedTensor) ----------------------------------------
KDL_CUDA = 2
_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLBool; kDLBfloat is 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Exported tensors not yet given back by their consumer: address of the DLManagedTensor -> what it
# keeps alive (the array, the struct, its shape and strides).
_exported: dict[int, tuple] = {}
_exported_lock = threading.Lock()


def dl_dtype(dtype: np.dtype) -> tuple[int, int]:
    """(DLPack type code, bits) of a flowjit dtype."""
    if dt.dtype(dtype) is dt.bfloat16:
        return 4, 16
    return _DL_CODES[dtype.kind], dtype.itemsize * 8


@_DELETER
def _delete_managed(managed) -> None:
    with _exported_lock:
        _exported.pop(ctypes.addressof(managed.contents), None)


_pythonapi = ctypes.PyDLL(None)  # our own function objects: their argtypes are set here, not on ctypes.pythonapi's
_pythonapi.PyCapsule_New.restype = ctypes.py_object
_pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_pythonapi.PyCapsule_IsValid.restype = ctypes.c_int
_pythonapi.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
_pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_pythonapi.PyCapsule_SetName.restype = ctypes.c_int
_pythonapi.PyCapsule_SetName.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: int) -> None:
    # A consumer renames the capsule 'used_dltensor' and calls the deleter itself; a capsule
    # dropped unconsumed still holds 'dltensor', and its tensor is given back here.
    if _pythonapi.PyCapsule_IsValid(capsule, b"dltensor"):
        pointer = _pythonapi.PyCapsule_GetPointer(capsule, b"dltensor")
        _delete_managed(ctypes.cast(pointer, ctypes.POINTER(DLManagedTensor)))


def _capsule(array: DeviceArray):
    ndim = array.ndim
    shape = (ctypes.c_int64 * max(ndim, 1))(*array.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(
        *(int(np.prod(array.shape[i + 1 :], dtype=np.int64)) for i in range(ndim))
    )
    code, bits = dl_dtype(array.dtype)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(
        array._address or None, DLDevice(KDL_CUDA, array._ctx.ordinal), ndim, DLDataType(code, bits, 1),
        ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)), ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0,
    )  # fmt: skip
    managed.manager_ctx = None
    managed.deleter = _delete_managed
    with _exported_lock:
        _exported[ctypes.addressof(managed)] = (array, managed, shape, strides)
    return _pythonapi.PyCapsule_New(ctypes.addressof(managed), b"dltensor", _capsule_destructor)


# --- importing another library's tensor --------------------------------------------------------------
_FROM_DL_CODES = {code: kind for kind, code in _DL_CODES.items()}
_USED = b"used_dltensor"  # a capsule keeps the pointer to its name: this bytes object lives on


def _numpy_dtype(code: int, bits: int, lanes: int) -> np.dtype:
    """The numpy dtype of a DLPack data type; a BufferError for one flowjit has no dtype for."""
    if lanes == 1 and code == 4 and bits == 16:
        return np.dtype(dt.bfloat16.np_dtype)
    kind = _FROM_DL_CODES.get(code)
    if lanes == 1 and kind is not None:
        dtype = np.dtype(f"{kind}{bits // 8}" if kind != "b" else "?")
        if dt.is_supported_numpy_dtype(dtype) and dtype.itemsize * 8 == bits:
            return dtype
    raise BufferError(f"DLPack type (code {code}, {bits} bits, {lanes} lanes) is no flowjit dtype")


def imported(ctx: DeviceContext, capsule) -> DeviceArray:
    """A DeviceArray over the kDLCUDA tensor of a 'dltensor' `capsule` (from `__dlpack__`) on
    `ctx`'s device, not copied: the capsule is marked used, and the DeviceArray calls the tensor's
    deleter when it goes. C-contiguous tensors only."""
    at = id(capsule)  # the capsule object's address (it stays alive: we hold it)
    if not _pythonapi.PyCapsule_IsValid(at, b"dltensor"):
        raise BufferError("expected an unused DLPack 'dltensor' capsule")
    pointer = _pythonapi.PyCapsule_GetPointer(at, b"dltensor")
    managed = ctypes.cast(pointer, ctypes.POINTER(DLManagedTensor))
    tensor = managed.contents.dl_tensor
    if (tensor.device.device_type, tensor.device.device_id) != (KDL_CUDA, ctx.ordinal):
        raise BufferError(
            f"the tensor is on DLPack device {(tensor.device.device_type, tensor.device.device_id)}, "
            f"not GPU {ctx.ordinal} {(KDL_CUDA, ctx.ordinal)}"
        )
    dtype = _numpy_dtype(tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    if tensor.strides:
        expected = 1
        for i in reversed(range(tensor.ndim)):
            if shape[i] != 1 and tensor.strides[i] != expected:
                raise BufferError(
                    f"the tensor of shape {shape} has strides {tuple(tensor.strides[j] for j in range(tensor.ndim))} "
                    "(in elements): flowjit takes C-contiguous tensors only (make it contiguous first)"
                )
            expected *= shape[i]
    address = (tensor.data or 0) + tensor.byte_offset
    deleter = managed.contents.deleter
    if _pythonapi.PyCapsule_SetName(at, _USED) != 0:
        raise BufferError("the DLPack capsule could not be marked used")

    def give_back() -> None:
        if deleter:
            deleter(managed)

    return DeviceArray(ctx, address, shape, dtype, give_back=give_back)
