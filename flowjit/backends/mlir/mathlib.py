"""Vectorizable math functions, emitted as scalar MLIR in `linalg.generic` bodies (the CPU's and the
GPU's `MathLibrary`: they make no calls, so PTX has no unresolved externals either).

MLIR 22 lowers `math.exp`, `math.tanh`, ... to LLVM intrinsics that the x86 backend scalarizes into
libm calls (`expf`, `tanhf`: up to 30x slower than vector code, see TOOLCHAIN.md §1). For float32 we
therefore emit our own branch-free approximations from `arith`/`math.fma`/`math.roundeven`/bit casts
only; LLVM vectorizes the loop around them (vfmadd, vrndscale, vpslld, blends) and the code makes no
calls. Special values are handled with `arith.cmpf` + `arith.select`, never with branches.

Contract: `MATH[name](b, x, elem) -> result` and `MATH_BINARY[name](b, x, y, elem) -> result` take a
`ScalarBuilder`, the SSA name(s) of the operand(s) and their MLIR element type ("f16", "bf16", "f32",
"f64"), emit the computation and return the SSA name of a result of the same element type. Every
emitted op is lowered by the "llvm-dialect" stage (`pipeline.py`). `truncate_to_bf16(b, x)` is the f32 -> bf16
rounding the backend should use everywhere (see below).

- f32: own polynomials (below). f16 / bf16: `arith.extf` to f32, the f32 code, then one rounding
  back (`arith.truncf` for f16; integer round-to-nearest-even for bf16, because `arith.truncf` to
  bf16 becomes vcvtneps2bf16 on AVX512-BF16 hosts, which flushes denormals to zero).
- f64 (numpy accuracy required): exp, log, log1p, expm1, tanh, logistic use our own float64
  polynomials (same algorithms, float64 fits; vectorized, no calls). sin, cos, erf, atan2, pow
  emit `math.sin`/`math.cos`/`math.erf`/`math.atan2`/`math.powf`, which become scalar libm calls
  (correct, 5-50x slower; visible as calls in the assembly dump; erf/atan2/pow rely on
  `convert-math-to-libm` in the pipeline): a float64 sin/cos over the whole range needs a
  Payne-Hanek reduction, and exp(y log x) in float64 would lose ~10 bits for pow. Targets without
  libm (the GPU) take call-free float64 versions of these from `mathlib_f64.py`. sqrt and rsqrt
  are vector instructions for all types.
- pow: float32 (and f16/bf16) is exp(y log|x|) evaluated with the float64 polynomials, then the
  C99/numpy special cases by selects (x^0 = 1, 1^y = 1, signed zeros and infinities, odd integer
  powers of negative x, nan for finite x < 0 with non-integer y).

Float32 algorithms:
- exp: n = round(x log2 e), r = x - n ln2 (two-constant Cody-Waite with fma), exp(r) = 1 + r +
  r^2 P(r) with P a degree-4 minimax fit (Cephes' degree 5 is no more accurate in float32), 2^n
  applied as two exact power-of-two factors built by integer shift + bitcast, so results down
  into the denormals and up to FLT_MAX are right; overflow gives inf, underflow 0, nan stays nan
  through ordered clamps. Vectorized on AVX-512, the factors become one `vscalefps` per register,
  same bits (`ldexp.py`).
- log: exponent/mantissa split by bit operations (denormal inputs are pre-scaled by 2^23), mantissa in
  [sqrt(1/2), sqrt(2)), Cephes degree-8 polynomial. log(0) = -inf, log(x<0) = nan, log(inf) = inf.
- log1p: log(u) + (x - (u - 1)) / u with u = 1 + x (the correction term restores the bits rounded off
  in 1 + x); tiny x returns x.
- expm1: same reduction as exp, expm1(r) by the polynomial, then 2^n expm1(r) + (2^n - 1) in one fma.
- tanh: e / (e + 2) with e = expm1(2|x|) (|x| clamped at 9.1), sign copied (tanh(-0) = -0);
  exactly +-1 once the true value rounds to it (|x| >= 9.01: e + 2 rounds to e). One expression for
  every |x|, 2^n as one `vscalef` of 1 (`_power_of_two`): 46 vector instructions per 16 floats of
  the elementwise chain tanh(0.7x + 0.1) * sigmoid(x) + 0.5x instead of 57 with a separate odd
  polynomial for |x| < 0.625, and that chain 18% faster on a 2-core AMD EPYC Zen 4 VM. The price is
  the rounding of e + 2 next to 2: 2.61 ulp at most (exhaustive over |x| in [2^-14, 9.2]; 1.32 with
  the odd polynomial),
  mean 0.26 ulp there, 0.05-0.28 on uniform or normal samples, where numpy's own float32 tanh
  averages 0.17-0.23 (max 1.37).
- logistic: e = exp(-|x|) never overflows; 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0.
- erf: x + x P(x^2) for |x| < 1 (degree 6), 1 - Q(|x| - 2.425) for 1 <= |x| < 3.85 (degree 14, erfc
  fit), +-1 beyond (where erf rounds to 1 in float32). Coefficients: Chebyshev fits in 40-digit
  arithmetic (mpmath.chebyfit), rounded to float32.
- sin/cos: n = round(x 2/pi), r = x - n pi/2 by a three-part Cody-Waite split of pi/2 with fma,
  done in float64 (the only float64 step; exact enough next to the zeros of sin/cos and for all
  |x| < 2^48), Cephes sin/cos polynomials on [-pi/4, pi/4] in float32, quadrant = n mod 4 computed
  in float (never out of integer range). |x| >= 2^48 (~2.8e14; no Payne-Hanek reduction) and +-inf
  give nan.
- atan2: t = min(|x|, |y|) / max(|x|, |y|) in [0, 1], atan(t) = t + t^3 P(t^2) (degree-9 fit),
  then pi/2 - a and pi - a with two-part constants; IEEE special cases (signed zeros,
  infinities) by selects.
- float64 exp/expm1 use a degree-10 polynomial on the same reduction; float64 log uses
  s = f / (2 + f) and log(1+f) = f - f^2/2 + s (f^2/2 + z P(z)), z = s^2 (degree 7); float64 tanh
  is x + x^3 P(x^2) (P of degree 12) below 0.625 and expm1(2|x|) / (expm1(2|x|) + 2) above. These
  coefficients are Chebyshev fits in 50-digit arithmetic (mpmath.chebyfit), rounded to float64.

Accuracy of the float32 code against numpy float64, over every 61st float32 bit pattern (70M inputs
over all exponents, both signs, denormals, inf, nan) plus special values (+-0, smallest/largest
denormals, FLT_MIN, FLT_MAX, overflow/underflow thresholds, integers, half-integers, multiples of
pi/4); atan2/pow on the sweep paired with a shuffled copy plus all pairs of special values. ulp =
spacing of the reference rounded to float32; a result equal to the correctly rounded value counts 0.
Relative error over normal results, absolute error over results with |ref| <= 1. Maxima include a
second sweep on 16M uniform samples in [-10, 10]. `python tests/test_mathlib.py` reproduces it.

    function  max ulp  max rel.  max abs.  notes
    exp       1.00     8.2e-8    4.9e-8    0 below -103.97, inf above 88.72
    log       0.82     7.9e-8    4.6e-8    denormal inputs included
    log1p     1.44     1.3e-7    6.3e-8    worst next to 0 (x = -8.9e-8)
    expm1     1.40     1.1e-7    5.6e-8
    tanh      2.61     1.8e-7    8.9e-8    exactly +-1 for |x| >= 9.01 (exhaustive max)
    logistic  2.30     1.7e-7    8.9e-8    denormal results for x in [-103.9, -87.3]
    erf       1.26     8.6e-8    7.4e-8    exactly +-1 for |x| >= 3.85
    sin, cos  1.57     1.3e-7    9.4e-8    for |x| < 2^48 (nan beyond); near zeros of sin/cos too
    sqrt      0 (correctly rounded)
    rsqrt     1.49     8.9e-8    8.7e-8    1 / sqrt(x): two roundings
    atan2     1.48     1.6e-7    7.2e-8    IEEE signed-zero / infinity cases exact
    pow       0.50     6.0e-8    3.0e-8    float64 exp/log inside: correctly rounded but for ties

f16 and bf16: every one of the 65536 inputs is within 1 ulp of numpy (float32 result rounded once).
f64 against numpy float64 (4M random bit patterns + uniform and log-uniform samples): exp, log,
log1p 1 ulp; expm1, tanh, logistic 2 ulp; libm functions as libm. The test allows 2 ulp (4 for
tanh, logistic, rsqrt, where numpy's own result is ~1.5 ulp off).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from flowjit.backends.mlir.emitter import ScalarBuilder

# The attribute marking exp's power-of-two factors, which the CPU rewrites into `vscalef` on AVX-512
# hosts (`backends/cpu/ldexp.py`); other targets ignore it.
LDEXP_TAG = "fj.ldexp"

_INT = {"f32": "i32", "f64": "i64"}
# (exponent bias, mantissa bits) of the binary formats
_FORMAT = {"f32": (127, 23), "f64": (1023, 52)}


class _Arith:
    """Emits arithmetic on one float element type through a ScalarBuilder; values are SSA names."""

    def __init__(self, b: ScalarBuilder, elem: str):
        self.b = b
        self.t = elem
        self.it = _INT[elem]
        self._consts: dict[tuple[str, str], str] = {}

    def c(self, value: float) -> str:
        return self._const(value, self.t)

    def ci(self, value: int) -> str:
        return self._const(value, self.it)

    def _const(self, value, elem: str) -> str:
        key = (repr(value), elem)  # repr keeps -0.0 apart from 0.0
        if key not in self._consts:
            self._consts[key] = self.b.const(value, elem)
        return self._consts[key]

    def _bin(self, op: str, x: str, y: str) -> str:
        return self.b.op(f"{op} {x}, {y} : {self.t}")

    def add(self, x: str, y: str) -> str:
        return self._bin("arith.addf", x, y)

    def sub(self, x: str, y: str) -> str:
        return self._bin("arith.subf", x, y)

    def mul(self, x: str, y: str) -> str:
        return self._bin("arith.mulf", x, y)

    def div(self, x: str, y: str) -> str:
        return self._bin("arith.divf", x, y)

    def fma(self, x: str, y: str, z: str) -> str:
        """x * y + z with one rounding."""
        return self.b.op(f"math.fma {x}, {y}, {z} : {self.t}")

    def poly(self, x: str, coeffs: list[float]) -> str:
        """Horner evaluation with fma; `coeffs` from the highest degree down."""
        acc = self.c(coeffs[0])
        for coeff in coeffs[1:]:
            acc = self.fma(acc, x, self.c(coeff))
        return acc

    def unary(self, op: str, x: str) -> str:
        return self.b.op(f"{op} {x} : {self.t}")

    def abs(self, x: str) -> str:
        return self.unary("math.absf", x)

    def copysign(self, magnitude: str, sign: str) -> str:
        return self._bin("math.copysign", magnitude, sign)

    def cmp(self, predicate: str, x: str, y: str) -> str:
        return self.b.op(f"arith.cmpf {predicate}, {x}, {y} : {self.t}")

    def select(self, cond: str, x: str, y: str) -> str:
        return self.b.op(f"arith.select {cond}, {x}, {y} : {self.t}")

    def both(self, p: str, q: str) -> str:
        return self.b.op(f"arith.andi {p}, {q} : i1")

    def either(self, p: str, q: str) -> str:
        return self.b.op(f"arith.ori {p}, {q} : i1")

    def negation(self, p: str) -> str:
        return self.b.op(f"arith.xori {p}, {self._const(1, 'i1')} : i1")

    def isnan(self, x: str) -> str:
        return self.cmp("uno", x, x)

    def bits(self, x: str) -> str:
        return self.b.op(f"arith.bitcast {x} : {self.t} to {self.it}")

    def from_bits(self, i: str) -> str:
        return self.b.op(f"arith.bitcast {i} : {self.it} to {self.t}")

    def iop(self, op: str, x: str, y: str) -> str:
        return self.b.op(f"arith.{op} {x}, {y} : {self.it}")

    def to_int(self, x: str) -> str:
        return self.b.op(f"arith.fptosi {x} : {self.t} to {self.it}")

    def to_float(self, i: str) -> str:
        return self.b.op(f"arith.sitofp {i} : {self.it} to {self.t}")

    def pow2_int(self, n: str) -> str:
        """2**n for an integer n (of the matching integer type) in the normal exponent range."""
        bias, mantissa_bits = _FORMAT[self.t]
        return self.from_bits(self.iop("shli", self.iop("addi", n, self.ci(bias)), self.ci(mantissa_bits)))


# ---------------------------------------------------------------------------------------------
# Polynomial code. exp, expm1, log, log1p, logistic and tanh exist for f32 and f64 (same
# algorithms, per-type constants); erf, sin, cos, atan2 for f32 only.

_LOG2E = 1.4426950408889634
# ln2 = hi + lo, hi with trailing zero bits so n * hi is exact for every exponent n
_LN2 = {"f32": (0.693359375, -2.12194440e-4), "f64": (float.fromhex("0x1.62e42fee00000p-1"), 1.9082149292705877e-10)}
# Clamps of the argument of exp: below, the result rounds to 0; above, it overflows to inf.
_EXP_RANGE = {"f32": (-104.0, 88.8), "f64": (-746.0, 709.9)}
# expm1 rounds to -1 below -17.4 (f32) / -37.5 (f64)
_EXPM1_LOW = {"f32": -25.0, "f64": -40.0}
# exp(r) = 1 + r + r^2 P(r) on [-ln2/2, ln2/2], P of degree 4: minimax fit of exp's relative error
# (3.1e-9 = 0.05 ulp in float64; Cephes expf's P has degree 5 for no measurable gain in float32:
# 0.839 vs 0.837 ulp evaluated in float32 over the reduced range, one fma fewer per exp)
_EXP_P = [1.3814611593e-3, 8.3687100559e-3, 4.1668388993e-2, 1.6666521132e-1, 4.9999994040e-1]
# float64: exp(r) = 1 + r + r^2 P(r) on [-ln2/2, ln2/2], Chebyshev fit (error 1.4e-18 on P)
_EXP_P64 = [
    2.0914679376583935e-09,
    2.510520637395701e-08,
    2.7557273661348637e-07,
    2.7557255425746435e-06,
    2.4801587325533363e-05,
    0.00019841269874800493,
    0.0013888888888883752,
    0.008333333333326141,
    0.04166666666666667,
    0.1666666666666667,
    0.5,
]
_EXP_POLY = {"f32": _EXP_P, "f64": _EXP_P64}
# float64 tanh(x) = x + x^3 P(x^2) for |x| < 0.625 (Chebyshev fit, error 1.4e-19 on P)
_TANH_P64 = [
    -2.438831631472088e-06,
    1.2209921790162781e-05,
    -3.708106921544234e-05,
    9.604109157026265e-05,
    -0.00023888944636751174,
    0.0005899818158388232,
    -0.0014558283998303246,
    0.003592127507599252,
    -0.008863235499801992,
    0.021869488535133222,
    -0.0539682539682359,
    0.13333333333333322,
    -0.3333333333333333,
]
# float64 log: log(1+f) = f - f^2/2 + s (f^2/2 + z P(z)), s = f / (2 + f), z = s^2 <= 0.0295;
# z P(z) fits 2 atanh(s) / s - 2 (Chebyshev, error 2e-18 on P)
_LOG_P64 = [
    0.13086767009948175,
    0.13268759668560612,
    0.15386240205813478,
    0.18181795630884753,
    0.2222222239180047,
    0.2857142857080323,
    0.4000000000000088,
    0.6666666666666666,
]
# Cephes logf: log(1+m) = m - m^2/2 + m^3 P(m) for 1+m in [sqrt(1/2), sqrt(2))
_LOG_P = [
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
]
# erf(x) = x + x P(x^2) on |x| < 1
_ERF_SMALL = [
    7.875875062685488e-05,
    -0.000801686428716587,
    0.005189087423433974,
    -0.026854212010626412,
    0.11283594715160218,
    -0.37612626666720334,
    0.12837916584835093,
]
# erfc(|x|) = Q(|x| - 2.425) on 1 <= |x| < 3.85
_ERFC_MID = 2.425
_ERFC_Q = [
    -1.3004556964379648e-06,
    3.625043516149725e-07,
    1.8674359093165825e-05,
    -3.147454671047829e-05,
    -6.874758328790887e-05,
    0.0003231043135830673,
    -0.0004491750820663766,
    -0.00034467321615709053,
    0.003032946901398698,
    -0.007428043111053536,
    0.011159827914956582,
    -0.011306094038646583,
    0.007642648933683033,
    -0.003151552175425808,
    0.0006047659898612764,
]
_TANH_ONE = 9.1  # tanh rounds to 1 in float32 from 9.01 on
_ERF_ONE = 3.85  # erfc(3.85) < 2**-25: erf rounds to 1 in float32 from here on
# pi/2 = _PIO2[0] + _PIO2[1] + _PIO2[2] to ~160 bits (each part a float64)
_PIO2 = [
    float.fromhex("0x1.921fb54442d18p+0"),
    float.fromhex("0x1.1a62633145c07p-54"),
    float.fromhex("-0x1.f1976b7ed8fbcp-110"),
]
_SINCOS_LIMIT = 2.0**48  # float64 Cody-Waite stays exact below; beyond (and for inf) sin/cos return nan
_SIN_P = [-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1]  # sin r = r + r^3 P(r^2)
_COS_P = [2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2]  # cos r = 1 - r^2/2 + r^4 P(r^2)
# atan(t) = t + t^3 P(t^2) on [0, 1] (Chebyshev fit, error 2.5e-9 on P)
_ATAN_P = [
    0.0014886919393047597,
    -0.009144629760592396,
    0.026305001110062377,
    -0.04896051402709067,
    0.07031914250029966,
    -0.08931826777381315,
    0.11088261628735159,
    -0.1428400379473353,
    0.19999949321141888,
    -0.3333333308107325,
]
_PI_OVER_2_F32 = (1.5707963705062866, -4.371138828673793e-08)  # pi/2 = hi + lo, both float32
_PI_F32 = (3.1415927410125732, -8.742277657347586e-08)
_FLT_MIN = 2.0**-126


def _clamp(m: _Arith, x: str, lo: float, hi: float) -> str:
    """x limited to [lo, hi]; nan becomes `hi` (callers restore nan at the end)."""
    x = m.select(m.cmp("ugt", x, m.c(hi)), m.c(hi), x)
    return m.select(m.cmp("olt", x, m.c(lo)), m.c(lo), x)


def _reduce_ln2(m: _Arith, x: str) -> tuple[str, str]:
    """(n, r) with x = n ln2 + r, n integral, |r| <= ln2/2."""
    ln2_hi, ln2_lo = _LN2[m.t]
    n = m.unary("math.roundeven", m.mul(x, m.c(_LOG2E)))
    r = m.fma(n, m.c(-ln2_hi), x)
    r = m.fma(n, m.c(-ln2_lo), r)
    return n, r


def _exp(m: _Arith, x: str, nonpositive: bool = False) -> str:
    """exp(x); with `nonpositive`, only for x <= 0 (or nan): no clamp from above (logistic's
    exp(-|x|)).

    nan runs through the clamps and the polynomial as nan; only the conversion of n to an integer
    (poison for nan in LLVM) sees 0 instead. Vectorized with `vscalef` (`ldexp.py`), that
    conversion and its guard are dead: nan * 2^nan is nan, with no compare and select per exp."""
    lo, hi = _EXP_RANGE[m.t]
    xc = x if nonpositive else _at_most(m, x, hi)
    xc = _at_least(m, xc, lo)
    n, r = _reduce_ln2(m, xc)
    p = m.poly(r, _EXP_POLY[m.t])
    y = m.add(m.fma(p, m.mul(r, r), r), m.c(1.0))
    # 2^n as 2^(n//2) * 2^(n - n//2): each factor is a normal float over the whole clamped
    # range, so denormal results are rounded once and exp(88.72) (f32) does not overflow early.
    ni = _to_int_exponent(m, n)
    n1 = m.iop("shrsi", ni, m.ci(1))
    return _scaled(m, m.mul(y, m.pow2_int(n1)), m.pow2_int(m.iop("subi", ni, n1)))


def _at_most(m: _Arith, x: str, hi: float) -> str:
    """min(x, hi) with nan kept: one `vminps hi, x` on x86."""
    return m.select(m.cmp("olt", m.c(hi), x), m.c(hi), x)


def _at_least(m: _Arith, x: str, lo: float) -> str:
    """max(x, lo) with nan kept: one `vmaxps lo, x` on x86."""
    return m.select(m.cmp("olt", x, m.c(lo)), m.c(lo), x)


def _to_int_exponent(m: _Arith, n: str) -> str:
    """Integral float n (nan allowed) as an integer: nan becomes 0, as `fptosi` of nan is poison."""
    return m.to_int(m.select(m.isnan(n), m.c(0.0), n))


def _scaled(m: _Arith, y: str, power: str) -> str:
    """y * power, the second of exp's two power-of-two factors of 2^n, tagged for `ldexp.rewrite`
    (one `vscalef` on AVX-512 once vectorized)."""
    return m.b.op(f"arith.mulf {y}, {power} {{{LDEXP_TAG} = 2 : i64}} : {m.t}")


def _power_of_two(m: _Arith, n: str) -> str:
    """2^n for an integral float n in the normal exponent range (nan gives 1, or nan once
    vectorized on AVX-512), tagged for `ldexp.rewrite`: one `vscalef` of 1 by n, instead of the
    guard's compare and select, the conversion, the addition and the shift."""
    bias, mantissa_bits = _FORMAT[m.t]
    exponent = m.iop("shli", m.iop("addi", _to_int_exponent(m, n), m.ci(bias)), m.ci(mantissa_bits))
    return m.b.op(f"arith.bitcast {exponent} {{{LDEXP_TAG} = 0 : i64}} : {m.it} to {m.t}")


