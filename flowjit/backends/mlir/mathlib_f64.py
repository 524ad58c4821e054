"""Call-free float64 sin, cos, erf, atan2 and pow, for targets without libm (the GPU, where the
shared library's `math.sin` in float64 would be a libdevice call nothing links). `MATH` and
`MATH_BINARY` are `mathlib`'s tables with these for float64; every other type and function is
`mathlib`'s. The CPU keeps libm, which is more accurate.

Accuracy (float64, against math/numpy; the op table's float64 tolerance is 1e-12 relative):
- sin/cos: n = round(x 2/pi), r = x - n pi/2 by `mathlib`'s three-part Cody-Waite split with fma,
  Cephes' sin/cos polynomials on [-pi/4, pi/4] (1 ulp there). The reduction's roundings leave an
  absolute error of a few 1e-16 in r, so results are within a few 1e-16 absolutely (relatively
  worse right next to the zeros of sin and cos, where libm's full reduction is exact). |x| >= 2^48
  and +-inf give nan, as in float32 (no Payne-Hanek reduction).
- atan2: t = min(|x|, |y|) / max(|x|, |y|), Cephes' atan rational function (1 ulp on [0, 1], t >
  0.66 through pi/4 + atan((t - 1) / (t + 1))), then the quadrant with two-part pi/2 and pi.
- erf: Cephes' rational functions: x T(x^2) / U(x^2) for |x| < 1 (3 ulp), 1 - exp(-x^2) P(|x|) /
  Q(|x|) for 1 <= |x| < 6 (absolute error ~1e-16), 1 beyond (erfc(6) < 2^-55).
- pow: exp(y log|x|) with `mathlib`'s float64 exp and log, so the relative error grows with
  |y log|x||: up to ~1e-13 next to overflow (libm's is below 1 ulp); special cases as float32's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from flowjit.backends.mlir import mathlib
from flowjit.backends.mlir.emitter import ScalarBuilder
from flowjit.backends.mlir.mathlib import _PIO2, _SINCOS_LIMIT, _Arith, _exp, _log, pow_special_cases

# Cephes sin.c: sin r = r + r^3 P(r^2), cos r = 1 - r^2/2 + r^4 Q(r^2) on [-pi/4, pi/4]
_SIN_P = [
    1.58962301576546568060e-10,
    -2.50507477628578072866e-8,
    2.75573136213857245213e-6,
    -1.98412698295895385996e-4,
    8.33333333332211858878e-3,
    -1.66666666666666307295e-1,
]
_COS_Q = [
    -1.13585365213876817300e-11,
    2.08757008419747316778e-9,
    -2.75573141792967388112e-7,
    2.48015872888517045348e-5,
    -1.38888888888730564116e-3,
    4.16666666666665929218e-2,
]
# Cephes atan.c: atan u = u + u z P(z) / Q(z), z = u^2, |u| <= 0.66 (Q's leading 1 first)
_ATAN_P = [
    -8.750608600031904122785e-1,
    -1.615753718733365076637e1,
    -7.500855792314704667340e1,
    -1.228866684490136173410e2,
    -6.485021904942025371773e1,
]
_ATAN_Q = [
    1.0,
    2.485846490142306297962e1,
    1.650270098316988542046e2,
    4.328810604912902668951e2,
    4.853903996359136964868e2,
    1.945506571482613964425e2,
]
_PIO2_LO = 6.123233995736765886130e-17  # pi/2 - float64(pi/2)
# Cephes ndtr.c: erf x = x T(x^2) / U(x^2) for |x| < 1; erfc x = exp(-x^2) P(x) / Q(x) for 1 <= x < 8
_ERF_T = [
    9.60497373987051638749e0,
    9.00260197203842689217e1,
    2.23200534594684319226e3,
    7.00332514112805075473e3,
    5.55923013010394962768e4,
]
_ERF_U = [
    1.0,
    3.35617141647503099647e1,
    5.21357949780152679795e2,
    4.59432382970980127987e3,
    2.26290000613890934246e4,
    4.92673942608635921086e4,
]
_ERFC_P = [
    2.46196981473530512524e-10,
    5.64189564831068821977e-1,
    7.46321056442269912687e0,
    4.86371970985681366614e1,
    1.96520832956077098242e2,
    5.26445194995477358631e2,
    9.34528527171957607540e2,
    1.02755188689515710272e3,
    5.57535335369399327526e2,
]
_ERFC_Q = [
    1.0,
    1.32281951154744992508e1,
    8.67072140885989742329e1,
    3.54937778887819891062e2,
    9.75708501743205489753e2,
    1.82390916687909736289e3,
    2.24633760818710981792e3,
    1.65666309194161350182e3,
    5.57535340817727675546e2,
]
_ERF_ONE = 6.0  # erf rounds to 1 in float64 from about 5.9 on


def _sincos(m: _Arith, x: str, cosine: bool) -> str:
    supported = m.cmp("olt", m.abs(x), m.c(_SINCOS_LIMIT))
    x0 = m.select(supported, x, m.c(0.0))
    n = m.unary("math.roundeven", m.mul(x0, m.c(2.0 / math.pi)))
    r = m.fma(n, m.c(-_PIO2[0]), x0)
    r = m.fma(n, m.c(-_PIO2[1]), r)
    r = m.fma(n, m.c(-_PIO2[2]), r)
    # quadrant = n mod 4, exact in float for any n (n/4 and floor are exact)
    quadrant = m.sub(n, m.mul(m.c(4.0), m.unary("math.floor", m.mul(n, m.c(0.25)))))
    q = m.to_int(quadrant)
    if cosine:
        q = m.iop("addi", q, m.ci(1))
    z = m.mul(r, r)
    sin_r = m.fma(m.mul(r, z), m.poly(z, _SIN_P), r)
    cos_r = m.fma(m.mul(z, z), m.poly(z, _COS_Q), m.fma(z, m.c(-0.5), m.c(1.0)))
    odd = m.b.op(f"arith.trunci {q} : i64 to i1")
    y = m.select(odd, cos_r, sin_r)
    # quadrants 2 and 3 negate: move bit 1 of q to the sign bit
    y = m.from_bits(m.iop("xori", m.bits(y), m.iop("shli", m.iop("andi", q, m.ci(2)), m.ci(62))))
    if not cosine:
        y = m.select(m.cmp("oeq", x, m.c(0.0)), x, y)  # sin(-0) = -0
    return m.select(supported, y, m.c(math.nan))


def _sin(m: _Arith, x: str) -> str:
    return _sincos(m, x, cosine=False)


def _cos(m: _Arith, x: str) -> str:
    return _sincos(m, x, cosine=True)


def _erf(m: _Arith, x: str) -> str:
    a = m.abs(x)
    z = m.mul(a, a)
    small = m.div(m.mul(a, m.poly(z, _ERF_T)), m.poly(z, _ERF_U))
    tail = m.div(m.mul(_exp(m, m.unary("arith.negf", z), nonpositive=True), m.poly(a, _ERFC_P)), m.poly(a, _ERFC_Q))
    y = m.select(m.cmp("olt", a, m.c(1.0)), small, m.sub(m.c(1.0), tail))
    y = m.select(m.cmp("oge", a, m.c(_ERF_ONE)), m.c(1.0), y)
    return m.copysign(y, x)


def _atan2(m: _Arith, y: str, x: str) -> str:
    ay, ax = m.abs(y), m.abs(x)
    swap = m.cmp("ogt", ay, ax)
    num = m.select(swap, ax, ay)
    den = m.select(swap, ay, ax)
    t = m.div(num, den)  # in [0, 1]; 0/0 and inf/inf are fixed up to the IEEE angles
    t = m.select(m.cmp("oeq", den, m.c(0.0)), m.c(0.0), t)
    t = m.select(m.cmp("oeq", num, m.c(math.inf)), m.c(1.0), t)
    large = m.cmp("ogt", t, m.c(0.66))
    u = m.select(large, m.div(m.sub(t, m.c(1.0)), m.add(t, m.c(1.0))), t)
    z = m.mul(u, u)
    angle = m.fma(u, m.div(m.mul(z, m.poly(z, _ATAN_P)), m.poly(z, _ATAN_Q)), u)
    angle = m.select(large, m.add(m.c(math.pi / 4), m.add(angle, m.c(0.5 * _PIO2_LO))), angle)
    angle = m.select(swap, m.add(m.sub(m.c(math.pi / 2), angle), m.c(_PIO2_LO)), angle)
    # x with its sign bit set (x = -0 included) mirrors the angle: pi - angle
    x_negative = m.b.op(f"arith.cmpi slt, {m.bits(x)}, {m.ci(0)} : i64")
    angle = m.select(x_negative, m.add(m.sub(m.c(math.pi), angle), m.c(2 * _PIO2_LO)), angle)
    return m.select(m.cmp("uno", y, x), m.add(y, x), m.copysign(angle, y))


def _pow(m: _Arith, x: str, y: str) -> str:
    magnitude = _exp(m, m.mul(y, _log(m, m.abs(x))))  # |x| = 0 / inf give the right 0 / inf
    return pow_special_cases(m, x, y, magnitude)


def _with_f64(emit: Callable[..., str], f64_impl: Callable[..., str]) -> Callable[..., str]:
    """`emit` (a `mathlib` emitter: operands, then the element type) with `f64_impl` for float64."""

    def with_f64(b: ScalarBuilder, *operands_and_elem: str) -> str:
        *operands, elem = operands_and_elem
        if elem == "f64":
            return f64_impl(_Arith(b, "f64"), *operands)
        return emit(b, *operands, elem)

    with_f64.__name__ = with_f64.__qualname__ = emit.__name__
    with_f64.__doc__ = emit.__doc__
    return with_f64


MATH = mathlib.MATH | {
    name: _with_f64(mathlib.MATH[name], impl) for name, impl in (("sin", _sin), ("cos", _cos), ("erf", _erf))
}
MATH_BINARY = mathlib.MATH_BINARY | {
    name: _with_f64(mathlib.MATH_BINARY[name], impl) for name, impl in (("atan2", _atan2), ("pow", _pow))
}
