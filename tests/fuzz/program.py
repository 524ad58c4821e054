"""A fuzz program: inputs, variables and straight-line statements, each rendered twice.

Every statement has a flowjit rendering (public API: `M` is `flowjit.numpy`, `FJ` is `flowjit`,
`nn` is `flowjit.nn`) and an independent numpy rendering that computes floats in float64 and casts
to flowjit's result dtype at the end. The same `Program` therefore gives

    flowjit_source()  -> `def program(x0, ...)` traced by `fj.jit` (interpreter and CPU backend)
    numpy_source()    -> the same computation in plain numpy (the third oracle)
    reproducer()      -> a standalone Python file that rebuilds the inputs and checks all three

Programs are plain data (strings, arrays), so hypothesis can shrink them and a failing one can be
written out as a permanent regression test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from flowjit.ir import dtypes as dt


@dataclass(frozen=True)
class Stmt:
    """`name = expr` (or a bare expression when `name` is None, e.g. a variable update)."""

    name: str | None
    fj: str
    np: str


@dataclass
class Program:
    """A generated program with its concrete inputs and the initial values of its variables."""

    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    variables: dict[str, np.ndarray] = field(default_factory=dict)
    stmts: list[Stmt] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        # What hypothesis prints for a falsifying example: the program as the user would write it.
        shapes = ", ".join(f"{n}: {dtype_name(a)}{list(a.shape)}" for n, a in self.inputs.items())
        return f"Program({shapes})\n{self.flowjit_source()}"

    def _source(self, which: str) -> str:
        lines = [f"def program({', '.join(self.inputs)}):"]
        for s in self.stmts:
            expr = s.fj if which == "fj" else s.np
            lines.append(f"    {s.name} = {expr}" if s.name else f"    {expr}")
        lines.append(f"    return ({''.join(o + ', ' for o in self.outputs)})")
        return "\n".join(lines) + "\n"

    def flowjit_source(self) -> str:
        return self._source("fj")

    def numpy_source(self) -> str:
        return self._source("np")

    def reproducer(self, title: str, ir_text: str | None = None) -> str:
        """A standalone Python file: inputs as literals, both renderings, and `check()` comparing
        numpy, the interpreter and the CPU backend (`python FILE` runs it)."""
        inputs = "\n".join(f"    {n!r}: {array_literal(a)}," for n, a in self.inputs.items())
        variables = "\n".join(f"    {n!r}: {array_literal(a)}," for n, a in self.variables.items())
        body = [
            f'"""Fuzzer regression: {title}',
            "",
            "Written by tests/fuzz (see docs/fuzzing.md); run by tests/test_fuzz.py forever after.",
            '"""',
            "",
            "import os",
            "import sys",
            "",
            "import ml_dtypes  # noqa: F401  (bfloat16 literals)",
            "import numpy as np",
            "",
            "# tests/ (where the `fuzz` package lives): two levels up, or FLOWJIT_TESTS_DIR for a copy elsewhere",
            "TESTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')",
            "sys.path.insert(0, os.environ.get('FLOWJIT_TESTS_DIR', TESTS_DIR))",
            "from fuzz.oracles import check_sources  # noqa: E402",
            "",
            f"INPUTS = {{\n{inputs}\n}}" if inputs else "INPUTS = {}",
            f"VARIABLES = {{\n{variables}\n}}" if variables else "VARIABLES = {}",
            f"FLOWJIT_SOURCE = '''\n{self.flowjit_source()}'''",
            f"NUMPY_SOURCE = '''\n{self.numpy_source()}'''",
        ]
        if ir_text is not None:
            body.append(f"TRACED_IR = '''\n{ir_text.rstrip()}\n'''")
        body += [
            "",
            "",
            "def check():",
            '    """Raise `Mismatch` (naming the oracle, output and pass) if any two oracles disagree."""',
            "    check_sources(FLOWJIT_SOURCE, NUMPY_SOURCE, INPUTS, VARIABLES)",
            "",
            "",
            'if __name__ == "__main__":',
            "    check()",
            '    print("all oracles agree")',
        ]
        return "\n".join(body) + "\n"


def dtype_name(array: np.ndarray) -> str:
    return dt.dtype(array.dtype).name


def _float_literal(x: float) -> str:
    if math.isnan(x):
        return "np.nan"
    if math.isinf(x):
        return "np.inf" if x > 0 else "-np.inf"
    return repr(float(x))


def array_literal(a: np.ndarray) -> str:
    """Python source that rebuilds `a` exactly (bfloat16 included)."""
    np_name = "ml_dtypes.bfloat16" if a.dtype == ml_dtypes.bfloat16 else f"np.{a.dtype.name}"
    flat = a.reshape(-1)
    if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
        items = ", ".join(_float_literal(float(x)) for x in flat.astype(np.float64))
    elif a.dtype == np.bool_:
        items = ", ".join(str(bool(x)) for x in flat)
    else:
        items = ", ".join(str(int(x)) for x in flat)
    return f"np.array([{items}], dtype={np_name}).reshape({tuple(a.shape)!r})"
