"""The GPU compiler driver: optimized flowjit graph -> one PTX text per kernel.

The stages and their passes are one table in `pipeline.py`. The texts this driver keeps are the
stages "mlir" (the lowering), "gpu-mlir" (after "gpu-kernels": host code launching outlined
`gpu.func` kernels) and "ptx" (each kernel's PTX under a header naming the `file:line` of the
ops it computes).

Where each kernel comes from: every line the GPU's lowerings write carries the MLIR location of
the flowjit op it lowers (`located`), which MLIR keeps through fusion, bufferization and
outlining; the kernel's header lists the locations of the ops inside it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from flowjit.backends.gpu.launch import mlir_location
from flowjit.backends.gpu.pipeline import GpuOptions, stage_pipeline
from flowjit.backends.gpu.plan import LaunchPlan, check_against_ptx, extract_plan
from flowjit.backends.gpu.row_stages import split_row_stages
from flowjit.backends.gpu.target import GPU, check_graph
from flowjit.backends.gpu.wide_accesses import wide_accesses
from flowjit.backends.mlir import pipeline as mlir_pipeline
from flowjit.backends.mlir.lowering import MlirModule, lower_graph
from flowjit.errors import CompileError
from flowjit.ir.graph import Graph


@dataclass(frozen=True)
class Kernel:
    """One outlined kernel: its symbol, the `file:line`s of the ops it computes, and its PTX."""

    name: str
    members: tuple[str, ...]
    ptx: str


@dataclass(frozen=True)
class GpuModule:
    """What compiling a graph for the GPU produced: the stage texts, the kernels and the launch plan
    (`plan.py`: the host function as data, which the runtime replays)."""

    mlir: MlirModule
    gpu_mlir: str
    kernels: tuple[Kernel, ...]
    plan: LaunchPlan

    def ptx_text(self) -> str:
        """Stage 'ptx': every kernel's PTX under a header naming its members."""
        parts = []
        for k in self.kernels:
            members = ", ".join(k.members) or "<no op's line: a copy or fill that bufferization added>"
            parts.append(f"// ---- kernel {k.name}: {members}\n{k.ptx}")
        return "\n".join(parts)


# --- locations ---------------------------------------------------------------------------------

_SINGLE_LINE_OP = re.compile(r"^\s*(%\S+ = |linalg\.yield |bufferization\.materialize_in_destination )[^{]*$")
_REGION_END = re.compile(r"^\s*\} -> ")


def located(fn):
    """A tensor lowering whose emitted ops carry `op`'s location (those an inner lowering located
    already keep theirs: a fused body's ops name their own lines)."""

    @functools.wraps(fn)
    def lower(em, op, operands):
        start = len(em.body)
        results = fn(em, op, operands)
        loc = mlir_location(op)
        if loc:
            for i in range(start, len(em.body)):
                line = em.body[i]
                if "loc(" not in line and "//" not in line and (_SINGLE_LINE_OP.match(line) or _REGION_END.match(line)):
                    em.body[i] = f"{line} {loc}"
        return results

    return lower


for _name, _fn in list(GPU.lowerings.tensor.items()):
    GPU.lowerings.tensor[_name] = located(_fn)

_FILE_LINE = re.compile(r'"((?:[^"\\]|\\.)*)":(\d+):\d+')


def _members(kernel_module) -> tuple[str, ...]:
    """The `file:line`s of the ops in a `gpu.module`, in order of first appearance."""
    from mlir import ir

    seen: dict[str, None] = {}

    def visit(op):
        for file, line in _FILE_LINE.findall(str(op.location)):
            if file == "-":  # where the parser read an op the lowering gave no location (`copies_as_kernels`)
                continue
            seen.setdefault(f"{file}:{line}", None)
        return ir.WalkResult.ADVANCE

    kernel_module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return tuple(seen)


# --- stages ------------------------------------------------------------------------------------


