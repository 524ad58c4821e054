"""CPU lowering of `sort`: a stable bottom-up merge sort of each row, rows split over the cores.

The operands are viewed as (rows, n) with the sorted axis last (a transpose first when it is not
last). Each row is sorted by `ceil(log2 n)` merge passes of doubling run widths, any n (no padding
to a power of two). The passes ping-pong between the result and a scratch row, starting on the
side that makes the last pass land in the result; after the first one or two, an `scf.for` runs
them in pairs with the run width doubling at run time, so a row of any length is four pass bodies
of code (`_sort_row`). A pass is an `scf.for` over pairs of adjacent
runs; each pair is merged from both ends at once by an `scf.for` carrying the read positions (the
heads and the tails of both runs) and the destination rows of every operand: two independent
dependency chains per iteration, which this latency-bound loop needs.

Order: the merge takes from the right run only when its key is strictly smaller, so equal keys
keep their order (stable). Float keys compare in the total order that puts nans last (`a < b`, or
`b` is nan and `a` is not), half types widened to f32; -0.0 and 0.0 are equal. Integer keys
compare signed; bool data moves as numpy's bytes (0 or 1).

Rows: one `scf.forall` chunk of rows per core when there are enough elements, else a single chunk
(the forall folds away). Each row is an `extract_slice` of the chunk, sorted in place and inserted
back, so bufferization writes into the result buffer directly; the scratch rows are one more
`shared_outs` tensor per operand.
"""

from __future__ import annotations

import math

from flowjit.backends.cpu import schedule
from flowjit.backends.cpu.target import lowering
from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder, memory_elem_type
from flowjit.backends.mlir.lower_elementwise import reshape_tensor
from flowjit.backends.mlir.lowering import bool_from_bytes, bool_to_bytes
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType

# A row at least this long sorted by one thread (one row, or fewer rows than cores) splits each
# merge pass's pairs of runs over the cores.
SPLIT_PASSES_MIN_ROW = 1 << 15


def _tensor(shape: tuple[int, ...], elem: str) -> str:
    return f"tensor<{''.join(f'{d}x' for d in shape)}{elem}>"


@lowering("sort")
def lower_sort(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """sort(keys, *payloads) along `axis` (see the module docstring)."""
    types = [v.type for v in op.operands]
    keys = types[0]
    axis = op.attrs["axis"] % keys.rank
    n = keys.shape[axis]
    if keys.size == 0 or n == 1:
        return list(operands)
    elems = [memory_elem_type(t.dtype) for t in types]
    data = [bool_to_bytes(em, x, t) if t.dtype.is_bool else x for x, t in zip(operands, types)]
    perm = [d for d in range(keys.rank) if d != axis] + [axis]
    moved_shape = tuple(keys.shape[d] for d in perm)
    if axis != keys.rank - 1:
        data = [_permute(em, x, keys.shape, perm, e) for x, e in zip(data, elems)]
    rows = keys.size // n
    flat = [
        reshape_tensor(em, x, TensorType(moved_shape, t.dtype), TensorType((rows, n), t.dtype), e)
        for x, t, e in zip(data, types, elems)
    ]
    parallel = schedule.threads() > 1 and rows > 1 and keys.size * max(1, math.ceil(math.log2(n))) >= (1 << 16)
    chunks = min(rows, schedule.threads()) if parallel else 1
    # One long row (or too few rows for the cores): each merge pass splits its pairs over the cores.
    split = schedule.threads() > 1 and chunks < schedule.threads() and n >= SPLIT_PASSES_MIN_ROW
    done = _SortKernel(em, types[0].dtype, elems, rows, n, split).emit(flat, chunks)
    em.kernel_kinds.add("sort")  # its merge loop stays branch-free (`toolchain.codegen_settings`)
    results = []
    inverse = [perm.index(d) for d in range(keys.rank)]
    for x, t, e in zip(done, types, elems):
        x = reshape_tensor(em, x, TensorType((rows, n), t.dtype), TensorType(moved_shape, t.dtype), e)
        if axis != keys.rank - 1:
            x = _permute(em, x, moved_shape, inverse, e)
        results.append(bool_from_bytes(em, x, t) if t.dtype.is_bool else x)
    return results


def _permute(em: KernelEmitter, x: str, shape: tuple[int, ...], perm: list[int], elem: str) -> str:
    """x transposed: result dim i is operand dim perm[i] (one copying `linalg.generic`)."""
    rank = len(shape)
    out_shape = tuple(shape[p] for p in perm)
    dims = [f"d{i}" for i in range(rank)]
    # Iterate over the result; the operand index of result position (d0..dk) puts d_i at perm[i].
    source = [""] * rank
    for i, p in enumerate(perm):
        source[p] = dims[i]
    in_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(source)})")
    init = em.op(f"tensor.empty() : {_tensor(out_shape, elem)}")
    return em.generic(
        [(x, _tensor(shape, elem))],
        (init, _tensor(out_shape, elem)),
        [in_map, em.identity_map(rank)],
        ["parallel"] * rank,
        lambda b, args: args[0],
        [elem],
        elem,
    )


