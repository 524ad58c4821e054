"""C text of an ahead-of-time library: the public header `NAME.h` and the wrapper `NAME.c` that
checks arguments, owns the workspace and calls the generated kernel.

The kernel is the CPU backend's entry point `void NAME_kernel(in..., out..., workspace)` taking
bare pointers (see `lowering.py`); it assumes no input overlaps an output. The wrapper makes
in-place calls correct anyway: an input whose bytes overlap an output's is first copied to a
temporary, so the caller may pass one buffer as both (the usual way to update parameters).
A partitioned function's wrapper calls one kernel per partition, concurrently, through the
rendezvous runtime in `aot_runtime.c`.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path

from flowjit.ir import dtypes as dt

# The rendezvous runtime of partitioned libraries, pasted into their wrapper.
RUNTIME_SOURCE = (Path(__file__).parent / "aot_runtime.c").read_text(encoding="utf-8")

WORKSPACE_ALIGNMENT = 64

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


# Names the wrapper's functions use for themselves.
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


def _parameters(name: str, inputs: list[Port], outputs: list[Port]) -> str:
    params = [f"const {p.c_type}* {p.c_name}" for p in inputs] + [f"{p.c_type}* {p.c_name}" for p in outputs]
    return ", ".join(params) if params else "void"


def _port_defines(prefix: str, port: Port, role: str) -> list[str]:
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


def header(name: str, inputs: list[Port], outputs: list[Port], manifest: dict) -> str:
    """The public header: status codes, sizes, and the three entry points of library `name`."""
    prefix = name.upper()
    guard = f"FLOWJIT_{prefix}_H"
    params = _parameters(name, inputs, outputs)
    status = "\n".join(f"  {code} = {value}, /* {doc} */" for code, value, doc in STATUS_CODES)
    defines = [f"#define {prefix}_NUM_INPUTS {len(inputs)}", f"#define {prefix}_NUM_OUTPUTS {len(outputs)}"]
    for port in inputs:
        defines += _port_defines(prefix, port, "input")
    for port in outputs:
        defines += _port_defines(prefix, port, "output")
    if "libiomp5" in manifest["runtime_libraries"]:
        threads = (
            "OpenMP: the library needs libiomp5.so at run time (found through its rpath: next to the\n"
            " * library, then the build's Python environment)"
        )
    elif manifest["threads"] == "serial":
        threads = "none (built with --threads serial): the library depends on libc and libm only"
    else:
        threads = "none (this function has no parallel loops): the library depends on libc and libm only"
    partitions = manifest.get("partitions")
    if partitions:
        devices = ", ".join(p["device"] for p in partitions)
        threads += (
            f".\n * Partitions: {len(partitions)} ({devices}), run concurrently by each call: the calling thread runs\n"
            " * the first, one new thread each of the others (libpthread); the workspace holds them all"
        )
    defines_text = "\n".join(defines)
    return f"""/* {name}.h: generated by flowjit {manifest["flowjit_version"]} from {manifest["source"]}. Do not edit.
 *
 * Calling convention: every buffer is a dense C-contiguous (row-major) array of the shape and
 * element type below; scalars are one-element arrays. Element types: float (f32), double (f64),
 * int32_t (i32), int64_t (i64), uint8_t (bool: one byte per element, 0 or 1), uint16_t (f16 and
 * bf16: the raw 16-bit pattern). Every function returns a status code (enum flowjit_status).
 *
 * Aliasing: an output may share memory with any input (e.g. update parameters in place); the
 * library then copies the overlapping input first. Outputs must not overlap each other.
 *
 * Threads: {name}() is safe to call from several threads at once (each call has its own
 * workspace). {name}_with_workspace() is too, as long as each concurrent call has its own workspace.
 * Threading inside a call: {threads}.
 *
 * Target: {manifest["target"]["cpu"]} ({manifest["target"]["triple"]}); the code uses that CPU's features.
 */
