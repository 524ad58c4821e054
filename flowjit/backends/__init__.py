"""Backends turn an optimized graph into an `Executable` for one kind of device.

    base.py          Executable and Backend: what every backend provides
    registry.py      which backend serves which target name and device type; compile_graph
    interpreter.py   the reference interpreter as a backend (the oracle)
    cpu/             MLIR -> LLVM -> native code for the host CPU

The names below are re-exported for callers above this layer; modules inside `backends/` import
the submodules themselves.
"""

from flowjit.backends.base import Backend, Executable
from flowjit.backends.registry import (
    BACKENDS,
    backend_for,
    backend_for_device,
    checked_target,
    compile_graph,
    default_target,
    get_backend,
    register_backend,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "Executable",
    "backend_for",
    "backend_for_device",
    "checked_target",
    "compile_graph",
    "default_target",
    "get_backend",
    "register_backend",
]
