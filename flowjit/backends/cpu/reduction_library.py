"""The JIT's reduction library: the sum, max or min of all the elements of a float32/float64 array,
for any length, compiled once per machine (`library.py`), which a program's whole-array reductions
call instead of compiling a kernel for their length.

    void fj_reduce_sum_f32(const float *x, float *out, int64_t n, int64_t chunks, int64_t vectors,
                           int64_t threads);
    and max, min, f64 alike. *out = the reduction of x[0:n].

Why: compiled into the program, one reduction kernel is most of a function's first call: `x.sum()`
over 64M floats spends about 18 of its 27-33 ms compiling it, on a 2-core AMD EPYC Zen 4 VM.

What they compute: the compiled kernel's reduction (`schedule._full_reduction`), in its order, so
the results are bit-identical: below `schedule.PARALLEL_MIN_ELEMENTS` (chunks = 0) one pass with
four vector accumulators (element j in lane j mod 4 x lanes, the partial last chunk masked, the
accumulators combined (0 + 2) + (1 + 3), then across lanes as a tree, then with the identity);
above, `chunks` equal contiguous pieces (the last ones shorter or empty), each reduced so with
`vectors` accumulators (one when the array streams from memory), split over `threads` cores, and
the pieces' results combined a vector at a time in order.

Which reductions call it: `match` (reduce_sum, reduce_max, reduce_min over every axis of a float32
or float64 operand with a buffer), through the call lowering this module registers for them.
`FLOWJIT_REDUCTION_LIBRARY=0` turns it off; AOT libraries keep their kernels (`library.disabled`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flowjit.backends.cpu import host, library, schedule
from flowjit.backends.cpu.library import Writer
from flowjit.backends.cpu.target import CALL_LOWERINGS
from flowjit.backends.mlir.emitter import elem_type, scalar_literal
from flowjit.backends.mlir.lowering import call_lowering
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op

KINDS = {
    "sum": ("addf", "add", 0.0),
    "max": ("maximumf", "maximumf", float("-inf")),
    "min": ("minimumf", "minimumf", float("inf")),
}
ELEMS = {"f32": dt.float32, "f64": dt.float64}


def symbol(kind: str, elem: str) -> str:
    return f"fj_reduce_{kind}_{elem}"


def symbols() -> list[str]:
    return [symbol(kind, elem) for kind in KINDS for elem in ELEMS]


class _ReductionKernel:
    """The library function for one reduction and element type."""

    def __init__(self, kind: str, elem: str):
        self.kind, self.elem = kind, elem
        self.combine_op, self.vector_kind, identity = KINDS[kind]
        self.vl = host.vector_bits() // int(elem[1:])
        self.vec = f"vector<{self.vl}x{elem}>"
        self.mask = f"vector<{self.vl}xi1>"
        self.w = Writer()
        literal = scalar_literal(identity, ELEMS[elem])
        self.identity = self.w.entry(f"arith.constant {literal} : {elem}")
        self.splat = self.w.entry(f"arith.constant dense<{literal}> : {self.vec}")

    def text(self) -> str:
        w, e = self.w, self.elem
        one = f"memref<1x{e}>"
        self.x = w.op(f"memref.reinterpret_cast %x0 to offset: [0], sizes: [%n], strides: [1] : {one} to memref<?x{e}>")
        serial = w.op(f"arith.cmpi eq, %chunks, {w.index(0)} : index")
        result = w.if_else(serial, e, lambda: self.pass_over(w.index(0), "%n", 4), self.in_chunks)
        w.line(f"memref.store {result}, %out[{w.index(0)}] : {one}")
        w.line("return")
        args = [f"%x0: {one}", f"%out: {one}"] + [f"%{n}: index" for n in ("n", "chunks", "vectors", "threads")]
        return w.function(symbol(self.kind, e), args)

    def in_chunks(self) -> str:
        """The reduction of `%chunks` equal pieces, the pieces over the cores, their results
        combined a vector at a time."""
        w, e = self.w, self.elem
        partials = w.op(f"memref.alloca(%chunks) : memref<?x{e}>")
        size = w.arith("ceildivui", "%n", "%chunks")
        _, lo, hi = w.chunks("%chunks", w.arith("ceildivui", "%chunks", "%threads"))
        c = w.fresh("c")
        w.open(f"scf.for {c} = {lo} to {hi} step {w.index(1)}")
        start = w.op(f"arith.minui {w.arith('muli', c, size)}, %n : index")
        end = w.op(f"arith.minui {w.arith('addi', start, size)}, %n : index")
        one_vector = w.op(f"arith.cmpi eq, %vectors, {w.index(1)} : index")
        value = w.if_else(one_vector, e, lambda: self.pass_over(start, end, 1), lambda: self.pass_over(start, end, 4))
        w.line(f"memref.store {value}, {partials}[{c}] : memref<?x{e}>")
        w.close()
        w.close()
        acc = w.fresh("acc")
        k, a = w.fresh("k"), w.fresh("a")
        loop = f"scf.for {k} = {w.index(0)} to %chunks step {w.index(self.vl)}"
        w.open(f"{acc} = {loop} iter_args({a} = {self.splat}) -> ({self.vec})")
        lanes = w.op(f"arith.minui {w.arith('subi', '%chunks', k)}, {w.index(self.vl)} : index")
        v = self.masked_load(partials, k, w.op(f"vector.create_mask {lanes} : {self.mask}"))
        w.line(f"scf.yield {self.combine(v, a)} : {self.vec}")
        w.close()
        return w.op(f"vector.reduction <{self.vector_kind}>, {acc}, {self.identity} : {self.vec} into {e}")

    def pass_over(self, start: str, end: str, vectors: int) -> str:
        """The reduction of x[start:end] with `vectors` accumulators: whole chunks of that many
        vectors, then one masked chunk (the order of `row_library._RowKernel.sweep`, which runs a
        body per vector as well)."""
        w, e = self.w, self.elem
        width = vectors * self.vl
        length = w.arith("subi", end, start)
        whole = w.arith("addi", start, w.arith("muli", w.arith("divui", length, width), width))
        types = ", ".join([self.vec] * vectors)
        names = [w.fresh("a") for _ in range(vectors)]
        inits = ", ".join(f"{n} = {self.splat}" for n in names)
        j, loop = w.fresh("j"), w.fresh("accs")
        w.open(
            f"{loop}:{vectors} = scf.for {j} = {start} to {whole} step {w.index(width)} iter_args({inits}) -> ({types})"
        )
        new = []
        for u in range(vectors):
            col = w.arith("addi", j, u * self.vl)
            new.append(self.combine(w.op(f"vector.load {self.x}[{col}] : memref<?x{e}>, {self.vec}"), names[u]))
        w.line(f"scf.yield {', '.join(new)} : {types}")
        w.close()
        accs = [f"{loop}#{u}" for u in range(vectors)]
        rest = w.arith("subi", end, whole)
        tail = w.fresh("tail")
        w.open(f"{tail}:{vectors} = scf.if {w.op(f'arith.cmpi ugt, {rest}, {w.index(0)} : index')} -> ({types})")
        new = []
        for u in range(vectors):
            left = w.op(f"arith.maxsi {w.arith('subi', rest, u * self.vl)}, {w.index(0)} : index")
            lanes = w.op(f"arith.minsi {left}, {w.index(self.vl)} : index")
            mask = w.op(f"vector.create_mask {lanes} : {self.mask}")
            at = w.arith("addi", whole, u * self.vl)
            v = self.masked_load(self.x, at, mask)
            new.append(self.combine(v, accs[u]))
        w.line(f"scf.yield {', '.join(new)} : {types}")
        w.otherwise()
        w.line(f"scf.yield {', '.join(accs)} : {types}")
        w.close()
        accs = [f"{tail}#{u}" for u in range(vectors)]
        while len(accs) > 1:  # the halving of one wide accumulator: (0 + 2) + (1 + 3)
            half = len(accs) // 2
            accs = [self.combine(accs[u], accs[u + half]) for u in range(half)]
        return w.op(f"vector.reduction <{self.vector_kind}>, {accs[0]}, {self.identity} : {self.vec} into {e}")

    def masked_load(self, source: str, at: str, mask: str) -> str:
        """A vector of the 1-d `source` at `at`, the identity where `mask` is off (nothing read there)."""
        types = f"memref<?x{self.elem}>, {self.mask}, {self.vec} into {self.vec}"
        return self.w.op(f"vector.maskedload {source}[{at}], {mask}, {self.splat} : {types}")

    def combine(self, value: str, acc: str) -> str:
        """value (+) acc, in the compiled kernels' operand order (x86's nan-propagating max and min
        take the accumulator's dependency through one instruction fewer this way)."""
        return self.w.op(f"arith.{self.combine_op} {value}, {acc} : {self.vec}")


