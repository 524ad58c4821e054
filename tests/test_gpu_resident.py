"""Variables in device memory and results kept on the device (flowjit/backends/gpu: resident.py,
arrays.py; the frontend's side in frontend/lowered.py, runtime/tasks.py; docs/gpu-backend.md).

Without a GPU: the coherence of a variable's device copy and its host buffer (`DeviceVariable`
on a stand-in context whose "device memory" is host memory), the home registry's seam
(`set_variable_home`, `bring_home`), the DLPack capsule read back through ctypes, and the errors
without a GPU. On the fake driver (tests/fake_cuda) with every launch emulated on the CPU
(tests/gpu_emulator.py), in a subprocess: a program updating a variable for several calls copies
it in once and out only when the host reads it, with the CPU backend's values; a kept result
passed to a second program is not copied through the host (the cuMemcpy calls in the driver's
log); every device block is freed once at exit.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
from flowjit.backends.gpu import arrays, driver, resident
from flowjit.backends.gpu.runtime import CachingAllocator
from flowjit.frontend import device_put as device_put_module
from flowjit.runtime import tasks

sys.path.insert(0, os.path.dirname(__file__))
from test_gpu_runtime import _with_fake_driver, fake_driver  # noqa: E402,F401  (the fixture)

NO_GPU = driver.unavailable_reason()


# --- a stand-in context: "device memory" is host memory, copies are counted ----------------------


class FakeCopier:
    def __init__(self):
        self.to_device_calls, self.to_host_calls = [], []

    def to_device(self, address, array, what):
        self.to_device_calls.append(what)
        ctypes.memmove(address, array.ctypes.data, array.nbytes)

    def to_host(self, address, array, what):
        self.to_host_calls.append(what)
        ctypes.memmove(array.ctypes.data, address, array.nbytes)


class FakeContext:
    """What resident.py and arrays.py use of a DeviceContext."""

    def __init__(self, ordinal=0):
        self.ordinal = ordinal
        self.closed = False
        self.residents = {}
        self.blocks = {}

        def malloc(n):
            block = np.zeros(n, np.uint8)
            self.blocks[block.ctypes.data] = block
            return block.ctypes.data

        self.allocator = CachingAllocator(malloc, lambda a: self.blocks.pop(a))
        self._copier = FakeCopier()

    def copier(self):
        return self._copier

    def device_values(self, address, like):
        return np.frombuffer(self.blocks[address], like.dtype, like.size).reshape(like.shape).copy()


def test_a_variable_is_copied_in_once_and_out_only_when_read():
    ctx = FakeContext()
    host = np.arange(6, dtype=np.float32)
    copy = resident.device_variable(ctx, "w", host)
    assert resident.device_variable(ctx, "w", host) is copy  # one copy per variable and device
    assert copy.address_for_call() == copy.address_for_call()
    assert ctx._copier.to_device_calls == ["variable 'w' to the device"]  # once

    # a call updated it into a fresh block: that block is the device copy, the host buffer is stale
    new = ctx.allocator.allocate(host.nbytes)
    ctypes.memmove(new, (host * 10).ctypes.data, host.nbytes)
    old = copy.address
    copy.updated(new)
    assert copy.address == new and ctx.allocator.bytes_cached == 512  # the old block went back
    assert old not in ctx.allocator._live and host[1] == 1.0
    assert copy.read().tolist() == (np.arange(6) * 10).tolist() and host[1] == 10.0
    copy.read()
    assert len(ctx._copier.to_host_calls) == 1  # the host buffer is current now
    assert copy.address_for_call() == new and len(ctx._copier.to_device_calls) == 1

    # the host writes it: the device copy is stale, the next call copies it in
    copy.write(np.full(6, 7.0, np.float32))
    assert host.tolist() == [7.0] * 6 and not copy.device_current
    copy.address_for_call()
    assert ctx.device_values(copy.address, host).tolist() == [7.0] * 6 and len(ctx._copier.to_device_calls) == 2

    # a call that wrote the variable to the host buffer (write-through): the device copy is stale
    copy.written_to_host()
    assert not copy.device_current and copy.host_current


def test_a_variable_that_leaves_its_device_is_copied_in_again():
    ctx = FakeContext()
    host = np.zeros(3, np.float32)
    copy = resident.device_variable(ctx, "v", host)
    copy.address_for_call()
    copy.updated(ctx.allocator.allocate(12))  # the new value (zeros) is on the device only
    ctypes.memmove(copy.address, np.ones(3, np.float32).ctypes.data, 12)
    copy.left()  # brings the host buffer up to date first
    assert host.tolist() == [1.0] * 3 and not copy.device_current
    copy.detach()
    assert copy.address == 0 and copy.host_current


def test_a_dead_variables_copy_goes_back_and_a_new_one_of_that_name_gets_its_own():
    ctx = FakeContext()
    host = np.zeros(1000, np.float32)
    first = resident.device_variable(ctx, "w", host)
    other = np.zeros(1000, np.float32)
    second = resident.device_variable(ctx, "w", other)  # another variable called "w" (the first died)
    assert second is not first and ctx.residents["w"] is second
    in_use = ctx.allocator.bytes_in_use
    del other, second
    assert "w" not in ctx.residents and ctx.allocator.bytes_in_use < in_use  # freed with its variable
    assert resident.device_variable(ctx, "w", host, create=False) is None


class Home:
    task = "/job:localhost/task:0"

    def __init__(self, value):
        self.value, self.gone = value, 0

    def read(self):
        return self.value.copy()

    def write(self, value):
        self.value = value

    def left(self):
        self.gone += 1


def test_homes_are_told_when_they_stop_being_a_variables_home():
    first, second = Home(np.ones(2)), Home(np.zeros(2))
    try:
        tasks.set_variable_home("seam_v", first)
        tasks.set_variable_home("seam_v", first)  # the same home again: nothing left
        assert first.gone == 0
        tasks.set_variable_home("seam_v", second)
        assert first.gone == 1 and tasks.variable_home("seam_v") is second
        buffer = np.full(2, 5.0)
        tasks.bring_home({"seam_v": buffer}, keep=lambda home: home is second)  # its executable keeps it
        assert tasks.variable_home("seam_v") is second and buffer.tolist() == [5.0, 5.0]
        tasks.bring_home({"seam_v": buffer})
        assert tasks.variable_home("seam_v") is None and second.gone == 1 and buffer.tolist() == [0.0, 0.0]
    finally:
        tasks.set_variable_home("seam_v", None)


def test_a_new_variable_does_not_inherit_the_home_of_a_dead_one_of_its_name():
    home = Home(np.ones(2, np.float32))
    tasks.set_variable_home("reused_name", home)
    v = fj.Variable(np.zeros(2, np.float32), name="reused_name")
    assert tasks.variable_home(v.name) is None and home.gone == 1 and v.value.tolist() == [0.0, 0.0]


# --- DLPack: the capsule's contents, read back through ctypes ---------------------------------------

_api = ctypes.PyDLL(None)
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _device_array(ctx, shape, dtype):
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return arrays.DeviceArray(ctx, ctx.allocator.allocate(nbytes), shape, dtype)


@pytest.mark.parametrize(
    "dtype,code,bits",
    [(np.float32, 2, 32), (np.float16, 2, 16), (ml_dtypes.bfloat16, 4, 16), (np.int32, 0, 32), (np.bool_, 6, 8)],
)
def test_dlpack_capsule_describes_the_device_array(dtype, code, bits):
    ctx = FakeContext(ordinal=0)
    a = _device_array(ctx, (3, 4, 5), dtype)
    assert a.__dlpack_device__() == (2, 0)  # kDLCUDA, device 0
    capsule = a.__dlpack__()
    managed = arrays.DLManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor"))
    t = managed.dl_tensor
    assert t.data == a.address_on(0) and (t.device.device_type, t.device.device_id) == (2, 0)
    assert t.ndim == 3 and [t.shape[i] for i in range(3)] == [3, 4, 5]
    assert [t.strides[i] for i in range(3)] == [20, 5, 1]  # in elements, C order
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (code, bits, 1) and t.byte_offset == 0

    # the consumer's side: it renames the capsule and calls the deleter when it is done
    address = ctypes.addressof(managed)
    assert address in arrays._exported
    _api.PyCapsule_SetName(capsule, b"used_dltensor")
    del a
    assert ctx.allocator.bytes_in_use > 0  # the consumer still holds the array
    managed.deleter(ctypes.pointer(managed))
    assert address not in arrays._exported and ctx.allocator.bytes_in_use == 0


def test_an_unconsumed_capsule_gives_the_array_back_and_exports_are_checked():
    ctx = FakeContext()
    a = _device_array(ctx, (4,), np.float32)
    capsule = a.__dlpack__()
    del a, capsule  # never consumed: its destructor calls the deleter
    assert not arrays._exported and ctx.allocator.bytes_in_use == 0
    b = _device_array(ctx, (4,), np.float32)
    with pytest.raises(BufferError, match=r"not \(2, 1\)"):
        b.__dlpack__(dl_device=(2, 1))
    with pytest.raises(BufferError, match="does not copy"):
        b.__dlpack__(copy=True)
    b.delete()
    with pytest.raises(fj.FlowjitValueError, match="was deleted"):
        b.__dlpack__()
    with pytest.raises(fj.FlowjitValueError, match="was deleted"):
        np.asarray(b)


def test_an_imported_tensor_is_read_in_place_and_handed_back_when_it_goes():
    """`imported` (fj.from_dlpack's core) on a capsule another library made (here our own export,
    standing in for PyTorch's): the same memory, not a copy; the producer's tensor lives as long as
    the DeviceArray over it, and its deleter runs when that goes."""
    ctx = FakeContext(ordinal=0)
    a = _device_array(ctx, (3, 4), np.float32)
    b = arrays.imported(ctx, a.__dlpack__())
    assert b.address_on(0) == a.address_on(0) and b.shape == (3, 4) and b.dtype == np.float32
    address = a.address_on(0)
    del a
    assert ctx.allocator.bytes_in_use > 0 and arrays._exported  # b keeps the producer's tensor
    assert b.address_on(0) == address
    del b
    assert not arrays._exported and ctx.allocator.bytes_in_use == 0


def test_an_imported_tensor_must_be_contiguous_on_this_device_and_of_a_flowjit_dtype():
    ctx = FakeContext(ordinal=0)
    a = _device_array(ctx, (3, 4), np.float32)
    with pytest.raises(BufferError, match=r"device \(2, 0\), not GPU 1"):
        arrays.imported(FakeContext(ordinal=1), a.__dlpack__())
    capsule = a.__dlpack__()
    t = arrays.DLManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    t.strides[0], t.strides[1] = 1, 3  # a transposed view
    with pytest.raises(BufferError, match=r"strides \(1, 3\).*C-contiguous tensors only"):
        arrays.imported(ctx, capsule)
    capsule = a.__dlpack__()
    t = arrays.DLManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    t.dtype.lanes = 4
    with pytest.raises(BufferError, match="4 lanes"):
        arrays.imported(ctx, capsule)
    with pytest.raises(BufferError, match="unused DLPack 'dltensor' capsule"):
        arrays.imported(ctx, "not a capsule")


def test_an_imported_view_off_the_16_byte_grid_comes_through_the_host():
    """Kernels may load and store 16 bytes at a time: every buffer they take starts at a multiple
    of `plan.BUFFER_ALIGNMENT` bytes. A DeviceArray starting 4 bytes into a block (another
    library's view) is passed as a host array, copied into a buffer of the runtime's; an aligned
    one is passed by its address."""
    ctx = FakeContext(ordinal=0)
    a = arrays.put(ctx, np.arange(8, dtype=np.float32))
    capsule = a.__dlpack__()
    t = arrays.DLManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    t.shape[0], t.byte_offset = 4, 4  # a[1:5]
    view = arrays.imported(ctx, capsule)
    aligned = arrays.put(ctx, np.arange(4, dtype=np.float32))
    lowered = fj.jit(lambda x: x * 2.0, target="cuda").lower(np.ones(4, np.float32))
    lowered.compile()
    executable = lowered._executable
    assert executable.check_arguments([aligned]) == [aligned.address_on(0)]
    [moved] = executable.check_arguments([view])
    assert isinstance(moved, np.ndarray) and moved.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_from_dlpack_takes_host_arrays_as_they_are_and_says_what_it_cannot_take():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = fj.from_dlpack(x)
    assert isinstance(y, np.ndarray) and np.shares_memory(x, y)
    with pytest.raises(
        fj.FlowjitTypeError, match=r"test_gpu_resident.py:\d+: from_dlpack needs an object with __dlpack__"
    ):
        fj.from_dlpack([1.0, 2.0])

    class OnAnotherDevice:
        def __dlpack_device__(self):
            return (14, 0)  # kDLMetal

        def __dlpack__(self, **kwargs):
            raise AssertionError("never asked for its capsule")

    with pytest.raises(fj.FlowjitValueError, match="DLPack device type 14"):
        fj.from_dlpack(OnAnotherDevice())


def test_device_arrays_come_to_the_host_through_the_copier():
    ctx = FakeContext()
    a = arrays.put(ctx, np.arange(6, dtype=np.int32).reshape(2, 3))
    assert (a.shape, a.dtype, a.ndim, a.size, a.nbytes, len(a)) == ((2, 3), np.int32, 2, 6, 24, 2)
    assert np.asarray(a).tolist() == [[0, 1, 2], [3, 4, 5]] and a.numpy().dtype == np.int32
    assert np.asarray(a, dtype=np.float32).dtype == np.float32
    assert a.address_on(1) is None and repr(a) == "DeviceArray(shape=(2, 3), dtype=int32, device=gpu:0)"


# --- without a GPU: the errors --------------------------------------------------------------------


@pytest.mark.skipif(NO_GPU is None, reason="a CUDA device is present")
def test_without_a_gpu_the_api_says_why_at_the_users_line():
    line = sys._getframe().f_lineno + 2
    with pytest.raises(driver.GpuRuntimeError) as info:
        fj.device_put(np.ones(3, np.float32), "gpu:0")
    assert f"test_gpu_resident.py:{line}: cannot put an array on GPU 0: " in str(info.value)
    assert NO_GPU.rstrip(".") in str(info.value)

    w = fj.Variable(np.ones(3, np.float32), name="no_gpu_w")

    def step(x):
        w.assign_add(x)
        return x * 2.0

    line = sys._getframe().f_lineno + 2
    with pytest.raises(driver.GpuRuntimeError) as info:
        fj.jit(step, target="cuda", keep_on_device=True)(np.ones(3, np.float32))
    assert f"test_gpu_resident.py:{line}: cannot run 'step' on GPU 0: " in str(info.value)
    assert w.value.tolist() == [1.0] * 3  # untouched


def test_device_put_and_keep_on_device_on_the_cpu_give_host_arrays():
    x = np.arange(4, dtype=np.float32)
    assert type(fj.device_put(x, "cpu:0")) is np.ndarray
    with pytest.raises(fj.FlowjitValueError, match="is not a GPU of this process"):
        fj.device_put(x, "/job:ps/task:0/device:gpu:0")
    with pytest.raises(fj.FlowjitTypeError, match="unsupported dtype uint8"):
        fj.device_put(x.astype(np.uint8), "gpu:0")
    out = fj.jit(lambda a: a * 2.0, keep_on_device=True)(x)
    assert type(out) is np.ndarray and out.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_device_put_without_a_device_uses_the_default_device(monkeypatch):
    """As JAX's: the device an enclosing `fj.device` names, else GPU 0 when there is one, else the CPU."""
    x = np.arange(4, dtype=np.float32)
    monkeypatch.setattr(device_put_module, "devices", lambda device_type=None: [])
    assert type(fj.device_put(x)) is np.ndarray
    monkeypatch.setattr(device_put_module, "devices", lambda device_type=None: ["gpu:0"])
    monkeypatch.setattr(device_put_module, "put", lambda context, array: ("on the GPU", array))
    monkeypatch.setattr(device_put_module, "_context", lambda ordinal, doing: ordinal)
    assert fj.device_put(x)[0] == "on the GPU"
    with fj.device("cpu:0"):
        assert type(fj.device_put(x)) is np.ndarray
    with fj.device("/job:localhost/task:0"):  # names no device type: the default again
        assert fj.device_put(x)[0] == "on the GPU"


# --- on a GPU (skipped here): the same programs against the CPU backend --------------------------


@pytest.mark.skipif(NO_GPU is not None, reason=f"no CUDA device: {NO_GPU}")
def test_variables_and_kept_results_on_a_gpu():
    import flowjit.numpy as fnp

    w_cpu = fj.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="gpu_w_cpu")
    w_gpu = fj.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="gpu_w_gpu")

    def make_step(v):
        def step(x):
            v.assign_add(x * 0.5)
            return fnp.sum(v.value * x)

        return step

    cpu_step, gpu_step = fj.jit(make_step(w_cpu), device="cpu:0"), fj.jit(make_step(w_gpu), device="gpu:0")
    for i in range(5):
        x = np.linspace(-1, 1, 4).astype(np.float32) * (i + 1)
        assert float(gpu_step(x)) == pytest.approx(float(cpu_step(x)), rel=1e-5)
    np.testing.assert_allclose(w_gpu.value, w_cpu.value, rtol=1e-6)

    x = np.linspace(-2, 2, 33 * 7, dtype=np.float32).reshape(33, 7)
    y = fj.jit(lambda a: fnp.tanh(a) * 2.0, device="gpu:0", keep_on_device=True)(x)
    z = fj.jit(lambda a, b: a * b + 1.0, device="gpu:0")(y, fj.device_put(x, "gpu:0"))
    assert isinstance(y, fj.DeviceArray)
    np.testing.assert_allclose(z, np.tanh(x) * 2.0 * x + 1.0, rtol=1e-5, atol=1e-6)
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        t = torch.from_dlpack(y)
        assert t.device.type == "cuda" and tuple(t.shape) == (33, 7)
        np.testing.assert_allclose(t.cpu().numpy(), np.asarray(y))


