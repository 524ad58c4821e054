"""Running MLIR pass pipelines on the lowering's text, for any target.

Everything that touches the `mlir` bindings lives here: the process's one context, the pass
managers (reused, one per pipeline), parsing with a readable error, the verifier, the reproducer
a failed pipeline leaves behind, the transform-dialect schedule's interpreter, and the translation
of an LLVM-dialect module to LLVM IR. A target's backend says which pipelines run in which order
(the CPU's stage table: `backends/cpu/pipeline.py`); this module only runs them.

All calls into MLIR hold `lock()`, which a backend's own native-code calls may share (the CPU's
llvmlite calls do: a process forked to run a part's pipelines must find no thread inside either).
"""

from __future__ import annotations

import functools
import math
import os
import re
import tempfile
import threading

from flowjit.errors import CompileError
from flowjit.passes import dump

_lock = threading.RLock()


def mlir_distribution() -> str | None:
    """The installed MLIR bindings' distribution (its dist-info folder name), found without
    importing `mlir` (`importlib.metadata` scans every installed distribution, a fifth of a warm
    start); None where they are not installed (a GPU machine running cached code)."""
    import importlib.util

    spec = importlib.util.find_spec("mlir")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = list(spec.submodule_search_locations)[0]
    site = os.path.dirname(package)
    for name in sorted(os.listdir(site)):
        if name.endswith(".dist-info") and "mlir" in name.lower():
            return name.removesuffix(".dist-info")
    return package


def lock() -> threading.RLock:
    """The lock held around every MLIR call (and the CPU backend's LLVM calls)."""
    return _lock


@functools.cache
def mlir_context():
    """One MLIR context per process (creating one costs milliseconds; parsing is guarded by a lock).
    Without MLIR's thread pool: our module is one function, so the pool never had work to share, and
    a process forked after the pool started has none of its threads, so the child's first parse
    (parallel verification) waited on them forever."""
    from mlir import ir

    context = ir.Context()
    context.enable_multithreading(False)
    return context


def pass_manager(pipeline: str):
    """A pass manager for `pipeline`. The MLIR verifier runs after every pass only with
    `FLOWJIT_VERIFY=1` (the test suite): it costs about a sixth of the pipelines' time. Without it
    the input is still verified when parsed and the result once at the end (`verify`)."""
    return _reused_pass_manager(pipeline, dump.verify_enabled())


@functools.lru_cache(maxsize=16)
def _reused_pass_manager(pipeline: str, verify: bool):
    """One pass manager per pipeline and process (used under `_lock`): a pass manager initializes
    its passes on its first run only (each canonicalize collects the patterns of every loaded op,
    conversions build theirs), which costs about a millisecond per compile, most of a tiny
    function's MLIR half."""
    from mlir.passmanager import PassManager

    pm = PassManager.parse(pipeline, context=mlir_context())
    pm.enable_verifier(verify)
    return pm


def module_pipeline(passes) -> str:
    """The 'builtin.module(...)' pipeline running `passes` (pass names, with their options) in order."""
    return f"builtin.module({','.join(passes)})"


def parse(text: str):
    """Parse MLIR text into a module (in `mlir_context()`, under `lock()`); a generated module that
    does not parse is an internal error that shows the text."""
    from mlir import ir

    try:
        return ir.Module.parse(text)
    except Exception as e:  # the bindings raise MLIRError with diagnostics
        raise CompileError(f"internal error: generated MLIR does not parse:\n{e}\n--- MLIR ---\n{text}") from None


def _join(pipelines: list[str]) -> str:
    """One 'builtin.module(...)' pipeline from several."""
    prefix = "builtin.module("
    if not all(p.startswith(prefix) and p.endswith(")") for p in pipelines):
        raise CompileError(f"internal error: pipelines must be '{prefix}...)' strings; found {pipelines}")
    return prefix + ",".join(p[len(prefix) : -1] for p in pipelines) + ")"


def run_pipeline(module, pipeline: str, repro_text) -> None:
    """Run `pipeline` on `module`; on failure save the input (`repro_text()`) and say how to rerun it."""
    try:
        pass_manager(pipeline).run(module.operation)
    except Exception as e:
        repro = _repro(repro_text(), pipeline)
        raise CompileError(f"internal error: MLIR pipeline failed: {pipeline}\n{e}\n{repro}") from None


def verify(module) -> None:
    """Verify the final module once when the verifier did not run after every pass."""
    if dump.verify_enabled():
        return
    try:
        module.operation.verify()
    except Exception as e:
        raise CompileError(f"internal error: the MLIR pipelines produced invalid IR:\n{e}") from None


