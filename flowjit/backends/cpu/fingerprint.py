"""What generated CPU code depends on beyond the program, and the seal on files of it.

`backend_fingerprint` (flowjit, MLIR and LLVM versions, the source of the CPU backend and of the
shared MLIR layer it builds on, the host CPU and its core count) is part of every compile-cache key
and of the precompiled libraries' file names, so a change to any of them never serves stale code.
`sealed`/`unsealed` append and check a sha256, so a truncated or damaged file is rebuilt, never
loaded (`cache_folder` decides whether a file may be trusted at all).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

from flowjit.backends import cache_folder
from flowjit.backends.cpu import host, toolchain
from flowjit.version import __version__

_DIGEST = 32
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


def sealed(body: bytes) -> bytes:
    """`body` followed by its sha256 (`unsealed` checks it)."""
    return body + hashlib.sha256(body).digest()


def unsealed(data: bytes) -> bytes | None:
    """The body of `sealed` data, or None when the data is truncated or damaged."""
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    return body if len(data) > _DIGEST and hashlib.sha256(body).digest() == digest else None