# --- on the fake driver, every launch emulated on the CPU ------------------------------------------

_PROGRAMS = """
    import ctypes, json, os, sys, tempfile, numpy as np, flowjit as fj, flowjit.numpy as fnp
    sys.path.insert(0, "tests")
    import gpu_emulator
    from flowjit.backends.gpu import cubin, runtime
    cubin.find_ptxas = lambda: None  # PTX only: the hook finds each kernel by its PTX
    LIB = ctypes.CDLL("libcuda.so.1")

    def copies():
        calls = [line.split() for line in open(os.environ["FAKE_CUDA_LOG"]).read().splitlines()]
        return ([int(c[2]) for c in calls if c[0] == "cuMemcpyHtoDAsync"],
                [int(c[2]) for c in calls if c[0] == "cuMemcpyDtoHAsync"], len(calls))

    def since(before):  # the bytes of each copy to the device and to the host since `before`
        now = copies()
        return [now[0][len(before[0]):], now[1][len(before[1]):]]

    def launches_since(before):
        calls = [line.split() for line in open(os.environ["FAKE_CUDA_LOG"]).read().splitlines()]
        return [c[1:] for c in calls[before[2]:] if c[0] == "cuLaunchKernel"]

    def make_step(v):
        def step(x):
            v.assign_add(x * 0.5)
            return fnp.sum(v.value * x)
        return step

    out = {{}}
    init = np.arange(12, dtype=np.float32).reshape(3, 4)  # 48 bytes; x is 16
    w_cpu, w_gpu = fj.Variable(init, name="w_cpu"), fj.Variable(init, name="w_gpu")
    xs = [np.linspace(-1, 1, 4).astype(np.float32) * (i + 1) for i in range(5)]
    cpu_step = fj.jit(make_step(w_cpu), device="cpu:0")
    lowered = fj.jit(make_step(w_gpu), device="gpu:0").lower(xs[0])
    gpu_step = lowered.compile()
    hooks = [gpu_emulator.run_launches_of(LIB, [lowered._executable])]

    before = copies()
    out["cpu"] = [float(cpu_step(x)) for x in xs]
    out["gpu"] = [float(gpu_step(x)) for x in xs]
    out["calls"] = since(before)
    before = copies()
    out["values"] = [w_gpu.value.tolist(), w_gpu.numpy().tolist(), w_cpu.value.tolist()]
    out["read"] = since(before)

    w_gpu.assign(init); w_cpu.assign(init)  # the host writes it
    before = copies()
    out["after_write"] = [float(gpu_step(xs[0])), float(cpu_step(xs[0])), since(before)]

    def bump(v):
        def bump(x):
            v.assign_add(x)
            return v.value * 2.0
        return bump
    before = copies()
    out["cpu_program"] = [fj.jit(bump(w_gpu), device="cpu:0")(xs[1]).tolist(), since(before)]
    w_cpu.assign_add(xs[1])
    before = copies()
    out["after_cpu_program"] = [float(gpu_step(xs[2])), float(cpu_step(xs[2])), since(before)]

    # the partition executor's call (GpuExecutable.run, no home kept): it reads the device copy and
    # leaves the new value in the host buffer itself; the next jitted call copies it in again
    before = copies()
    raw = lowered._executable.run([xs[3]], {{"w_gpu": w_gpu.buffer}})
    cpu_raw = float(cpu_step(xs[3]))
    out["write_through"] = [float(raw[0]), cpu_raw, w_gpu.buffer.tolist(), w_cpu.value.tolist(), since(before)]
    before = copies()
    out["after_write_through"] = [float(gpu_step(xs[4])), float(cpu_step(xs[4])), since(before)]

    path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
    before = copies()
    fj.save_checkpoint(path, {{"w": w_gpu}})
    out["checkpoint"] = [fj.load_checkpoint(path)["w"].tolist(), w_cpu.value.tolist(), since(before)]

    def first(x):
        return fnp.tanh(x) * 2.0

    def second(y, x):
        return y * x + 1.0

    x = np.linspace(-2, 2, 33 * 7, dtype=np.float32).reshape(33, 7)  # 924 bytes
    lo1 = fj.jit(first, device="gpu:0", keep_on_device=True).lower(x)
    lo2 = fj.jit(second, device="gpu:0").lower(x, x)
    c1, c2 = lo1.compile(), lo2.compile()
    hooks.append(gpu_emulator.run_launches_of(LIB, [lo1._executable, lo2._executable]))
    before = copies()
    y = c1(x)
    out["kept"] = [type(y).__name__, list(y.shape), str(y.dtype), y.device, since(before)]
    before = copies()
    z = c2(y, x)
    address = str(y.address_on(0))
    out["second"] = [since(before), any(address in launch for launch in launches_since(before)),
                     float(np.max(np.abs(z - fj.jit(second, device="cpu:0")(fj.jit(first, device="cpu:0")(x), x))))]
    before = copies()
    host = np.asarray(y)
    out["to_host"] = [since(before), float(np.max(np.abs(host - fj.jit(first, device="cpu:0")(x))))]
    before = copies()
    d = fj.device_put(x, "gpu:0")
    y2 = c1(d)
    out["device_put"] = [since(before), float(np.max(np.abs(y2.numpy() - host)))]
    ctx = runtime.context(0)
    in_use = ctx.allocator.bytes_in_use
    del y, y2, d
    out["freed"] = [in_use - ctx.allocator.bytes_in_use, ctx.allocator.bytes_in_use]

    w_gpu.assign_add(1.0)  # on the device only at exit: teardown brings it to the host buffer first
    float(gpu_step(xs[0]))
    print(json.dumps(out))
"""


