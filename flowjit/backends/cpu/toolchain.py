"""The CPU toolchain: MLIR text -> MLIR pass pipeline -> LLVM IR -> llvmlite (host CPU, O3) ->
native code, in process (MCJIT; object code from the cache or the libraries linked by JITLink:
`load_objects`) or as an object file for ahead-of-time builds.

Everything that touches `llvmlite` directly lives here (and in `parallel_codegen`, which compiles
a large module's parts on several threads); MLIR pipelines run through the shared runner
(`backends/mlir/pipeline.py`), so the lowering code only deals in MLIR text.
Recipes and their pitfalls are in shared/TOOLCHAIN.md; the ones that matter here:
attribute aliases sit outside `module {}`; `eliminate-empty-tensors` precedes bufferization;
`convert-ub-to-llvm` is required; the OpenMP runtime (`libiomp5` from the intel-openmp wheel) must
be loaded before any module that calls `__kmpc_*` is finalized, or MCJIT segfaults silently.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import struct
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

from flowjit.backends.cpu import lane_extremes, ldexp, pipeline, single_lane
from flowjit.backends.cpu.host import host_cpu, llvm
from flowjit.backends.mlir import pipeline as mlir_pipeline
from flowjit.errors import CompileError

_lock = mlir_pipeline.lock()


def lock() -> threading.RLock:
    """The lock held around this module's MLIR and LLVM calls (`mlir_pipeline.lock`)."""
    return _lock


@contextlib.contextmanager
def fork_lock():
    """Held while `parallel_mlir` forks: this module's lock and llvmlite's (every llvmlite call
    holds it but `parallel_codegen`'s unlocked parse, optimization and code generation), so that no
    other thread is inside MLIR or an llvmlite call when the child's copy of the process is taken.
    Freeing an engine (a dropped function's machine code) deregisters its exception-handling frames
    under the C++ unwinder's mutex; a child forked meanwhile would wait forever for that mutex at its
    first C++ exception, which the MLIR bindings throw at the end of every iteration over
    operations (2 children in ~3,600 forks hung so while another thread compiled and dropped
    functions)."""
    from llvmlite.binding import ffi

    with _lock, ffi.lib._lock:
        yield


# The code model of the code compiled for this process (`jit_compile`, `parallel_codegen`'s parts).
# MCJIT's loader, RuntimeDyld, maps an object's code, read-only data and writable data with separate
# mmaps, each wherever the kernel finds room: more than 2 GiB apart in a process whose address space
# other native libraries fragmented (JAX's XLA). In the large code model every reference to another
# section or symbol is a 64-bit address, which no placement overflows. The same code as llvmlite's
# "jitdefault" on x86-64, named because it is load-bearing (`load_objects` links either model).
JIT_CODE_MODEL = "large"


def target_machine(reloc: str = "default", opt: int = 3):
    """An llvmlite target machine for the host CPU: for MCJIT (`JIT_CODE_MODEL`), or with
    `reloc="pic"` for position-independent objects of the small code model, which a linker that
    keeps an object's sections together must load (`emit_object`)."""
    binding = llvm()
    cpu = host_cpu()
    target = binding.Target.from_triple(cpu.triple)
    codemodel = JIT_CODE_MODEL if reloc == "default" else "default"
    return target.create_target_machine(cpu=cpu.name, features=cpu.features, opt=opt, reloc=reloc, codemodel=codemodel)


def _apply_schedule(module) -> bool:
    """Run the module's transform schedule, if it has one, and erase it (`mlir_pipeline.apply_schedule`);
    then rewrite the float max/min reductions across vector lanes, the schedules' and the lowerings'
    own (`lane_extremes`), and exp's vectorized power-of-two scaling (`ldexp`). True if there was a
    schedule."""
    scheduled = mlir_pipeline.apply_schedule(module)
    lane_extremes.rewrite(module)
    ldexp.rewrite(module)
    return scheduled


def apply_transform_schedule(text: str) -> str:
    """Run the transform-dialect schedule embedded in the module (`transform.named_sequence
    @__transform_main` inside a module carrying `transform.with_named_sequence`), then erase the
    schedule so the payload is an ordinary module again."""
    with _lock, mlir_pipeline.mlir_context():
        module = mlir_pipeline.parse(text)
        _apply_schedule(module)
        return str(module)


