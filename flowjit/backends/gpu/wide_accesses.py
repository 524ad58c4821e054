"""Wide accesses: elementwise kernels whose threads each load and store 16 contiguous bytes.

`wide_accesses` runs on the bufferized module, after `compiler.contiguous_dimension_first` put the
loop over each generic's contiguous dimension first. An all-parallel `linalg.generic` whose first
loop can be read and written in whole vectors is tiled by the vector width along that loop
(`scf.forall`, which `gpu-launches` maps to threads like any parallel loop) and vectorized: each
thread computes `width` consecutive elements with one `vector.load` per operand and one
`vector.store` per result (`ld.global.v4.b32` / `st.global.v4.b32` in the PTX: NVPTX writes 32-bit
accesses untyped), a quarter of the threads and memory instructions of the scalar kernel for
float32. A broadcast operand (one that
does not vary along the first loop) is read as one element.

The width is 16 bytes' worth of the widest element the first loop walks (4 float32, 8 float16 or
bfloat16, 2 float64). A generic keeps its scalar kernel unless all of these hold:
- its body is arithmetic and math only (no `tensor.extract`, loop or call: those read at computed
  indices, which a vector load does not);
- every operand that varies along the first loop has it as its innermost index, with unit stride;
- the first loop's extent is a multiple of the width;
- every such operand's view starts a multiple of `width` elements into its buffer, and its other
  strides are multiples of `width`, so that every thread's vector starts at a multiple of its own
  size: buffers themselves start 16-byte aligned (`plan.BUFFER_ALIGNMENT`: the runtime's and the
  AOT library's allocations are; a `DeviceArray` from elsewhere that is not comes through the host).
  The typed `memref.view`s of bytes, whose start the memref type does not show, start aligned too:
  a workspace slot is a buffer of its own in the launch plan, and a constant is viewed from byte 0
  of its global (`.align 64`).
"""

from __future__ import annotations

from flowjit.backends.gpu.plan import BUFFER_ALIGNMENT
from flowjit.backends.mlir import pipeline as mlir_pipeline
from flowjit.errors import CompileError

# Bytes each thread loads or stores per operand in one access: the widest global access of PTX,
# and no more than every buffer's alignment.
ACCESS_BYTES = min(16, BUFFER_ALIGNMENT)
# Element types a vector may hold: whole bytes (an i1 memref element is a byte, an i1 vector a bit).
_ELEMENT_BITS = (8, 16, 32, 64)
# Ops a vectorized body may hold: they compute on vectors elementwise.
_ELEMENTWISE_DIALECTS = ("arith.", "math.")


def wide_accesses(module) -> None:
    """Tile and vectorize every elementwise generic of `module` that can use wide accesses (see the
    module docstring for when), along its first loop; the others keep their scalar kernels."""
    from mlir import ir
    from mlir.dialects.transform import interpreter

    tile_lists: set[tuple[int, ...]] = set()
    for op in mlir_pipeline.ops_named(module, "linalg.generic"):
        width = vector_width(op)
        if width is None:
            continue
        tiles = (width, *[1] * (len(op.attributes["iterator_types"]) - 1))
        op.attributes["fj.wide"] = ir.DenseI64ArrayAttr.get(list(tiles))
        tile_lists.add(tiles)
    if not tile_lists:
        return
    schedule = ir.Module.parse(_schedule(sorted(tile_lists)))
    try:
        interpreter.apply_named_sequence(module.operation, schedule.body.operations[0], schedule)
    except Exception as e:  # the MLIR error: a schedule that fails is our defect
        raise CompileError(f"internal error: vectorizing the elementwise kernels failed:\n{e}") from None
    _aligned_vector_accesses(module)


def vector_width(op) -> int | None:
    """Elements per thread for generic `op` with wide accesses, or None where it must stay scalar."""
    from mlir import ir

    if any("parallel" not in str(kind) for kind in op.attributes["iterator_types"]):
        return None
    for inner in op.regions[0].blocks[0].operations:
        name = inner.operation.name
        if name != "linalg.yield" and not name.startswith(_ELEMENTWISE_DIALECTS):
            return None
    maps = [ir.AffineMapAttr(m).value for m in op.attributes["indexing_maps"]]
    walking = []  # the memref types of the operands the first loop walks
    for operand, indexing in zip(op.operands, maps):
        uses = [i for i, e in enumerate(indexing.results) if _uses_first_loop(e)]
        if not uses:
            continue  # broadcast along the first loop: one element per thread
        if uses != [len(indexing.results) - 1] or not _is_first_loop(indexing.results[-1]):
            return None
        walking.append(ir.MemRefType(operand.type))
    if not walking or any(not _whole_bytes(t.element_type) for t in walking):
        return None
    width = ACCESS_BYTES * 8 // max(_bits(t.element_type) for t in walking)
    if width < 2:
        return None
    for t in walking:
        if not _vector_aligned(t, width):
            return None
    return width


