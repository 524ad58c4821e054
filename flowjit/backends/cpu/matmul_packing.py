"""The operand packing of the register-blocked matrix product (`matmul_kernel.emit_matmul`), as MLIR
vector code: B's panels (`_pack_b`, one panel at a time `_pack_panel`, or from B's rows
`_pack_panel_from_rows` with the in-register transpose `_transpose_square`), A's blocks of columns
for A given as (K, M) (`_pack_a_columns`), A copied with rows one cache line apart (`restride`),
and the readers the micro-kernel reads A through (`_a_reader`, `_packed_a_reader`).
"""

from __future__ import annotations

from typing import NamedTuple

from flowjit.backends.cpu import host
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.matmul_plan import (
    CACHE_LINE,
    MatmulShape,
    _ceil_div,
    _packed_a_bytes,
    _packed_b_bytes,
    _panel_ranges,
)
from flowjit.backends.mlir.emitter import KernelEmitter

# Packing loops over k up to this long are written out (the CNN conv's K = 9), unrolled without
# LLVM's unroll marks (which keep a function on LLVM's O3 pipeline; docs/cpu-compile-time.md, "Emit less
# time").
MAX_UNROLLED_PACK = 16


def _pack_b(w: LoopWriter, s: MatmulShape, b: str, batch_index: str | None) -> str:
    """Bp[p, k, :] = B[k, p*NR : p*NR + NR] (zero past N), or from B's rows with `s.b_rows`."""
    pack = _pack_panel_from_rows if s.b_rows else _pack_panel
    packed = w.temporary((s.panels, s.k, s.nr), s.elem, w.index(0))
    packed_type = f"tensor<{s.panels}x{s.k}x{s.nr}x{s.elem}>"
    for first, end, states in _panel_ranges(s):
        loop, p, (cur,) = w.open_for(w.index(first), w.index(end), w.index(1), [(packed, packed_type)])
        w.close_for([pack(w, s, b, batch_index, states, p, cur, packed_type, p)], [packed_type])
        packed = loop
    return packed


def _pack_panel(w: LoopWriter, s: MatmulShape, b: str, batch_index, states, p: str, dest: str, dest_type: str, at: str):
    """dest[at, k, :] = B[k, p*NR : p*NR + NR] for every k; `states` per vector (see `matmul_plan._panel_ranges`)."""
    em = w.em
    vl = s.lanes
    vec = f"vector<{vl}x{s.elem}>"
    zero = em.op(f"arith.constant {s.zero} : {s.elem}")
    zero_vec = em.op(f"arith.constant dense<{s.zero}> : {vec}")
    col = w.mul(p, w.index(s.nr))

    def pack_row(k: str, cur: str) -> str:
        for c, state in enumerate(states):
            v = zero_vec
            if state != "none":
                where = ", ".join(([batch_index] if batch_index else []) + [k, w.add(col, w.index(c * vl))])
                v = em.op(f"vector.transfer_read {b}[{where}], {zero} {{in_bounds = [{state}]}} : {s.b_tensor}, {vec}")
            where = f"{at}, {k}, {w.index(c * vl)}"
            cur = em.op(f"vector.transfer_write {v}, {cur}[{where}] {{in_bounds = [true]}} : {vec}, {dest_type}")
        return cur

    if s.k <= MAX_UNROLLED_PACK:  # written out (a marked loop would keep the function on LLVM's O3)
        for k in range(s.k):
            dest = pack_row(w.index(k), dest)
        return dest
    loop, k, (cur,) = w.open_for(w.index(0), w.index(s.k), w.index(1), [(dest, dest_type)])
    w.close_for([pack_row(k, cur)], [dest_type])
    return loop