class LLVMLowering(NamedTuple):
    """What the MLIR half produced: LLVM IR text, the LLVM-dialect MLIR text (when asked for), and
    the number of elements of the largest kernel the transform schedule left as a linalg op other
    than a fill, or `copies_as_loops` made (0 when every kernel was vectorized by a schedule): such
    a kernel becomes plain scalar loops, which only LLVM's O3 pipeline vectorizes."""

    llvm_ir: str
    dialect_text: str | None
    plain_loop_elements: int
    streamed: tuple = ()  # the arguments given non-temporal stores (`nontemporal.Streamed`)


def lower_to_llvm_ir(
    text: str, options: pipeline.CompileOptions | None = None, keep_text: bool = False
) -> LLVMLowering:
    """The backend's MLIR half on one in-memory module: parse the lowering's text, run its transform
    schedule and the stages "bufferize" and "llvm-dialect" (`pipeline.mlir_stages` for `options`),
    translate to LLVM IR. The LLVM-dialect text is
    made only when `keep_text` asks for it: printing and re-parsing the module between steps cost a
    fifth of this function's time."""
    with _lock, mlir_pipeline.mlir_context():
        module = mlir_pipeline.parse(text)
        passes = pipeline.stage_pipeline("bufferize", "llvm-dialect", options=options)
        scheduled = _apply_schedule(module)
        plain = mlir_pipeline.largest_plain_kernel(module)

        def repro() -> str:  # a failure's reproducer starts after the schedule, as `run_mlir` takes it
            return apply_transform_schedule(text) if scheduled else text

        mlir_pipeline.run_pipeline(module, passes, repro)
        streamed = _streamed(module)
        llvm_ir = _translated(module)
        if mlir_pipeline.COPY_CALL in llvm_ir:
            module = mlir_pipeline.parse(text)
            _apply_schedule(module)
            mlir_pipeline.run_pipeline(module, pipeline.stage_pipeline("bufferize", options=options), repro)
            bufferized = mlir_pipeline.copies_as_loops(str(module))
            module = mlir_pipeline.parse(bufferized)
            plain = max(plain, mlir_pipeline.largest_plain_kernel(module))  # the copies, now plain loops
            to_llvm = pipeline.stage_pipeline("llvm-dialect", options=options)
            mlir_pipeline.run_pipeline(module, to_llvm, lambda: bufferized)
            streamed = _streamed(module)
            llvm_ir = _translated(module)
        return LLVMLowering(llvm_ir, str(module) if keep_text else None, plain, streamed)


def _streamed(module) -> tuple:
    """`nontemporal.stream_stores` on an x86-64 host (its fence is an x86 instruction)."""
    if not host_cpu().triple.startswith("x86_64"):
        return ()
    from flowjit.backends.cpu import nontemporal

    return tuple(nontemporal.stream_stores(module))


def _translated(module) -> str:
    """LLVM IR of a module the pipelines lowered, once it is verified and holds only LLVM-dialect
    and OpenMP ops (the translation would crash on any other); one-lane masked stores made scalar
    (`single_lane`: LLVM's x86 code generation wrote such a store at the width of the elements it
    was truncated from)."""
    return single_lane.scalar_stores(mlir_pipeline.translate(module))


def translate_to_llvm_ir(llvm_dialect_text: str) -> str:
    """LLVM-dialect MLIR (with OpenMP ops) -> LLVM IR text. Ops of other dialects left behind by the
    pipeline are an internal error (the translation itself would crash on them)."""
    with _lock, mlir_pipeline.mlir_context():
        return _translated(mlir_pipeline.parse(llvm_dialect_text))


def optimize(llvm_ir: str, name: str, opt: int = 3, reloc: str = "default", light: bool = False):
    """Parse LLVM IR and run the O`opt` pipeline (`pipeline.LIGHT_PASSES` when `light`) for the host CPU;
    returns (module, target machine)."""
    binding = llvm()
    with _lock:
        module = binding.parse_assembly(llvm_ir)
        module.name = name
        module.triple = host_cpu().triple
        tm = target_machine(reloc=reloc)
        module.data_layout = str(tm.target_data)
        module.verify()
        if opt > 0:
            manager, builder = optimization_pipeline(tm, opt, light)
            manager.run(module, builder)
        return module, tm


