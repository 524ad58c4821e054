"""The on-disk compile cache for GPU code, in the folder every backend uses (`cache_folder`): a
process running a program compiled before (here, or on a build machine whose cache folder was
copied over) loads the launch plan and the kernels instead of running MLIR; it never imports
`mlir`.

- Key: sha256 of the optimized IR text, the `GpuOptions`, and `fingerprint()`: the flowjit
  version, the source of the GPU backend and of the shared MLIR layer, and, named explicitly, the
  machine-dependent parts: the GPU arch (`gpu-arch`, the chip the PTX and cubins are for) and the
  CPU target of the host side. A GPU function's host side is the launch plan, plain data that
  Python replays, so it fits every CPU (`cpu-target: any`); a CPU partition of the same program
  has its own entry keyed on the host CPU (`cpu/cache.py`). So a copied cache is found on a machine
  that needs the same chip, and never for another chip.
- What the key cannot hold, because the running machine need not have it: the MLIR version that
  generated the code and the ptxas that assembled the cubins. The entry records both; a machine
  that has MLIR installed treats an entry made by another MLIR version as missing and recompiles
  (`load`); a machine without MLIR (a GPU machine) uses it.
- Entry file `<key>.fjg`: magic, header length + JSON header (function, inputs, outputs, the
  launch plan, the stage texts, the toolchain, each kernel's name, PTX and cubin lengths), the
  kernels' PTX and cubins, then the sha256 of everything before it. A truncated or damaged entry is
  deleted and rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from flowjit.backends import cache_folder
from flowjit.backends.gpu.plan import LaunchPlan
from flowjit.backends.gpu.runtime import KernelImage
from flowjit.backends.mlir.pipeline import mlir_distribution
from flowjit.version import __version__

MAGIC = b"FLOWJIT-GPU-ENTRY-1\n"
# The folders whose Python source generates the code: this backend and the shared MLIR layer.
_SOURCE_FOLDERS = ("gpu", "mlir")


@dataclass(frozen=True)
class Entry:
    """What a compiled GPU function needs to run, and its stage texts."""

    function: str
    chip: str
    inputs: tuple[tuple[tuple[int, ...], str], ...]  # (shape, flowjit dtype name) of each input
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    plan: LaunchPlan
    kernels: tuple[KernelImage, ...]
    stages: dict[str, str]
    toolchain: dict[str, str | None]  # 'mlir': the bindings' distribution, 'ptxas': its version or None


def fingerprint(chip: str) -> str:
    """Everything besides the program and the options that the cached code depends on and that
    every machine using it can know (see the module docstring)."""
    parts = {
        "flowjit": __version__,
        "backend-source": cache_folder.source_digest(_SOURCE_FOLDERS),
        "gpu-arch": chip,
        "cpu-target": "any",
    }
    return json.dumps(parts, sort_keys=True)


def cache_key(graph_text: str, options) -> str:
    digest = hashlib.sha256()
    for part in (graph_text, repr(options), fingerprint(options.chip)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def mlir_version() -> str | None:
    """The installed MLIR bindings (`mlir_pipeline.mlir_distribution`), None without them."""
    return mlir_distribution()


def entry_path(key: str) -> str:
    return os.path.join(cache_folder.location(), f"{key}.fjg")


def encode(entry: Entry) -> bytes:
    header = {
        "function": entry.function,
        "chip": entry.chip,
        "inputs": [[list(shape), dtype] for shape, dtype in entry.inputs],
        "outputs": [[list(shape), dtype] for shape, dtype in entry.outputs],
        "plan": entry.plan.to_json(),
        "stages": entry.stages,
        "toolchain": entry.toolchain,
        "kernels": [
            [
                k.name,
                k.function,
                list(k.members),
                len(k.ptx.encode()),
                None if k.cubin is None else len(k.cubin),
                k.cubin_chip,
            ]
            for k in entry.kernels
        ],
    }
    payload = b"".join(k.ptx.encode() + (k.cubin or b"") for k in entry.kernels)
    return cache_folder.pack_entry(MAGIC, header, payload)


def decode(data: bytes) -> Entry | None:
    """The entry in `data`, or None when it is not a complete, intact entry of this format."""
    unpacked = cache_folder.unpack_entry(MAGIC, data)
    if unpacked is None:
        return None
    header, body = unpacked
    pos = 0
    kernels = []
    for name, function, members, ptx_len, cubin_len, cubin_chip in header["kernels"]:
        ptx = body[pos : pos + ptx_len].decode()
        pos += ptx_len
        cubin = None
        if cubin_len is not None:
            cubin = bytes(body[pos : pos + cubin_len])
            pos += cubin_len
        kernels.append(KernelImage(name, function, tuple(members), ptx, cubin, cubin_chip))
    if pos != len(body):
        return None
    return Entry(
        header["function"],
        header["chip"],
        tuple((tuple(shape), dtype) for shape, dtype in header["inputs"]),
        tuple((tuple(shape), dtype) for shape, dtype in header["outputs"]),
        LaunchPlan.from_json(header["plan"]),
        tuple(kernels),
        dict(header["stages"]),
        dict(header["toolchain"]),
    )


def load(key: str) -> Entry | None:
    """The cached entry for `key`, or None: none, refused (`cache_folder.read`), damaged (then
    deleted), or made by another MLIR version than the one installed here."""
    if not cache_folder.enabled():
        return None
    entry = cache_folder.read_entry(entry_path(key), decode)
    if entry is None:
        return None
    installed = mlir_version()
    if installed is not None and entry.toolchain.get("mlir") != installed:
        return None  # compiled by another MLIR: this machine can compile it again, and does
    return entry


def store(key: str, entry: Entry) -> None:
    """Write the entry atomically, unless the cache is off or refused; a cache that cannot be
    written is skipped (the code is already compiled in this process)."""
    try:
        cache_folder.write(entry_path(key), encode(entry))
    except OSError:
        return
