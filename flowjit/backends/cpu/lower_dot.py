"""CPU lowering of dot_general.

The portable form is one generic over (batch, lhs free, rhs free, contracting) loop dims
(`contraction.contraction_generic`). Fast paths replace it where measured to win: the
register-blocked kernel in `matmul_kernel.py` (with a fusion's epilogue applied to each register
tile as it is stored: `_dot_with_epilogue`), a call of the precompiled matmul library
(`library_call`), blocks of dots for products with fewer columns than a vector
(`_lower_with_dot_blocks`) and row dots for narrower ones (`_lower_with_row_dots`). Choices and
measurements: docs/cpu-kernels.md, section Contractions.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowjit.backends.cpu import host, library, matmul_kernel, matmul_library, matmul_plan, transpose_library
from flowjit.backends.cpu.contraction import (
    PARALLEL_MIN_WORK,
    Epilogue,
    accumulator_elem,
    contraction_generic,
    narrow,
    size_of,
    widen_tensor,
)
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.row_writers import over_cores, per_row, transpose
from flowjit.backends.cpu.target import CALL_LOWERINGS, SCRATCH, lowering
from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, memref_type, tensor_type
from flowjit.backends.mlir.lower_movement import reshape
from flowjit.backends.mlir.lowering import call_lowering
from flowjit.ir.graph import Op
from flowjit.ir.ops.contraction import dot_dims
from flowjit.ir.types import TensorType


def _dims_of_dot(op: Op):
    """(lhs free dims, rhs free dims, (batch, m, n, k)) of a dot_general, products of dim sizes."""
    ta, tb = op.operands[0].type, op.operands[1].type
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = dot_dims(op.attrs)
    lhs_free = [i for i in range(ta.rank) if i not in lhs_contract and i not in lhs_batch]
    rhs_free = [i for i in range(tb.rank) if i not in rhs_contract and i not in rhs_batch]
    sizes = (size_of(lhs_batch, ta.shape), size_of(lhs_free, ta.shape), size_of(rhs_free, tb.shape))
    return lhs_free, rhs_free, (*sizes, size_of(lhs_contract, ta.shape))


def _kernel_shape(op: Op) -> matmul_plan.MatmulShape | None:
    """The tiled kernel's view of a dot_general, or None when the product is too small or too
    narrow for it. B already laid out as (batch, N, K) (`a @ b.T`): the kernel packs it from there;
    A laid out as (batch, K, M) (`a.T @ b`, weight gradients): the kernel reads its columns. No
    transpose copies."""
    lhs_contract, _, lhs_batch, _ = dot_dims(op.attrs)
    _, _, (batch, m, n, k) = _dims_of_dot(op)
    if not matmul_plan.worth_it(batch, m, n, k) or _row_against_rows(op) or _few_columns(op):
        return None
    acc = accumulator_elem(op.result.type.dtype)
    rhs_rows = _rhs_rows_given(op)
    lhs_cols = _lhs_in_column_order(op) or _lhs_free_last(op)
    return matmul_plan.MatmulShape(batch if lhs_batch else 0, m, n, k, acc, b_rows=rhs_rows, a_cols=lhs_cols)


def _dot_general_scratch(op: Op) -> int:
    shape = _kernel_shape(op)
    kernel = 0 if shape is None else matmul_plan.scratch_bytes(shape)
    call = library_call(op)
    # Either may run (the call is declined when an operand has no buffer).
    return max(kernel, call.scratch_bytes() if call else 0, _transpose_scratch(op))


SCRATCH["dot_general"] = _dot_general_scratch


@dataclass(frozen=True)
class LibraryCall:
    """A dot_general as a call of the matmul library (`matmul_library`): C (M, N) = A @ B in `elem`,
    `layout` "" (A (M, K), B (K, N)), "bt" (B given as (N, K)) or "at" (A given as (K, M))."""

    m: int
    n: int
    k: int
    elem: str
    layout: str

    @property
    def symbol(self) -> str:
        return matmul_library.symbol(self.elem, self.layout)

    def scratch_bytes(self) -> int:
        return matmul_library.scratch_bytes(self.m, self.n, self.k, self.elem, self.layout)

    @property
    def small(self) -> bool:
        return matmul_library.small(self.m, self.n, self.k)

    def product_bytes(self) -> int:
        return self.m * self.n * int(self.elem[1:]) // 8

    def emit(self, em: KernelEmitter, a: tuple[str, str], b: tuple[str, str], c: tuple[str, str]) -> None:
        """The call on memrefs (name, type) of A, B (laid out as `layout` says) and C, with the
        function's scratch area; its declaration goes into the module."""
        one, byte = f"memref<1x{self.elem}>", "memref<1xi8>"
        area, size = em.scratch
        pointers = [(*a, one), (*b, one), (*c, one), (area, f"memref<{size}xi8>", byte)]
        lda = self.m if self.layout == "at" else self.k
        ldb = self.k if self.layout == "bt" else self.n
        threads = matmul_library.call_threads(self.m, self.n, self.k, self.elem)
        scalars = [(value, "index") for value in (self.m, self.n, self.k, lda, ldb, self.n, threads)]
        note = f"dot_general: calls the matmul library's @{self.symbol} (precompiled: matmul_library.py)"
        library.emit_call(em, self.symbol, note, pointers, scalars)