def _log_core_f32(m: _Arith, x: str) -> str:
    """log(x) for finite x > 0 (denormals included); other inputs give unspecified values."""
    denormal = m.cmp("olt", x, m.c(_FLT_MIN))
    xs = m.select(denormal, m.mul(x, m.c(2.0**23)), x)
    e_adjust = m.select(denormal, m.c(-23.0), m.c(0.0))
    bits = m.bits(xs)
    exponent = m.iop("subi", m.iop("shrui", bits, m.ci(23)), m.ci(126))
    e = m.add(m.to_float(exponent), e_adjust)
    mantissa = m.from_bits(m.iop("ori", m.iop("andi", bits, m.ci(0x007FFFFF)), m.ci(0x3F000000)))  # [0.5, 1)
    below = m.cmp("olt", mantissa, m.c(math.sqrt(0.5)))
    e = m.select(below, m.sub(e, m.c(1.0)), e)
    f = m.sub(m.select(below, m.add(mantissa, mantissa), mantissa), m.c(1.0))
    ln2_hi, ln2_lo = _LN2["f32"]
    z = m.mul(f, f)
    y = m.mul(m.mul(f, z), m.poly(f, _LOG_P))
    y = m.fma(e, m.c(ln2_lo), y)
    y = m.fma(z, m.c(-0.5), y)
    return m.fma(e, m.c(ln2_hi), m.add(f, y))