def generate_mlir(graph: Graph) -> MlirModule:
    """Stage 'mlir': the graph on tensors with the GPU's lowerings, after `check_graph`; fused regions
    with a partial row part split into stages first (`row_stages.split_row_stages`)."""
    check_graph(graph)
    return lower_graph(split_row_stages(graph), GPU)


# Ops the host function may keep once every loop nest became a kernel: launches, constants, index
# arithmetic, buffer allocation and views, and serial loops around launches (a reduction over
# outer axes launches its inner parallel loop once per step). Any other (a load, a store, a copy, a loop) would touch
# device memory from the host.
_HOST_OPS = re.compile(
    r"^(gpu\.launch_func|gpu\.module|gpu\.binary|arith\.\w+|func\.\w+|builtin\.module|memref\.(alloc|dealloc|"
    r"collapse_shape|expand_shape|subview|reinterpret_cast|cast|view|extract_strided_metadata)|"
    r"affine\.apply|ub\.poison|scf\.for|scf\.yield)$"
)


def _host_leftovers(module) -> list[str]:
    """Ops outside the kernels that would run on the host on device buffers."""
    from mlir import ir

    found: dict[str, None] = {}

    def visit(op):
        name = op.name
        if name == "gpu.module":
            return ir.WalkResult.SKIP
        if not _HOST_OPS.match(name):
            found.setdefault(f"{name} at {op.location}", None)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return list(found)


# Ops that read a constant global (`memref.get_global`) or view what it returned, with the index
# constants they take: moved into the launches that use them.
_GLOBAL_READS = frozenset(
    (
        "memref.get_global",
        "memref.view",
        "memref.expand_shape",
        "memref.collapse_shape",
        "memref.reinterpret_cast",
        "memref.subview",
        "memref.cast",
        "arith.constant",
    )
)


def _reads_a_global(op) -> bool:
    """Whether `op` is a chain of `_GLOBAL_READS` ending in a `memref.get_global`."""
    from mlir import ir

    name = op.operation.name
    if name == "memref.get_global":
        return True
    if name == "arith.constant" or name not in _GLOBAL_READS:
        return False
    sources = [v.owner for v in op.operation.operands if isinstance(v, ir.OpResult)]
    return any(_reads_a_global(source) for source in sources)


def globals_into_launches(module) -> None:
    """Each `gpu.launch` gets its own copy of the host ops that read constant globals it uses (a
    multi-valued constant's `memref.get_global` and its views), so that `gpu-kernel-outlining`
    copies the globals into the kernel's `gpu.module`: the kernel reads the constant from device
    memory of its own module, not from a host global."""
    for launch in mlir_pipeline.ops_named(module, "gpu.launch"):
        _globals_into_launch(launch)


def _globals_into_launch(launch) -> None:
    from mlir import ir

    start = ir.InsertionPoint(launch.regions[0].blocks[0].operations[0])
    copies: dict = {}  # host value -> its copy inside the launch

    def copy_of(value):
        if value in copies:
            return copies[value]
        source = value.owner.operation
        inside = {  # the operands' copies first: each copy goes after the ones made before it
            i: copy_of(operand)
            for i, operand in enumerate(source.operands)
            if isinstance(operand, ir.OpResult) and operand.owner.operation.name in _GLOBAL_READS
        }
        clone = source.clone(ip=start)
        for i, operand in inside.items():
            clone.operands[i] = operand
        for old, new in zip(source.results, clone.results):
            copies[old] = new
        return copies[value]

    inner = []

    def collect(op):
        inner.append(op)
        return ir.WalkResult.ADVANCE

    for block in launch.regions[0].blocks:
        for op in block.operations:
            op.operation.walk(collect, ir.WalkOrder.PRE_ORDER)
    for op in inner:
        for i, operand in enumerate(op.operands):
            if not isinstance(operand, ir.OpResult):
                continue
            owner = operand.owner.operation
            if not _inside(owner, launch.operation) and _reads_a_global(owner):
                op.operands[i] = copy_of(operand)


