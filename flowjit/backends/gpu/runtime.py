"""Running a launch plan on a CUDA device through the driver API (`driver.py`).

    DeviceContext    one per device and process: the device's primary context, its caching
                     allocator, the modules loaded into it, what lives in its memory between
                     calls (`residents`: variables' device copies, `resident.py`) and a `Copier`
                     for copies outside calls; torn down at exit (`close_all`)
    CachingAllocator device memory in size classes with a free list per class; blocks come back to
                     their list after a call and are freed on teardown (or when an allocation
                     fails, before it is tried again)
    PinnedStaging    one page-locked host block per runner, grown as needed: inputs are copied into
                     it and sent from it, outputs come back through it
    PlanRunner       one per executable and device: a stream, the kernels' functions, the argument
                     packing of every launch; `run` copies inputs in (or reads them where they
                     are on the device), replays the plan, copies outputs out (or keeps them on the
                     device) and waits for the stream with a deadline (`wait`: never unbounded)

One call of a runner at a time (its lock): a runner owns one stream and one staging block.
Nothing here imports MLIR; the runner needs only the plan (data) and each kernel's PTX or cubin.
No part of this file has run on a GPU yet (docs/gpu-backend.md).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.backends.gpu import driver
from flowjit.backends.gpu.driver import GpuRuntimeError
from flowjit.backends.gpu.plan import Affine, Launch, LaunchPlan, Loop, MemrefArg

# How long a call may wait for its GPU work (seconds); FLOWJIT_GPU_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 120.0
# A wait polls without sleeping this long (seconds), then sleeps 20 us doubling up to 1 ms.
SPIN_S = 200e-6
# Device allocations are rounded up to a size class: powers of two from 512 bytes to 1 MiB, then
# multiples of 2 MiB (the driver's own granularity for large allocations).
MIN_BLOCK = 512
LARGE_FROM = 1 << 20
LARGE_GRANULE = 2 << 20


def timeout_s() -> float:
    raw = os.environ.get("FLOWJIT_GPU_TIMEOUT_S")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise GpuRuntimeError(f"FLOWJIT_GPU_TIMEOUT_S must be a positive number of seconds; found {raw!r}")
    return value


def size_class(nbytes: int) -> int:
    """The bytes actually allocated for a request of `nbytes` (> 0)."""
    if nbytes <= MIN_BLOCK:
        return MIN_BLOCK
    if nbytes <= LARGE_FROM:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // LARGE_GRANULE) * LARGE_GRANULE


class CachingAllocator:
    """Device memory by size class (`size_class`): `allocate` takes a block from the class's free
    list or from `malloc`; `release` puts it back; `free_all` returns every block to `free`
    (teardown). A failing `malloc` (GpuRuntimeError) is retried once after the cached free blocks
    are freed. `malloc(nbytes) -> address` and `free(address)` are the driver's (or a test's)."""

    def __init__(self, malloc: Callable[[int], int], free: Callable[[int], None]):
        self._malloc, self._free = malloc, free
        self._free_lists: dict[int, list[int]] = {}
        self._live: dict[int, int] = {}  # address -> its size class, for blocks handed out
        self._lock = threading.Lock()
        self.driver_allocations = 0

    def allocate(self, nbytes: int) -> int:
        """A device address of at least `nbytes` bytes (0 for 0 bytes: nothing to address)."""
        if nbytes == 0:
            return 0
        size = size_class(nbytes)
        with self._lock:
            free = self._free_lists.get(size)
            if free:
                address = free.pop()
                self._live[address] = size
                return address
        try:
            address = self._malloc(size)
        except GpuRuntimeError:
            self.trim()  # give the cached blocks back to the driver, then try once more
            address = self._malloc(size)
        with self._lock:
            self._live[address] = size
            self.driver_allocations += 1
        return address

    def release(self, address: int) -> None:
        """Return a block `allocate` gave (0 is ignored); a block not handed out is an error."""
        if address == 0:
            return
        with self._lock:
            size = self._live.pop(address, None)
            if size is None:
                raise GpuRuntimeError(f"internal error: device block {address:#x} released but not allocated here")
            self._free_lists.setdefault(size, []).append(address)

    def trim(self) -> None:
        """Free the cached (unused) blocks."""
        with self._lock:
            blocks = [a for free in self._free_lists.values() for a in free]
            self._free_lists.clear()
        for address in blocks:
            self._free(address)

    def free_all(self) -> None:
        """Free every block, cached or handed out (the context is going away)."""
        self.trim()
        with self._lock:
            live = list(self._live)
            self._live.clear()
        for address in live:
            self._free(address)

    @property
    def bytes_in_use(self) -> int:
        return sum(self._live.values())

    @property
    def bytes_cached(self) -> int:
        return sum(size * len(free) for size, free in self._free_lists.items())


@dataclass
class LoadedKernel:
    """A kernel function loaded into a context, and how its code got there ('cubin sm_90' or
    'PTX through the driver's JIT (...)')."""

    function: object
    how: str


class DeviceContext:
    """Device `ordinal`'s primary context, its allocator and its loaded modules (`context(n)`)."""

    def __init__(self, ordinal: int):
        driver.initialize()
        count = driver.device_count()
        if not 0 <= ordinal < count:
            raise GpuRuntimeError(f"no CUDA device {ordinal}: the driver shows {count} device(s)")
        self.ordinal = ordinal
        self.device = driver.call("cuDeviceGet", ordinal)
        self.capability = driver.compute_capability(ordinal)
        self.name = driver.device_name(ordinal)
        self.handle = driver.call("cuDevicePrimaryCtxRetain", self.device)
        self.activate()
        cu = driver.bindings()
        self.allocator = CachingAllocator(
            lambda n: int(driver.call("cuMemAlloc", n)), lambda a: driver.call("cuMemFree", cu.CUdeviceptr(a))
        )
        self._modules: dict[tuple[str, bytes], tuple[object, LoadedKernel]] = {}
        self._lock = threading.Lock()
        self.runners: weakref.WeakSet[PlanRunner] = weakref.WeakSet()  # closed before the context
        # What else lives in this context's memory between calls (variables' device copies, by
        # name: `resident.py`); each is detached (its value brought to the host) before teardown.
        self.residents: dict[str, object] = {}
        self._copier: Copier | None = None
        self.closed = False

    def copier(self) -> Copier:
        """The context's stream for copies outside a plan's calls (made on first use)."""
        with self._lock:
            if self.closed:
                raise GpuRuntimeError(f"the context of GPU {self.ordinal} was closed (the process is exiting)")
            if self._copier is None:
                self._copier = Copier(self)
            return self._copier

    @property
    def chip(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def activate(self) -> None:
        """Make this context current on the calling thread (the driver's current context is per thread)."""
        driver.call("cuCtxSetCurrent", self.handle)

    def load(self, module_name: str, function_name: str, ptx: str, cubin: bytes | None, cubin_chip: str | None):
        """The kernel `function_name` of one compiled module: its cubin when it was built for this
        device's chip (or an earlier chip of the same major version), else its PTX through the
        driver's JIT. Loaded once per context."""
        use_cubin = cubin is not None and cubin_chip is not None and _cubin_runs_on(cubin_chip, self.chip)
        image = cubin if use_cubin else ptx.encode() + b"\0"
        key = (function_name, image)
        with self._lock:
            if key in self._modules:
                return self._modules[key][1]
            if not use_cubin:
                _check_ptx_target(ptx, module_name, self.chip)
            self.activate()
            module = driver.call("cuModuleLoadDataEx", image, 0, [], [])
            function = driver.call("cuModuleGetFunction", module, function_name.encode())
            if use_cubin:
                how = f"cubin {cubin_chip}"
            elif cubin is None:
                how = "PTX through the driver's JIT (no cubin: ptxas was not found when it was compiled)"
            else:
                how = f"PTX through the driver's JIT (its cubin is for {cubin_chip}, the device is {self.chip})"
            loaded = LoadedKernel(function, how)
            self._modules[key] = (module, loaded)
            return loaded

    def close(self) -> None:
        """Unload the modules, free all device memory and release the primary context."""
        if self.closed:
            return
        for resident in list(self.residents.values()):
            resident.detach()  # a variable whose value is only here goes to its host buffer first
        self.residents.clear()
        for runner in list(self.runners):
            runner.close()
        if self._copier is not None:
            self._copier.close()
        self.closed = True
        self.activate()
        for module, _ in self._modules.values():
            driver.call("cuModuleUnload", module)
        self._modules.clear()
        self.allocator.free_all()
        driver.call("cuDevicePrimaryCtxRelease", self.device)


def _cubin_runs_on(cubin_chip: str, device_chip: str) -> bool:
    """A cubin for sm_XY runs on devices of the same major version X and minor >= Y."""
    built, device = cubin_chip.removeprefix("sm_"), device_chip.removeprefix("sm_")
    return built[:-1] == device[:-1] and built[-1] <= device[-1]


def _check_ptx_target(ptx: str, module_name: str, device_chip: str) -> None:
    """PTX for a later chip than the device's cannot be JIT-compiled for it: say so plainly."""
    for line in ptx.splitlines():
        if line.startswith(".target"):
            target = line.split()[1].rstrip(",")
            if int(target.removeprefix("sm_").rstrip("a")) > int(device_chip.removeprefix("sm_")):
                raise GpuRuntimeError(
                    f"kernel {module_name} was compiled for {target}, but the device is {device_chip}: compile with "
                    f"target 'cuda-{device_chip}' (or 'cuda', sm_80)"
                )
            return


_contexts: dict[int, DeviceContext] = {}
_contexts_lock = threading.Lock()


def context(ordinal: int) -> DeviceContext:
    """The process's context on device `ordinal` (made on first use)."""
    with _contexts_lock:
        found = _contexts.get(ordinal)
        if found is None or found.closed:
            found = _contexts[ordinal] = DeviceContext(ordinal)
        return found


@atexit.register
def close_all() -> None:
    """Tear down every context this process made (their memory and modules)."""
    with _contexts_lock:
        contexts = list(_contexts.values())
        _contexts.clear()
    for ctx in contexts:
        try:
            ctx.close()
        except GpuRuntimeError:
            pass  # at exit the driver may be gone already; nothing is left to free then


class PinnedStaging:
    """One page-locked host block, grown to the largest request (`cuMemHostAlloc`), through which
    a runner's transfers go: a copy from pinned memory is a real asynchronous DMA."""

    def __init__(self):
        self.address, self.nbytes = 0, 0

    def reserve(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            self.free()
            size = max(nbytes, 4096)
            self.address = int(driver.call("cuMemHostAlloc", size, 0))
            self.nbytes = size
        return self.address

    def free(self) -> None:
        if self.address:
            driver.call("cuMemFreeHost", self.address)
            self.address, self.nbytes = 0, 0


class Copier:
    """A context's copies outside a plan's calls (the host reads a variable kept on the device,
    `device_put`, a kept result brought to the host): its own stream, an event and a pinned block,
    one copy at a time, each waited for with the deadline (`wait`)."""

    def __init__(self, ctx: DeviceContext):
        self.ctx = ctx
        ctx.activate()
        cu = driver.bindings()
        self.stream = driver.call("cuStreamCreate", cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.done = driver.call("cuEventCreate", cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.staging = PinnedStaging()
        self.lock = threading.Lock()
        self.broken: str | None = None  # a copy that did not finish: its pinned block may still be read

    def to_device(self, address: int, array: np.ndarray, what: str) -> None:
        """Copy the C-contiguous `array` to device `address`; returns once it is there."""
        self._copy(address, array, to_device=True, what=what)

    def to_host(self, address: int, array: np.ndarray, what: str) -> None:
        """Copy `array.nbytes` bytes at device `address` into the C-contiguous `array`."""
        self._copy(address, array, to_device=False, what=what)

    def _copy(self, address: int, array: np.ndarray, to_device: bool, what: str) -> None:
        if not array.nbytes:
            return
        with self.lock:
            if self.broken:
                raise GpuRuntimeError(self.broken)
            self.ctx.activate()
            cu = driver.bindings()
            pinned = self.staging.reserve(array.nbytes)
            try:
                if to_device:
                    ctypes.memmove(pinned, array.ctypes.data, array.nbytes)
                    driver.call("cuMemcpyHtoDAsync", cu.CUdeviceptr(address), pinned, array.nbytes, self.stream)
                else:
                    driver.call("cuMemcpyDtoHAsync", pinned, cu.CUdeviceptr(address), array.nbytes, self.stream)
                wait(self.done, self.stream, timeout_s(), f"copying {what} on device {self.ctx.ordinal}")
            except BaseException as error:
                self.broken = (
                    f"an earlier copy of {what} on GPU {self.ctx.ordinal} failed: {type(error).__name__}: {error}"
                )
                raise
            if not to_device:
                ctypes.memmove(array.ctypes.data, pinned, array.nbytes)

    def after_legacy_stream(self, what: str) -> None:
        """Returns once the work queued on the legacy default stream is done (another library's,
        which it ordered there for us: DLPack's `stream=1`), within the deadline."""
        with self.lock:
            self.ctx.activate()
            wait(self.done, driver.bindings().CUstream(1), timeout_s(), what)  # CU_STREAM_LEGACY

    def close(self) -> None:
        self.ctx.activate()
        self.staging.free()
        driver.call("cuEventDestroy", self.done)
        driver.call("cuStreamDestroy", self.stream)


_PARAM_CTYPES = {
    "u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "u16": ctypes.c_uint16, "u8": ctypes.c_uint8,
    "f64": ctypes.c_double, "f32": ctypes.c_float, "b16": ctypes.c_uint16,
}  # fmt: skip


class PackedLaunch:
    """One launch's kernel parameters in ctypes storage and the array of pointers to them that
    `cuLaunchKernel` takes; `fill` writes the values of one call (buffer addresses) and one loop
    iteration (loop variables)."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.values = [_PARAM_CTYPES[kind]() for kind in launch.param_kinds()]
        self.pointers = (ctypes.c_void_p * max(1, len(self.values)))(*[ctypes.addressof(v) for v in self.values])

    def fill(self, addresses: Sequence[int], loops: dict[int, int]) -> None:
        i = 0
        for arg in self.launch.args:
            if isinstance(arg, MemrefArg):
                base = addresses[arg.buffer]
                # the descriptor MLIR expands: allocated pointer, aligned pointer, offset, sizes, strides
                for value in (base, base, arg.offset.at(loops), *arg.sizes, *arg.strides):
                    self.values[i].value = value
                    i += 1
                continue
            value = arg.value.at(loops) if isinstance(arg.value, Affine) else arg.value
            self.values[i].value = value
            i += 1

    @property
    def address(self) -> int:
        return ctypes.addressof(self.pointers)


@dataclass(frozen=True)
class KernelImage:
    """One compiled kernel module: its kernel function, the `file:line`s of the ops it computes,
    its PTX, and a cubin for `cubin_chip` when ptxas made one."""

    name: str
    function: str
    members: tuple[str, ...]
    ptx: str
    cubin: bytes | None
    cubin_chip: str | None


class PlanRunner:
    """Runs one executable's plan on one device (see the module docstring)."""

    def __init__(self, plan: LaunchPlan, kernels: Sequence[KernelImage], ordinal: int):
        self.plan = plan
        self.ctx = context(ordinal)
        self.ctx.activate()
        images = {k.name: k for k in kernels}
        self.loaded: dict[str, LoadedKernel] = {}
        for launch, _ in plan.launches():
            if launch.module not in self.loaded:
                image = images.get(launch.module)
                if image is None:
                    raise GpuRuntimeError(
                        f"internal error: the plan launches kernel {launch.module}, which was not compiled"
                    )
                self.loaded[launch.module] = self.ctx.load(
                    image.name, launch.function, image.ptx, image.cubin, image.cubin_chip
                )
        self.steps = pack(plan.steps)
        # plan buffer index of each input and output (the plan is fixed: found once, not per call)
        self.inputs_at = {b.index: i for i, b in enumerate(plan.buffers) if b.kind == "input"}
        self.outputs_at = {b.index: i for i, b in enumerate(plan.buffers) if b.kind == "output"}
        cu = driver.bindings()
        self.stream = driver.call("cuStreamCreate", cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.done = driver.call("cuEventCreate", cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.staging = PinnedStaging()
        self.lock = threading.Lock()
        self.broken: str | None = None  # why this runner may not run again (a timed-out call)
        self.closed = False
        self.ctx.runners.add(self)

    def loading_report(self) -> dict[str, str]:
        """How each kernel was loaded (cubin or PTX JIT)."""
        return {name: loaded.how for name, loaded in self.loaded.items()}

    def run(self, inputs: Sequence[np.ndarray | int], outputs: Sequence[np.ndarray | None], name: str) -> list[int]:
        """Copy the host `inputs` (C-contiguous, of the plan's input types) in, replay the plan,
        copy the results into the host `outputs` (preallocated arrays). An input given as an int is
        a device address holding that input already (a variable's device copy, a kept result): it
        is read where it is, not copied. An output given as None stays on the device: its block is
        not copied back but returned (the caller owns it and gives it back to `ctx.allocator`).
        Returns the kept outputs' blocks in order."""
        with self.lock:
            if self.broken:
                raise GpuRuntimeError(self.broken)
            self.ctx.activate()
            cu = driver.bindings()
            resident = {self.inputs_at[i]: a for i, a in enumerate(inputs) if not isinstance(a, np.ndarray)}
            addresses = self._allocate(resident)
            kept = [addresses[self.outputs_at[i]] for i, o in enumerate(outputs) if o is None]
            ours = [a for i, a in enumerate(addresses) if i not in resident]  # given back after the call
            host_in = [(self.inputs_at[i], a) for i, a in enumerate(inputs) if isinstance(a, np.ndarray) and a.nbytes]
            host_out = [(self.outputs_at[i], o) for i, o in enumerate(outputs) if o is not None and o.nbytes]
            finished = False
            try:
                total = sum(a.nbytes for _, a in host_in) + sum(o.nbytes for _, o in host_out)
                at = self.staging.reserve(total)
                for buffer, array in host_in:
                    ctypes.memmove(at, array.ctypes.data, array.nbytes)
                    driver.call("cuMemcpyHtoDAsync", cu.CUdeviceptr(addresses[buffer]), at, array.nbytes, self.stream)
                    at += array.nbytes
                replay(self.steps, addresses, self._launch)
                out_at = at
                for buffer, array in host_out:
                    driver.call("cuMemcpyDtoHAsync", out_at, cu.CUdeviceptr(addresses[buffer]), array.nbytes,
                                self.stream)  # fmt: skip
                    out_at += array.nbytes
                wait(self.done, self.stream, timeout_s(), f"'{name}' on {self.ctx.chip} device {self.ctx.ordinal}")
                finished = True
                for _, array in host_out:
                    ctypes.memmove(array.ctypes.data, at, array.nbytes)
                    at += array.nbytes
            except BaseException as error:  # an interrupt during the wait too
                kept = []  # nobody takes them: the kept outputs go back with the others
                if not finished:
                    # The stream may still be using the buffers: they are not handed out again
                    # (freed with the context), and this runner refuses later calls.
                    self.broken = (
                        f"an earlier call of '{name}' on the GPU failed, so this executable cannot run again: "
                        f"{type(error).__name__}: {error}"
                    )
                    ours = []
                raise
            finally:
                for address in ours:
                    if address not in kept:
                        self.ctx.allocator.release(address)
            return kept

    def _allocate(self, given: dict[int, int]) -> list[int]:
        """A device block for every buffer of the plan but those `given` (buffer index -> the
        device address to use); none kept when one cannot be had."""
        addresses: list[int] = []
        try:
            for i, buffer in enumerate(self.plan.buffers):
                addresses.append(given[i] if i in given else self.ctx.allocator.allocate(buffer.nbytes))
        except GpuRuntimeError:
            for i, address in enumerate(addresses):  # nothing was queued on them yet
                if i not in given:
                    self.ctx.allocator.release(address)
            raise
        return addresses

    def _launch(self, packed: PackedLaunch) -> None:
        launch = packed.launch
        driver.call(
            "cuLaunchKernel", self.loaded[launch.module].function, *launch.grid, *launch.block,
            launch.shared_bytes, self.stream, packed.address, 0,
        )  # fmt: skip

    def close(self) -> None:
        """Free the stream, the event and the staging block (the context keeps the modules)."""
        if self.closed or self.ctx.closed:
            return
        self.closed = True
        self.broken = "its GPU resources were released"
        self.ctx.activate()
        self.staging.free()
        driver.call("cuEventDestroy", self.done)
        driver.call("cuStreamDestroy", self.stream)


def replay(steps, addresses: Sequence[int], launch: Callable[[PackedLaunch], None], loops=None) -> None:
    """Every launch of packed `steps` (`pack`) in order, loops run, each launch's parameters filled
    for buffer `addresses` and the loop variables' values, then handed to `launch`."""
    loops = loops or {}
    for step in steps:
        if isinstance(step, tuple):  # (Loop, its packed body)
            loop, body = step
            for i in range(loop.start, loop.stop, loop.step):
                replay(body, addresses, launch, {**loops, loop.var: i})
            continue
        step.fill(addresses, loops)
        launch(step)


def pack(steps) -> list:
    """The plan's steps with each launch's parameters in ctypes storage (`PackedLaunch`) and each
    loop as (Loop, its packed body)."""
    packed = []
    for step in steps:
        if isinstance(step, Loop):
            packed.append((step, pack(step.body)))
        else:
            packed.append(PackedLaunch(step))
    return packed


def wait(event, stream, seconds: float, what: str) -> None:
    """Record `event` on `stream` and poll it until the stream's work is done, at most `seconds`:
    a GpuRuntimeError names `what` when the deadline passes (the work may still be running)."""
    driver.call("cuEventRecord", event, stream)
    start = time.monotonic()
    deadline, spin_until = start + seconds, start + SPIN_S
    pause = 20e-6
    while not driver.query("cuEventQuery", event):
        now = time.monotonic()
        if now < spin_until:  # short work: poll without sleeping (sleep(20e-6) took 94 us on a 2-core VM)
            continue
        if now > deadline:
            raise GpuRuntimeError(
                f"the GPU did not finish {what} within {seconds:g} s (FLOWJIT_GPU_TIMEOUT_S sets the limit); "
                "its work may still be running"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
