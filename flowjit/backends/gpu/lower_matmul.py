"""Matmul-shaped dot_generals, and conv2d as an implicit product, as a tiled kernel through
workgroup (shared) memory.

Which products (`tiled_product`): float32, float16 or bfloat16 operands (half types accumulate in
float32, the result is rounded to the op's dtype), batch dimensions leading in both operands and
in the same order, one contracting dimension and one free dimension per operand; either operand
may be transposed (A given as (batch..., K, M), B as (batch..., N, K)). The kernel is worth its
tiles only when the product fills them (`uses_tiles`): M and N of at least `MIN_MN` (with fewer
rows or columns most of a tile's threads would compute masked zeros while the one-thread-per-
element kernel keeps every thread busy) and K of at least `BK` (with fewer, each element is read
from global memory once either way, so shared memory saves nothing). Any other product keeps
`lower_kernels.lower_dot_general` (one thread per element, a loop over K from global memory).

A convolution (`tiled_conv`, NCHW input, OIHW weights, any stride, padding and dilation) is,
per image, the product of its weights viewed as (O, C KH KW) and its windows (C KH KW, OH OW),
under the same rule; the kernel reads each window element from the input where it loads B's
tile (`_window_loader`: padding clamped and selected to 0), so the windows are never stored, and
C is the result viewed as (N, O, OH OW).

Where: a top-level product through the call lowering (`lower_tiled`), writing the result's
own buffer (one launch); a product or convolution inside a fused region whose other ops are an
elementwise epilogue (a layer's `tanh(x @ w + b)`, a CNN layer's `relu(conv2d(x, w) + b)`) through
`lower_epilogue.py`, the epilogue applied to each thread's sums before the store (`emit`'s
`store`, at the result's element `result_indices`; one launch); a product inside any other fused
region (lowered op by op on tensors) through the tensor lowering (`tiled_tensor`), writing a
temporary that the rest of the region, a kernel of its own, reads.

The kernel (`emit`, a `gpu.launch` on the operands' and the result's buffers, written at the
"mlir" stage): block (x, y, z) computes the `BM` x `BN` tile (y, x) of C in batch z with
`THREADS` threads; thread t holds a `MICRO` x `MICRO` micro-tile in registers, rows
t / 16 + 16 i and columns t % 16 + 16 j (strided, so that a warp's reads of the B tile and its
stores of C touch consecutive words). K goes in steps of `BK`: the block loads the `BM` x `BK`
tile of A and the `BK` x `BN` tile of B into workgroup memory (each thread 4 elements of each,
consecutive threads reading consecutive addresses of the operand's contiguous dimension, so
global reads are coalesced whichever operand is transposed), `gpu.barrier`, each thread
accumulates its micro-tile from the shared tiles (`math.fma` in float32), `gpu.barrier`. The
shared tiles are stored k-major, `BK` x (`BM` + `PAD`) floats: the padding makes a warp's
transposing stores (16 consecutive k of two rows) hit 32 distinct banks.

Edges: a dimension that is not a multiple of its tile is masked where it is read (the index
clamped into the operand, the value replaced by 0) and where C is written (the store skipped);
dimensions that are multiples get no mask. No thread reads or writes outside its buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowjit.backends.gpu.launch import workgroup_launch
from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder, memory_elem_type, memref_type, tensor_type
from flowjit.backends.mlir.lower_elementwise import extend, narrow
from flowjit.backends.mlir.lowering import call_buffers
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType

BM = BN = 64  # a block's tile of C (equal: the shared tiles and their loads assume it)
BK = 16  # the K step
THREADS = 256
MICRO = 4  # each thread's micro-tile is MICRO x MICRO
PAD = 2  # floats after each k-row of a shared tile (bank conflicts)
MIN_MN = 32  # the fewest rows and columns the tiled kernel takes
_SPREAD = BM // MICRO  # threads along a tile's rows and columns (16)
_FLOATS = (dt.float32, dt.float16, dt.bfloat16)
_GRID_YZ_MAX = 65535


@dataclass(frozen=True)
class TiledProduct:
    """The product batch x (M, K) @ (K, N) the tiled kernel computes (a dot_general's, or a
    conv2d's implicit one), and whether a dot_general's operands are stored transposed."""

    batch: int
    m: int
    n: int
    k: int
    a_transposed: bool  # A stored (batch..., K, M)
    b_transposed: bool  # B stored (batch..., N, K)


def tiled_product(op: Op) -> TiledProduct | None:
    """`op` (a dot_general) as a matmul the tiled kernel computes, or None."""
    a, b = (v.type for v in op.operands)
    result = op.result.type
    lc, rc = op.attrs["lhs_contract"], op.attrs["rhs_contract"]
    lb, rb = list(op.attrs["lhs_batch"]), list(op.attrs["rhs_batch"])
    nb = len(lb)
    if a.dtype not in _FLOATS or b.dtype != a.dtype or result.dtype not in _FLOATS:
        return None
    if lb != list(range(nb)) or rb != list(range(nb)) or len(lc) != 1 or len(rc) != 1:
        return None
    if a.rank != nb + 2 or b.rank != nb + 2:
        return None
    a_transposed, b_transposed = lc[0] == nb, rc[0] == nb + 1
    m = a.shape[nb + 1] if a_transposed else a.shape[nb]
    n = b.shape[nb] if b_transposed else b.shape[nb + 1]
    product = TiledProduct(math.prod(a.shape[:nb]), m, n, a.shape[lc[0]], a_transposed, b_transposed)
    if not uses_tiles(product):
        return None
    return product


def uses_tiles(p: TiledProduct) -> bool:
    """Whether the tiled kernel can win over one thread per element (the module docstring), and
    the grid fits (1 to 65535 batches, at most 65535 tiles of rows)."""
    rows = -(-p.m // BM)
    return p.m >= MIN_MN and p.n >= MIN_MN and p.k >= BK and rows <= _GRID_YZ_MAX and 1 <= p.batch <= _GRID_YZ_MAX


def tiled_conv(op: Op) -> TiledProduct | None:
    """`op` (a conv2d, NCHW x OIHW) as the implicit product the tiled kernel computes, or None:
    per image, weights (O, C KH KW) @ windows (C KH KW, OH OW), the windows read from the input
    where the kernel loads them (`_window_loader`), never stored."""
    x, w = (v.type for v in op.operands)
    result = op.result.type
    if x.dtype not in _FLOATS or w.dtype != x.dtype or result.size == 0:
        return None
    n, o, oh, ow = result.shape
    product = TiledProduct(n, o, oh * ow, math.prod(w.shape[1:]), False, False)
    return product if uses_tiles(product) else None


def planned_product(op: Op) -> TiledProduct | None:
    """`op` (a dot_general or conv2d) as the product the tiled kernel computes, or None."""
    return tiled_product(op) if op.name == "dot_general" else tiled_conv(op)


def lower_tiled(fl, op: Op) -> bool:
    """`LoweringTable.call` entry for dot_general and conv2d: the tiled kernel on the buffers, or
    False (the op gets `lower_kernels.lower_dot_general` or `lower_conv2d`)."""
    product = planned_product(op)
    buffers = call_buffers(fl, op) if product is not None else None
    if buffers is None:
        return False
    emit(fl.em, product, op, [buffer for buffer, _ in buffers])
    return True


def tiled_tensor(em: KernelEmitter, op: Op, operands: list[str]) -> str | None:
    """For the tensor lowering (a product inside a fused region, whose operands and result have no
    buffers of their own): the tiled kernel reading `operands`' buffers and writing a fresh one,
    returned as a tensor; None where the product is not tiled. The region's epilogue is a kernel of
    its own after it."""
    product = planned_product(op)
    if product is None:
        return None
    buffers = []
    for tensor, v in zip(operands, op.operands):
        ttype = tensor_type(v.type, memory_elem_type(v.type.dtype))
        buffers.append(em.op(f"bufferization.to_buffer {tensor} read_only : {ttype} to {memref_type(v.type)}"))
    ttype, memref = tensor_type(op.result.type, memory_elem_type(op.result.dtype)), memref_type(op.result.type)
    result = em.op(f"bufferization.to_buffer {em.empty(op.result.type)} : {ttype} to {memref}")
    emit(em, product, op, [*buffers, result])
    return em.op(f"bufferization.to_tensor {result} restrict writable : {memref} to {ttype}")


# --- the kernel ----------------------------------------------------------------------------------


def _as_3d(em: KernelEmitter, buffer: str, t: TensorType) -> tuple[str, str]:
    """`buffer` (of type `t`: batch dims, then two) viewed as (batch, rows, columns), and its type."""
    shape = t.shape
    nb = len(shape) - 2
    source, viewed = memref_type(t), memref_type(t.with_shape((math.prod(shape[:nb]), *shape[nb:])))
    if nb == 1:
        return buffer, source
    if nb == 0:
        extents = ", ".join(map(str, (1, *shape)))
        return em.op(
            f"memref.expand_shape {buffer} [[0, 1], [2]] output_shape [{extents}] : {source} into {viewed}"
        ), viewed
    groups = f"[[{', '.join(map(str, range(nb)))}], [{nb}], [{nb + 1}]]"
    return em.op(f"memref.collapse_shape {buffer} {groups} : {source} into {viewed}"), viewed


class _KernelWriter:
    """Writes the body of one tiled product's `gpu.launch` (`emit`)."""

    def __init__(self, b: ScalarBuilder, p: TiledProduct, op: Op, loaders, store, shared: tuple[str, str]):
        self.b, self.p, self.op = b, p, op
        self.loaders = loaders  # (A's, B's): fn(writer, k, free) -> (f32 value, validity or None)
        self.store = store  # fn(writer, f32 sum, row, column): writes C's element (`_result_store`)
        self.shared = shared  # (A tile, B tile) in workgroup memory
        self.shared_type = f"memref<{BK}x{BM + PAD}xf32, #gpu.address_space<workgroup>>"
        self.batch = ""  # the block's batch index (block id z), set by `write`

    def index(self, value: int) -> str:
        return self.b.const(value, "index")

    def affine(self, x: str, scale: int, add: str | None) -> str:
        """x * scale + add (index values; add None: 0)."""
        b = self.b
        scaled = x if scale == 1 else b.op(f"arith.muli {x}, {self.index(scale)} : index")
        return scaled if add is None else b.op(f"arith.addi {scaled}, {add} : index")

    def masked(self, coordinates: list[tuple[str, int, bool]]) -> tuple[list[str], str | None]:
        """Each (index, extent, needs a mask) clamped into its extent where masked, and the
        conjunction of the masked ones' `index < extent` (None: no mask)."""
        b, clamped, valid = self.b, [], None
        for index, extent, mask in coordinates:
            if not mask:
                clamped.append(index)
                continue
            valid = self.both(valid, b.op(f"arith.cmpi ult, {index}, {self.index(extent)} : index"))
            clamped.append(b.op(f"arith.minui {index}, {self.index(extent - 1)} : index"))
        return clamped, valid

    def both(self, x: str | None, y: str | None) -> str | None:
        """The conjunction of two optional conditions."""
        if x is None or y is None:
            return x if y is None else y
        return self.b.op(f"arith.andi {x}, {y} : i1")

    def load_tile(self, operand: int, k0: str, tid: str, free0: str) -> None:
        """Operand `operand`'s tile of this K step into its shared tile, stored [k][free]: each
        thread 4 elements, consecutive threads along the operand's contiguous dimension."""
        b, p = self.b, self.p
        k_major = p.a_transposed if operand == 0 else not p.b_transposed  # stored (K, free)
        free_extent = p.m if operand == 0 else p.n
        width = BM if k_major else BK  # extent of the tile's contiguous dimension
        inner = b.op(f"arith.remui {tid}, {self.index(width)} : index")
        outer = b.op(f"arith.divui {tid}, {self.index(width)} : index")
        zero = b.const(0.0, "f32")
        for s in range(BM * BK // THREADS):
            across = self.affine(self.index(s * (THREADS // width)), 1, outer) if s else outer
            k, free = (across, inner) if k_major else (inner, across)
            global_k, global_free = self.affine(k, 1, k0), self.affine(free, 1, free0)
            (gk, gf), valid = self.masked(
                [(global_k, p.k, p.k % BK != 0), (global_free, free_extent, free_extent % BM != 0)]
            )
            value, inside = self.loaders[operand](self, gk, gf)
            valid = self.both(valid, inside)
            if valid is not None:
                value = b.op(f"arith.select {valid}, {value}, {zero} : f32")
            b.line(f"memref.store {value}, {self.shared[operand]}[{k}, {free}] : {self.shared_type}")

    def shared_load(self, operand: int, k: str, first: str, step: int) -> str:
        """Element [k][first + 16 step] of operand `operand`'s shared tile."""
        at = self.affine(first, 1, self.index(_SPREAD * step))
        return self.b.op(f"memref.load {self.shared[operand]}[{k}, {at}] : {self.shared_type}")

    def accumulate(self, row: str, col: str, acc: list[str]) -> list[str]:
        """The micro-tile's sums after one K step: a loop over the shared tiles' k."""
        b, em = self.b, self.b.emitter
        kk, result = em.fresh("kk"), em.fresh("acc")
        carried = [em.fresh("c") for _ in acc]
        types = ", ".join(["f32"] * len(acc))
        b.line(
            f"{result}:{len(acc)} = scf.for {kk} = {self.index(0)} to {self.index(BK)} step {self.index(1)} "
            f"iter_args({', '.join(f'{c} = {a}' for c, a in zip(carried, acc))}) -> ({types}) {{"
        )
        b.indent += "  "
        a = [self.shared_load(0, kk, row, i) for i in range(MICRO)]
        w = [self.shared_load(1, kk, col, j) for j in range(MICRO)]
        sums = [
            b.op(f"math.fma {a[i]}, {w[j]}, {carried[i * MICRO + j]} : f32") for i in range(MICRO) for j in range(MICRO)
        ]
        b.line(f"scf.yield {', '.join(sums)} : {types}")
        b.indent = b.indent[:-2]
        b.line("}")
        return [f"{result}#{i}" for i in range(len(acc))]

    def write(self, block: tuple[str, str, str], tid: str) -> None:
        """The kernel of block ids `block` (x: tile column, y: tile row, z: batch), thread id `tid`."""
        b, p, em = self.b, self.p, self.b.emitter
        bx, by, self.batch = block
        row0, col0 = self.affine(by, BM, None), self.affine(bx, BN, None)
        row = b.op(f"arith.divui {tid}, {self.index(_SPREAD)} : index")
        col = b.op(f"arith.remui {tid}, {self.index(_SPREAD)} : index")
        zero = b.const(0.0, "f32")
        steps = -(-p.k // BK)
        kt, result = em.fresh("kt"), em.fresh("acc")
        carried = [em.fresh("c") for _ in range(MICRO * MICRO)]
        types = ", ".join(["f32"] * len(carried))
        b.line(
            f"{result}:{len(carried)} = scf.for {kt} = {self.index(0)} to {self.index(steps)} step {self.index(1)} "
            f"iter_args({', '.join(f'{c} = {zero}' for c in carried)}) -> ({types}) {{"
        )
        b.indent += "  "
        k0 = self.affine(kt, BK, None)
        self.load_tile(0, k0, tid, row0)
        self.load_tile(1, k0, tid, col0)
        b.line("gpu.barrier")
        sums = self.accumulate(row, col, carried)
        b.line("gpu.barrier")
        b.line(f"scf.yield {', '.join(sums)} : {types}")
        b.indent = b.indent[:-2]
        b.line("}")
        for i in range(MICRO):
            r = self.affine(row, 1, self.affine(row0, 1, self.index(_SPREAD * i)))
            for j in range(MICRO):
                c = self.affine(col, 1, self.affine(col0, 1, self.index(_SPREAD * j)))
                _, valid = self.masked([(r, p.m, p.m % BM != 0), (c, p.n, p.n % BN != 0)])
                if valid is not None:
                    b.line(f"scf.if {valid} {{")
                    b.indent += "  "
                # Rounded (and any epilogue computed) inside the store's block: skipped where
                # masked, and no bf16 value lives across blocks (x86, where the emulator runs
                # kernels, converts those by a libcall).
                self.store(self, f"{result}#{i * MICRO + j}", r, c)
                if valid is not None:
                    b.indent = b.indent[:-2]
                    b.line("}")


def _view_loader(view: str, mtype: str, dtype: dt.DType, k_major: bool, batched: bool):
    """Loads an operand held as a (batch, rows, columns) view: (K, free) when `k_major`, else
    (free, K); an operand without batches (`batched` False) is read at batch 0 by every block."""

    def load(w: _KernelWriter, k: str, free: str) -> tuple[str, str | None]:
        at = (k, free) if k_major else (free, k)
        batch = w.batch if batched else w.index(0)
        return extend(w.b, w.b.op(f"memref.load {view}[{batch}, {at[0]}, {at[1]}] : {mtype}"), dtype), None

    return load


def _window_loader(x: str, op: Op):
    """Loads element (k, p) of a convolution's windows: input channel c and tap (i, j) of
    k = (c KH + i) KW + j at output pixel p = oh OW + ow, read from the NCHW input `x` at row
    oh sh + i dh - pad_top and column ow sw + j dw - pad_left; a padded position is clamped into
    the input and selected to 0 (the validity returned)."""
    xt, wt = (v.type for v in op.operands)
    _, _, height, width = xt.shape
    _, _, kh, kw = wt.shape
    stride, dilation, padding = op.attrs["stride"], op.attrs["dilation"], op.attrs["padding"]
    ow_extent = op.result.type.shape[3]
    mtype = memref_type(xt)

    def load(w: _KernelWriter, k: str, p: str) -> tuple[str, str | None]:
        b = w.b
        channel = b.op(f"arith.divui {k}, {w.index(kh * kw)} : index")
        tap = b.op(f"arith.remui {k}, {w.index(kh * kw)} : index")
        taps = (b.op(f"arith.divui {tap}, {w.index(kw)} : index"), b.op(f"arith.remui {tap}, {w.index(kw)} : index"))
        pixel = (
            b.op(f"arith.divui {p}, {w.index(ow_extent)} : index"),
            b.op(f"arith.remui {p}, {w.index(ow_extent)} : index"),
        )
        at, valid = [], None
        for d, extent in enumerate((height, width)):
            position = w.affine(taps[d], dilation[d], w.affine(pixel[d], stride[d], None))
            if padding[d][0]:
                position = b.op(f"arith.subi {position}, {w.index(padding[d][0])} : index")
            if not any(padding[d]):  # every window lies inside the input along d
                at.append(position)
                continue
            low = b.op(f"arith.cmpi sge, {position}, {w.index(0)} : index")
            high = b.op(f"arith.cmpi slt, {position}, {w.index(extent)} : index")
            valid = w.both(valid, w.both(low, high))
            above = b.op(f"arith.maxsi {position}, {w.index(0)} : index")
            at.append(b.op(f"arith.minsi {above}, {w.index(extent - 1)} : index"))
        value = b.op(f"memref.load {x}[{w.batch}, {channel}, {at[0]}, {at[1]}] : {mtype}")
        return extend(b, value, xt.dtype), valid

    return load


def _result_store(view: str, mtype: str, dtype: dt.DType):
    """Stores C's element (row, column) of the block's batch, rounded to `dtype`, into `view`."""

    def store(w: _KernelWriter, value: str, row: str, column: str) -> None:
        w.b.line(f"memref.store {narrow(w.b, value, dtype)}, {view}[{w.batch}, {row}, {column}] : {mtype}")

    return store


def _operands(em: KernelEmitter, p: TiledProduct, op: Op, buffers: list[str]):
    """The loaders of A and B (`_KernelWriter.loaders`) and the (batch, M, N) view of C (None
    where `buffers` holds no C: an epilogue stores), made on the host (views of the buffers)."""
    a, b = op.operands
    if op.name == "dot_general":
        (va, ta), (vb, tb) = (_as_3d(em, buffer, v.type) for buffer, v in zip(buffers, (a, b)))
        loaders = (
            _view_loader(va, ta, a.type.dtype, p.a_transposed, True),
            _view_loader(vb, tb, b.type.dtype, not p.b_transposed, True),
        )
        if len(buffers) == 2:
            return loaders, None
        return loaders, _as_3d(em, buffers[2], op.result.type)
    # conv2d: weights (O, C, KH, KW) as (1, O, C KH KW)
    o, k = b.type.shape[0], math.prod(b.type.shape[1:])
    flat_type = b.type.with_shape((o, k))
    into = f"{memref_type(b.type)} into {memref_type(flat_type)}"
    flat = em.op(f"memref.collapse_shape {buffers[1]} [[0], [1, 2, 3]] : {into}")
    weights, weights_type = _as_3d(em, flat, flat_type)
    n, o, oh, ow = op.result.type.shape
    out_type = memref_type(op.result.type.with_shape((n, o, oh * ow)))
    loaders = (_view_loader(weights, weights_type, b.type.dtype, False, False), _window_loader(buffers[0], op))
    if len(buffers) == 2:
        return loaders, None
    out = em.op(
        f"memref.collapse_shape {buffers[2]} [[0], [1], [2, 3]] : {memref_type(op.result.type)} into {out_type}"
    )
    return loaders, (out, out_type)


def result_indices(w: _KernelWriter, op: Op, row: str, column: str) -> list[str]:
    """The indices into `op`'s result (a dot_general's or conv2d's) of C's element (row, column)
    in the block's batch: (batch..., row, column) for a product, (n, o, oh, ow) for a
    convolution, whose C is its result viewed as (N, O, OH OW)."""
    b = w.b
    shape = op.result.type.shape
    if op.name == "conv2d":
        ow = w.index(shape[3])
        return [w.batch, row, b.op(f"arith.divui {column}, {ow} : index"), b.op(f"arith.remui {column}, {ow} : index")]
    batch_shape = shape[:-2]
    if len(batch_shape) <= 1:
        return [w.batch] * len(batch_shape) + [row, column]
    indices, rest = [], w.batch
    for extent in reversed(batch_shape[1:]):
        indices.append(b.op(f"arith.remui {rest}, {w.index(extent)} : index"))
        rest = b.op(f"arith.divui {rest}, {w.index(extent)} : index")
    return [rest, *reversed(indices), row, column]


def emit(em: KernelEmitter, p: TiledProduct, op: Op, buffers: list[str], store=None) -> None:
    """The tiled kernel of `op` (a dot_general or conv2d) as a `gpu.launch` reading buffers (A, B)
    (conv2d: input, weights) and writing C (its result); or, given `store` (a fused region's
    epilogue, `lower_epilogue.py`) and no C, handing each thread's sums to `store` instead."""
    loaders, out = _operands(em, p, op, buffers)
    if store is None:
        store = _result_store(*out, op.result.dtype)
    shared = (em.fresh("a_tile"), em.fresh("b_tile"))
    one, tiles_n, tiles_m, batch, threads = (
        em.op(f"arith.constant {k} : index") for k in (1, -(-p.n // BN), -(-p.m // BM), p.batch, THREADS)
    )
    tile = f"memref<{BK}x{BM + PAD}xf32, #gpu.address_space<workgroup>>"
    workgroup_launch(
        em,
        op,
        (tiles_n, tiles_m, batch),
        (threads, one, one),
        [f"{shared[0]} : {tile}", f"{shared[1]} : {tile}"],
        lambda b, blocks, thread_ids: _KernelWriter(b, p, op, loaders, store, shared).write(blocks, thread_ids[0]),
    )
