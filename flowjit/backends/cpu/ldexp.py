"""exp's power-of-two scaling as one `vscalefps`/`vscalefpd` per vector register (AVX-512).

`mathlib._exp` ends by multiplying the polynomial's value y by 2^n, built from the integral float n
by converting it to an integer (nan guarded to 0 first) and shifting that into a float's exponent
field. Over the whole range (denormal results, exp(88.72) just below FLT_MAX) that takes two
factors, 2^(n >> 1) and 2^(n - (n >> 1)): eleven vector instructions per exp (the guard's compare
and select, the conversion, an arithmetic shift, a subtraction, two additions, two shifts, two
multiplies); a power 2^n alone (`mathlib._power_of_two`: expm1 and tanh's 2^n expm1(r) + 2^n - 1)
takes five. AVX-512's `vscalefps` computes y * 2^floor(n) from the float n with one rounding, in
one instruction. The vectorizer knows no such op, so the scalar code stays portable arith, its
final multiply (or the power's bitcast) tagged `fj.ldexp = <factors>` (2, or 0 for a power alone);
after the transform schedule, `rewrite` replaces each tagged op that the schedule vectorized in
whole 512-bit registers (one, or several cut into registers: a row reduction's 4-vector tiles) by
`x86vector.avx512.mask.scalef` on all lanes (of y, or of 1 for a power alone), finding y and n by
walking back the tagged code's known shape. Anything else (an op left scalar, a vector narrower
than a register, a rank-2 tile, code of another shape) keeps the arith code, which computes the
same value but for nan's power: vscalef gives nan, the guarded arith 1, and the callers' results
are nan either way.

The same value: y * 2^(n >> 1) is exact (a normal float over the clamped range) and the second
factor rounds once, as `vscalef`'s single rounding of y * 2^n does (denormal results included;
overflow is inf either way); tests/test_mathlib.py compares the bits of both over its bit-pattern
sweep. It makes exp over 1M float32 run in 0.74x the time on a 2-core AMD EPYC Zen 4 VM, and
functions with exp in them (softmax, logsumexp, tanh, sigmoid) gain accordingly.

Only on hosts with AVX-512F (`enabled`), which AOT libraries are compiled for as well.
"""

from __future__ import annotations

import functools

from flowjit.backends.mlir.mathlib import LDEXP_TAG as TAG


@functools.cache
def enabled() -> bool:
    """Whether the host's vector units scale by powers of two in one instruction (AVX-512F)."""
    from flowjit.backends.cpu.host import host_cpu

    return "+avx512f" in host_cpu().features


def rewrite(module) -> int:
    """Replace the tagged multiplies of `module` that the schedule vectorized in whole registers by
    `vscalef` (one per register); returns how many."""
    from mlir import ir

    if not enabled():
        return 0
    found = []

    def visit(op):
        if op.name in ("arith.mulf", "arith.bitcast") and TAG in op.attributes and _registers(op.results[0].type):
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    done = 0
    for op in found:
        operands = _scaled(op, ir.IntegerAttr(op.attributes[TAG]).value)
        if operands is None:
            continue
        with ir.InsertionPoint(op), op.location:
            y, n = operands
            if y is None:
                y = _constant(ir, op.results[0].type, 1.0)
            scaled = _scalef(ir, y, n, _registers(op.results[0].type))
        op.results[0].replace_all_uses_with(scaled)
        op.erase()
        done += 1
    return done


def _registers(t) -> int:
    """How many 512-bit registers a float vector type fills, if whole ones (else 0)."""
    from mlir import ir

    if not isinstance(t, ir.VectorType) or t.rank != 1 or not isinstance(t.element_type, (ir.F32Type, ir.F64Type)):
        return 0
    bits = t.shape[0] * t.element_type.width
    return bits // _BITS if bits % _BITS == 0 else 0


_BITS = 512


