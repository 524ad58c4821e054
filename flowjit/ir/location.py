"""Source locations: the user's `file:line` that created an op, captured while tracing."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class Location:
    """Where an op came from in the user's program. `UNKNOWN` when built by a pass or parsed bare."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.file else "<unknown>"


UNKNOWN = Location("", 0)


def _display_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def is_internal_file(filename: str) -> bool:
    """True for files inside the flowjit package (compiler frames hidden from users)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def user_location(skip_internal: bool = True) -> Location:
    """The innermost stack frame outside the flowjit package: the user's line being traced."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (skip_internal and is_internal_file(filename)) and not filename.startswith("<frozen"):
            return Location(_display_path(filename), frame.f_lineno)
        frame = frame.f_back
    return UNKNOWN
