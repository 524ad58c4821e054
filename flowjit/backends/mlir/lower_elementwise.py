"""Lowerings of elementwise ops (unary, binary, comparisons, logical, select, convert) and iota, for
any target: a target adds them to its table with `register`.

Every elementwise op becomes one 1-D `linalg.generic`: operands of rank > 1 are collapsed (free on
contiguous buffers), so the kernel's schedule is the same for every shape: the target's
(`em.target.schedules.elementwise`; on the CPU vectors of the host width and, when large, one chunk
per core). Float math (exp, log, tanh, pow, atan2, ...) is the target's math library
(`em.target.math`; the CPU's `mathlib.py`). Splat constant operands become scalars in the body.
Half types (f16, bf16) compute in f32 and round once at the end, as the reference does.

Semantics follow `flowjit/ir/ops/elementwise.py` exactly: integer division truncates toward zero,
`x / 0 = 0`, `x rem 0 = 0`, `INT_MIN / -1 = INT_MIN` (never a trap); max/min propagate nan;
round is half-to-even; sign(nan) = nan; float -> int conversion saturates with nan -> 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder, elem_type, scalar_literal, tensor_type
from flowjit.backends.mlir.lowering import bool_from_bytes, bool_to_bytes, splat_value
from flowjit.backends.mlir.target import LoweringTable, MathLibrary
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op, Value
from flowjit.ir.types import TensorType

_HALF = (dt.float16, dt.bfloat16)


def compute_elem(dtype: dt.DType) -> str:
    """The MLIR type arithmetic on `dtype` runs in (f32 for half types)."""
    return "f32" if dtype in _HALF else elem_type(dtype)


def _bits(elem: str) -> int:
    return 1 if elem == "i1" else int(elem.lstrip("bfi"))


def collapse(em: KernelEmitter, tensor: str, t: TensorType, elem: str | None = None) -> str:
    """A rank > 1 tensor viewed as 1-D (rank 0 and 1 are returned as they are)."""
    if t.rank <= 1:
        return tensor
    flat = TensorType((t.size,), t.dtype)
    group = ", ".join(str(i) for i in range(t.rank))
    return em.op(f"tensor.collapse_shape {tensor} [[{group}]] : {tensor_type(t, elem)} into {tensor_type(flat, elem)}")


def expand(em: KernelEmitter, tensor: str, t: TensorType, elem: str | None = None) -> str:
    """The inverse of `collapse`: a 1-D tensor of `t.size` elements viewed with `t`'s shape."""
    if t.rank <= 1:
        return tensor
    flat = TensorType((t.size,), t.dtype)
    group = ", ".join(str(i) for i in range(t.rank))
    shape = ", ".join(str(d) for d in t.shape)
    into = f"{tensor_type(flat, elem)} into {tensor_type(t, elem)}"
    result = em.op(f"tensor.expand_shape {tensor} [[{group}]] output_shape [{shape}] : {into}")
    em.store_through(result, tensor, flat.shape)
    return result


FILL_KERNEL_MIN_ELEMENTS = 4096


def memory_scalar(em: KernelEmitter, value, dtype: dt.DType, elem: str) -> str:
    """The Python or numpy scalar `value` as an `arith.constant` of memory element type `elem` (a
    bool as its byte)."""
    literal = int(bool(value)) if dtype.is_bool else scalar_literal(value, dtype)
    return em.op(f"arith.constant {literal} : {elem}")


def filled(em: KernelEmitter, value, t: TensorType, elem: str, into: str | None = None) -> str:
    """A new tensor of type `t` (stored as `elem`, bools as bytes) holding the Python or numpy scalar
    `value` everywhere (written into the tensor `into` when given), made 1-D. From
    FILL_KERNEL_MIN_ELEMENTS elements a generic with the elementwise schedule (vector stores, both
    cores when large): a `linalg.fill` is left as scalar loops, one store per element on one core
    (`fnp.zeros_like(t) + 1`, the zeros of a scatter_add). A new tensor is stored through a 1-D
    view of its buffer (`store_through`), so that the fill writes the buffer itself."""
    scalar = memory_scalar(em, value, t.dtype, elem)
    flat = TensorType((t.size,), t.dtype)
    init = collapse(em, into, t, elem) if into is not None else em.empty(flat, elem)
    flat_type = tensor_type(flat, elem)
    if t.size < FILL_KERNEL_MIN_ELEMENTS:
        out = em.op(f"linalg.fill ins({scalar} : {elem}) outs({init} : {flat_type}) -> {flat_type}")
    else:
        out = em.generic([], (init, flat_type), [em.identity_map(1)], ["parallel"], lambda b, args: scalar, [], elem)
        em.schedule(out, em.target.schedules.elementwise(t.size, _bits(elem)))
    result = expand(em, out, t, elem)
    if into is None and result != out:
        em.store_through(result, out, (t.size,))
    return result