def _vector_aligned(t, width: int) -> bool:
    """Whether every `width` consecutive elements of memref type `t` that start at a multiple of
    `width` along its innermost dimension start at a multiple of `width` elements in its buffer,
    and that dimension splits into such vectors."""
    from mlir import ir

    if not t.has_static_shape:
        return False
    strides, offset = t.get_strides_and_offset()
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    if offset == dynamic or any(s == dynamic for s in strides):
        return False
    if t.shape[-1] % width or strides[-1] != 1 or offset % width:
        return False
    return all(stride % width == 0 for stride, size in zip(strides[:-1], t.shape[:-1]) if size != 1)


def _uses_first_loop(expr) -> bool:
    from mlir import ir

    return any(
        isinstance(e.maybe_downcast(), ir.AffineDimExpr) and e.maybe_downcast().position == 0 for e in _walk(expr)
    )


def _walk(expr):
    from mlir import ir

    expr = expr.maybe_downcast()
    yield expr
    if isinstance(expr, ir.AffineBinaryExpr):
        yield from _walk(expr.lhs)
        yield from _walk(expr.rhs)


def _is_first_loop(expr) -> bool:
    from mlir import ir

    expr = expr.maybe_downcast()
    return isinstance(expr, ir.AffineDimExpr) and expr.position == 0


def _bits(element_type) -> int:
    """The width in bits of an integer or float type; 0 for any other (index)."""
    from mlir import ir

    element_type = element_type.maybe_downcast()
    return element_type.width if isinstance(element_type, (ir.IntegerType, ir.FloatType)) else 0


def _whole_bytes(element_type) -> bool:
    return _bits(element_type) in _ELEMENT_BITS


def _schedule(tile_lists) -> str:
    """The transform schedule: each marked generic tiled into an `scf.forall` by its tile sizes
    (the width along the first loop, 1 along the others) and vectorized; then the transfers as
    plain vector loads and stores of one dimension (a broadcast operand: a scalar load)."""
    steps = []
    for i, tiles in enumerate(tile_lists):
        sizes = ", ".join(map(str, tiles))
        steps.append(
            f'    %g{i} = transform.structured.match ops{{["linalg.generic"]}} '
            f"attributes {{fj.wide = array<i64: {sizes}>}} in %root : (!transform.any_op) -> !transform.any_op\n"
            f"    %t{i}, %l{i} = transform.structured.tile_using_forall %g{i} tile_sizes [{sizes}] "
            ": (!transform.any_op) -> (!transform.any_op, !transform.any_op)\n"
            f"    transform.structured.vectorize %t{i} : !transform.any_op\n"
        )
    # The patterns run inside the loops only: canonicalizing the function would fold a loop of one
    # trip into the host code (a kernel of `width` elements), leaving its loads there.
    patterns = "".join(
        f"    transform.apply_patterns to %l{i} {{\n{_PATTERNS}    }} : !transform.any_op\n"
        for i in range(len(tile_lists))
    )
    return (
        "module attributes {transform.with_named_sequence} {\n"
        "  transform.named_sequence @__transform_main(%root: !transform.any_op {transform.readonly}) {\n"
        + "".join(steps)
        + patterns
        + "    transform.yield\n  }\n}\n"
    )


# The vectorizer reads a tile of shape (width, 1, ...) in loop order, transposed from the operand's:
# as a read of `width` contiguous elements (its unit dimensions dropped), then a plain vector load.
_PATTERNS = (
    "      transform.apply_patterns.vector.transfer_permutation_patterns\n"
    "      transform.apply_patterns.vector.cast_away_vector_leading_one_dim\n"
    "      transform.apply_patterns.vector.drop_unit_dims_with_shape_cast\n"
    "      transform.apply_patterns.vector.lower_transpose\n"
    "      transform.apply_patterns.vector.lower_broadcast\n"
    "      transform.apply_patterns.vector.lower_transfer max_transfer_rank = 1\n"
    "      transform.apply_patterns.memref.fold_memref_alias_ops\n"
    "      transform.apply_patterns.canonicalization\n"
)


def _aligned_vector_accesses(module) -> None:
    """Give every `vector.load` and `vector.store` the alignment of its whole vector (which
    `vector_width` checked), so that NVPTX emits one wide access instead of one per element; a
    transfer left in any other form is a defect of the schedule."""
    from mlir import ir

    def visit(op):
        name = op.name
        if name in ("vector.transfer_read", "vector.transfer_write", "vector.gather", "vector.scatter"):
            raise CompileError(f"internal error: vectorizing left {name} at {op.location}")
        if name in ("vector.load", "vector.store"):
            vector = ir.VectorType(op.results[0].type if name == "vector.load" else op.operands[0].type)
            nbytes = vector.shape[0] * _bits(vector.element_type) // 8
            op.attributes["alignment"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), nbytes)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
