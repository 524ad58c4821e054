"""Transform-dialect schedules for the CPU kernels: how a `linalg.generic` is split over threads,
tiled and vectorized. Each function returns `steps(handle) -> [transform ops]` for
`KernelEmitter.schedule`. The choices and their reasons are in docs/cpu-kernels.md.

- Elementwise kernels are 1-D (the lowering collapses operands): vectors of the host width, and
  above `PARALLEL_MIN_ELEMENTS` one `scf.forall` chunk per core (lowered to OpenMP).
- Reductions are normalized by the lowering to (A, R) rows or (A, R, B) with B contiguous:
  rows reduce with vector accumulators along R; columns vectorize along B and keep the
  accumulator in registers across R (`loop-invariant-subset-hoisting` after the schedule).
"""

from __future__ import annotations

import math
import os

from flowjit.backends.cpu import host
from flowjit.backends.mlir.emitter import HOIST_MARK

# Below this many elements a kernel stays on one thread: a fork/join costs 5-20 us and, on a shared
# machine, waits for a descheduled worker, while one core streams 256K float32 in about 60 us (both
# on a 2-core AMD EPYC Zen 4 VM), so smaller kernels cannot win (docs/cpu-backend.md, "Threads").
PARALLEL_MIN_ELEMENTS = 1 << 18
# A kernel left without a schedule (plain loops) up to this many elements does not need LLVM's
# vectorizers: the function may still take LLVM's light pipeline (`compiler.light_pipeline`), which
# leaves such loops scalar. Fine for an iota of 256 x 10 label columns or a 0-d division; kernels
# with math in them get a schedule at this size (`lower_fusion`'s n-d kernels: `copy_nd`).
PLAIN_LOOP_MAX_ELEMENTS = 4096
# A full reduction over the cores: this many partial results, each with this many vector
# accumulators (`_full_reduction`). Inputs of at least `STREAMING_REDUCTION_MIN_BYTES` (streamed from
# memory, not held in any cache) take one accumulator per partial and 4x the partials, so that each
# lane adds as many elements in sequence: memory then bounds the sum, and more partials keep more
# loads in flight. From cache one accumulator per partial is no faster, and up to 7% slower (sums of
# 1-64 MiB of float32 on a 2-core Xeon VM, whose L3 holds 64 MiB), hence the threshold.
FULL_REDUCTION_CHUNKS = 64
FULL_REDUCTION_VECTORS = 4
STREAMING_REDUCTION_MIN_BYTES = 128 << 20
ANY = "!transform.any_op"
# LLVM's pipeline does not unroll loops on its own (`toolchain.optimization_pipeline`): a loop with
# a short constant trip count is unrolled by its schedule (`copy_nd`) or written out by the lowering
# (`row_writers.row_of_vectors`, the matmul kernel's pack and row blocks), not marked for LLVM's
# full unrolling, which would keep their functions on the O3 pipeline.
# Vector steps up to which a row's loop is unrolled.
MAX_UNROLLED_STEPS = 4
# Rows shorter than a vector and at most this long reduce whole rows per tile (`_short_row_reduction`):
# a tile is a vector of rows by the row, at most this many vector registers.
SHORT_ROW_MAX = 15


def threads() -> int:
    """Cores the schedules split large kernels over."""
    return os.cpu_count() or 1