def reshape_tensor(em: KernelEmitter, x: str, source: TensorType, result: TensorType, elem: str | None = None) -> str:
    """`x` viewed with `result`'s shape (same number of elements): collapse to 1-D, expand.
    `elem` overrides the element type (bool moves as bytes)."""
    if source.shape == result.shape:
        return x
    flat_type = TensorType((source.size,), source.dtype)
    flat = x
    if source.rank == 0:
        into = f"{tensor_type(source, elem)} into {tensor_type(flat_type, elem)}"
        flat = em.op(f"tensor.expand_shape {x} [] output_shape [1] : {into}")
    elif source.rank > 1:
        flat = collapse(em, x, source, elem)
    if result.rank == 0:
        return em.op(
            f"tensor.collapse_shape {flat} [] : {tensor_type(flat_type, elem)} into {tensor_type(result, elem)}"
        )
    return expand(em, flat, result, elem)


def map_elementwise(
    em: KernelEmitter,
    out: TensorType,
    inputs: Sequence[tuple[str, Value]],
    body: Callable[[ScalarBuilder, list[str]], str],
    compute_result: bool = True,
) -> str:
    """One elementwise kernel: `body(b, args)` maps scalars in compute types (see `compute_elem`)
    to the result scalar, in the compute type of `out` (or in `out`'s own type when
    `compute_result` is False, e.g. for bool results). Returns the result tensor.

    bool data enters and leaves the kernel as numpy's bytes (i8) and is i1 only inside the body,
    so a bool kernel never needs an i1 buffer."""
    rank1 = TensorType((out.size,), out.dtype) if out.rank > 1 else out
    tensors, scalars = [], []
    for tensor, value in inputs:
        splat = splat_value(value)
        scalars.append(splat)
        if splat is None:
            t = value.type
            if t.dtype.is_bool:
                tensor = bool_to_bytes(em, tensor, t)
            tensors.append((collapse(em, tensor, t, _storage(t.dtype)), t))
    out_elem = _storage(out.dtype)
    init = em.empty(rank1, out_elem)
    identity = em.identity_map(rank1.rank)

    def kernel_body(b: ScalarBuilder, args: list[str]) -> str:
        it = iter(args)
        values = []
        for (_, value), splat in zip(inputs, scalars):
            ce = compute_elem(value.type.dtype)
            if splat is not None:
                values.append(b.const(splat, ce))
                continue
            arg = next(it)
            if value.type.dtype.is_bool:
                arg = b.op(f"arith.cmpi ne, {arg}, {b.const(0, 'i8')} : i8")
            values.append(extend(b, arg, value.type.dtype))
        result = body(b, values)
        result = narrow(b, result, out.dtype) if compute_result else result
        return b.op(f"arith.extui {result} : i1 to i8") if out.dtype.is_bool else result

    result = em.generic(
        [(t, tensor_type(rank1.with_dtype(v.dtype), _storage(v.dtype))) for t, v in tensors],
        (init, tensor_type(rank1, out_elem)),
        [identity] * (len(tensors) + 1),
        ["parallel"] * rank1.rank,
        kernel_body,
        [_storage(v.dtype) for _, v in tensors],
        out_elem,
    )
    if rank1.rank == 1 and out.size > 1:
        widest = max([_bits(out_elem), *(_bits(_storage(v.dtype)) for _, v in tensors)])
        em.schedule(result, em.target.schedules.elementwise(out.size, widest))
    result = expand(em, result, out, out_elem)
    return bool_from_bytes(em, result, out) if out.dtype.is_bool else result


def _storage(dtype: dt.DType) -> str:
    """Element type of a kernel's tensors (bool as bytes)."""
    return "i8" if dtype.is_bool else elem_type(dtype)


def extend(b: ScalarBuilder, x: str, dtype: dt.DType) -> str:
    """A scalar of `dtype` in its compute type (half types widened to f32)."""
    return b.op(f"arith.extf {x} : {elem_type(dtype)} to f32") if dtype in _HALF else x


