"""Writing a failing program out as a permanent regression test (text IR + standalone Python)."""

from __future__ import annotations

import hashlib
import os

import flowjit as fj
from fuzz.oracles import _flowjit_function
from fuzz.program import Program

REGRESSIONS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "regressions")


def traced_ir(program: Program) -> str | None:
    """The program's traced IR, or None when tracing itself fails (that is then the bug)."""
    try:
        fn, _ = _flowjit_function(program.flowjit_source(), program.variables)
        return fj.jit(fn).lower(*program.inputs.values()).as_text("traced")
    except Exception:
        return None


def write_reproducer(program: Program, title: str, where: str, directory: str = REGRESSIONS_DIR) -> str:
    """Write `<where>_<hash>.py` (and `.fj`, the traced IR) under `directory`; returns the .py path."""
    digest = hashlib.sha256(program.flowjit_source().encode()).hexdigest()[:10]
    stem = os.path.join(directory, f"{where.replace(':', '_').replace('-', '_')}_{digest}")
    ir_text = traced_ir(program)
    os.makedirs(directory, exist_ok=True)
    with open(stem + ".py", "w", encoding="utf-8") as f:
        f.write(program.reproducer(title, ir_text))
    if ir_text is not None:
        with open(stem + ".fj", "w", encoding="utf-8") as f:
            f.write(ir_text if ir_text.endswith("\n") else ir_text + "\n")
    return stem + ".py"