def _log_core_f64(m: _Arith, x: str) -> str:
    """log(x) for finite x > 0 (denormals included); other inputs give unspecified values."""
    denormal = m.cmp("olt", x, m.c(2.0**-1022))
    xs = m.select(denormal, m.mul(x, m.c(2.0**52)), x)
    e_adjust = m.select(denormal, m.c(-52.0), m.c(0.0))
    bits = m.bits(xs)
    exponent = m.iop("subi", m.iop("shrui", bits, m.ci(52)), m.ci(1022))
    e = m.add(m.to_float(exponent), e_adjust)
    mantissa_bits = m.iop("andi", bits, m.ci(0x000FFFFFFFFFFFFF))
    mantissa = m.from_bits(m.iop("ori", mantissa_bits, m.ci(0x3FE0000000000000)))  # [0.5, 1)
    below = m.cmp("olt", mantissa, m.c(math.sqrt(0.5)))
    e = m.select(below, m.sub(e, m.c(1.0)), e)
    f = m.sub(m.select(below, m.add(mantissa, mantissa), mantissa), m.c(1.0))
    s = m.div(f, m.add(f, m.c(2.0)))
    z = m.mul(s, s)
    half_f2 = m.mul(m.mul(f, f), m.c(0.5))
    ln2_hi, ln2_lo = _LN2["f64"]
    # e ln2_hi + (f - (f^2/2 - (s (f^2/2 + z P(z)) + e ln2_lo))): the small terms first
    tail = m.fma(s, m.fma(z, m.poly(z, _LOG_P64), half_f2), m.mul(e, m.c(ln2_lo)))
    return m.fma(e, m.c(ln2_hi), m.sub(f, m.sub(half_f2, tail)))


