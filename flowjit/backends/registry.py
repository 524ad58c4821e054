"""Which backend serves which target name and device type.

    BACKENDS            target name -> Backend ('cpu', 'interpreter', 'cuda' and 'cuda-<chip>'
                        (PTX run through the CUDA driver), and any registered one)
    DEVICE_BACKENDS     device type -> target name ('cpu' -> 'cpu', 'gpu' -> 'cuda')

`fj.jit(f, target=...)` names a backend for every partition, or, as a mapping {device type: target
name}, for the partitions of those device types (`{"cpu": "interpreter"}`: CPU partitions run on
the reference interpreter, GPU ones are compiled as usual); by default each partition is compiled by
the backend of its device's type (`backend_for_device`, `backend_for`). A new backend registers itself with the
device types it serves; a new device type must also be known to device names
(`flowjit.ir.devices.register_device_type`) and have local devices (`runtime.devices`).
"""

from __future__ import annotations

from flowjit.backends.base import Backend, Executable
from flowjit.backends.cpu.backend import CpuBackend
from flowjit.backends.gpu import backend as gpu_backend
from flowjit.backends.interpreter import InterpreterBackend
from flowjit.errors import FlowjitValueError
from flowjit.ir.devices import DeviceSpec, register_device_type
from flowjit.ir.graph import Graph

BACKENDS: dict[str, Backend] = {"interpreter": InterpreterBackend(), "cpu": CpuBackend(), **gpu_backend.BACKENDS}
DEVICE_BACKENDS: dict[str, str] = {"cpu": "cpu", "gpu": "cuda"}


def register_backend(backend: Backend, device_types: tuple[str, ...] = ()) -> None:
    """Make `backend` a target (`fj.jit(f, target=backend.name)`) and the compiler of the devices
    of `device_types` (registered as device types if new). Registering a name again replaces it."""
    if not backend.name:
        raise FlowjitValueError("a backend needs a name")
    BACKENDS[backend.name] = backend
    for device_type in device_types:
        register_device_type(device_type)
        DEVICE_BACKENDS[device_type] = backend.name


def unregister_backend(name: str) -> None:
    """Remove a registered backend and the device types it served (the built-in ones stay)."""
    if name in ("cpu", "interpreter") or name in gpu_backend.BACKENDS:
        raise FlowjitValueError(f"the built-in backend '{name}' cannot be removed")
    BACKENDS.pop(name, None)
    for device_type in [t for t, n in DEVICE_BACKENDS.items() if n == name]:
        del DEVICE_BACKENDS[device_type]


def get_backend(target: str) -> Backend:
    """The backend registered as `target`."""
    backend = BACKENDS.get(target)
    if backend is None:
        raise FlowjitValueError(f"unknown target '{target}'; available: {', '.join(sorted(BACKENDS))}")
    return backend


def backend_for_device(device: str) -> Backend:
    """The backend that compiles for `device` (a device name): the one registered for its type."""
    device_type = DeviceSpec.parse(device).device_type
    name = DEVICE_BACKENDS.get(device_type)
    if name is None:
        raise FlowjitValueError(
            f"no backend compiles for device '{device}' (type '{device_type}'); backends serve "
            f"{', '.join(f'{t} ({n})' for t, n in sorted(DEVICE_BACKENDS.items()))}"
        )
    return BACKENDS[name]


def checked_target(target) -> str | tuple[tuple[str, str], ...] | None:
    """`fj.jit`'s `target`, checked: None, a target name, or a mapping {device type: target name},
    returned as sorted (device type, name) pairs (hashable: jit caches are keyed on it)."""
    if target is None:
        return None
    if isinstance(target, str):
        get_backend(target)
        return target
    if isinstance(target, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in target):
        target = dict(target)
    if not isinstance(target, dict):
        raise FlowjitValueError(
            f"target: expected a target name ({', '.join(sorted(BACKENDS))}) or a mapping "
            f"{{device type: target name}}; found {type(target).__name__}"
        )
    for device_type, name in target.items():
        if device_type not in DEVICE_BACKENDS:
            raise FlowjitValueError(
                f"target: no device type '{device_type}'; device types: {', '.join(sorted(DEVICE_BACKENDS))}"
            )
        if not isinstance(name, str):
            raise FlowjitValueError(f"target: the backend of '{device_type}' must be a target name; found {name!r}")
        get_backend(name)
    return tuple(sorted(target.items()))


def backend_for(device: str | None, target) -> Backend:
    """The backend that compiles a partition on `device` (None: a function placed on no device)
    under a checked `target` (`checked_target`): the one it names, the one it maps the device's
    type to, or else the device type's own."""
    if isinstance(target, str):
        return get_backend(target)
    by_type = dict(target or ())
    if device is None:
        return get_backend(by_type.get("cpu", default_target()))
    name = by_type.get(DeviceSpec.parse(device).device_type)
    return get_backend(name) if name is not None else backend_for_device(device)


def compile_graph(graph: Graph, target: str = "cpu", options=None, aliases: dict[int, int] | None = None) -> Executable:
    """Compile `graph` with the backend registered as `target` ('cpu', 'interpreter', ...). `aliases`
    (output index -> input index of the same type) are the outputs callers may have written into
    donated inputs' buffers; the executable's `aliases` says which ones the backend honors."""
    return get_backend(target).compile(graph, None, options, dict(aliases or {}))


def default_target() -> str:
    return "cpu" if "cpu" in BACKENDS else "interpreter"
