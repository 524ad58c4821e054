"""Random valid flowjit programs, drawn with hypothesis through the public tracing API.

`programs()` is a hypothesis strategy of `Program`s: a few inputs (shapes that broadcast against
each other, every dtype), then statements, each made by the builder of one registered op
(`BUILDERS`, keyed by op name so a new op without a builder is reported by tests/test_fuzz.py).
A builder picks operands from the values computed so far and renders the statement twice: flowjit
(`M.exp(v1)`, `v0 @ v2`, `FJ.cond(...)`) and numpy in float64 (`np.exp(W(v1))`).

Every statement is checked while it is drawn: tracing it gives flowjit's result dtype (the numpy
rendering is cast to it), and the numpy value must be finite and moderate, so the program stays in
every op's safe domain (no log of negatives, no overflow) and a mismatch means a bug, not noise.
Discontinuous ops (floor, comparisons, argmax, float->int, ...) only take *exact* operands (inputs
on a 1/8 grid, or values derived from them without rounding), so rounding differences between
backends cannot flip them.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.ir import dtypes as dt
from fuzz import numpy_ref
from fuzz.program import Program, Stmt

FLOAT_DTYPES = ("f16", "bf16", "f32", "f64")
INT_DTYPES = ("i32", "i64")
# Weighted towards float32, the dtype users run.
INPUT_DTYPES = ("f32", "f32", "f32", "f64", "f16", "bf16", "i32", "i64", "bool")
# Mostly tiny shapes (cheap, easy to read when shrunk); a few larger ones with odd sizes reach the
# vectorized loops, their remainders and the tiled matmul kernel.
BASE_SHAPES = ((), (4,), (2, 3), (3, 1), (2, 3, 4), (1, 5), (6,), (2, 2, 2), (17,), (3, 33), (40, 9), (2, 5, 19))
MAX_MAGNITUDE = 1e4  # f16 overflows at 65504; keep every value well inside
GRID = 8  # inputs are multiples of 1/GRID: exact in every float dtype

# Ops a program cannot create through the public API, with the reason. Every other registered op
# must have a builder (tests/test_fuzz.py checks), so coverage cannot silently rot.
NOT_GENERATED = {
    "send": "created only by the partition pass (checked by the per-pass oracle on multi-device graphs)",
    "recv": "created only by the partition pass (checked by the per-pass oracle on multi-device graphs)",
    "send_done": "created only by the partition pass (checked by the per-pass oracle on multi-device graphs)",
    "fusion": "created only by the fuse pass (checked by the per-pass oracle on every program)",
    "custom_vjp_call": "needs a user-written backward rule; covered by tests/test_gradients.py",
}


@dataclass
class Val:
    """A value computed so far: its name, its numpy reference value, and whether it is exact."""

    name: str
    array: np.ndarray
    exact: bool

    @property
    def dtype(self) -> str:
        return dt.dtype(self.array.dtype).name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def is_int(self) -> bool:
        return self.dtype in INT_DTYPES

    @property
    def magnitude(self) -> float:
        return float(np.max(np.abs(self.array.astype(np.float64)))) if self.array.size else 0.0


class Rejected(Exception):
    """A drawn statement is not valid or not numerically safe: drop it and draw another."""


class Gen:
    """The state of one program being drawn."""

    def __init__(self, draw, smooth: bool = False, prefix: str = "v"):
        self.draw = draw
        self.smooth = smooth  # only differentiable ops, float64: programs for gradient checks
        self.prefix = prefix  # of the names of computed values
        self.program = Program()
        self.vals: list[Val] = []
        self.fj_vars: dict[str, fj.Variable] = {}
        self.np_env = numpy_ref.namespace()
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def region(self, params: list[Val]) -> Gen:
        """A generator for the body of a transformation (`vmap`, `scan`): its first values are the
        lambda's `params` (their arrays: one example, one step), its statements are named `t0`,
        `t1`, ... (inlined into one expression by `inline`), and the inputs it creates (a gather's
        indices, a matmul's weights) become program inputs closed over by the body (`adopt`)."""
        sub = Gen(self.draw, self.smooth, prefix="t")
        sub.program.inputs = dict(self.program.inputs)
        sub.rng = self.rng
        sub.np_env = {**self.np_env, **{p.name: p.array for p in params}}
        sub.vals = list(params)
        return sub

    def adopt(self, sub: Gen) -> None:
        """Make the inputs `sub` (a `region`) created inputs of this program too."""
        for name, array in sub.program.inputs.items():
            if name not in self.program.inputs:
                self.program.inputs[name] = array
                self.np_env[name] = array
                self.vals.append(Val(name, array, exact=not self.smooth))

    # --- values -----------------------------------------------------------------------------

    def new_input(self, shape, dtype: str, lo: float = -4.0, hi: float = 4.0, index_range: int | None = None) -> Val:
        name = f"x{len(self.program.inputs)}"
        if index_range is not None:
            array = self.rng.integers(-index_range - 2, index_range + 2, size=shape).astype(dt.dtype(dtype).np_dtype)
        elif dtype == "bool":
            array = self.rng.random(shape) < 0.5
        elif dtype in INT_DTYPES:
            array = self.rng.integers(int(lo) * 2, int(hi) * 2 + 1, size=shape).astype(dt.dtype(dtype).np_dtype)
        elif self.smooth:
            array = self.rng.uniform(lo, hi, size=shape).astype(dt.dtype(dtype).np_dtype)
        else:
            grid = self.rng.integers(int(lo * GRID), int(hi * GRID) + 1, size=shape) / GRID
            array = np.asarray(grid).astype(dt.dtype(dtype).np_dtype)
        array = np.asarray(array)
        self.program.inputs[name] = array
        self.np_env[name] = array
        val = Val(name, array, exact=not self.smooth)
        self.vals.append(val)
        return val

    def pick(self, pred: Callable[[Val], bool] = lambda v: True) -> Val | None:
        candidates = [v for v in self.vals if pred(v)]
        if not candidates:
            return None
        return candidates[self.draw(st.integers(0, len(candidates) - 1))]

    def need(self, pred: Callable[[Val], bool]) -> Val:
        v = self.pick(pred)
        if v is None:
            raise Rejected
        return v

    def choice(self, options):
        options = list(options)
        return options[self.draw(st.integers(0, len(options) - 1))]

    def broadcast_partner(self, a: Val, pred: Callable[[Val], bool]) -> Val | None:
        def fits(v: Val) -> bool:
            try:
                np.broadcast_shapes(a.shape, v.shape)
            except ValueError:
                return False
            return pred(v)

        return self.pick(fits)

    # --- statements -------------------------------------------------------------------------

    def result_dtype(self, fj_expr: str) -> tuple[str, tuple]:
        """flowjit's dtype and shape for `fj_expr`, by tracing it (no compile)."""
        names = [v.name for v in self.vals]
        env = {"M": fnp, "FJ": fj, "nn": nn, "np": np, **self.fj_vars}
        exec(f"def stmt({', '.join(names)}):\n    return {fj_expr}\n", env)
        try:
            lowered = fj.jit(env["stmt"]).lower(*[v.array for v in self.vals])
        except fj.FlowjitError as e:
            raise Rejected from e
        (ttype,) = lowered.graph("traced").result_types
        return ttype.dtype.name, ttype.shape

    def emit(self, fj_expr: str, np_expr: str, exact: bool) -> Val:
        """Add `v = fj_expr` to the program; `np_expr` may use `{T}`, flowjit's result dtype."""
        dtype, shape = self.result_dtype(fj_expr)
        np_expr = np_expr.replace("{T}", repr(dtype))
        with np.errstate(all="ignore"):
            array = np.asarray(eval(np_expr, self.np_env))
        if array.shape != shape or dt.dtype(array.dtype).name != dtype:
            raise AssertionError(
                f"fuzz builder bug: {fj_expr!r} is {dtype}{list(shape)} in flowjit but numpy "
                f"{np_expr!r} gives {array.dtype}{list(array.shape)}"
            )
        val = Val(f"{self.prefix}{len(self.program.stmts)}", array, exact)
        if not np.all(np.isfinite(array.astype(np.float64))) or val.magnitude > MAX_MAGNITUDE:
            raise Rejected
        self.program.stmts.append(Stmt(val.name, fj_expr, np_expr))
        self.np_env[val.name] = array
        self.vals.append(val)
        return val

    def effect(self, fj_stmt: str, np_stmt: str) -> None:
        """A statement without a result (a variable update)."""
        self.program.stmts.append(Stmt(None, fj_stmt, np_stmt))
        exec(np_stmt, self.np_env)


# --- builders: one per op, (gen) -> None, raising Rejected when they do not apply --------------------

BUILDERS: dict[str, Callable[[Gen], None]] = {}


def builder(*ops: str):
    def deco(fn):
        for op in ops:
            BUILDERS[op] = fn
        return fn

    return deco


def _w(v: Val) -> str:
    """The numpy rendering of operand `v`: floats in float64."""
    return f"W({v.name})"


def _bounded(v: Val, bound: float) -> tuple[str, str]:
    """`v`, squashed through tanh when it could overflow the op (|v| > bound)."""
    if v.magnitude <= bound:
        return v.name, _w(v)
    return f"M.tanh({v.name})", f"np.tanh({_w(v)})"


# Smooth unary float ops: flowjit template, numpy template (on float64), operand bound.
UNARY_FLOAT = {
    "exp": ("M.exp({a})", "np.exp({a})", 8.0),
    "expm1": ("M.expm1({a})", "np.expm1({a})", 8.0),
    "tanh": ("M.tanh({a})", "np.tanh({a})", np.inf),
    "logistic": ("nn.sigmoid({a})", "1 / (1 + np.exp(-{a}))", np.inf),
    "sin": ("M.sin({a})", "np.sin({a})", 50.0),
    "cos": ("M.cos({a})", "np.cos({a})", 50.0),
    "erf": ("M.erf({a})", "R.erf({a})", np.inf),
    "log": ("M.log(M.abs({a}) + 0.5)", "np.log(np.abs({a}) + 0.5)", np.inf),
    "log1p": ("M.log1p(M.abs({a}))", "np.log1p(np.abs({a}))", np.inf),
    "sqrt": ("M.sqrt(M.abs({a}) + 0.25)", "np.sqrt(np.abs({a}) + 0.25)", np.inf),
    "rsqrt": ("M.rsqrt(M.abs({a}) + 0.25)", "1 / np.sqrt(np.abs({a}) + 0.25)", np.inf),
}


def _unary_float(op: str):
    fj_t, np_t, bound = UNARY_FLOAT[op]

    def build(g: Gen) -> None:
        a = g.need(lambda v: v.is_float)
        fa, na = _bounded(a, bound)
        g.emit(fj_t.format(a=fa), f"C({np_t.format(a=na)}, {{T}})", exact=False)

    return build


for _op in UNARY_FLOAT:
    BUILDERS[_op] = _unary_float(_op)


@builder("floor", "ceil", "round", "sign", "neg", "abs")
def _exact_unary(g: Gen) -> None:
    fj_t, np_t = g.choice(
        [("M.floor({a})", "np.floor({a})"), ("M.ceil({a})", "np.ceil({a})"), ("M.round({a})", "np.round({a})")]
        * (not g.smooth)
        + [("M.sign({a})", "np.sign({a})")] * (not g.smooth)
        + [("-{a}", "np.negative({a})"), ("M.abs({a})", "np.abs({a})")]
    )
    ints_ok = "floor" not in fj_t and "ceil" not in fj_t and "round" not in fj_t
    a = g.need(lambda v: (v.is_float and (v.exact or g.smooth)) or (ints_ok and v.is_int))
    g.emit(fj_t.format(a=a.name), f"C({np_t.format(a=_w(a))}, {{T}})", exact=a.exact)


@builder("logical_not")
def _logical_not(g: Gen) -> None:
    a = g.need(lambda v: v.dtype == "bool")
    g.emit(f"M.logical_not({a.name})", f"np.logical_not({a.name})", exact=True)


@builder("bitwise_not")
def _bitwise_not(g: Gen) -> None:
    a = g.need(lambda v: v.is_int or v.dtype == "bool")
    g.emit(f"~{a.name}", f"np.invert({a.name})", exact=True)


def _scalar(g: Gen, kinds: str) -> str:
    options = [
        s for s in ("2", "-3", "0.5", "2.5", "-1.25") if ("." in s and "f" in kinds) or ("." not in s and "i" in kinds)
    ]
    return g.choice(options)


def _second_operand(g: Gen, a: Val, pred: Callable[[Val], bool]) -> tuple[str, str, bool]:
    """A broadcast-compatible value or a Python scalar: (flowjit text, numpy text, exact)."""
    if g.draw(st.booleans()):
        b = g.broadcast_partner(a, pred)
        if b is not None:
            return b.name, _w(b), b.exact
    s = _scalar(g, "if" if not a.is_int else "i" if g.draw(st.booleans()) else "if")
    return s, s, True


@builder("add", "sub", "mul")
def _arith(g: Gen) -> None:
    a = g.need(lambda v: v.is_float or (v.is_int and not g.smooth))
    fb, nb, b_exact = _second_operand(g, a, lambda v: v.is_float or v.is_int)
    op, np_op = g.choice([("+", "np.add"), ("-", "np.subtract"), ("*", "np.multiply")])
    fj_expr = f"{a.name} {op} {fb}" if g.draw(st.booleans()) else f"{fb} {op} {a.name}"
    first, second = (_w(a), nb) if fj_expr.startswith(a.name + " ") else (nb, _w(a))
    # Integer results are exact; float sums of exact values may round, so they are not.
    g.emit(fj_expr, f"C({np_op}({first}, {second}), {{T}})", exact=a.is_int and b_exact and "." not in fb)


@builder("div")
def _div(g: Gen) -> None:
    a = g.need(lambda v: v.is_float)
    b = g.broadcast_partner(a, lambda v: v.is_float)
    if b is None or g.draw(st.booleans()):
        s = g.choice(["4", "0.5", "-2.5"])
        g.emit(f"{a.name} / {s}", f"C({_w(a)} / {s}, {{T}})", exact=False)
        return
    g.emit(f"{a.name} / (M.abs({b.name}) + 1)", f"C({_w(a)} / (np.abs({_w(b)}) + 1), {{T}})", exact=False)


@builder("rem")
def _rem(g: Gen) -> None:
    a = g.need(lambda v: (v.is_float and v.exact) or v.is_int)
    d = g.choice(["3", "-3"] + ["2.5", "-0.75"] * a.is_float)
    fj_t, np_t = g.choice([("{a} % {d}", "np.remainder({a}, {d})"), ("M.fmod({a}, {d})", "np.fmod({a}, {d})")])
    g.emit(fj_t.format(a=a.name, d=d), f"C({np_t.format(a=_w(a), d=d)}, {{T}})", exact=True)


@builder("pow")
def _pow(g: Gen) -> None:
    a = g.need(lambda v: v.is_float)
    e = g.broadcast_partner(a, lambda v: v.is_float)
    if e is None:
        s = g.choice(["1.5", "-0.5", "3.0"])
        g.emit(f"(M.abs({a.name}) + 0.5) ** {s}", f"C((np.abs({_w(a)}) + 0.5) ** {s}, {{T}})", exact=False)
        return
    g.emit(
        f"M.power(M.abs({a.name}) + 0.5, M.tanh({e.name}) * 2)",
        f"C(np.power(np.abs({_w(a)}) + 0.5, np.tanh({_w(e)}) * 2), {{T}})",
        exact=False,
    )


@builder("max", "min")
def _max_min(g: Gen) -> None:
    a = g.need(lambda v: v.is_float or v.is_int)
    fb, nb, b_exact = _second_operand(g, a, lambda v: v.is_float or v.is_int)
    fn = g.choice(["maximum", "minimum"])
    g.emit(f"M.{fn}({a.name}, {fb})", f"C(np.{fn}({_w(a)}, {nb}), {{T}})", exact=a.exact and b_exact)


@builder("atan2")
def _atan2(g: Gen) -> None:
    a = g.need(lambda v: v.is_float)
    fb, nb, _ = _second_operand(g, a, lambda v: v.is_float)
    if g.smooth:  # x > 0: away from the singular point (0, 0) (`x - x` makes exact zeros) and the cut at x < 0, y = 0
        fb, nb = f"(M.abs({fb}) + 0.5)", f"(np.abs({nb}) + 0.5)"
    g.emit(f"M.arctan2({a.name}, {fb})", f"C(np.arctan2({_w(a)}, {nb}), {{T}})", exact=False)


@builder("logical_and", "logical_or", "logical_xor")
def _logical(g: Gen) -> None:
    a = g.need(lambda v: v.dtype == "bool")
    b = g.broadcast_partner(a, lambda v: v.dtype == "bool") or a
    fn = g.choice(["logical_and", "logical_or", "logical_xor"])
    g.emit(f"M.{fn}({a.name}, {b.name})", f"np.{fn}({a.name}, {b.name})", exact=True)


@builder("eq", "ne", "lt", "le", "gt", "ge")
def _compare(g: Gen) -> None:
    a = g.need(lambda v: v.exact and v.dtype != "bool")
    fb, nb, b_exact = _second_operand(g, a, lambda v: v.exact and v.dtype != "bool")
    op, np_op = g.choice(
        [
            ("==", "equal"),
            ("!=", "not_equal"),
            ("<", "less"),
            ("<=", "less_equal"),
            (">", "greater"),
            (">=", "greater_equal"),
        ]
    )
    g.emit(f"{a.name} {op} {fb}", f"np.{np_op}({_w(a)}, {nb})", exact=True)


@builder("bitwise_and", "bitwise_or", "bitwise_xor")
def _bitwise(g: Gen) -> None:
    a = g.need(lambda v: v.is_int or v.dtype == "bool")
    b = g.broadcast_partner(a, lambda v: v.is_int == a.is_int and (v.is_int or v.dtype == "bool")) or a
    op, fn = g.choice([("&", "bitwise_and"), ("|", "bitwise_or"), ("^", "bitwise_xor")])
    g.emit(f"{a.name} {op} {b.name}", f"C(np.{fn}({a.name}, {b.name}), {{T}})", exact=True)


@builder("shift_left", "shift_right_arithmetic", "shift_right_logical")
def _shift(g: Gen) -> None:
    a = g.need(lambda v: v.is_int)
    s = g.draw(st.integers(0, 7))
    fj_t, np_t = g.choice(
        [
            ("{a} << {s}", "np.left_shift({a}, {s})"),
            ("{a} >> {s}", "np.right_shift({a}, {s})"),
            ("M.right_shift_logical({a}, {s})", "R.right_shift_logical({a}, {s})"),
        ]
    )
    g.emit(fj_t.format(a=a.name, s=s), f"C({np_t.format(a=a.name, s=s)}, {{T}})", exact=True)


@builder("select")
def _select(g: Gen) -> None:
    c = g.need(lambda v: v.dtype == "bool")
    a = g.broadcast_partner(c, lambda v: True)
    b = g.broadcast_partner(a, lambda v: True) if a is not None else None
    if a is None or b is None:
        raise Rejected
    g.emit(
        f"M.where({c.name}, {a.name}, {b.name})",
        f"C(np.where({c.name}, {_w(a)}, {_w(b)}), {{T}})",
        exact=a.exact and b.exact,
    )


@builder("convert")
def _convert(g: Gen) -> None:
    a = g.need(lambda v: True)
    targets = FLOAT_DTYPES if (a.is_float and not a.exact) or g.smooth else (*FLOAT_DTYPES, *INT_DTYPES, "bool")
    target = g.choice([t for t in targets if t != a.dtype])
    g.emit(f"{a.name}.astype({target!r})", f"C({a.name}, {target!r})", exact=a.exact)


@builder("iota")
def _iota(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 1 and v.dtype != "bool")
    dim = g.draw(st.integers(0, len(a.shape) - 1))
    target = g.choice(["i32", "i64", "f32"])
    g.emit(
        f"{a.name} + M.iota({a.shape!r}, {dim}, dtype={target!r})",
        f"C({_w(a)} + np.indices({a.shape!r})[{dim}], {{T}})",
        exact=a.exact,
    )


@builder("constant")
def _constant(g: Gen) -> None:
    a = g.need(lambda v: v.dtype != "bool")
    values = g.rng.integers(-8, 9, size=a.shape[-1:] or ())
    literal = repr((values if a.is_int else values / 4).tolist())
    g.emit(f"{a.name} * M.asarray({literal}, dtype={a.dtype!r})", f"C({_w(a)} * np.array({literal}), {{T}})", a.exact)


@builder("broadcast")
def _broadcast(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) <= 2)
    shape = (g.draw(st.integers(1, 3)), *[d if d != 1 else g.draw(st.integers(1, 3)) for d in a.shape])
    g.emit(f"M.broadcast_to({a.name}, {shape!r})", f"np.broadcast_to({a.name}, {shape!r})", exact=a.exact)


