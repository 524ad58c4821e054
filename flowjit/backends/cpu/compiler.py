"""The CPU compiler driver: optimized flowjit graph -> native code, through the disk cache.

The stages, their passes and the options that select them are one table in `pipeline.py`; the
texts this driver keeps are those of the stages "mlir", "mlir-llvm" (after the "llvm-dialect"
stage), "llvm" and "asm".

A large module is optimized and compiled in parts, one per thread (`parallel_codegen`): the
"llvm" and "asm" stages then show each part under a `---- part k of n` comment line. A function
with a large body is lowered in parts as well (`lower_graph(split=n)`), whose MLIR pipelines run
at once in forked processes (`parallel_mlir`), one LLVM part each. Its stage texts are those of
the whole module (lowered again when asked for), so that "mlir" to "asm" are one module's stages
and "mlir" parses as one module; `python benchmarks/compile_time.py` shows the parts' count.

The MLIR half works on one in-memory module (`toolchain.lower_to_llvm_ir`); stage texts other than
'mlir' are printed only when asked for. A compile-cache hit (see `cache.py`) skips everything but
loading the object code: `mlir` is not even imported. Stages of a cached function are recomputed
from the graph when first asked for.
"""

from __future__ import annotations

import functools
import hashlib
import time

import numpy as np

from flowjit.backends.cpu import cache, libraries, parallel_codegen, parallel_mlir, pipeline, schedule, toolchain
from flowjit.backends.cpu.communication import COMMUNICATION_OPS, link_native_symbols
from flowjit.backends.cpu.executable import CpuExecutable, Layout
from flowjit.backends.cpu.pipeline import CompileOptions
from flowjit.errors import CompileError
from flowjit.ir.builder import single_value
from flowjit.ir.graph import Graph, Value
from flowjit.ir.ops.contraction import conv_params
from flowjit.ir.printer import print_graph
from flowjit.passes import dump

# Modules that fill the CPU's lowering table (`target.CPU`), imported when compiling (not when
# loading from the cache); `target` itself adds the shared lowerings (`backends/mlir/lower_*.py`).
LOWERING_MODULES = (
    "flowjit.backends.cpu.reduction_library",
    "flowjit.backends.cpu.lower_movement",
    "flowjit.backends.cpu.lower_conv",
    "flowjit.backends.cpu.lower_dot",
    "flowjit.backends.cpu.lower_pooling",
    "flowjit.backends.cpu.lower_arg_extreme",
    "flowjit.backends.cpu.lower_communication",
    "flowjit.backends.cpu.lower_fusion",
    "flowjit.backends.cpu.lower_sort",
    "flowjit.backends.cpu.lower_scan",
)

# Ops whose lowerings vectorize every kernel they make with a schedule (or make only views and
# constants), so that LLVM's light pipeline loses nothing on them (`light_pipeline`): these and the
# elementwise and reduction ops (`lower_elementwise`, `lower_reduction`). The others write scalar
# loops that LLVM's O3 vectorizes or speeds up (sort, gather, scatter, control flow, argmax,
# pad copies, communication). Each op below runs as fast under the light pipeline as under O3 and
# compiles faster (docs/cpu-compile-time.md):
# - transpose: a large copy moves in 8x8 blocks or, when the input's rows stay rows, as vector row
#   copies, both scheduled; any other (rank 3+ with ragged blocks) is plain loops, which
#   `PLAIN_LOOP_MAX_ELEMENTS` sends to O3.
# - conv2d with stride 1 only (`_light_op`): its im2col, pad and matmul kernel are vector code (a
#   small pad's copy or the generic conv of a few taps are plain loops, which
#   `PLAIN_LOOP_MAX_ELEMENTS` catches); a strided conv such as the 7x7/2 stem runs slower (its
#   im2col's strided reads).
# - pooling (`reduce_window`): its rows are written out rather than marked for unrolling. Large
#   windows are plain generics, which `PLAIN_LOOP_MAX_ELEMENTS` catches.
# - `cumsum` writes its vector loops itself (`lower_scan`).
# - `concatenate`: every block, short ones too, is a masked vector copy (`_concatenate_blocks`; an
#   empty result makes no loop).
LIGHT_PIPELINE_OPS = frozenset(
    {
        "constant",
        "broadcast",
        "reshape",
        "slice",
        "transpose",
        "dot_general",
        "conv2d",
        "reduce_window",
        "fusion",
        "cumsum",
        "linear_recurrence",
        "concatenate",
    }
)
LIGHT_PIPELINE_LOWERINGS = ("flowjit.backends.mlir.lower_elementwise", "flowjit.backends.mlir.lower_reduction")
# A kernel the transform schedules left as a linalg op (plain loops) up to this many elements does
# not need LLVM's vectorizers (`schedule.PLAIN_LOOP_MAX_ELEMENTS`).
PLAIN_LOOP_MAX_ELEMENTS = schedule.PLAIN_LOOP_MAX_ELEMENTS
# The LLVM metadata of a loop marked for full unrolling, which only LLVM's O3 pipeline honours (no
# lowering marks one: short loops are written out; the check guards any that would).
FULL_UNROLL_METADATA = '!"llvm.loop.unroll.full"'


