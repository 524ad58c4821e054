"""The JIT's row library: softmax, log-softmax, layer norm and RMS norm over the rows of a matrix,
for any row count and length, compiled once per machine (`library.py`), which a program's fused region calls
when it is exactly one of them, instead of compiling a row kernel for its shapes.

    void fj_softmax_f32(const float *x, float *y, int64_t rows, int64_t cols, int64_t threads);
    void fj_log_softmax_f32(const float *x, float *y, int64_t rows, int64_t cols, int64_t threads);
    void fj_layer_norm_f32(const float *x, float *y, int64_t rows, int64_t cols, float eps,
                           int64_t threads);
    void fj_layer_norm_affine_f32(const float *x, const float *gamma, const float *beta, float *y,
                                  int64_t rows, int64_t cols, float eps, int64_t threads);
    void fj_rms_norm_f32(x, y, rows, cols, eps, threads), fj_rms_norm_scaled_f32(x, gamma, y, ...);
    fj_softmax_divided_f32, fj_layer_norm_divided[_affine]_f32: the forms that divide by the sum or root;
    and the _f64 functions alike. Rows are contiguous (cols apart); y may be x.

Why: such a function's first call is almost all compile time (softmax over 4096 x 1024: about 38
of its 42-44 ms go to MLIR and LLVM for one fused row kernel, on a 2-core AMD EPYC Zen 4 VM). With
the library the program's module holds a call, which compiles in a few milliseconds.

What they compute: the row nest's code (`lower_rows`) for the same graph, a row at a time: the same
scalar math (`mathlib`'s exp, log, rsqrt, written on vectors here), sweeps and order of operations,
and the same summation order as the compiled kernel's reductions of rows of at least four vectors:
four vector accumulators, the element at column j in lane j mod (4 x lanes), the partial last chunk
masked, the accumulators combined (0 + 2) + (1 + 3) and then across lanes as a tree. Rows of that
length (most: 1024 floats is 16 chunks of 64) give bit-identical results; shorter rows, which the
compiled kernel sums a vector at a time, would round differently and keep their kernel
(`_identical_sums`), so the library never changes a program's results.

Which regions call it: `match` (a fusion whose body is, op for op, what `flowjit.nn`'s function traces
to for the same types, registered as a composite in `flowjit.ir.composites`; rows of `MIN_ROW_BYTES`
to `lower_rows.MAX_ROW_BYTES`, of any length in inputs of at most `SMALL_INPUT_BYTES`), through
`lower_fusion`'s `CALL_LOWERINGS` entry (`lowering.call_lowering`). `FLOWJIT_ROW_LIBRARY=0` turns it
off; AOT libraries keep their kernels (`library.disabled`). docs/cpu-fusion.md ("Row library") has the measurements.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np

from flowjit.backends.cpu import host, library, schedule
from flowjit.backends.cpu.library import Writer
from flowjit.backends.mlir import mathlib
from flowjit.backends.mlir.emitter import scalar_literal
from flowjit.ir import dtypes as dt
from flowjit.ir.composites import COMPOSITES, EPS_MARKER, composite_graph
from flowjit.ir.graph import Graph, Op
from flowjit.ir.types import TensorType

ELEMS = ("f32", "f64")
# name -> the pointer arguments before y (x first), and whether it takes eps
FUNCTIONS = {
    "softmax": (("x",), False),
    "softmax_divided": (("x",), False),
    "log_softmax": (("x",), False),
    "layer_norm": (("x",), True),
    "layer_norm_affine": (("x", "gamma", "beta"), True),
    "layer_norm_divided": (("x",), True),
    "layer_norm_divided_affine": (("x", "gamma", "beta"), True),
    "rms_norm": (("x",), True),
    "rms_norm_scaled": (("x", "gamma"), True),
}
ACCUMULATORS = 4
# Rows shorter than this keep their compiled kernel, which works on tiles of 8 rows and runs faster
# there (per row the library pays its horizontal reductions and scalar math alone): on a 2-core AMD
# EPYC Zen 4 VM, log-softmax over rows of 64 float32 takes 1.6x the kernel's time, while from 512
# floats on the library is as fast or faster. Rows longer than `lower_rows.MAX_ROW_BYTES` (not
# cache-resident between the sweeps) keep theirs too: the library runs them slightly slower.
MIN_ROW_BYTES = 2048
# ... unless the whole input is at most this many bytes: then the library's run time is
# at most a few microseconds more, and the kernel's compile 20-40 ms (both on a 2-core AMD EPYC
# Zen 4 VM).
SMALL_INPUT_BYTES = 128 << 10


def symbol(name: str, elem: str) -> str:
    return f"fj_{name}_{elem}"


def symbols() -> list[str]:
    return [symbol(name, elem) for name in FUNCTIONS for elem in ELEMS]


_SCALAR_TYPE = re.compile(r"\b(f32|f64|i32|i64|i1)\b")
_DTYPES = {"f32": dt.float32, "f64": dt.float64, "i32": dt.int32, "i64": dt.int64, "i1": dt.bool_}


def _literal(value, elem: str) -> str:
    return scalar_literal(value, _DTYPES[elem])


class _VectorBuilder:
    """`mathlib`'s builder interface (`ScalarBuilder`) writing the same code on vectors of `lanes`:
    each op's types become vector types, constants splats defined once at the function's entry."""

    def __init__(self, w: Writer, lanes: int):
        self.w, self.lanes = w, lanes

    def _vector(self, types: str) -> str:
        return _SCALAR_TYPE.sub(lambda m: f"vector<{self.lanes}x{m.group(1)}>", types)

    def op(self, rhs: str) -> str:
        head, types = rhs.rsplit(" : ", 1)
        if head.startswith("arith.select "):  # a vector condition is typed as well
            types = f"i1, {types}"
        return self.w.op(f"{head} : {self._vector(types)}")

    def line(self, text: str) -> None:
        self.w.line(text)

    def const(self, value, elem: str) -> str:
        return self.w.entry(f"arith.constant dense<{_literal(value, elem)}> : vector<{self.lanes}x{elem}>")


class _ScalarBuilder:
    """`mathlib`'s builder interface for a row's scalars (its max, sum, mean), constants at the entry."""

    def __init__(self, w: Writer):
        self.w = w

    def op(self, rhs: str) -> str:
        return self.w.op(rhs)

    def line(self, text: str) -> None:
        self.w.line(text)

    def const(self, value, elem: str) -> str:
        return self.w.entry(f"arith.constant {_literal(value, elem)} : {elem}")


class _RowKernel:
    """The library function `name` for one element type."""

    def __init__(self, name: str, elem: str):
        self.name, self.elem = name, elem
        self.vl = host.vector_bits() // int(elem[1:])
        self.width = ACCUMULATORS * self.vl
        self.vec = f"vector<{self.vl}x{elem}>"
        self.mask = f"vector<{self.vl}xi1>"
        self.mat = f"memref<?x?x{elem}, strided<[?, 1]>>"
        self.w = Writer()
        self.v = mathlib._Arith(_VectorBuilder(self.w, self.vl), elem)  # arithmetic on vectors
        self.s = mathlib._Arith(_ScalarBuilder(self.w), elem)  # on a row's scalars
        # The _divided forms divide by the row's sum or root where the others multiply by its
        # reciprocal (`nn.softmax`) or reciprocal root (`nn.layer_norm`): written `e / e.sum(...)`,
        # `(x - mean) / sqrt(var + eps)`.
        self.divided = "_divided" in name

    def text(self) -> str:
        w, e = self.w, self.elem
        pointers, takes_eps = FUNCTIONS[self.name]
        one = f"memref<1x{e}>"
        args = [f"%{p}0: {one}" for p in (*pointers, "y")] + ["%rows: index", "%cols: index"]
        args += [f"%eps: {e}"] * takes_eps + ["%threads: index"]
        self.x = self.matrix("%x0")
        self.y = self.matrix("%y0")
        self.gamma = self.matrix("%gamma0", "1") if "gamma" in pointers else None
        self.beta = self.matrix("%beta0", "1") if "beta" in pointers else None
        self.whole = w.arith("muli", w.arith("divui", "%cols", self.width), self.width)
        self.rest = w.arith("subi", "%cols", self.whole)
        self.count = w.op(f"arith.uitofp {w.op('arith.index_cast %cols : index to i64')} : i64 to {e}")
        _, lo, hi = w.chunks("%rows", w.arith("ceildivui", "%rows", "%threads"))  # one thread: all rows
        self.rows(lo, hi)
        w.close()
        w.line("return")
        return w.function(symbol(self.name, e), args)

    def matrix(self, pointer: str, rows: str = "%rows") -> str:
        """The rows x cols matrix at `pointer` (gamma and beta: one row)."""
        return self.w.op(
            f"memref.reinterpret_cast {pointer} to offset: [0], sizes: [{rows}, %cols], strides: [%cols, 1] "
            f": memref<1x{self.elem}> to {self.mat}"
        )

    def rows(self, lo: str, hi: str) -> None:
        w = self.w
        r = w.fresh("r")
        w.open(f"scf.for {r} = {lo} to {hi} step {w.index(1)}")
        getattr(self, self.name.replace("_divided", "").removesuffix("_affine").removesuffix("_scaled"))(r)
        w.close()

    # --- the functions, a row at a time (the order of operations of `flowjit.nn`'s graphs) ---------

    def softmax(self, r: str) -> None:
        v, s = self.v, self.s
        top = self.sweep(r, lambda x, col, mask: x, "maximumf")
        top_v = self.splat(top)

        def exp(x, col, mask):
            e = mathlib.MATH["exp"](v.b, v.sub(x, top_v), self.elem)
            self.store(self.y, r, col, mask, e)
            return e

        total = self.sweep(r, exp, "add")
        if self.divided:
            total_v = self.splat(total)

            def divided(_, col, mask):
                self.store(self.y, r, col, mask, v.div(self.load(self.y, r, col, mask), total_v))

            self.sweep(r, divided)
            return
        scale = self.splat(s.div(s.c(1.0), total))

        def scaled(_, col, mask):
            self.store(self.y, r, col, mask, v.mul(self.load(self.y, r, col, mask), scale))

        self.sweep(r, scaled)

    def log_softmax(self, r: str) -> None:
        v, s = self.v, self.s
        top_v = self.splat(self.sweep(r, lambda x, col, mask: x, "maximumf"))
        total = self.sweep(r, lambda x, col, mask: mathlib.MATH["exp"](v.b, v.sub(x, top_v), self.elem), "add")
        log_v = self.splat(mathlib.MATH["log"](s.b, total, self.elem))
        self.sweep(r, lambda x, col, mask: self.store(self.y, r, col, mask, v.sub(v.sub(x, top_v), log_v)))

    def layer_norm(self, r: str) -> None:
        v, s = self.v, self.s
        mean_v = self.splat(s.div(self.sweep(r, lambda x, col, mask: x, "add"), self.count))

        def square(x, col, mask):
            centered = v.sub(x, mean_v)
            return v.mul(centered, centered)

        var = s.div(self.sweep(r, square, "add"), self.count)
        root = "sqrt" if self.divided else "rsqrt"
        scale_v = self.splat(mathlib.MATH[root](s.b, s.add(var, "%eps"), self.elem))

        def normalized(x, col, mask):
            y = (v.div if self.divided else v.mul)(v.sub(x, mean_v), scale_v)
            if self.gamma is not None:
                first = self.w.index(0)
                y = v.add(v.mul(y, self.load(self.gamma, first, col, mask)), self.load(self.beta, first, col, mask))
            self.store(self.y, r, col, mask, y)

        self.sweep(r, normalized)

    def rms_norm(self, r: str) -> None:
        v, s = self.v, self.s
        mean_square = s.div(self.sweep(r, lambda x, col, mask: v.mul(x, x), "add"), self.count)
        scale_v = self.splat(mathlib.MATH["rsqrt"](s.b, s.add(mean_square, "%eps"), self.elem))

        def normalized(x, col, mask):
            y = v.mul(x, scale_v)
            if self.gamma is not None:
                y = v.mul(y, self.load(self.gamma, self.w.index(0), col, mask))
            self.store(self.y, r, col, mask, y)

        self.sweep(r, normalized)

    # --- sweeps over a row ------------------------------------------------------------------------

    def splat(self, scalar: str) -> str:
        return self.w.op(f"vector.broadcast {scalar} : {self.elem} to {self.vec}")

    def load(self, source: str, r: str, col: str, mask: str | None) -> str:
        if mask is None:
            return self.w.op(f"vector.load {source}[{r}, {col}] : {self.mat}, {self.vec}")
        types = f"{self.mat}, {self.mask}, {self.vec} into {self.vec}"
        return self.w.op(f"vector.maskedload {source}[{r}, {col}], {mask}, {self.v.c(0.0)} : {types}")

    def store(self, target: str, r: str, col: str, mask: str | None, value: str) -> None:
        if mask is None:
            self.w.line(f"vector.store {value}, {target}[{r}, {col}] : {self.mat}, {self.vec}")
        else:
            types = f"{self.mat}, {self.mask}, {self.vec}"
            self.w.line(f"vector.maskedstore {target}[{r}, {col}], {mask}, {value} : {types}")

    def sweep(self, r: str, body, combine: str | None = None) -> str | None:
        """One pass over row `r`: body(x vector, column, mask or None) for every vector of the row, in
        chunks of `ACCUMULATORS` vectors, the last chunk masked. With `combine` ("add", "maximumf"),
        the row's reduction of body's values (a scalar): accumulator u takes the chunks' vector u,
        the masked lanes the identity."""
        w, v = self.w, self.v
        identity = {"add": 0.0, "maximumf": float("-inf"), None: 0.0}[combine]
        init = v.c(identity)
        accs = [init] * ACCUMULATORS
        types = ", ".join([self.vec] * ACCUMULATORS)
        j = w.fresh("j")
        loop = f"scf.for {j} = {w.index(0)} to {self.whole} step {w.index(self.width)}"
        if combine:
            names = [w.fresh("a") for _ in range(ACCUMULATORS)]
            inits = ", ".join(f"{n} = {a}" for n, a in zip(names, accs))
            result = w.fresh("acc")
            w.open(f"{result}:{ACCUMULATORS} = {loop} iter_args({inits}) -> ({types})")
        else:
            w.open(loop)
        new = []
        for u in range(ACCUMULATORS):
            col = w.arith("addi", j, u * self.vl)
            value = body(self.load(self.x, r, col, None), col, None)
            if combine:
                new.append(self.combine(combine, value, names[u]))
        if combine:
            w.line(f"scf.yield {', '.join(new)} : {types}")
            accs = [f"{result}#{u}" for u in range(ACCUMULATORS)]
        w.close()
        partial = w.op(f"arith.cmpi ugt, {self.rest}, {w.index(0)} : index")
        if combine:
            tail = w.fresh("tail")
            w.open(f"{tail}:{ACCUMULATORS} = scf.if {partial} -> ({types})")
        else:
            w.open(f"scf.if {partial}")
        new = []
        for u in range(ACCUMULATORS):
            col = w.arith("addi", self.whole, u * self.vl)
            left = w.arith("subi", self.rest, u * self.vl)
            left = w.op(f"arith.minsi {left}, {w.index(self.vl)} : index")
            lanes = w.op(f"arith.maxsi {left}, {w.index(0)} : index")
            mask = w.op(f"vector.create_mask {lanes} : {self.mask}")
            value = body(self.load(self.x, r, col, mask), col, mask)
            if combine:
                kept = w.op(f"arith.select {mask}, {value}, {init} : {self.mask}, {self.vec}")
                new.append(self.combine(combine, kept, accs[u]))
        if combine:
            w.line(f"scf.yield {', '.join(new)} : {types}")
            w.otherwise()
            w.line(f"scf.yield {', '.join(accs)} : {types}")
        w.close()
        if not combine:
            return None
        accs = [f"{tail}#{u}" for u in range(ACCUMULATORS)]
        # (0 + 2) + (1 + 3): the halving order of the compiled kernel's one wide accumulator
        half = [self.combine(combine, accs[u], accs[u + ACCUMULATORS // 2]) for u in range(ACCUMULATORS // 2)]
        whole = self.combine(combine, half[0], half[1])
        return w.op(f"vector.reduction <{combine}>, {whole} : {self.vec} into {self.elem}")

    def combine(self, kind: str, value: str, acc: str) -> str:
        """value (+) acc, in the compiled kernels' operand order (`reduction_library._ReductionKernel.combine`)."""
        return self.w.op(f"arith.{'addf' if kind == 'add' else kind} {value}, {acc} : {self.vec}")


