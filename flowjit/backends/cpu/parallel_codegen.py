"""LLVM's half of a compile on several cores: the module is split into parts by function, each part
is optimized and turned into object code on its own thread, and the objects are linked into one
MCJIT engine.

Why: LLVM O3 and code generation are two thirds of a first call, and LLVM works on one module in
one thread. A training step's module is one entry function (the kernels that run on one thread)
plus the OpenMP-outlined bodies of the parallel kernels (`@f..omp_par.N`), which are only called
through `__kmpc_fork_call`: no call site to inline or specialize, so each can be compiled apart
from the entry with no loss. The MLP training step splits into two halves, and LLVM's wall time
falls by about 40% on a 2-core AMD EPYC Zen 4 VM (docs/cpu-compile-time.md).

How:
- `split_llvm_ir` cuts the LLVM IR text (as `mlir-translate` prints it: globals, declarations,
  `define ... {` to `}` blocks, attributes, metadata) into `parts`: the entry and every function
  that is not an outlined OpenMP body stay in part 0; the outlined bodies go to the least loaded
  part, largest first. Every part keeps all module-level lines (constants are duplicated, O3 drops
  the unused ones); a function defined in another part is declared, and defined with external
  linkage so the linker finds it. A module with a mutable global is not split (each part would get
  its own copy).
- `optimize_parts` / `emit_objects` run one part per thread, each in an LLVM context of its own
  (LLVM is thread-safe across contexts). llvmlite serializes every call into LLVM with one global
  lock, so the long calls (parse, the pass pipeline, code generation) go to the ctypes functions
  under its wrappers, which release the GIL; all other llvmlite calls keep the lock.
- `FLOWJIT_COMPILE_THREADS` caps the threads (default: the cores this process may run on, at most
  8; 1 turns the split off), and the processes of the MLIR half (`parallel_mlir`).
"""

from __future__ import annotations

import functools
import os
import re
from concurrent.futures import ThreadPoolExecutor
from ctypes import c_char_p, string_at

from flowjit.backends.cpu import host, toolchain
from flowjit.errors import CompileError

# Below this many lines of unoptimized IR the split costs more than it saves (thread hand-off,
# parsing the shared lines again, one more object to link).
MIN_SPLIT_LINES = 1000
# Split only when the largest part is at most this share of the module: otherwise one thread does
# nearly all the work anyway.
MAX_PART_SHARE = 0.8
MAX_THREADS = 8

_DEFINE = re.compile(
    r"^define\s+(?:(?:internal|private)\s+)?(?P<sig>.*?)@(?P<name>[-\w.$]+)\((?P<args>.*)\)(?P<attrs>.*)\{\s*$"
)
_SYMBOL = re.compile(r"@([-\w.$]+)")
_MUTABLE_GLOBAL = re.compile(r"^@[-\w.$]+\s*=.*\bglobal\b")
_OUTLINED = ".omp_par"


def threads() -> int:
    """Threads a compile may use: `FLOWJIT_COMPILE_THREADS`, else this process's cores (at most 8)."""
    value = os.environ.get("FLOWJIT_COMPILE_THREADS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise CompileError(f"FLOWJIT_COMPILE_THREADS must be a whole number; found {value!r}") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS))


class _Function:
    """One `define` block of the IR text."""

    def __init__(self, lines: list[str]):
        match = _DEFINE.match(lines[0])
        if match is None:
            raise CompileError(f"internal error: unexpected LLVM function header: {lines[0][:200]}")
        self.lines = lines
        self.name = match["name"]
        self.signature, self.args, self.attrs = match["sig"], match["args"], match["attrs"]

    def definition(self) -> list[str]:
        """The block with external linkage (visible to the other parts)."""
        return [f"define {self.signature}@{self.name}({self.args}){self.attrs}{{", *self.lines[1:]]

    def declaration(self) -> str:
        return f"declare {self.signature}@{self.name}({self.args})"


def split_llvm_ir(text: str, parts: int) -> list[str]:
    """The module `text` as up to `parts` modules that together define the same functions (see the
    module docstring); `[text]` when splitting would not pay."""
    if parts < 2 or text.count("\n") < MIN_SPLIT_LINES:
        return [text]
    shared: list[str] = []
    functions: list[_Function] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("define "):
            end = lines.index("}", i)
            functions.append(_Function(lines[i : end + 1]))
            i = end + 1
        else:
            if _MUTABLE_GLOBAL.match(lines[i]):
                return [text]
            shared.append(lines[i])
            i += 1
    outlined = sorted((f for f in functions if _OUTLINED in f.name), key=lambda f: len(f.lines), reverse=True)
    groups = [[f for f in functions if _OUTLINED not in f.name]] + [[] for _ in range(parts - 1)]
    load = [sum(len(f.lines) for f in groups[0])] + [0] * (parts - 1)
    for f in outlined:
        k = min(range(parts), key=load.__getitem__)
        groups[k].append(f)
        load[k] += len(f.lines)
    if max(load) > MAX_PART_SHARE * sum(load):
        return [text]
    groups = [group for group in groups if group]  # fewer outlined bodies than threads
    home = {f.name: k for k, group in enumerate(groups) for f in group}
    modules = []
    for k, group in enumerate(groups):
        body = [line for f in group for line in f.definition()]
        used = set(_SYMBOL.findall("\n".join(body)))
        declarations = [f.declaration() for f in functions if f.name in used and home[f.name] != k]
        modules.append("\n".join(shared + declarations + body) + "\n")
    return modules


def _unlocked(name: str):
    """The ctypes function under llvmlite's locking wrapper (releases the GIL, takes no lock); the
    wrapper itself (correct, but one part at a time) if a llvmlite release lays them out otherwise."""
    from llvmlite.binding import ffi

    wrapper = getattr(ffi.lib, name)
    return getattr(wrapper, "_cfn", wrapper)


_pools: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """This process's compile threads. Keyed by pid: a child forked after the pool started has
    none of its threads, and work queued on the inherited pool would wait forever."""
    pid = os.getpid()
    pool = _pools.get(pid)
    if pool is None:
        pool = _pools[pid] = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="flowjit-llvm")
    return pool


