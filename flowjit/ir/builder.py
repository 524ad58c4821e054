"""Creating ops: look up the definition, fill defaulted attributes, run the shape rule, and turn a
rule's complaint into a user-facing error that names the op and the user's source line."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError, ShapeError, op_error
from flowjit.ir.dtypes import DType
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.location import UNKNOWN, Location
from flowjit.ir.ops import get_opdef
from flowjit.ir.types import TensorType


def single_value(array: np.ndarray) -> bool:
    """Whether every element of a non-empty `array` has the bits of its first: -0.0 is not 0.0, and
    nan payloads count (a value-equality test would take [-0.0, 0.0] for a splat of -0.0). Checked a block
    at a time, so an array of varied values fails on its first block."""
    if array.size == 0 or array.dtype.itemsize not in (1, 2, 4, 8):
        return False
    flat = np.ascontiguousarray(array).reshape(-1)
    bits = flat.view(f"u{flat.dtype.itemsize}")
    first, block = bits[0], 1 << 16
    return all(np.all(bits[i : i + block] == first) for i in range(0, bits.size, block))


def normalize_attr(value):
    """Attributes are immutable: lists become tuples, numpy scalars become Python scalars."""
    if isinstance(value, (list, tuple)):
        return tuple(normalize_attr(v) for v in value)
    if isinstance(value, np.ndarray | DType | str | bool | int | float):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise FlowjitValueError(f"unsupported attribute value {value!r} ({type(value).__name__})")


def infer_types(name: str, operand_types: Sequence[TensorType], attrs: dict, loc: Location = UNKNOWN):
    """Result types of op `name`; raises FlowjitTypeError naming the op and `loc` on a mismatch."""
    opdef = get_opdef(name)
    if opdef.arity is not None and len(operand_types) != opdef.arity:
        raise op_error(FlowjitTypeError, loc, name, f"expects {opdef.arity} operands; found {len(operand_types)}")
    missing = [a for a in opdef.attrs if a not in attrs]
    if missing:
        raise op_error(FlowjitValueError, loc, name, f"missing attribute(s) {', '.join(missing)}")
    try:
        return opdef.infer(list(operand_types), attrs)
    except ShapeError as e:
        raise op_error(FlowjitTypeError, loc, name, str(e)) from None


def make_op(
    name: str,
    operands: Sequence[Value],
    attrs: dict | None = None,
    loc: Location = UNKNOWN,
    regions: Sequence[Graph] = (),
    device: str | None = None,
    result_types: Sequence[TensorType] | None = None,
) -> Op:
    """Build (but do not insert) an op, with its result types inferred by its shape rule."""
    opdef = get_opdef(name)
    full = {**opdef.defaults, **{k: normalize_attr(v) for k, v in (attrs or {}).items()}}
    if result_types is None:
        rule_attrs = {**full, "__regions__": list(regions)} if regions else full
        result_types = infer_types(name, [v.type for v in operands], rule_attrs, loc)
    return Op(name, operands, result_types, full, loc, device, regions)


def emit(
    graph: Graph, name: str, operands: Sequence[Value], attrs: dict | None = None, loc: Location = UNKNOWN, **kwargs
) -> Op:
    """Build an op and append it to `graph`."""
    return graph.append(make_op(name, operands, attrs, loc, **kwargs))