def lanes(elem_bits: int) -> int:
    """Vector length in elements for the widest element type of a kernel."""
    return max(4, host.vector_bits() // max(elem_bits, 8))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def elementwise(n: int, elem_bits: int, vectors: int = 1):
    """A 1-D elementwise kernel over `n` elements, `vectors` vectors per loop step (`lower_fusion`
    gives long fused bodies two: independent work for the core while each vector waits on its
    chain of math-function latencies)."""
    vl = lanes(elem_bits) * vectors

    def steps(h: str) -> list[str]:
        lines = []
        if n >= PARALLEL_MIN_ELEMENTS and threads() > 1:
            # Chunks of whole groups of 4 vectors of the widest lanes: 256 bytes of f32 with
            # AVX-512, each thread starting on a line; no wider (a step of 4 vectors rounds to
            # itself), so that n / threads of such groups splits evenly, into static chunks the
            # vectorizer needs no masks for.
            chunk = _round_up(-(-n // threads()), lanes(elem_bits) * 4)
            lines.append(
                f"%par{h[1:]}, %forall{h[1:]} = transform.structured.tile_using_forall {h} tile_sizes [{chunk}] "
                f": ({ANY}) -> ({ANY}, {ANY})"
            )
            h = f"%par{h[1:]}"
        lines += [
            f"%vec{h[1:]}, %loop{h[1:]} = transform.structured.tile_using_for {h} tile_sizes [{vl}] "
            f": ({ANY}) -> ({ANY}, {ANY})",
            f"transform.structured.vectorize %vec{h[1:]} vector_sizes [{vl}] : {ANY}",
        ]
        return lines

    return steps


def short_row(width: int, vector_lanes: int) -> bool:
    """Whether a row of `width` elements takes at most `MAX_UNROLLED_STEPS` vectors: its loop is then
    unrolled (by the schedule in `copy_nd`, marked for LLVM's full unrolling in im2col and pooling)."""
    return -(-width // vector_lanes) <= MAX_UNROLLED_STEPS


def short_rows(shape: tuple[int, ...], elem_bits: int) -> bool:
    """Whether an n-d kernel's rows are short (`short_row`): `copy_nd` then unrolls the row loop, and
    the lowerings give such kernels that schedule even when small (LLVM, not unrolling, would run a
    vector loop plus a scalar remainder loop per row)."""
    return len(shape) > 1 and short_row(shape[-1], lanes(elem_bits))


def _rows_over_cores(h: str, shape: tuple[int, ...], parallel: bool, multiple: int = 1) -> tuple[list[str], str]:
    """The kernel `h`'s first dim in one `tile_using_forall` chunk (a multiple of `multiple`) per
    core, when `parallel` and there is more than one core and row: (lines, handle of the chunk)."""
    if not (parallel and threads() > 1 and shape[0] > 1):
        return [], h
    chunk = _round_up(-(-shape[0] // threads()), multiple)
    sizes = ", ".join([str(chunk)] + ["0"] * (len(shape) - 1))
    line = (
        f"%par{h[1:]}, %forall{h[1:]} = transform.structured.tile_using_forall {h} tile_sizes [{sizes}] "
        f": ({ANY}) -> ({ANY}, {ANY})"
    )
    return [line], f"%par{h[1:]}"


def copy_nd(shape: tuple[int, ...], elem_bits: int, parallel: bool = True, unroll: int = MAX_UNROLLED_STEPS):
    """An n-d kernel (e.g. a broadcast): rows split over cores (unless not `parallel`), the last
    dimension vectorized, its loop unrolled when short (by at most `unroll` steps)."""
    vl = lanes(elem_bits)
    rank = len(shape)

    def steps(h: str) -> list[str]:
        lines, h = _rows_over_cores(h, shape, parallel)
        tiles = ", ".join(["1"] * (rank - 1) + [str(vl)])
        loops = ", ".join([ANY] * rank)
        lines += [
            f"%vec{h[1:]}, {', '.join(f'%loop{i}{h[1:]}' for i in range(rank))} = "
            f"transform.structured.tile_using_for {h} tile_sizes [{tiles}] : ({ANY}) -> ({ANY}, {loops})",
            f"transform.structured.vectorize %vec{h[1:]} vector_sizes [{tiles}] : {ANY}",
        ]
        row_steps = -(-shape[-1] // vl)
        factor = max(d for d in range(1, min(row_steps, unroll) + 1) if row_steps % d == 0)
        if short_row(shape[-1], vl) and factor > 1:
            # Unrolled here rather than marked for LLVM's unrolling: a marked loop keeps the
            # function on LLVM's O3 pipeline (`compiler.light_pipeline`).
            lines.append(f"transform.loop.unroll %loop{rank - 1}{h[1:]} {{factor = {factor}}} : {ANY}")
        return lines

    return steps


# The largest side of a transpose block. 8x8 balances compile and run time: a 16x16 block's shuffle
# network costs LLVM's instruction selection about 50 ms per kernel (a 4096x1024 float32 transpose,
# 2-core AMD EPYC Zen 4 VM) to save about a quarter of the run time, and 4x4 blocks run markedly
# slower than 8x8.
TRANSPOSE_BLOCK_MAX = 8


def transpose_block(elem_bits: int) -> int:
    """The side of `transpose_blocks`' square blocks: a vector's lanes, at most TRANSPOSE_BLOCK_MAX."""
    return min(lanes(elem_bits), TRANSPOSE_BLOCK_MAX)


def transpose_blocks(shape: tuple[int, ...], source_last: int, elem_bits: int, parallel: bool = True):
    """A permuted copy whose input's contiguous (last) dim is output dim `source_last` (not the
    last): blocks of lanes x lanes elements, read as `lanes` contiguous input rows and written as
    `lanes` contiguous output rows, transposed in registers; rows of blocks split over the cores.
    (As plain loops every element is a strided read, an order of magnitude slower.) Blocks are at
    most TRANSPOSE_BLOCK_MAX a side: 64 x 64 bytes in one vector makes LLVM's instruction selection
    run for minutes."""
    vl = transpose_block(elem_bits)
    rank = len(shape)

    def steps(h: str) -> list[str]:
        lines, h = _rows_over_cores(h, shape, parallel, vl if source_last == 0 else 1)
        tiles = ", ".join(str(vl) if d in (source_last, rank - 1) else "1" for d in range(rank))
        loops = ", ".join([ANY] * rank)
        lines += [
            f"%vec{h[1:]}, {', '.join(f'%loop{i}{h[1:]}' for i in range(rank))} = "
            f"transform.structured.tile_using_for {h} tile_sizes [{tiles}] : ({ANY}) -> ({ANY}, {loops})",
            f"transform.structured.vectorize %vec{h[1:]} vector_sizes [{tiles}] : {ANY}",
        ]
        return lines

    return steps


def transpose_short_rows(shape: tuple[int, int], elem_bits: int):
    """A (K, R) -> (R, K) copy of fewer rows R than `transpose_block`: tiles of all R output rows x
    `transpose_block` columns, each read as that many input rows of R, transposed in registers
    and stored as R rows; on one thread. A square block would store its rows past R under
    all-false masks: past the output's end, in pages never mapped, where AVX-512's masked stores
    take a microcode assist each on Zen 4, about 40x the run time (`lower_layout._transposed_in_two`)."""
    vl = transpose_block(elem_bits)
    tiles = f"[{shape[0]}, {vl}]"

    def steps(h: str) -> list[str]:
        return [
            f"%vec{h[1:]}, %loop0{h[1:]}, %loop1{h[1:]} = transform.structured.tile_using_for {h} "
            f"tile_sizes {tiles} : ({ANY}) -> ({ANY}, {ANY}, {ANY})",
            f"transform.structured.vectorize %vec{h[1:]} vector_sizes {tiles} : {ANY}",
        ]

    return steps


def _tile_for(h: str, sizes: list[int], out: str) -> str:
    loops = sum(1 for s in sizes if s)
    results = ", ".join([out] + [f"%{out[1:]}_l{i}" for i in range(loops)])
    types = ", ".join([ANY] * (loops + 1))
    return f"{results} = transform.structured.tile_using_for {h} tile_sizes {sizes} : ({ANY}) -> ({types})"


def _forall(h: str, sizes: list[int], out: str) -> str:
    tiled = f"transform.structured.tile_using_forall {h} tile_sizes {sizes}"
    return f"{out}, %{out[1:]}_f = {tiled} : ({ANY}) -> ({ANY}, {ANY})"


def _vectorize(h: str, sizes: list[int] | None = None) -> str:
    vs = f" vector_sizes {sizes}" if sizes else ""
    return f"transform.structured.vectorize {h}{vs} : {ANY}"


def peel_last(loop: str, prefix: str) -> tuple[list[str], str, str]:
    """Peel the partial last iteration off the tiled loop `loop` (its tiles then all have the step's
    size, so the op inside vectorizes without masks; the remainder's op is masked once): the
    transform lines and handles to the linalg ops of the main loop and of the remainder, named
    from `prefix` (a unique name). Handles to ops inside `loop` are invalidated."""
    scf_for = '!transform.op<"scf.for">'
    lines = [
        f"{prefix}for = transform.cast {loop} : {ANY} to {scf_for}",
        f"{prefix}main, {prefix}rest = transform.loop.peel {prefix}for : ({scf_for}) -> ({ANY}, {ANY})",
    ]
    for part in ("main", "rest"):
        match = f'transform.structured.match ops{{["linalg.generic"]}} in {prefix}{part}'
        lines.append(f"{prefix}{part}op = {match} : ({ANY}) -> {ANY}")
    return lines, f"{prefix}mainop", f"{prefix}restop"


# The transposes an inner-parallel reduction makes, as one shuffle each (`_short_row_reduction`).
_SHUFFLE_TRANSPOSES = 'transform.apply_patterns.vector.lower_transpose lowering_strategy = "shuffle_1d"'


def _inner_parallel(loop: str, more: str = "") -> str:
    """Lower the multi-reductions inside `loop` with the inner-parallel strategy (the reduced dim
    moved outermost, its slices combined elementwise), with the patterns `more` beside it."""
    patterns = f'transform.apply_patterns.vector.lower_multi_reduction lowering_strategy = "innerparallel" {more}'
    return f"transform.apply_patterns to {loop} {{ {patterns.rstrip()} }} : {ANY}"


def _hoist(loop: str) -> str:
    # The vectorized reduction reads and writes its accumulator in every iteration: hoisted out of
    # the loop, it stays in vector registers.
    return f'transform.annotate {loop} "{HOIST_MARK}" : {ANY}'


def reduction(shape: tuple[int, ...], axis: int | tuple[int, ...], acc_bits: int, may_stay_plain: bool = False):
    """A reduction in normal form: (R) -> (), (A, R) -> (A), (R, B) -> (B) or (A, R, B) -> (A, B); or
    one over the last axis of any rank, (A1, .., An, R) -> (A1, .., An) (a fused reduction of
    broadcast values, whose iteration space cannot be collapsed: `sum((a[:, None] - b[None]) ** 2,
    -1)`); or one over several axes (a tuple), none of them the last: (A, R1, B, R2, C) -> (A, B, C)
    (a mean over the window axes of `x.reshape(n, h / 2, 2, w / 2, 2, c)`), as columns. None (no
    schedule: plain loops) when `may_stay_plain` (the caller's kernel runs once per call and has no
    math function in its body) and `stays_plain`."""
    vl = lanes(acc_bits)
    if may_stay_plain and stays_plain(shape, axis, acc_bits):
        return None
    if isinstance(axis, tuple):
        if len(axis) > 1:
            size = math.prod(shape)
            return _column_reduction(shape, axis, vl, size >= PARALLEL_MIN_ELEMENTS and threads() > 1)
        (axis,) = axis
    size = 1
    for d in shape:
        size *= d
    parallel = size >= PARALLEL_MIN_ELEMENTS and threads() > 1
    if len(shape) == 1:
        streams = parallel and size * acc_bits // 8 >= STREAMING_REDUCTION_MIN_BYTES
        return _full_reduction(vl, parallel, streams)
    if axis == len(shape) - 1:
        return _row_reduction(shape, vl, parallel)
    return _column_reduction(shape, axis, vl, parallel)


def stays_plain(shape: tuple[int, ...], axis: int | tuple[int, ...], acc_bits: int) -> bool:
    """Whether a reduction of `shape` over `axis`, run once per call with no math function in its
    body, is left as plain loops: rows shorter than a vector (`_short_row_reduction`), at most
    `PLAIN_LOOP_MAX_ELEMENTS` elements in all. Their tile's transpose (a 16 x 10 tile is a
    160-element shuffle) costs about 20 ms of compile each, mostly LLVM's lowering of the shuffles,
    to save 2-3 us of run time (cross-entropy's gradient over 256 x 10 on a 2-core AMD EPYC Zen 4
    VM; docs/cpu-compile-time.md)."""
    last = len(shape) - 1
    short = last > 0 and axis in (last, (last,)) and shape[-1] < min(lanes(acc_bits), SHORT_ROW_MAX + 1)
    return short and math.prod(shape) <= PLAIN_LOOP_MAX_ELEMENTS


def _full_reduction(vl: int, parallel: bool, streams: bool):
    vectors = 1 if streams else FULL_REDUCTION_VECTORS
    # As many partials more as accumulators fewer: each lane adds as many elements in sequence.
    chunks = FULL_REDUCTION_CHUNKS * FULL_REDUCTION_VECTORS // vectors

    def steps(h: str) -> list[str]:
        n = h[1:]
        lines = []
        if parallel:
            lines += [
                f"%pfill{n}, %psplit{n}, %pcomb{n}, %pforall{n} = transform.structured.tile_reduction_using_forall "
                f"{h} by num_threads = [{chunks}] : ({ANY}) -> ({ANY}, {ANY}, {ANY}, {ANY})",
            ]
            h = f"%psplit{n}"
        # Four vector accumulators: independent add chains (latency hidden) and 4x fewer sequential
        # additions per lane (accuracy); one when streaming (see `STREAMING_REDUCTION_MIN_BYTES`).
        lines += [
            f"%fill{n}, %split{n}, %comb{n}, %rloop{n} = transform.structured.tile_reduction_using_for {h} "
            f"by tile_sizes = [{vectors * vl}] : ({ANY}) -> ({ANY}, {ANY}, {ANY}, {ANY})",
            _vectorize(f"%split{n}", [vectors * vl]),
            _vectorize(f"%comb{n}"),
            _vectorize(f"%fill{n}"),
        ]
        if parallel:
            # The partials are combined a vector at a time: vectorized whole, the streaming sum's 256
            # would be one <256 x float> add tree, slow in LLVM's instruction selection.
            lines += [
                f"%cfill{n}, %csplit{n}, %ccomb{n}, %cloop{n} = transform.structured.tile_reduction_using_for "
                f"%pcomb{n} by tile_sizes = [{vl}] : ({ANY}) -> ({ANY}, {ANY}, {ANY}, {ANY})",
                _vectorize(f"%csplit{n}", [vl]),
                _vectorize(f"%ccomb{n}"),
                _vectorize(f"%cfill{n}"),
                _vectorize(f"%pfill{n}"),
                _hoist(f"%cloop{n}"),
            ]
        return lines + [_hoist(f"%rloop{n}")]

    return steps


def _row_reduction(shape: tuple[int, ...], vl: int, parallel: bool):
    a, r = shape[-2], shape[-1]
    lead = [1] * (len(shape) - 2)  # dims before the rows' (rank > 2): one at a time
    if r < min(vl, SHORT_ROW_MAX + 1):
        return _short_row_reduction(shape, vl, parallel)
    # Rows of at least four vectors: one row at a time, four vector accumulators (independent chains)
    # and one horizontal reduction per row. Shorter rows: eight rows at a time, one vector each. Eight
    # rows of one vector on long rows run no faster (softmax, layer norm) and their eight horizontal
    # reductions per tile are most of the kernel's machine code, so LLVM's compile time.
    rows, width = (1, 4 * vl) if r >= 4 * vl else (8 if a >= 8 else a, vl)
    if width < r < 2 * width and r % width:
        # One whole chunk and a partial one: the whole chunk's reduction folds into its input (the
        # accumulator starts as the identity), and the partial chunk, combined into that input's
        # slice, becomes a copy of the tile per step, several times slower than JAX. Narrower chunks
        # make a loop of at least two.
        width = vl if width > vl else vl // 2

    def steps(h: str) -> list[str]:
        lines, targets = _row_tiles(h, shape, rows, parallel, _row_chunk(a, rows))
        for op, n, _ in targets:
            lines += [
                f"%fill{n}, %split{n}, %comb{n}, %rloop{n} = transform.structured.tile_reduction_using_for {op} "
                f"by tile_sizes = {[0] * (len(shape) - 1) + [width]} : ({ANY}) -> ({ANY}, {ANY}, {ANY}, {ANY})",
            ]
            loop = f"%rloop{n}"
            if r % width and r > width:
                # The last, partial chunk peeled off: with it in the loop every chunk is masked (each
                # load, and the accumulator stored and reloaded each step); peeled, rows of 1000 run
                # as fast as rows of 1024.
                peeled, split, rest = peel_last(f"%rloop{n}", f"%r{n}")
                lines += [*peeled, _vectorize(rest, lead + [rows, r % width])]
                loop = f"%r{n}main"
            else:
                split = f"%split{n}"
            lines += [
                _vectorize(split, lead + [rows, width]),
                _vectorize(f"%comb{n}", lead + [rows, width]),
                _vectorize(f"%fill{n}", lead + [rows, width]),
                _hoist(loop),
            ]
        return lines

    return steps


def _row_chunk(a: int, rows: int) -> int:
    """Rows per chunk over the cores for tiles of `rows` rows: about a / (8 x cores), a whole number
    of tiles, and one that divides `a` when some number of tiles between half and twice that does:
    then every chunk is whole and no tile is peeled off (`_row_tiles`), half the kernel's code. Of
    those, a number of chunks that the cores share evenly (OpenMP's static schedule gives each core
    as many), if there is one. Max over 20000 rows of 50 float32 on two cores, for instance, takes
    20 chunks of 1000 rather than chunks of 1248 and a peeled last one of 32, which would nearly
    double the LLVM IR and the first call's compile time."""
    target = max(1, -(-a // (threads() * 8)) // rows)
    if a % rows:
        return target * rows
    tiles = a // rows
    whole = [t for t in range(max(1, target // 2), min(2 * target, tiles // threads()) + 1) if tiles % t == 0]
    shared = [t for t in whole if (tiles // t) % threads() == 0]
    return min(shared or whole, key=lambda t: abs(t - target), default=target) * rows


def _row_tiles(h: str, shape: tuple[int, ...], rows: int, parallel: bool, chunk: int) -> tuple[list[str], list]:
    """A row reduction's kernel `h` in chunks of `chunk` rows over the cores (of the first dim when
    the rank is above 2), each in tiles of `rows` rows (the dims before them one at a time): the
    transform lines and the (linalg op, unique name, loop) of each kind of tile. When the tiles may not
    fill a chunk (the rows, or the chunks, not a whole number of them), the last tile of each chunk
    is peeled off: otherwise every tile has a run-time size and is masked, and a sum over rows whose
    count the tiles do not divide runs several times slower than one over the same elements in rows
    they do."""
    n = h[1:]
    a, lead = shape[-2], [1] * (len(shape) - 2)
    lines = []
    partial = a % rows != 0
    if parallel and lead and shape[0] > 1:
        lines.append(_forall(h, [-(-shape[0] // threads())] + [0] * (len(shape) - 1), f"%par{n}"))
        h = f"%par{n}"
    elif parallel and a > rows:
        lines.append(_forall(h, lead + [chunk, 0], f"%par{n}"))
        h = f"%par{n}"
        partial = partial or a % chunk != 0
    lines.append(_tile_for(h, lead + [rows, 0], f"%rows{n}"))
    if not partial or rows == 1:
        return lines, [(f"%rows{n}", n, f"%rows{n}_l{len(lead)}")]
    peeled, main, rest = peel_last(f"%rows{n}_l{len(lead)}", f"%p{n}")
    return lines + peeled, [(main, f"{n}m", f"%p{n}main"), (rest, f"{n}r", f"%p{n}rest")]


def _short_row_reduction(shape: tuple[int, ...], vl: int, parallel: bool):
    """Rows shorter than a vector (x, y, z coordinates, RGB channels, ten class scores): a tile of
    `vl` whole rows is one 2-d vector, reduced with the inner-parallel strategy, which transposes
    it (the tile's columns become vectors of one element of `vl` rows) and combines the columns
    elementwise: `vl` results per step, no horizontal reduction and no mask along the row. The
    general schedule reduces eight rows per step, each row a masked vector with its own
    horizontal reduction, several times slower on such rows. The transpose is one shuffle of the
    tile's elements (`shuffle_1d`; element by element, the default, makes 2.5-5x the machine code
    and runs no faster). From a full vector on, the transposes cost more than they save, and
    those rows keep the general schedule, as do rows of more than `SHORT_ROW_MAX`
    narrow elements (a tile of 64 rows of bools is 64 x r bytes, r vector registers). Tiles as in
    `_row_tiles`."""
    a, r = shape[-2], shape[-1]
    lead = [1] * (len(shape) - 2)
    rows = vl if a >= vl else a

    def steps(h: str) -> list[str]:
        lines, targets = _row_tiles(h, shape, rows, parallel, _round_up(-(-a // threads()), rows))
        for op, _, loop in targets:
            lines += [
                _vectorize(op, lead + [rows, r]),
                _inner_parallel(loop, _SHUFFLE_TRANSPOSES),
            ]
        return lines

    return steps


def _column_reduction(shape: tuple[int, ...], axis: int | tuple[int, ...], vl: int, parallel: bool):
    """(A, R, B) -> (A, B), or any rank with one reduced axis before the last (a fused reduction over
    the channels of NCHW values with a broadcast among them, whose space cannot collapse): each
    output vector sums its column over R in sequence, as in the collapsed form. Several reduced
    axes (a tuple, none the last): each output vector sums over all of them, the last innermost."""
    rank = len(shape)
    axes = axis if isinstance(axis, tuple) else (axis,)

    def steps(h: str) -> list[str]:
        n = h[1:]
        lines = []
        if parallel:
            first = 0 if rank >= 3 and axes[0] > 0 and shape[0] >= threads() else rank - 1
            sizes = [0] * rank
            sizes[first] = -(-shape[first] // threads())
            if first == rank - 1:
                sizes[first] = _round_up(sizes[first], 4 * vl)
            lines.append(_forall(h, sizes, f"%par{n}"))
            h = f"%par{n}"
        # The dims before and after R by 1 (the last by 4 vectors), R whole; then R by 1 inside: the
        # accumulator stays in registers.
        # Columns narrower than 4 vectors: whole vectors of them (otherwise 32 float32 columns would
        # be two vectors' work in a masked 64-lane one).
        width = min(4 * vl, _round_up(shape[-1], vl))
        outer = [0 if d in axes else width if d == rank - 1 else 1 for d in range(rank)]
        inner = [1 if d in axes else 0 for d in range(rank)]
        lines.append(_tile_for(h, outer, f"%cols{n}"))
        targets = [(f"%cols{n}", f"%red{n}")]
        if shape[-1] % width and shape[-1] > width:
            # The partial last column tile peeled off: with it in the loop every tile is masked, and
            # a column sum over 1000 columns runs nearly twice as long as over 1024.
            loops = sum(1 for size in outer if size)
            peeled, main, rest = peel_last(f"%cols{n}_l{loops - 1}", f"%col{n}")
            lines += peeled
            targets = [(main, f"%redmain{n}"), (rest, f"%redrest{n}")]
        for target, red in targets:
            lines += [
                _tile_for(target, inner, red),
                _vectorize(red, [1] * (rank - 1) + [width]),
                # The step reduces a 1 x vl slice into the accumulator: an elementwise combine, which
                # only the inner-parallel strategy emits as one vector instruction.
                _inner_parallel(f"{red}_l0"),
                # innermost first: its accumulator moves to the loop around it, then out of that one
                *(_hoist(f"{red}_l{i}") for i in reversed(range(len(axes)))),
            ]
        return lines

    return steps