def _pack_panel_from_rows(
    w: LoopWriter, s: MatmulShape, b: str, batch_index, states, p: str, dest: str, dest_type: str, at: str
):
    """dest[at, k, j] = B[p*NR + j, k] (zero past N) for B given as (N, K): blocks of NR rows x one
    vector of k, read contiguously and transposed in registers (`_transpose_square`). A strided copy
    of B to (K, N) before the usual packing costs more than the product itself."""
    em = w.em
    vl, nr = s.lanes, s.nr
    vec = f"vector<{vl}x{s.elem}>"
    zero = em.op(f"arith.constant {s.zero} : {s.elem}")
    zero_vec = em.op(f"arith.constant dense<{s.zero}> : {vec}")
    # Rows of the partial last panel at or past N stay zero (only that panel has a "none" state).
    live = nr if all(state == "true" for state in states) else s.n % nr
    row0 = w.mul(p, w.index(nr))
    whole_k = s.k // vl * vl

    def read(row: str, k: str, k_in_bounds: str) -> str:
        where = ", ".join(([batch_index] if batch_index else []) + [row, k])
        return em.op(f"vector.transfer_read {b}[{where}], {zero} {{in_bounds = [{k_in_bounds}]}} : {s.b_tensor}, {vec}")

    def write(square: list[str], cur: str, k: str, count: int, column: str) -> str:
        for i in range(count):
            where = f"[{at}, {w.add(k, w.index(i))}, {column}]"
            cur = em.op(f"vector.transfer_write {square[i]}, {cur}{where} {{in_bounds = [true]}} : {vec}, {dest_type}")
        return cur

    def pack_block(k: str, k_in_bounds: str, count: int, cur: str) -> str:
        # Writes packed rows k .. k + count - 1 (count < vl only for the tail past the last whole vector of k).
        if live == nr and nr > vl:
            # A whole panel: its squares of vl rows one after the other in an `scf.for`, one copy of
            # the transpose's code. Written out, the squares run no faster and more than double the
            # kernel's MLIR and lengthen its compile.
            loop, c, (into,) = w.open_for(w.index(0), w.index(nr), w.index(vl), [(cur, dest_type)])
            first = w.add(row0, c)
            square = _transpose_square(em, [read(w.add(first, w.index(j)), k, k_in_bounds) for j in range(vl)], vec)
            w.close_for([write(square, into, k, count, c)], [dest_type])
            return loop
        rows = [read(w.add(row0, w.index(j)), k, k_in_bounds) for j in range(live)] + [zero_vec] * (nr - live)
        for c in range(s.vectors_per_row):
            cur = write(_transpose_square(em, rows[c * vl : (c + 1) * vl], vec), cur, k, count, w.index(c * vl))
        return cur

    cur = dest
    if whole_k:
        loop, k, (c,) = w.open_for(w.index(0), w.index(whole_k), w.index(vl), [(cur, dest_type)])
        w.close_for([pack_block(k, "true", vl, c)], [dest_type])
        cur = loop
    if s.k % vl:
        cur = pack_block(w.index(whole_k), "false", s.k % vl, cur)
    return cur


def _transpose_square(em: KernelEmitter, rows: list[str], vec: str) -> list[str]:
    """The rows of the transpose of the square whose rows are `rows` (len(rows) = lanes, a power of two).

    A butterfly of log2(lanes) stages, each `lanes` two-source `vector.shuffle`s (one instruction
    each with AVX-512: vshufps, vpermt2pd, vshuff64x2): stage `bit` swaps that bit between the row
    and column index of every element where they differ. A `vector.transpose` of the block, which
    canonicalization folds into one extract and insert per element, compiles to about 1000
    shuffles and three times the LLVM time.
    """
    n = len(rows)
    bit = 1
    while bit < n:
        low = [j if j & bit == 0 else n + j - bit for j in range(n)]
        high = [j + bit if j & bit == 0 else n + j for j in range(n)]
        out = list(rows)
        for i in range(n):
            if i & bit == 0:
                pair = f"{rows[i]}, {rows[i | bit]}"
                out[i] = em.op(f"vector.shuffle {pair} [{', '.join(map(str, low))}] : {vec}, {vec}")
                out[i | bit] = em.op(f"vector.shuffle {pair} [{', '.join(map(str, high))}] : {vec}, {vec}")
        rows, bit = out, bit * 2
    return rows


class Restrided(NamedTuple):
    """A's copy with rows one cache line longer (`restride`): (M, K + pad), the batch's matrix."""

    tensor: str
    type: str


def _a_reader(w: LoopWriter, s: MatmulShape, a: str | Restrided, row0: str, batch_index: str | None):
    """read(i, r, k) = A[row0 + i + r, k], read in place or from its restrided copy."""
    if isinstance(a, Restrided):
        a, a_type, prefix = a.tensor, a.type, []
    else:
        a_type, prefix = s.a_tensor, [batch_index] if batch_index else []

    def read(i: str, r: int, k: str) -> str:
        row = w.add(w.add(row0, i), w.index(r))
        where = [k, row] if s.a_cols else [row, k]
        return w.em.op(f"tensor.extract {a}[{', '.join(prefix + where)}] : {a_type}")

    return read


