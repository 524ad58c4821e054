"""The C interface every ahead-of-time library shares, whatever its target (`cpu/aot_c.py`,
`gpu/aot_c.py`): the C types of flowjit's dtypes, the status codes, how buffers are named, and
the per-buffer size macros of the header. One enum for all targets, so that headers of several
flowjit libraries can be included in one program (the enum is guarded)."""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

from flowjit.ir import dtypes as dt

C_TYPES = {
    "f32": "float",
    "f64": "double",
    "i32": "int32_t",
    "i64": "int64_t",
    "bool": "uint8_t",  # one byte per element, 0 or 1 (numpy's bool)
    "f16": "uint16_t",  # IEEE half bits
    "bf16": "uint16_t",  # bfloat16 bits: the high half of a float's bits
}

_C_KEYWORDS = frozenset(
    "auto break case char const continue default do double else enum extern float for goto if inline int long "
    "register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while "
    "bool true false".split()
)

# (name, value, meaning); codes 3-4 come from partitioned CPU libraries only, 5-8 from CUDA libraries only.
STATUS_CODES = (
    ("FLOWJIT_OK", 0, "success: every output is written"),
    ("FLOWJIT_ERROR_NULL_ARGUMENT", 1, "an input, output or workspace pointer is NULL; nothing is written"),
    ("FLOWJIT_ERROR_OUT_OF_MEMORY", 2, "allocating the workspace or an in-place copy failed; nothing is written"),
    (
        "FLOWJIT_ERROR_TRANSFER",
        3,
        "a transfer between partitions failed or timed out (FLOWJIT_RECV_TIMEOUT); the outputs are undefined",
    ),
    ("FLOWJIT_ERROR_THREAD", 4, "a thread for a partition could not be started; the outputs are undefined"),
    (
        "FLOWJIT_ERROR_NO_GPU",
        5,
        "the CUDA driver cannot be loaded or shows no usable device (the last_error function says which); "
        "nothing is written",
    ),
    (
        "FLOWJIT_ERROR_CUDA",
        6,
        "a CUDA driver call failed (the last_error function names it and its error); the outputs are undefined",
    ),
    (
        "FLOWJIT_ERROR_TIMEOUT",
        7,
        "the GPU did not finish within FLOWJIT_GPU_TIMEOUT_S seconds (default 120); the outputs are undefined "
        "and the library refuses later calls",
    ),
    (
        "FLOWJIT_ERROR_INVALID_SETTING",
        8,
        "a setting is invalid (FLOWJIT_GPU_TIMEOUT_S, a negative device number); nothing is written",
    ),
)


@dataclass(frozen=True)
class Port:
    """One argument of the C entry point: an input or output buffer of the compiled function."""

    c_name: str  # the C parameter name (unique, a valid identifier)
    path: str  # where it comes from: a pytree path of the Python signature, or a variable
    shape: tuple[int, ...]
    dtype: dt.DType
    variable: str | None = None  # the flowjit Variable this buffer holds, if any

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def c_type(self) -> str:
        return C_TYPES[self.dtype.name]


# Names the wrappers' functions use for themselves.
RESERVED_NAMES = frozenset({"workspace", "flowjit_in", "flowjit_out", "flowjit_status"})


def c_identifier(path: str, taken: set[str]) -> str:
    """A C identifier for a pytree path (`params['w1']` -> `params_w1`), unique among `taken` and
    different from the wrapper's own names."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_") or "arg"
    if name[0].isdigit():
        name = "_" + name
    if name in _C_KEYWORDS or keyword.iskeyword(name):
        name += "_"
    unique, n = name, 2
    while unique in taken or unique in RESERVED_NAMES:
        unique, n = f"{name}_{n}", n + 1
    taken.add(unique)
    return unique


def parameters(inputs: list[Port], outputs: list[Port]) -> str:
    """The entry point's parameter list: `const T* input...`, then `T* output...` (or `void`)."""
    params = [f"const {p.c_type}* {p.c_name}" for p in inputs] + [f"{p.c_type}* {p.c_name}" for p in outputs]
    return ", ".join(params) if params else "void"


def port_defines(prefix: str, port: Port, role: str) -> list[str]:
    """The header's comment and macros for one buffer: `PREFIX_NAME_RANK`, `_DIMi`, `_SIZE`."""
    macro = f"{prefix}_{port.c_name.upper()}"
    lines = [
        f"/* {role} {port.c_name}: {port.path}, {port.dtype.name}{list(port.shape)} ({port.c_type}, C order)"
        + (f", variable '{port.variable}'" if port.variable else "")
        + " */",
        f"#define {macro}_RANK {len(port.shape)}",
    ]
    lines += [f"#define {macro}_DIM{i} {d}" for i, d in enumerate(port.shape)]
    lines.append(f"#define {macro}_SIZE {port.size} /* elements */")
    return lines


def signature_defines(prefix: str, inputs: list[Port], outputs: list[Port]) -> str:
    """The header's counts and every buffer's macros."""
    defines = [f"#define {prefix}_NUM_INPUTS {len(inputs)}", f"#define {prefix}_NUM_OUTPUTS {len(outputs)}"]
    for port in inputs:
        defines += port_defines(prefix, port, "input")
    for port in outputs:
        defines += port_defines(prefix, port, "output")
    return "\n".join(defines)


def status_enum() -> str:
    """`enum flowjit_status`, guarded so that several flowjit headers can be included together."""
    status = "\n".join(f"  {code} = {value}, /* {doc} */" for code, value, doc in STATUS_CODES)
    return f"#ifndef FLOWJIT_STATUS_CODES\n#define FLOWJIT_STATUS_CODES\nenum flowjit_status {{\n{status}\n}};\n#endif"


def status_cases() -> str:
    """The `case CODE: return "meaning";` lines of a status_string function."""
    return "\n".join(f'    case {code}: return "{doc}";' for code, _, doc in STATUS_CODES)
