"""The JIT's transpose library: a (K, N) float32/float64 matrix with fewer columns than a vector
transposed to (N, K), for any K and N, compiled once per machine (`library.py`), which products
with few columns (`lower_dot._lower_with_dot_blocks`: the CNN's dense layer, a classifier's
logits) call to make B^T instead of compiling the transpose into the program.

    void fj_transpose_narrow_f32(const float *b, float *out, int64_t k, int64_t n, int64_t threads);
    and f64 alike. out[j, i] = b[i, j] for i < k, j < n; 1 <= n <= the vector's lanes.

How: blocks of `lanes` rows of B, each row one read masked to its n columns (contiguous), the block
transposed in registers (`matmul_packing._transpose_square`, log2(lanes) stages of two-source
shuffles) and written as n vectors of the output's rows; whole blocks split over `threads` cores,
the rows left over (K no multiple of the vector) read and written under masks on the calling
thread. Nothing is read or written outside either matrix.

Why: without it the program gathers down B's columns (two 8-lane `vgatherqps` per vector, about 13
cycles each on Zen 4), a visible share of the CNN forward's time, or compiles the block transpose
itself, which adds about 15 ms to the CNN's first call on a 2-core AMD EPYC Zen 4 VM.
docs/cpu-kernels.md ("Narrow and small products") has the measurements.

`FLOWJIT_TRANSPOSE_LIBRARY=0` turns it off (the program then gathers); AOT libraries keep the
compiled gathers (`library.disabled`).
"""

from __future__ import annotations

from flowjit.backends.cpu import host, library, matmul_packing
from flowjit.backends.cpu.library import Writer

ELEMS = ("f32", "f64")


def symbol(elem: str) -> str:
    return f"fj_transpose_narrow_{elem}"


def symbols() -> list[str]:
    return [symbol(elem) for elem in ELEMS]


class _TransposeKernel:
    """The library function for one element type."""

    def __init__(self, elem: str):
        self.elem = elem
        self.lanes = host.vector_bits() // int(elem[1:])
        self.vec = f"vector<{self.lanes}x{elem}>"
        self.mask = f"vector<{self.lanes}xi1>"
        self.flat = f"memref<?x{elem}>"
        self.w = Writer()
        self.zero = self.w.entry(f"arith.constant dense<0.0> : {self.vec}")

    def text(self) -> str:
        w, e, lanes = self.w, self.elem, self.lanes
        one = f"memref<1x{e}>"
        size = w.arith("muli", "%k", "%n")
        cast = f"offset: [0], sizes: [{size}], strides: [1] : {one} to {self.flat}"
        self.b = w.op(f"memref.reinterpret_cast %b0 to {cast}")
        self.out = w.op(f"memref.reinterpret_cast %out0 to {cast}")
        columns = w.op(f"vector.create_mask %n : {self.mask}")
        whole = w.arith("divui", "%k", lanes)
        _, lo, hi = w.chunks(whole, w.arith("ceildivui", whole, "%threads"))
        v = w.fresh("blk")
        w.open(f"scf.for {v} = {lo} to {hi} step {w.index(1)}")
        self.block(w.arith("muli", v, lanes), [columns] * lanes, None)
        w.close()
        w.close()
        rest = w.arith("remui", "%k", lanes)
        w.open(f"scf.if {w.op(f'arith.cmpi ugt, {rest}, {w.index(0)} : index')}")
        none = w.op(f"vector.constant_mask [0] : {self.mask}")
        inside = [w.op(f"arith.cmpi ult, {w.index(i)}, {rest} : index") for i in range(lanes)]
        rows = [w.op(f"arith.select {row}, {columns}, {none} : {self.mask}") for row in inside]
        self.block(w.arith("muli", whole, lanes), rows, w.op(f"vector.create_mask {rest} : {self.mask}"))
        w.close()
        w.line("return")
        args = [f"%b0: {one}", f"%out0: {one}"] + [f"%{name}: index" for name in ("k", "n", "threads")]
        return w.function(symbol(e), args)

    def block(self, first: str, row_masks: list[str], stored: str | None) -> None:
        """B's rows [first, first + lanes) (row i read under `row_masks[i]`) into the output's
        columns from `first` on, each of its n rows stored whole, or under `stored`."""
        w = self.w
        rows = []
        for i, mask in enumerate(row_masks):
            at = w.arith("muli", w.arith("addi", first, i), "%n")
            types = f"{self.flat}, {self.mask}, {self.vec} into {self.vec}"
            rows.append(w.op(f"vector.maskedload {self.b}[{at}], {mask}, {self.zero} : {types}"))
        for j, column in enumerate(matmul_packing._transpose_square(w, rows, self.vec)):
            at = w.arith("addi", w.arith("muli", w.index(j), "%k"), first)
            if stored is None:
                store = f"vector.store {column}, {self.out}[{at}] : {self.flat}, {self.vec}"
            else:
                types = f"{self.flat}, {self.mask}, {self.vec}"
                store = f"vector.maskedstore {self.out}[{at}], {stored}, {column} : {types}"
            if j == 0:  # n >= 1
                w.line(store)
                continue
            w.open(f"scf.if {w.op(f'arith.cmpi ult, {w.index(j)}, %n : index')}")
            w.line(store)
            w.close()


def library_mlir() -> str:
    """The library module's MLIR: one function per element type."""
    return "module {\n" + "\n".join(_TransposeKernel(elem).text() for elem in ELEMS) + "\n}\n"


def enabled() -> bool:
    """False with `FLOWJIT_TRANSPOSE_LIBRARY=0`, or inside `library.disabled()` (AOT compiles)."""
    return LIBRARY.enabled()


LIBRARY = library.Library(
    "transpose", library_mlir, symbols, strength_reduction=False, switch="FLOWJIT_TRANSPOSE_LIBRARY"
)


def emit(em, b: tuple[str, str], out: tuple[str, str], elem: str, k: int, n: int, threads: int) -> None:
    """A call transposing the (k, n) memref `b` = (name, type) into the (n, k) memref `out`."""
    note = f"B^T: calls the transpose library's @{symbol(elem)} (precompiled: transpose_library.py)"
    one = f"memref<1x{elem}>"
    sizes = [(k, "index"), (n, "index"), (threads, "index")]
    library.emit_call(em, symbol(elem), note, [(*b, one), (*out, one)], sizes)