@functools.cache
def library_mlir() -> str:
    """The library module's MLIR: one function per reduction and element type."""
    kernels = [_ReductionKernel(kind, elem).text() for kind in KINDS for elem in ELEMS]
    return "module {\n" + "\n".join(kernels) + "\n}\n"


def enabled() -> bool:
    """False with `FLOWJIT_REDUCTION_LIBRARY=0`, or inside `library.disabled()` (AOT compiles)."""
    return LIBRARY.enabled()


LIBRARY = library.Library(
    "reduction", library_mlir, symbols, strength_reduction=False, switch="FLOWJIT_REDUCTION_LIBRARY"
)


@dataclass(frozen=True)
class ReductionCall:
    """A whole-array reduction as a call of the library: `kind` of `n` elements of `elem`."""

    kind: str
    elem: str
    n: int

    @property
    def symbol(self) -> str:
        return symbol(self.kind, self.elem)

    def plan(self) -> tuple[int, int, int]:
        """(chunks, vectors, threads): the compiled kernel's (`schedule.reduction` of a 1-d shape)."""
        parallel = self.n >= schedule.PARALLEL_MIN_ELEMENTS and schedule.threads() > 1
        if not parallel:
            return 0, schedule.FULL_REDUCTION_VECTORS, 1
        bits = int(self.elem[1:])
        streams = self.n * bits // 8 >= schedule.STREAMING_REDUCTION_MIN_BYTES
        vectors = 1 if streams else schedule.FULL_REDUCTION_VECTORS
        return schedule.FULL_REDUCTION_CHUNKS * schedule.FULL_REDUCTION_VECTORS // vectors, vectors, schedule.threads()

    def emit(self, em, x: tuple[str, str], out: tuple[str, str]) -> None:
        one = f"memref<1x{self.elem}>"
        note = f"{self.kind}: calls the reduction library's @{self.symbol} (precompiled: reduction_library.py)"
        scalars = [(value, "index") for value in (self.n, *self.plan())]
        library.emit_call(em, self.symbol, note, [(*x, one), (*out, one)], scalars)


def match(op: Op) -> ReductionCall | None:
    """How a reduce_sum/max/min calls the library, or None: over every axis of a non-empty float32
    or float64 operand (whose result is that type too)."""
    kind = op.name.removeprefix("reduce_")
    if kind not in KINDS or not op.operands or not enabled():
        return None
    source = op.operands[0].type
    elem = elem_type(source.dtype) if source.dtype in ELEMS.values() else None
    axes = sorted(a % max(source.rank, 1) for a in op.attrs.get("axes", ()))
    if elem is None or source.rank == 0 or source.size == 0 or op.result.type.dtype != source.dtype:
        return None
    if axes != list(range(source.rank)):
        return None
    return ReductionCall(kind, elem, source.size)


# A float32/float64 reduction of a whole array as a call of this library on its operand's and
# result's buffers; compiled otherwise (the shared `mlir/lower_reduction.py`).
for _name in ("reduce_sum", "reduce_max", "reduce_min"):
    CALL_LOWERINGS[_name] = call_lowering(match)