def _parallel(fn, items: list) -> list:
    """`[fn(item) for item in items]`, the first on this thread and the rest on the pool."""
    if len(items) == 1:
        return [fn(items[0])]
    futures = [_pool().submit(fn, item) for item in items[1:]]
    first = fn(items[0])
    return [first, *(f.result() for f in futures)]


@functools.cache
def _part_module_class():
    from llvmlite.binding.module import ModuleRef

    class PartModule(ModuleRef):
        """A module that owns its LLVM context and disposes of the module first, then the context.
        Left to the garbage collector separately, the two could be finalized in either order (both
        are reachable only from the same cycle of compiled-function objects), and disposing of a
        module whose context is gone crashes."""

        def _dispose(self):
            context = self._context
            super()._dispose()
            context._owned = False
            context.close()

    return PartModule


def _optimize_part(job: tuple[str, str, int, bool]):
    """Parse one part in a context of its own and run the O-level (or light) pipeline; (module,
    target machine)."""
    from llvmlite.binding import ffi

    text, name, opt, light = job
    binding = host.llvm()
    context = binding.create_context()
    context._owned = True  # disposed by its module (`PartModule`), never on its own
    with ffi.OutputString() as error:
        pointer = _unlocked("LLVMPY_ParseAssembly")(context, c_char_p(text.encode()), error)
        if error or not pointer:
            context._owned = False
            raise CompileError(f"internal error: LLVM IR of part '{name}' does not parse: {error}")
    module = _part_module_class()(pointer, context)
    module.name = name
    module.triple = host.host_cpu().triple
    tm = toolchain.target_machine()
    module.data_layout = str(tm.target_data)
    module.verify()
    if opt > 0:
        manager, builder = toolchain.optimization_pipeline(tm, opt, light)
        _unlocked("LLVMPY_RunNewModulePassManager")(manager, module, builder)
    return module, tm


def optimize_parts(texts: list[str], name: str, opt: int, light: bool = False) -> list:
    """Each part of `split_llvm_ir` optimized on its own thread: [(llvmlite module, target machine)]."""
    jobs = [(text, f"{name}.part{k}", opt, light) for k, text in enumerate(texts)]
    return _parallel(_optimize_part, jobs)


def _emit_object(part) -> bytes:
    from llvmlite.binding import ffi

    module, tm = part
    with ffi.OutputString() as error:
        buffer = _unlocked("LLVMPY_TargetMachineEmitToMemory")(tm, module, 1, error)
        if not buffer:
            raise CompileError(f"internal error: code generation failed for {module.name}: {error}")
    try:
        return string_at(ffi.lib.LLVMPY_GetBufferStart(buffer), ffi.lib.LLVMPY_GetBufferSize(buffer))
    finally:
        ffi.lib.LLVMPY_DisposeMemoryBuffer(buffer)


def emit_objects(parts: list, strength_reduction: bool = False, cmov_conversion: bool = True) -> list[bytes]:
    """Object code of each optimized part, generated on its own thread (`strength_reduction`,
    `cmov_conversion`: see `toolchain.codegen_options`)."""
    with toolchain.codegen_options(strength_reduction, cmov_conversion):
        return _parallel(_emit_object, parts)


def undefined_symbols(modules: list) -> list[str]:
    """External functions the parts call that none of them defines."""
    defined = {f.name for m in modules for f in m.functions if not f.is_declaration}
    return sorted({name for m in modules for name in toolchain.undefined_symbols(m)} - defined)
