"""CPU lowerings of contractions: dot_general, conv2d (reduce_window: `lower_pooling`, argmax/argmin:
`lower_arg_extreme`).

Every op has a portable form, one `linalg.generic` whose indexing maps encode the op's dimension
numbers (`contraction.contraction_generic`), correct for every shape and dtype. Fast paths replace
it where measured to win: the register-blocked kernel in `matmul_kernel.py` and a row-dot kernel
for narrow products (dot_general); conv2d and large generics split over the cores. Choices and
measurements: docs/cpu-backend.md, section Contractions.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from flowjit.backends.cpu import library, matmul_kernel, matmul_library, schedule, transpose_library
from flowjit.backends.cpu.contraction import (
    PARALLEL_MIN_WORK,
    Epilogue,
    accumulator_elem,
    combine,
    const,
    contraction_generic,
    narrow,
    size_of,
    widen_tensor,
)
from flowjit.backends.cpu.lower_movement import fill, pad_tensor, reshape
from flowjit.backends.cpu.row_writers import close_loops, over_cores, per_row, row_major_strides, transpose, window_rows
from flowjit.backends.cpu.target import CALL_LOWERINGS, SCRATCH, lowering
from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, memref_type, tensor_type
from flowjit.backends.mlir.lowering import call_lowering
from flowjit.ir.graph import Op
from flowjit.ir.ops.contraction import conv_params, dot_dims
from flowjit.ir.types import TensorType


def _dims_of_dot(op: Op):
    """(lhs free dims, rhs free dims, (batch, m, n, k)) of a dot_general, products of dim sizes."""
    ta, tb = op.operands[0].type, op.operands[1].type
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = dot_dims(op.attrs)
    lhs_free = [i for i in range(ta.rank) if i not in lhs_contract and i not in lhs_batch]
    rhs_free = [i for i in range(tb.rank) if i not in rhs_contract and i not in rhs_batch]
    sizes = (size_of(lhs_batch, ta.shape), size_of(lhs_free, ta.shape), size_of(rhs_free, tb.shape))
    return lhs_free, rhs_free, (*sizes, size_of(lhs_contract, ta.shape))


def _kernel_shape(op: Op) -> matmul_kernel.MatmulShape | None:
    """The tiled kernel's view of a dot_general, or None when the product is too small or too
    narrow for it. B already laid out as (batch, N, K) (`a @ b.T`): the kernel packs it from there;
    A laid out as (batch, K, M) (`a.T @ b`, weight gradients): the kernel reads its columns. No
    transpose copies."""
    lhs_contract, _, lhs_batch, _ = dot_dims(op.attrs)
    _, _, (batch, m, n, k) = _dims_of_dot(op)
    if not matmul_kernel.worth_it(batch, m, n, k) or _row_against_rows(op) or _few_columns(op):
        return None
    acc = accumulator_elem(op.result.type.dtype)
    rhs_rows = _rhs_rows_given(op)
    lhs_cols = _lhs_in_column_order(op) or _lhs_free_last(op)
    return matmul_kernel.MatmulShape(batch if lhs_batch else 0, m, n, k, acc, b_rows=rhs_rows, a_cols=lhs_cols)


def _dot_general_scratch(op: Op) -> int:
    shape = _kernel_shape(op)
    kernel = 0 if shape is None else matmul_kernel.scratch_bytes(shape)
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


def _as_result(em: KernelEmitter, product: str, lead: tuple, shape: matmul_kernel.MatmulShape, result: TensorType):
    """The kernel's C (lead + (M, N)) viewed with `result`'s shape; when that takes an expand_shape, the
    result is stored through a view of the output of C's shape (`em.store_through`; C was a
    temporary copied out: 6 MiB for (8, 128, 512) @ (512, 1536), 11% of the call)."""
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
    residual or a mask of C's shape, read 8 rows x 128 bytes per tile down the columns, made the
    product 2% slower than computing the epilogue after it (1024 x 1024 x 1024 and 256 x 1024 x
    1024, paired in one process), and so do products too small for the kernel: the product, then
    the epilogue over it in place (the dump says so)."""
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
        return epilogue.window(em, _library_product(em, call, op, operands), result, {}, None, False)
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
    it goes to the kernel as (batch, N, K) rows, a copy of whole contiguous rows (`_copy_blocks`),
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
    own order (`_lower_with_row_dots`). Through the tiled kernel, which packs B's rows into panels
    for the one row block, (1, 4096) @ (4096, 4096).T f32 took 5.0-5.6 ms."""
    acc = accumulator_elem(op.result.type.dtype)
    _, _, (_, m, _, k) = _dims_of_dot(op)
    return m == 1 and k >= DOT_UNROLL * matmul_kernel.vector_bits() // int(acc[1:]) and _rhs_in_row_order(op)


def _lower_with_row_dots(em: KernelEmitter, op: Op, operands: list[str]) -> str | None:
    """Products with fewer output columns than half a vector (matrix-vector, dot), or of one row
    with B's rows (`_row_against_rows`), and a long contraction: each output is a dot of two
    contiguous rows, A[b, i, :] . B^T[b, j, :], with DOT_UNROLL independent vector accumulators (the
    generic's scalar sum is one add chain: no reassociation without fast-math) and a masked tail;
    outputs split over the cores."""
    result = op.result.type
    acc = accumulator_elem(result.dtype)
    lanes = matmul_kernel.vector_bits() // int(acc[1:])
    _, _, (batch, m, n, k) = _dims_of_dot(op)
    narrow_enough = n < lanes // 2 or _row_against_rows(op)
    if not narrow_enough or k < DOT_UNROLL * lanes or batch * m * n * k < matmul_kernel.KERNEL_MIN_FLOPS:
        return None
    a, b, lead = _dot_operands(em, op, operands, acc, rhs_rows=True)
    w = matmul_kernel.LoopWriter(em)
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
    parallel = matmul_kernel.cores() > 1 and outputs > 1 and outputs * k >= PARALLEL_MIN_WORK
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
    lanes = matmul_kernel.vector_bits() // int(acc[1:])
    _, _, (_, m, n, k) = _dims_of_dot(op)
    return lanes // 2 <= n < lanes and k >= DOT_BLOCK_MIN_VECTORS * lanes and m >= DOT_BLOCK_MIN_ROWS


def _dot_block_rows(n: int) -> int:
    """Rows of a `_lower_with_dot_blocks` block: the most (up to 4) whose rows x N accumulators, one
    vector of A per row and one of B^T fit the vector registers."""
    registers = 32 if matmul_kernel.vector_bits() == 512 else 16
    return max(r for r in (4, 3, 2, 1) if r * n + r + 1 <= registers or r == 1)


def _lower_with_dot_blocks(em: KernelEmitter, op: Op, operands: list[str]) -> str | None:
    """A product with few columns (`_few_columns`) as blocks of `_dot_block_rows` rows x all N
    columns: each output a dot along K of A's row and B^T's row (B transposed once, K x N floats),
    the block's rows x N vector accumulators in registers, so that each vector of A is loaded once
    per block and each of B^T once per row block; a masked last step when K is no multiple of the
    vector; blocks split over the cores, a last block of the rows left over on the calling thread.
    The CNN's dense layer, (64, 6272) @ (6272, 10) float32 + bias on two Zen 4 cores, paired in one
    process: the library's kernel 109 us (its panels 10/32 used, a broadcast of A per multiply-add),
    this way 74 (51 with B given as (N, K); `_rows_of` gathers the rest), relative error 3.6e-6 ->
    4.9e-7 (sixteen partial sums per output); the CNN forward 366 -> 345 us."""
    if not _few_columns(op):
        return None
    result = op.result.type
    acc = accumulator_elem(result.dtype)
    lanes = matmul_kernel.vector_bits() // int(acc[1:])
    _, _, (_, m, n, k) = _dims_of_dot(op)
    height = _dot_block_rows(n)
    rows_given = _rhs_rows_given(op)
    a, b, _ = _dot_operands(em, op, operands, acc, rhs_rows=rows_given)
    if not rows_given:
        b = _transposed_by_library(em, b, k, n, acc) or _rows_of(em, b, TensorType((k, n), result.dtype), acc)
    w = matmul_kernel.LoopWriter(em)
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
    parallel = matmul_kernel.cores() > 1 and whole >= 2 and m * n * k >= PARALLEL_MIN_WORK
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
    lanes = matmul_kernel.vector_bits() // int(acc[1:])
    parallel = k * n >= SHORT_ROWS_PARALLEL_MIN_ELEMENTS
    threads = min(matmul_kernel.cores(), k // lanes) if parallel else 1  # K is at least 4 vectors
    transpose_library.emit(em, (buffer, f"memref<{given}>"), (out, f"memref<{rows}>"), acc, k, n, threads)
    return em.op(f"bufferization.to_tensor {out} restrict writable : memref<{rows}> to tensor<{rows}>")


def _rows_of(em: KernelEmitter, b: str, tb: TensorType, acc: str) -> str:
    """B (K, N) transposed to (N, K), N shorter than a vector: each vector of a row gathered from
    B's column (`vector.gather`, a masked one for the last when K is no multiple of the vector).
    Where the transpose library is off (`_transposed_by_library`): AOT compiles."""
    k, n = tb.shape
    lanes = matmul_kernel.vector_bits() // int(acc[1:])
    w = matmul_kernel.LoopWriter(em)
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

    threads = min(matmul_kernel.cores(), n) if rows_t.size >= SHORT_ROWS_PARALLEL_MIN_ELEMENTS else 1
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


# `_rows_of` splits B's rows over the cores from this size on: (6272, 10) 40 -> 23 us; the transpose
# library (`_transposed_by_library`) its blocks.
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


@lowering("conv2d")
def lower_conv2d(em: KernelEmitter, op: Op, operands: list[str], epilogue: Epilogue | None = None) -> list[str]:
    """Zero-pad the input, then one generic whose input map applies stride and dilation:
    out[n, o, oh, ow] += x[n, c, oh*s0 + kh*d0, ow*s1 + kw*d1] * w[o, c, kh, kw]; or, for sums of
    at least IM2COL_MIN_DEPTH taps, im2col + the matmul kernel (`_conv_as_matmul`), whose im2col
    pads as it reads where it can (`_im2col_pads`: no padded copy). With `epilogue`
    (`streams_epilogue`), the result is the epilogue's, applied to each chunk of the im2col form's
    output as it is copied out (to the whole product after the generic)."""
    x, w = operands
    tx, tw, result = op.operands[0].type, op.operands[1].type, op.result.type
    stride, padding, dilation = conv_params(op.attrs)
    padded_type, padded = tx, x
    depth = tw.size // tw.shape[0]
    if depth >= IM2COL_MIN_DEPTH and _im2col_pads(tx, tw, result, stride, padding):
        conv = (w, tw, stride, dilation, padding)
        return [_conv_as_matmul(em, x, tx, conv, result, epilogue)]
    if any(lo or hi for lo, hi in padding):
        padded_type = tx.with_shape(tx.shape[:2] + tuple(d + lo + hi for d, (lo, hi) in zip(tx.shape[2:], padding)))
        zero = const(em, 0, tx.dtype)
        padded = pad_tensor(em, x, tx, padded_type, zero, (0, 0, padding[0][0], padding[1][0]), (0, 0, 0, 0))
    if depth >= IM2COL_MIN_DEPTH:
        return [_conv_as_matmul(em, padded, padded_type, (w, tw, stride, dilation, None), result, epilogue)]
    # Loops (n, o, oh, ow, c, kh, kw), reductions innermost: LLVM unrolls the small window into
    # one register accumulator per output and vectorizes across outputs. (Putting `ow` innermost
    # instead measured 10x slower: the output row goes through memory once per tap.)
    x_exprs = f"d0, d4, d2 * {stride[0]} + d5 * {dilation[0]}, d3 * {stride[1]} + d6 * {dilation[1]}"
    iterators = ["parallel"] * 4 + ["reduction"] * 3
    inputs = [(padded, padded_type, x_exprs), (w, tw, "d1, d4, d5, d6")]
    product = contraction_generic(em, inputs, result, iterators, depth)
    return [epilogue.apply(em, product, False, result, None, None, False) if epilogue else product]


# Convolutions summing over at least this many (c, kh, kw) taps go through im2col + the matmul
# kernel: the generic's reduction is one scalar add chain per output (no reassociation), slower
# even for a 3x3 window (CNN layer 1x28x28 -> 32: generic 0.81 ms, im2col + kernel 0.50 ms, one
# core) and latency-bound for deep ones (32 -> 64 channels: 111 ms vs 3 ms).
IM2COL_MIN_DEPTH = 8

# The column matrix is a temporary of depth x (columns of the chunk) elements, made and consumed
# per chunk: runs of whole images while they fit, else blocks of output rows of one image. At 16M
# elements (64 MiB, the cap before session 7) a chunk was mapped fresh and page-faulted every call
# and went through memory three times (im2col, packing, product): 8x64x56x56 * 64x64x3x3 took 33 ms
# against 7.4 ms at 512K and PyTorch's 5-9; one image above the cap fell back to the generic
# (1x64x224x224: 956 ms against PyTorch's 10). At 128K elements (512 KiB of float32) a chunk stays
# in a core's L2 (1 MiB) while the kernel packs it (session 8, paired against 512K in one process:
# 8x64x56x56 3x3 0.96-0.97x the time, 32x32x32x32 0.93x, 8x128x28x28 0.97x, the 7x7/2 stem 0.98x,
# 1x64x224x224 0.97x), but only when that is at least IM2COL_MIN_COLUMNS columns: deeper convs
# keep WIDE_CHUNK_ELEMENTS (8x256x14x14 1.08x at 98 columns a chunk, 8x512x7x7 1.22x when fewer,
# larger chunks no longer split evenly over the cores). See docs/cpu-backend.md ("conv2d").
IM2COL_MAX_ELEMENTS = 1 << 17

IM2COL_MIN_COLUMNS = 112

# The chunks of deeper convs, those that decide whether a conv is summed over taps (`over_taps`),
# and those of a 1x1 conv (its columns are views of the input, so a chunk is only a share of the
# work per core: 1.05x the time at 128K) keep the cap of session 7.
WIDE_CHUNK_ELEMENTS = 1 << 19

# A chunk's product (O x columns), which an epilogue reads back, stays under this many elements
# (512 KiB of float32, half a Zen 4 core's L2) (`_epilogue_cap`).
EPILOGUE_PRODUCT_ELEMENTS = 1 << 17


@dataclass(frozen=True)
class _Conv:
    """One convolution's im2col form: its (O, C*KH*KW) weights in the accumulator type `acc`, their
    4-D type `tw`, stride, dilation, and the epilogue its output goes through (None: the product
    in `acc`, narrowed to the result's type at the end)."""

    weights: str | matmul_kernel.Restrided  # restrided for a fork's chunks (`_restrides_weights`)
    tw: TensorType
    stride: tuple
    dilation: tuple
    acc: str
    epilogue: Epilogue | None
    padding: tuple | None = None  # the input's, when im2col pads as it reads (`_im2col_pads`)

    @property
    def out_elem(self) -> str:
        """The element of the output tensor being filled: the epilogue's, else the accumulator."""
        return self.epilogue.elem if self.epilogue is not None else self.acc

    def finish(self, em: KernelEmitter, out: str, result: TensorType) -> str:
        return out if self.epilogue is not None else narrow(em, out, result, self.acc)

    def out(self, part: TensorType) -> TensorType:
        """The part of the output tensor that conv output `part` fills (pooled by the epilogue)."""
        return part.with_shape(self.epilogue.out_shape(part.shape)) if self.epilogue is not None else part

    @property
    def row_step(self) -> int:
        """Conv output rows per output row: the pool's window height (chunks of rows are its multiples)."""
        pool = self.epilogue.pool if self.epilogue is not None else None
        return pool["window"][2] if pool is not None else 1

    def out_slice(self, w_, image: str, row: str, part: TensorType) -> str:
        """The `[offsets] [sizes] [strides]` of the output that conv output rows `part` from (image, row) fill."""
        if self.row_step > 1:
            row = w_.em.op(f"arith.divui {row}, {w_.index(self.row_step)} : index")
        return f"[{image}, 0, {row}, 0] [{', '.join(map(str, self.out(part).shape))}] [1, 1, 1, 1]"


def _restrides_weights(o: int, depth: int, acc: str) -> bool:
    """Whether the weights' rows are copied one cache line apart before the chunks' fork: rows a
    multiple of 4 KiB long (`matmul_kernel.ALIASING_STRIDE`; 1x1 convs over 1024 or 2048 channels),
    which the products of the chunks, serial, would read in place. 8 x 1024 x 14 x 14 -> 256
    channels on two Zen 4 cores: 101 -> 182 GFLOP/s (docs/cpu-backend.md, "conv2d")."""
    return o >= matmul_kernel.SHORT_TILE_ROWS and matmul_kernel.aliases(depth, acc)


def _conv2d_scratch(op: Op) -> int:
    """The weights' restrided copy (`_restrides_weights`), when the conv may take the im2col form."""
    tw = op.operands[1].type
    o, depth, acc = tw.shape[0], tw.size // tw.shape[0], accumulator_elem(op.result.type.dtype)
    return matmul_kernel.restrided_bytes(o, depth, acc) if _restrides_weights(o, depth, acc) else 0


SCRATCH["conv2d"] = _conv2d_scratch


def _im2col_cap(depth: int) -> int:
    """Elements of an im2col chunk's column matrix for a sum over `depth` taps (see IM2COL_MAX_ELEMENTS)."""
    return IM2COL_MAX_ELEMENTS if depth * IM2COL_MIN_COLUMNS <= IM2COL_MAX_ELEMENTS else WIDE_CHUNK_ELEMENTS


def _epilogue_cap(cap: int, conv: _Conv, o: int) -> int:
    """`cap` for the chunks of a conv with an epilogue, lowered so that a chunk's product (O x its
    columns) also stays under EPILOGUE_PRODUCT_ELEMENTS: the epilogue (and its pool) reads it back
    from L2. A shallow conv's product is the larger: 1 -> 32 channels 3x3 makes 32 outputs from 9
    taps. The CNN's conv + bias + relu + 2x2 max pooling, 64 x 1 x 28 x 28: 16 images a chunk
    (1.6 MB of product) 386 us, 4 (400 KB) 366 us, paired in one process."""
    if conv.epilogue is None:
        return cap
    depth = conv.tw.size // o
    return min(cap, depth * max(1, EPILOGUE_PRODUCT_ELEMENTS // o))


def _conv_chunk(n: int, oh: int, depth: int, ow: int, cap: int) -> tuple[int, int]:
    """(images, output rows) per chunk of at most `cap` elements of the column matrix: all rows of
    as many images as fit, else one image's rows in blocks that fit, preferring a block height that
    divides OH when one is at least half the largest that fits (no tail block)."""
    per_image = depth * oh * ow
    if per_image <= cap:
        return max(1, min(n, cap // per_image)), oh
    rows = max(1, cap // (depth * ow))
    divisor = max(d for d in range(1, rows + 1) if oh % d == 0)
    return 1, divisor if 2 * divisor >= rows else rows


def _whole_images(n: int, fit: int) -> int:
    """Images per chunk when `fit` of the `n` fit in one: a divisor of `n` of at least half `fit`
    when there is one, so that no tail chunk repeats the chunk's code (im2col, packing, product,
    epilogue) for the images left over, and of those one giving a number of chunks the cores share
    evenly (then they run in one fork), the largest. The CNN's 64 x 1 x 28 x 28 3x3 conv: 18 images
    a chunk, three chunks in turn and a tail of 10 (1050 lines of MLIR), now 16, four chunks on two
    cores."""
    whole = [d for d in range(max(1, fit // 2), fit + 1) if n % d == 0]
    shared = [d for d in whole if (n // d) % matmul_kernel.cores() == 0]
    return max(shared or whole, default=fit)


def _conv_as_matmul(em: KernelEmitter, padded: str, padded_type: TensorType, conv, result, epilogue) -> str:
    """conv2d as W (O, C*KH*KW) @ cols (C*KH*KW, N*OH*OW) (see `_conv_images`), over chunks whose
    column matrix fits IM2COL_MAX_ELEMENTS (`_conv_chunk`). With several cores and at least as many
    whole chunks as cores, the chunks are split over the cores (each thread makes its chunk's
    columns and multiplies them on its own, so the im2col and the copies run in parallel too, with
    one fork for the whole convolution); otherwise chunk after chunk, each product on all cores.
    With an `epilogue`, each chunk's product goes through it into its window of the output. `conv`
    = (weights, their type, stride, dilation, padding): padding None when `padded` is the padded
    input, else that of the unpadded input, which im2col pads as it reads (`_im2col_pads`)."""
    w, tw, stride, dilation, padding = conv
    n, o, oh, ow = result.shape
    depth = tw.size // o
    acc = accumulator_elem(result.dtype)
    weights = reshape(em, widen_tensor(em, w, tw, acc), tw, (o, depth), acc)
    conv = _Conv(weights, tw, stride, dilation, acc, epilogue, padding)
    if over_taps(tw, result):
        return conv.finish(em, _conv_over_taps(em, (padded, padded_type), conv, result), result)
    images, rows = _conv_chunk(n, oh, depth, ow, WIDE_CHUNK_ELEMENTS)
    if _pointwise(tw, stride, padded_type):
        images = 1 if n > 1 else images  # each image's own view is its column matrix (`_pointwise_columns`)
    else:
        images, rows = _conv_chunk(n, oh, depth, ow, _epilogue_cap(_im2col_cap(depth), conv, o))
        if rows == oh and images < n:
            images = _whole_images(n, images)
    if rows < oh:  # blocks of rows that pool on their own
        rows = max(conv.row_step, rows // conv.row_step * conv.row_step)
    w_ = matmul_kernel.LoopWriter(em)
    whole = n // images if rows == oh else n * (oh // rows)  # whole chunks
    threads = matmul_kernel.cores()
    if threads < 2 or whole < threads or (whole < 2 * threads and whole % threads):
        if images == n and rows == oh:
            return conv.finish(em, _conv_images(em, (padded, padded_type), conv, result), result)
        return conv.finish(
            em, _conv_chunks_in_turn(em, w_, (padded, padded_type), conv, result, (images, rows)), result
        )
    in_fork = conv
    if _restrides_weights(o, depth, acc):
        # Before the fork, for the chunks' products inside it: serial, they have no scratch area
        # of their own (the tail chunks after it are not, and restride the weights themselves).
        copier = matmul_kernel.LoopWriter.with_scratch(em, matmul_kernel.restrided_bytes(o, depth, acc))
        source = (conv.weights, f"tensor<{o}x{depth}x{acc}>", [])
        weights = matmul_kernel.restride(copier, source, o, depth, acc, copier.index(0), threads)
        in_fork = dataclasses.replace(conv, weights=weights)
    out_type = tensor_type(conv.out(result), conv.out_elem)
    done, t, shared = w_.open_forall(whole, em.empty(conv.out(result), conv.out_elem), out_type)
    if rows == oh:
        image, row = w_.mul(t, w_.index(images)), w_.index(0)
    else:
        per_image = w_.index(oh // rows)
        image = em.op(f"arith.divui {t}, {per_image} : index")
        row = w_.mul(em.op(f"arith.remui {t}, {per_image} : index"), w_.index(rows))
    part = result.with_shape((images, o, rows, ow))
    where = conv.out_slice(w_, image, row, part)
    part_type = tensor_type(conv.out(part), conv.out_elem)
    into = em.op(f"tensor.extract_slice {shared}{where} : {out_type} to {part_type}")
    scratch, em.scratch = em.scratch, None  # the shared scratch area is no thread's own: allocate
    y = _conv_images(em, (padded, padded_type), in_fork, part, (image, row), serial=True, into=into)
    em.scratch = scratch
    w_.close_forall(y, shared, where, part_type, out_type)
    if rows == oh and n % images:  # the tail chunk of images
        done = _conv_chunk_into(
            em, (padded, padded_type), conv, result, done, (w_.index(whole * images), n % images, w_.index(0), oh)
        )
    elif rows < oh and oh % rows >= conv.row_step:  # each image's tail block of rows (a whole pooling window)
        first = w_.index(oh // rows * rows)
        tail = lambda image, _, into: _conv_chunk_into(
            em, (padded, padded_type), conv, result, into, (image, 1, first, oh % rows)
        )
        done = _blocks(w_, 1, n, tail, done, out_type)
    return conv.finish(em, done, result)


def _conv_chunks_in_turn(em: KernelEmitter, w_, source, conv, result: TensorType, chunk: tuple[int, int]) -> str:
    """The chunks one after another (each product on all cores): loops over whole chunks, then tails."""
    n, oh = result.shape[0], result.shape[2]
    images, rows = chunk
    out_type = tensor_type(conv.out(result), conv.out_elem)
    empty = em.empty(conv.out(result), conv.out_elem)

    def chunk_into(image, count, row, height, into):
        return _conv_chunk_into(em, source, conv, result, into, (image, count, row, height))

    if rows == oh:  # runs of whole images
        return _blocks(
            w_, images, n, lambda first, count, into: chunk_into(first, count, w_.index(0), oh, into), empty, out_type
        )

    def image_rows(first, _, into):
        return _blocks(
            w_, rows, oh, lambda row, height, inner: chunk_into(first, 1, row, height, inner), into, out_type
        )

    return _blocks(w_, 1, n, image_rows, empty, out_type)


def _blocks(w_, size: int, total: int, emit, into: str, out_type: str) -> str:
    """`into` after `emit(first, count, into)` over the whole blocks of `size` (a loop), then the tail."""
    full = total // size
    if full == 1 and total == size:
        return emit(w_.index(0), size, into)
    loop, i, (carried,) = w_.open_for(w_.index(0), w_.index(full), w_.index(1), [(into, out_type)])
    w_.close_for([emit(w_.mul(i, w_.index(size)), size, carried)], [out_type])
    return loop if total % size == 0 else emit(w_.index(full * size), total % size, loop)


def _conv_chunk_into(em: KernelEmitter, source, conv, result: TensorType, into: str, chunk) -> str:
    """`into` with the output rows [row, row + height) of images [image, image + count) computed
    (`row` a multiple of the epilogue's pool height; rows past its last whole window are left out)."""
    image, count, row, height = chunk
    part = result.with_shape((count, result.shape[1], height, result.shape[3]))
    if conv.out(part).size == 0:  # a tail shorter than a pooling window
        return into
    where = conv.out_slice(matmul_kernel.LoopWriter(em), image, row, part)
    part_type, out_type = tensor_type(conv.out(part), conv.out_elem), tensor_type(conv.out(result), conv.out_elem)
    window = em.op(f"tensor.extract_slice {into}{where} : {out_type} to {part_type}")
    y = _conv_images(em, source, conv, part, (image, row), into=window)
    return em.op(f"tensor.insert_slice {y} into {into}{where} : {part_type} into {out_type}")


def _conv_images(
    em: KernelEmitter, source, conv, result: TensorType, origin=None, serial: bool = False, into=None
) -> str:
    """The convolution in the accumulator type of the images and output rows `result` covers, from
    image and output row `origin` (index values; the first ones when None) of the padded input
    `source` = (tensor, type): cols[c, kh, kw, n, oh, ow] = x[n, c, oh*s0 + kh*d0, ow*s1 + kw*d1]
    (`_im2col`), the matmul kernel's W @ cols as (O, N, OH, OW), transposed to NCHW (a reshape for
    one image), or, with the convolution's epilogue, its result (computed `into` that tensor when
    given). `serial`: the product stays on the calling thread."""
    weights, tw, stride, dilation, acc = conv.weights, conv.tw, conv.stride, conv.dilation, conv.acc
    n, o, oh, ow = result.shape
    c, kh, kw = tw.shape[1:]
    depth, columns = c * kh * kw, n * oh * ow
    in_place = False  # the kernel reads the columns where they are (`MatmulShape.b_in_place`)
    if _pointwise(tw, stride, source[1]) and n == 1:  # the image's rows are the columns already
        cols = _pointwise_columns(em, source, origin, columns, acc)
    else:
        in_place = serial and depth * columns <= IM2COL_MAX_ELEMENTS  # just written, in L2
        cols_type = TensorType((c, kh, kw, n, oh, ow), result.dtype)
        if conv.padding is not None:
            cols = _im2col_padding(em, source, cols_type, conv, origin)
        else:
            cols = _im2col(em, source, cols_type, stride, dilation, acc, origin)
        cols = reshape(em, cols, TensorType((cols_type.size,), result.dtype), (depth, columns), acc)
    shape = matmul_kernel.MatmulShape(0, o, columns, depth, acc, serial=serial, b_in_place=in_place)
    if n == 1 and conv.epilogue is None and into is not None:
        # One image's rows: the product is its window of the output, (O, rows x OW) in place. As a
        # product of its own, reshaped to the window, it was a temporary copied into the output
        # (a strided copy, the one plain loop that kept such a conv on LLVM's O3).
        four = f"tensor<1x{o}x{oh}x{ow}x{acc}>"
        view = em.op(f"tensor.collapse_shape {into} [[0, 1], [2, 3]] : {four} into tensor<{o}x{columns}x{acc}>")
        product = matmul_kernel.emit_matmul(em, weights, cols, shape, out=view)
        return em.op(
            f"tensor.expand_shape {product} [[0, 1], [2, 3]] output_shape [1, {o}, {oh}, {ow}] "
            f": tensor<{o}x{columns}x{acc}> into {four}"
        )
    product = matmul_kernel.emit_matmul(em, weights, cols, shape)
    if n == 1 and conv.epilogue is None:
        return reshape(em, product, TensorType((o, columns), result.dtype), result.shape, acc)
    onhw = TensorType((o, n, oh, ow), result.dtype)
    product = reshape(em, product, TensorType((o, columns), result.dtype), onhw.shape, acc)
    if conv.epilogue is not None:
        return conv.epilogue.apply(em, product, True, result, origin, into, serial)
    return transpose(em, product, onhw, [1, 0, 2, 3], acc, into)[0]


# A chunk of whole images with fewer columns than this leaves the matmul kernel's panels (32
# columns for float32) mostly empty; convolutions with short output rows and long kernel rows are
# then summed over chunks of their taps instead (`_conv_over_taps`).
TAPS_FORM_MAX_COLUMNS = 128

# ... while each thread's partial sum (O x N*OH*OW) stays under this many elements.
TAPS_FORM_MAX_OUTPUT = 1 << 21


def over_taps(tw: TensorType, result: TensorType) -> bool:
    """Whether `_conv_over_taps` computes this convolution: output rows shorter than the kernel's
    (a weight gradient: the forward's kernel is its output, the forward's output its kernel) and
    chunks of whole images (of `WIDE_CHUNK_ELEMENTS`) too narrow for the matmul kernel."""
    n, _, oh, ow = result.shape
    images, rows = _conv_chunk(n, oh, tw.size // tw.shape[0], ow, WIDE_CHUNK_ELEMENTS)
    return ow < tw.shape[3] and images * rows * ow < TAPS_FORM_MAX_COLUMNS and result.size <= TAPS_FORM_MAX_OUTPUT


def _conv_over_taps(em: KernelEmitter, source, conv, result: TensorType) -> str:
    """The convolution as a sum over chunks of its taps: out (O, N*OH*OW) = sum over chunks of
    W[:, chunk] @ rows[:, chunk]^T, where rows[(n, oh, ow), (c, kh, kw)] = x[n, c, oh*s0 + kh*d0,
    ow*s1 + kw*d1] (`_im2row`: along kernel rows, which are long here, unlike the output rows) and
    a chunk is a run of (c, kh) pairs. The matmul kernel adds each chunk's product to the running
    sum (`MatmulShape.accumulate`). On several cores each thread sums its share of the chunks into
    its own partial sum (one fork), and the partial sums are added at the end. The weight gradient
    of a 3x3 conv over 8x64x56x56 (O x N*OH*OW = 64 x 576, 25,088 taps) took 14.5 ms as chunks of
    images (two images, 18 columns each), about 8 this way (fj.grad w.r.t. w with its forward:
    21.4 -> 14.9 ms; docs/cpu-backend.md, "conv2d")."""
    weights, tw, stride, dilation, acc = conv.weights, conv.tw, conv.stride, conv.dilation, conv.acc
    n, o, oh, ow = result.shape
    c, kh, kw = tw.shape[1:]
    columns = n * oh * ow
    fit = max(1, WIDE_CHUNK_ELEMENTS // (columns * kw))
    pairs = max(d for d in range(1, min(c * kh, fit) + 1) if (c * kh) % d == 0)  # (c, kh) pairs per chunk
    chunks, taps = c * kh // pairs, pairs * kw
    threads = max(1, min(matmul_kernel.cores(), chunks))
    per = -(-chunks // threads)
    threads = -(-chunks // per)
    w_ = matmul_kernel.LoopWriter(em)
    sum_t = TensorType((o, columns), result.dtype)
    sum_type = tensor_type(sum_t, acc)

    def add_chunk(chunk: str, into: str, serial: bool) -> str:
        first = w_.mul(chunk, w_.index(pairs))
        rows = _im2row(em, source, (n, oh, ow), (kh, kw), (first, pairs), stride, dilation, acc)
        a = em.op(
            f"tensor.extract_slice {weights}[0, {w_.mul(first, w_.index(kw))}] [{o}, {taps}] [1, 1] "
            f": tensor<{o}x{c * kh * kw}x{acc}> to tensor<{o}x{taps}x{acc}>"
        )
        shape = matmul_kernel.MatmulShape(0, o, columns, taps, acc, b_rows=True, serial=serial, accumulate=True)
        return matmul_kernel.emit_matmul(em, a, rows, shape, into)

    def chunk_loop(lo: str, hi: str, serial: bool) -> str:
        zero = fill(em, const(em, 0, acc), sum_t, acc)
        loop, i, (partial,) = w_.open_for(lo, hi, w_.index(1), [(zero, sum_type)])
        w_.close_for([add_chunk(i, partial, serial)], [sum_type])
        return loop

    if threads == 1:
        total = chunk_loop(w_.index(0), w_.index(chunks), False)
    else:
        parts_type = f"tensor<{threads}x{o}x{columns}x{acc}>"
        empty = em.empty(TensorType((threads, o, columns), result.dtype), acc)
        parts, t, shared = w_.open_forall(threads, empty, parts_type)
        lo = w_.mul(t, w_.index(per))
        hi = em.op(f"arith.minsi {w_.add(lo, w_.index(per))}, {w_.index(chunks)} : index")
        scratch, em.scratch = em.scratch, None  # the shared scratch area is no thread's own: allocate
        partial = chunk_loop(lo, hi, True)
        em.scratch = scratch
        w_.close_forall(partial, shared, f"[{t}, 0, 0] [1, {o}, {columns}] [1, 1, 1]", sum_type, parts_type)
        ident = em.identity_map(2)
        where = f"[1, {o}, {columns}] [1, 1, 1] : {parts_type} to {sum_type}"
        slices = [em.op(f"tensor.extract_slice {parts}[{k}, 0, 0] {where}") for k in range(threads)]
        total = em.generic(
            [(part, sum_type) for part in slices],
            (em.empty(sum_t, acc), sum_type),
            [ident] * (threads + 1),
            ["parallel", "parallel"],
            lambda b, args: functools.reduce(
                lambda total, part: combine(b, "sum", total, part, acc, acc.startswith("i")), args[1:threads], args[0]
            ),
            [acc] * threads,
            acc,
        )
        if sum_t.size > schedule.PLAIN_LOOP_MAX_ELEMENTS:  # vector code: as plain loops, only LLVM's O3 vectorizes
            em.schedule(total, schedule.copy_nd(sum_t.shape, int(acc[1:]), False))
    onhw = TensorType((o, n, oh, ow), result.dtype)
    total = reshape(em, total, sum_t, onhw.shape, acc)
    if conv.epilogue is not None:
        return conv.epilogue.apply(em, total, True, result, None, None, False)
    return transpose(em, total, onhw, [1, 0, 2, 3], acc)[0]


def _im2row(em: KernelEmitter, source, out_dims, kernel, pairs, stride, dilation, acc) -> str:
    """rows[(n, oh, ow), (p, kw)] = x[n, c, oh*s0 + kh*d0, ow*s1 + kw*d1] for the `pairs` = (first,
    count) run of (c, kh) pairs (c = p // KH, kh = p % KH), as a (N*OH*OW, count*KW) tensor: per
    output position and pair, the KW taps along one input row (`window_rows`)."""
    n, oh, ow = out_dims
    kh, kw = kernel
    first, count = pairs
    strides = row_major_strides(source[1].shape)
    width = count * kw

    def pair_offsets(w, q: str) -> tuple[str, str]:
        pair = w.add(first, q)
        channel = w.em.op(f"arith.divui {pair}, {w.index(kh)} : index")
        kernel_row = w.em.op(f"arith.remui {pair}, {w.index(kh)} : index")
        read = w.add(w.mul(channel, w.index(strides[1])), w.mul(kernel_row, w.index(dilation[0] * strides[2])))
        return read, w.mul(q, w.index(kw))

    levels = [
        (n, (strides[0], oh * ow * width)),
        (oh, (stride[0] * strides[2], ow * width)),
        (ow, (stride[1], width)),
        (count, pair_offsets),
    ]
    rows = window_rows(em, source, n * oh * ow * width, levels, (kw, dilation[1]), acc)
    return reshape(em, rows, TensorType((n * oh * ow * width,), source[1].dtype), (n * oh * ow, width), acc)


def _pointwise(tw: TensorType, stride, padded_type: TensorType) -> bool:
    """A 1x1 convolution with stride 1 over an input in the accumulator type: one image's
    (C, H*W) view is its column matrix (a chunk of it, a block of its rows), so no im2col."""
    return (
        tw.shape[2:] == (1, 1)
        and tuple(stride) == (1, 1)
        and elem_type(padded_type.dtype) == accumulator_elem(padded_type.dtype)
    )


def _pointwise_columns(em: KernelEmitter, source, origin, columns: int, acc: str) -> str:
    """The columns of a pointwise convolution's chunk: the (C, columns) view of image n0 from output
    row oh0 on (`origin`; the first image and row when None), a strided slice of the input."""
    x, t = source
    n, c, h, w = t.shape
    flat = reshape(em, x, t, (n, c, h * w), acc)
    image, row = origin if origin is not None else (em.op("arith.constant 0 : index"),) * 2
    first = em.op(f"arith.muli {row}, {em.op(f'arith.constant {w} : index')} : index")
    view = f"tensor<{c}x{columns}x{acc}>"
    return em.op(
        f"tensor.extract_slice {flat}[{image}, 0, {first}] [1, {c}, {columns}] [1, 1, 1] "
        f": tensor<{n}x{c}x{h * w}x{acc}> to {view}"
    )


def _im2col(em: KernelEmitter, source, cols_type: TensorType, stride, dilation, acc, origin=None):
    """cols[c, kh, kw, n, oh, ow] = x[n0 + n, c, (oh0 + oh)*s0 + kh*d0, ow*s1 + kw*d1] as a flat
    tensor, (n0, oh0) = `origin` (index values, or the first image and row), x = `source` (the
    padded input, (tensor, type)), one output row (fixed c, kh, kw, n, oh) at a time
    (`window_rows`). (A 6-D generic computed the same but LLVM spent 150-300 ms compiling its
    unrolled small loops.)"""
    c, kh, kw, n, oh, ow = cols_type.shape
    strides = row_major_strides(source[1].shape)

    def base(w) -> str:  # the chunk's first image and output row
        return w.add(w.mul(origin[0], w.index(strides[0])), w.mul(origin[1], w.index(stride[0] * strides[2])))

    # (bound, (input elements, output elements) per step) of the c, kh, kw, n, oh loops
    levels = [
        (c, (strides[1], kh * kw * n * oh * ow)),
        (kh, (dilation[0] * strides[2], kw * n * oh * ow)),
        (kw, (dilation[1], n * oh * ow)),
        (n, (strides[0], oh * ow)),
        (oh, (stride[0] * strides[2], ow)),
    ]
    return window_rows(em, source, cols_type.size, levels, (ow, stride[1]), acc, base if origin else None)


def _im2col_pads(tx: TensorType, tw: TensorType, result: TensorType, stride, padding) -> bool:
    """Whether im2col reads the unpadded input and pads as it reads (`_im2col_padding`), so that no
    padded copy of the input is made: a padded convolution with stride 1 along the rows, rows of
    input and output at least a vector long, at most a vector of padding on either side of a row,
    and the plain im2col form (not the sum over taps, not a 1x1 conv)."""
    lanes = matmul_kernel.vector_bits() // int(accumulator_elem(result.dtype)[1:])
    ow = result.shape[3]
    return (
        any(lo or hi for lo, hi in padding)
        and stride[1] == 1
        and min(tx.shape[3], ow) >= lanes
        and max(padding[1]) <= lanes
        and tw.shape[2:] != (1, 1)
        and not over_taps(tw, result)
    )


def _im2col_padding(em: KernelEmitter, source, cols_type: TensorType, conv, origin=None) -> str:
    """`_im2col` of the unpadded input `source`, zero outside it (conv.padding, `_im2col_pads`):
    per row (c, kh, n, oh) the input row ih = (oh0 + oh)*s0 + kh*d0 - top, read clamped into the
    input and zeroed when outside it; per kernel column kw (written out) the row's vectors at
    columns 0, lanes, 2*lanes, ... and OW - lanes (the last overlapping the one before) read
    input columns q + kw*d1 - left: a run of three or more vectors wholly inside the input row is
    one loop of plain reads; each other vector (at most a vector of padding: the first ones and
    the last ones) reads from a start clamped into the row, its lanes moved into place and the
    ones outside the row zeroed by one constant shuffle (none when it lies inside)."""
    x, t = source
    c, kh, kw, n, oh, ow = cols_type.shape
    _, _, height, width = t.shape
    (top, _), (left, _) = conv.padding
    stride, dilation, acc = conv.stride, conv.dilation, conv.acc
    elem = elem_type(t.dtype)
    lanes = matmul_kernel.vector_bits() // int(acc[1:])
    strides = row_major_strides(t.shape)
    flat_in = TensorType((t.size,), t.dtype)
    flat_source = reshape(em, x, t, flat_in.shape)
    flat_t = TensorType((cols_type.size,), cols_type.dtype)
    flat_type = tensor_type(flat_t, acc)
    w = matmul_kernel.LoopWriter(em)
    vec, wide = f"vector<{lanes}x{elem}>", f"vector<{lanes}x{acc}>"
    zero_in = em.op(f"arith.constant dense<0.0> : {vec}")
    zero_out = em.op(f"arith.constant dense<0.0> : {wide}")
    pad = em.op(f"arith.constant 0.0 : {elem}")
    plane = n * oh * ow  # elements of the column matrix per (c, kh, kw)
    origin = origin or (w.index(0), w.index(0))
    carried, loops = em.empty(flat_t, acc), []
    ivs = []
    for bound in (c, kh, n, oh):
        loop, iv, (carried,) = w.open_for(w.index(0), w.index(bound), w.index(1), [(carried, flat_type)])
        loops.append(loop)
        ivs.append(iv)
    ci, khi, ni, ohi = ivs
    row = em.op(
        f"arith.subi {w.add(w.mul(w.add(origin[1], ohi), w.index(stride[0])), w.mul(khi, w.index(dilation[0])))}, "
        f"{w.index(top)} : index"
    )
    inside = em.op(
        f"arith.andi {em.op(f'arith.cmpi sge, {row}, {w.index(0)} : index')}, "
        f"{em.op(f'arith.cmpi slt, {row}, {w.index(height)} : index')} : i1"
    )
    clamped = em.op(f"arith.minsi {em.op(f'arith.maxsi {row}, {w.index(0)} : index')}, {w.index(height - 1)} : index")
    image = w.add(origin[0], ni)
    row_start = w.add(
        w.add(w.mul(image, w.index(strides[0])), w.mul(ci, w.index(strides[1]))), w.mul(clamped, w.index(strides[2]))
    )
    out_row = w.add(
        w.add(w.mul(w.add(w.mul(ci, w.index(kh)), khi), w.index(kw * plane)), w.mul(ni, w.index(oh * ow))),
        w.mul(ohi, w.index(ow)),
    )
    steps = -(-ow // lanes)
    columns = [min(j * lanes, ow - lanes) for j in range(steps)]

    in_type = tensor_type(flat_in)

    def vector_at(column: int | str, shift: int) -> str:
        """The row's vector at output column `column` (an index value: a middle vector) for kernel
        column offset `shift`."""
        picks = list(range(lanes))
        if isinstance(column, str):  # inside the row
            where = w.add(row_start, w.add(column, w.index(shift)))
        else:
            first = column + shift
            start = min(max(first, 0), width - lanes)
            where = w.add(row_start, w.index(start))
            picks = [first + lane - start if 0 <= first + lane < width else lanes for lane in range(lanes)]
        v = em.op(f"vector.transfer_read {flat_source}[{where}], {pad} {{in_bounds = [true]}} : {in_type}, {vec}")
        if picks != list(range(lanes)):
            v = em.op(f"vector.shuffle {v}, {zero_in} [{', '.join(map(str, picks))}] : {vec}, {vec}")
        if elem != acc:
            v = em.op(f"arith.extf {v} : {vec} to {wide}")
        return em.op(f"arith.select {inside}, {v}, {zero_out} : {wide}")

    cur = carried
    for k in range(kw):
        shift = k * dilation[1] - left
        out = w.add(out_row, w.index(k * plane))
        # Vectors wholly inside the input row, at multiples of lanes: a run of them is one loop.
        plain = [j for j in range(steps) if columns[j] == j * lanes and 0 <= columns[j] + shift <= width - lanes]
        run = (plain[0], plain[-1] + 1) if len(plain) > 2 else (0, 0)
        for j in range(steps):
            if not run[0] <= j < run[1]:
                cur = em.op(
                    f"vector.transfer_write {vector_at(columns[j], shift)}, {cur}[{w.add(out, w.index(columns[j]))}] "
                    f"{{in_bounds = [true]}} : {wide}, {flat_type}"
                )
        if run[1] > run[0]:
            loop, j, (inner,) = w.open_for(w.index(run[0]), w.index(run[1]), w.index(1), [(cur, flat_type)])
            column = w.mul(j, w.index(lanes))
            inner = em.op(
                f"vector.transfer_write {vector_at(column, shift)}, {inner}[{w.add(out, column)}] "
                f"{{in_bounds = [true]}} : {wide}, {flat_type}"
            )
            w.close_for([inner], [flat_type])
            cur = loop
    return close_loops(w, cur, flat_type, loops)
