"""What generated CPU code depends on beyond the program.

`backend_fingerprint` (flowjit, MLIR and LLVM versions, the source of the CPU backend and of the
shared MLIR layer it builds on, the host CPU and its core count) is part of every compile-cache key
and of the precompiled libraries' file names, so a change to any of them never serves stale code.
"""

from __future__ import annotations

import functools
import json
import os

from flowjit.backends import cache_folder
from flowjit.backends.cpu import host, toolchain
from flowjit.version import __version__

# The folders whose Python source generates the code: this backend and the shared MLIR layer.
_SOURCE_FOLDERS = ("cpu", "mlir")


@functools.cache
def backend_fingerprint() -> str:
    """Versions, host and the backends' source: anything that changes generated code."""
    cpu = host.host_cpu()
    parts = {
        "flowjit": __version__,
        **toolchain.versions(),
        "backend-source": cache_folder.source_digest(_SOURCE_FOLDERS),
        "cpu": f"{cpu.triple} {cpu.name} {cpu.features}",
        "cores": os.cpu_count(),
    }
    return json.dumps(parts, sort_keys=True)
