"""The JIT's matmul library: shape-generic matrix products, compiled once per machine by our own MLIR
and LLVM pipelines, which a program's large products call instead of compiling a kernel for their
shapes.

    void fj_matmul_f32(const float *a, const float *b, float *c, void *scratch, int64_t m, int64_t n,
                       int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t threads);
    C[m, n] = A[m, k] @ B[k, n], row-major with leading dimensions lda, ldb, ldc; fj_matmul_f64 alike;
    the _bt functions take B as (n, k) (`a @ w.T`), the _at ones A as (k, m) (`x.T @ dz`).

Why: a function's first call is almost all compile time, and a product's specialized kernel
(`matmul_kernel.py`, static shapes throughout) is most of its module: matmul 1024's first call
spends about 45 of its 55-70 ms in MLIR and LLVM on a 2-core AMD EPYC Zen 4 VM
(`benchmarks/compile_time.py`), while JAX's XLA calls a precompiled Eigen kernel for the product.
With the library the program's module holds a call, which compiles in a few milliseconds.

The functions run the specialized kernel's algorithm with loop bounds in registers (`_Kernel`), so
each element is the same chain of multiply-adds and the results are bit-identical: C's whole panels
split over the cores, packed just in time (`matmul_plan._columns_in_parallel`), or, for products
too narrow or too short for that, C's rows split over the cores after every panel is packed
(`_rows_in_parallel`); MR-row register tiles, leftover rows as tiles of 8, 4, 2 and 1 rows; the
partial last panel masked; A restrided when its rows alias in L1, packed in blocks of MR columns
when given as (K, M) and re-read by 4 or more panels. docs/cpu-kernels.md ("Matmul library") has the
measurements.

Which products call it: `call_shape` (f32/f64 products the specialized kernel would split over the
cores and not stream, K >= 64; and every small one (`SMALL_FLOPS`), on one core
when the kernel would not fork: `call_threads`) and `lower_dot.library_call` (no batch, not
both operands transposed); in JIT-compiled code only (`library.disabled` for AOT). With one thread
a call runs in place (`library.Writer.chunks`: no OpenMP parallel region, whose fork would cost a
small product more than its arithmetic), as fast as the specialized kernel, with a first call a
third to half as long. `FLOWJIT_MATMUL_LIBRARY=0` turns it off. Where it lives, when it is built
and loaded: `library.py` (`matmul-<key>.o`, built once per machine in seconds, loaded in
milliseconds).
"""

from __future__ import annotations

import functools

from flowjit.backends.cpu import host, library, matmul_kernel, matmul_packing, matmul_plan

ELEMS = ("f32", "f64")
# A vector of a panel: loaded and stored whole, or past N (`_Kernel.pack`); otherwise its mask.
WHOLE, NONE = "whole", "none"


# Operand layouts, each its own function: B given as (N, K) (`a @ w.T`: packed from its rows,
# transposed in registers) and A given as (K, M) (`x.T @ dz`, weight gradients: its blocks of MR
# columns packed first, shared by the cores).
LAYOUTS = ("", "bt", "at")


# Products of at most this many multiply-adds (tens of microseconds on two cores) take the library
# even where the specialized kernel runs a little faster: short contractions (K < 64, where its
# shorter tiles are faster) and fused epilogues it would apply tile by tile (the library's
# product is written, then the epilogue makes the result), and those of one core's work (run in
# place: `call_threads`). Their specialized code costs 20-40 ms of compile each on a 2-core AMD
# EPYC Zen 4 VM (the MLP step's logits and the gradient of its last layer's input; attention's
# q @ k.T over 128 x 64), far more than it saves.
SMALL_FLOPS = 1 << 23


def symbol(elem: str, layout: str = "") -> str:
    return f"fj_matmul_{elem}{'_' + layout if layout else ''}"


def enabled() -> bool:
    """False with `FLOWJIT_MATMUL_LIBRARY=0`, or inside `library.disabled()` (AOT compiles)."""
    return LIBRARY.enabled()