def narrow(b: ScalarBuilder, x: str, dtype: dt.DType) -> str:
    """A compute-type scalar rounded back to `dtype` (bf16 without `arith.truncf`, which flushes
    denormals on AVX512-BF16 hosts)."""
    if dtype is dt.bfloat16:
        return b.emitter.target.math.truncate_to_bf16(b, x)
    return b.op(f"arith.truncf {x} : f32 to {elem_type(dtype)}") if dtype is dt.float16 else x


# --- unary ---------------------------------------------------------------------------------------


def _math(name: str) -> Callable[[ScalarBuilder, str, str], str]:
    return lambda b, x, e: b.op(f"math.{name} {x} : {e}")


# Plain float instructions; the other float unary ops are the target's math (`MathLibrary.unary`).
_FLOAT_UNARY: dict[str, Callable[[ScalarBuilder, str, str], str]] = {
    "floor": _math("floor"),
    "ceil": _math("ceil"),
    "round": _math("roundeven"),
}


def _sign(b: ScalarBuilder, x: str, e: str) -> str:
    is_float = e.startswith(("f", "bf"))
    zero, one, minus_one = b.const(0, e), b.const(1, e), b.const(-1, e)
    if is_float:
        positive = b.op(f"arith.cmpf ogt, {x}, {zero} : {e}")
        negative = b.op(f"arith.cmpf olt, {x}, {zero} : {e}")
        rest = x  # 0, -0 and nan map to themselves
    else:
        positive = b.op(f"arith.cmpi sgt, {x}, {zero} : {e}")
        negative = b.op(f"arith.cmpi slt, {x}, {zero} : {e}")
        rest = zero
    low = b.op(f"arith.select {negative}, {minus_one}, {rest} : {e}")
    return b.op(f"arith.select {positive}, {one}, {low} : {e}")


def _neg(b: ScalarBuilder, x: str, e: str) -> str:
    if e.startswith("i"):
        return b.op(f"arith.subi {b.const(0, e)}, {x} : {e}")
    return b.op(f"arith.negf {x} : {e}")


def _abs(b: ScalarBuilder, x: str, e: str) -> str:
    # Integers: max(x, -x) (the minimum value stays itself, as numpy's). Not `math.absi`: on the
    # 2-d vectors of n-d kernels (vector<1x16xi32>) MathToLLVM leaves it unconverted ("failed to
    # legalize 'math.absi'"), which failed every int abs kernel with a `copy_nd` schedule.
    if e.startswith("i"):
        return b.op(f"arith.maxsi {x}, {_neg(b, x, e)} : {e}")
    return b.op(f"math.absf {x} : {e}")


_UNARY = {
    "neg": _neg,
    "abs": _abs,
    "sign": _sign,
    "logical_not": lambda b, x, e: b.op(f"arith.xori {x}, {b.const(1, 'i1')} : i1"),
    "bitwise_not": lambda b, x, e: b.op(f"arith.xori {x}, {b.const(1 if e == 'i1' else -1, e)} : {e}"),
}


def unary_scalar(math: MathLibrary, name: str) -> Callable[[ScalarBuilder, str, str], str]:
    """The scalar code `fn(b, x, elem)` of unary op `name`: plain instructions or `math`'s."""
    return _UNARY.get(name) or _FLOAT_UNARY.get(name) or math.unary[name]