def run_mlir(text: str, pipelines: list[str]) -> str:
    """Parse MLIR text, run each pass pipeline (a 'builtin.module(...)' string), return MLIR text."""
    with _lock, mlir_context():
        module = parse(text)
        # One pass manager for all pipelines: the input text is then the reproducer of a failure.
        run_pipeline(module, _join(pipelines), lambda: text)
        verify(module)
        return str(module)


def _repro(text: str, pipeline: str) -> str:
    """Save the input of a failed pipeline and say how to rerun it."""
    fd, path = tempfile.mkstemp(prefix="flowjit-failed-", suffix=".mlir")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    command = f"from flowjit.backends.mlir import pipeline; pipeline.run_mlir(open({path!r}).read(), [{pipeline!r}])"
    return f'input saved to {path}; reproduce with: python -c "{command}"'


def apply_schedule(module) -> bool:
    """Run the module's transform-dialect schedule (`transform.named_sequence @__transform_main`
    inside a module carrying `transform.with_named_sequence`), if it has one, and erase it, so the
    payload is an ordinary module again. True if there was a schedule."""
    if "transform.with_named_sequence" not in module.operation.attributes:
        return False
    try:
        pass_manager("builtin.module(transform-interpreter)").run(module.operation)
    except Exception as e:
        raise CompileError(f"internal error: transform schedule failed:\n{e}") from None
    for op in list(module.body.operations):
        if op.operation.name == "transform.named_sequence":
            op.operation.erase()
    del module.operation.attributes["transform.with_named_sequence"]
    return True


def check_lowered(module, dialects: tuple[str, ...] = ("llvm", "omp")) -> None:
    """Ops of other dialects than `dialects` left behind by the pipeline are an internal error (the
    translation to LLVM IR would crash on them)."""
    from mlir import ir

    prefixes = tuple(f"{d}." for d in dialects)
    leftovers: set[str] = set()

    def visit(op):
        name = op.name
        if not name.startswith(prefixes) and name != "builtin.module":
            leftovers.add(name)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if leftovers:
        raise CompileError(
            f"internal error: ops not lowered to the LLVM dialect: {', '.join(sorted(leftovers))}"
            f"\n--- MLIR ---\n{module}"
        )


def ops_named(module, name: str) -> list:
    """The ops of `module` named `name`, outermost first."""
    from mlir import ir

    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def translate(module) -> str:
    """LLVM IR of a module the pipelines lowered, once it is verified and holds only LLVM-dialect
    and OpenMP ops (the translation would crash on any other)."""
    from mlir.dialects import llvm as llvm_dialect

    verify(module)
    check_lowered(module)
    return str(llvm_dialect.translate_module_to_llvmir(module.operation))


def largest_plain_kernel(module) -> int:
    """Elements of the largest linalg op (fills aside) left in `module` after its transform schedule:
    the largest operand or result, a lower bound of its iteration space."""
    from mlir import ir

    largest = 0

    def visit(op):
        nonlocal largest
        name = op.name
        if name.startswith("linalg.") and name not in _NOT_KERNELS:
            for value in (*op.operands, *op.results):
                shaped = value.type
                if isinstance(shaped, ir.ShapedType) and shaped.has_static_shape:
                    largest = max(largest, math.prod(shaped.shape))
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return largest


# linalg ops that are not kernels of their own: fills (accumulator initializations a schedule did not
# fold, memsets) and the body ops of a generic.
_NOT_KERNELS = frozenset({"linalg.fill", "linalg.yield", "linalg.index"})


# MLIR lowers a `memref.copy` between memrefs that are not both contiguous to a call of its C runner
# library's `memrefCopy`, which native code here cannot call. The lowerings avoid such copies, but
# MLIR's folding can still make one (a fused kernel whose body folds to the identity, `x[::2] << 0`,
# is erased and its strided input copied to the output). Such a module is lowered again with every
# `memref.copy` after bufferization rewritten as `linalg.copy`, which becomes loops.
COPY_CALL = "@memrefCopy("
_MEMREF_COPY = re.compile(r"^(\s*)memref\.copy (\S+), (\S+) : (.+) to (.+)$", re.MULTILINE)


def copies_as_loops(bufferized: str) -> str:
    """Bufferized MLIR text with each `memref.copy` replaced by the equivalent `linalg.copy`."""
    return _MEMREF_COPY.sub(r"\1linalg.copy ins(\2 : \4) outs(\3 : \5)", bufferized)