@functools.cache
def library_mlir() -> str:
    """The library module's MLIR: one function per row function and element type."""
    kernels = [_RowKernel(name, elem).text() for name in FUNCTIONS for elem in ELEMS]
    return "module {\n" + "\n".join(kernels) + "\n}\n"


# --- which fused regions call it ------------------------------------------------------------------

# Ops each function's region holds: a test that costs nothing before its reference is traced
# (milliseconds per function and operand types), so that other regions (elementwise chains) pay
# none of it.
_HOLDS = {
    "softmax": {"reduce_max", "exp", "reduce_sum"},
    "softmax_divided": {"reduce_max", "exp", "reduce_sum", "div"},
    "log_softmax": {"reduce_max", "exp", "reduce_sum", "log"},
    "layer_norm": {"reduce_sum", "rsqrt", "sub"},
    "layer_norm_affine": {"reduce_sum", "rsqrt", "sub"},
    "layer_norm_divided": {"reduce_sum", "sqrt", "sub", "div"},
    "layer_norm_divided_affine": {"reduce_sum", "sqrt", "sub", "div"},
    "rms_norm": {"reduce_sum", "rsqrt"},
    "rms_norm_scaled": {"reduce_sum", "rsqrt"},
}


def _signature(body: Graph) -> tuple[tuple, list[np.ndarray]] | None:
    """A region's structure (ops, their operands by position, result types, attributes) with its
    constants' values apart; None for a region this cannot describe (nested regions)."""
    names: dict = {p: ("param", i) for i, p in enumerate(body.params)}
    ops, constants = [], []
    for k, op in enumerate(body.ops):
        if op.regions or any(v not in names for v in op.operands):
            return None
        attrs = []
        for key in sorted(op.attrs):
            value = op.attrs[key]
            if isinstance(value, np.ndarray):
                if op.name == "constant" and key == "value":
                    constants.append(value)
                    value = (value.dtype.str, value.shape)
                else:
                    value = (value.dtype.str, value.shape, value.tobytes())
            attrs.append((key, repr(value)))
        results = tuple(str(r.type) for r in op.results)
        ops.append((op.name, tuple(names[v] for v in op.operands), results, tuple(attrs)))
        names.update({r: (k, j) for j, r in enumerate(op.results)})
    if any(v not in names for v in body.results):
        return None
    return (tuple(str(p.type) for p in body.params), tuple(ops), tuple(names[v] for v in body.results)), constants