_LOG_CORE = {"f32": _log_core_f32, "f64": _log_core_f64}


def _log_specials(m: _Arith, x: str, y: str) -> str:
    """log-like results at the edges: x = 0 -> -inf, x < 0 -> nan, x = inf -> inf, nan -> nan."""
    y = m.select(m.cmp("oeq", x, m.c(math.inf)), x, y)
    y = m.select(m.cmp("oeq", x, m.c(0.0)), m.c(-math.inf), y)
    return m.select(m.cmp("ult", x, m.c(0.0)), m.c(math.nan), y)


def _log(m: _Arith, x: str) -> str:
    return _log_specials(m, x, _LOG_CORE[m.t](m, x))


def _log1p(m: _Arith, x: str) -> str:
    u = m.add(x, m.c(1.0))
    correction = m.div(m.sub(x, m.sub(u, m.c(1.0))), u)
    y = m.add(_LOG_CORE[m.t](m, u), correction)
    y = m.select(m.cmp("oeq", u, m.c(1.0)), x, y)  # 1 + x rounds to 1: log1p(x) rounds to x (keeps -0)
    return _log_specials(m, u, y)


def _expm1(m: _Arith, x: str) -> str:
    _, high = _EXP_RANGE[m.t]
    xc = _clamp(m, x, _EXPM1_LOW[m.t], high)
    n, r = _reduce_ln2(m, xc)
    p = m.fma(m.poly(r, _EXP_POLY[m.t]), m.mul(r, r), r)  # expm1(r)
    # 2^n p + (2^n - 1); n = bias + 1 (x just below the overflow threshold) uses 2^bias and an exact
    # doubling at the end.
    top = m.c(float(_FORMAT[m.t][0]))
    n_capped = m.select(m.cmp("ogt", n, top), top, n)
    s = _power_of_two(m, n_capped)
    y = m.fma(s, p, m.sub(s, m.c(1.0)))
    y = m.select(m.cmp("ogt", n, top), m.add(y, y), y)
    y = m.select(m.cmp("oeq", x, m.c(0.0)), x, y)  # expm1(-0) = -0
    return m.select(m.isnan(x), x, y)


