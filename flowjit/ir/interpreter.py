"""The reference interpreter: evaluates any graph with the ops' numpy implementations.

It is the oracle every backend is tested against, so it is deliberately simple: walk the ops in
order, look each one's implementation up in the registry, check the result against the type the
shape rule promised. Ops whose semantics need the interpreter itself (regions, state) register a
handler in `HANDLERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from flowjit.errors import CompileError, FlowjitTypeError
from flowjit.ir.channel import Channel, loopback, receive_array
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.ops import get_opdef
from flowjit.ir.types import TensorType


@dataclass
class RunContext:
    """What a call provides beyond its arguments: the live buffers of the variables it uses, and
    for a partition of a multi-device function the step's channel (`send`/`recv`)."""

    variables: dict[str, np.ndarray] = field(default_factory=dict)
    channel: Channel | None = None  # None: this thread's loopback


# op name -> handler(op, operand arrays, context) -> list of result arrays
HANDLERS: dict[str, Callable] = {}


def check_array(value: np.ndarray, expected: TensorType, what: str) -> None:
    if value.shape != expected.shape or value.dtype != expected.dtype.np_dtype:
        raise FlowjitTypeError(
            f"{what}: expected {expected}; found an array of shape {value.shape} and dtype {value.dtype}"
        )


def eval_op(op: Op, args: list[np.ndarray], context) -> list[np.ndarray]:
    handler = HANDLERS.get(op.name)
    if handler is not None:
        return handler(op, args, context)
    impl = get_opdef(op.name).impl
    if impl is None:
        raise CompileError(f"{op.loc}: op '{op.name}' has no reference implementation")
    out = impl(*args, **op.attrs)
    outs = list(out) if isinstance(out, tuple) else [out]
    return [np.asarray(o) for o in outs]


def interpret(graph: Graph, args: Sequence[np.ndarray], context=None) -> list[np.ndarray]:
    """Evaluate `graph` on numpy arrays; returns its results. `context` is passed to handlers
    (state of variables, rendezvous) and may be None for pure graphs."""
    if len(args) != len(graph.params):
        raise FlowjitTypeError(f"@{graph.name} takes {len(graph.params)} arguments; found {len(args)}")
    env: dict[Value, np.ndarray] = {}
    for param, arg in zip(graph.params, args):
        arg = np.asarray(arg)
        check_array(arg, param.type, f"argument {param.name_hint or param.index} of @{graph.name}")
        env[param] = arg
    for op in graph.ops:
        outs = eval_op(op, [env[v] for v in op.operands], context)
        if len(outs) != len(op.results):
            raise CompileError(
                f"internal error: op '{op.name}' produced {len(outs)} results, expected {len(op.results)}"
            )
        for result, value in zip(op.results, outs):
            check_array(value, result.type, f"internal error: result of op '{op.name}' at {op.loc}")
            env[result] = value
    return [env[r] for r in graph.results]


# --- structured control flow --------------------------------------------------------------------------


def _run_cond(op: Op, args, context):
    pred, *xs = args
    region = op.regions[0] if bool(pred) else op.regions[1]
    return interpret(region, xs, context)


def _run_while(op: Op, args, context):
    num_carry = op.attrs["num_carry"]
    carry, invariants = list(args[:num_carry]), list(args[num_carry:])
    cond_region, body_region = op.regions
    while bool(interpret(cond_region, carry + invariants, context)[0]):
        carry = interpret(body_region, carry + invariants, context)
    return carry


def _run_for(op: Op, args, context):
    num_carry = op.attrs["num_carry"]
    lo, hi, *rest = args
    carry, invariants = list(rest[:num_carry]), list(rest[num_carry:])
    for i in range(int(lo), int(hi)):
        index = np.asarray(i, dtype=lo.dtype)
        carry = interpret(op.regions[0], [index, *carry, *invariants], context)
    return carry


def _run_fusion(op: Op, args, context):
    return interpret(op.regions[0], args, context)


HANDLERS.update({"cond": _run_cond, "while": _run_while, "for": _run_for, "fusion": _run_fusion})


# --- state --------------------------------------------------------------------------------------------


def _variable_buffer(op: Op, context) -> np.ndarray:
    buffers = getattr(context, "variables", None)
    if buffers is None or op.attrs["var"] not in buffers:
        raise CompileError(f"{op.loc}: op '{op.name}': no buffer for variable '{op.attrs['var']}' in this call")
    return buffers[op.attrs["var"]]


def _read_variable(op: Op, args, context):
    return [_variable_buffer(op, context).copy()]


def _update_variable(op: Op, args, context):
    buffer = _variable_buffer(op, context)
    (value,) = args
    with np.errstate(over="ignore"):
        if op.name == "assign":
            np.copyto(buffer, value)
        elif op.name == "assign_add":
            np.copyto(buffer, (buffer + value).astype(buffer.dtype))
        else:
            np.copyto(buffer, (buffer - value).astype(buffer.dtype))
    return []


HANDLERS.update(
    {
        "read_variable": _read_variable,
        "assign": _update_variable,
        "assign_add": _update_variable,
        "assign_sub": _update_variable,
    }
)


# --- communication --------------------------------------------------------------------------------------


def _channel(context) -> Channel:
    channel = getattr(context, "channel", None)
    return loopback() if channel is None else channel  # a graph run on its own: its sends reach its own recvs


def _send(op: Op, args, context):
    _channel(context).send(op.attrs["key"], args[0])  # the array itself: the interpreter never mutates it
    return []


def _recv(op: Op, args, context):
    ttype = op.result.type
    return [receive_array(_channel(context), op.attrs["key"], ttype.shape, ttype.dtype.np_dtype, f"{op.loc}: ")]


def _send_done(op: Op, args, context):
    return []  # sends hand over the arrays themselves: nothing to wait for


HANDLERS.update({"send": _send, "recv": _recv, "send_done": _send_done})
