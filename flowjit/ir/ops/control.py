"""Structured control flow: `cond`, `while` and `for`, ops whose bodies are nested graphs (regions).

Regions see only their parameters: values from the enclosing graph that a body uses are passed in
as explicit operands (the frontend turns captured tracers into operands), so every region is a
self-contained function and passes can treat it as one.

    cond(pred, *xs)        regions (true, false): (*xs) -> results; both yield the same types
    while(*carry, *inv)    regions (cond, body): (*carry, *inv) -> bool[] / -> carry types
    for(lo, hi, *carry, *inv)  region (body): (i, *carry, *inv) -> carry types; i = lo, lo+1, ..., hi-1
"""

from __future__ import annotations

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import CONTROL, defop
from flowjit.ir.types import TensorType


def _regions(attrs):
    regions = attrs.get("__regions__")
    if regions is None:
        raise ShapeError("control-flow ops need their regions to infer result types")
    return regions


def _check_params(region, types, what):
    found = region.param_types
    if found != list(types):
        raise ShapeError(f"{what} takes ({_fmt(found)}); the op passes ({_fmt(types)})")


def _fmt(types):
    return ", ".join(str(t) for t in types)


def _cond_rule(types, attrs):
    pred, *xs = types
    if pred != TensorType((), dt.bool_):
        raise ShapeError(f"the predicate must be a bool scalar; found {pred}")
    true_region, false_region = _regions(attrs)
    _check_params(true_region, xs, "the true branch")
    _check_params(false_region, xs, "the false branch")
    if true_region.result_types != false_region.result_types:
        raise ShapeError(
            f"branches must return the same types; true returns ({_fmt(true_region.result_types)}), "
            f"false returns ({_fmt(false_region.result_types)})"
        )
    return list(true_region.result_types)


defop("cond", CONTROL, _cond_rule, None, None, num_regions=2, doc="run the true or the false region")


def _while_rule(types, attrs):
    num_carry = attrs["num_carry"]
    cond_region, body_region = _regions(attrs)
    carry = types[:num_carry]
    _check_params(cond_region, types, "the loop condition")
    _check_params(body_region, types, "the loop body")
    if cond_region.result_types != [TensorType((), dt.bool_)]:
        raise ShapeError(f"the loop condition must return one bool scalar; found ({_fmt(cond_region.result_types)})")
    if body_region.result_types != list(carry):
        raise ShapeError(
            f"the loop body must return the carry types ({_fmt(carry)}); found ({_fmt(body_region.result_types)})"
        )
    return list(carry)


defop(
    "while",
    CONTROL,
    _while_rule,
    None,
    None,
    attrs=("num_carry",),
    num_regions=2,
    doc="while cond(carry): carry = body(carry)",
)


def _for_rule(types, attrs):
    num_carry = attrs["num_carry"]
    lo, hi, *rest = types
    for name, t in (("lower bound", lo), ("upper bound", hi)):
        if t.shape != () or not t.dtype.is_int:
            raise ShapeError(f"the {name} must be an integer scalar; found {t}")
    if lo.dtype != hi.dtype:
        raise ShapeError(f"loop bounds must have one dtype; found {lo.dtype} and {hi.dtype}")
    (body_region,) = _regions(attrs)
    _check_params(body_region, [lo, *rest], "the loop body")
    carry = rest[:num_carry]
    if body_region.result_types != list(carry):
        raise ShapeError(
            f"the loop body must return the carry types ({_fmt(carry)}); found ({_fmt(body_region.result_types)})"
        )
    return list(carry)


defop(
    "for",
    CONTROL,
    _for_rule,
    None,
    None,
    attrs=("num_carry",),
    num_regions=1,
    doc="for i in range(lo, hi): carry = body(i, carry)",
)