def _tanh_f32(m: _Arith, x: str) -> str:
    """tanh(x) = e / (e + 2) with e = expm1(2|x|), sign copied: accurate next to 0 (e = 2|x| + ...),
    no branch for small |x|. |x| is clamped at 9.1, past which tanh rounds to 1 (e + 2 rounds to e
    from |x| = 9.01 on), so 2^n stays a normal float and the scaling is one factor."""
    a = _at_most(m, m.abs(x), _TANH_ONE)
    t = m.add(a, a)
    n = m.unary("math.roundeven", m.mul(t, m.c(_LOG2E)))
    # One ln2 constant: its float32 error (1.9e-9) times n <= 27 moves e by up to n 1.9e-9 relative,
    # which e / (e + 2) damps by 2 / (e + 2) < 2^(1 - n): at most 0.02 ulp of tanh.
    r = m.fma(n, m.c(-math.log(2.0)), t)
    p = m.fma(m.poly(r, _EXP_POLY[m.t]), m.mul(r, r), r)  # expm1(r)
    s = _power_of_two(m, n)
    e = m.fma(s, p, m.sub(s, m.c(1.0)))  # 2^n expm1(r) + 2^n - 1
    return m.copysign(m.div(e, m.add(e, m.c(2.0))), x)


def _tanh_f64(m: _Arith, x: str) -> str:
    a = m.abs(x)
    z = m.mul(a, a)
    small = m.fma(m.mul(a, z), m.poly(z, _TANH_P64), a)
    e = _expm1(m, m.add(a, a))
    large = m.div(e, m.add(e, m.c(2.0)))  # expm1(2a) / (expm1(2a) + 2)
    y = m.select(m.cmp("olt", a, m.c(0.625)), small, large)
    y = m.select(m.cmp("ogt", a, m.c(22.0)), m.c(1.0), y)  # rounds to 1; avoids inf / inf
    return m.copysign(y, x)