def library_call(op: Op) -> LibraryCall | None:
    """How this dot_general calls the matmul library, or None when it does not: one float type, no
    batch, A (.., K) with its free dims first or (K, M), B (K, N) or (N, K), not both transposed,
    a product the library takes (`matmul_library.call_shape`)."""
    lhs_contract, rhs_contract, lhs_batch, _ = dot_dims(op.attrs)
    ta, tb = op.operands[0].type, op.operands[1].type
    if lhs_batch or tb.rank != 2 or not ta.dtype == tb.dtype == op.result.type.dtype or ta.dtype.is_bool:
        return None
    if _few_columns(op):
        return None
    if tuple(lhs_contract) == (ta.rank - 1,):
        a_cols, m, k = False, ta.size // max(ta.shape[-1], 1), ta.shape[-1]
    elif ta.rank == 2 and tuple(lhs_contract) == (0,):
        a_cols, m, k = True, ta.shape[1], ta.shape[0]
    else:
        return None
    b_rows = tuple(rhs_contract) == (1,)
    if a_cols and b_rows:
        return None
    n, elem = tb.shape[0 if b_rows else 1], elem_type(ta.dtype)
    layout = "at" if a_cols else "bt" if b_rows else ""
    return LibraryCall(m, n, k, elem, layout) if matmul_library.call_shape(m, n, k, elem, layout) else None


# A large product as a call of the matmul library on the operands' and the result's buffers (its
# packed panels in the scratch area); the tensor lowering when the library does not take it.
CALL_LOWERINGS["dot_general"] = call_lowering(library_call, needs_scratch=True)


def _lower_with_kernel(em: KernelEmitter, op: Op, operands: list[str]) -> str | None:
    """dot_general through the tiled kernel (operands as (batch, M, K), (batch, K, N) views), or None
    when the product is too small or too narrow for it."""
    shape = _kernel_shape(op)
    if shape is None:
        return None
    result = op.result.type
    a, b, lead = _dot_operands(em, op, operands, shape.elem, rhs_rows=shape.b_rows, lhs_cols=shape.a_cols)
    product = matmul_kernel.emit_matmul(em, a, b, shape)
    return narrow(em, _as_result(em, product, lead, shape, result), result, shape.elem)


def _as_result(em: KernelEmitter, product: str, lead: tuple, shape: matmul_plan.MatmulShape, result: TensorType):
    """The kernel's C (lead + (M, N)) viewed with `result`'s shape; when that takes an expand_shape, the
    result is stored through a view of the output of C's shape (`em.store_through`; otherwise C is
    a temporary copied out, a tenth of the call for (8, 128, 512) @ (512, 1536))."""
    c_shape = lead + (shape.m, shape.n)
    viewed = reshape(em, product, TensorType(c_shape, result.dtype), result.shape, shape.elem)
    if viewed != product and result.rank > len(c_shape):
        em.store_through(viewed, product, c_shape)
    return viewed