def contiguous_dimension_first(module) -> None:
    """Reorder the loops of every `linalg.generic` of rank 2 or more: first the loop over the
    innermost dimension of its (first) output that has more than one element, then its other
    parallel loops, then its reductions.

    The `gpu-launches` stage gives the first loop of each nest to the threads of a block (in tiles
    of `block_size`), the other parallel ones to blocks and the reductions to a serial loop inside.
    With the loops in the result's own order, the threads of a warp would walk its first dimension,
    each a row apart in memory (uncoalesced), and a reduction between parallel loops would split
    the nest; with the contiguous dimension first, consecutive threads touch consecutive elements.
    Loop order is free in a generic: its indexing maps and its `linalg.index` ops are rewritten for
    the new order."""
    from mlir import ir

    for op in mlir_pipeline.ops_named(module, "linalg.generic"):
        order = _contiguous_first_order(op)
        if order is None or order == sorted(order):
            continue
        new_position = [order.index(d) for d in range(len(order))]
        renamed = ir.AffineMap.get_permutation(new_position)
        maps = [ir.AffineMapAttr(m).value for m in op.attributes["indexing_maps"]]
        op.attributes["indexing_maps"] = ir.ArrayAttr.get(
            [
                ir.AffineMapAttr.get(ir.AffineMap.get(m.n_dims, m.n_symbols, [e.compose(renamed) for e in m.results]))
                for m in maps
            ]
        )
        iterators = list(op.attributes["iterator_types"])
        op.attributes["iterator_types"] = ir.ArrayAttr.get([iterators[d] for d in order])
        for inner in op.regions[0].blocks[0].operations:
            if inner.operation.name == "linalg.index":
                dim = ir.IntegerAttr(inner.attributes["dim"]).value
                inner.attributes["dim"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), new_position[dim])


def _contiguous_first_order(op) -> list[int] | None:
    """The new loop order of generic `op` (`contiguous_dimension_first`): new loop j is old loop
    order[j]; None when it has fewer than two loops or no output dimension to put first."""
    from mlir import ir

    parallel = ["parallel" in str(i) for i in op.attributes["iterator_types"]]
    if len(parallel) < 2:
        return None
    inputs = ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"])[0]
    output_map = ir.AffineMapAttr(op.attributes["indexing_maps"][inputs]).value
    extents = ir.ShapedType(op.operands[inputs].type).shape
    first = None
    for expr, extent in reversed(list(zip(output_map.results, extents))):
        expr = expr.maybe_downcast()
        if extent != 1 and isinstance(expr, ir.AffineDimExpr):
            first = expr.position
            break
    if first is None:
        return None
    others = [d for d in range(len(parallel)) if d != first]
    return [first, *[d for d in others if parallel[d]], *[d for d in others if not parallel[d]]]


def _inside(op, ancestor) -> bool:
    parent = op.parent
    while parent is not None:
        if parent == ancestor:
            return True
        parent = parent.parent
    return False


_MEMREF_COPY = re.compile(r"^(\s*)memref\.copy (\S+), (\S+) : (.+?) to (.+?)( loc\([^()]*\))?$", re.MULTILINE)
_SCALAR_MEMREF = re.compile(r"^memref<([a-z]+\d*)>$")


def copies_as_kernels(bufferized: str) -> str:
    """Bufferized MLIR text (with locations) with each `memref.copy` written as a `linalg.copy`,
    which becomes a kernel; a copy of one element (rank 0) through views of rank 1, since a copy
    with no parallel dimension would stay on the host."""
    count = 0

    def rewrite(m: re.Match) -> str:
        nonlocal count
        indent, source, dest, source_type, dest_type, loc = m.groups()
        loc = loc or ""
        scalar = _SCALAR_MEMREF.match(source_type)
        if scalar is None or _SCALAR_MEMREF.match(dest_type) is None:
            return f"{indent}linalg.copy ins({source} : {source_type}) outs({dest} : {dest_type}){loc}"
        count += 1
        one = f"memref<1x{scalar.group(1)}>"
        a, b = f"%fj_copy{count}_in", f"%fj_copy{count}_out"
        return (
            f"{indent}{a} = memref.expand_shape {source} [] output_shape [1] : {source_type} into {one}{loc}\n"
            f"{indent}{b} = memref.expand_shape {dest} [] output_shape [1] : {dest_type} into {one}{loc}\n"
            f"{indent}linalg.copy ins({a} : {one}) outs({b} : {one}){loc}"
        )

    return _MEMREF_COPY.sub(rewrite, bufferized)