#ifndef {guard}
#define {guard}

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {{
#endif

#ifndef FLOWJIT_STATUS_CODES
#define FLOWJIT_STATUS_CODES
enum flowjit_status {{
{status}
}};
#endif

{defines_text}

/* Bytes of scratch memory {name}_with_workspace() needs (any alignment). */
#define {prefix}_WORKSPACE_SIZE {manifest["workspace_bytes"]}

/* Run {name}: allocates its workspace per call (malloc/free). */
int {name}({params});

/* The size of the workspace {name}_with_workspace() needs, in bytes ({prefix}_WORKSPACE_SIZE). */
size_t {name}_workspace_size(void);

/* Run {name} in a caller-owned workspace of at least {name}_workspace_size() bytes. The wrapper
 * allocates only for an input that overlaps an output (a temporary copy); the generated code
 * allocates only if the manifest's external_symbols lists malloc. */
int {name}_with_workspace({params.removesuffix("void").rstrip(", ")}{", " if inputs or outputs else ""}void* workspace);

/* A short English description of a status code. */
const char* {name}_status_string(int status);

#ifdef __cplusplus
}}
#endif

#endif /* {guard} */
"""


def wrapper(name: str, kernel: str, inputs: list[Port], outputs: list[Port], kernel_workspace: int) -> str:
    """The C source of the library's public functions, calling `kernel`."""
    kernel_params = ", ".join(["const void*"] * len(inputs) + ["void*"] * len(outputs) + ["void*"])
    declaration = f"""/* The generated code (hidden: only the functions of {name}.h are exported). */
__attribute__((visibility("hidden"))) void {kernel}({kernel_params});"""
    arguments = [f"in[{i}]" for i in range(len(inputs))] + [f"out[{i}]" for i in range(len(outputs))]
    call = f"{kernel}({', '.join([*arguments, 'scratch'])});"
    return _wrapper(name, inputs, outputs, kernel_workspace, declaration, call)


@dataclass(frozen=True)
class PartitionKernel:
    """One partition's kernel in a partitioned library: `kernel(in[inputs]..., out[outputs]...,
    workspace)`, with `inputs`/`outputs` indices into the function's inputs and outputs."""

    kernel: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    workspace_bytes: int


def _aligned(n: int) -> int:
    return (n + WORKSPACE_ALIGNMENT - 1) // WORKSPACE_ALIGNMENT * WORKSPACE_ALIGNMENT


def partitioned_workspace_bytes(kernels: list[PartitionKernel]) -> int:
    """The kernels' workspaces side by side, each starting 64-byte aligned."""
    return sum(_aligned(k.workspace_bytes) for k in kernels)


def partitioned_wrapper(
    name: str,
    kernels: list[PartitionKernel],
    keys: list[str],
    passthrough: list[tuple[int, int]],
    inputs: list[Port],
    outputs: list[Port],
) -> str:
    """The C source of a library whose function is partitioned: the rendezvous runtime
    (aot_runtime.c), one call of every partition's kernel, run concurrently per call by the same
    public functions as `wrapper`. `keys` are the rendezvous keys of the transfers; `passthrough`
    lists (output, input) pairs of results that are arguments returned as they are."""
    lines = ["/* The generated code, one kernel per partition (hidden, like the runtime below). */"]
    for k in kernels:
        params = ", ".join(["const void*"] * len(k.inputs) + ["void*"] * len(k.outputs) + ["void*"])
        lines.append(f'__attribute__((visibility("hidden"))) void {k.kernel}({params});')
    key_table = ", ".join(_c_string(key) for key in keys) or "0"
    lines += [
        "",
        f"#define NUM_PARTITIONS {len(kernels)}",
        f"#define NUM_KEYS {max(len(keys), 1)}",
        f"static const char* const rendezvous_keys[NUM_KEYS] = {{{key_table}}};",
        # The kernels call these names (aot.py renames flowjit_send... per library), so two
        # partitioned libraries linked into one program do not clash.
        f"#define FLOWJIT_SEND {name}_flowjit_send",
        f"#define FLOWJIT_RECV {name}_flowjit_recv",
        f"#define FLOWJIT_SEND_DONE {name}_flowjit_send_done",
        "",
        "static void run_kernel(int n, const void** in, void** out, char* scratch) {",
        "  switch (n) {",
    ]
    offset = 0
    for n, k in enumerate(kernels):
        arguments = [f"in[{i}]" for i in k.inputs] + [f"out[{j}]" for j in k.outputs] + [f"scratch + {offset}"]
        lines.append(f"    case {n}: {k.kernel}({', '.join(arguments)}); break;")
        offset += _aligned(k.workspace_bytes)
    lines += ["  }", "}", "", RUNTIME_SOURCE]
    copies = "".join(
        f"\n    memmove(out[{j}], in[{i}], {outputs[j].nbytes});" for j, i in passthrough if outputs[j].nbytes
    )
    call = f"status = run_partitions(in, out, (char*)scratch);{copies}"
    return _wrapper(name, inputs, outputs, partitioned_workspace_bytes(kernels), "\n".join(lines), call)


