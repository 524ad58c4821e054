"""The on-disk compile cache for CPU code: a second process running the same program loads object
code instead of running MLIR and LLVM (it never imports `mlir`).

- Location, switch and trust: `backends/cache_folder.py` (`$FLOWJIT_CACHE_DIR`, else
  `~/.cache/flowjit`; `FLOWJIT_CACHE=0` disables it: no entry read or written). An entry, or the
  folder holding it, that another user owns or could have written is refused with a warning and
  never loaded: the function is compiled instead.
- Key: sha256 of the optimized IR text, the compile options, the flowjit, MLIR and LLVM versions,
  the CPU backend's own source, the host CPU (name, features) and its core count.
- Entry file `<key>.fjo`: magic, header length + JSON header (entry symbol, workspace size, I/O
  layout, the length of each object), payload length + the objects (one per part the function was
  compiled in, `parallel_codegen`), then the sha256 of everything before it. A file that is
  truncated, corrupt or of another format is deleted and rebuilt, never loaded.
- Writes go to a unique temporary file in the same folder, then `os.replace` (`cache_folder.write`):
  readers see the old entry or the new one, and concurrent writers of one key never interleave.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from flowjit.backends import cache_folder
from flowjit.backends.cpu.executable import Buffer, Layout
from flowjit.backends.cpu.fingerprint import backend_fingerprint

MAGIC = b"FLOWJIT-CPU-OBJECT-2\n"


@dataclass(frozen=True)
class Entry:
    """What a cached function needs to run: object code (one object per part) and its calling layout."""

    objects: tuple[bytes, ...]
    symbol: str
    workspace_bytes: int
    inputs: Layout
    outputs: Layout
    streamed_outputs: tuple[int, ...] = ()  # written with non-temporal stores: allocated on a line


def cache_key(graph_text: str, options) -> str:
    """sha256 of the optimized IR, the options and everything else that changes the code (the
    precompiled libraries it may call included)."""
    from flowjit.backends.cpu import libraries

    digest = hashlib.sha256()
    for part in (graph_text, repr(options), backend_fingerprint(), libraries.state()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def entry_path(key: str) -> str:
    """Where the entry for `key` lives."""
    return os.path.join(cache_folder.location(), f"{key}.fjo")


def encode(entry: Entry) -> bytes:
    """The file contents for `entry`: magic, header, object code, checksum (`cache_folder.pack_entry`)."""
    header = {
        "symbol": entry.symbol,
        "workspace_bytes": entry.workspace_bytes,
        "inputs": [[list(b.shape), b.dtype] for b in entry.inputs],
        "outputs": [[list(b.shape), b.dtype] for b in entry.outputs],
        "objects": [len(o) for o in entry.objects],
        "streamed_outputs": list(entry.streamed_outputs),
    }
    return cache_folder.pack_entry(MAGIC, header, b"".join(entry.objects))


def decode(data: bytes) -> Entry | None:
    """The entry in `data`, or None when it is not a complete, intact entry."""
    unpacked = cache_folder.unpack_entry(MAGIC, data)
    if unpacked is None:
        return None
    header, payload = unpacked

    def layout(items) -> Layout:
        return Layout(Buffer(tuple(shape), dtype) for shape, dtype in items)

    sizes = header.get("objects")
    if not isinstance(sizes, list) or sum(sizes) != len(payload):
        return None
    objects, start = [], 0
    for size in sizes:
        objects.append(payload[start : start + size])
        start += size
    streamed = tuple(header.get("streamed_outputs", ()))
    inputs, outputs = layout(header["inputs"]), layout(header["outputs"])
    return Entry(tuple(objects), header["symbol"], header["workspace_bytes"], inputs, outputs, streamed)


def load(key: str) -> Entry | None:
    """The cached entry for `key`; a damaged entry is deleted (and None returned), one that may not
    be trusted is refused (`cache_folder.read`)."""
    if not cache_folder.enabled():
        return None
    return cache_folder.read_entry(entry_path(key), decode)


def store(key: str, entry: Entry) -> None:
    """Write the entry atomically, unless the cache is off or refused (`cache_folder.write`); a
    cache that cannot be written is skipped silently (the code is already compiled in this
    process)."""
    if not entry.objects:
        return
    try:
        cache_folder.write(entry_path(key), encode(entry))
    except OSError:
        return