_ASSEMBLY = re.compile(r'assembly = "((?:[^"\\]|\\.)*)"')


def _unescape(text: str) -> str:
    """An MLIR string attribute's text (`\\XX` hex escapes, `\\\\`, `\\"`) as Python text."""
    return re.sub(
        r"\\([0-9A-Fa-f]{2}|\\|\")", lambda m: m.group(1) if len(m.group(1)) == 1 else chr(int(m.group(1), 16)), text
    )


def _ptx_of(binary_op) -> str:
    match = _ASSEMBLY.search(str(binary_op))
    if match is None:
        raise CompileError(f"internal error: no PTX in {str(binary_op)[:200]}")
    return _unescape(match.group(1))


_EXTERN = re.compile(r"^\.extern \.func.*?(\w+)\s*\(", re.MULTILINE)


def lower_to_ptx(graph: Graph, options: GpuOptions) -> GpuModule:
    """Run the stage table on `graph`: the 'mlir' and 'gpu-mlir' texts and each kernel's PTX."""
    mlir = generate_mlir(graph)
    with mlir_pipeline.lock(), mlir_pipeline.mlir_context():
        module = mlir_pipeline.parse(mlir.text)
        mlir_pipeline.run_pipeline(module, stage_pipeline("bufferize", options=options), lambda: mlir.text)
        # A copy MLIR's folding left between buffers would run on the host: as a linalg.copy, it
        # becomes a kernel like the others.
        bufferized = module.operation.get_asm(enable_debug_info=True)  # the ops' locations too
        if "memref.copy" in bufferized:
            bufferized = copies_as_kernels(bufferized)
            module = mlir_pipeline.parse(bufferized)
        mlir_pipeline.run_pipeline(module, stage_pipeline("generalize", options=options), lambda: bufferized)
        contiguous_dimension_first(module)
        wide_accesses(module)
        mlir_pipeline.run_pipeline(module, stage_pipeline("gpu-launches", options=options), lambda: bufferized)
        globals_into_launches(module)
        launched = str(module)
        mlir_pipeline.run_pipeline(module, stage_pipeline("gpu-kernels", options=options), lambda: launched)
        leftovers = _host_leftovers(module)
        if leftovers:
            raise CompileError(
                "internal error: the GPU pipeline left ops on the host that would read or write device "
                f"memory there: {'; '.join(leftovers)}"
            )
        gpu_mlir = str(module)
        plan = extract_plan(module, mlir.entry, len(mlir.inputs), len(mlir.outputs))
        members = {
            op.sym_name.value: _members(op) for op in module.body.operations if op.operation.name == "gpu.module"
        }
        mlir_pipeline.run_pipeline(module, stage_pipeline("nvvm", options=options), lambda: gpu_mlir)
        kernels = tuple(
            Kernel(op.sym_name.value, members.get(op.sym_name.value, ()), _ptx_of(op))
            for op in module.body.operations
            if op.operation.name == "gpu.binary"
        )
    for kernel in kernels:
        externs = _EXTERN.findall(kernel.ptx)
        if externs:
            raise CompileError(
                f"internal error: kernel {kernel.name} ({', '.join(kernel.members)}) calls functions no PTX "
                f"defines: {', '.join(externs)}"
            )
    check_against_ptx(plan, {k.name: k.ptx for k in kernels})
    return GpuModule(mlir, gpu_mlir, kernels, plan)
