"""The devices this process has, and the `with fj.device(...)` scope.

Local devices live in `/job:localhost/task:0`. The host shows `FLOWJIT_CPU_DEVICES=N` CPU devices
(default 1), so partitioned execution is testable on one machine; other device types come from
providers (`register_device_provider`). GPUs are such a provider: `gpu:N` for each CUDA device the
driver shows, asked once per process on the first `devices()` call (`cuda-bindings` is imported
then, never on `import flowjit`; without it, a driver or a device there are none). Names and their
parsing are the IR's (`flowjit.ir.devices`), re-exported here.

    fj.devices()                     # [Device('/job:localhost/task:0/device:cpu:0'), ...]
    with fj.device("cpu:1"): ...     # ops traced inside are constrained to cpu:1
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from flowjit.errors import FlowjitValueError
from flowjit.ir.devices import DEVICE_TYPES, LOCAL_JOB, Device, DeviceSpec, register_device_type, unregister_device_type
from flowjit.ir.devices import resolve as resolve_among

__all__ = [
    "LOCAL_JOB",
    "Device",
    "DeviceSpec",
    "current_device_spec",
    "device",
    "devices",
    "placement_devices",
    "variable_device",
    "variable_placement",
    "register_task_devices",
    "resolve",
]

# device type -> a function returning how many devices of that type this process has
_providers: dict[str, Callable[[], int]] = {}
# functions returning the devices of other tasks (processes) a running cluster offers to placement
_task_devices: list[Callable[[], list[Device]]] = []


def cpu_device_count() -> int:
    raw = os.environ.get("FLOWJIT_CPU_DEVICES", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise FlowjitValueError(f"FLOWJIT_CPU_DEVICES must be a positive integer; found {raw!r}")
    return int(raw)


def register_device_provider(device_type: str, count: Callable[[], int]) -> Callable[[], None]:
    """Make `count()` devices of `device_type` local devices (asked on every `devices()` call, so
    the count may follow the environment). Returns a function that removes the provider again (and
    the device type, if this call registered it)."""
    if device_type == "cpu":
        raise FlowjitValueError("CPU devices are counted by FLOWJIT_CPU_DEVICES; register another device type")
    new_type = device_type not in DEVICE_TYPES
    register_device_type(device_type)
    _providers[device_type] = count

    def unregister() -> None:
        if _providers.get(device_type) is count:
            del _providers[device_type]
            if new_type:
                unregister_device_type(device_type)

    return unregister


def devices(device_type: str | None = None) -> list[Device]:
    """The devices of this process (`/job:localhost/task:0`), optionally of one type: the CPUs
    first, then each registered type's in registration order."""
    counts = {"cpu": cpu_device_count(), **{t: count() for t, count in _providers.items()}}
    found = [Device(DeviceSpec(LOCAL_JOB, 0, t, i)) for t, n in counts.items() for i in range(n)]
    return [d for d in found if device_type is None or d.device_type == device_type]


def register_task_devices(provider: Callable[[], list[Device]]) -> Callable[[], None]:
    """Offer the devices `provider()` returns (those of other tasks: a cluster's) to placement,
    beside the local ones, until the returned function is called."""
    _task_devices.append(provider)

    def unregister() -> None:
        if provider in _task_devices:
            _task_devices.remove(provider)

    return unregister


def placement_devices() -> list[Device]:
    """The devices placement may use: this process's own, then those of the tasks of running
    clusters (`flowjit.distributed.Cluster`)."""
    found = devices()
    for provider in list(_task_devices):
        found += [d for d in provider() if d not in found]
    return found


def resolve(spec: str | DeviceSpec, candidates: list[Device] | None = None) -> list[Device]:
    """The devices matching `spec`, in order (among the local devices unless `candidates`)."""
    return resolve_among(spec, candidates if candidates is not None else devices())


# --- `with fj.device(spec):` ----------------------------------------------------------------------------

_scope = threading.local()


def current_device_spec() -> DeviceSpec | None:
    """The merged constraint of the enclosing `fj.device` scopes on this thread, if any."""
    stack = getattr(_scope, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def device(spec):
    """Constrain ops traced inside the block to devices matching `spec` (full or partial)."""
    parsed = DeviceSpec.parse(spec)
    stack = getattr(_scope, "stack", None)
    if stack is None:
        stack = _scope.stack = []
    stack.append(stack[-1].merged_with(parsed) if stack else parsed)
    try:
        yield parsed
    finally:
        stack.pop()


# --- where new Variables go when nothing says (`with cluster.shard_variables():`) -----------------


@contextlib.contextmanager
def variable_placement(placer: Callable[[int], str]):
    """Inside the block, a Variable created without a device (and outside any `fj.device` scope)
    goes to the device `placer(nbytes)` names: TensorFlow's `replica_device_setter`."""
    stack = getattr(_scope, "placers", None)
    if stack is None:
        stack = _scope.placers = []
    stack.append(placer)
    try:
        yield
    finally:
        stack.pop()


def variable_device(nbytes: int) -> str | None:
    """The device the innermost `variable_placement` picks for a new variable of `nbytes`, if any."""
    stack = getattr(_scope, "placers", None)
    return stack[-1](nbytes) if stack else None


def _gpu_count() -> int:
    """The CUDA devices this process can use (0 without cuda-bindings, a driver or a device)."""
    from flowjit.backends.gpu.driver import local_gpu_count

    return local_gpu_count()


register_device_provider("gpu", _gpu_count)