def _logistic(m: _Arith, x: str) -> str:
    e = _exp(m, m.unary("arith.negf", m.abs(x)), nonpositive=True)
    numerator = m.select(m.cmp("oge", x, m.c(0.0)), m.c(1.0), e)  # x < 0: e / (1 + e), no overflow
    return m.div(numerator, m.add(m.c(1.0), e))


def _erf_f32(m: _Arith, x: str) -> str:
    a = m.abs(x)
    small = m.fma(a, m.poly(m.mul(a, a), _ERF_SMALL), a)
    mid = m.sub(m.c(1.0), m.poly(m.sub(a, m.c(_ERFC_MID)), _ERFC_Q))
    y = m.select(m.cmp("olt", a, m.c(1.0)), small, mid)
    y = m.select(m.cmp("oge", a, m.c(_ERF_ONE)), m.c(1.0), y)
    return m.copysign(y, x)


def _sincos_f32(m: _Arith, x: str, cosine: bool) -> str:
    supported = m.cmp("olt", m.abs(x), m.c(_SINCOS_LIMIT))
    x0 = m.select(supported, x, m.c(0.0))
    # The reduction runs in float64: r = x - n pi/2 is then exact to ~2^-53 relative for |x| < 2^48,
    # also next to the zeros of sin/cos, where a float32 reduction loses all bits.
    d = _Arith(m.b, "f64")
    xd = m.b.op(f"arith.extf {x0} : f32 to f64")
    n = d.unary("math.roundeven", d.mul(xd, d.c(2.0 / math.pi)))
    rd = d.fma(n, d.c(-_PIO2[0]), xd)
    rd = d.fma(n, d.c(-_PIO2[1]), rd)
    rd = d.fma(n, d.c(-_PIO2[2]), rd)
    r = m.b.op(f"arith.truncf {rd} : f64 to f32")
    # quadrant = n mod 4, exact in float for any n (n/4 and floor are exact), so never out of i32 range
    quadrant = d.sub(n, d.mul(d.c(4.0), d.unary("math.floor", d.mul(n, d.c(0.25)))))
    q = m.b.op(f"arith.fptosi {quadrant} : f64 to i32")
    if cosine:
        q = m.iop("addi", q, m.ci(1))
    z = m.mul(r, r)
    sin_r = m.fma(m.mul(r, z), m.poly(z, _SIN_P), r)
    cos_r = m.fma(m.mul(z, z), m.poly(z, _COS_P), m.fma(z, m.c(-0.5), m.c(1.0)))
    odd = m.b.op(f"arith.trunci {q} : i32 to i1")
    y = m.select(odd, cos_r, sin_r)
    # quadrants 2 and 3 negate: move bit 1 of q to the sign bit
    sign = m.iop("shli", m.iop("andi", q, m.ci(2)), m.ci(30))
    y = m.from_bits(m.iop("xori", m.bits(y), sign))
    if not cosine:
        y = m.select(m.cmp("oeq", x, m.c(0.0)), x, y)  # sin(-0) = -0
    return m.select(supported, y, m.c(math.nan))