@functools.cache
def load_lowerings() -> dict:
    """Import every lowering module once; returns the filled `LOWERINGS` table."""
    import importlib

    for name in LOWERING_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a module that exists but fails to import is a bug: surface it
                raise
    from flowjit.backends.cpu.target import LOWERINGS

    return LOWERINGS


def generate_mlir(graph: Graph, options: CompileOptions | None = None, split: int = 1):
    """Stage 'mlir': the generated module and its calling layout (in up to `split` parts)."""
    load_lowerings()
    from flowjit.backends.cpu.target import CPU
    from flowjit.backends.mlir.lowering import lower_graph

    options = options or CompileOptions()
    aliased = dict(options.aliased_inputs)
    return lower_graph(graph, CPU, late_outputs=frozenset(options.late_outputs), aliased=aliased, split=split)


class Stages:
    """All backend stage texts of one function. Compiling keeps only the 'mlir' text (and all of
    them when `FLOWJIT_DUMP_DIR` is set); the others are recomputed from the graph on first use,
    as for a function loaded from the compile cache."""

    NAMES = ("mlir", "mlir-llvm", "llvm", "asm")

    def __init__(self, graph_text: str, name: str, options: CompileOptions):
        self.graph_text = graph_text
        self.name = name
        self.options = options
        self.texts: dict[str, str] = {}
        self.mlir = None  # the MlirModule, when compiled in this process
        # The optimized module, when compiled in this process: [(llvmlite module, target machine)],
        # one per part (`parallel_codegen`), the first defining the entry.
        self.parts: list = []
        self.timings: dict[str, float] = {}  # seconds per phase of the last build
        self.streamed_outputs: tuple[int, ...] = ()  # outputs written with non-temporal stores (`nontemporal`)

    def build(self, graph: Graph | None = None, keep_texts: bool = False) -> None:
        """Lower, run the MLIR pipelines and optimize: `module` is ready for code generation."""
        graph = graph if graph is not None else self._graph()
        t0 = time.perf_counter()
        # Stage texts come from one module: a split function's parts would each show a piece.
        mlir = generate_mlir(graph, self.options, split=1 if keep_texts else parallel_mlir.processes())
        t1 = time.perf_counter()
        lowerings = parallel_mlir.lower_parts(list(mlir.parts or [mlir.text]), self.options, keep_text=keep_texts)
        lowered = lowerings[0]
        if len(lowerings) > 1:  # one LLVM part per MLIR part, the first defining the entry
            pieces = [part.llvm_ir for part in lowerings]
            plain = max(p.plain_loop_elements for p in lowerings)
            streamed = tuple(s for p in lowerings for s in p.streamed)
            lowered = toolchain.LLVMLowering("\n".join(pieces), None, plain, streamed)
        else:
            pieces = parallel_codegen.split_llvm_ir(lowered.llvm_ir, parallel_codegen.threads())
        llvm_ir = lowered.llvm_ir
        t2 = time.perf_counter()
        opt = self.options.opt_level
        light, why = light_pipeline(graph, lowered, opt)
        if len(pieces) == 1:
            self.parts = [toolchain.optimize(llvm_ir, mlir.entry, opt=opt, light=light)]
        else:
            self.parts = parallel_codegen.optimize_parts(pieces, mlir.entry, opt, light)
        modules = [module for module, _ in self.parts]
        expected = len(mlir.inputs) + len(mlir.outputs) + 1
        found = len(list(modules[0].get_function(mlir.entry).arguments))
        if found != expected:  # a memref that missed the bare-pointer convention would crash the call
            raise CompileError(f"internal error: @{mlir.entry} takes {found} arguments; expected {expected} pointers")
        self.timings = {"lower": t1 - t0, "mlir": t2 - t1, "llvm-opt": time.perf_counter() - t2}
        self.mlir = mlir
        first = len(mlir.inputs)  # the entry's (and its parts') arguments: inputs, outputs, workspace
        self.streamed_outputs = tuple(
            sorted({s.argument - first for s in lowered.streamed if first <= s.argument < first + len(mlir.outputs)})
        )
        if not mlir.parts:  # a split function's "mlir" stage is its whole module, made when asked for
            self.texts["mlir"] = mlir.text
        if keep_texts:
            # Printed before code generation, which rewrites the module in place (CodeGenPrepare).
            streamed = "".join(f"; non-temporal stores (nontemporal.py): {s}\n" for s in lowered.streamed)
            llvm = f"; LLVM pipeline: {why}\n{streamed}" + self._joined(lambda module, tm: str(module), ";")
            self.texts.update({"mlir-llvm": lowered.dialect_text, "llvm": llvm})

    def _graph(self) -> Graph:
        """The function's graph again, from its text (a cached function has no other)."""
        from flowjit.ir.parser import parse_graph

        return parse_graph(self.graph_text)

    def _joined(self, text_of, comment: str) -> str:
        """`text_of(module, tm)` of each part, under a `comment` header line when there are several."""
        if len(self.parts) == 1:
            return text_of(*self.parts[0])
        n = len(self.parts)
        return "".join(
            f"{comment} ---- part {k + 1} of {n} (optimized and compiled on a thread of its own) ----\n{text_of(*part)}"
            for k, part in enumerate(self.parts)
        )

    def native(self) -> toolchain.NativeModule:
        """Machine code for the built parts: MCJIT for one, objects made in parallel and linked for several."""
        lsr, cmov = toolchain.codegen_settings(self.mlir.kernel_kinds)
        if len(self.parts) == 1:
            return toolchain.jit_compile(
                *self.parts[0], strength_reduction=lsr, cmov_conversion=cmov, resolve=libraries.resolve
            )
        objects = tuple(parallel_codegen.emit_objects(self.parts, lsr, cmov))
        return toolchain.load_objects(objects, self.mlir.entry, resolve=libraries.resolve)

    def __getitem__(self, stage: str) -> str:
        if stage not in self.NAMES:
            raise KeyError(stage)
        if stage == "mlir" and stage not in self.texts:
            self.texts["mlir"] = generate_mlir(self._graph(), self.options).text
        if stage not in self.texts:
            if "llvm" not in self.texts:  # a fresh module: the compiled one went through code generation
                self.build(keep_texts=True)
            if stage == "asm":
                lsr, cmov = toolchain.codegen_settings(self.mlir.kernel_kinds)
                how = "with" if lsr else "without"
                header = f"# code generation: {how} loop strength reduction (toolchain.codegen_options)\n"
                if not cmov:
                    header += "# code generation: without x86's cmov conversion (branch-free sort merges)\n"
                self.texts["asm"] = header + self._joined(lambda m, tm: toolchain.emit_assembly(m, tm, lsr, cmov), "#")
        return self.texts[stage]

    def __iter__(self):
        return iter(self.NAMES)

    def __contains__(self, stage) -> bool:
        return stage in self.NAMES

    def __len__(self) -> int:
        return len(self.NAMES)

    def keys(self):
        return list(self.NAMES)