@builder("reshape")
def _reshape(g: Gen) -> None:
    a = g.need(lambda v: v.array.size > 0)
    size = a.array.size
    dims = [d for d in range(1, size + 1) if size % d == 0]
    first = g.choice(dims)
    shape = (first, size // first) if g.draw(st.booleans()) else (size,)
    if g.draw(st.booleans()) and len(shape) == 2:
        shape = (shape[0], -1)
    g.emit(f"{a.name}.reshape{shape!r}", f"{a.name}.reshape{shape!r}", exact=a.exact)


@builder("transpose")
def _transpose(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 2)
    perm = tuple(g.draw(st.permutations(range(len(a.shape)))))
    if g.draw(st.booleans()):
        g.emit(f"{a.name}.T", f"{a.name}.T", exact=a.exact)
    else:
        g.emit(f"M.transpose({a.name}, {perm!r})", f"np.transpose({a.name}, {perm!r})", exact=a.exact)


@builder("slice")
def _slice(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 1)
    parts = []
    for n in a.shape:
        start = g.draw(st.integers(0, max(n - 1, 0)))
        stop = g.draw(st.integers(start + 1, n)) if n > start else n
        step = g.choice([1, 1, 2, -1])
        parts.append(f"{start}:{stop}" + (f":{step}" if step == 2 else "") if step != -1 else "::-1")
    index = ", ".join(parts)
    g.emit(f"{a.name}[{index}]", f"{a.name}[{index}]", exact=a.exact)


@builder("dynamic_slice")
def _dynamic_slice(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 1 and min(v.shape) > 0)
    sizes = tuple(g.draw(st.integers(1, n)) for n in a.shape)
    start = g.new_input((), "i32", index_range=a.shape[0])
    starts = [start.name] + [str(g.draw(st.integers(-1, n))) for n in a.shape[1:]]
    fj_expr = f"M.dynamic_slice({a.name}, [{', '.join(starts)}], {sizes!r})"
    g.emit(fj_expr, f"R.dynamic_slice({a.name}, [{', '.join(starts)}], {sizes!r})", exact=a.exact)


@builder("pad")
def _pad(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 1)
    widths = tuple((g.draw(st.integers(0, 2)), g.draw(st.integers(0, 2))) for _ in a.shape)
    g.emit(f"M.pad({a.name}, {widths!r})", f"np.pad({a.name}, {widths!r})", exact=a.exact)


@builder("concatenate")
def _concatenate(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 1)
    axis = g.draw(st.integers(0, len(a.shape) - 1))
    if g.draw(st.booleans()):  # a roll: two slices of `a` joined, which the CPU backend copies from `a` directly
        shift = g.draw(st.integers(-3, 40))
        g.emit(f"M.roll({a.name}, {shift}, axis={axis})", f"np.roll({a.name}, {shift}, axis={axis})", exact=a.exact)
        return

    def fits(v: Val) -> bool:
        same_rank = len(v.shape) == len(a.shape)
        return same_rank and all(x == y for i, (x, y) in enumerate(zip(v.shape, a.shape)) if i != axis)

    b = g.pick(fits)
    g.emit(
        f"M.concatenate([{a.name}, {b.name}], axis={axis})",
        f"C(np.concatenate([{_w(a)}, {_w(b)}], axis={axis}), {{T}})",
        exact=a.exact and b.exact,
    )


@builder("gather")
def _gather(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 1 and min(v.shape) > 0)
    axis = g.draw(st.integers(0, len(a.shape) - 1))
    n = a.shape[axis]
    # Out-of-range indices on purpose: flowjit clamps them (numpy_ref.take does the same).
    idx = g.new_input((g.draw(st.integers(1, 4)),), g.choice(INT_DTYPES), index_range=n)
    g.emit(f"M.take({a.name}, {idx.name}, axis={axis})", f"R.take({a.name}, {idx.name}, {axis})", exact=a.exact)


@builder("scatter_add")
def _scatter_add(g: Gen) -> None:
    a = g.need(lambda v: len(v.shape) >= 1 and min(v.shape) > 0 and v.dtype != "bool")
    idx = g.new_input((g.draw(st.integers(1, 3)),), "i32", index_range=a.shape[0])
    upd = g.new_input((idx.shape[0], *a.shape[1:]), a.dtype)
    g.emit(
        f"M.scatter_add({a.name}, {idx.name}, {upd.name})",
        f"R.scatter_add({a.name}, {idx.name}, {upd.name}, 0)",
        exact=a.is_int,
    )


@builder("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
def _reduce(g: Gen) -> None:
    a = g.need(lambda v: (v.is_float or (v.is_int and not g.smooth)) and len(v.shape) >= 1)
    axis = g.choice([None, *range(len(a.shape))])
    keep = g.draw(st.booleans())
    fn = g.choice(["sum", "max", "min", "prod"] if not g.smooth else ["sum", "sum", "prod"])
    fa, na = a.name, _w(a)
    if fn == "prod" and a.is_float:
        fa, na = f"M.tanh({a.name})", f"np.tanh({_w(a)})"
    if fn == "prod" and a.magnitude > 2 and a.is_int:
        raise Rejected
    exact = a.exact and (fn in ("max", "min") or a.is_int)
    g.emit(
        f"M.{fn}({fa}, axis={axis}, keepdims={keep})", f"C(np.{fn}({na}, axis={axis}, keepdims={keep}), {{T}})", exact
    )


@builder("cumsum")
def _cumsum(g: Gen) -> None:
    # Running sums in order: floats against numpy's float64 sums (the tolerance), integers and bools
    # exactly (bools sum as int64 in both, int32 stays int32 in flowjit: the cast wraps alike).
    a = g.need(lambda v: (v.is_float or not g.smooth) and len(v.shape) >= 1)
    axis = g.choice([None, *range(len(a.shape))])
    g.emit(
        f"M.cumsum({a.name}, axis={axis})",
        f"C(np.cumsum({_w(a)}, axis={axis}), {{T}})",
        exact=a.exact and not a.is_float,
    )


@builder("linear_recurrence")
def _cumprod(g: Gen) -> None:
    # Running products (fnp.cumprod: the linear_recurrence op). Floats squashed into [0.75, 1.25]
    # (no overflow in float32 where numpy's float64 reference would not overflow) and only in
    # float32/float64 (a half type's long product drifts past the tolerance); integers exactly
    # (int32 stays int32 in flowjit: numpy's int64 product cast back wraps alike).
    a = g.need(lambda v: len(v.shape) >= 1 and (v.dtype in ("f32", "f64") or (v.is_int and not g.smooth)))
    axis = g.choice([None, *range(len(a.shape))])
    if a.is_float:
        g.emit(
            f"M.cumprod(M.tanh({a.name}) * 0.25 + 1.0, axis={axis})",
            f"C(np.cumprod(np.tanh({_w(a)}) * 0.25 + 1.0, axis={axis}), {{T}})",
            exact=False,
        )
        return
    g.emit(f"M.cumprod({a.name}, axis={axis})", f"C(np.cumprod({_w(a)}, axis={axis}), {{T}})", exact=a.exact)


@builder("argmax", "argmin")
def _arg_reduce(g: Gen) -> None:
    a = g.need(lambda v: v.exact and v.dtype != "bool" and v.array.size > 0 and len(v.shape) >= 1)
    axis = g.choice([None, *range(len(a.shape))])
    fn = g.choice(["argmax", "argmin"])
    g.emit(f"M.{fn}({a.name}, axis={axis})", f"C(np.{fn}({a.name}, axis={axis}), {{T}})", exact=True)


@builder("sort")
def _sort(g: Gen) -> None:
    # Sorted values are continuous in the keys, so any value may be sorted (ties keep their order in
    # both: stable). The permutation is not: keys one rounding apart (f16 `pow` computed in f32 here,
    # in f64 by the numpy oracle) swap places, so argsort only takes exact keys.
    a = g.need(lambda v: len(v.shape) >= 1 and v.array.size > 0 and (v.is_float or not g.smooth))
    axis = g.choice([None, -1, *range(len(a.shape))])
    fn = "sort" if g.smooth or not a.exact else g.choice(["sort", "argsort"])
    g.emit(
        f"M.{fn}({a.name}, axis={axis})",
        f"C(np.{fn}({_w(a)}, axis={axis}, kind='stable'), {{T}})",
        exact=a.exact,
    )


@builder("dot_general")
def _matmul(g: Gen) -> None:
    a = g.need(lambda v: v.is_float and len(v.shape) in (1, 2, 3))
    k = a.shape[-1]
    m = g.draw(st.integers(1, 4)) if g.draw(st.booleans()) else g.draw(st.integers(5, 40))
    b = g.pick(lambda v: v.is_float and len(v.shape) == 2 and v.shape[0] == k)
    if b is None:
        b = g.new_input((k, m), g.choice(FLOAT_DTYPES) if not g.smooth else "f64")
    form = g.choice(["{a} @ {b}", "M.matmul({a}, {b})", "M.dot({a}, {b})"])
    g.emit(form.format(a=a.name, b=b.name), f"C(np.matmul({_w(a)}, {_w(b)}), {{T}})", exact=False)


@builder("conv2d")
def _conv2d(g: Gen) -> None:
    a = g.need(lambda v: v.is_float and len(v.shape) == 2 and min(v.shape) >= 2)
    h, w = a.shape
    # 3x3 sums 9 taps: the CPU backend's im2col + matmul form (and its streamed epilogues); smaller
    # kernels its generic loops.
    k = g.draw(st.integers(1, min(h, w, 3)))
    stride, padding = g.draw(st.integers(1, 2)), g.draw(st.integers(0, 1))
    weights = g.new_input((2, 1, k, k), a.dtype)
    x = f"{a.name}.reshape(1, 1, {h}, {w})"
    g.emit(
        f"nn.conv2d({x}, {weights.name}, stride={stride}, padding={padding})",
        f"C(R.conv2d({x}, {weights.name}, {stride}, {padding}), {{T}})",
        exact=False,
    )


@builder("reduce_window")
def _max_pool(g: Gen) -> None:
    a = g.need(lambda v: v.is_float and len(v.shape) == 2 and min(v.shape) >= 2)
    h, w = a.shape
    window = g.draw(st.integers(1, 2))
    x = f"{a.name}.reshape(1, 1, {h}, {w})"
    g.emit(f"nn.max_pool2d({x}, {window})", f"R.max_pool2d({x}, {window}, {window})", exact=a.exact)


# Branch bodies of fj.cond per operand kind: (true, false), flowjit templates over `{a}`; bools and
# ints cross region boundaries differently from floats in compiled code (bools travel as bytes).
COND_BRANCHES = {
    "float": (("M.tanh({a}) * 2", "{a} - 1", "M.sin({a})"), ("M.cos({a})", "{a} * 0.5", "-{a}")),
    "int": (("{a} + 1", "{a} * 2"), ("-{a}", "{a} - 3")),
    "bool": (("M.logical_not({a})", "{a}"), ("{a}", "M.logical_not({a})")),
}


def _kind(v: Val) -> str:
    return "float" if v.is_float else "int" if v.is_int else "bool"


@builder("cond")
def _cond(g: Gen) -> None:
    # Smooth programs have continuous random values: a perturbation never flips the predicate.
    p = g.need(lambda v: (v.exact or g.smooth) and v.dtype != "bool" and v.array.size > 0)
    a = g.need(lambda v: v.is_float or not g.smooth)
    true_options, false_options = COND_BRANCHES[_kind(a)]
    ta, fa = g.choice(true_options), g.choice(false_options)
    to_np = lambda t: t.replace("M.", "np.").format(a="W(a)")  # noqa: E731
    g.emit(
        f"FJ.cond(M.max({p.name}) > 0, lambda a: {ta.format(a='a')}, lambda a: {fa.format(a='a')}, {a.name})",
        f"C(R.cond(np.max({p.name}) > 0, lambda a: {to_np(ta)}, lambda a: {to_np(fa)}, {a.name}), {{T}})",
        exact=a.exact and not a.is_float,
    )


@builder("for")
def _fori_loop(g: Gen) -> None:
    c = g.need(lambda v: v.is_float or not g.smooth)
    n = g.draw(st.integers(0, 3))
    t = c.dtype
    if c.dtype == "bool":  # bools are carried as bytes in compiled loops
        g.emit(
            f"FJ.fori_loop(0, {n}, lambda i, c: M.logical_xor(c, i % 2 == 0), {c.name})",
            f"R.fori_loop(0, {n}, lambda i, c: np.logical_xor(c, i % 2 == 0), {c.name})",
            exact=c.exact,
        )
        return
    if c.is_int:
        g.emit(
            f"FJ.fori_loop(0, {n}, lambda i, c: (c * 2 - i).astype({t!r}), {c.name})",
            f"R.fori_loop(0, {n}, lambda i, c: C(c * 2 - i, {t!r}), {c.name})",
            exact=c.exact,
        )
        return
    x = g.broadcast_partner(c, lambda v: v.is_float and np.broadcast_shapes(v.shape, c.shape) == c.shape) or c
    g.emit(
        f"FJ.fori_loop(0, {n}, lambda i, c: (c * 0.5 + M.tanh({x.name}) + i).astype({t!r}), {c.name})",
        f"R.fori_loop(0, {n}, lambda i, c: C(W(c) * 0.5 + np.tanh({_w(x)}) + i, {t!r}), {c.name})",
        exact=False,
    )


@builder("while")
def _while_loop(g: Gen) -> None:
    c = g.need(lambda v: v.is_float)
    n = g.draw(st.integers(0, 3))
    t = c.dtype
    g.emit(
        f"FJ.while_loop(lambda s: s[0] < {n}, lambda s: (s[0] + 1, (s[1] * 0.5 + 1).astype({t!r})), "
        f"(M.asarray(0), {c.name}))[1]",
        f"R.while_loop(lambda s: s[0] < {n}, lambda s: (s[0] + 1, C(W(s[1]) * 0.5 + 1, {t!r})), (0, {c.name}))[1]",
        exact=False,
    )


@builder("read_variable", "assign", "assign_add", "assign_sub")
def _variable(g: Gen) -> None:
    a = g.need(lambda v: v.is_float or v.is_int)
    name = f"var{len(g.program.variables)}"
    init = np.asarray(g.rng.integers(-4, 5, size=a.shape)).astype(a.array.dtype)
    g.program.variables[name] = init
    g.fj_vars[name] = fj.Variable(init.copy())
    g.np_env[name] = numpy_ref.Var(init)
    update = g.choice(["assign", "assign_add", "assign_sub"])
    # The update runs plainly, or inside a loop or a branch: state threaded through regions.
    where = g.choice(["plain", "loop", "branch"])
    if where == "plain":
        g.effect(f"{name}.{update}({a.name})", f"{name}.{update}({a.name})")
    elif where == "loop":
        n = g.draw(st.integers(0, 3))
        body = "lambda i, c: ({var}.{update}(c * 2), c)[1]"
        g.effect(
            f"FJ.fori_loop(0, {n}, {body.format(var=name, update=update)}, {a.name})",
            f"R.fori_loop(0, {n}, {body.format(var=name, update=update)}, {a.name})",
        )
    else:
        p = g.need(lambda v: v.exact and v.dtype != "bool" and v.array.size > 0)
        branch = "lambda c: ({var}.{update}(c), c)[1]"
        g.effect(
            f"FJ.cond(M.max({p.name}) > 0, {branch.format(var=name, update=update)}, lambda c: c, {a.name})",
            f"R.cond(np.max({p.name}) > 0, {branch.format(var=name, update=update)}, lambda c: c, {a.name})",
        )
    g.emit(f"{name}.value", f"{name}.value", exact=a.exact and update == "assign")


@builder("stop_gradient")
def _stop_gradient(g: Gen) -> None:
    a = g.need(lambda v: v.is_float)
    g.emit(f"FJ.stop_gradient({a.name})", f"R.stop_gradient({a.name})", exact=a.exact)


# Ops whose derivative is defined and smooth on the drawn values: the builders of gradient programs.
SMOOTH_OPS = (
    *UNARY_FLOAT,
    "neg",
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "atan2",
    "broadcast",
    "reshape",
    "transpose",
    "slice",
    "pad",
    "concatenate",
    "sort",
    "reduce_sum",
    "cumsum",
    "linear_recurrence",
    "dot_general",
    "conv2d",
    "select",
    "cond",
    "for",
    "stop_gradient",
)


# --- transformations: statements that wrap drawn ops (`vmap`, `scan`) or index (`.at[]`) -------------
#
# Not keyed by op: they lower to existing ops (vmap's batched forms, scan's `for`, `.at[]`'s
# gather/scatter_add), so `programs()` draws them beside the op builders with some probability.

STATEFUL_OPS = frozenset({"read_variable", "assign", "assign_add", "assign_sub"})  # a variable holds one value


def _draw_body(sub: Gen, max_stmts: int = 3) -> Val:
    """One to `max_stmts` statements drawn by the op builders in a `Gen.region`; returns the last."""
    ops = sorted(SMOOTH_OPS if sub.smooth else set(BUILDERS) - STATEFUL_OPS)
    wanted = sub.draw(st.integers(1, max_stmts))
    for _ in range(3 * wanted):
        if len(sub.program.stmts) >= wanted:
            break
        try:
            BUILDERS[sub.draw(st.sampled_from(ops))](sub)
        except Rejected:
            continue
    if not sub.program.stmts:
        raise Rejected
    last = sub.program.stmts[-1].name
    return next(v for v in sub.vals if v.name == last)


def _check_body(sub: Gen, bindings: list[dict]) -> None:
    """A body is drawn (and checked safe) for one binding of its parameters: reject it unless every
    statement is also finite and moderate for every other binding (each example, each step)."""
    for binding in bindings:
        env = {**sub.np_env, **binding}
        for s in sub.program.stmts:
            with np.errstate(all="ignore"):
                value = np.asarray(eval(s.np, env)).astype(np.float64)
            if not np.all(np.isfinite(value)) or np.max(np.abs(value), initial=0.0) > MAX_MAGNITUDE:
                raise Rejected
            env[s.name] = value.astype(np.asarray(env[s.name]).dtype)


def inline(stmts: list, name: str) -> tuple[str, str]:
    """The flowjit and numpy expressions of the region value `name`, its `t0`, `t1`, ... inlined."""
    fj_exprs, np_exprs = {}, {}
    for s in stmts:
        fj_exprs[s.name] = re.sub(r"\bt\d+\b", lambda m: f"({fj_exprs[m.group()]})", s.fj)
        np_exprs[s.name] = re.sub(r"\bt\d+\b", lambda m: f"({np_exprs[m.group()]})", s.np)
    return fj_exprs[name], np_exprs[name]


def _render_vmap(levels: list, params: list[str], args: list[str], fj_body: str, np_body: str) -> tuple[str, str]:
    """`FJ.vmap(lambda a, b: BODY, in_axes=..., out_axes=...)(x, y)`, nested once per level
    (outermost first; each `(in axes per param, out axis, size)`), and its numpy rendering: the body
    evaluated per example, `np.stack`ed along the out axis."""
    fj_text, np_text, lam = fj_body, np_body, ", ".join(params)
    for k in reversed(range(len(levels))):
        axes, out_axis, size = levels[k]
        call = args if k == 0 else params
        in_axes = axes[0] if len(axes) == 1 else tuple(axes)
        options = ("" if in_axes == 0 else f", in_axes={in_axes!r}") + (
            "" if out_axis == 0 else f", out_axes={out_axis}"
        )
        fj_text = f"FJ.vmap(lambda {lam}: {fj_text}{options})({', '.join(call)})"
        sliced = [arg if axis is None else f"np.take({arg}, i{k}, axis={axis})" for arg, axis in zip(call, axes)]
        np_text = (
            f"np.stack([(lambda {lam}: {np_text})({', '.join(sliced)}) for i{k} in range({size})], axis={out_axis})"
        )
    return fj_text, np_text


def _vmap(g: Gen) -> None:
    # `a` is mapped (one axis, or two by a nested vmap); `b`, when there is one, is the same for
    # every example (in_axes None) or mapped along an axis of the same size.
    x = g.need(lambda v: len(v.shape) >= 1 and v.array.size > 0)
    x_axes, sizes, a = [], [], x.array
    for _ in range(2 if len(x.shape) >= 2 and g.draw(st.integers(0, 3)) == 0 else 1):
        axis = g.draw(st.integers(-a.ndim, a.ndim - 1))
        x_axes.append(axis)
        sizes.append(a.shape[axis])
        a = np.take(a, 0, axis=axis)
    if math.prod(sizes) > 64:
        raise Rejected
    form = g.choice(["one", "unmapped", "mapped"])
    y = g.pick(lambda v: sizes[0] in v.shape) if form == "mapped" else g.pick() if form == "unmapped" else None
    params, args, y_axis = ["a"], [x.name], None
    region_params = [Val("a", a, x.exact)]
    if y is not None:
        params.append("b")
        args.append(y.name)
        if form == "mapped":
            y_axis = g.choice([i for i, d in enumerate(y.shape) if d == sizes[0]])
        b = y.array if y_axis is None else np.take(y.array, 0, axis=y_axis)
        region_params.append(Val("b", b, y.exact))
    sub = g.region(region_params)
    result = _draw_body(sub)
    bindings = []
    for example in itertools.product(*map(range, sizes)):
        a = x.array
        for axis, i in zip(x_axes, example):
            a = np.take(a, i, axis=axis)
        binding = {"a": a}
        if y is not None:
            binding["b"] = y.array if y_axis is None else np.take(y.array, example[0], axis=y_axis)
        bindings.append(binding)
    _check_body(sub, bindings)
    fj_body, np_body = inline(sub.program.stmts, result.name)
    levels = []
    for k, (axis, size) in enumerate(zip(x_axes, sizes)):
        rank = result.array.ndim + len(sizes) - k  # of this level's output
        out_axis = g.choice([0, 0, *range(-rank, rank)])
        y_axes = [] if y is None else [y_axis if k == 0 else None]
        levels.append(([axis, *y_axes], out_axis, size))
    fj_text, np_text = _render_vmap(levels, params, args, fj_body, np_body)
    g.adopt(sub)
    g.emit(fj_text, np_text, exact=result.exact)


def _at_index(g: Gen, v: Val) -> tuple[str, str, bool]:
    """An index for `v.at[...]`: (flowjit text, numpy text of the index tuple, whether entry 0 is
    traced). Static ints, slices and integer lists (repeats included) stay in range (numpy's
    error otherwise); traced indices (an input, or `M.asarray` of a list) go out of range on
    purpose: their updates are dropped."""
    n = v.shape[0]
    form = g.choice(["int", "slice", "list", "constant"] + ["input"] * (not g.smooth))
    if form == "int":
        first = str(g.draw(st.integers(-n, n - 1)))
    elif form == "slice":
        start = g.draw(st.integers(0, n - 1))
        stop = g.draw(st.integers(start + 1, n))
        first = g.choice([f"{start}:{stop}", f"{start}:{stop}:2", "::-1", ":"])
    elif form == "list":
        first = repr([g.draw(st.integers(-n, n - 1)) for _ in range(g.draw(st.integers(1, 4)))])
    elif form == "constant":
        first = repr([g.draw(st.integers(-n - 2, n + 1)) for _ in range(g.draw(st.integers(1, 4)))])
    else:
        shape = g.choice([(), (g.draw(st.integers(1, 4)),)])
        first = g.new_input(shape, g.choice(INT_DTYPES), index_range=n).name
    fj_first = f"M.asarray({first})" if form == "constant" else first
    np_first = f"np.array({first})" if form == "constant" else first
    rest = ""
    if len(v.shape) >= 2 and g.draw(st.booleans()):
        m = v.shape[1]
        start = g.draw(st.integers(0, m - 1))
        rest = g.choice([str(g.draw(st.integers(-m, m - 1))), f"{start}:{g.draw(st.integers(start + 1, m))}"])
    fj_index = fj_first + (f", {rest}" if rest else "")
    np_index = f"np.s_[{np_first}, {rest}]" if rest else f"np.s_[{np_first},]"
    return fj_index, np_index, form in ("constant", "input")


def _at_update(g: Gen) -> None:
    v = g.need(lambda v: len(v.shape) >= 1 and min(v.shape) > 0 and (v.is_float or v.is_int))
    kind = g.choice(["set", "add", "multiply"] + ["min", "max"] * (not g.smooth))
    fj_index, np_index, traced = _at_index(g, v)
    target = numpy_ref.at_positions(v.shape, eval(np_index, g.np_env), traced).shape

    def fits(w: Val) -> bool:
        kind_ok = (w.is_float and (v.is_float or w.exact)) or w.is_int
        return kind_ok and len(w.shape) <= len(target) and _broadcasts_into(w.shape, target)

    form = g.choice(["scalar", "value", "input"])
    u = g.pick(fits) if form == "value" else None
    if u is None and form != "scalar":
        shape = target if g.draw(st.booleans()) else target[-1:]
        u = g.new_input(shape, v.dtype)
    if u is None:
        fu = nu = g.choice(["2", "-3", "1"] if v.is_int else ["0.5", "-1.25", "2.5"])
        u_exact = True
    else:
        fu, nu, u_exact = u.name, _w(u), u.exact
    g.emit(
        f"{v.name}.at[{fj_index}].{kind}({fu})",
        f"C(R.at_update(W({v.name}), {np_index}, W(C({nu}, {{T}})), {kind!r}, traced={traced}), {{T}})",
        exact=v.exact and u_exact and (kind in ("set", "min", "max") or v.is_int),
    )


def _scan(g: Gen) -> None:
    # The carry contracts (c * 0.5 + tanh(x)), so it stays moderate over any number of steps; each
    # step's output y is a body drawn by the op builders over (c, x).
    c = g.need(lambda v: v.is_float)
    t = c.dtype
    reverse = g.draw(st.booleans())
    which = g.choice([0, 1])  # the final carry, or the stacked ys

    def fits(v: Val) -> bool:
        return v.is_float and len(v.shape) >= 1 and 0 < v.shape[0] <= 8 and _broadcasts_into(v.shape[1:], c.shape)

    xs = g.pick(fits) if g.draw(st.integers(0, 3)) else None
    options = ", reverse=True" if reverse else ""
    if xs is None:
        length = g.draw(st.integers(0, 3))
        g.emit(
            f"FJ.scan(lambda c, x: ((c * 0.5 + 1).astype({t!r}), M.sin(c)), {c.name}, None, length={length}{options})"
            f"[{which}]",
            f"R.scan(lambda c, x: (C(W(c) * 0.5 + 1, {t!r}), C(np.sin(W(c)), {t!r})), {c.name}, None, {length}, "
            f"{reverse})[{which}]",
            exact=False,
        )
        return
    steps = list(reversed(range(xs.shape[0]))) if reverse else list(range(xs.shape[0]))
    carry, bindings = c.array, []
    for step in steps:
        bindings.append({"c": carry, "x": xs.array[step]})
        carry = (numpy_ref.W(carry) * 0.5 + np.tanh(numpy_ref.W(xs.array[step]))).astype(carry.dtype)
    sub = g.region([Val("c", c.array, exact=False), Val("x", xs.array[steps[0]], xs.exact)])
    result = _draw_body(sub)
    _check_body(sub, bindings)
    fj_y, np_y = inline(sub.program.stmts, result.name)
    g.adopt(sub)
    g.emit(
        f"FJ.scan(lambda c, x: ((c * 0.5 + M.tanh(x)).astype({t!r}), {fj_y}), {c.name}, {xs.name}{options})[{which}]",
        f"R.scan(lambda c, x: (C(W(c) * 0.5 + np.tanh(W(x)), {t!r}), {np_y}), {c.name}, {xs.name}, None, "
        f"{reverse})[{which}]",
        exact=which == 1 and result.exact,
    )


def _broadcasts_into(shape: tuple, target: tuple) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


@dataclass(frozen=True)
class Transform:
    """A transformation statement's builder, the text that marks it in a program's flowjit source,
    and whether flowjit has it yet (`scan` lands from its own branch)."""

    build: Callable[[Gen], None]
    marker: str
    available: Callable[[], bool] = lambda: True


TRANSFORMS = {
    "vmap": Transform(_vmap, "FJ.vmap("),
    "at": Transform(_at_update, ".at["),
    "scan": Transform(_scan, "FJ.scan(", lambda: hasattr(fj, "scan")),
}
TRANSFORM_SHARE = 6  # one drawn statement in this many is a transformation


def transforms_in(program: Program) -> set[str]:
    """The transformations `program` uses."""
    source = program.flowjit_source()
    return {name for name, t in TRANSFORMS.items() if t.marker in source}


@st.composite
def programs(draw, max_stmts: int = 10, smooth: bool = False, require: str | None = None) -> Program:
    """A random valid program. `smooth`: float64, differentiable ops only (for gradient checks).
    `require`: a transformation (a `TRANSFORMS` name) the program uses, tried first."""
    g = Gen(draw, smooth)
    # Finite differences cost two evaluations per input element: gradient programs stay tiny.
    base = draw(st.sampled_from(BASE_SHAPES[:8] if smooth else BASE_SHAPES))
    for _ in range(draw(st.integers(1, 3))):
        shape = base if draw(st.booleans()) else tuple(1 if draw(st.booleans()) else d for d in base)
        g.new_input(shape, "f64" if smooth else draw(st.sampled_from(INPUT_DTYPES)))
    ops = sorted(SMOOTH_OPS) if smooth else sorted(BUILDERS)
    transforms = [name for name, t in TRANSFORMS.items() if t.available()]
    wanted = draw(st.integers(1, max_stmts))
    for _ in range(20 if require else 0):
        try:
            TRANSFORMS[require].build(g)
            break
        except Rejected:
            continue
    # Builders that do not apply to the values at hand are skipped; a bounded number of tries keeps
    # generation fast when few apply.
    for _ in range(3 * wanted):
        if len(g.program.stmts) >= wanted:
            break
        if transforms and draw(st.integers(1, TRANSFORM_SHARE)) == 1:
            # Which one by the program's rng: hypothesis' draws lean to the first of a list, and
            # every transformation should be drawn about as often.
            build = TRANSFORMS[transforms[g.rng.integers(len(transforms))]].build
        else:
            build = BUILDERS[draw(st.sampled_from(ops))]
        try:
            build(g)
        except Rejected:
            continue
    made = [s.name for s in g.program.stmts if s.name]
    used = {name for s in g.program.stmts for name in re.findall(r"\bv\d+\b", s.fj)}
    # Every unused value is an output (nothing is dead); a drawn subset of the others too.
    g.program.outputs = [n for n in made if n not in used or draw(st.booleans())] or [next(iter(g.program.inputs))]
    return g.program
