"""A register-blocked matrix-multiply kernel for f32/f64/i32/i64, written directly as MLIR vector code on
tensors (no transform schedule): C[b] = A[b] @ B[b] with A (M, K), B (K, N), all row-major.

Algorithm (GotoBLAS-style, simplified):
1. Pack B into panels `Bp[p, k, 0:NR]` = B[k, p*NR : p*NR + NR], zero-padded past N, so the
   micro-kernel reads NR contiguous elements per k and the panel stays in cache.
2. When the product is large enough to pay for a thread team (`scf.forall`, lowered to OpenMP):
   with two or more panels per core, split C's columns: each core packs each of its panels into its
   own K x NR buffer just before using it. Otherwise split C's rows (one chunk per core) after
   packing all of B.
3. For each panel p, for each block of MR rows: keep an MR x NR tile of C in vector registers
   (`scf.for` iter_args), and for each k broadcast A[row, k] and FMA it with the NR-wide panel row.
   Rows left over (M not a multiple of MR) run the same kernel as one shorter tile (or, in the
   last of the cores' row chunks, one row at a time).
4. Store the tile; the stores of the last panel are masked when N is not a multiple of NR, so
   nothing is written outside C and no scalar fallback is needed.
A whose rows are a multiple of 4 KiB apart is first copied with rows one cache line longer
(`restride`): read in place, a tile's rows would all share one L1 set. Packed panels and that copy
live in the function's scratch area (`scratch_bytes`), not in per-call allocations.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

from flowjit.backends.cpu import host
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.mlir.emitter import KernelEmitter
from flowjit.errors import CompileError

# Below this many multiply-adds the product runs on one thread (an OpenMP fork costs microseconds).
PARALLEL_MIN_FLOPS = 1 << 21
# Below this many multiply-adds, or with fewer columns than one vector, the plain linalg.generic
# (scalar loops that LLVM unrolls) is as fast and compiles faster.
KERNEL_MIN_FLOPS = 1 << 12


def worth_it(batch: int, m: int, n: int, k: int) -> bool:
    """Whether a product of this shape should use this kernel."""
    lanes = vector_bits() // 32
    return max(batch, 1) * m * n * k >= KERNEL_MIN_FLOPS and n >= lanes // 2 and k > 0


@functools.cache
def vector_bits() -> int:
    """Width of the host's vector registers (512 with AVX-512, 256 with AVX2, else 128)."""
    features = host.host_cpu().features
    if "+avx512f" in features:
        return 512
    return 256 if "+avx2" in features else 128


@functools.cache
def tile_rows(vectors_per_row: int) -> int:
    """The most rows a register tile of `vectors_per_row` vectors per row can have: its accumulators,
    the panel's vectors and one broadcast in the host's vector registers (32 with AVX-512, 16
    otherwise), one spare (an integer product's temporary)."""
    registers = 32 if vector_bits() == 512 else 16
    return (registers - 2 - vectors_per_row) // vectors_per_row