def _sin_f32(m: _Arith, x: str) -> str:
    return _sincos_f32(m, x, cosine=False)


def _cos_f32(m: _Arith, x: str) -> str:
    return _sincos_f32(m, x, cosine=True)


def _atan2_f32(m: _Arith, y: str, x: str) -> str:
    ay, ax = m.abs(y), m.abs(x)
    swap = m.cmp("ogt", ay, ax)
    num = m.select(swap, ax, ay)
    den = m.select(swap, ay, ax)
    t = m.div(num, den)  # in [0, 1]; 0/0 and inf/inf are fixed up to the IEEE angles
    t = m.select(m.cmp("oeq", den, m.c(0.0)), m.c(0.0), t)
    t = m.select(m.cmp("oeq", num, m.c(math.inf)), m.c(1.0), t)
    t2 = m.mul(t, t)
    angle = m.fma(m.mul(t, t2), m.poly(t2, _ATAN_P), t)
    # pi/2 - angle and pi - angle with two-part constants (the float32 pi alone is 0.3 ulp off)
    pio2_hi, pio2_lo = _PI_OVER_2_F32
    angle = m.select(swap, m.add(m.sub(m.c(pio2_hi), angle), m.c(pio2_lo)), angle)
    # x with its sign bit set (x = -0 included) mirrors the angle: pi - angle
    x_negative = m.b.op(f"arith.cmpi slt, {m.bits(x)}, {m.ci(0)} : i32")
    pi_hi, pi_lo = _PI_F32
    angle = m.select(x_negative, m.add(m.sub(m.c(pi_hi), angle), m.c(pi_lo)), angle)
    return m.select(m.cmp("uno", y, x), m.add(y, x), m.copysign(angle, y))


def _sqrt(m: _Arith, x: str) -> str:
    return m.unary("math.sqrt", x)


def _rsqrt(m: _Arith, x: str) -> str:
    return m.unary("math.rsqrt", x)


# ---------------------------------------------------------------------------------------------
# libm calls (float64 sin, cos, erf, atan2, pow: numpy accuracy needs a full-range reduction or
# extra precision we do not have yet), and float32 pow built on the float64 polynomials.


def _libm(name: str) -> Callable[[_Arith, str], str]:
    def emit(m: _Arith, x: str) -> str:
        return m.unary(f"math.{name}", x)

    return emit


def _atan2_f64(m: _Arith, y: str, x: str) -> str:
    """libm's atan2, with both zeros by selects: MLIR folds `math.atan2` of two constant zeros to
    nan (C and numpy: atan2(+-0, +0) = +-0, atan2(+-0, -0) = +-pi; found by the fuzzer)."""
    r = m.b.op(f"math.atan2 {y}, {x} : f64")
    zeros = m.both(m.cmp("oeq", y, m.c(0.0)), m.cmp("oeq", x, m.c(0.0)))
    x_negative = m.b.op(f"arith.cmpi slt, {m.bits(x)}, {m.ci(0)} : i64")
    return m.select(zeros, m.select(x_negative, m.copysign(m.c(math.pi), y), y), r)


def _pow_f64(m: _Arith, x: str, y: str) -> str:
    return m.b.op(f"math.powf {x}, {y} : f64")


def _pow_f32(m: _Arith, x: str, y: str) -> str:
    """exp(y log|x|) in float64 (our polynomials: the ~2^-52 relative error on y log|x| vanishes in
    the rounding to float32), with the C99/numpy special cases applied by selects."""
    d = _Arith(m.b, "f64")
    xd = m.b.op(f"arith.extf {x} : f32 to f64")
    yd = m.b.op(f"arith.extf {y} : f32 to f64")
    magnitude = _exp(d, d.mul(yd, _log(d, d.abs(xd))))  # |x| = 0 / inf give the right 0 / inf
    return pow_special_cases(m, x, y, m.b.op(f"arith.truncf {magnitude} : f64 to f32"))


