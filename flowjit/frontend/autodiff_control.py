"""VJP rules for structured control flow, registered into `flowjit.passes.autodiff`'s tables.

cond   one cond over the two branches' VJP graphs
for    (fori_loop, scan) the body's VJP graph, split in two. Its forward part (the ops that read no
       cotangent) runs in a forward loop (a `FORWARD_RULES` entry, replacing the primal loop) that
       tapes, every iteration, the residuals: the values of the forward part that depend on the
       carry and that the backward part reads (as JAX's partial evaluation stores them), so the
       reverse pass never recomputes the forward body. A reverse loop runs the backward part on
       its iteration's residuals; values that depend only on the step and the invariants (`xs[i]`)
       are recomputed there, not taped. The rows an iteration reads of an invariant get their
       cotangent added into the carried sum. A carry the backward part never reads (scan's
       stacked `ys`, written one row per step) is not taped: that would cost O(T) per iteration
while  an error naming fj.fori_loop: reverse mode needs the trip count while tracing
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.errors import FlowjitTypeError, op_error
from flowjit.frontend.autodiff import FORWARD_RULES, VJP_RULES, VJPSpec, emit_traced, vjp_graph, zeros
from flowjit.frontend.trace import Trace, Tracer, bind, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.types import TensorType
from flowjit.passes.canonicalize import canonicalize


def _while_vjp(op, cts, operands, results):
    raise op_error(
        FlowjitTypeError,
        op.loc,
        op.name,
        "cannot differentiate through fj.while_loop: its trip count is only known at run time, so "
        "reverse mode cannot store its iterations. Use fj.fori_loop(lo, hi, body_fn, init), whose "
        "gradient is supported, or stop the gradient with fj.stop_gradient",
    )


def _cond_vjp(op, cts, operands, results):
    # The gradient of a branch is the branch's own VJP graph: one cond picks between the two.
    pred, *xs = operands
    wrt = tuple(i for i, x in enumerate(xs) if dt.dtype(x.dtype).is_float)
    seeds = tuple(i for i, ct in enumerate(cts) if ct is not None)
    if not wrt:
        return [None] * len(operands)
    spec = VJPSpec(wrt=wrt, seeds=seeds, primal_outputs=False)
    regions = [vjp_graph(region, spec) for region in op.regions]
    operands_in = [pred, *xs, *(cts[i] for i in seeds)]
    grads = emit_traced(current_trace(), "cond", operands_in, {}, op.loc, regions, op.device)
    out = [None] * len(operands)
    for i, g in zip(wrt, grads):
        out[1 + i] = g
    return out


def _static_bound(op: Op, index: int, what: str) -> int:
    producer = op.operands[index].producer
    if producer is None or producer.name != "constant":
        raise op_error(
            FlowjitTypeError,
            op.loc,
            op.name,
            f"cannot differentiate through fj.fori_loop with a traced {what} bound: reverse mode stores every "
            "iteration, so the trip count must be known while tracing. Pass Python ints as the bounds",
        )
    return int(producer.attrs["value"])


def _region(name: str, param_types: Sequence[TensorType], body: Callable) -> Graph:
    """Trace `body(*params)` into a self-contained region graph."""
    with Trace(name) as trace:
        params = [trace.new_param(t) for t in param_types]
        trace.graph.results = [trace.lift(x) for x in body(*params)]
    return trace.graph


def _tape_position(i, lo: int):
    """Iteration `i`'s row in a tape: i - lo as a 1-element index vector."""
    return bind("reshape", [i - np.asarray(lo, i.dtype)], {"shape": (1,)})


# Values the reverse loop recomputes from their operands rather than taping them: shape-only ops
# (their operand is taped instead) and bools (tapes are written with scatter_add, on numbers).
RECOMPUTED = frozenset({"broadcast", "reshape"})


@dataclass(frozen=True)
class _LoopVJP:
    """What both halves of a `for` loop's gradient need. `body_vjp` is the body's VJP graph
    `(i, *carry, *inv, *ct_carry) -> (*carry_out, *grads)` (canonicalized); `backward` its ops that
    read a cotangent (run by the reverse loop only); `taped` the ops of the forward part that
    depend on the carry and are not recomputed (run by the forward loop only); `residuals` the
    values the reverse loop reads from the tapes (results of `taped` ops, or carry parameters);
    `float_carry`/`float_inv` the carries and invariants it differentiates."""

    body_vjp: Graph
    float_carry: list[int]
    float_inv: list[int]
    backward: frozenset[Op]
    taped: frozenset[Op]
    residuals: list[Value]


