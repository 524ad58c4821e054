"""The plan of a register-blocked matrix product (`matmul_kernel.emit_matmul`): its shape
(`MatmulShape`: register tile, panels), how it is split over the cores (by C's rows or columns,
`_threads`), when it is streamed instead of tiled (`streams_rows`), the row ranges and panel ranges
its tiles cover, and the bytes of scratch its packed operands take (`scratch_bytes`). Pure
arithmetic on shapes: no MLIR is written here; the tuning constants live next to the decisions
they drive.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flowjit.backends.cpu import host

# Below this many multiply-adds the product runs on one thread (an OpenMP fork costs microseconds).
PARALLEL_MIN_FLOPS = 1 << 21
# Below this many multiply-adds, or with fewer columns than one vector, the plain linalg.generic
# (scalar loops that LLVM unrolls) is as fast and compiles faster.
KERNEL_MIN_FLOPS = 1 << 12


def worth_it(batch: int, m: int, n: int, k: int) -> bool:
    """Whether a product of this shape should use this kernel."""
    lanes = host.vector_bits() // 32
    return max(batch, 1) * m * n * k >= KERNEL_MIN_FLOPS and n >= lanes // 2 and k > 0


@functools.cache
def tile_rows(vectors_per_row: int) -> int:
    """The most rows a register tile of `vectors_per_row` vectors per row can have: its accumulators,
    the panel's vectors and one broadcast in the host's vector registers (32 with AVX-512, 16
    otherwise), one spare (an integer product's temporary)."""
    registers = 32 if host.vector_bits() == 512 else 16
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
    # A arrives as (.., K, M) (e.g. `a.T @ b`): read by columns (see `matmul_packing._pack_a_columns`)
    a_cols: bool = False
    serial: bool = False  # on the calling thread only (inside another kernel's parallel loop)
    accumulate: bool = False  # C = C0 + A @ B, C0 given to `emit_matmul` (a sum over K in parts)
    # B (K, N) read in place by the micro-kernel, no panel packed: for a B the caller has just
    # written and that fits in L2 (a conv chunk's columns; `serial` products only, see
    # `matmul_kernel._panels_just_in_time`).
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
        return host.vector_bits() // int(self.elem[1:])

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
# A given as (K, M) is packed (see `matmul_packing._pack_a_columns`) when this many panels re-read
# it; a product with fewer (a narrow N) reads its columns in place (packing for a.T @ dz with N = 10
# triples its time).
PACK_A_MIN_PANELS = 4
# A whose rows are a multiple of this many bytes apart is first copied to rows padded by one cache
# line (`matmul_packing.restride`). The micro-kernel reads MR rows of A at once, one line of each
# per 16 k: at such a stride all MR lines fall in the same L1 set (sets x line = 4 KiB on the Zen 4,
# Zen 5 and Xeon cores measured), which holds 8 or 12 lines, so with 14 rows every broadcast misses
# L1: on a 2-core AMD EPYC Zen 4 VM a 1024^3 float32 product unpadded runs at about 60% of the speed
# of K = 1008 or 1040.
ALIASING_STRIDE = 4096
CACHE_LINE = 64
# Cores split C's columns (each packing its panels just in time) only for contractions at least this
# long: split that way, the CNN's 3x3 conv on one channel (K = 9) runs 7% slower and a deep one
# (K = 288) faster (2-core AMD EPYC Zen 4 VM).
COLUMN_SPLIT_MIN_K = 64


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


def _splits_columns(s: MatmulShape, threads: int) -> bool:
    """Whether the cores split C's columns (whole panels) rather than its rows: when each gets two
    or more panels of at least `COLUMN_SPLIT_MIN_K` rows, and neither a batch nor a packed A (which
    every thread would need) is involved."""
    splits = threads > 1 and not s.batch and not _packs_a(s) and s.k >= COLUMN_SPLIT_MIN_K
    return splits and s.n // s.nr >= 2 * threads


def _row_ranges(s: MatmulShape) -> list[tuple[tuple[int, int], int]]:
    """((first row, end row), rows per block) of all of C's rows: whole blocks of MR, then the rows
    left over, as one shorter tile (several independent accumulators) unless they are at most
    1/`SINGLE_ROWS_MAX_SHARE` of the rows: then one at a time (a 1-row tile runs at a quarter of
    the speed, its two accumulators latency-bound, but is a tenth of the code to compile)."""
    full, left = s.m // s.mr * s.mr, s.m % s.mr
    tail = [((full, s.m), 1 if left * SINGLE_ROWS_MAX_SHARE <= s.m else left)] if left else []
    return ([((0, full), s.mr)] if full else []) + tail


def _fork_cores(s: MatmulShape) -> int:
    """The cores a product this large may be split over (all of them when it pays for a fork, 1
    when serial or small), before the row or column split is chosen."""
    threads = 1 if s.serial else host.cores()
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


def aliases(k: int, elem: str) -> bool:
    """Whether rows of `k` elements of `elem` are a multiple of `ALIASING_STRIDE` bytes long."""
    return k * int(elem[1:]) // 8 % ALIASING_STRIDE == 0


def restrided_bytes(m: int, k: int, elem: str) -> int:
    """Bytes of an (m, k) matrix's restrided copy (`matmul_packing.restride`)."""
    return _round_up(m * (k * int(elem[1:]) // 8 + CACHE_LINE), 64)


def _restrides_a(s: MatmulShape) -> bool:
    """Whether A's rows are copied one cache line apart first (see `ALIASING_STRIDE`): a row-major A
    read in place by tall tiles, its rows a multiple of `ALIASING_STRIDE` bytes long. Not for
    serial products (inside another kernel's parallel loop, which has no scratch area of its own:
    a convolution restrides its weights before its fork, `lower_conv._conv_as_matmul`)."""
    return not s.a_cols and not s.serial and s.m >= s.mr and aliases(s.k, s.elem)


# Products of at most FEW_ROWS_MAX rows (a batch-1 or small-batch layer, `v @ W`) are streamed
# (`matmul_kernel._rows_streamed`): nothing is packed, and B is read once, row after row, in the
# order it lies in memory. Packed into K x NR panels, each B row would be read 128 bytes at a time,
# 16 KiB apart, and the panels used by one row block only, at half the memory bandwidth JAX reaches
# on such products. FEW_ROWS_K_STEP rows of B go through each pass over C's block (fewer loads and
# stores of C per multiply-add), and a block of C is at most FEW_ROWS_BLOCK_BYTES, to stay in L1.
FEW_ROWS_MAX = 4
FEW_ROWS_K_STEP = 4
FEW_ROWS_BLOCK_BYTES = 16 << 10
# Up to this many rows, a product whose B is larger than the last-level cache is streamed too:
# memory-bound either way, and the tiled kernel's panels read B 128 bytes at a time, so streaming
# is faster there (by a third at 6 rows); with B in L3 tiling is faster, hence the size condition.
FEW_ROWS_MAX_LARGE_B = 8


def streams_rows(s: MatmulShape) -> bool:
    """Whether `emit_matmul` streams this product (`matmul_kernel._rows_streamed`) instead of tiling it."""
    plain = not (s.batch or s.serial or s.accumulate or s.a_cols or s.b_rows or s.b_in_place)
    b_bytes = s.k * s.n * int(s.elem[1:]) // 8
    few = s.m <= FEW_ROWS_MAX or (s.m <= FEW_ROWS_MAX_LARGE_B and b_bytes > host.last_level_cache_bytes())
    return plain and few and s.n >= s.lanes and s.k >= FEW_ROWS_K_STEP


def _packed_b_bytes(s: MatmulShape) -> int:
    return _round_up(s.panels * s.k * s.nr * int(s.elem[1:]) // 8, 64)


def _packed_a_bytes(s: MatmulShape, most_rows: int) -> int:
    """One thread's packed A (see `matmul_packing._pack_a_columns`) for up to `most_rows` rows."""
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
    """Bytes of the scratch area before A's restrided copy (`matmul_packing.restride`), which comes last."""
    threads = _threads(s)
    if s.b_in_place and s.serial:
        return 0
    if _splits_columns(s, threads):
        return threads * _panel_bytes(s)
    chunk = _chunk_rows(s, threads)
    most = chunk if threads > 1 else s.m // s.mr * s.mr
    return _packed_b_bytes(s) + threads * _packed_a_bytes(s, most)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b