def _c_string(text: str) -> str:
    return '"' + "".join(c if c.isalnum() or c in " :->_%#." else f"\\{ord(c):03o}" for c in text) + '"'


def _wrapper(name: str, inputs: list[Port], outputs: list[Port], kernel_workspace: int, declarations: str, call: str):
    params = _parameters(name, inputs, outputs)
    workspace_params = params.removesuffix("void").rstrip(", ")
    sep = ", " if inputs or outputs else ""
    in_names = [p.c_name for p in inputs]
    out_names = [p.c_name for p in outputs]
    n_in, n_out = len(inputs), len(outputs)
    in_bytes = ", ".join(str(p.nbytes) for p in inputs) or "0"
    out_bytes = ", ".join(str(p.nbytes) for p in outputs) or "0"
    null_checks = " || ".join(
        [f"({p.c_name} == NULL && {p.nbytes} > 0)" for p in inputs + outputs] + ["workspace == NULL"]
    )
    statuses = "\n".join(f'    case {code}: return "{doc}";' for code, _, doc in STATUS_CODES)
    return f"""/* {name}.c: generated by flowjit. The public functions of {name}.h around the generated kernel. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "{name}.h"

{declarations}

#define KERNEL_WORKSPACE {kernel_workspace}
#define ALIGNMENT {WORKSPACE_ALIGNMENT}
#define NUM_INPUTS {max(n_in, 1)}
#define NUM_OUTPUTS {max(n_out, 1)}

static const size_t input_bytes[NUM_INPUTS] = {{{in_bytes}}};
static const size_t output_bytes[NUM_OUTPUTS] = {{{out_bytes}}};

static int overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {{
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}}

/* The kernel assumes its inputs and outputs do not overlap: copy each input that overlaps an
 * output to a temporary first. */
static int run(const void** in, void** out, void* workspace) {{
  void* copies[NUM_INPUTS] = {{0}};
  int status = FLOWJIT_OK;
  for (int i = 0; i < {n_in}; i++) {{
    for (int j = 0; j < {n_out}; j++) {{
      if (!overlaps(in[i], input_bytes[i], out[j], output_bytes[j])) continue;
      copies[i] = malloc(input_bytes[i]);
      if (copies[i] == NULL) {{ status = FLOWJIT_ERROR_OUT_OF_MEMORY; goto done; }}
      memcpy(copies[i], in[i], input_bytes[i]);
      in[i] = copies[i];
      break;
    }}
  }}
  {{
    uintptr_t base = (uintptr_t)workspace;
    void* scratch = (void*)((base + ALIGNMENT - 1) & ~(uintptr_t)(ALIGNMENT - 1));
    {call}
  }}
done:
  for (int i = 0; i < {n_in}; i++) free(copies[i]);
  return status;
}}

size_t {name}_workspace_size(void) {{ return KERNEL_WORKSPACE + ALIGNMENT; }}

int {name}_with_workspace({workspace_params}{sep}void* workspace) {{
  if ({null_checks}) return FLOWJIT_ERROR_NULL_ARGUMENT;
  const void* flowjit_in[NUM_INPUTS] = {{{", ".join(in_names) or "0"}}};
  void* flowjit_out[NUM_OUTPUTS] = {{{", ".join(out_names) or "0"}}};
  return run(flowjit_in, flowjit_out, workspace);
}}

int {name}({params}) {{
  void* workspace = malloc(KERNEL_WORKSPACE + ALIGNMENT);
  if (workspace == NULL) return FLOWJIT_ERROR_OUT_OF_MEMORY;
  int flowjit_status = {name}_with_workspace({", ".join(in_names + out_names)}{sep}workspace);
  free(workspace);
  return flowjit_status;
}}

const char* {name}_status_string(int status) {{
  switch (status) {{
{statuses}
    default: return "unknown status code";
  }}
}}
"""
