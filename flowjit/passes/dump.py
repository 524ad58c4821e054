"""`FLOWJIT_DUMP_DIR=DIR`: every compilation stage (IR after each pass, MLIR, LLVM IR, asm) is
written to DIR as `NNNN-<function>-<stage>.<ext>`, numbered in the order produced, each headed by
the stage and the function's name. `FLOWJIT_VERIFY=1` runs the verifier after every pass."""

from __future__ import annotations

import itertools
import os
import threading

_counter = itertools.count()
_lock = threading.Lock()
_local = threading.local()

_EXTENSIONS = {"mlir": "mlir", "mlir-llvm": "mlir", "llvm": "ll", "asm": "s", "ptx": "ptx"}
_COMMENT = {"ll": ";", "s": "#", "ptx": "//"}


def verify_enabled() -> bool:
    return os.environ.get("FLOWJIT_VERIFY", "") not in ("", "0")


def dump_dir() -> str | None:
    if getattr(_local, "quiet", False):
        return None
    return os.environ.get("FLOWJIT_DUMP_DIR") or None


class quiet:
    """Context manager: nothing is dumped on this thread inside (graphs the compiler traces for its
    own use, e.g. the CPU row library's references, are not the user's stages)."""

    def __enter__(self):
        self.before = getattr(_local, "quiet", False)
        _local.quiet = True

    def __exit__(self, *exc):
        _local.quiet = self.before


def write_stage(function: str, stage: str, text: str) -> str | None:
    """Write one stage's text if dumping is on; returns the path written."""
    directory = dump_dir()
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    ext = _EXTENSIONS.get(stage, "fj")
    comment = _COMMENT.get(ext, "//")
    with _lock:
        n = next(_counter)
    safe = "".join(c if c.isalnum() or c in "_-." else "_" for c in function)
    path = os.path.join(directory, f"{n:04d}-{safe}-{stage}.{ext}")
    with open(path, "w") as f:
        f.write(f"{comment} flowjit stage '{stage}' of function '{function}'\n{text}")
    return path
