"""State: ops that read and update `Variable`s, named buffers that outlive a call.

Variables are referenced by a unique `var` name attribute and carry their type in attributes, so
each op is self-describing in text IR. These ops are effectful: passes never delete, merge or
reorder them, and a read after a write sees the written value.

    read_variable {var, shape, dtype} -> value
    assign / assign_add / assign_sub (value) {var, shape, dtype} -> ()
"""

from __future__ import annotations

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import STATEFUL, defop
from flowjit.ir.ops.rules import int_tuple
from flowjit.ir.types import TensorType

STATE_ATTRS = ("var", "shape", "dtype")


def variable_type(attrs) -> TensorType:
    return TensorType(int_tuple(attrs["shape"], "shape"), dt.dtype(attrs["dtype"]))


def _read_rule(types, attrs):
    if not isinstance(attrs["var"], str) or not attrs["var"]:
        raise ShapeError(f"'var' must be a non-empty name; found {attrs['var']!r}")
    return [variable_type(attrs)]


def _assign_rule(types, attrs):
    (value,) = types
    expected = variable_type(attrs)
    if value != expected:
        raise ShapeError(f"variable '{attrs['var']}' holds {expected}; the assigned value is {value}")
    return []


defop("read_variable", STATEFUL, _read_rule, None, 0, attrs=STATE_ATTRS, doc="the variable's current value")
for _name, _doc in (
    ("assign", "variable = value"),
    ("assign_add", "variable += value"),
    ("assign_sub", "variable -= value"),
):
    defop(_name, STATEFUL, _assign_rule, None, 1, attrs=STATE_ATTRS, doc=_doc)

STATE_UPDATES = ("assign", "assign_add", "assign_sub")