def call_shape(m: int, n: int, k: int, elem: str, layout: str = "") -> bool:
    """Whether an (M, K) @ (K, N) product of `elem`, its operands laid out as `layout` says, calls
    the library: a tiled product (`worth_it`) not streamed, small (`SMALL_FLOPS`), or split over
    the cores (by columns or rows) with a contraction long enough for tall tiles."""
    if elem not in ELEMS or layout not in LAYOUTS or not enabled():
        return False
    shape = matmul_plan.MatmulShape(0, m, n, k, elem)
    if not matmul_plan.worth_it(0, m, n, k) or matmul_plan.streams_rows(shape):
        return False
    return small(m, n, k) or (matmul_plan._threads(shape) > 1 and k >= matmul_plan.TALL_TILE_MIN_K)


def call_threads(m: int, n: int, k: int, elem: str) -> int:
    """The cores a call splits its product over: the specialized kernel's choice (one for a small
    product, whose fork would cost more than it saves)."""
    return matmul_plan._threads(matmul_plan.MatmulShape(0, m, n, k, elem))


def small(m: int, n: int, k: int) -> bool:
    """Whether a product is small enough to take the library where the kernel runs a little faster
    (`SMALL_FLOPS`)."""
    return m * n * k <= SMALL_FLOPS


def threads() -> int:
    return host.cores()