def pow_special_cases(m: _Arith, x: str, y: str, r: str) -> str:
    """`r`, exp(y log|x|) in `m`'s type, with the sign of odd powers of negative x and the C99/numpy
    special cases applied by selects."""
    is_integer = m.cmp("oeq", m.unary("math.floor", y), y)
    half = m.mul(y, m.c(0.5))
    is_odd = m.both(is_integer, m.cmp("one", m.unary("math.floor", half), half))
    x_sign_set = m.b.op(f"arith.cmpi slt, {m.bits(x)}, {m.ci(0)} : {m.it}")
    r = m.select(m.both(x_sign_set, is_odd), m.unary("arith.negf", r), r)  # (-x)^odd = -(x^odd), -0/-inf too
    # finite x < 0 with a finite non-integer y has no real power
    finite_negative_x = m.both(m.cmp("olt", x, m.c(0.0)), m.cmp("ogt", x, m.c(-math.inf)))
    finite_y = m.cmp("olt", m.abs(y), m.c(math.inf))
    no_real = m.both(m.both(finite_negative_x, finite_y), m.negation(is_integer))
    r = m.select(no_real, m.c(math.nan), r)
    # x^0 = 1 (even for nan), 1^y = 1 (even for nan), (-1)^+-inf = 1
    minus_one_inf = m.both(m.cmp("oeq", x, m.c(-1.0)), m.cmp("oeq", m.abs(y), m.c(math.inf)))
    one = m.either(m.either(m.cmp("oeq", y, m.c(0.0)), m.cmp("oeq", x, m.c(1.0))), minus_one_inf)
    return m.select(one, m.c(1.0), r)


# ---------------------------------------------------------------------------------------------
# dispatch on the element type

_UNARY: dict[str, tuple[Callable[[_Arith, str], str], Callable[[_Arith, str], str]]] = {
    # name: (float32 implementation, float64 implementation)
    "exp": (_exp, _exp),
    "log": (_log, _log),
    "log1p": (_log1p, _log1p),
    "expm1": (_expm1, _expm1),
    "tanh": (_tanh_f32, _tanh_f64),
    "logistic": (_logistic, _logistic),
    "erf": (_erf_f32, _libm("erf")),
    "sin": (_sin_f32, _libm("sin")),
    "cos": (_cos_f32, _libm("cos")),
    "sqrt": (_sqrt, _sqrt),
    "rsqrt": (_rsqrt, _rsqrt),
}
_BINARY: dict[str, tuple[Callable[[_Arith, str, str], str], Callable[[_Arith, str, str], str]]] = {
    "atan2": (_atan2_f32, _atan2_f64),
    "pow": (_pow_f32, _pow_f64),
}


def truncate_to_bf16(b: ScalarBuilder, x: str) -> str:
    """Emit f32 `x` rounded to bf16 (nearest even, denormals kept, nan stays nan); returns the bf16
    SSA name. Use it instead of `arith.truncf`, which becomes vcvtneps2bf16 on AVX512-BF16 hosts and
    flushes denormal results to zero."""
    m = _Arith(b, "f32")
    bits = m.bits(x)
    lsb = m.iop("andi", m.iop("shrui", bits, m.ci(16)), m.ci(1))
    rounded = m.iop("shrui", m.iop("addi", bits, m.iop("addi", lsb, m.ci(0x7FFF))), m.ci(16))
    quiet_nan = m.iop("ori", m.iop("shrui", bits, m.ci(16)), m.ci(0x40))
    result = b.op(f"arith.select {m.isnan(x)}, {quiet_nan}, {rounded} : i32")
    return b.op(f"arith.bitcast {b.op(f'arith.trunci {result} : i32 to i16')} : i16 to bf16")


def _widened(b: ScalarBuilder, elem: str, operands: tuple[str, ...], emit) -> str:
    """Run the f32 code on f16/bf16 operands: extend, compute, round once to `elem`."""
    wide = [b.op(f"arith.extf {x} : {elem} to f32") for x in operands]
    result = emit(_Arith(b, "f32"), *wide)
    if elem == "bf16":
        return truncate_to_bf16(b, result)
    return b.op(f"arith.truncf {result} : f32 to {elem}")


def _unary_emitter(name: str) -> Callable[[ScalarBuilder, str, str], str]:
    f32_impl, f64_impl = _UNARY[name]

    def emit(b: ScalarBuilder, x: str, elem: str) -> str:
        if elem in ("f16", "bf16"):
            return _widened(b, elem, (x,), f32_impl)
        return (f64_impl if elem == "f64" else f32_impl)(_Arith(b, elem), x)

    emit.__name__ = emit.__qualname__ = f"emit_{name}"
    emit.__doc__ = f"Emit {name}(x) for a scalar x of MLIR float type `elem`; returns the result's SSA name."
    return emit


def _binary_emitter(name: str) -> Callable[[ScalarBuilder, str, str, str], str]:
    f32_impl, f64_impl = _BINARY[name]

    def emit(b: ScalarBuilder, x: str, y: str, elem: str) -> str:
        if elem in ("f16", "bf16"):
            return _widened(b, elem, (x, y), f32_impl)
        return (f64_impl if elem == "f64" else f32_impl)(_Arith(b, elem), x, y)

    emit.__name__ = emit.__qualname__ = f"emit_{name}"
    emit.__doc__ = f"Emit {name}(x, y) for scalars of MLIR float type `elem`; returns the result's SSA name."
    return emit


MATH: dict[str, Callable[[ScalarBuilder, str, str], str]] = {name: _unary_emitter(name) for name in _UNARY}
MATH_BINARY: dict[str, Callable[[ScalarBuilder, str, str, str], str]] = {
    name: _binary_emitter(name) for name in _BINARY
}