def restride(
    w: LoopWriter, a: tuple[str, str, list[str]], m: int, k: int, elem: str, offset: str, threads: int
) -> Restrided:
    """The (m, k) matrix `a` = (tensor, its type, leading indices (a batch's)) copied with rows
    `CACHE_LINE` bytes longer, into the scratch area at byte `offset` (`restrided_bytes`), so the
    rows of a tile fall in consecutive cache sets; split by rows over `threads` cores (its own
    fork: every core's tiles read all of A when they split C's columns)."""
    em = w.em
    source, source_type, prefix = a
    vl = host.vector_bits() // int(elem[1:])
    vec = f"vector<{vl}x{elem}>"
    stride = k + CACHE_LINE * 8 // int(elem[1:])
    copy_type = f"tensor<{m}x{stride}x{elem}>"
    copy = w.temporary((m, stride), elem, offset)
    pad = em.op(f"arith.constant {'0' if elem.startswith('i') else '0.0'} : {elem}")

    def copy_rows(row0: str, rows: str, dest: str, dest_type: str) -> str:
        outer, r, (cur,) = w.open_for(w.index(0), rows, w.index(1), [(dest, dest_type)])
        inner, col, (c,) = w.open_for(w.index(0), w.index(k), w.index(vl), [(cur, dest_type)])
        where = ", ".join(prefix + [w.add(row0, r), col])
        v = em.op(f"vector.transfer_read {source}[{where}], {pad} {{in_bounds = [true]}} : {source_type}, {vec}")
        c = em.op(f"vector.transfer_write {v}, {c}[{r}, {col}] {{in_bounds = [true]}} : {vec}, {dest_type}")
        w.close_for([c], [dest_type])
        w.close_for([inner], [dest_type])
        return outer

    if threads == 1:
        return Restrided(copy_rows(w.index(0), w.index(m), copy, copy_type), copy_type)
    chunk = _ceil_div(m, threads)
    done, t, shared = w.open_forall(_ceil_div(m, chunk), copy, copy_type)
    row0 = w.mul(t, w.index(chunk))
    rows = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(m)}, {row0} : index')}, {w.index(chunk)} : index")
    part_type = f"tensor<?x{stride}x{elem}>"
    where = f"[{row0}, 0] [{rows}, {stride}] [1, 1]"
    part = em.op(f"tensor.extract_slice {shared}{where} : {copy_type} to {part_type}")
    w.close_forall(copy_rows(row0, rows, part, part_type), shared, where, part_type, copy_type)
    return Restrided(done, copy_type)


def _pack_a_columns(
    w: LoopWriter, s: MatmulShape, a: str, row0: str, rows, batch_index: str | None, thread: str
) -> tuple[str, str]:
    """Ap[q, k, 0:MR] = A[row0 + lo + q*MR : .. + MR, k] for A given as (K, M) and the whole blocks of
    MR rows in [lo, hi). Read in place, the micro-kernel would touch a new line per k, M elements
    apart (4 KiB for M = 1024: all in the same cache sets); packed, each block is contiguous."""
    em = w.em
    lo, hi, most = rows
    vec = f"vector<{s.mr}x{s.elem}>"
    blocks_most = max(most // s.mr, 1)
    packed_type = f"tensor<{blocks_most}x{s.k}x{s.mr}x{s.elem}>"
    pad = em.op(f"arith.constant {s.zero} : {s.elem}")
    offset = w.add(w.index(_packed_b_bytes(s)), w.mul(thread, w.index(_packed_a_bytes(s, most))))
    packed = w.temporary((blocks_most, s.k, s.mr), s.elem, offset)
    blocks = em.op(f"arith.divsi {em.op(f'arith.subi {hi}, {lo} : index')}, {w.index(s.mr)} : index")
    first = w.add(row0, lo)
    prefix = [batch_index] if batch_index else []
    outer, k, (cur,) = w.open_for(w.index(0), w.index(s.k), w.index(1), [(packed, packed_type)])
    inner, q, (c,) = w.open_for(w.index(0), blocks, w.index(1), [(cur, packed_type)])
    col = w.add(first, w.mul(q, w.index(s.mr)))
    v = em.op(
        f"vector.transfer_read {a}[{', '.join(prefix + [k, col])}], {pad} {{in_bounds = [true]}} : {s.a_tensor}, {vec}"
    )
    c = em.op(f"vector.transfer_write {v}, {c}[{q}, {k}, {w.index(0)}] {{in_bounds = [true]}} : {vec}, {packed_type}")
    w.close_for([c], [packed_type])
    w.close_for([inner], [packed_type])
    return outer, packed_type


def _packed_a_reader(w: LoopWriter, s: MatmulShape, packed: tuple[str, str], lo: str):
    """read(i, r, k) = Ap[(i - lo) / MR, k, r] (see `_pack_a_columns`)."""
    packed, packed_type = packed

    def read(i: str, r: int, k: str) -> str:
        q = w.em.op(f"arith.divsi {w.em.op(f'arith.subi {i}, {lo} : index')}, {w.index(s.mr)} : index")
        return w.em.op(f"tensor.extract {packed}[{q}, {k}, {w.index(r)}] : {packed_type}")

    return read