def scratch_bytes(m: int, n: int, k: int, elem: str, layout: str = "") -> int:
    """Bytes of the scratch area a call uses (`_Kernel.text` lays it out): one panel per core
    (K rounded up to a vector, x NR), then A's restrided copy (when its rows alias,
    `matmul_plan.aliases`) or, A given as (K, M), its packed blocks of MR columns."""
    geometry = _Geometry(elem)
    by_columns = n // geometry.nr >= 2 * threads() and k >= matmul_plan.COLUMN_SPLIT_MIN_K
    count = threads() if by_columns else -(-n // geometry.nr)
    panels = count * _round_up(_round_up(k, geometry.vl) * geometry.nr * geometry.size, 64)
    if layout == "at" and -(-n // geometry.nr) >= matmul_plan.PACK_A_MIN_PANELS:
        blocks = -(-m // geometry.mr)
        return panels + _round_up(blocks * k * geometry.packed_width * geometry.size, 64)
    return panels + (matmul_plan.restrided_bytes(m, k, elem) if matmul_plan.aliases(k, elem) else 0)


class _Geometry:
    """Vector and register-tile sizes for `elem` on this host."""

    def __init__(self, elem: str):
        self.elem = elem
        self.size = int(elem[1:]) // 8
        self.vl = host.vector_bits() // int(elem[1:])
        self.nr = 2 * self.vl
        self.mr = matmul_plan.tile_rows(2)
        self.packed_width = _round_up(self.mr, self.vl)  # a packed block of A's columns, per k


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


class _Kernel(_Geometry):
    """The library function for one element type and operand layout."""

    def __init__(self, elem: str, layout: str):
        super().__init__(elem)
        self.layout = layout
        self.vec = f"vector<{self.vl}x{elem}>"
        self.mask = f"vector<{self.vl}xi1>"
        self.mat = f"memref<?x?x{elem}, strided<[?, 1]>>"
        self.panel = f"memref<?x{self.nr}x{elem}>"
        self.packed = f"memref<?x?x{self.packed_width}x{elem}>"
        self.packs_a = False  # while writing the product for A's packed blocks (`packed_a`)
        self.w = library.Writer()

    def text(self) -> str:
        w, e = self.w, self.elem
        one = f"memref<1x{e}>"
        a = self.matrix("%a0", ("%k", "%m") if self.layout == "at" else ("%m", "%k"), "%lda")
        b = self.matrix("%b0", ("%n", "%k") if self.layout == "bt" else ("%k", "%n"), "%ldb")
        c = self.matrix("%c0", ("%m", "%n"), "%ldc")
        # The scratch area (`scratch_bytes`): the panels (one per core when the cores split C's
        # columns, else all of them), then A's copy or packed blocks.
        k_rounded = w.arith("muli", w.arith("ceildivui", "%k", self.vl), self.vl)
        panel_bytes = w.arith("muli", k_rounded, self.nr * self.size)
        panel_bytes = w.arith("muli", w.arith("ceildivui", panel_bytes, 64), 64)
        wide = w.op(f"arith.cmpi uge, {w.arith('divui', '%n', self.nr)}, {w.arith('muli', '%threads', 2)} : index")
        deep = w.op(f"arith.cmpi uge, %k, {w.index(matmul_plan.COLUMN_SPLIT_MIN_K)} : index")
        by_columns = w.op(f"arith.andi {wide}, {deep} : i1")
        count = w.op(f"arith.select {by_columns}, %threads, {w.arith('ceildivui', '%n', self.nr)} : index")
        after = w.arith("muli", count, panel_bytes)
        sizes = f"sizes: [{self.big()}], strides: [1]"
        scratch = w.op(f"memref.reinterpret_cast %s0 to offset: [0], {sizes} : memref<1xi8> to memref<?xi8>")
        panels = (scratch, panel_bytes, k_rounded)
        if self.layout == "at":
            # A's blocks packed when enough panels read them (`matmul_plan.PACK_A_MIN_PANELS`), else
            # read in place, as the specialized kernel does.
            many = w.arith("ceildivui", "%n", self.nr)
            packs = w.op(f"arith.cmpi uge, {many}, {w.index(matmul_plan.PACK_A_MIN_PANELS)} : index")
            w.open(f"scf.if {packs}")
            self.packs_a = True
            self.product(self.packed_a(a, scratch, after), b, c, panels, by_columns)
            self.packs_a = False
            w.otherwise()
            self.product(self.in_place_a(a, True), b, c, panels, by_columns)
            w.close()
        else:
            self.product(self.in_place_a(self.restrided(a, scratch, after), False), b, c, panels, by_columns)
        w.line("return")
        args = [f"%a0: {one}", f"%b0: {one}", f"%c0: {one}", "%s0: memref<1xi8>"]
        args += [f"%{n}: index" for n in ("m", "n", "k", "lda", "ldb", "ldc", "threads")]
        return w.function(symbol(e, self.layout), args)

    def product(self, read_a, b: str, c: str, panels: tuple[str, str, str], by_columns: str) -> None:
        w = self.w
        w.open(f"scf.if {by_columns}")
        self.columns(read_a, b, c, panels)
        w.otherwise()
        self.row_chunks(read_a, b, c, panels)
        w.close()

    def big(self) -> str:
        # The scratch area's size as a memref bound (never used to index: views carry their own).
        return self.w.index(1 << 62)

    def matrix(self, pointer: str, sizes: tuple[str, str], ld: str) -> str:
        return self.w.op(
            f"memref.reinterpret_cast {pointer} to offset: [0], sizes: [{sizes[0]}, {sizes[1]}], strides: [{ld}, 1] "
            f": memref<1x{self.elem}> to {self.mat}"
        )

    def in_place_a(self, a: str, transposed: bool):
        """read(row start, r, k) = A[start + r, k], or At[k, start + r] for A given as (K, M)."""
        w = self.w

        def read(start: str, r: int, k: str) -> str:
            row = w.arith("addi", start, r)
            return w.op(f"memref.load {a}[{f'{k}, {row}' if transposed else f'{row}, {k}'}] : {self.mat}")

        return read

    def restrided(self, a: str, scratch: str, at: str) -> str:
        """A, or its copy with rows one cache line longer when A's rows alias in L1 (the specialized
        kernel's `restride`), split by rows over the cores."""
        w = self.w
        stride = w.arith("addi", "%lda", matmul_plan.CACHE_LINE // self.size)
        row_bytes = w.arith("muli", "%lda", self.size)
        offset = w.arith("remui", row_bytes, matmul_plan.ALIASING_STRIDE)
        aliased = w.op(f"arith.cmpi eq, {offset}, {w.index(0)} : index")
        tall = w.op(f"arith.cmpi uge, %m, {w.index(self.mr)} : index")
        copies = w.op(f"arith.andi {aliased}, {tall} : i1")
        elements = w.arith("muli", "%m", stride)
        flat = w.op(f"memref.view {scratch}[{at}][{elements}] : memref<?xi8> to memref<?x{self.elem}>")
        copy = w.op(
            f"memref.reinterpret_cast {flat} to offset: [0], sizes: [%m, %k], strides: [{stride}, 1] "
            f": memref<?x{self.elem}> to {self.mat}"
        )
        w.open(f"scf.if {copies}")
        _, r = self.split("%m", w.arith("ceildivui", "%m", "%threads"))
        self.copy_row(a, copy, r)
        w.close()
        w.close()
        w.close()
        return w.op(f"arith.select {copies}, {copy}, {a} : {self.mat}")

    def split(self, count: str, chunk: str) -> tuple[str, str]:
        """`chunks` and, inside, a loop over the core's chunk; returns (the core's index, the loop's
        index) (close both)."""
        w = self.w
        t, lo, hi = self.w.chunks(count, chunk)
        i = w.fresh()
        w.open(f"scf.for {i} = {lo} to {hi} step {w.index(1)}")
        return t, i

    def copy_row(self, a: str, copy: str, r: str) -> None:
        """copy[r, 0:K] = A[r, 0:K], a vector at a time, the tail masked."""
        w = self.w
        whole = w.arith("muli", w.arith("divui", "%k", self.vl), self.vl)
        col = w.fresh()
        w.open(f"scf.for {col} = {w.index(0)} to {whole} step {w.index(self.vl)}")
        v = w.op(f"vector.load {a}[{r}, {col}] : {self.mat}, {self.vec}")
        w.line(f"vector.store {v}, {copy}[{r}, {col}] : {self.mat}, {self.vec}")
        w.close()
        rest = w.arith("subi", "%k", whole)
        w.open(f"scf.if {w.op(f'arith.cmpi ugt, {rest}, {w.index(0)} : index')}")
        mask = w.op(f"vector.create_mask {rest} : {self.mask}")
        v = self.masked_load(a, f"[{r}, {whole}]", mask)
        w.line(f"vector.maskedstore {copy}[{r}, {whole}], {mask}, {v} : {self.mat}, {self.mask}, {self.vec}")
        w.close()

    def masked_load(self, source: str, at: str, mask: str) -> str:
        """A vector of the matrix `source` at `at`, zeros where `mask` is off (nothing read there)."""
        w = self.w
        zeros = w.op(f"arith.constant dense<0.0> : {self.vec}")
        types = f"{self.mat}, {self.mask}, {self.vec} into {self.vec}"
        return w.op(f"vector.maskedload {source}{at}, {mask}, {zeros} : {types}")

    def packed_a(self, a: str, scratch: str, at: str):
        """A given as (K, M): its blocks of MR columns packed as Ap[block, k, 0:MR] (zeros past M),
        split by blocks over the cores before any product (every core's panels read all of A), so
        that a tile reads MR contiguous elements per k instead of one line per k, M apart (all in
        one L1 set when M is a multiple of 1024). read(row start, r, k) = A's row start + r at k."""
        w = self.w
        blocks = w.arith("ceildivui", "%m", self.mr)
        packed = w.op(f"memref.view {scratch}[{at}][{blocks}, %k] : memref<?xi8> to {self.packed}")
        _, block = self.split(blocks, w.arith("ceildivui", blocks, "%threads"))
        first = w.arith("muli", block, self.mr)
        live = w.op(f"arith.minui {w.arith('subi', '%m', first)}, {w.index(self.mr)} : index")
        masks = []
        for q in range(self.packed_width // self.vl):
            past = w.op(f"arith.maxui {live}, {w.index(q * self.vl)} : index")  # lanes of vector q inside
            count = w.op(f"arith.minui {w.arith('subi', past, q * self.vl)}, {w.index(self.vl)} : index")
            masks.append(w.op(f"vector.create_mask {count} : {self.mask}"))
        k = w.fresh()
        w.open(f"scf.for {k} = {w.index(0)} to %k step {w.index(1)}")
        for q, mask in enumerate(masks):
            v = self.masked_load(a, f"[{k}, {w.arith('addi', first, q * self.vl)}]", mask)
            w.line(f"vector.store {v}, {packed}[{block}, {k}, {w.index(q * self.vl)}] : {self.packed}, {self.vec}")
        w.close()
        w.close()
        w.close()

        def read(start: str, r: int, k: str) -> str:
            block, within = w.arith("divui", start, self.mr), w.arith("remui", start, self.mr)
            return w.op(f"memref.load {packed}[{block}, {k}, {w.arith('addi', within, r)}] : {self.packed}")

        return read

    def columns(self, read_a, b: str, c: str, panels: tuple[str, str, str]) -> None:
        """C's whole panels split over the cores, each packed just in time into the core's own
        buffer, then the partial last panel on this thread (`panels`: the scratch area, a panel's
        bytes, its rows)."""
        w = self.w
        whole = w.arith("divui", "%n", self.nr)
        thread, p = self.split(whole, w.arith("ceildivui", whole, "%threads"))
        panel = self.panel_at(panels, thread)
        col = w.arith("muli", p, self.nr)
        self.pack(b, panel, col, [WHOLE, WHOLE])
        self.rows(read_a, panel, c, col, [WHOLE, WHOLE], (w.index(0), "%m"))
        w.close()
        w.close()
        panel = self.panel_at(panels, w.index(0))
        col = w.arith("muli", whole, self.nr)

        def last(states):
            self.pack(b, panel, col, states)
            self.rows(read_a, panel, c, col, states, (w.index(0), "%m"))

        self.partial_panel(last)

    def row_chunks(self, read_a, b: str, c: str, panels: tuple[str, str, str]) -> None:
        """C's rows split over the cores in equal chunks (narrow or short products: too few panels
        or too short a contraction to split by columns), after every panel is packed on this thread
        (as the specialized kernel does: for few panels a second fork costs more than packing
        them)."""
        w = self.w
        whole = w.arith("divui", "%n", self.nr)
        p = w.fresh()
        w.open(f"scf.for {p} = {w.index(0)} to {whole} step {w.index(1)}")
        self.pack(b, self.panel_at(panels, p), w.arith("muli", p, self.nr), [WHOLE, WHOLE])
        w.close()
        panel, col = self.panel_at(panels, whole), w.arith("muli", whole, self.nr)
        self.partial_panel(lambda states: self.pack(b, panel, col, states))
        # Equal chunks (a multiple of MR rows only for A's packed blocks, which a tile must not
        # straddle): in multiples of MR, (256, 1024) @ (1024, 10) would give one core 140 rows and
        # the other 116, slower than the specialized kernel (which picks a tile height that
        # divides 128).
        chunk = w.arith("ceildivui", "%m", "%threads")
        if self.packs_a:
            chunk = w.arith("muli", w.arith("ceildivui", chunk, self.mr), self.mr)
        _, lo, hi = self.w.chunks("%m", chunk)
        p = w.fresh()
        w.open(f"scf.for {p} = {w.index(0)} to {whole} step {w.index(1)}")
        col = w.arith("muli", p, self.nr)
        self.rows(read_a, self.panel_at(panels, p), c, col, [WHOLE, WHOLE], (lo, hi))
        w.close()
        panel = self.panel_at(panels, whole)
        col = w.arith("muli", whole, self.nr)
        self.partial_panel(lambda states: self.rows(read_a, panel, c, col, states, (lo, hi)))
        w.close()

    def panel_at(self, panels: tuple[str, str, str], index: str) -> str:
        """The `index`th panel buffer of the scratch area."""
        scratch, panel_bytes, k_rounded = panels
        at = self.w.arith("muli", index, panel_bytes)
        return self.w.op(f"memref.view {scratch}[{at}][{k_rounded}] : memref<?xi8> to {self.panel}")

    def partial_panel(self, body) -> None:
        """`body(states)` for C's partial last panel, if any: with at most one vector's worth of
        columns left the second vector is neither computed nor stored (half the multiply-adds);
        else the first is whole and the second masked."""
        w = self.w
        left = w.arith("subi", "%n", w.arith("muli", w.arith("divui", "%n", self.nr), self.nr))
        w.open(f"scf.if {w.op(f'arith.cmpi ugt, {left}, {w.index(0)} : index')}")
        w.open(f"scf.if {w.op(f'arith.cmpi ult, {left}, {w.index(self.vl)} : index')}")
        body([self.partial(left), NONE])
        w.otherwise()
        w.open(f"scf.if {w.op(f'arith.cmpi eq, {left}, {w.index(self.vl)} : index')}")
        body([WHOLE, NONE])  # one whole vector: no masks, which would slow N = 784 down
        w.otherwise()
        body([WHOLE, self.partial(w.arith("subi", left, self.vl))])
        w.close()
        w.close()
        w.close()

    def partial(self, count: str) -> tuple[str, str]:
        """The state of a panel vector with `count` columns inside C: (its mask, count)."""
        return (self.w.op(f"vector.create_mask {count} : {self.mask}"), count)

    def pack(self, b: str, panel: str, col: str, states: list) -> None:
        """panel[k, :] = B[k, col : col + NR], zeros past N; `states`, one per vector: `WHOLE`,
        `partial` (the partial last panel) or `NONE` (past N: not packed, never read)."""
        if self.layout == "bt":
            self.pack_rows(b, panel, col, states)
            return
        w = self.w
        k = w.fresh()
        w.open(f"scf.for {k} = {w.index(0)} to %k step {w.index(1)}")
        for v, state in enumerate(states):
            if state == NONE:
                continue
            at = f"[{k}, {w.arith('addi', col, v * self.vl)}]"
            if state == WHOLE:
                x = w.op(f"vector.load {b}{at} : {self.mat}, {self.vec}")
            else:
                x = self.masked_load(b, at, state[0])
            w.line(f"vector.store {x}, {panel}[{k}, {w.index(v * self.vl)}] : {self.panel}, {self.vec}")
        w.close()

    def pack_rows(self, b: str, panel: str, col: str, states: list) -> None:
        """`pack` for B given as (N, K): squares of a vector's rows x a vector of k, read along
        B's rows and transposed in registers (`matmul_packing._transpose_square`); the k tail's
        loads masked (the panel has K rounded up to a vector rows: the extra ones are zeros, never
        read), rows past N not read."""
        w = self.w
        whole = w.arith("muli", w.arith("divui", "%k", self.vl), self.vl)
        k = w.fresh()
        w.open(f"scf.for {k} = {w.index(0)} to {whole} step {w.index(self.vl)}")
        self.pack_square(b, panel, col, states, k, None)
        w.close()
        rest = w.arith("subi", "%k", whole)
        w.open(f"scf.if {w.op(f'arith.cmpi ugt, {rest}, {w.index(0)} : index')}")
        self.pack_square(b, panel, col, states, whole, rest)
        w.close()

    def pack_square(self, b: str, panel: str, col: str, states: list, k: str, k_count: str | None) -> None:
        w = self.w
        for v, state in enumerate(states):
            if state == NONE:
                continue
            rows = []
            for j in range(self.vl):
                at = f"[{w.arith('addi', col, v * self.vl + j)}, {k}]"
                if state == WHOLE and k_count is None:
                    rows.append(w.op(f"vector.load {b}{at} : {self.mat}, {self.vec}"))
                    continue
                length = k_count or w.index(self.vl)
                if state != WHOLE:  # row j of this vector lies past N: nothing read
                    inside = w.op(f"arith.cmpi ult, {w.index(j)}, {state[1]} : index")
                    length = w.op(f"arith.select {inside}, {length}, {w.index(0)} : index")
                rows.append(self.masked_load(b, at, w.op(f"vector.create_mask {length} : {self.mask}")))
            square = matmul_packing._transpose_square(w, rows, self.vec)
            for i, row in enumerate(square):
                where = f"[{w.arith('addi', k, i)}, {w.index(v * self.vl)}]"
                w.line(f"vector.store {row}, {panel}{where} : {self.panel}, {self.vec}")

    def rows(self, read_a, panel: str, c: str, col: str, states: list, bounds: tuple[str, str]) -> None:
        """Every block of MR rows in [lo, hi) times the panel, then the rows left over."""
        w = self.w
        lo, hi = bounds
        full = w.arith("addi", lo, w.arith("muli", w.arith("divui", w.arith("subi", hi, lo), self.mr), self.mr))
        i = w.fresh()
        w.open(f"scf.for {i} = {lo} to {full} step {w.index(self.mr)}")
        self.tile(read_a, panel, c, i, col, self.mr, states)
        w.close()
        # The rows left over (fewer than MR) as tiles of 8, 4, 2 and 1 rows, by the bits of their
        # count: four tiles' code instead of one per count (the specialized kernel writes the one
        # it needs); each row's multiply-adds are the same, so are the results.
        left = w.arith("subi", hi, full)
        size = 1 << (self.mr - 1).bit_length() - 1
        while size:
            if size < self.mr:
                has = w.op(f"arith.cmpi ne, {w.arith('andi', left, size)}, {w.index(0)} : index")
                w.open(f"scf.if {has}")
                start = w.arith("addi", full, w.arith("andi", left, ~(2 * size - 1)))
                self.tile(read_a, panel, c, start, col, size, states)
                w.close()
            size //= 2

    def tile(self, read_a, panel: str, c: str, i: str, col: str, mr: int, states: list) -> None:
        """The register tile of rows [i, i + mr) with the panel's vectors (`states`, see `pack`),
        stored into C."""
        w = self.w
        live = [v for v, state in enumerate(states) if state != NONE]
        zero = w.op(f"arith.constant dense<0.0> : {self.vec}")
        names = [w.fresh("c") for _ in range(len(live) * mr)]
        k = w.fresh()
        result = w.fresh("r")
        inits = ", ".join(f"{n} = {zero}" for n in names)
        types = ", ".join([self.vec] * len(names))
        count = f":{len(names)}" if len(names) > 1 else ""
        w.open(f"{result}{count} = scf.for {k} = {w.index(0)} to %k step {w.index(1)} iter_args({inits}) -> ({types})")
        b = [w.op(f"vector.load {panel}[{k}, {w.index(v * self.vl)}] : {self.panel}, {self.vec}") for v in live]
        new = []
        for r in range(mr):
            xb = w.op(f"vector.broadcast {read_a(i, r, k)} : {self.elem} to {self.vec}")
            for j in range(len(live)):
                new.append(w.op(f"vector.fma {xb}, {b[j]}, {names[len(live) * r + j]} : {self.vec}"))
        w.line(f"scf.yield {', '.join(new)} : {types}")
        w.close(f"}} {{{matmul_kernel.NO_UNROLL}}}")
        for r in range(mr):
            row = w.arith("addi", i, r)
            for j, v in enumerate(live):
                acc = f"{result}#{len(live) * r + j}" if len(names) > 1 else result
                at = f"[{row}, {w.arith('addi', col, v * self.vl)}]"
                if states[v] == WHOLE:
                    w.line(f"vector.store {acc}, {c}{at} : {self.mat}, {self.vec}")
                else:
                    w.line(f"vector.maskedstore {c}{at}, {states[v][0]}, {acc} : {self.mat}, {self.mask}, {self.vec}")


@functools.cache
def library_mlir() -> str:
    """The library module's MLIR: one function per element type and operand layout."""
    kernels = [_Kernel(elem, layout).text() for elem in ELEMS for layout in LAYOUTS]
    return "module {\n" + "\n".join(kernels) + "\n}\n"


def symbols() -> list[str]:
    return [symbol(elem, layout) for elem in ELEMS for layout in LAYOUTS]


# Built with loop strength reduction (`toolchain.codegen_options`): a tile's rows of A are a run-time
# stride apart, and without it LLVM keeps 14 row pointers, spills two and the loop bound, and
# reloads them every k, which makes the library slower than the specialized kernel; with it, 1024^3
# runs as fast.
LIBRARY = library.Library("matmul", library_mlir, symbols, strength_reduction=True, switch="FLOWJIT_MATMUL_LIBRARY")