@functools.lru_cache(maxsize=16)
def _loop_vjp(op: Op) -> _LoopVJP:
    """The body's VJP graph of `for` loop `op`, split into its forward and backward parts. The
    forward rule and the VJP rule of one loop both need it: it is computed once (cached per op,
    which the autodiff pass does not change)."""
    (body,) = op.regions
    num_carry = op.attrs["num_carry"]
    types = [p.type for p in body.params[1:]]
    float_carry = [k for k, t in enumerate(types[:num_carry]) if t.dtype.is_float]
    float_inv = [m for m, t in enumerate(types[num_carry:]) if t.dtype.is_float]
    wrt = tuple([1 + k for k in float_carry] + [1 + num_carry + m for m in float_inv])
    graph = canonicalize(vjp_graph(body, VJPSpec(wrt=wrt, seeds=tuple(float_carry))))
    on_ct = set(graph.params[len(body.params) :])
    on_carry = set(graph.params[1 : 1 + num_carry])
    backward, forward = set(), set()
    for inner in graph.ops:
        if any(v in on_ct for v in inner.operands):
            on_ct.update(inner.results)
            backward.add(inner)
        elif any(v in on_carry for v in inner.operands):
            on_carry.update(inner.results)
            forward.add(inner)
    residuals, recomputed, seen = [], set(), set()

    def need(v: Value) -> None:
        if v in seen or v not in on_carry:  # computed in the reverse loop from the step and the invariants
            return
        seen.add(v)
        producer = v.producer
        if producer is not None and (producer.name in RECOMPUTED or v.type.dtype.is_bool):
            recomputed.add(producer)
            for x in producer.operands:
                need(x)
            return
        residuals.append(v)

    for v in [*(x for inner in graph.ops if inner in backward for x in inner.operands), *graph.results[num_carry:]]:
        need(v)
    return _LoopVJP(graph, float_carry, float_inv, frozenset(backward), frozenset(forward - recomputed), residuals)


def _emit(graph: Graph, env: dict, skip) -> None:
    """Emit `graph`'s ops but those in `skip` into the current trace, reading operands from and
    writing results to `env`."""
    trace = current_trace()
    for inner in graph.ops:
        if inner in skip:
            continue
        operands = [env[v] for v in inner.operands]
        outs = emit_traced(trace, inner.name, operands, inner.attrs, inner.loc, inner.regions, inner.device)
        env.update(zip(inner.results, outs))


def _taped_forward(op: Op, lo: int, trips: int, bounds, carry, invariants, grad: _LoopVJP) -> list[Tracer]:
    """The loop running the forward part of the body's VJP graph, also recording its residuals
    every iteration: one (trips, ...) tape per residual. Returns the final carries, then the tapes."""
    graph, residuals = grad.body_vjp, grad.residuals
    trace, num_carry, num_taped = current_trace(), len(carry), len(residuals)
    carry_types = [x.value.type for x in carry]
    tape_types = [TensorType((trips, *v.type.shape), v.type.dtype) for v in residuals]

    def taped_body(i, *args):
        xs, tapes, inv = args[:num_carry], args[num_carry : num_carry + num_taped], args[num_carry + num_taped :]
        env = dict(zip(graph.params, [i, *xs, *inv]))
        _emit(graph, env, grad.backward)
        position = _tape_position(i, lo)
        rows = [bind("reshape", [env[v]], {"shape": (1, *v.type.shape)}) for v in residuals]
        recorded = [bind("scatter_add", [t, position, r], {"axis": 0}) for t, r in zip(tapes, rows)]
        return [*(env[r] for r in graph.results[:num_carry]), *recorded]

    param_types = [graph.params[0].type, *carry_types, *tape_types, *(x.value.type for x in invariants)]
    taped_region = _region("body_taped", param_types, taped_body)
    operands = [*bounds, *carry, *(zeros(trace, t) for t in tape_types), *invariants]
    attrs = {"num_carry": num_carry + num_taped}
    return emit_traced(trace, "for", operands, attrs, op.loc, [taped_region], op.device)


def _is_zeros(value: Value) -> bool:
    """Whether `value` is `zeros(...)`: a zero scalar constant, broadcast or not."""
    producer = value.producer
    if producer is not None and producer.name == "broadcast":
        producer = producer.operands[0].producer
    return producer is not None and producer.name == "constant" and not np.any(producer.attrs["value"])


def _row_updates(value: Value) -> list[Op] | None:
    """The `scatter_add`s into zeros that sum to `value` (the VJP of `gather`: one per read of rows
    of an invariant, summed by `add`s), or None when `value` is anything else (a dense cotangent)."""
    producer = value.producer
    if producer is None:
        return None
    if producer.name == "scatter_add" and _is_zeros(producer.operands[0]):
        return [producer]
    if producer.name != "add":
        return None
    lhs, rhs = (_row_updates(x) for x in producer.operands)
    return None if lhs is None or rhs is None else lhs + rhs