def optimization_pipeline(tm, opt: int = 3, light: bool = False):
    """LLVM's O`opt` module pipeline for target machine `tm`, or `pipeline.LIGHT_PASSES` when `light`:
    (module pass manager, pass builder). Loop unrolling is off (it doubled LLVM's time on the large
    workloads): only loops carrying forced unroll metadata would be unrolled; the lowering writes
    out its short loops instead (docs/cpu-compile-time.md)."""
    binding = llvm()
    tuning = binding.create_pipeline_tuning_options(speed_level=opt)
    tuning.loop_unrolling = False
    builder = binding.create_pass_builder(tm, tuning)
    if not light:
        return builder.getModulePassManager(), builder
    manager = binding.create_new_module_pass_manager()
    for name in pipeline.LIGHT_PASSES:
        getattr(manager, f"add_{name}_pass")()
    return manager, builder


def undefined_symbols(module) -> list[str]:
    """External functions the module's IR calls (an AOT library's externals)."""
    return sorted(f.name for f in module.functions if f.is_declaration and not f.name.startswith("llvm."))


def object_externals(object_code: bytes) -> tuple[set[str], set[str]]:
    """(symbols the ELF object refers to without defining them, symbols it defines): its IR's
    external calls and the helpers its code generation called for operations the CPU lacks, which
    no IR declaration shows."""
    undefined, defined = set(), set()
    for symbol, _, section in _elf_symbols(object_code):
        (undefined if section == 0 else defined).add(symbol)
    return undefined, defined


def _elf_symbols(object_code: bytes) -> list[tuple[str, int, int]]:
    """(name, binding: 0 local / 1 global / 2 weak, section index: 0 undefined) of each named
    symbol of an ELF object."""
    binding = llvm()
    sections = {s.name(): s.data() for s in binding.ObjectFileRef.from_data(object_code).sections()}
    table, names = sections.get(b".symtab", b""), sections.get(b".strtab", b"")
    symbols = []
    for offset in range(0, len(table) - _ELF64_SYMBOL.size + 1, _ELF64_SYMBOL.size):
        name, info, _, section, _, _ = _ELF64_SYMBOL.unpack_from(table, offset)
        if name:
            symbols.append((names[name : names.index(b"\0", name)].decode(), info >> 4, section))
    return symbols


_ELF64_SYMBOL = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx (0: undefined), st_value, st_size


def check_objects(objects: tuple[bytes, ...]) -> None:
    """Raise unless every symbol the objects (one function's parts, linked together) use resolves
    in this process: MCJIT links an unresolved one to address 0, and the call crashes."""
    binding = llvm()
    undefined, defined = set(), set()
    for object_code in objects:
        used, own = object_externals(object_code)
        undefined |= used
        defined |= own
    missing = sorted(name for name in undefined - defined if not binding.address_of_symbol(name))
    if missing:
        raise CompileError(
            f"internal error: the generated code calls unresolved functions: {', '.join(missing)} (helpers "
            f"of LLVM's code generation live in libgcc_s / compiler-rt)"
        )


class NativeModule:
    """Machine code loaded in this process; keeps it loaded as long as functions are used (`owner`:
    the MCJIT engine of `jit_compile`, or the linked library of `load_objects`, whose symbols
    `lookup` finds). `objects`: the object code it was loaded from (one object per part,
    `parallel_codegen`)."""

    def __init__(self, owner, objects: tuple[bytes, ...], lookup: Callable[[str], int]):
        self.owner = owner
        self.objects = objects
        self._lookup = lookup

    def address(self, symbol: str) -> int:
        address = self._lookup(symbol)
        if not address:
            raise CompileError(f"internal error: symbol '{symbol}' not found in the compiled module")
        return address


