"""User-facing tracebacks: flowjit errors leave the API (`jit`, `Lowered`, `Compiled`) with the
compiler's own frames hidden, so the user's lines are what they see (`FLOWJIT_FULL_TRACEBACK=1`
keeps them)."""

from __future__ import annotations

import functools
import os
import types

from flowjit.errors import FlowjitError
from flowjit.ir.location import is_internal_file


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without flowjit's own frames, so the user's lines are what they see."""
    frames = []
    while tb is not None:
        if not is_internal_file(tb.tb_frame.f_code.co_filename):
            frames.append(tb)
        tb = tb.tb_next
    new = None
    for t in reversed(frames):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new


def user_errors(fn):
    """Decorator: FlowjitErrors leave with compiler frames hidden from the traceback
    (`FLOWJIT_FULL_TRACEBACK=1` keeps them)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlowjitError as e:
            if os.environ.get("FLOWJIT_FULL_TRACEBACK"):
                raise
            # Keep an explicit cause (a toolchain's diagnostics), drop the implicit context.
            raise e.with_traceback(_user_traceback(e.__traceback__)) from e.__cause__

    return wrapper
