"""Batching rules for structured control flow and `custom_vjp_call`, registered into
`flowjit.frontend.batching`'s table.

cond     predicate the same for every example: one cond over the two batched branches; a
         predicate per example: both branches run and a select picks each example's results
while    carries become batched where the body makes them so (a fixpoint over the body); a
         per-example predicate loops while any example's holds, and examples that are done keep
         their carry (a select per carry)
for      as while with a static trip count; bounds per example become a while over a batched index
custom_vjp_call  the user's backward function, vmapped the same way, is the batched op's rule
"""

from __future__ import annotations

from collections.abc import Sequence

from flowjit.frontend.autodiff import CUSTOM_RULES, add_custom_rule, replay
from flowjit.frontend.batching import (
    BATCH_RULES,
    FLAG_RULES,
    Batching,
    _trace_region,
    batch_into,
    batch_region,
    batched_type,
    effectful_ops,
    result_flags,
)
from flowjit.frontend.trace import Trace, Tracer, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph
from flowjit.ir.types import TensorType

# --- cond ------------------------------------------------------------------------------------------------


def _cond(b: Batching, operands, batched):
    pred, *xs = operands
    x_flags = list(batched[1:])
    regions = b.op.regions
    if not batched[0]:
        force = _cond_flags(b.op, batched)
        new = [batch_region(r, x_flags, b.size, force)[0] for r in regions]
        return b.emit("cond", [pred, *xs], b.op.attrs, new), force
    effects = [op for r in regions for op in effectful_ops(r)]
    if effects:
        raise b.error(
            f"the predicate of this cond differs per example, so both branches must run, but a branch "
            f"has effects ('{effects[0].name}' at {effects[0].loc}); compute both values and select "
            "with fnp.where instead"
        )
    t_outs, t_flags = batch_into(regions[0], xs, x_flags, b.size)
    f_outs, f_flags = batch_into(regions[1], xs, x_flags, b.size)
    outs = []
    for t, tf, f, ff in zip(t_outs, t_flags, f_outs, f_flags):
        t, f = b.batched(t, tf), b.batched(f, ff)
        mask = b.one("broadcast", [pred], shape=tuple(t.shape), dims=(0,))
        outs.append(b.one("select", [mask, t, f]))
    return outs, [True] * len(outs)


def _cond_flags(op, batched) -> list[bool]:
    if batched[0]:
        return [True] * len(op.results)
    return [any(column) for column in zip(*(result_flags(r, batched[1:]) for r in op.regions))]


BATCH_RULES["cond"] = _cond
FLAG_RULES["cond"] = _cond_flags

# --- loops -------------------------------------------------------------------------------------------------


def _carry_fixpoint(body: Graph, carry: list[bool], rest_before: list[bool], rest_after: list[bool]) -> list[bool]:
    """The carries' batched flags: a carry is batched if it starts so or the body makes it so."""
    carry = list(carry)
    while True:
        out = result_flags(body, rest_before + carry + rest_after)
        widened = [c or o for c, o in zip(carry, out)]
        if widened == carry:
            return carry
        carry = widened


def _any(b: Batching, pred: Tracer) -> Tracer:
    """Whether any example's predicate holds: a bool scalar."""
    as_int = b.one("convert", [pred], dtype=dt.int32)
    most = b.one("reduce_max", [as_int], axes=(0,))
    return b.one("gt", [most, b.scalar(0, dt.int32)])


def _while_loop(b: Batching, cond: Graph, body: Graph, carry, invariants, carry_flags, inv_flags):
    """Emit a batched while loop over unbatched regions `cond` and `body` of (*carry, *invariants)."""
    given = list(carry_flags)
    carry_flags, pred_batched = _while_flags(cond, body, given, list(inv_flags))
    carry = [b.batch(x) if want and not f else x for x, f, want in zip(carry, given, carry_flags)]
    flags = carry_flags + list(inv_flags)
    if not pred_batched:
        new_cond, _ = batch_region(cond, flags, b.size)
        new_body, _ = batch_region(body, flags, b.size, force=carry_flags)
        return b.emit("while", [*carry, *invariants], {"num_carry": len(carry)}, [new_cond, new_body]), carry_flags
    types = [x.value.type for x in (*carry, *invariants)]
    n = len(carry)

    def any_holds(*params):
        (pred,), _ = batch_into(cond, params, flags, b.size)
        return [_any(Batching(b.op, b.size, b.loc, b.device), pred)]

    def masked_body(*params):
        inner = Batching(b.op, b.size, b.loc, b.device)
        (pred,), _ = batch_into(cond, params, flags, b.size)
        new, new_flags = batch_into(body, params, flags, b.size)
        out = []
        for old, x, f in zip(params[:n], new, new_flags):
            x = inner.batched(x, f)
            mask = inner.one("broadcast", [pred], shape=tuple(x.shape), dims=(0,))
            out.append(inner.one("select", [mask, x, old]))
        return out

    regions = [_trace_region("while_any", types, any_holds), _trace_region("while_masked", types, masked_body)]
    return b.emit("while", [*carry, *invariants], {"num_carry": n}, regions), carry_flags