def _scalef(ir, y, n, registers: int):
    """y * 2^n for float vectors y and integral n of `registers` whole registers: one
    `vscalefps`/`vscalefpd` per register, on all its lanes."""
    vector = ir.VectorType(y.type)
    lanes = _BITS // vector.element_type.width
    every = _constant(ir, ir.IntegerType.get_signless(lanes), -1)
    # _MM_FROUND_CUR_DIRECTION: MXCSR's rounding, as the multiplies'
    current = _constant(ir, ir.IntegerType.get_signless(32), 4)

    def scaled(y_part, n_part):
        return ir.Operation.create(
            "x86vector.avx512.mask.scalef",
            results=[y_part.type],
            # MLIR 22 hands the operands to `llvm.x86.avx512.mask.scalef.ps.512` in this order: (a,
            # b, passthrough), although the op's syntax names them (src, a, b)
            operands=[y_part, n_part, y_part, every, current],
        ).result

    if registers == 1:
        return scaled(y, n)
    part = ir.VectorType.get([lanes], vector.element_type)
    result = _constant(ir, vector, 0.0)
    for k in range(registers):
        piece = scaled(*(_extract(ir, v, k * lanes, part) for v in (y, n)))
        result = ir.Operation.create(
            "vector.insert_strided_slice",
            results=[y.type],
            operands=[piece, result],
            attributes={"offsets": _i64_array(ir, [k * lanes]), "strides": _i64_array(ir, [1])},
        ).result
    return result


def _extract(ir, v, offset: int, part):
    return ir.Operation.create(
        "vector.extract_strided_slice",
        results=[part],
        operands=[v],
        attributes={
            "offsets": _i64_array(ir, [offset]),
            "sizes": _i64_array(ir, [part.shape[0]]),
            "strides": _i64_array(ir, [1]),
        },
    ).result


def _i64_array(ir, values: list[int]):
    return ir.ArrayAttr.get([ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v) for v in values])


def _constant(ir, t, value):
    if isinstance(t, ir.VectorType):
        attr = ir.DenseElementsAttr.get_splat(t, ir.FloatAttr.get(t.element_type, value))
    else:
        attr = ir.IntegerAttr.get(t, value)
    return ir.Operation.create("arith.constant", results=[t], attributes={"value": attr}).result


def _scaled(op, factors: int):
    """(y, n) of `y * 2^n` as `mathlib._exp` builds it (two power-of-two factors), or None;
    `factors` = 0 tags a power 2^n alone (`mathlib._power_of_two`, the bitcast): y is None, for 1."""
    if factors == 0:  # bits((n + bias) << m)
        n = _float(_exponent(op.results[0]))
        return None if n is None else (None, n)
    # (y * bits((n >> 1) + bias << m)) * bits((n - (n >> 1)) + bias << m)
    first, second = op.operands
    rest = _producer(second, "arith.bitcast", "arith.shli", "arith.addi", "arith.subi")
    inner = _producer(first, "arith.mulf")
    if rest is None or inner is None:
        return None
    n, half = rest.operands
    halved = _producer(half, "arith.shrsi")
    if halved is None or halved.operands[0] != n or _exponent(inner.operands[1]) != half:
        return None
    n = _float(n)
    return None if n is None else (inner.operands[0], n)


def _float(n):
    """The integral float that integer `n` was converted from (through exp's nan guard
    `select(isnan(f), 0, f)`, which `vscalef` does not need: it scales nan to nan), or None."""
    convert = None if n is None else _producer(n, "arith.fptosi")
    if convert is None:
        return None
    guard = _producer(convert.operands[0], "arith.select")
    if guard is None:
        return convert.operands[0]
    condition, _, f = guard.operands
    test = _producer(condition, "arith.cmpf")
    if test is None or list(test.operands) != [f, f] or "cmpf uno" not in str(test):
        return None
    return f


def _exponent(power):
    """n of the power of two `bits((n + bias) << mantissa bits)`, or None."""
    add = _producer(power, "arith.bitcast", "arith.shli", "arith.addi")
    return None if add is None else add.operands[0]


def _producer(value, *names: str):
    """The op at the end of the chain `value` <- names[0] <- names[1] ... (each through its first
    operand), or None where an op differs."""
    from mlir import ir

    op = None
    for name in names:
        owner = value.owner
        if isinstance(owner, ir.Block) or owner.operation.name != name:
            return None
        op = owner.operation
        value = op.operands[0]
    return op
