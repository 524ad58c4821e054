"""The verifier: every op is registered, has its attributes, and its result types agree with its
shape rule; every operand is defined before its use in the same graph (regions are self-contained:
they read only their parameters and their own ops); regions have the count their op declares; all
ops naming one variable agree on its shape and dtype. Runs after every pass in tests and under
`FLOWJIT_VERIFY=1`."""

from __future__ import annotations

from flowjit.errors import FlowjitError, FlowjitTypeError, FlowjitValueError, op_error
from flowjit.ir.builder import infer_types
from flowjit.ir.graph import Graph, Op
from flowjit.ir.ops import REGISTRY, STATEFUL, get_opdef
from flowjit.ir.types import TensorType


class VerificationError(FlowjitError):
    """The IR is malformed (a compiler bug, or bad hand-written text IR)."""


def _fail(op: Op, message: str) -> VerificationError:
    return op_error(VerificationError, op.loc, op.name, message)


def check_op(op: Op) -> None:
    """Check one op on its own: it is registered, has the regions its definition declares, and its
    result types are what its shape rule gives for its operands and attributes."""
    try:
        opdef = get_opdef(op.name)
    except FlowjitValueError as e:
        raise _fail(op, str(e)) from None
    if len(op.regions) != opdef.num_regions:
        raise _fail(op, f"expects {opdef.num_regions} regions; found {len(op.regions)}")
    try:
        expected = infer_types(
            op.name,
            [v.type for v in op.operands],
            {**op.attrs, "__regions__": op.regions} if op.regions else op.attrs,
            op.loc,
        )
    except (FlowjitTypeError, FlowjitValueError) as e:
        raise VerificationError(str(e)) from None
    except (ValueError, TypeError, IndexError, KeyError) as e:
        # A shape rule tripping over an attribute of the wrong kind (hand-written IR, a buggy pass).
        raise _fail(op, f"malformed attributes {_attr_summary(op)}: {type(e).__name__}: {e}") from None
    found = [r.type for r in op.results]
    if list(expected) != found:
        raise _fail(op, f"result types {_types(found)} disagree with the shape rule's {_types(expected)}")


def _attr_summary(op: Op) -> str:
    return "{" + ", ".join(f"{k} = {v!r}" for k, v in sorted(op.attrs.items())) + "}"


def _types(types) -> str:
    return "(" + ", ".join(str(t) for t in types) + ")"


def _verify_op(op: Op, defined: set) -> None:
    for i, v in enumerate(op.operands):
        if v not in defined:
            raise _fail(op, f"operand {i} ({v.type}) is not defined before it (in this graph or region)")
    if any(r in defined for r in op.results):
        raise _fail(op, "its results are defined twice (the op appears twice in the graph)")
    check_op(op)


def verify(graph: Graph) -> None:
    """Raise `VerificationError` describing the first problem in `graph` (recursing into regions)."""
    _verify_graph(graph, f"@{graph.name}")
    _verify_variables(graph)


def _verify_graph(graph: Graph, where: str) -> None:
    # Regions are self-contained: they see their parameters and their own ops, never the enclosing
    # graph's values (those come in as operands of the region's op).
    defined = set(graph.params)
    for op in graph.ops:
        _verify_op(op, defined)
        for i, region in enumerate(op.regions):
            _verify_graph(region, f"region {i} (^{region.name}) of op '{op.name}' at {op.loc}")
        defined.update(op.results)
    for i, r in enumerate(graph.results):
        if r not in defined:
            raise VerificationError(f"{where}: result {i} ({r.type}) is not defined in it")


def _verify_variables(graph: Graph) -> None:
    """Every op naming a variable agrees on its type (runs after the per-op checks, so the `shape`
    and `dtype` attributes are well formed)."""
    first_use: dict[str, tuple[Op, TensorType]] = {}
    for op in graph.walk():
        if "var" not in op.attrs or op.name not in REGISTRY or REGISTRY[op.name].family != STATEFUL:
            continue
        ttype = TensorType(op.attrs["shape"], op.attrs["dtype"])
        first, first_type = first_use.setdefault(op.attrs["var"], (op, ttype))
        if ttype != first_type:
            raise _fail(
                op,
                f"variable '{op.attrs['var']}' is {ttype} here but {first_type} at op '{first.name}' ({first.loc})",
            )
