"""`autodiff`: reverse-mode differentiation as a graph transformation.

`vjp_graph(f, spec)` turns a graph `f(params) -> results` into an ordinary graph

    g(params..., cotangents...) -> (results..., gradients...)

that computes f's results and the vector-Jacobian product of the cotangents (one per seeded result)
with respect to the chosen parameters. `g` contains only registered ops, so canonicalize, fusion and
the backends optimize it like any other graph, and differentiating it again gives higher derivatives.

Algorithm:
  1. Open a `GradTrace` and create one parameter per parameter of `f` and per seeded result.
  2. Replay every op of `f` on those tracers (same attributes, location and device).
  3. Mark the *active* values: float values that depend on a differentiated parameter.
  4. Walk the ops in reverse. For an op with an active operand and a non-zero result cotangent, apply
     its rule from `VJP_RULES`; rules are written with `flowjit.numpy` on tracers, so the backward ops
     land in the same trace. Cotangents of a value with several uses are summed; a zero cotangent is
     `None` and is never materialized, except as the gradient of a parameter nothing depends on.
  5. Backward ops take the location (and device, if any) of the forward op they differentiate.

Rule signature: `VJP_RULES[op_name](op, cts, operands, results) -> one cotangent (or None) per operand`,
where `cts` holds one cotangent tracer (or None) per result of `op`. Ops that carry no gradient
(comparisons, integer and rounding ops, `stop_gradient`) are listed in `NON_DIFFERENTIABLE`; any other
op without a rule is a `CompileError` naming the op and the user's line. An op whose VJP needs values
from inside it (a loop's per-iteration carries) has a `FORWARD_RULES` entry that replaces its replay
in step 2 and appends those residuals to the `results` its VJP rule receives.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.errors import CompileError, FlowjitTypeError, FlowjitValueError, op_error
from flowjit.frontend.trace import Trace, Tracer, bind, trace_stack
from flowjit.ir.builder import make_op
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.location import UNKNOWN, Location
from flowjit.ir.ops import COMMUNICATION, STATEFUL, get_opdef
from flowjit.ir.types import TensorType
from flowjit.passes.registry import register


class GradTrace(Trace):
    """A trace whose graph will be differentiated. While one is on the trace stack, `stop_gradient`
    and `custom_vjp` functions emit their marker ops; elsewhere they are plain identities."""


def under_differentiation() -> bool:
    """True while tracing code whose graph the autodiff pass will see."""
    return any(isinstance(t, GradTrace) for t in trace_stack())


@dataclass(frozen=True)
class VJPSpec:
    """What `vjp_graph` differentiates.

    wrt: indices of the parameters to differentiate with respect to (None: every float parameter).
    seeds: indices of the results that receive a cotangent parameter (None: every float result).
    primal_outputs: whether g returns f's results before the gradients.
    """

    wrt: tuple[int, ...] | None = None
    seeds: tuple[int, ...] | None = None
    primal_outputs: bool = True

    def __post_init__(self):
        for name in ("wrt", "seeds"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(i) for i in value))


def _select_float(values: Sequence[Value], chosen, what: str) -> tuple[int, ...]:
    if chosen is None:
        return tuple(i for i, v in enumerate(values) if v.type.dtype.is_float)
    for i in chosen:
        if not 0 <= i < len(values):
            raise FlowjitValueError(f"vjp: {what} index {i} is out of range (the graph has {len(values)})")
        if not values[i].type.dtype.is_float:
            raise FlowjitTypeError(f"vjp: {what} {i} has type {values[i].type}; only float values have gradients")
    return chosen


def vjp_graph(graph: Graph, spec: VJPSpec = VJPSpec()) -> Graph:
    """The graph `(params..., cotangents...) -> (results..., gradients...)` of `graph` (see module doc).

    Gradients are returned in the order of `spec.wrt`; cotangent parameters follow `spec.seeds`."""
    wrt = _select_float(graph.params, spec.wrt, "parameter")
    seeds = _select_float(graph.results, spec.seeds, "result")
    with GradTrace(f"{graph.name}_vjp") as trace:
        env: dict[Value, Tracer] = {p: trace.new_param(p.type, p.name_hint) for p in graph.params}
        seed_cts = [trace.new_param(graph.results[i].type, f"ct{k}") for k, i in enumerate(seeds)]
        active = _active_values(graph, [graph.params[i] for i in wrt])
        residuals = _forward_pass(trace, graph, env, active)
        cts: dict[Value, Tracer] = {}
        for i, ct in zip(seeds, seed_cts):
            if graph.results[i] in active:
                _accumulate(cts, graph.results[i], ct)
        for op in reversed(graph.ops):
            _backward_op(trace, op, cts, env, active, residuals.get(op, []))
        grads = []
        for i in wrt:
            param = graph.params[i]
            grads.append(cts[param] if param in cts else zeros(trace, param.type))
        primal = [env[r] for r in graph.results] if spec.primal_outputs else []
        trace.graph.results = [trace.lift(x) for x in primal + grads]
    return trace.graph


@register("autodiff")
def autodiff(graph: Graph) -> Graph:
    """Replace `graph` by its VJP graph with the defaults of `VJPSpec`: differentiate with respect to
    every float parameter, one cotangent parameter per float result (after the original parameters),
    results first and then one gradient per float parameter. Assumes a verified graph; guarantees a
    graph of registered ops whose first results equal the original's."""
    return vjp_graph(graph)