def _reference(name: str, types: tuple[TensorType, ...]):
    """The signature of the region the composite `name` traces to for operands of `types`
    (`flowjit.ir.composites`, registered by `flowjit.nn`), or None when it does not trace to one
    fused region over the function's arguments in order."""
    graph = composite_graph(name, types)
    if graph is None or len(graph.ops) != 1 or graph.ops[0].name != "fusion" or graph.ops[0].operands != graph.params:
        return None
    return _signature(graph.ops[0].regions[0])


@dataclass(frozen=True)
class RowCall:
    """A fused region as a call of the row library's `name` on rows x cols of `elem`."""

    name: str
    elem: str
    rows: int
    cols: int
    eps: float | None

    @property
    def symbol(self) -> str:
        return symbol(self.name, self.elem)

    @property
    def threads(self) -> int:
        """The cores the rows split over: as the compiled row nest's (`lower_rows.plan`)."""
        parallel = self.rows * self.cols >= schedule.PARALLEL_MIN_ELEMENTS and schedule.threads() > 1
        return schedule.threads() if parallel else 1

    def emit(self, em, *buffers: tuple[str, str]) -> None:
        """The call on memrefs (name, type) of the region's operands, then its result; its
        declaration goes into the module."""
        one = f"memref<1x{self.elem}>"
        scalars = [(self.rows, "index"), (self.cols, "index")]
        scalars += [(_literal(self.eps, self.elem), self.elem)] * (self.eps is not None) + [(self.threads, "index")]
        note = f"fusion: calls the row library's @{self.symbol} (precompiled: row_library.py)"
        library.emit_call(em, self.symbol, note, [(*b, one) for b in buffers], scalars)