def test_variables_and_kept_results_on_the_fake_driver(fake_driver, tmp_path):  # noqa: F811  (the fixture)
    done, calls = _with_fake_driver(fake_driver, _PROGRAMS.format(), tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    w, x = 48, 16  # bytes of the variable and of an argument

    # five calls updating the variable: it goes in once, and never out; the values are the CPU's
    np.testing.assert_allclose(out["gpu"], out["cpu"], rtol=1e-6)
    assert out["calls"] == [[w] + [x] * 5, [4] * 5]
    assert out["values"][0] == out["values"][1] and np.allclose(out["values"][0], out["values"][2])
    assert out["read"] == [[], [w]]  # two reads by the host, one copy out
    # the host wrote it: the next call copies it in again
    assert out["after_write"][0] == pytest.approx(out["after_write"][1]) and out["after_write"][2] == [[w, x], [4]]
    # a CPU program used it: brought to the host first, copied in again by the next GPU call
    assert out["cpu_program"][1] == [[], [w]]
    gpu_value, cpu_value, copied = out["after_cpu_program"]
    assert gpu_value == pytest.approx(cpu_value, rel=1e-6) and copied == [[w, x], [4]]
    gpu_value, cpu_value, gpu_buffer, cpu_buffer, copied = out["write_through"]
    assert gpu_value == pytest.approx(cpu_value, rel=1e-6) and np.allclose(gpu_buffer, cpu_buffer)
    assert copied == [[x], [4, w]]  # x in; the result and the variable out, into its buffer
    gpu_value, cpu_value, copied = out["after_write_through"]
    assert gpu_value == pytest.approx(cpu_value, rel=1e-6) and copied == [[w, x], [4]]
    assert np.allclose(out["checkpoint"][0], out["checkpoint"][1]) and out["checkpoint"][2] == [[], [w]]

    # a kept result: nothing comes back; the second program reads it where it is
    assert out["kept"] == ["DeviceArray", [33, 7], "float32", "gpu:0", [[924], []]]
    (to_device, to_host), launched_with_it, error = out["second"]
    assert to_device == [924] and to_host == [924]  # x in, z out: y did not pass through the host
    assert launched_with_it and error <= 1e-6
    assert out["to_host"][0] == [[], [924]] and out["to_host"][1] <= 1e-6
    assert out["device_put"] == [[[924], []], 0.0]
    assert out["freed"][0] == 3 * 1024  # y, y2 and d went back to the allocator

    # teardown: the variable kept on the device came to its host buffer; every block freed once
    names = [c[0] for c in calls]
    last_copy_out = max(i for i, name in enumerate(names) if name == "cuMemcpyDtoHAsync")
    assert calls[last_copy_out][2] == str(w) and names.index("cuModuleUnload") > last_copy_out
    allocated = sorted(int(c[2]) for c in calls if c[0] == "cuMemAlloc")
    assert sorted(int(c[1]) for c in calls if c[0] == "cuMemFree") == allocated
    assert names[-1] == "cuDevicePrimaryCtxRelease"


_FROM_DLPACK = """
    import json, numpy as np, flowjit as fj
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = fj.device_put(x, "gpu:0")

    class Foreign:  # another library's tensor, as far as from_dlpack can tell
        def __init__(self, a):
            self.a, self.stream = a, "not asked"
        def __dlpack_device__(self):
            return self.a.__dlpack_device__()
        def __dlpack__(self, stream=None):
            self.stream = stream
            return self.a.__dlpack__()

    f = Foreign(a)
    b = fj.from_dlpack(f)
    same, stream = b.address_on(0) == a.address_on(0), f.stream
    del a, f
    print(json.dumps([same, stream, np.asarray(b).tolist(), repr(b)]))
"""


def test_from_dlpack_reads_a_gpu_tensor_in_place_on_the_fake_driver(fake_driver, tmp_path):  # noqa: F811
    """The whole import path: the producer is asked to order its work before the legacy default
    stream (1), which is waited on (an event recorded there, before any copy), and the tensor's
    memory is used as it is."""
    done, calls = _with_fake_driver(fake_driver, _FROM_DLPACK, tmp_path)
    assert done.returncode == 0, done.stderr
    same, stream, values, text = json.loads(done.stdout.strip().splitlines()[-1])
    assert same and stream == 1
    assert values == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
    assert text == "DeviceArray(shape=(3, 4), dtype=float32, device=gpu:0)"
    names = [c[0] for c in calls]
    copies_in = [i for i, n in enumerate(names) if n == "cuMemcpyHtoDAsync"]
    copies_out = [i for i, n in enumerate(names) if n == "cuMemcpyDtoHAsync"]
    assert len(copies_in) == 1 and len(copies_out) == 1  # device_put's copy in, np.asarray's copy out: no other
    # between them, device_put's wait for its copy and from_dlpack's for the producer's work
    assert names[copies_in[0] + 1 : copies_out[0]] == ["cuEventRecord", "cuEventRecord"]


_TWO_GPUS = """
    import ctypes, json, os, sys, numpy as np, flowjit as fj, flowjit.numpy as fnp
    sys.path.insert(0, "tests")
    import gpu_emulator
    from flowjit.backends.gpu import cubin
    cubin.find_ptxas = lambda: None
    LIB = ctypes.CDLL("libcuda.so.1")

    def copies():
        calls = [line.split() for line in open(os.environ["FAKE_CUDA_LOG"]).read().splitlines()]
        return ([int(c[2]) for c in calls if c[0] == "cuMemcpyHtoDAsync"],
                [int(c[2]) for c in calls if c[0] == "cuMemcpyDtoHAsync"])

    def since(before):
        now = copies()
        return [now[0][len(before[0]):], now[1][len(before[1]):]]

    def make_step(v):
        def step(x):
            v.assign_add(x * 0.5)
            return fnp.sum(v.value * x)
        return step

    init = np.arange(12, dtype=np.float32).reshape(3, 4)
    w, ref = fj.Variable(init, name="w"), fj.Variable(init, name="ref")
    x = np.linspace(-1, 1, 4).astype(np.float32)
    cpu = fj.jit(make_step(ref), device="cpu:0")
    lowered = [fj.jit(make_step(w), device=f"gpu:{n}").lower(x) for n in (0, 1)]
    steps = [lo.compile() for lo in lowered]
    hooks = [gpu_emulator.run_launches_of(LIB, [lo._executable for lo in lowered])]
    got, want, moves = [], [], []
    for n in (0, 0, 1, 1, 0):
        before = copies()
        got.append(float(steps[n](x)))
        want.append(float(cpu(x)))
        moves.append(since(before))
    out = {"values": [got, want, w.value.tolist(), ref.value.tolist()], "moves": moves}

    k0 = fj.jit(lambda a: a * 2.0, device="gpu:0", keep_on_device=True).lower(x)
    k1 = fj.jit(lambda a: a * 2.0, device="gpu:1").lower(x)
    c0, c1 = k0.compile(), k1.compile()
    hooks.append(gpu_emulator.run_launches_of(LIB, [k0._executable, k1._executable]))
    y = c0(x)
    before = copies()
    out["across"] = [c1(y).tolist(), since(before)]
    print(json.dumps(out))
"""


def test_a_variable_moves_between_two_gpus_through_the_host(fake_driver, tmp_path):  # noqa: F811
    """Two devices of the fake driver: the newest value lives on one device at a time; using the
    variable on the other brings it home (one copy out) and copies it in there (one copy in)."""
    done, _ = _with_fake_driver(fake_driver, _TWO_GPUS, tmp_path, FAKE_CUDA_DEVICES="2")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    got, want, w_value, ref_value = out["values"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(w_value, ref_value, rtol=1e-6)
    w, x = 48, 16
    stay, move = [[x], [4]], [[w, x], [w, 4]]  # a move: brought home from one GPU, copied to the other
    assert out["moves"] == [[[w, x], [4]], stay, move, stay, move]
    # a kept result of gpu:0 passed to a program on gpu:1 comes through the host
    result, copied = out["across"]
    np.testing.assert_allclose(result, [-4.0, -4.0 / 3, 4.0 / 3, 4.0], rtol=1e-6)
    assert copied == [[x], [x, x]]
