"""`functionalize-state`: variables become explicit parameters and results.

Every variable the graph reads or updates becomes one extra parameter (its value on entry); every
variable it updates also becomes one extra result (its value on exit). `read_variable` is replaced by
the variable's current SSA value, `assign` makes the assigned value current, `assign_add`/`assign_sub`
become an `add`/`sub` of the current value. Region ops thread state through: a `cond` gets the
variables it touches as extra operands and the ones it updates as extra results; a `while`/`for`
carries the variables its body updates and passes the ones it only reads as invariants.

Backends compile the functional graph and bind the extra parameters/results to the variables' live
buffers (an updated variable's input and output are the same buffer), so the update happens in
place; ahead-of-time libraries expose them as arguments, or freeze them into constants.

Assumes a verified graph. Guarantees: no state op remains; results and reads are unchanged in
value; the order of reads and writes is preserved by data dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowjit.errors import CompileError
from flowjit.ir.builder import make_op
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.ops import STATEFUL, get_opdef
from flowjit.ir.ops.stateful import STATE_UPDATES, variable_type
from flowjit.ir.types import TensorType
from flowjit.passes.registry import register


@dataclass(frozen=True)
class StateLayout:
    """Where the variables went: `inputs[i]` is the variable behind extra parameter i (after the
    original ones); `outputs[j]` the variable behind extra result j (after the original results)."""

    inputs: tuple[tuple[str, TensorType], ...] = ()
    outputs: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.inputs


def _state_ops(graph: Graph):
    return (op for op in graph.walk() if get_opdef(op.name).family == STATEFUL)


def touched_variables(graph: Graph) -> dict[str, TensorType]:
    """Variables read or updated anywhere in `graph` (regions included), in first-use order."""
    found: dict[str, TensorType] = {}
    for op in _state_ops(graph):
        name = op.attrs["var"]
        vtype = variable_type(op.attrs)
        if found.setdefault(name, vtype) != vtype:
            raise CompileError(f"{op.loc}: variable '{name}' is used with types {found[name]} and {vtype}")
    return found


def updated_variables(graph: Graph) -> list[str]:
    seen: dict[str, None] = {}
    for op in _state_ops(graph):
        if op.name in STATE_UPDATES:
            seen.setdefault(op.attrs["var"], None)
    return list(seen)


class _Functionalizer:
    def __init__(self):
        self.replace: dict[Value, Value] = {}

    def resolve(self, v: Value) -> Value:
        while v in self.replace:
            v = self.replace[v]
        return v

    def body(self, graph: Graph, current: dict[str, Value]) -> None:
        """Rewrite `graph` in place; `current` maps each variable to its value at this point."""
        new_ops: list[Op] = []
        for op in graph.ops:
            op.operands = [self.resolve(v) for v in op.operands]
            if op.name == "read_variable":
                self.replace[op.result] = current[op.attrs["var"]]
            elif op.name in STATE_UPDATES:
                self._update(op, current, new_ops)
            elif op.regions and any(True for _ in (o for r in op.regions for o in _state_ops(r))):
                new_ops.append(self._region_op(op, current))
            else:
                new_ops.append(op)
        graph.ops = new_ops
        graph.results = [self.resolve(v) for v in graph.results]

    def _update(self, op: Op, current: dict[str, Value], new_ops: list[Op]) -> None:
        name = op.attrs["var"]
        (value,) = op.operands
        if op.name == "assign":
            current[name] = value
            return
        arith = make_op(
            "add" if op.name == "assign_add" else "sub", [current[name], value], {}, op.loc, device=op.device
        )
        new_ops.append(arith)
        current[name] = arith.result

    def _region_op(self, op: Op, current: dict[str, Value]) -> Op:
        touched: dict[str, TensorType] = {}
        updated: list[str] = []
        for region in op.regions:
            for name, vtype in touched_variables(region).items():
                touched.setdefault(name, vtype)
            updated += [n for n in updated_variables(region) if n not in updated]
        read_only = [n for n in touched if n not in updated]
        if op.name == "cond":
            return self._cond(op, current, touched, updated)
        if op.name == "while" and updated_variables(op.regions[0]):
            raise CompileError(f"{op.loc}: a while_loop condition must not update variables")
        return self._loop(op, current, touched, updated, read_only)

    def _cond(self, op, current, touched, updated) -> Op:
        names = list(touched)
        for region in op.regions:
            local = {n: region.add_param(touched[n], n) for n in names}
            self.body(region, local)
            region.results = region.results + [local[n] for n in updated]
        new = make_op(
            op.name, op.operands + [current[n] for n in names], op.attrs, op.loc, regions=op.regions, device=op.device
        )
        return self._finish(op, new, current, updated)

    def _loop(self, op, current, touched, updated, read_only) -> Op:
        num_carry = op.attrs["num_carry"]
        lead = 2 if op.name == "for" else 0  # for: (lo, hi) operands, (i) region param
        region_lead = 1 if op.name == "for" else 0
        carry_end = lead + num_carry
        operands = (
            op.operands[:carry_end]
            + [current[n] for n in updated]
            + op.operands[carry_end:]
            + [current[n] for n in read_only]
        )
        for index, region in enumerate(op.regions):
            params = region.params
            split = region_lead + num_carry
            inserted = {n: Value(touched[n], None, 0, n) for n in updated}
            appended = {n: Value(touched[n], None, 0, n) for n in read_only}
            region.params = params[:split] + list(inserted.values()) + params[split:] + list(appended.values())
            for i, p in enumerate(region.params):
                p.index = i
            local = {**inserted, **appended}
            self.body(region, local)
            is_body = op.name == "for" or index == 1
            if is_body:
                region.results = region.results + [local[n] for n in updated]
        attrs = {**op.attrs, "num_carry": num_carry + len(updated)}
        new = make_op(op.name, operands, attrs, op.loc, regions=op.regions, device=op.device)
        return self._finish(op, new, current, updated)

    def _finish(self, old: Op, new: Op, current, updated) -> Op:
        n = len(old.results)
        for a, b in zip(old.results, new.results[:n]):
            self.replace[a] = b
        for name, value in zip(updated, new.results[n:]):
            current[name] = value
        return new


def functionalize_state(graph: Graph) -> tuple[Graph, StateLayout]:
    """Rewrite `graph` (in place) so variables are parameters and results; see the module doc."""
    touched = touched_variables(graph)
    if not touched:
        return graph, StateLayout()
    updated = updated_variables(graph)
    current = {name: graph.add_param(vtype, name) for name, vtype in touched.items()}
    _Functionalizer().body(graph, current)
    graph.results = graph.results + [current[n] for n in updated]
    return graph, StateLayout(tuple(touched.items()), tuple(updated))


@register("functionalize-state")
def functionalize_state_pass(graph: Graph) -> Graph:
    """Variables become extra parameters (values on entry) and extra results (values on exit of the
    updated ones), in first-use order."""
    return functionalize_state(graph)[0]