def _identical_sums(cols: int, elem: str) -> bool:
    """Whether the compiled row kernel sums rows of `cols` as the library does (four vector
    accumulators: `schedule._row_reduction`): rows of at least four vectors, except those between
    four and eight vectors long that are not a multiple of four, which it sums a vector at a time."""
    width = ACCUMULATORS * host.vector_bits() // int(elem[1:])
    return cols >= width and not (width < cols < 2 * width and cols % width)


def match(op: Op) -> RowCall | None:
    """How the fusion `op` calls the row library, or None: a region with one result whose body is
    op for op the graph of one of the composites (`flowjit.ir.composites`) for the same operand
    types (the norms: any eps),
    f32/f64 rows of `MIN_ROW_BYTES` (any length in inputs of at most `SMALL_INPUT_BYTES`) to
    `lower_rows.MAX_ROW_BYTES` on which the compiled kernel would sum as the library does (same bits:
    `_identical_sums`)."""
    from flowjit.backends.cpu.lower_rows import MAX_ROW_BYTES

    if op.name != "fusion" or len(op.results) != 1 or not op.operands or not enabled():
        return None
    t = op.result.type
    elem = {dt.float32: "f32", dt.float64: "f64"}.get(t.dtype)
    if elem is None or t.rank < 1 or op.operands[0].type != t:
        return None
    cols, rows = t.shape[-1], math.prod(t.shape[:-1])
    row_bytes = cols * t.dtype.itemsize
    shortest = MIN_ROW_BYTES if rows * row_bytes > SMALL_INPUT_BYTES else 1
    if rows < 1 or not shortest <= row_bytes <= MAX_ROW_BYTES or not _identical_sums(cols, elem):
        return None
    held = {o.name for o in op.regions[0].ops}
    types = tuple(v.type for v in op.operands)
    candidates = [n for n, held_ops in _HOLDS.items() if held_ops <= held and n in COMPOSITES]
    found = _signature(op.regions[0]) if candidates else None
    if found is None:
        return None
    signature, constants = found
    for name in candidates:
        expected = _reference(name, types)
        if expected is None or expected[0] != signature:
            continue
        eps = _constants_match(expected[1], constants)
        if eps is not False:
            return RowCall(name, elem, rows, cols, eps)
    return None


def _constants_match(expected: list[np.ndarray], found: list[np.ndarray]) -> float | None | bool:
    """False unless `found` has the reference's constants (same dtypes and shapes, same bits) but for
    the splats of `EPS_MARKER`, which must be splats of one value there; else that value (eps; None where
    the function has none)."""
    eps = None
    for want, have in zip(expected, found):
        if want.dtype != have.dtype or want.shape != have.shape:
            return False
        if want.size and (want == EPS_MARKER).all():
            value = have.reshape(-1)[0]
            if (have != value).any() or (eps is not None and float(value) != eps):
                return False
            eps = float(value)
        elif want.tobytes() != have.tobytes():
            return False
    return eps


def enabled() -> bool:
    """False with `FLOWJIT_ROW_LIBRARY=0`, or inside `library.disabled()` (AOT compiles)."""
    return LIBRARY.enabled()


LIBRARY = library.Library("row", library_mlir, symbols, strength_reduction=True, switch="FLOWJIT_ROW_LIBRARY")