def _light_op(op) -> bool:
    """Whether `op` is of `LIGHT_PIPELINE_OPS` (a conv2d only with stride 1 and not summed over its
    taps: a weight gradient, `lower_conv.over_taps`, runs slower under the light pipeline than
    under O3, even with its pad and partial sums in vector code),
    or a pad of edges (`lower_movement.pads_edges`: rows of vector copies and splat writes, like
    a concatenation)."""
    if op.name == "pad":
        from flowjit.backends.cpu.lower_movement import pads_edges

        return pads_edges(op)
    if op.name == "conv2d":
        from flowjit.backends.cpu.lower_conv import over_taps

        if any(s != 1 for s in conv_params(op.attrs)[0]) or over_taps(op.operands[1].type, op.result.type):
            return False
    return op.name in LIGHT_PIPELINE_OPS


def light_pipeline(graph: Graph, lowered: toolchain.LLVMLowering, opt: int) -> tuple[bool, str]:
    """Whether LLVM runs `pipeline.LIGHT_PASSES` instead of O`opt` on this function, and why (the
    "llvm" stage's first line says it): at O2 and O3, when every op (fusion bodies included) is of
    `LIGHT_PIPELINE_OPS` or the elementwise and reduction lowerings, no kernel above
    `PLAIN_LOOP_MAX_ELEMENTS` was left unvectorized, and no loop is marked for full unrolling (which
    only O3's unroll pass does without unrolling other loops too)."""
    from flowjit.backends.cpu.target import LOWERINGS

    if opt < 2:
        return False, f"O{opt}"
    names = {op.name for op in graph.walk() if not _light_op(op)}
    others = sorted(n for n in names if n not in LOWERINGS or LOWERINGS[n].__module__ not in LIGHT_PIPELINE_LOWERINGS)
    if others:
        return False, f"O{opt} (for the scalar loops of: {', '.join(others)})"
    if lowered.plain_loop_elements > PLAIN_LOOP_MAX_ELEMENTS:
        elements = lowered.plain_loop_elements
        return False, f"O{opt} (a kernel of {elements} elements runs as plain loops, vectorized by no schedule)"
    if FULL_UNROLL_METADATA in lowered.llvm_ir:
        return False, f"O{opt} (loops marked for full unrolling)"
    return True, f"light ({', '.join(pipeline.LIGHT_PASSES)}): every kernel vectorized by its schedule"