def emit_traced(
    trace: Trace, name: str, operands: Sequence, attrs: dict, loc: Location, regions=(), device=None
) -> list[Tracer]:
    """Append op `name` to `trace` (never evaluated eagerly, unlike `bind`), lifting numpy operands
    to constants; returns its results as tracers."""
    values = [trace.lift(x) for x in operands]
    op = make_op(name, values, attrs, loc, regions=regions, device=device)
    trace.graph.append(op)
    return [Tracer(r, trace) for r in op.results]


def _replay_ops(trace: Trace, graph: Graph, env: dict) -> None:
    """Emit `graph`'s ops into `trace`, reading operands from and writing results to `env`."""
    for op in graph.ops:
        outs = emit_traced(trace, op.name, [env[v] for v in op.operands], op.attrs, op.loc, op.regions, op.device)
        env.update(zip(op.results, outs))


def _forward_pass(trace: Trace, graph: Graph, env: dict, active: set) -> dict[Op, list[Tracer]]:
    """Replay `graph` like `_replay_ops`, but let `FORWARD_RULES` emit active ops whose VJP needs values
    computed inside them; returns those values (residuals) per op."""
    residuals = {}
    for op in graph.ops:
        operands = [env[v] for v in op.operands]
        forward = FORWARD_RULES.get(op.name)
        produced = forward(op, operands) if forward is not None and any(v in active for v in op.operands) else None
        if produced is None:
            produced = emit_traced(trace, op.name, operands, op.attrs, op.loc, op.regions, op.device), []
        outs, residuals[op] = produced
        env.update(zip(op.results, outs))
    return residuals


def replay(trace: Trace, graph: Graph, inputs: Sequence) -> list[Tracer]:
    """Emit `graph`'s ops into `trace` with `inputs` for its parameters; returns its results."""
    env = dict(zip(graph.params, inputs))
    _replay_ops(trace, graph, env)
    return [env[r] for r in graph.results]


def zeros(trace: Trace, ttype: TensorType) -> Tracer:
    """A zero tensor as a scalar constant broadcast to `ttype` (never a full-size literal)."""
    (scalar,) = emit_traced(trace, "constant", [], {"value": np.zeros((), ttype.dtype.np_dtype)}, UNKNOWN)
    if ttype.shape == ():
        return scalar
    (out,) = emit_traced(trace, "broadcast", [scalar], {"shape": ttype.shape, "dims": ()}, UNKNOWN)
    return out


def _active_values(graph: Graph, wrt: Sequence[Value]) -> set[Value]:
    active = {v for v in wrt}
    for op in graph.ops:
        if is_non_differentiable(op.name):
            continue
        if any(v in active for v in op.operands):
            active.update(r for r in op.results if r.type.dtype.is_float)
    return active


def _accumulate(cts: dict[Value, Tracer], value: Value, ct: Tracer) -> None:
    if isinstance(ct, Tracer) and ct.value.type != value.type:
        raise CompileError(f"internal error: a cotangent of type {ct.value.type} for a value of type {value.type}")
    cts[value] = ct if value not in cts else bind("add", [cts[value], ct])