def _add_into(acc: Tracer, ct: Tracer) -> Tracer:
    """acc + ct, for the running sum of an invariant's cotangent. When ct only has rows read by the
    iteration (`scatter_add(zeros, idx, rows)`), the rows are added into acc in place of a dense
    zeros + scatter_add + add: O(rows) work per iteration, not O(the whole invariant)."""
    updates = _row_updates(ct.value)
    if updates is None:
        return acc + ct
    trace = current_trace()
    for op in updates:  # acc + scatter_add(0, idx, rows) -> scatter_add(acc, idx, rows)
        idx, rows = (Tracer(x, trace) for x in op.operands[1:])
        acc = bind("scatter_add", [acc, idx, rows], dict(op.attrs))
    return acc


def _reverse_loop(op: Op, lo: int, hi: int, cts, bounds, tapes, invariants, grad: _LoopVJP) -> list[Tracer]:
    """A loop over i = hi-1 ... lo running the backward part of the body's VJP graph on the
    residuals taped at iteration i. It carries the float carries' cotangents and the running sum
    of the float invariants' cotangents; returns both."""
    graph, num_carry = grad.body_vjp, op.attrs["num_carry"]
    trace = current_trace()
    carry_types = [p.type for p in graph.params[1 : 1 + num_carry]]
    inv_types = [x.value.type for x in invariants]
    inv_params = graph.params[1 + num_carry : 1 + num_carry + len(invariants)]
    ct_params = graph.params[1 + num_carry + len(invariants) :]
    nc, ni, nt = len(grad.float_carry), len(grad.float_inv), len(tapes)

    def backward_body(j, *args):
        ct_carry, ct_inv = args[:nc], args[nc : nc + ni]
        tapes_, inv = args[nc + ni : nc + ni + nt], args[nc + ni + nt :]
        i = np.asarray(lo + hi - 1, j.dtype) - j
        position = _tape_position(i, lo)
        env = {graph.params[0]: i, **dict(zip(inv_params, inv)), **dict(zip(ct_params, ct_carry))}
        for v, tape in zip(grad.residuals, tapes_):
            env[v] = bind("reshape", [bind("gather", [tape, position], {"axis": 0})], {"shape": v.type.shape})
        _emit(graph, env, grad.taped)
        grads = [env[r] for r in graph.results[num_carry:]]
        return [*grads[:nc], *(_add_into(acc, g) for acc, g in zip(ct_inv, grads[nc:]))]

    ct_types = [carry_types[k] for k in grad.float_carry] + [inv_types[m] for m in grad.float_inv]
    tape_types = [t.value.type for t in tapes]
    region = _region("body_vjp", [graph.params[0].type, *ct_types, *tape_types, *inv_types], backward_body)
    ct_init = [cts[k] if cts[k] is not None else zeros(trace, carry_types[k]) for k in grad.float_carry]
    ct_init += [zeros(trace, inv_types[m]) for m in grad.float_inv]
    operands = [*bounds, *ct_init, *tapes, *invariants]
    return emit_traced(trace, "for", operands, {"num_carry": len(ct_init)}, op.loc, [region], op.device)


def _for_forward(op, operands):
    # The loop with its carries taped, in place of the plain loop (None: keep the plain loop; its VJP
    # then reports why it cannot be differentiated, if a cotangent reaches it).
    num_carry = op.attrs["num_carry"]
    try:
        lo, hi = _static_bound(op, 0, "lower"), _static_bound(op, 1, "upper")
    except FlowjitTypeError:
        return None
    if hi <= lo:
        return None
    bounds, carry, invariants = operands[:2], operands[2 : 2 + num_carry], operands[2 + num_carry :]
    outs = _taped_forward(op, lo, hi - lo, bounds, carry, invariants, _loop_vjp(op))
    return outs[:num_carry], outs[num_carry:]


def _for_vjp(op, cts, operands, results):
    # `results` ends with the tapes of `_for_forward`; the reverse loop applies the body's VJP graph.
    num_carry = op.attrs["num_carry"]
    lo, hi = _static_bound(op, 0, "lower"), _static_bound(op, 1, "upper")
    bounds, invariants = operands[:2], operands[2 + num_carry :]
    if hi <= lo:  # no iterations: the loop returns its initial carry
        return [None, None, *cts, *(None for _ in invariants)]
    grad = _loop_vjp(op)
    backward = _reverse_loop(op, lo, hi, cts, bounds, results[num_carry:], invariants, grad)
    out = [None] * len(operands)
    for k, g in zip(grad.float_carry, backward):
        out[2 + k] = g
    for m, g in zip(grad.float_inv, backward[len(grad.float_carry) :]):
        out[2 + num_carry + m] = g
    return out


FORWARD_RULES["for"] = _for_forward
VJP_RULES.update({"while": _while_vjp, "cond": _cond_vjp, "for": _for_vjp})