# Constants of at least this many bytes (not of one value: those are fills) are passed to the
# native code as extra inputs after the function's own, not built into the module
# (`lift_constants`). Built in, each byte goes through MLIR's translation to LLVM IR text and
# llvmlite's parser, about 90 ms per MiB on a 2-core AMD EPYC Zen 4 VM: seconds for one large
# weight, against a fixed cost per module for a small one.
LIFT_MIN_BYTES = 64 << 10


def lift_constants(graph: Graph) -> tuple[Graph, tuple[np.ndarray, ...]]:
    """`graph` with each large top-level constant (`LIFT_MIN_BYTES`, not a splat) replaced by a new
    parameter after the others (named `constN`), and the constants' arrays in parameter order; the
    graph itself when there is none to lift. Constants in loop and branch bodies stay (a region
    sees only its parameters and its own ops; the text form would not parse back): the lowering
    reads the large ones once before the loop (`lower_control._large_constants`)."""
    lifted = [op for op in graph.ops if op.name == "constant" and _liftable(op.attrs["value"])]
    if not lifted:
        return graph, ()
    params = [Value(op.result.type, None, len(graph.params) + i, f"const{i}") for i, op in enumerate(lifted)]
    new = graph.copy({op.result: p for op, p in zip(lifted, params)}, skip=frozenset(id(op) for op in lifted))
    new.params.extend(params)
    return new, tuple(np.ascontiguousarray(op.attrs["value"]) for op in lifted)


def _liftable(value: np.ndarray) -> bool:
    return value.nbytes >= LIFT_MIN_BYTES and not single_value(value)


def _constants_digest(constants: tuple[np.ndarray, ...]) -> str:
    """What the cache key adds for lifted constants: each one's type and a hash of its bytes."""
    digest = hashlib.sha256()
    for array in constants:
        digest.update(f"{array.shape}{array.dtype}".encode())
        digest.update(memoryview(array.reshape(-1).view(np.uint8)))
    return f"// lifted constants: {digest.hexdigest()}\n" if constants else ""


def compile_cpu(graph: Graph, options: CompileOptions | None = None):
    """Compile `graph`, which has no state ops (`stateful.py` functionalizes those first), for the
    host CPU (or load it from the compile cache). Large constants become inputs the executable
    passes itself (`lift_constants`)."""
    options = options or CompileOptions()
    if any(op.name in COMMUNICATION_OPS for op in graph.ops):
        link_native_symbols()  # the runtime functions send/recv call (compiled or loaded code)
    graph, constants = lift_constants(graph)
    graph_text = print_graph(graph)
    key = cache.cache_key(graph_text + _constants_digest(constants), options)
    stages = Stages(graph_text, graph.name, options)
    entry = cache.load(key)
    if entry is None:
        stages.build(graph, keep_texts=dump.dump_dir() is not None)
        t0 = time.perf_counter()
        native = stages.native()
        stages.timings["codegen"] = time.perf_counter() - t0
        mlir = stages.mlir
        inputs, outputs = Layout.of(mlir.inputs), Layout.of(mlir.outputs)
        entry = cache.Entry(native.objects, mlir.entry, mlir.workspace_bytes, inputs, outputs, stages.streamed_outputs)
        cache.store(key, entry)
    else:
        native = toolchain.load_objects(entry.objects, entry.symbol, resolve=libraries.resolve)
    executable = CpuExecutable(native, entry, stages, constants)
    if dump.dump_dir() is not None:
        for stage in Stages.NAMES:
            dump.write_stage(graph.name, stage, stages[stage])
    return executable