def _backward_op(trace: Trace, op: Op, cts: dict, env: dict, active: set, residuals: list) -> None:
    if not any(v in active for v in op.operands):
        return
    result_cts = [cts.pop(r, None) for r in op.results]
    if all(c is None for c in result_cts):
        return
    rule = VJP_RULES.get(op.name)
    if rule is None:
        raise op_error(
            CompileError,
            op.loc,
            op.name,
            f"no vjp rule for op '{op.name}', so it cannot be differentiated; wrap its input in "
            "fj.stop_gradient if no gradient should flow through it, or define one with fj.custom_vjp",
        )
    start = len(trace.graph.ops)
    operand_cts = rule(op, result_cts, [env[v] for v in op.operands], [*(env[r] for r in op.results), *residuals])
    for v, ct in zip(op.operands, operand_cts):
        if ct is not None and v in active:
            _accumulate(cts, v, ct if isinstance(ct, Tracer) else Tracer(trace.lift(ct), trace))
    for new in trace.graph.ops[start:]:
        new.loc = op.loc
        if op.device is not None:  # gradients are colocated with the op they differentiate (as in TF)
            new.device = op.device


# --- the rule tables ------------------------------------------------------------------------------------

# op name -> rule(op, cts, operands, results) -> one cotangent (or None) per operand. The rules are
# written with flowjit.numpy, a layer above this one: `flowjit/numpy/vjp_rules.py` registers them
# when flowjit.numpy is imported (as every `import flowjit` does).
VJP_RULES: dict[str, Callable] = {}

# Ops whose results carry no gradient to their operands: boolean, integer-valued and rounding ops
# (zero derivative almost everywhere, as in JAX), bitwise ops, creation ops, and `stop_gradient`.
NON_DIFFERENTIABLE = frozenset(
    {
        "stop_gradient",
        "constant",
        "iota",
        "floor",
        "ceil",
        "round",
        "sign",
        "logical_not",
        "logical_and",
        "logical_or",
        "logical_xor",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "argmax",
        "argmin",
        "bitwise_not",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
    }
)
# Reads and writes of variables and communication are not differentiated through: gradients with
# respect to a variable's value differentiate a function of that value instead.
_STATE_FAMILIES = frozenset({STATEFUL, COMMUNICATION})


def is_non_differentiable(name: str) -> bool:
    """True for ops declared to carry no gradient (see `NON_DIFFERENTIABLE` and `_STATE_FAMILIES`)."""
    return name in NON_DIFFERENTIABLE or get_opdef(name).family in _STATE_FAMILIES


# --- rules: custom_vjp ---------------------------------------------------------------------------------------

# custom_vjp rule id -> backward(residual tracers, result cotangents) -> one cotangent (or None) per
# input; filled by `flowjit.frontend.custom_derivatives.custom_vjp` (and `custom_jvp`).
CUSTOM_RULES: dict[int, Callable] = {}
_custom_rule_ids = itertools.count()


def add_custom_rule(backward: Callable) -> int:
    """Register a custom_vjp backward function; returns its id (the op's `rule` attribute)."""
    rule = next(_custom_rule_ids)
    CUSTOM_RULES[rule] = backward
    return rule


def _custom_vjp_call_vjp(op, cts, operands, results):
    num_inputs, num_residuals = op.attrs["num_inputs"], op.attrs["num_residuals"]
    backward = CUSTOM_RULES.get(op.attrs["rule"])
    if backward is None:
        raise op_error(
            CompileError,
            op.loc,
            op.name,
            f"custom_vjp rule {op.attrs['rule']} is not defined in this process (custom_vjp_call ops only "
            "make sense in graphs traced here, not in text IR)",
        )
    input_cts = backward(operands[num_inputs : num_inputs + num_residuals], cts)
    return list(input_cts) + [None] * (len(operands) - num_inputs)


VJP_RULES["custom_vjp_call"] = _custom_vjp_call_vjp

# Ops whose VJP needs values computed inside the op: forward(op, operands) emits a replacement and
# returns (its results, residuals) or None for a plain replay; the VJP rule finds the residuals after
# the op's results in its `results` argument. Filled by `autodiff_control` (loops).
FORWARD_RULES: dict[str, Callable] = {}

# The rules for structured control flow (cond, for, while) live next door and register themselves.
from flowjit.frontend import autodiff_control  # noqa: E402,F401