def lower_unary(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Unary math, neg/abs/sign, logical and bitwise not."""
    (x,) = op.operands
    fn = unary_scalar(em.target.math, op.name)
    e = compute_elem(x.dtype)
    return [map_elementwise(em, op.result.type, [(operands[0], x)], lambda b, a: fn(b, a[0], e))]


# --- binary --------------------------------------------------------------------------------------


def _safe_divisor(b: ScalarBuilder, y: str, e: str) -> tuple[str, str, str, str, str]:
    """(zero, y == 0, y == -1, either, divisor): the divisor is 1 where y is 0 or -1, the two divisors that
    trap on x86 (x/0, INT_MIN/-1); callers select the defined result for those lanes."""
    zero, one, minus_one = b.const(0, e), b.const(1, e), b.const(-1, e)
    y_zero = b.op(f"arith.cmpi eq, {y}, {zero} : {e}")
    y_minus_one = b.op(f"arith.cmpi eq, {y}, {minus_one} : {e}")
    unsafe = b.op(f"arith.ori {y_zero}, {y_minus_one} : i1")
    return zero, y_zero, y_minus_one, unsafe, b.op(f"arith.select {unsafe}, {one}, {y} : {e}")


def _int_div(b: ScalarBuilder, x: str, y: str, e: str) -> str:
    """Truncating division with x/0 = 0 and INT_MIN/-1 = INT_MIN (wrapping negation)."""
    zero, y_zero, y_minus_one, _, divisor = _safe_divisor(b, y, e)
    quotient = b.op(f"arith.divsi {x}, {divisor} : {e}")
    negated = b.op(f"arith.subi {zero}, {x} : {e}")
    by_minus_one = b.op(f"arith.select {y_minus_one}, {negated}, {quotient} : {e}")
    return b.op(f"arith.select {y_zero}, {zero}, {by_minus_one} : {e}")


def _int_rem(b: ScalarBuilder, x: str, y: str, e: str) -> str:
    """Remainder with the sign of x; x rem 0 = 0 and x rem -1 = 0 (no trap on INT_MIN rem -1)."""
    zero, _, _, unsafe, divisor = _safe_divisor(b, y, e)
    remainder = b.op(f"arith.remsi {x}, {divisor} : {e}")
    return b.op(f"arith.select {unsafe}, {zero}, {remainder} : {e}")


def _int_pow(b: ScalarBuilder, x: str, y: str, e: str) -> str:
    """x**y by square-and-multiply over every exponent bit (wrapping, as numpy); y < 0 gives 0
    unless |x| == 1."""
    zero, one = b.const(0, e), b.const(1, e)
    result, base, exponent = one, x, y
    for _ in range(_bits(e) - 1):
        low_bit = b.op(f"arith.andi {exponent}, {one} : {e}")
        odd = b.op(f"arith.cmpi ne, {low_bit}, {zero} : {e}")
        product = b.op(f"arith.muli {result}, {base} : {e}")
        result = b.op(f"arith.select {odd}, {product}, {result} : {e}")
        base = b.op(f"arith.muli {base}, {base} : {e}")
        exponent = b.op(f"arith.shrui {exponent}, {one} : {e}")
    minus_one = b.const(-1, e)
    x_one = b.op(f"arith.cmpi eq, {x}, {one} : {e}")
    x_minus_one = b.op(f"arith.cmpi eq, {x}, {minus_one} : {e}")
    y_bit = b.op(f"arith.andi {y}, {one} : {e}")
    y_odd = b.op(f"arith.cmpi ne, {y_bit}, {zero} : {e}")
    signed_one = b.op(f"arith.select {y_odd}, {minus_one}, {one} : {e}")
    negative_case = b.op(f"arith.select {x_minus_one}, {signed_one}, {zero} : {e}")
    negative_case = b.op(f"arith.select {x_one}, {one}, {negative_case} : {e}")
    y_negative = b.op(f"arith.cmpi slt, {y}, {zero} : {e}")
    return b.op(f"arith.select {y_negative}, {negative_case}, {result} : {e}")


def _arith(float_op: str, int_op: str):
    def fn(b: ScalarBuilder, x: str, y: str, e: str) -> str:
        name = int_op if e.startswith("i") else float_op
        return b.op(f"arith.{name} {x}, {y} : {e}")

    return fn


def _by_kind(float_fn, int_fn):
    return lambda b, x, y, e: (int_fn if e.startswith("i") else float_fn)(b, x, y, e)


def _math_binary(name: str):
    """The target's `MathLibrary.binary[name]`, looked up when the body is written."""
    return lambda b, x, y, e: b.emitter.target.math.binary[name](b, x, y, e)


_BINARY = {
    "add": _arith("addf", "addi"),
    "sub": _arith("subf", "subi"),
    "mul": _arith("mulf", "muli"),
    "div": _by_kind(_arith("divf", ""), _int_div),
    "rem": _by_kind(_arith("remf", ""), _int_rem),
    "pow": _by_kind(_math_binary("pow"), _int_pow),
    "max": _arith("maximumf", "maxsi"),
    "min": _arith("minimumf", "minsi"),
    "atan2": _math_binary("atan2"),
    "logical_and": _arith("", "andi"),
    "logical_or": _arith("", "ori"),
    "logical_xor": _arith("", "xori"),
}


def _shift(kind: str):
    """Shifts by the amount clamped to [0, bits]: >= bits gives 0 (left, logical) or the sign
    fill (arithmetic); LLVM's shifts by >= bits are poison, so the amount is made safe first."""

    def fn(b: ScalarBuilder, x: str, y: str, e: str) -> str:
        zero, bits = b.const(0, e), b.const(_bits(e), e)
        negative = b.op(f"arith.cmpi slt, {y}, {zero} : {e}")
        amount = b.op(f"arith.select {negative}, {zero}, {y} : {e}")
        too_far = b.op(f"arith.cmpi sge, {amount}, {bits} : {e}")
        if kind == "arithmetic":
            last = b.const(_bits(e) - 1, e)
            amount = b.op(f"arith.select {too_far}, {last}, {amount} : {e}")
            return b.op(f"arith.shrsi {x}, {amount} : {e}")
        safe = b.op(f"arith.select {too_far}, {zero}, {amount} : {e}")
        shifted = b.op(f"arith.{'shli' if kind == 'left' else 'shrui'} {x}, {safe} : {e}")
        return b.op(f"arith.select {too_far}, {zero}, {shifted} : {e}")

    return fn


_BINARY.update(
    {
        "bitwise_and": _arith("", "andi"),
        "bitwise_or": _arith("", "ori"),
        "bitwise_xor": _arith("", "xori"),
        "shift_left": _shift("left"),
        "shift_right_logical": _shift("logical"),
        "shift_right_arithmetic": _shift("arithmetic"),
    }
)


def lower_identity(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """An autodiff marker: the value itself."""
    return [operands[0]]


def lower_binary(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Arithmetic, min/max, pow, atan2, logical, bitwise and shift ops."""
    x, y = op.operands
    fn = _BINARY[op.name]
    e = compute_elem(x.dtype)
    inputs = list(zip(operands, op.operands))
    return [map_elementwise(em, op.result.type, inputs, lambda b, a: fn(b, a[0], a[1], e))]


# numpy comparison semantics: every ordered comparison with nan is false, `ne` with nan is true.
_FLOAT_PREDICATE = {"eq": "oeq", "ne": "une", "lt": "olt", "le": "ole", "gt": "ogt", "ge": "oge"}
_INT_PREDICATE = {"eq": "eq", "ne": "ne", "lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge"}
_BOOL_PREDICATE = {"eq": "eq", "ne": "ne", "lt": "ult", "le": "ule", "gt": "ugt", "ge": "uge"}


def lower_compare(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """eq/ne/lt/le/gt/ge with numpy's nan rules; bools compare as unsigned."""
    x, _ = op.operands
    e = compute_elem(x.dtype)
    if x.dtype.is_float:
        cmp = f"arith.cmpf {_FLOAT_PREDICATE[op.name]}"
    else:
        cmp = f"arith.cmpi {(_BOOL_PREDICATE if x.dtype.is_bool else _INT_PREDICATE)[op.name]}"
    inputs = list(zip(operands, op.operands))
    body = lambda b, a: b.op(f"{cmp}, {a[0]}, {a[1]} : {e}")  # noqa: E731
    return [map_elementwise(em, op.result.type, inputs, body, compute_result=False)]


def lower_select(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """p ? a : b elementwise."""
    e = compute_elem(op.result.type.dtype)
    inputs = list(zip(operands, op.operands))
    body = lambda b, a: b.op(f"arith.select {a[0]}, {a[1]}, {a[2]} : {e}")  # noqa: E731
    return [map_elementwise(em, op.result.type, inputs, body)]


# --- convert -------------------------------------------------------------------------------------


def _float_to_int(b: ScalarBuilder, x: str, src: str, dst: dt.DType) -> str:
    """Saturating float -> int with nan -> 0 (fptosi alone is undefined out of range)."""
    e = elem_type(dst)
    info_min, info_max = -(1 << (dst.bits - 1)), (1 << (dst.bits - 1)) - 1
    is_nan = b.op(f"arith.cmpf uno, {x}, {x} : {src}")
    too_big = b.op(f"arith.cmpf oge, {x}, {b.const(float(info_max), src)} : {src}")
    too_small = b.op(f"arith.cmpf ole, {x}, {b.const(float(info_min), src)} : {src}")
    zero_f = b.const(0.0, src)
    safe = b.op(f"arith.select {is_nan}, {zero_f}, {x} : {src}")
    safe = b.op(f"arith.select {too_big}, {zero_f}, {safe} : {src}")
    safe = b.op(f"arith.select {too_small}, {zero_f}, {safe} : {src}")
    value = b.op(f"arith.fptosi {safe} : {src} to {e}")
    value = b.op(f"arith.select {too_big}, {b.const(info_max, e)}, {value} : {e}")
    return b.op(f"arith.select {too_small}, {b.const(info_min, e)}, {value} : {e}")


def convert_scalar(b: ScalarBuilder, x: str, src: dt.DType, dst: dt.DType) -> str:
    """`x` (in `src`'s compute type) converted to `dst`'s own element type."""
    s, d = compute_elem(src), elem_type(dst)
    if dst.is_bool:
        if src.is_bool:
            return x
        if src.is_float:
            return b.op(f"arith.cmpf une, {x}, {b.const(0.0, s)} : {s}")
        return b.op(f"arith.cmpi ne, {x}, {b.const(0, s)} : {s}")
    if src.is_bool:
        return b.op(f"arith.uitofp {x} : i1 to {d}") if dst.is_float else b.op(f"arith.extui {x} : i1 to {d}")
    if src.is_int and dst.is_int:
        if src.bits == dst.bits:
            return x
        op = "extsi" if dst.bits > src.bits else "trunci"
        return b.op(f"arith.{op} {x} : {s} to {d}")
    if src.is_int:
        return b.op(f"arith.sitofp {x} : {s} to {d}")
    if dst.is_int:
        return _float_to_int(b, x, s, dst)
    if s == d:
        return x
    # float -> float: `s` is f32 or f64 (half sources are already extended). f64 -> half goes
    # through f32: LLVM lowers a direct fptrunc to a compiler-rt call (`__truncdfhf2`) that the
    # JIT cannot resolve; the double rounding differs from numpy's by at most one ulp, rarely.
    if s == "f64" and dst.bits == 16:
        x, s = b.op(f"arith.truncf {x} : f64 to f32"), "f32"
    if dst is dt.bfloat16:
        return b.emitter.target.math.truncate_to_bf16(b, x)
    widen = dst.bits > (32 if s == "f32" else 64)
    return b.op(f"arith.{'extf' if widen else 'truncf'} {x} : {s} to {d}")


def lower_convert(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """dtype conversion with flowjit's semantics (see `convert_scalar`)."""
    (x,) = op.operands
    src, dst = x.dtype, op.result.type.dtype
    if src == dst:
        return [operands[0]]
    body = lambda b, a: convert_scalar(b, a[0], src, dst)  # noqa: E731
    return [map_elementwise(em, op.result.type, [(operands[0], x)], body, compute_result=False)]


# --- iota ----------------------------------------------------------------------------------------


def iota_scalar(b: ScalarBuilder, dimension: int, dtype: dt.DType) -> str:
    """The position along loop dimension `dimension` (`linalg.index`) as a `dtype` scalar: an iota's
    element, in its own kernel or inside a fused one (`lower_fusion`)."""
    index = b.op(f"linalg.index {dimension} : index")
    as_int = b.op(f"arith.index_cast {index} : index to i64")
    return convert_scalar(b, as_int, dt.int64, dtype)


def lower_iota(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """0, 1, 2, ... along `dimension` from `linalg.index`."""
    t = op.result.type
    dimension = op.attrs["dimension"]
    identity = em.identity_map(t.rank)

    def body(b: ScalarBuilder, args: list[str]) -> str:
        return iota_scalar(b, dimension, t.dtype)

    result = em.generic(
        [], (em.empty(t), tensor_type(t)), [identity], ["parallel"] * t.rank, body, [], elem_type(t.dtype)
    )
    return [result]


def register(table: LoweringTable, math: MathLibrary) -> None:
    """Add the elementwise and iota lowerings to `table`, the float unary ops being those `math`
    provides; their splat operands become scalars in the body."""
    unary = [*math.unary, *_FLOAT_UNARY, *_UNARY]
    table.tensor.update({name: lower_unary for name in unary})
    table.tensor.update({name: lower_binary for name in _BINARY})
    table.tensor.update({name: lower_compare for name in _FLOAT_PREDICATE})
    table.tensor.update({"stop_gradient": lower_identity, "select": lower_select, "convert": lower_convert})
    table.tensor["iota"] = lower_iota
    table.inlines_splats.update(unary, _BINARY, _FLOAT_PREDICATE, ["select", "convert"])
