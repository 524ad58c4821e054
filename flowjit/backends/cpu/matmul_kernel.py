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

This module writes the micro-kernel (the register tile, `_row_block`) and the drivers that run it over
C: by rows or by columns over the cores, packing panels just in time, or streaming a few rows
(`_rows_streamed`). The shape and the plan (tile sizes, thread split, scratch bytes) are
`matmul_plan.py`; the packing of A and B is `matmul_packing.py`.
"""

from __future__ import annotations

from flowjit.backends.cpu import host
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.matmul_packing import (
    Restrided,
    _a_reader,
    _pack_a_columns,
    _pack_b,
    _pack_panel,
    _pack_panel_from_rows,
    _packed_a_reader,
    restride,
)
from flowjit.backends.cpu.matmul_plan import (
    FEW_ROWS_BLOCK_BYTES,
    FEW_ROWS_K_STEP,
    PARALLEL_MIN_FLOPS,
    TALL_TILE_MIN_K,
    MatmulShape,
    _ceil_div,
    _chunk_rows,
    _packs_a,
    _panel_bytes,
    _panel_ranges,
    _restrides_a,
    _row_ranges,
    _scratch_before_a_copy,
    _splits_columns,
    _threads,
    scratch_bytes,
    streams_rows,
)
from flowjit.backends.mlir.emitter import KernelEmitter
from flowjit.errors import CompileError

# On the micro-kernel's k loop: LLVM must not unroll it. It fully unrolls short contractions (the
# CNN's K = 9: 144 FMAs where the loop has 16), which runs no faster and grows the optimized IR,
# and leaves long ones rolled anyway (docs/cpu-compile-time.md). scf-to-cf copies the attribute to
# the loop's branch, which becomes `!llvm.loop` metadata; it must be named `loop_annotation`
# (`llvm.br`'s own attribute): named `llvm.loop_annotation` it stays in the LLVM dialect and is
# dropped by the translation.
NO_UNROLL = "loop_annotation = #llvm.loop_annotation<unroll = <disable = true>>"
# The loop over a panel's blocks of MR rows stays a loop: against up to 4 blocks of constant
# rows written out when K is short (the CNN conv's 32 rows, K = 9), it runs as fast (within 2%) and
# its first call compiles 20-50% faster (2-core AMD EPYC Zen 4 VM): one copy of the register
# tile's code instead of four.
MAX_UNROLLED_ROW_BLOCKS = 1


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
    threads = host.cores() if s.m * s.n * s.k >= PARALLEL_MIN_FLOPS and whole >= 2 * host.cores() else 1
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
    """All of C's rows on this thread (`matmul_plan._row_ranges`)."""
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


def multiply_add_vectors(em: KernelEmitter, a: str, b: str, acc: str, vec: str, elem: str) -> str:
    """acc + a * b on vectors of `elem` (fused for floats; integers wrap, as numpy's do)."""
    if elem.startswith("i"):
        return em.op(f"arith.addi {acc}, {em.op(f'arith.muli {a}, {b} : {vec}')} : {vec}")
    return em.op(f"vector.fma {a}, {b}, {acc} : {vec}")