# Loop strength reduction (LSR) in LLVM's code generation, per function (`codegen_options`). LSR
# rewrites loop address arithmetic into pointer increments; most of our loops are vector loops over
# unit-stride views whose `base + index * scale` addresses x86 takes as they are, and there it costs
# a fifth to a half of code generation for no speed (the CNN, the MLP step and matmul on a 2-core
# AMD EPYC Zen 4 VM). Row-tile nests (`lower_rows`: softmax, layer norm) run slightly faster with
# it, so functions whose main work they are keep it (`codegen_settings`; docs/cpu-compile-time.md,
# "Code generation options").
#
# x86's cmov conversion (`X86CmovConversion`) turns conditional moves in loops back into branches
# when it judges the branch predictable. In a merge sort's merge loop the choice between the two
# runs' heads is a coin flip on random keys: converted, the loop mispredicts about every second
# element and sorts twice as slowly. Functions with sort kernels turn it off (`codegen_settings`);
# the rest keep LLVM's default.
_codegen = threading.Condition()
_codegen_users = 0
# LLVM's defaults (strength reduction, cmov conversion), and what the process has while none of
# our code generations runs.
_DEFAULTS = (True, True)
_codegen_state = _DEFAULTS
CODEGEN_WAIT_S = 600


def _set_codegen_state(state: tuple[bool, bool]) -> None:
    global _codegen_state
    binding = llvm()
    lsr, cmov = state
    if lsr != _codegen_state[0]:
        binding.set_option("flowjit", f"-disable-lsr={'false' if lsr else 'true'}")
    if cmov != _codegen_state[1] and host_cpu().triple.startswith("x86_64"):  # an x86 option
        binding.set_option("flowjit", f"-x86-cmov-converter={'true' if cmov else 'false'}")
    _codegen_state = state


@contextlib.contextmanager
def codegen_options(strength_reduction: bool = False, cmov_conversion: bool = True):
    """LLVM's code generation with loop strength reduction and x86's cmov conversion on or off.
    They are LLVM command-line options, global to the process: code generations wanting other
    settings wait for the running ones, and LLVM's defaults come back when the last one ends, so
    that another llvmlite user in the process (numba) keeps them. Setting one costs a fraction of a
    millisecond. Not to be nested with other settings on one thread (it would wait for itself until
    `CODEGEN_WAIT_S`)."""
    global _codegen_users
    state = (strength_reduction, cmov_conversion)
    with _codegen:
        if not _codegen.wait_for(lambda: _codegen_users == 0 or _codegen_state == state, timeout=CODEGEN_WAIT_S):
            raise CompileError(f"internal error: code generation waited {CODEGEN_WAIT_S} s for another one")
        _set_codegen_state(state)
        _codegen_users += 1
    try:
        yield
    finally:
        with _codegen:
            _codegen_users -= 1
            if _codegen_users == 0:
                _set_codegen_state(_DEFAULTS)
                _codegen.notify_all()


def codegen_settings(kernel_kinds) -> tuple[bool, bool]:
    """(strength_reduction, cmov_conversion) of `codegen_options` for a function whose lowering made
    kernels of `kernel_kinds` (`MlirModule.kernel_kinds`): loop strength reduction for functions
    whose main work is row-tile nests (softmax, layer norm: slightly faster with it, for little
    compile time), not for those with packed matmul kernels (no faster, and a longer code
    generation); x86's cmov conversion off for functions with sort kernels, whose merge loop picks
    between two runs' heads unpredictably (see the comment above `_codegen`)."""
    return "row_nest" in kernel_kinds and "matmul" not in kernel_kinds, "sort" not in kernel_kinds


# Loads whatever defines the given symbols (the precompiled libraries) before code calling them is linked.
Resolver = Callable[[Iterable[str]], None]


def jit_compile(
    module, tm, strength_reduction: bool = False, cmov_conversion: bool = True, resolve: Resolver | None = None
) -> NativeModule:
    """MCJIT-compile an optimized llvmlite module; also captures its object code for the disk cache.
    `strength_reduction`, `cmov_conversion`: see `codegen_options`; `resolve`: called with the
    module's undefined symbols before linking, to load what defines them (`libraries.resolve`)."""
    binding = llvm()
    captured: dict[str, bytes] = {}
    if resolve is not None:
        resolve(undefined_symbols(module))
    with _lock, codegen_options(strength_reduction, cmov_conversion):
        engine = binding.create_mcjit_compiler(module, tm)
        engine.set_object_cache(lambda mod, buf: captured.setdefault("obj", bytes(buf)), lambda mod: None)
        engine.finalize_object()
        objects = (captured["obj"],) if "obj" in captured else ()
        check_objects(objects)  # before anything runs: static constructors, the function
        engine.run_static_constructors()
    return NativeModule(engine, objects, engine.get_function_address)