@dataclass(frozen=True)
class MatmulShape:
    """One (batched) product: `batch` may be 0 for plain 2-D operands."""

    batch: int
    m: int
    n: int
    k: int
    elem: str  # "f32", "f64", "i32" or "i64"
    b_rows: bool = False  # B arrives as (.., N, K) (e.g. `a @ b.T`): packed straight from its rows
    a_cols: bool = False  # A arrives as (.., K, M) (e.g. `a.T @ b`): read by columns (see `_pack_a_columns`)
    serial: bool = False  # on the calling thread only (inside another kernel's parallel loop)
    accumulate: bool = False  # C = C0 + A @ B, C0 given to `emit_matmul` (a sum over K in parts)
    # B (K, N) read in place by the micro-kernel, no panel packed: for a B the caller has just
    # written and that fits in L2 (a conv chunk's columns; `serial` products only, see
    # `_panels_just_in_time`).
    b_in_place: bool = False

    @property
    def a_tensor(self) -> str:
        return self.tensor(self.k, self.m) if self.a_cols else self.tensor(self.m, self.k)

    @property
    def b_tensor(self) -> str:
        return self.tensor(self.n, self.k) if self.b_rows else self.tensor(self.k, self.n)

    @property
    def zero(self) -> str:
        return "0" if self.elem.startswith("i") else "0.0"

    @property
    def lanes(self) -> int:
        return vector_bits() // int(self.elem[1:])

    @property
    def vectors_per_row(self) -> int:
        return 2

    @property
    def nr(self) -> int:
        return self.lanes * self.vectors_per_row

    @functools.cached_property
    def mr(self) -> int:
        """Rows of the register tile (see `TALL_TILE_MIN_K`). For a product split by rows over the
        cores (whose chunks are multiples of it), the height from there down to `SHORT_TILE_ROWS`
        that pads a core's rows least: 64 rows on two cores take 8-row tiles (32 per core), not
        14-row ones (42 and 22 rows)."""
        tall = tile_rows(self.vectors_per_row)
        short = min(SHORT_TILE_ROWS, tall)
        if self.k < TALL_TILE_MIN_K:
            return short
        threads = _fork_cores(self)
        if threads == 1 or _splits_columns(self, threads):
            return tall
        per = _ceil_div(self.m, threads)
        return min(range(tall, short - 1, -1), key=lambda mr: _ceil_div(per, mr) * mr)

    @property
    def panels(self) -> int:
        return -(-self.n // self.nr)

    def tensor(self, rows: int | str, cols: int) -> str:
        prefix = f"{self.batch}x" if self.batch else ""
        return f"tensor<{prefix}{rows}x{cols}x{self.elem}>"


# MR, the rows of the register tile (`MatmulShape.mr`): its 2 x MR accumulators, the two panel vectors
# and the broadcast of A fill the vector registers (`tile_rows`: 14 rows with AVX-512's 32, 6 with
# AVX2's 16) when the contraction is at least `TALL_TILE_MIN_K` long: 28 FMAs per k against 2 + 14
# loads instead of 16 against 2 + 8: the conv layer runs 3-8% faster with 14 rows than with 8 on a
# 2-core Xeon VM with AVX-512 (docs/cpu-kernels.md, "Matmul kernel").
# Shorter contractions keep `SHORT_TILE_ROWS`: with 14-row tiles they run slower, their time going
# to the tiles' stores and epilogue, not the k loop (the CNN's K = 9 conv).
TALL_TILE_MIN_K = 64
SHORT_TILE_ROWS = 8
SINGLE_ROWS_MAX_SHARE = 64  # see `_row_ranges`
# A given as (K, M) is packed (see `_pack_a_columns`) when this many panels re-read it; a product
# with fewer (a narrow N) reads its columns in place (packing for a.T @ dz with N = 10 triples its
# time).
PACK_A_MIN_PANELS = 4
# A whose rows are a multiple of this many bytes apart is first copied to rows padded by one cache
# line (`restride`). The micro-kernel reads MR rows of A at once, one line of each per 16 k: at
# such a stride all MR lines fall in the same L1 set (sets x line = 4 KiB on the Zen 4, Zen 5 and
# Xeon cores measured), which holds 8 or 12 lines, so with 14 rows every broadcast misses L1: on a
# 2-core AMD EPYC Zen 4 VM a 1024^3 float32 product unpadded runs at about 60% of the speed of
# K = 1008 or 1040.
ALIASING_STRIDE = 4096
CACHE_LINE = 64
# Cores split C's columns (each packing its panels just in time) only for contractions at least this
# long: split that way, the CNN's 3x3 conv on one channel (K = 9) runs 7% slower and a deep one
# (K = 288) faster (2-core AMD EPYC Zen 4 VM).
COLUMN_SPLIT_MIN_K = 64
# On the micro-kernel's k loop: LLVM must not unroll it. It fully unrolls short contractions (the
# CNN's K = 9: 144 FMAs where the loop has 16), which runs no faster and grows the optimized IR,
# and leaves long ones rolled anyway (docs/cpu-compile-time.md). scf-to-cf copies the attribute to
# the loop's branch, which becomes `!llvm.loop` metadata; it must be named `loop_annotation`
# (`llvm.br`'s own attribute): named `llvm.loop_annotation` it stays in the LLVM dialect and is
# dropped by the translation.
NO_UNROLL = "loop_annotation = #llvm.loop_annotation<unroll = <disable = true>>"
# Packing loops over k up to this long are written out (the CNN conv's K = 9), unrolled without
# LLVM's unroll marks (which keep a function on LLVM's O3 pipeline; docs/cpu-compile-time.md, "Emit less
# time"). The loop over a panel's blocks of MR rows stays a loop: against up to 4 blocks of constant
# rows written out when K is short (the CNN conv's 32 rows, K = 9), it runs as fast (within 2%) and
# its first call compiles 20-50% faster (2-core AMD EPYC Zen 4 VM): one copy of the register
# tile's code instead of four.
MAX_UNROLLED_PACK = 16
MAX_UNROLLED_ROW_BLOCKS = 1


def _panel_ranges(s: MatmulShape) -> list[tuple[int, int, list[str]]]:
    """(first panel, end panel, per-vector state) runs: whole panels, then the partial last one.

    A vector's state is "true" (inside C), "false" (straddles column N: masked access, slow, so
    kept out of the whole panels' loop) or "none" (entirely past N: not read, not stored).
    """
    whole = s.n // s.nr
    ranges = [(0, whole, ["true"] * s.vectors_per_row)] if whole else []
    if s.n % s.nr:
        first = whole * s.nr
        states = []
        for c in range(s.vectors_per_row):
            lo, hi = first + c * s.lanes, first + (c + 1) * s.lanes
            states.append("true" if hi <= s.n else "false" if lo < s.n else "none")
        ranges.append((whole, whole + 1, states))
    return ranges


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
    """dest[at, k, :] = B[k, p*NR : p*NR + NR] for every k; `states` per vector (see `_panel_ranges`)."""
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


def _row_blocks(
    w: LoopWriter,
    s: MatmulShape,
    a: str,
    packed: str,
    c_tile: str,
    c_type: str,
    row0: str,
    rows: tuple[int | str, int | str, int],
    mr: int,
    batch_index: str | None,
    thread: str,
) -> str:
    """For every panel and every block of `mr` rows in [lo, hi) of `c_tile` (whose row 0 is A's row
    `row0`; `rows` = (lo, hi, the most rows hi - lo can be)): the register-tile product, stored into
    `c_tile`. `thread` numbers the caller's share of the scratch area."""
    lo, hi, most = rows
    read_a = _a_reader(w, s, a, row0, batch_index)
    if _packs_a(s) and mr == s.mr:
        rows = (_index(w, lo), _index(w, hi), most)
        read_a = _packed_a_reader(w, s, _pack_a_columns(w, s, a, row0, rows, batch_index, thread), rows[0])
    for first, end, states in _panel_ranges(s):
        c_tile = _panel_loop(w, s, read_a, packed, c_tile, c_type, (lo, hi), mr, (first, end, states))
    return c_tile


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


def aliases(k: int, elem: str) -> bool:
    """Whether rows of `k` elements of `elem` are a multiple of `ALIASING_STRIDE` bytes long."""
    return k * int(elem[1:]) // 8 % ALIASING_STRIDE == 0


def restrided_bytes(m: int, k: int, elem: str) -> int:
    """Bytes of an (m, k) matrix's restrided copy (`restride`)."""
    return _round_up(m * (k * int(elem[1:]) // 8 + CACHE_LINE), 64)


def _restrides_a(s: MatmulShape) -> bool:
    """Whether A's rows are copied one cache line apart first (see `ALIASING_STRIDE`): a row-major A
    read in place by tall tiles, its rows a multiple of `ALIASING_STRIDE` bytes long. Not for
    serial products (inside another kernel's parallel loop, which has no scratch area of its own:
    a convolution restrides its weights before its fork, `lower_conv._conv_as_matmul`)."""
    return not s.a_cols and not s.serial and s.m >= s.mr and aliases(s.k, s.elem)


def restride(
    w: LoopWriter, a: tuple[str, str, list[str]], m: int, k: int, elem: str, offset: str, threads: int
) -> Restrided:
    """The (m, k) matrix `a` = (tensor, its type, leading indices (a batch's)) copied with rows
    `CACHE_LINE` bytes longer, into the scratch area at byte `offset` (`restrided_bytes`), so the
    rows of a tile fall in consecutive cache sets; split by rows over `threads` cores (its own
    fork: every core's tiles read all of A when they split C's columns)."""
    em = w.em
    source, source_type, prefix = a
    vl = vector_bits() // int(elem[1:])
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


def _panel_loop(w: LoopWriter, s: MatmulShape, read_a, packed, c_tile, c_type, row_range, mr, panels):
    first, end, states = panels
    packed_type = f"tensor<{s.panels}x{s.k}x{s.nr}x{s.elem}>"
    loop, p, (tile,) = w.open_for(w.index(first), w.index(end), w.index(1), [(c_tile, c_type)])
    col = w.mul(p, w.index(s.nr))
    tile = _row_loop(w, s, read_a, (packed, packed_type, p), tile, c_type, col, row_range, mr, states)
    w.close_for([tile], [c_type])
    return loop


def _row_loop(w: LoopWriter, s: MatmulShape, read_a, panel, c_tile, c_type, col, row_range, mr, states) -> str:
    """For every block of `mr` rows in `row_range`: the register-tile product of those rows of A with
    one packed panel (`panel` = (tensor, type, index of the panel in it)), or with B's columns
    [index, index + NR) read in place (`panel` = (B, its type, None, index)), stored into columns
    [col, col + NR) of `c_tile` (vectors per `states`)."""
    lo, hi = row_range
    few = isinstance(lo, int) and isinstance(hi, int) and -(-(hi - lo) // mr) <= MAX_UNROLLED_ROW_BLOCKS
    if few and s.k < TALL_TILE_MIN_K:
        # A single block of constant rows over a short k loop: no loop around it (see
        # MAX_UNROLLED_ROW_BLOCKS; copies of a tile cost compile time, most of it in one-shot
        # bufferization).
        for start in range(lo, hi, mr):
            c_tile = _row_block(w, s, read_a, panel, (c_tile, c_type, col), w.index(start), mr, states)
        return c_tile
    rows, i, (t2,) = w.open_for(_index(w, lo), _index(w, hi), w.index(mr), [(c_tile, c_type)])
    w.close_for([_row_block(w, s, read_a, panel, (t2, c_type, col), i, mr, states)], [c_type])
    return rows


def _index(w: LoopWriter, value: int | str) -> str:
    return w.index(value) if isinstance(value, int) else value


def _row_block(w: LoopWriter, s: MatmulShape, read_a, panel, c, i: str, mr: int, states) -> str:
    """The register tile of rows [i, i + mr) of A with one panel (see `_row_loop`), stored into
    `c` = (tile, its type, its column of the panel)."""
    em = w.em
    vl, nv = s.lanes, s.vectors_per_row
    packed, packed_type, at = panel[:3]
    t2, c_type, col = c
    vec = f"vector<{vl}x{s.elem}>"
    zero_vec = em.op(f"arith.constant dense<{s.zero}> : {vec}")
    pad = em.op(f"arith.constant {s.zero} : {s.elem}")
    inits = [zero_vec] * (mr * nv)
    if s.accumulate:  # start from C's tile
        inits = [
            zero_vec
            if state == "none"
            else em.op(
                f"vector.transfer_read {t2}[{w.add(i, w.index(r))}, {w.add(col, w.index(c * vl))}], {pad} "
                f"{{in_bounds = [{state}]}} : {c_type}, {vec}"
            )
            for r in range(mr)
            for c, state in enumerate(states)
        ]
    accs, k, acc_names = w.open_for(w.index(0), w.index(s.k), w.index(1), [(init, vec) for init in inits])
    if at is None:
        b_vecs = [
            zero_vec
            if state == "none"
            else em.op(
                f"vector.transfer_read {packed}[{k}, {w.add(panel[3], w.index(c * vl))}], {pad} "
                f"{{in_bounds = [{state}]}} : {packed_type}, {vec}"
            )
            for c, state in enumerate(states)
        ]
    else:
        b_vecs = [
            em.op(
                f"vector.transfer_read {packed}[{at}, {k}, {w.index(c * vl)}], {pad} {{in_bounds = [true]}} "
                f": {packed_type}, {vec}"
            )
            for c in range(nv)
        ]
    new = []
    for r in range(mr):
        scalar = read_a(i, r, k)
        broadcast = em.op(f"vector.broadcast {scalar} : {s.elem} to {vec}")
        for c in range(nv):
            new.append(multiply_add_vectors(em, broadcast, b_vecs[c], acc_names[r * nv + c], vec, s.elem))
    w.close_for(new, [vec] * len(new), NO_UNROLL)
    cur = t2
    if mr > 1 and all(state == "true" for state in states):
        # One 2-D write of the whole tile: one tensor value for bufferization to analyse instead
        # of 2 x MR (its conflict analysis grows faster than linearly with them).
        tile_vec = f"vector<{mr}x{s.nr}x{s.elem}>"
        whole = em.op(f"ub.poison : {tile_vec}")
        for r in range(mr):
            for c in range(nv):
                acc = f"{accs}#{r * nv + c}"
                whole = em.op(
                    f"vector.insert_strided_slice {acc}, {whole} {{offsets = [{r}, {c * vl}], strides = [1]}} "
                    f": {vec} into {tile_vec}"
                )
        cur = em.op(
            f"vector.transfer_write {whole}, {cur}[{i}, {col}] {{in_bounds = [true, true]}} : {tile_vec}, {c_type}"
        )
    else:  # one row, or the partial panel: vector by vector, masked where a vector crosses N
        for r in range(mr):
            row = w.add(i, w.index(r))
            for c, state in enumerate(states):
                if state == "none":
                    continue
                acc = f"{accs}#{r * nv + c}" if mr * nv > 1 else accs
                cur = em.op(
                    f"vector.transfer_write {acc}, {cur}[{row}, {w.add(col, w.index(c * vl))}] "
                    f"{{in_bounds = [{state}]}} : {vec}, {c_type}"
                )
    if w.tile_epilogue is not None:
        cur = _tile_through_epilogue(w, s, (cur, c_type), i, col, mr, states)
    return cur


def _tile_through_epilogue(w: LoopWriter, s: MatmulShape, c, i: str, col: str, mr: int, states) -> str:
    """The register tile just stored at rows [i, i + mr), columns [col, col + NR) of `c` = (tile,
    its type), or the part of them inside C, through `w.tile_epilogue` in place: still in L1, so
    the epilogue costs a reload of the tile, never a pass over C in memory."""
    em = w.em
    tile, c_type = c
    width = s.nr if all(state == "true" for state in states) else s.n % s.nr
    window = f"tensor<{mr}x{width}x{s.elem}>"
    where = f"[{i}, {col}] [{mr}, {width}] [1, 1]"
    part = em.op(f"tensor.extract_slice {tile}{where} : {c_type} to {window}")
    row0, col0 = w.origin
    part = w.tile_epilogue(part, (mr, width), w.add(row0, i), w.add(col0, col))
    return em.op(f"tensor.insert_slice {part} into {tile}{where} : {window} into {c_type}")


def emit_matmul(
    em: KernelEmitter,
    a: str | Restrided,
    b: str,
    s: MatmulShape,
    into: str | None = None,
    tile_epilogue=None,
    out: str | None = None,
) -> str:
    """C = A @ B (batched when s.batch) as a new tensor, or `into` + A @ B with `s.accumulate`; `a`,
    `b` are row-major (.., M, K), (.., K, N), or `a` is (.., K, M) with `s.a_cols`, `b` is (.., N, K)
    with `s.b_rows`; a serial product may be given A already restrided (`restride`: a convolution's
    weights, copied before its fork). With `tile_epilogue(window, (rows, columns), row, column)` (a product made
    whole, not serial, not accumulated), each register tile goes through it once stored: it
    returns the tile's window of C (`rows` x `columns` at C's `row`, `column`; of the batch's
    matrix when batched) computed in place. `out`: a tensor of C's type to compute C into instead of
    a new one (a view of the caller's destination: bufferization then writes it in place)."""
    em.kernel_kinds.add("matmul")
    w = LoopWriter.with_scratch(em, scratch_bytes(s), tile_epilogue)
    c_type = s.tensor(s.m, s.n)
    if s.accumulate != (into is not None):
        raise CompileError("internal error: emit_matmul accumulates exactly when given the tensor to add to")
    if tile_epilogue is not None and (s.serial or s.accumulate):
        raise CompileError("internal error: a tile epilogue needs a product made whole")
    result = into if s.accumulate else out or em.op(f"tensor.empty() : {c_type}")
    if streams_rows(s) and not isinstance(a, Restrided):
        return _rows_streamed(w, s, a, b, result)
    threads = _threads(s)
    if s.batch:
        outer, batch_index, (c_all,) = w.open_for(w.index(0), w.index(s.batch), w.index(1), [(result, c_type)])
    else:
        batch_index, c_all = None, result
    if _restrides_a(s):
        prefix = [batch_index] if batch_index else []
        offset = w.index(_scratch_before_a_copy(s))
        a = restride(w, (a, s.a_tensor, prefix), s.m, s.k, s.elem, offset, threads)
    if _splits_columns(s, threads):
        c_new = _columns_in_parallel(w, s, a, b, c_all, threads)
    elif threads > 1:
        c_new = _rows_in_parallel(w, s, (a, _pack_b(w, s, b, batch_index), batch_index), c_all, threads)
    elif s.serial and not s.batch and not _packs_a(s) and s.n >= s.nr:
        c_new = _panels_just_in_time(w, s, a, b, c_all)
    else:
        c_new = _rows_serially(w, s, (a, _pack_b(w, s, b, batch_index), batch_index), c_all)
    if s.batch:
        w.close_for([c_new], [c_type])
        return outer
    return c_new


# Products of at most FEW_ROWS_MAX rows (a batch-1 or small-batch layer, `v @ W`) are streamed
# (`_rows_streamed`): nothing is packed, and B is read once, row after row, in the order it lies in
# memory. Packed into K x NR panels, each B row would be read 128 bytes at a time, 16 KiB apart,
# and the panels used by one row block only, at half the memory bandwidth JAX reaches on such
# products. FEW_ROWS_K_STEP rows of B go through each pass over C's block (fewer loads and
# stores of C per multiply-add), and a block of C is at most FEW_ROWS_BLOCK_BYTES, to stay in L1.
FEW_ROWS_MAX = 4
FEW_ROWS_K_STEP = 4
FEW_ROWS_BLOCK_BYTES = 16 << 10
# Up to this many rows, a product whose B is larger than the last-level cache is streamed too:
# memory-bound either way, and the tiled kernel's panels read B 128 bytes at a time, so streaming
# is faster there (by a third at 6 rows); with B in L3 tiling is faster, hence the size condition.
FEW_ROWS_MAX_LARGE_B = 8


def streams_rows(s: MatmulShape) -> bool:
    """Whether `emit_matmul` streams this product (`_rows_streamed`) instead of tiling it."""
    plain = not (s.batch or s.serial or s.accumulate or s.a_cols or s.b_rows or s.b_in_place)
    b_bytes = s.k * s.n * int(s.elem[1:]) // 8
    few = s.m <= FEW_ROWS_MAX or (s.m <= FEW_ROWS_MAX_LARGE_B and b_bytes > last_level_cache_bytes())
    return plain and few and s.n >= s.lanes and s.k >= FEW_ROWS_K_STEP


@functools.cache
def last_level_cache_bytes() -> int:
    """The host's largest data cache (sysfs), 32 MiB when it cannot be read."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        indices = [name for name in os.listdir(root) if name.startswith("index")]
    except OSError:
        indices = []
    for index in indices:
        try:
            with open(os.path.join(root, index, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


def _rows_streamed(w: LoopWriter, s: MatmulShape, a: str, b: str, c_all: str) -> str:
    """C = A @ B for a few rows (`streams_rows`): C starts at zero and each step adds
    FEW_ROWS_K_STEP rows of B, scaled by A's matching columns, to a block of C's columns, vector by
    vector, so B streams from memory in its own order and C stays in L1. The cores split C's
    whole vectors of columns; a last partial vector (N not a multiple of the vector width) follows
    on the calling thread, masked, so nothing outside C is read or written."""
    em = w.em
    em.line(f"// matmul: {s.m} row(s) x {s.k} x {s.n} streamed against B's rows, nothing packed")
    c_type = s.tensor(s.m, s.n)
    zero = em.op(f"arith.constant {s.zero} : {s.elem}")
    c = em.op(f"linalg.fill ins({zero} : {s.elem}) outs({c_all} : {c_type}) -> {c_type}")
    whole = s.n // s.lanes
    threads = cores() if s.m * s.n * s.k >= PARALLEL_MIN_FLOPS and whole >= 2 * cores() else 1
    if threads > 1:
        per = _ceil_div(whole, threads)
        done, t, shared = w.open_forall(_ceil_div(whole, per), c, c_type)
        v0 = w.mul(t, w.index(per))
        count = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(whole)}, {v0} : index')}, {w.index(per)} : index")
        col0 = w.mul(v0, w.index(s.lanes))
        tile_type = f"tensor<{s.m}x?x{s.elem}>"
        where = f"[0, {col0}] [{s.m}, {w.mul(count, w.index(s.lanes))}] [1, 1]"
        tile = em.op(f"tensor.extract_slice {shared}{where} : {c_type} to {tile_type}")
        tile = _stream_columns(w, s, a, b, (tile, tile_type, col0), col0, count, "true")
        w.close_forall(tile, shared, where, tile_type, c_type)
        c = done
    else:
        c = _stream_columns(w, s, a, b, (c, c_type, w.index(0)), w.index(0), w.index(whole), "true")
    if s.n % s.lanes:
        c = _stream_columns(w, s, a, b, (c, c_type, w.index(0)), w.index(whole * s.lanes), w.index(1), "false")
    if w.tile_epilogue is not None:
        c = _epilogue_by_vectors(w, s, c, c_type)
    return c


def _stream_columns(w: LoopWriter, s: MatmulShape, a: str, b: str, c, col0: str, count: str, state: str) -> str:
    """`count` vectors of C's columns from column `col0` (`c` = (C's tile, its type, the column of C
    where the tile starts)), in blocks of at most FEW_ROWS_BLOCK_BYTES of C; `state` "false" masks the vectors
    (one partial vector past N)."""
    em = w.em
    tile, tile_type, origin = c
    vec = f"vector<{s.lanes}x{s.elem}>"
    read_a = _a_reader(w, s, a, w.index(0), None)
    block = max(1, FEW_ROWS_BLOCK_BYTES // (s.m * s.lanes * int(s.elem[1:]) // 8))
    blocks, first, (cur,) = w.open_for(w.index(0), count, w.index(block), [(tile, tile_type)])
    end = em.op(f"arith.minsi {w.add(first, w.index(block))}, {count} : index")

    def pass_over_block(cur: str, ks: list[str]) -> str:
        """C's block += B's rows `ks` times A's columns `ks`."""
        scales = [
            [em.op(f"vector.broadcast {read_a(w.index(0), r, k)} : {s.elem} to {vec}") for k in ks] for r in range(s.m)
        ]
        loop, v, (t,) = w.open_for(first, end, w.index(1), [(cur, tile_type)])
        at = w.add(col0, w.mul(v, w.index(s.lanes)))
        col = em.op(f"arith.subi {at}, {origin} : index")
        pad = em.op(f"arith.constant {s.zero} : {s.elem}")
        masked = f"{{in_bounds = [{state}]}}"
        accs = [
            em.op(f"vector.transfer_read {t}[{w.index(r)}, {col}], {pad} {masked} : {tile_type}, {vec}")
            for r in range(s.m)
        ]
        for u, k in enumerate(ks):
            row = em.op(f"vector.transfer_read {b}[{k}, {at}], {pad} {masked} : {s.b_tensor}, {vec}")
            accs = [multiply_add_vectors(em, scales[r][u], row, accs[r], vec, s.elem) for r in range(s.m)]
        for r in range(s.m):
            t = em.op(f"vector.transfer_write {accs[r]}, {t}[{w.index(r)}, {col}] {masked} : {vec}, {tile_type}")
        w.close_for([t], [tile_type], NO_UNROLL)
        return loop

    steps = s.k // FEW_ROWS_K_STEP
    loop, kb, (t,) = w.open_for(w.index(0), w.index(steps), w.index(1), [(cur, tile_type)])
    k0 = w.mul(kb, w.index(FEW_ROWS_K_STEP))
    t = pass_over_block(t, [w.add(k0, w.index(u)) for u in range(FEW_ROWS_K_STEP)])
    w.close_for([t], [tile_type], NO_UNROLL)
    cur = loop
    if s.k % FEW_ROWS_K_STEP:
        cur = pass_over_block(cur, [w.index(k) for k in range(steps * FEW_ROWS_K_STEP, s.k)])
    w.close_for([cur], [tile_type])
    return blocks


def _epilogue_by_vectors(w: LoopWriter, s: MatmulShape, c: str, c_type: str) -> str:
    """C, once made, through `w.tile_epilogue` one (M, vector) window at a time (C is a few rows:
    a window is still in L1 when the epilogue reads it back), then its partial last vector."""
    em = w.em
    whole = s.n // s.lanes
    window = f"tensor<{s.m}x{s.lanes}x{s.elem}>"
    loop, v, (cur,) = w.open_for(w.index(0), w.index(whole), w.index(1), [(c, c_type)])
    col = w.mul(v, w.index(s.lanes))
    where = f"[0, {col}] [{s.m}, {s.lanes}] [1, 1]"
    part = em.op(f"tensor.extract_slice {cur}{where} : {c_type} to {window}")
    part = w.tile_epilogue(part, (s.m, s.lanes), w.index(0), col)
    w.close_for([em.op(f"tensor.insert_slice {part} into {cur}{where} : {window} into {c_type}")], [c_type])
    if s.n % s.lanes == 0:
        return loop
    width = s.n % s.lanes
    window = f"tensor<{s.m}x{width}x{s.elem}>"
    where = f"[0, {whole * s.lanes}] [{s.m}, {width}] [1, 1]"
    part = em.op(f"tensor.extract_slice {loop}{where} : {c_type} to {window}")
    part = w.tile_epilogue(part, (s.m, width), w.index(0), w.index(whole * s.lanes))
    return em.op(f"tensor.insert_slice {part} into {loop}{where} : {window} into {c_type}")


def _splits_columns(s: MatmulShape, threads: int) -> bool:
    """Whether the cores split C's columns (whole panels) rather than its rows: when each gets two
    or more panels of at least `COLUMN_SPLIT_MIN_K` rows, and neither a batch nor a packed A (which
    every thread would need) is involved."""
    splits = threads > 1 and not s.batch and not _packs_a(s) and s.k >= COLUMN_SPLIT_MIN_K
    return splits and s.n // s.nr >= 2 * threads


def _columns_in_parallel(w: LoopWriter, s: MatmulShape, a: str, b: str, c_all: str, threads: int) -> str:
    """C's whole panels in one `scf.forall` chunk per core; each thread packs every panel of its
    chunk into its own K x NR buffer just before using it. Packing all of B first would run on the
    calling thread alone, while the other cores wait, and send all the packed panels through
    memory; this way nothing runs before the fork and a packed panel stays in L2 while every row
    block reads it. The partial last panel, if any, follows on the calling thread."""
    em = w.em
    whole = s.n // s.nr
    per = _ceil_div(whole, threads)
    c_type, tile_type = s.tensor(s.m, s.n), f"tensor<{s.m}x?x{s.elem}>"
    done, t, shared = w.open_forall(_ceil_div(whole, per), c_all, c_type)
    p0 = w.mul(t, w.index(per))
    count = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(whole)}, {p0} : index')}, {w.index(per)} : index")
    where = f"[0, {w.mul(p0, w.index(s.nr))}] [{s.m}, {w.mul(count, w.index(s.nr))}] [1, 1]"
    tile = em.op(f"tensor.extract_slice {shared}{where} : {c_type} to {tile_type}")
    panels = (p0, w.add(p0, count), ["true"] * s.vectors_per_row)
    w.origin = (w.index(0), w.mul(p0, w.index(s.nr)))
    tile = _panels_packed_one_by_one(w, s, a, b, (tile, tile_type), p0, panels, w.mul(t, w.index(_panel_bytes(s))))
    w.close_forall(tile, shared, where, tile_type, c_type)
    if s.n % s.nr == 0:
        return done
    states = _panel_ranges(s)[-1][2]
    partial = (w.index(whole), w.index(whole + 1), states)
    w.origin = (w.index(0), w.index(0))
    return _panels_packed_one_by_one(w, s, a, b, (done, c_type), w.index(0), partial, w.index(0))


def _panels_just_in_time(w: LoopWriter, s: MatmulShape, a: str, b: str, c_all: str) -> str:
    """A serial product (inside another kernel's parallel loop: a conv chunk) packing each panel just
    before its row blocks use it, so the panel stays in L1/L2, instead of packing all of B first
    (docs/cpu-kernels.md). With `s.b_in_place` no panel is packed: the row blocks read B's columns
    where they are (a conv chunk's column matrix, just written and in L2); that is faster while the
    chunk fits in L2 and slower beyond, so the caller decides."""
    if s.b_in_place:
        return _panels_in_place(w, s, a, b, c_all)
    c_type, whole = s.tensor(s.m, s.n), s.n // s.nr
    panels = (w.index(0), w.index(whole), ["true"] * s.vectors_per_row)
    c_new = _panels_packed_one_by_one(w, s, a, b, (c_all, c_type), w.index(0), panels, w.index(0))
    if s.n % s.nr:
        partial = (w.index(whole), w.index(whole + 1), _panel_ranges(s)[-1][2])
        c_new = _panels_packed_one_by_one(w, s, a, b, (c_new, c_type), w.index(0), partial, w.index(0))
    return c_new


def _row_ranges(s: MatmulShape) -> list[tuple[tuple[int, int], int]]:
    """((first row, end row), rows per block) of all of C's rows: whole blocks of MR, then the rows
    left over, as one shorter tile (several independent accumulators) unless they are at most
    1/`SINGLE_ROWS_MAX_SHARE` of the rows: then one at a time (a 1-row tile runs at a quarter of
    the speed, its two accumulators latency-bound, but is a tenth of the code to compile)."""
    full, left = s.m // s.mr * s.mr, s.m % s.mr
    tail = [((full, s.m), 1 if left * SINGLE_ROWS_MAX_SHARE <= s.m else left)] if left else []
    return ([((0, full), s.mr)] if full else []) + tail


def _panels_in_place(w: LoopWriter, s: MatmulShape, a: str, b: str, c_all: str) -> str:
    """Every panel's row blocks, reading B's columns in place (`MatmulShape.b_in_place`)."""
    c_type = s.tensor(s.m, s.n)
    read_a = _a_reader(w, s, a, w.index(0), None)
    c_new = c_all
    for first, end, states in _panel_ranges(s):
        loop, p, (cur,) = w.open_for(w.index(first), w.index(end), w.index(1), [(c_new, c_type)])
        col = w.mul(p, w.index(s.nr))
        for row_range, mr in _row_ranges(s):
            cur = _row_loop(w, s, read_a, (b, s.b_tensor, None, col), cur, c_type, col, row_range, mr, states)
        w.close_for([cur], [c_type])
        c_new = loop
    return c_new


def _panels_packed_one_by_one(w: LoopWriter, s: MatmulShape, a, b, c_tile, tile_p0, panels, buffer_offset) -> str:
    """For each panel p in [first, end): pack it into a K x NR buffer at `buffer_offset` of the scratch
    area, then every row block's product with it into `c_tile` (whose column 0 is panel `tile_p0`'s)."""
    em = w.em
    tile, tile_type = c_tile
    first, end, states = panels
    buf_type = f"tensor<1x{s.k}x{s.nr}x{s.elem}>"
    buf = w.temporary((1, s.k, s.nr), s.elem, buffer_offset)
    pack = _pack_panel_from_rows if s.b_rows else _pack_panel
    loop, p, (cur, cur_buf) = w.open_for(first, end, w.index(1), [(tile, tile_type), (buf, buf_type)])
    panel = pack(w, s, b, None, states, p, cur_buf, buf_type, w.index(0))
    col = w.mul(em.op(f"arith.subi {p}, {tile_p0} : index"), w.index(s.nr))
    read_a = _a_reader(w, s, a, w.index(0), None)
    for row_range, mr in _row_ranges(s):
        cur = _row_loop(w, s, read_a, (panel, buf_type, w.index(0)), cur, tile_type, col, row_range, mr, states)
    w.close_for([cur, panel], [tile_type, buf_type])
    return f"{loop}#0"


def _rows_in_parallel(w: LoopWriter, s: MatmulShape, operands, c_all: str, threads: int) -> str:
    """C's rows in one `scf.forall` chunk (a multiple of MR rows) per core."""
    em = w.em
    a, packed, bi = operands
    c_type, tile_type = s.tensor(s.m, s.n), f"tensor<?x{s.n}x{s.elem}>"
    chunk = _chunk_rows(s, threads)
    done, t, shared = w.open_forall(_ceil_div(s.m, chunk), c_all, c_type)
    row0 = w.mul(t, w.index(chunk))
    rows = em.op(f"arith.minsi {em.op(f'arith.subi {w.index(s.m)}, {row0} : index')}, {w.index(chunk)} : index")
    full = w.mul(em.op(f"arith.divsi {rows}, {w.index(s.mr)} : index"), w.index(s.mr))
    where = ", ".join(([bi] if bi else []) + [row0, w.index(0)])
    sizes = ", ".join((["1"] if bi else []) + [rows, str(s.n)])
    strides = ", ".join(["1"] * (3 if bi else 2))
    tile = em.op(f"tensor.extract_slice {shared}[{where}] [{sizes}] [{strides}] : {c_type} to {tile_type}")
    w.origin = (row0, w.index(0))
    tile = _row_blocks(w, s, a, packed, tile, tile_type, row0, (w.index(0), full, chunk), s.mr, bi, t)
    if s.m % s.mr:  # chunks are multiples of MR rows, so only a ragged M leaves single rows
        tile = _row_blocks(w, s, a, packed, tile, tile_type, row0, (full, rows, chunk), 1, bi, t)
    w.close_forall(tile, shared, f"[{where}] [{sizes}] [{strides}]", tile_type, c_type)
    return done


def _rows_serially(w: LoopWriter, s: MatmulShape, operands, c_all: str) -> str:
    """All of C's rows on this thread (`_row_ranges`)."""
    em = w.em
    a, packed, bi = operands
    c_type = tile_type = s.tensor(s.m, s.n)
    w.origin = (w.index(0), w.index(0))
    tile = c_all
    if bi:  # this batch's matrix of C
        tile_type = f"tensor<{s.m}x{s.n}x{s.elem}>"
        where = f"[{bi}, 0, 0] [1, {s.m}, {s.n}] [1, 1, 1]"
        tile = em.op(f"tensor.extract_slice {c_all}{where} : {c_type} to {tile_type}")
    for (lo, hi), mr in _row_ranges(s):
        tile = _row_blocks(w, s, a, packed, tile, tile_type, w.index(0), (lo, hi, hi), mr, bi, w.index(0))
    return em.op(f"tensor.insert_slice {tile} into {c_all}{where} : {tile_type} into {c_type}") if bi else tile


def _fork_cores(s: MatmulShape) -> int:
    """The cores a product this large may be split over (all of them when it pays for a fork, 1
    when serial or small), before the row or column split is chosen."""
    threads = 1 if s.serial else cores()
    return threads if s.m * s.n * s.k * max(s.batch, 1) >= PARALLEL_MIN_FLOPS else 1


def _threads(s: MatmulShape) -> int:
    """Threads the product is split over (by columns or rows): all cores when large enough, else 1."""
    threads = _fork_cores(s)
    if threads == 1:
        return 1
    # Split by rows, each core needs two blocks of MR rows; split by columns, any number of rows.
    return threads if s.m >= 2 * s.mr * threads or _splits_columns(s, threads) else 1


def _chunk_rows(s: MatmulShape, threads: int) -> int:
    """Rows of C per thread: a multiple of MR (all of them on one thread)."""
    return _ceil_div(_ceil_div(s.m, threads), s.mr) * s.mr if threads > 1 else s.m


def _packs_a(s: MatmulShape) -> bool:
    return s.a_cols and s.panels >= PACK_A_MIN_PANELS


def _packed_b_bytes(s: MatmulShape) -> int:
    return _round_up(s.panels * s.k * s.nr * int(s.elem[1:]) // 8, 64)


def _packed_a_bytes(s: MatmulShape, most_rows: int) -> int:
    """One thread's packed A (see `_pack_a_columns`) for up to `most_rows` rows."""
    return _round_up(max(most_rows // s.mr, 1) * s.k * s.mr * int(s.elem[1:]) // 8, 64) if _packs_a(s) else 0


def _panel_bytes(s: MatmulShape) -> int:
    return _round_up(s.k * s.nr * int(s.elem[1:]) // 8, 64)


def scratch_bytes(s: MatmulShape) -> int:
    """Bytes of temporaries `emit_matmul` keeps in the function's scratch area (`KernelEmitter.scratch`)
    when the area is that large, else allocates: the packed B panels (one batch at a time), then each
    thread's packed A, then A's restrided copy. Per-call allocations this big fragmented glibc's
    heap (small blocks allocated between calls land in the freed panels), so every call
    page-faulted fresh memory."""
    if streams_rows(s):
        return 0
    return _scratch_before_a_copy(s) + (restrided_bytes(s.m, s.k, s.elem) if _restrides_a(s) else 0)


def _scratch_before_a_copy(s: MatmulShape) -> int:
    """Bytes of the scratch area before A's restrided copy (`restride`), which comes last."""
    threads = _threads(s)
    if s.b_in_place and s.serial:
        return 0
    if _splits_columns(s, threads):
        return threads * _panel_bytes(s)
    chunk = _chunk_rows(s, threads)
    most = chunk if threads > 1 else s.m // s.mr * s.mr
    return _packed_b_bytes(s) + threads * _packed_a_bytes(s, most)


def multiply_add_vectors(em: KernelEmitter, a: str, b: str, acc: str, vec: str, elem: str) -> str:
    """acc + a * b on vectors of `elem` (fused for floats; integers wrap, as numpy's do)."""
    if elem.startswith("i"):
        return em.op(f"arith.addi {acc}, {em.op(f'arith.muli {a}, {b} : {vec}')} : {vec}")
    return em.op(f"vector.fma {a}, {b}, {acc} : {vec}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def cores() -> int:
    """Cores the generated code splits work over (one OpenMP thread each)."""
    return os.cpu_count() or 1