def _dot_with_epilogue(em: KernelEmitter, op: Op, operands: list[str], epilogue: Epilogue) -> str:
    """A matrix product (M, N) and its epilogue in the tiled kernel: each MR x NR register tile,
    once stored, goes through the epilogue in place while it is in L1 (`emit_matmul`'s
    `tile_epilogue`), so the product is never read back from memory. Several free dimensions on
    the left (x (B, T, D) @ w (D, F)) are M = B * T rows, and batched products are matrices one
    after the other, when the epilogue reads at most a bias along the columns
    (`Epilogue.columns_only`). The epilogue's other operands must not vary along the rows: a
    residual or a mask of C's shape, read 8 rows x 128 bytes per tile down the columns, makes the
    product slower than computing the epilogue after it, and so do products too small for the
    kernel: the product, then the epilogue over it in place (the dump says so)."""
    shape = _kernel_shape(op)
    lhs_free, rhs_free, _ = _dims_of_dot(op)
    result = op.result.type
    in_place = epilogue.elem == accumulator_elem(result.dtype)
    kernel = shape is not None and len(rhs_free) == 1 and in_place
    flat = len(lhs_free) > 1 or bool(shape and shape.batch)  # C's rows span more than one dim
    tiles = kernel and (epilogue.columns_only() if flat else not epilogue.reads_along(0))
    call = library_call(op)
    if call is not None and result.rank == 2 and _scratch_holds(em, call) and (not tiles or call.small):
        # The product into the scratch area, the epilogue from there into the result: the same
        # passes over C as the kernel's product and in-place epilogue (a small product's tiles
        # are cheaper to compile as a library call than to fuse its epilogue into).
        em.line("// fusion: epilogue over the whole product after it (the product is a matmul library call)")
        product = _library_product(em, call, op, operands)
        return epilogue.window(em, product, result, {}, epilogue.accumulate_into(), False)
    if tiles or (kernel and flat and not shape.batch and epilogue.as_matrix()):
        a, b, lead = _dot_operands(em, op, operands, shape.elem, rhs_rows=shape.b_rows, lhs_cols=shape.a_cols)
        if tiles:

            def tile(window: str, size: tuple[int, int], row: str, column: str) -> str:
                window_type = TensorType(size, result.dtype)
                return epilogue.window(em, window, window_type, {0: row, 1: column}, window, True, flat)

            return _as_result(em, matmul_kernel.emit_matmul(em, a, b, shape, tile_epilogue=tile), lead, shape, result)
        # After the product, on C itself viewed as (rows, N) with the residual collapsed alike, so
        # that the output is written in place (through the result's n-d view C was a temporary).
        em.line("// fusion: epilogue over the whole product after it (it reads tensors of the product's rows)")
        product = matmul_kernel.emit_matmul(em, a, b, shape)
        product = epilogue.window(em, product, TensorType((shape.m, shape.n), result.dtype), {}, product, False, True)
        return _as_result(em, product, lead, shape, result)
    why = "it reads tensors of the product's rows" if kernel else "not a 2-D product of the tiled kernel"
    em.line(f"// fusion: epilogue over the whole product after it ({why})")
    (product,) = lower_dot_general(em, op, operands)
    return epilogue.window(em, product, result, {}, product if in_place else None, False)


def fusion_scratch(op: Op) -> int:
    """Scratch bytes of a fusion whose product calls the matmul library (`_dot_with_epilogue`): the
    call's, then the product; or of B^T for dot blocks (`_transpose_scratch`)."""
    dots = [inner for inner in op.regions[0].walk() if inner.name == "dot_general"]
    calls = [library_call(inner) for inner in dots]
    products = [_product_at(call) + call.product_bytes() for call in calls if call is not None]
    return max(products + [_transpose_scratch(inner) for inner in dots], default=0)