@functools.cache
def _object_linker():
    """This process's linker of object code (`load_objects`): ORC's LLJIT on JITLink."""
    return llvm().create_lljit_compiler(target_machine(), use_jit_link=True)


_linked = itertools.count()  # each link is a library of its own, named uniquely in the process


def load_objects(objects: tuple[bytes, ...], name: str, resolve: Resolver | None = None) -> NativeModule:
    """Link object code (from the disk cache, the precompiled libraries, or the parts
    `parallel_codegen` compiled) into this process as one library, without MLIR or LLVM
    optimization: its objects' references to each other and to the process's symbols resolved
    (`resolve`, as for `jit_compile`, first loads what defines them).

    Through JITLink, not MCJIT's RuntimeDyld: JITLink maps all sections of an object in one
    allocation and builds the GOT entries and call stubs of its external references inside it, so
    an object's 32-bit pc-relative references (the small code model of the precompiled
    libraries) cannot overflow wherever the allocation lands; a reference that still cannot
    reach is an error, not an abort. RuntimeDyld maps each section apart: after JAX had compiled in
    the process, the matmul library's code and data landed more than 2 GiB apart, and its
    assertion on the overflowing relocation aborted the process."""
    binding = llvm()
    with _lock:
        undefined, exported = set(), set()
        for object_code in objects:
            for symbol, scope, section in _elf_symbols(object_code):
                if section == 0:
                    undefined.add(symbol)
                elif scope in (_ELF_GLOBAL, _ELF_WEAK):
                    exported.add(symbol)
        if resolve is not None:
            resolve(undefined)
        check_objects(objects)
        builder = binding.JITLibraryBuilder()
        for object_code in objects:
            builder.add_object_img(object_code)
        for symbol in undefined - exported:
            builder.import_symbol(symbol, binding.address_of_symbol(symbol))
        for symbol in exported:
            builder.export_symbol(symbol)
        try:
            library = builder.link(_object_linker(), f"{name}.{next(_linked)}")
        except RuntimeError as e:
            raise CompileError(
                f"internal error: linking the object code of '{name}' failed: {e} (the JIT session error printed "
                f"before says why)"
            ) from None
    addresses = {symbol: library[symbol] for symbol in exported}
    return NativeModule(library, tuple(objects), lambda symbol: addresses.get(symbol, 0))


_ELF_GLOBAL, _ELF_WEAK = 1, 2  # symbol bindings (`_elf_symbols`)


def emit_assembly(module, tm, strength_reduction: bool = False, cmov_conversion: bool = True) -> str:
    """Host assembly of an optimized module (the "asm" stage)."""
    with _lock, codegen_options(strength_reduction, cmov_conversion):
        return tm.emit_assembly(module)


def emit_object(
    llvm_ir: str, name: str, strength_reduction: bool = False, cmov_conversion: bool = True, light: bool = False
) -> bytes:
    """Position-independent object code (small code model) for ahead-of-time shared libraries and
    the precompiled libraries, which `load_objects` links; `light`: `pipeline.LIGHT_PASSES` instead
    of O3."""
    module, tm = optimize(llvm_ir, name, reloc="pic", light=light)
    with _lock, codegen_options(strength_reduction, cmov_conversion):
        return tm.emit_object(module)


def versions() -> dict[str, str]:
    """Toolchain versions that go into compile-cache keys (without importing `mlir`)."""
    import llvmlite

    return {
        "llvmlite": llvmlite.__version__,
        "llvm": ".".join(str(v) for v in llvm().llvm_version_info),
        "mlir": _mlir_version(),
    }


def _mlir_version() -> str:
    """The MLIR bindings' distribution (`mlir_pipeline.mlir_distribution`), which the CPU backend needs."""
    version = mlir_pipeline.mlir_distribution()
    if version is None:
        raise CompileError("the MLIR Python bindings (package xtc-mlir-python-bindings) are not installed")
    return version