class _SortKernel:
    """Emits the row loops and merge passes of one sort (see the module docstring)."""

    def __init__(
        self, em: KernelEmitter, key_dtype: dt.DType, elems: list[str], rows: int, n: int, split_passes: bool = False
    ):
        self.em = em
        self.split_passes = split_passes
        self.key_dtype = key_dtype
        self.elems = elems
        self.rows = rows
        self.n = n

    def index(self, value: int) -> str:
        # Emitted at each use (canonicalize hoists and merges them): a cached one could sit inside
        # a loop body that does not dominate a later use.
        return self.em.op(f"arith.constant {value} : index")

    def emit(self, flat: list[str], chunks: int) -> list[str]:
        """The sorted (rows, n) tensors: a forall over `chunks` chunks of rows, a loop over each
        chunk's rows, the merge passes of each row."""
        em, rows, n = self.em, self.rows, self.n
        full = [_tensor((rows, n), e) for e in self.elems]
        outs = [em.op(f"tensor.empty() : {t}") for t in full]
        scratch = [em.op(f"tensor.empty() : {t}") for t in full]
        chunk = -(-rows // chunks)
        parts = [_tensor(("?", n), e) for e in self.elems] * 2

        def window(t: str):
            first = em.op(f"arith.muli {t}, {self.index(chunk)} : index")
            left = em.op(f"arith.subi {self.index(rows)}, {first} : index")
            count = em.op(f"arith.minsi {left}, {self.index(chunk)} : index")
            return f"[{first}, 0]", f"[{count}, {n}]", "[1, 1]", (first, count)

        def sort_rows(bounds: tuple[str, str], sliced: list[str]) -> list[str]:
            first, count = bounds
            loop, row = em.fresh(), em.fresh("r")
            carried = [em.fresh("c") for _ in sliced]
            init = ", ".join(f"{c} = {v}" for c, v in zip(carried, sliced))
            em.line(
                f"{loop}:{len(carried)} = scf.for {row} = {self.index(0)} to {count} step {self.index(1)} "
                f"iter_args({init}) -> ({', '.join(parts)}) {{"
            )
            em.indent += "  "
            source_row = em.op(f"arith.addi {first}, {row} : index")
            sources = [self._row(x, f, source_row, e) for x, f, e in zip(flat, full, self.elems)]
            row_results, row_scratch = self._sort_row(
                sources,
                [self._row(c, p, row, e) for c, p, e in zip(carried[: len(full)], parts, self.elems)],
                [self._row(c, p, row, e) for c, p, e in zip(carried[len(full) :], parts, self.elems)],
            )
            yielded = [
                self._insert(r, c, p, row, e)
                for r, c, p, e in zip(row_results + row_scratch, carried, parts, self.elems + self.elems)
            ]
            em.line(f"scf.yield {', '.join(yielded)} : {', '.join(parts)}")
            em.indent = em.indent[:-2]
            em.line("}")
            return [f"{loop}#{i}" for i in range(len(carried))]

        done = self._in_parallel(-(-rows // chunk), outs + scratch, full + full, parts, window, sort_rows)
        return done[: len(full)]

    def _in_parallel(self, threads: int, dest: list[str], types: list[str], part_types: list[str], window, body):
        """An `scf.forall` of `threads` over the tensors `dest` (of `types`), each thread on its own
        part of them: `window(t)` emits the thread's (offsets, sizes, strides, bounds),
        `body(bounds, parts)` the parts' new values, which are inserted back. Returns the tensors
        after it."""
        em = self.em
        done, t = em.fresh(), em.fresh("t")
        shared = [em.fresh("o") for _ in dest]
        bindings = ", ".join(f"{o} = {d}" for o, d in zip(shared, dest))
        em.line(
            f"{done}:{len(dest)} = scf.forall ({t}) in ({threads}) shared_outs({bindings}) -> ({', '.join(types)}) {{"
        )
        em.indent += "  "
        offsets, sizes, strides, bounds = window(t)
        parts = [
            em.op(f"tensor.extract_slice {o}{offsets} {sizes} {strides} : {r} to {p}")
            for o, r, p in zip(shared, types, part_types)
        ]
        merged = body(bounds, parts)
        em.line("scf.forall.in_parallel {")
        for m, o, r, p in zip(merged, shared, types, part_types):
            em.line(f"  tensor.parallel_insert_slice {m} into {o}{offsets} {sizes} {strides} : {p} into {r}")
        em.line("}")
        em.indent = em.indent[:-2]
        em.line("}")
        return [f"{done}#{i}" for i in range(len(dest))]

    def _row(self, x: str, ttype: str, row: str, elem: str) -> str:
        return self.em.op(
            f"tensor.extract_slice {x}[{row}, 0] [1, {self.n}] [1, 1] : {ttype} to {_tensor((self.n,), elem)}"
        )

    def _insert(self, row_value: str, into: str, ttype: str, row: str, elem: str) -> str:
        return self.em.op(
            f"tensor.insert_slice {row_value} into {into}[{row}, 0] [1, {self.n}] [1, 1] : "
            f"{_tensor((self.n,), elem)} into {ttype}"
        )

    def _sort_row(self, sources: list[str], results: list[str], scratch: list[str]) -> tuple[list[str], list[str]]:
        """The merge passes of one row: returns the (result, scratch) row tensors after them. The
        first pass (two when their number is even) reads the source row and lands in the result;
        then an `scf.for` runs the remaining passes in pairs, result -> scratch -> result, with run
        widths doubling at run time: four pass bodies for any n. (Unrolled, a million-element sort
        would have 20 of them, and their compile would be most of its first call.)"""
        em = self.em
        passes = math.ceil(math.log2(self.n))
        if passes % 2:
            results = self._merge_pass(sources, results, self.index(1))
        else:
            scratch = self._merge_pass(sources, scratch, self.index(1))
            results = self._merge_pass(scratch, results, self.index(2))
        pairs = (passes - (1 if passes % 2 else 2)) // 2
        if pairs == 0:
            return results, scratch
        row_types = [_tensor((self.n,), e) for e in self.elems]
        loop, q, width = em.fresh(), em.fresh("q"), em.fresh("w")
        kept, spare = [em.fresh("d") for _ in results], [em.fresh("d") for _ in scratch]
        init = ", ".join(
            [f"{width} = {self.index(2 if passes % 2 else 4)}"]
            + [f"{c} = {v}" for c, v in zip(kept + spare, results + scratch)]
        )
        types = ", ".join(["index"] + row_types + row_types)
        em.line(
            f"{loop}:{1 + 2 * len(results)} = scf.for {q} = {self.index(0)} to {self.index(pairs)} "
            f"step {self.index(1)} iter_args({init}) -> ({types}) {{"
        )
        em.indent += "  "
        into_scratch = self._merge_pass(kept, spare, width)
        double = em.op(f"arith.muli {width}, {self.index(2)} : index")
        into_result = self._merge_pass(into_scratch, kept, double)
        next_width = em.op(f"arith.muli {width}, {self.index(4)} : index")
        em.line(f"scf.yield {', '.join([next_width] + into_result + into_scratch)} : {types}")
        em.indent = em.indent[:-2]
        em.line("}")
        k = len(results)
        return [f"{loop}#{1 + m}" for m in range(k)], [f"{loop}#{1 + k + m}" for m in range(k)]

    def _merge_pass(self, source: list[str], dest: list[str], width: str) -> list[str]:
        """Merge adjacent runs of `width` (an index value) of `source` into `dest` (one row per
        operand). A long row sorted alone (`split_passes`) has each pass's pairs of runs split over
        the cores: each thread merges its pairs into its own part of `dest`."""
        em, n = self.em, self.n
        row_types = self._source_types()
        span = em.op(f"arith.muli {width}, {self.index(2)} : index")
        pairs = em.op(f"arith.ceildivui {self.index(n)}, {span} : index")
        if not self.split_passes:
            return self._merge_pairs(source, dest, row_types, width, span, self.index(0), pairs, None)
        threads = schedule.threads()
        part_types = [_tensor(("?",), e) for e in self.elems]

        def window(t: str):
            per = em.op(f"arith.ceildivui {pairs}, {self.index(threads)} : index")
            first = em.op(f"arith.minui {em.op(f'arith.muli {t}, {per} : index')}, {pairs} : index")
            last = em.op(f"arith.minui {em.op(f'arith.addi {first}, {per} : index')}, {pairs} : index")
            start = em.op(f"arith.minui {em.op(f'arith.muli {first}, {span} : index')}, {self.index(n)} : index")
            end = em.op(f"arith.minui {em.op(f'arith.muli {last}, {span} : index')}, {self.index(n)} : index")
            return f"[{start}]", f"[{em.op(f'arith.subi {end}, {start} : index')}]", "[1]", (first, last, start)

        def merge(bounds: tuple[str, str, str], parts: list[str]) -> list[str]:
            first, last, start = bounds
            return self._merge_pairs(source, parts, part_types, width, span, first, last, start)

        return self._in_parallel(threads, dest, row_types, part_types, window, merge)

    def _merge_pairs(self, source, dest, dest_types, width, span, first, last, base) -> list[str]:
        """The pairs of runs `first` to `last` (index values) merged into `dest` (rows from
        position `base` of the row, or whole rows when it is None)."""
        em, n = self.em, self.n
        outer, pair = em.fresh(), em.fresh("p")
        carried = [em.fresh("d") for _ in dest]
        init = ", ".join(f"{c} = {d}" for c, d in zip(carried, dest))
        results = f"{outer}:{len(dest)}" if len(dest) > 1 else outer
        em.line(
            f"{results} = scf.for {pair} = {first} to {last} step {self.index(1)} "
            f"iter_args({init}) -> ({', '.join(dest_types)}) {{"
        )
        em.indent += "  "
        lo = em.op(f"arith.muli {pair}, {span} : index")
        mid = em.op(f"arith.minsi {em.op(f'arith.addi {lo}, {width} : index')}, {self.index(n)} : index")
        hi = em.op(f"arith.minsi {em.op(f'arith.addi {lo}, {span} : index')}, {self.index(n)} : index")
        merged = self._merge(source, carried, dest_types, lo, mid, hi, base)
        em.line(f"scf.yield {', '.join(merged)} : {', '.join(dest_types)}")
        em.indent = em.indent[:-2]
        em.line("}")
        return [f"{outer}#{i}" for i in range(len(dest))] if len(dest) > 1 else [outer]

    def _merge(self, source, dest, row_types, lo, mid, hi, base=None) -> list[str]:
        """source[lo:mid] merged with source[mid:hi] into dest[lo:hi], from both ends at once: each
        iteration writes the next smallest element at the front and the next largest at the back
        (two independent dependency chains, which the latency-bound loop needs), then an odd
        length takes one more front step. The merged order is unique (ties: left run first), so the
        two halves agree. `row_types`: the types of the `dest` rows, which start at position `base`
        of the row (a thread's part, `_merge_pass`) when it is given."""
        em = self.em
        half = em.op(f"arith.divui {em.op(f'arith.subi {hi}, {lo} : index')}, {self.index(2)} : index")
        rows = ", ".join(row_types)
        loop, k = em.fresh(), em.fresh("k")
        i, j, i_back, j_back = em.fresh("i"), em.fresh("j"), em.fresh("i"), em.fresh("j")
        carried = [em.fresh("d") for _ in dest]
        starts = [f"{i} = {lo}", f"{j} = {mid}"]
        starts += [f"{i_back} = {em.op(f'arith.subi {mid}, {self.index(1)} : index')}"]
        starts += [f"{j_back} = {em.op(f'arith.subi {hi}, {self.index(1)} : index')}"]
        init = ", ".join(starts + [f"{c} = {d}" for c, d in zip(carried, dest)])
        em.line(
            f"{loop}:{4 + len(dest)} = scf.for {k} = {self.index(0)} to {half} step {self.index(1)} "
            f"iter_args({init}) -> (index, index, index, index, {rows}) {{"
        )
        em.indent += "  "
        front = em.op(f"arith.addi {lo}, {k} : index")
        next_i, next_j, written = self._front_step(source, carried, row_types, front, i, j, mid, hi, base)
        back = em.op(f"arith.subi {em.op(f'arith.subi {hi}, {self.index(1)} : index')}, {k} : index")
        next_ib, next_jb, written = self._back_step(source, written, row_types, back, i_back, j_back, lo, mid, base)
        em.line(
            f"scf.yield {next_i}, {next_j}, {next_ib}, {next_jb}, {', '.join(written)} : "
            f"index, index, index, index, {rows}"
        )
        em.indent = em.indent[:-2]
        em.line("}")
        # An odd length leaves the middle element: one more front step (a loop of 0 or 1 trips).
        first_left = em.op(f"arith.addi {lo}, {half} : index")
        last_left = em.op(f"arith.subi {hi}, {half} : index")
        tail, position = em.fresh(), em.fresh("k")
        ti, tj = em.fresh("i"), em.fresh("j")
        tail_carried = [em.fresh("d") for _ in dest]
        init = ", ".join(
            [f"{ti} = {loop}#0", f"{tj} = {loop}#1"] + [f"{c} = {loop}#{4 + m}" for m, c in enumerate(tail_carried)]
        )
        em.line(
            f"{tail}:{2 + len(dest)} = scf.for {position} = {first_left} to {last_left} step {self.index(1)} "
            f"iter_args({init}) -> (index, index, {rows}) {{"
        )
        em.indent += "  "
        next_i, next_j, written = self._front_step(source, tail_carried, row_types, position, ti, tj, mid, hi, base)
        em.line(f"scf.yield {next_i}, {next_j}, {', '.join(written)} : index, index, {rows}")
        em.indent = em.indent[:-2]
        em.line("}")
        return [f"{tail}#{2 + m}" for m in range(len(dest))]

    def _pick(self, source, dest, row_types, at, base, take_b, a_read, b_read) -> list[str]:
        """dest[at - base] = source[b_read if take_b else a_read], for every operand."""
        em = self.em
        position = em.op(f"arith.select {take_b}, {b_read}, {a_read} : index")
        if base is not None:
            at = em.op(f"arith.subi {at}, {base} : index")
        written = []
        for x, d, t, row in zip(source, dest, row_types, self._source_types()):
            value = em.op(f"tensor.extract {x}[{position}] : {row}")
            written.append(em.op(f"tensor.insert {value} into {d}[{at}] : {t}"))
        return written

    def _source_types(self) -> list[str]:
        return [_tensor((self.n,), e) for e in self.elems]

    def _key_less(self, source, row_type, x_read, y_read) -> str:
        """key[x_read] < key[y_read] in the sort's order."""
        em = self.em
        x = em.op(f"tensor.extract {source[0]}[{x_read}] : {row_type}")
        y = em.op(f"tensor.extract {source[0]}[{y_read}] : {row_type}")
        b = ScalarBuilder(em, em.indent)
        less = _less(b, x, y, self.elems[0], self.key_dtype)
        em.body.extend(b.lines)
        return less

    def _step(self, taken: str) -> str:
        return self.em.op(f"arith.index_cast {self.em.op(f'arith.extui {taken} : i1 to i64')} : i64 to index")

    def _front_step(self, source, dest, row_types, at, i, j, mid, hi, base=None):
        """The smallest remaining element to dest[at]: the right run's head only if strictly
        smaller than the left's (stable), or if the left run is used up."""
        em = self.em
        last = self.index(self.n - 1)
        i_read = em.op(f"arith.minsi {i}, {last} : index")  # a used-up run's head may be n: stay inside
        j_read = em.op(f"arith.minsi {j}, {last} : index")
        left_done = em.op(f"arith.cmpi sge, {i}, {mid} : index")
        right_open = em.op(f"arith.cmpi slt, {j}, {hi} : index")
        smaller = self._key_less(source, self._source_types()[0], j_read, i_read)
        take_right = em.op(f"arith.andi {right_open}, {em.op(f'arith.ori {left_done}, {smaller} : i1')} : i1")
        written = self._pick(source, dest, row_types, at, base, take_right, i_read, j_read)
        step = self._step(take_right)
        next_i = em.op(f"arith.addi {i}, {em.op(f'arith.subi {self.index(1)}, {step} : index')} : index")
        return next_i, em.op(f"arith.addi {j}, {step} : index"), written

    def _back_step(self, source, dest, row_types, at, i, j, lo, mid, base=None):
        """The largest remaining element to dest[at]: the left run's tail only if strictly larger
        than the right's (equal keys: the right one is later), or if the right run is used up."""
        em = self.em
        zero = self.index(0)
        i_read = em.op(f"arith.maxsi {i}, {zero} : index")  # a used-up run's tail may be -1: stay inside
        j_read = em.op(f"arith.maxsi {j}, {zero} : index")
        right_done = em.op(f"arith.cmpi slt, {j}, {mid} : index")
        left_open = em.op(f"arith.cmpi sge, {i}, {lo} : index")
        larger = self._key_less(source, self._source_types()[0], j_read, i_read)
        take_left = em.op(f"arith.andi {left_open}, {em.op(f'arith.ori {right_done}, {larger} : i1')} : i1")
        written = self._pick(source, dest, row_types, at, base, take_left, j_read, i_read)
        step = self._step(take_left)
        next_j = em.op(f"arith.subi {j}, {em.op(f'arith.subi {self.index(1)}, {step} : index')} : index")
        return em.op(f"arith.subi {i}, {step} : index"), next_j, written


def _less(b: ScalarBuilder, x: str, y: str, elem: str, dtype: dt.DType) -> str:
    """x < y in the sort's order: signed for integers (and bool bytes), nans last for floats."""
    if not dtype.is_float:
        return b.op(f"arith.cmpi slt, {x}, {y} : {elem}")
    if elem in ("f16", "bf16"):
        x, y = b.op(f"arith.extf {x} : {elem} to f32"), b.op(f"arith.extf {y} : {elem} to f32")
        elem = "f32"
    ordered_less = b.op(f"arith.cmpf olt, {x}, {y} : {elem}")
    y_nan = b.op(f"arith.cmpf uno, {y}, {y} : {elem}")
    x_number = b.op(f"arith.cmpf ord, {x}, {x} : {elem}")
    return b.op(f"arith.ori {ordered_less}, {b.op(f'arith.andi {y_nan}, {x_number} : i1')} : i1")