def _while_flags(cond: Graph, body: Graph, carry: list[bool], invariants: list[bool]) -> tuple[list[bool], bool]:
    """The carries' flags and whether the predicate differs per example (then every carry does)."""
    carry = _carry_fixpoint(body, carry, [], invariants)
    (pred_batched,) = result_flags(cond, carry + invariants)
    return ([True] * len(carry) if pred_batched else carry), pred_batched


def _while(b: Batching, operands, batched):
    n = b.op.attrs["num_carry"]
    cond, body = b.op.regions
    return _while_loop(b, cond, body, operands[:n], operands[n:], batched[:n], batched[n:])


def _for(b: Batching, operands, batched):
    n = b.op.attrs["num_carry"]
    lo, hi, *rest = operands
    (body,) = b.op.regions
    carry, invariants = rest[:n], rest[n:]
    carry_flags, inv_flags = list(batched[2 : 2 + n]), list(batched[2 + n :])
    if batched[0] or batched[1]:
        return _for_as_while(b, lo, hi, body, carry, invariants, batched[:2], carry_flags, inv_flags)
    carry_flags = _carry_fixpoint(body, carry_flags, [False], inv_flags)
    carry = [b.batch(x) if want and not f else x for x, f, want in zip(carry, batched[2 : 2 + n], carry_flags)]
    new_body, _ = batch_region(body, [False] + carry_flags + inv_flags, b.size, force=carry_flags)
    return b.emit("for", [lo, hi, *carry, *invariants], b.op.attrs, [new_body]), carry_flags


def _for_as_while(b: Batching, lo, hi, body: Graph, carry, invariants, bound_flags, carry_flags, inv_flags):
    """A for loop whose bounds differ per example: a while loop over (i, *carry) with hi invariant."""
    n = len(carry)
    index_type, *carry_types = [p.type for p in body.params[: 1 + n]]
    types = [index_type, *carry_types, index_type, *(p.type for p in body.params[1 + n :])]

    def cond(i, *params):
        return [Batching(b.op, b.size, b.loc, b.device).one("lt", [i, params[n]])]

    def step(i, *params):
        inner = Batching(b.op, b.size, b.loc, b.device)
        new = replay(current_trace(), body, [i, *params[:n], *params[n + 1 :]])
        return [inner.one("add", [i, inner.scalar(1, dt.dtype(index_type.dtype))]), *new]

    cond_g, body_g = _trace_region("for_cond", types, cond), _trace_region("for_body", types, step)
    outs, flags = _while_loop(
        b, cond_g, body_g, [lo, *carry], [hi, *invariants], [bound_flags[0], *carry_flags], [bound_flags[1], *inv_flags]
    )
    return outs[1:], flags[1:]


def _while_result_flags(op, batched) -> list[bool]:
    n = op.attrs["num_carry"]
    return _while_flags(*op.regions, list(batched[:n]), list(batched[n:]))[0]


def _for_result_flags(op, batched) -> list[bool]:
    n = op.attrs["num_carry"]
    if batched[0] or batched[1]:  # a while loop over a per-example index: every carry is batched
        return [True] * n
    return _carry_fixpoint(op.regions[0], list(batched[2 : 2 + n]), [False], list(batched[2 + n :]))


BATCH_RULES.update({"while": _while, "for": _for})
FLAG_RULES.update({"while": _while_result_flags, "for": _for_result_flags})

# --- custom_vjp_call ------------------------------------------------------------------------------------------

# (rule, batch size) -> the rule id of the user's backward function batched over that size
_batched_rules: dict[tuple[int, int], int] = {}


def _custom_vjp_call(b: Batching, operands, batched):
    a = b.op.attrs
    xs = [b.batched(x, f) for x, f in zip(operands, batched)]
    key = (a["rule"], b.size)
    if key not in _batched_rules:
        _batched_rules[key] = add_custom_rule(_batched_backward(a["rule"], b, a["num_inputs"]))
    outs = b.emit("custom_vjp_call", xs, {**a, "rule": _batched_rules[key]})
    return outs, [True] * len(outs)


def _batched_backward(rule: int, b: Batching, num_inputs: int):
    size, op = b.size, b.op

    def backward(residuals: Sequence[Tracer], cts: Sequence):
        inner = Batching(op, size)
        out_types = [r.type for r in op.results]
        cts = [
            inner.full(0, batched_type(t, size).shape, t.dtype) if ct is None else ct for ct, t in zip(cts, out_types)
        ]
        args = [*residuals, *cts]
        with Trace("custom_vjp_bwd") as trace:
            params = [trace.new_param(TensorType(tuple(x.shape[1:]), dt.dtype(x.dtype))) for x in args]
            found = CUSTOM_RULES[rule](params[: len(residuals)], params[len(residuals) :])
            present = [i for i, g in enumerate(found) if g is not None]
            trace.graph.results = [trace.lift(found[i]) for i in present]
        captured = [outer for outer, _ in trace.captures]
        flags = [True] * len(args) + [False] * len(captured)
        grads, grad_flags = batch_into(trace.graph, [*args, *captured], flags, size)
        out = [None] * num_inputs
        for i, g, f in zip(present, grads, grad_flags):
            out[i] = inner.batched(g, f)
        return out

    return backward


BATCH_RULES["custom_vjp_call"] = _custom_vjp_call