def _product_at(call: LibraryCall) -> int:
    return -(-call.scratch_bytes() // 64) * 64


def _scratch_holds(em: KernelEmitter, call: LibraryCall) -> bool:
    return em.scratch is not None and em.scratch[1] >= _product_at(call) + call.product_bytes()


def _library_product(em: KernelEmitter, call: LibraryCall, op: Op, operands: list[str]) -> str:
    """The product as a call of the matmul library into the scratch area, after the call's own
    temporaries; returns it as a tensor."""
    buffers = []
    for x, v in zip(operands, op.operands):
        t = v.type
        buffer = em.op(f"bufferization.to_buffer {x} read_only : {tensor_type(t)} to {memref_type(t)}")
        buffers.append((buffer, memref_type(t)))
    area, size = em.scratch
    c_type = op.result.type
    at = em.op(f"arith.constant {_product_at(call)} : index")
    c = em.op(f"memref.view {area}[{at}][] : memref<{size}xi8> to {memref_type(c_type)}")
    call.emit(em, buffers[0], buffers[1], (c, memref_type(c_type)))
    return em.op(f"bufferization.to_tensor {c} restrict writable : {memref_type(c_type)} to {tensor_type(c_type)}")


def _rhs_in_row_order(op: Op) -> bool:
    """Whether the rhs's dims are already (batch, free, contracting) in memory order."""
    tb = op.operands[1].type
    _, rhs_contract, _, rhs_batch = dot_dims(op.attrs)
    rhs_free = [i for i in range(tb.rank) if i not in rhs_contract and i not in rhs_batch]
    order = list(rhs_batch) + rhs_free + list(rhs_contract)
    return order == sorted(order) and order != list(rhs_batch) + list(rhs_contract) + rhs_free


def _rhs_contracts_last(op: Op) -> bool:
    """Whether the rhs contracts its last dims, in order, but its batch and free dims need moving
    (attention's `q @ k.T` on split heads: k (B, T, H, D) contracting D, batched over B and H): then
    it goes to the kernel as (batch, N, K) rows, a copy of whole contiguous rows (`row_writers.transpose`),
    rather than transposed to (batch, K, N), which moves every element on its own (a
    `linalg.transpose`: plain loops, which also kept the function off LLVM's light pipeline)."""
    tb = op.operands[1].type
    _, rhs_contract, _, _ = dot_dims(op.attrs)
    return list(rhs_contract) == list(range(tb.rank - len(rhs_contract), tb.rank))


def _lhs_free_last(op: Op) -> bool:
    """The lhs's twin of `_rhs_contracts_last`: its free dims are its last dims, in order, with
    its batch and contracting dims to move (a gradient's `q.T @ ds` on split heads): it goes to the
    kernel as (batch, K, M), a copy of whole contiguous rows, read by columns."""
    ta = op.operands[0].type
    lhs_contract, _, lhs_batch, _ = dot_dims(op.attrs)
    free = [i for i in range(ta.rank) if i not in lhs_contract and i not in lhs_batch]
    return bool(free) and free == list(range(ta.rank - len(free), ta.rank)) and bool(lhs_contract)


def _lhs_in_column_order(op: Op) -> bool:
    """Whether the lhs's dims are already (batch, contracting, free) in memory order."""
    ta = op.operands[0].type
    lhs_contract, _, lhs_batch, _ = dot_dims(op.attrs)
    lhs_free = [i for i in range(ta.rank) if i not in lhs_contract and i not in lhs_batch]
    order = list(lhs_batch) + list(lhs_contract) + lhs_free
    return order == sorted(order) and order != list(lhs_batch) + lhs_free + list(lhs_contract)


def _dot_operands(em: KernelEmitter, op: Op, operands: list[str], acc: str, rhs_rows: bool, lhs_cols: bool = False):
    """The operands widened to `acc`, transposed (only if needed) and reshaped as views to
    (batch, M, K) and (batch, K, N), or (batch, K, M) with `lhs_cols` and (batch, N, K) with
    `rhs_rows` (no batch dim when the op has none). Returns (a, b, the leading batch shape: () or (batch,))."""
    a, b = operands
    ta, tb = op.operands[0].type, op.operands[1].type
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = dot_dims(op.attrs)
    lhs_free = [i for i in range(ta.rank) if i not in lhs_contract and i not in lhs_batch]
    rhs_free = [i for i in range(tb.rank) if i not in rhs_contract and i not in rhs_batch]
    batch = size_of(lhs_batch, ta.shape)
    m, k, n = size_of(lhs_free, ta.shape), size_of(lhs_contract, ta.shape), size_of(rhs_free, tb.shape)
    a, b = widen_tensor(em, a, ta, acc), widen_tensor(em, b, tb, acc)
    lhs_order = list(lhs_contract) + lhs_free if lhs_cols else lhs_free + list(lhs_contract)
    a, ta = transpose(em, a, ta, list(lhs_batch) + lhs_order, acc)
    rhs_order = rhs_free + list(rhs_contract) if rhs_rows else list(rhs_contract) + rhs_free
    b, tb = transpose(em, b, tb, list(rhs_batch) + rhs_order, acc)
    lead = (batch,) if lhs_batch else ()
    a = reshape(em, a, ta, lead + ((k, m) if lhs_cols else (m, k)), acc)
    b = reshape(em, b, tb, lead + ((n, k) if rhs_rows else (k, n)), acc)
    return a, b, lead


def _row_against_rows(op: Op) -> bool:
    """A product of one row with B laid out as (.., N, K) and a long contraction (`x @ w.T` of a
    single x, PyTorch's layout of a linear layer): N dots of contiguous rows, B read once in its
    own order (`_lower_with_row_dots`). The tiled kernel would pack B's rows into panels used by
    the one row block only, reading all of B twice."""
    acc = accumulator_elem(op.result.type.dtype)
    _, _, (_, m, _, k) = _dims_of_dot(op)
    return m == 1 and k >= DOT_UNROLL * host.vector_bits() // int(acc[1:]) and _rhs_in_row_order(op)


def _lower_with_row_dots(em: KernelEmitter, op: Op, operands: list[str]) -> str | None:
    """Products with fewer output columns than half a vector (matrix-vector, dot), or of one row
    with B's rows (`_row_against_rows`), and a long contraction: each output is a dot of two
    contiguous rows, A[b, i, :] . B^T[b, j, :], with DOT_UNROLL independent vector accumulators (the
    generic's scalar sum is one add chain: no reassociation without fast-math) and a masked tail;
    outputs split over the cores."""
    result = op.result.type
    acc = accumulator_elem(result.dtype)
    lanes = host.vector_bits() // int(acc[1:])
    _, _, (batch, m, n, k) = _dims_of_dot(op)
    narrow_enough = n < lanes // 2 or _row_against_rows(op)
    if not narrow_enough or k < DOT_UNROLL * lanes or batch * m * n * k < matmul_plan.KERNEL_MIN_FLOPS:
        return None
    a, b, lead = _dot_operands(em, op, operands, acc, rhs_rows=True)
    w = LoopWriter(em)
    vec = f"vector<{lanes}x{acc}>"
    a_type = tensor_type(TensorType(lead + (m, k), result.dtype), acc)
    b_type = tensor_type(TensorType(lead + (n, k), result.dtype), acc)
    zero = em.op(f"arith.constant {0 if acc.startswith('i') else 0.0} : {acc}")
    zero_vec = em.op(f"vector.broadcast {zero} : {acc} to {vec}")

    def dot(r: str) -> str:
        prefix = [em.op(f"arith.divui {r}, {w.index(m * n)} : index")] if lead else []
        i = em.op(f"arith.divui {em.op(f'arith.remui {r}, {w.index(m * n)} : index')}, {w.index(n)} : index")
        j = em.op(f"arith.remui {r}, {w.index(n)} : index")

        def step(column: str, in_bounds: str, total: str) -> str:
            x, y = (
                em.op(
                    f"vector.transfer_read {t}[{', '.join(prefix + [row, column])}], {zero} "
                    f"{{in_bounds = [{in_bounds}]}} : {tt}, {vec}"
                )
                for t, row, tt in ((a, i, a_type), (b, j, b_type))
            )
            return matmul_kernel.multiply_add_vectors(em, x, y, total, vec, acc)

        full, groups = k // lanes, k // (lanes * DOT_UNROLL)
        loop, g, totals = w.open_for(w.index(0), w.index(groups), w.index(1), [(zero_vec, vec)] * DOT_UNROLL)
        first = w.mul(g, w.index(DOT_UNROLL * lanes))
        w.close_for(
            [step(w.add(first, w.index(u * lanes)), "true", totals[u]) for u in range(DOT_UNROLL)], [vec] * DOT_UNROLL
        )
        totals = [f"{loop}#{u}" for u in range(DOT_UNROLL)]
        for c in range(groups * DOT_UNROLL, full):
            totals[0] = step(w.index(c * lanes), "true", totals[0])
        if k % lanes:
            totals[0] = step(w.index(full * lanes), "false", totals[0])
        add = "addi" if acc.startswith("i") else "addf"
        total = totals[0]
        for other in totals[1:]:
            total = em.op(f"arith.{add} {total}, {other} : {vec}")
        return em.op(f"vector.reduction <add>, {total} : {vec} into {acc}")

    outputs = batch * m * n
    parallel = host.cores() > 1 and outputs > 1 and outputs * k >= PARALLEL_MIN_WORK
    flat = per_row(em, outputs, acc, dot, parallel)
    product = reshape(em, flat, TensorType((outputs,), result.dtype), result.shape, acc)
    return narrow(em, product, result, acc)


# Independent vector accumulators of the row-dot kernel.
DOT_UNROLL = 4


def _few_columns(op: Op) -> bool:
    """A float product of A's contiguous rows (no batch) with at least half a vector but fewer than
    a vector of columns (a classifier's logits, `h @ W` with W (K, 10)) and a contraction of at least
    DOT_BLOCK_MIN_VECTORS vectors: `_lower_with_dot_blocks` computes it, not the tiled kernel, whose
    panels of two vectors (32 float32 columns with AVX-512) held 10 used ones."""
    result = op.result.type
    acc = accumulator_elem(result.dtype)
    lhs_contract, _, lhs_batch, _ = dot_dims(op.attrs)
    if acc not in ("f32", "f64") or lhs_batch or tuple(lhs_contract) != (op.operands[0].type.rank - 1,):
        return False
    lanes = host.vector_bits() // int(acc[1:])
    _, _, (_, m, n, k) = _dims_of_dot(op)
    return lanes // 2 <= n < lanes and k >= DOT_BLOCK_MIN_VECTORS * lanes and m >= DOT_BLOCK_MIN_ROWS


def _dot_block_rows(n: int) -> int:
    """Rows of a `_lower_with_dot_blocks` block: the most (up to 4) whose rows x N accumulators, one
    vector of A per row and one of B^T fit the vector registers."""
    registers = 32 if host.vector_bits() == 512 else 16
    return max(r for r in (4, 3, 2, 1) if r * n + r + 1 <= registers or r == 1)


def _lower_with_dot_blocks(em: KernelEmitter, op: Op, operands: list[str]) -> str | None:
    """A product with few columns (`_few_columns`) as blocks of `_dot_block_rows` rows x all N
    columns: each output a dot along K of A's row and B^T's row (B transposed once, K x N floats),
    the block's rows x N vector accumulators in registers, so that each vector of A is loaded once
    per block and each of B^T once per row block; a masked last step when K is no multiple of the
    vector; blocks split over the cores, a last block of the rows left over on the calling thread.
    The CNN's dense layer, (64, 6272) @ (6272, 10) float32 + bias, runs a third faster this way than
    in the library's kernel (which uses 10 of a panel's 32 columns and broadcasts A per
    multiply-add) on a 2-core AMD EPYC Zen 4 VM, faster still with B given as (N, K) (`_rows_of`
    gathers the rest), and with sixteen partial sums per output its rounding error is smaller."""
    if not _few_columns(op):
        return None
    result = op.result.type
    acc = accumulator_elem(result.dtype)
    lanes = host.vector_bits() // int(acc[1:])
    _, _, (_, m, n, k) = _dims_of_dot(op)
    height = _dot_block_rows(n)
    rows_given = _rhs_rows_given(op)
    a, b, _ = _dot_operands(em, op, operands, acc, rhs_rows=rows_given)
    if not rows_given:
        b = _transposed_by_library(em, b, k, n, acc) or _rows_of(em, b, TensorType((k, n), result.dtype), acc)
    w = LoopWriter(em)
    vec = f"vector<{lanes}x{acc}>"
    a_type = tensor_type(TensorType((m, k), result.dtype), acc)
    b_type = tensor_type(TensorType((n, k), result.dtype), acc)
    zero = em.op(f"arith.constant 0.0 : {acc}")
    zero_vec = em.op(f"vector.broadcast {zero} : {acc} to {vec}")
    em.line(f"// dot_general: {m} x {k} x {n} as blocks of {height} row(s) x {n} dots along K (few columns)")

    def step(rows: list[str], column: str, in_bounds: str, totals: list[str]) -> list[str]:
        def read(t: str, row: str, tt: str) -> str:
            bounds = f"{{in_bounds = [{in_bounds}]}}"
            return em.op(f"vector.transfer_read {t}[{row}, {column}], {zero} {bounds} : {tt}, {vec}")

        xs = [read(a, row, a_type) for row in rows]
        ys = [read(b, w.index(j), b_type) for j in range(n)]
        return [
            matmul_kernel.multiply_add_vectors(em, x, y, totals[r * n + j], vec, acc)
            for r, x in enumerate(xs)
            for j, y in enumerate(ys)
        ]

    def block(first_row: str, rows: int, out: str, out_type: str, at: str) -> str:
        """`out` (flat) with C's rows [first_row, first_row + rows) written from element `at` on."""
        row_ids = [w.add(first_row, w.index(r)) for r in range(rows)]
        loop, kv, totals = w.open_for(w.index(0), w.index(k // lanes), w.index(1), [(zero_vec, vec)] * (rows * n))
        w.close_for(step(row_ids, w.mul(kv, w.index(lanes)), "true", totals), [vec] * (rows * n))
        totals = [f"{loop}#{i}" for i in range(rows * n)] if rows * n > 1 else [loop]
        if k % lanes:
            totals = step(row_ids, w.index(k // lanes * lanes), "false", totals)
        sums = [em.op(f"vector.reduction <add>, {total} : {vec} into {acc}") for total in totals]
        # One write of the block's rows x N outputs: as many tensor.inserts they were as many tensor
        # values for bufferization to analyse.
        block_vec = f"vector<{len(sums)}x{acc}>"
        values = em.op(f"vector.from_elements {', '.join(sums)} : {block_vec}")
        return em.op(f"vector.transfer_write {values}, {out}[{at}] {{in_bounds = [true]}} : {block_vec}, {out_type}")

    def blocks(first: str | None, count: str, part: str, part_type: str) -> str:
        first_row = w.index(0) if first is None else em.op(f"arith.divui {first}, {w.index(n)} : index")
        loop, i, (cur,) = w.open_for(w.index(0), count, w.index(1), [(part, part_type)])
        row = w.add(first_row, w.mul(i, w.index(height)))
        w.close_for([block(row, height, cur, part_type, w.mul(i, w.index(height * n)))], [part_type])
        return loop

    whole = m // height
    parallel = host.cores() > 1 and whole >= 2 and m * n * k >= PARALLEL_MIN_WORK
    flat = over_cores(em, m * n, acc, whole, height * n, blocks, parallel)
    if m % height:
        flat_type = f"tensor<{m * n}x{acc}>"
        flat = block(w.index(whole * height), m % height, flat, flat_type, w.index(whole * height * n))
    product = reshape(em, flat, TensorType((m * n,), result.dtype), result.shape, acc)
    em.store_through(product, flat, (m * n,))  # the blocks write the output itself, not a copy of it
    return narrow(em, product, result, acc)


def _rhs_rows_given(op: Op) -> bool:
    """Whether a product's B comes as (N, K) rows: a view or a copy of rows, no transpose."""
    return _rhs_in_row_order(op) or _rhs_contracts_last(op)


def _transposed_bytes(k: int, n: int, acc: str) -> int:
    return k * n * int(acc[1:]) // 8


def _transpose_scratch(op: Op) -> int:
    """Scratch bytes of B^T that `_lower_with_dot_blocks` gets from the transpose library
    (`_transposed_by_library`: B given as (K, N)), else 0."""
    if not _few_columns(op) or _rhs_rows_given(op) or not transpose_library.enabled():
        return 0
    _, _, (_, _, n, k) = _dims_of_dot(op)
    return _transposed_bytes(k, n, accumulator_elem(op.result.type.dtype))


def _transposed_by_library(em: KernelEmitter, b: str, k: int, n: int, acc: str) -> str | None:
    """B (K, N) as (N, K), made by the transpose library (`transpose_library.py`) in the scratch
    area, or None where it is off (AOT, `FLOWJIT_TRANSPOSE_LIBRARY=0`) or the area is too small:
    then `_rows_of` compiles the transpose into the program."""
    if not transpose_library.enabled() or em.scratch is None or em.scratch[1] < _transposed_bytes(k, n, acc):
        return None
    area, size = em.scratch
    given, rows = f"{k}x{n}x{acc}", f"{n}x{k}x{acc}"
    buffer = em.op(f"bufferization.to_buffer {b} read_only : tensor<{given}> to memref<{given}>")
    at = em.op("arith.constant 0 : index")
    out = em.op(f"memref.view {area}[{at}][] : memref<{size}xi8> to memref<{rows}>")
    lanes = host.vector_bits() // int(acc[1:])
    parallel = k * n >= SHORT_ROWS_PARALLEL_MIN_ELEMENTS
    threads = min(host.cores(), k // lanes) if parallel else 1  # K is at least 4 vectors
    transpose_library.emit(em, (buffer, f"memref<{given}>"), (out, f"memref<{rows}>"), acc, k, n, threads)
    return em.op(f"bufferization.to_tensor {out} restrict writable : memref<{rows}> to tensor<{rows}>")


def _rows_of(em: KernelEmitter, b: str, tb: TensorType, acc: str) -> str:
    """B (K, N) transposed to (N, K), N shorter than a vector: each vector of a row gathered from
    B's column (`vector.gather`, a masked one for the last when K is no multiple of the vector).
    Where the transpose library is off (`_transposed_by_library`): AOT compiles."""
    k, n = tb.shape
    lanes = host.vector_bits() // int(acc[1:])
    w = LoopWriter(em)
    flat_t = TensorType((k * n,), tb.dtype)
    flat = reshape(em, b, tb, flat_t.shape, acc)
    rows_t = TensorType((n, k), tb.dtype)
    rows_type, flat_type = tensor_type(rows_t, acc), tensor_type(flat_t, acc)
    vec, ivec, mvec = f"vector<{lanes}x{acc}>", f"vector<{lanes}xi32>", f"vector<{lanes}xi1>"
    steps = em.op(f"arith.constant dense<[{', '.join(str(i * n) for i in range(lanes))}]> : {ivec}")
    zero = em.op(f"vector.broadcast {em.op(f'arith.constant 0.0 : {acc}')} : {acc} to {vec}")

    def gather(row: str, column: str, mask: str, into: str, in_bounds: str) -> str:
        at = w.add(w.mul(column, w.index(n)), row if threads == 1 else w.add(first, row))
        types = f"{flat_type}, {ivec}, {mvec}, {vec} into {vec}"
        value = em.op(f"vector.gather {flat}[{at}] [{steps}], {mask}, {zero} : {types}")
        written = f"vector.transfer_write {value}, {into}[{row}, {column}]"
        if in_bounds == "true":
            return em.op(f"{written} {{in_bounds = [true]}} : {vec}, {rows_type}")
        return em.op(f"{written}, {mask} {{in_bounds = [false]}} : {vec}, {rows_type}")

    threads = min(host.cores(), n) if rows_t.size >= SHORT_ROWS_PARALLEL_MIN_ELEMENTS else 1
    per = -(-n // threads)
    threads = -(-n // per)
    empty = em.empty(rows_t, acc)
    if threads > 1:
        done_all, t, shared = w.open_forall(threads, empty, rows_type)
        first = w.mul(t, w.index(per))
        count = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(n)}, {first} : index')}, {w.index(per)} : index")
        part_type = f"tensor<?x{k}x{acc}>"
        where = f"[{first}, 0] [{count}, {k}] [1, 1]"
        part = em.op(f"tensor.extract_slice {shared}{where} : {rows_type} to {part_type}")
        rows_type, bound = part_type, count
    else:
        part, bound = empty, w.index(n)
    rows_loop, j, (cur,) = w.open_for(w.index(0), bound, w.index(1), [(part, rows_type)])
    whole = k // lanes
    full = em.op(f"vector.constant_mask [{lanes}] : {mvec}")
    loop, v, (inner,) = w.open_for(w.index(0), w.index(whole), w.index(1), [(cur, rows_type)])
    w.close_for([gather(j, w.mul(v, w.index(lanes)), full, inner, "true")], [rows_type])
    done = loop
    if k % lanes:
        mask = em.op(f"vector.constant_mask [{k % lanes}] : {mvec}")
        done = gather(j, w.index(whole * lanes), mask, done, "false")
    w.close_for([done], [rows_type])
    if threads == 1:
        return rows_loop
    w.close_forall(rows_loop, shared, where, rows_type, tensor_type(rows_t, acc))
    return done_all


# `_rows_of` splits B's rows over the cores from this size on (two cores take (6272, 10) in 23 us
# against 40 on one, on a 2-core AMD EPYC Zen 4 VM); the transpose library
# (`_transposed_by_library`) its blocks.
SHORT_ROWS_PARALLEL_MIN_ELEMENTS = 1 << 14

# Products of at least this many vectors of contraction, and rows, take `_lower_with_dot_blocks`.
DOT_BLOCK_MIN_VECTORS = 4

DOT_BLOCK_MIN_ROWS = 4


@lowering("dot_general")
def lower_dot_general(em: KernelEmitter, op: Op, operands: list[str], epilogue: Epilogue | None = None) -> list[str]:
    """dot_general through the tiled matmul kernel, or the row-dot kernel for narrow products, when
    big enough to need them; otherwise one generic over (batch, lhs free, rhs free, contracting)
    loop dims. With `epilogue` (`streams_epilogue`), the result is the epilogue's: applied to each
    register tile of the kernel as it is stored (`_dot_with_epilogue`)."""
    if epilogue is not None:
        return [_dot_with_epilogue(em, op, operands, epilogue)]
    fast = (
        _lower_with_kernel(em, op, operands)
        or _lower_with_dot_blocks(em, op, operands)
        or _lower_with_row_dots(em, op, operands)
    )
    if fast is not None:
        return [fast]
    a, b = operands
    ta, tb, result = op.operands[0].type, op.operands[1].type, op.result.type
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = dot_dims(op.attrs)
    lhs_free = [i for i in range(ta.rank) if i not in lhs_contract and i not in lhs_batch]
    rhs_free = [i for i in range(tb.rank) if i not in rhs_contract and i not in rhs_batch]
    n_batch, n_out = len(lhs_batch), result.rank
    lhs_loop, rhs_loop = {}, {}
    for i, (x, y) in enumerate(zip(lhs_batch, rhs_batch)):
        lhs_loop[x] = rhs_loop[y] = i
    for i, x in enumerate(lhs_free):
        lhs_loop[x] = n_batch + i
    for i, y in enumerate(rhs_free):
        rhs_loop[y] = n_batch + len(lhs_free) + i
    for i, (x, y) in enumerate(zip(lhs_contract, rhs_contract)):
        lhs_loop[x] = rhs_loop[y] = n_out + i
    lhs_exprs = ", ".join(f"d{lhs_loop[i]}" for i in range(ta.rank))
    rhs_exprs = ", ".join(f"d{rhs_loop[i]}" for i in range(tb.rank))
    iterators = ["parallel"] * n_out + ["reduction"] * len(lhs_contract)
    reduction_size = size_of(lhs_contract, ta.shape)
    return [contraction_generic(em, [(a, ta, lhs_exprs), (b, tb, rhs_exprs)], result, iterators, reduction_size)]
