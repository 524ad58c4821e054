"""The `place` pass: give every op a concrete device, and record the rule that chose it.

Assumes: ops carry their user constraint in `op.device` (a full or partial device name, or None),
as traced under `with fj.device(...)` / `fj.jit(..., device=...)`.
Input: the devices it may use (`place(graph, devices)`; the registered pass reads `graph.devices`,
which the frontend sets to the local devices, `fj.devices()`, and a cluster to its tasks' devices).
Guarantees: every op, nested ones included, has `op.device` set to the full name of one of those
devices; ops that touch one variable share a device; a region op (cond/while/for) and its
body share a device; `graph.placement` maps each top-level op to a one-line reason.

Ops without a constraint are placed among the devices of the first device's task (the calling
process, when the frontend lists the local devices first): devices of other tasks (a cluster's)
only take the ops the program puts there.

Cost model (deterministic, in estimated microseconds; constants below, measured by
`benchmarks/multidevice.py`): an op costs its elements touched (operands + results) at
`ELEMENTS_PER_US`, a contraction its multiply-adds at `FLOPS_PER_US`; moving a value to another
device costs `TRANSFER_LATENCY_US` plus its bytes at `TRANSFER_BYTES_PER_US`, once per
(value, device). Each op goes to the device where it would finish earliest given when that device
is free and when its operands can arrive there (list scheduling), ties broken by fewer bytes moved,
then by device order. Results bound for a pinned op on another device (a variable's update, a
constrained consumer) add their transfer to the estimate. An op leaves its affine device (where
most of its operand bytes are, else where its results are bound for, else where the previous op
went) only when that gains more than one transfer latency, the price of joining the results again.
So chains stay on one device, small programs are not split, and
independent work big enough to pay for its transfers spreads across devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flowjit.errors import CompileError, FlowjitValueError
from flowjit.ir.devices import Device, DeviceSpec
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.ops import CONTRACTION, get_opdef
from flowjit.passes.registry import register

ELEMENTS_PER_US = 1000.0  # elementwise/movement work: ~1 ns per element touched
FLOPS_PER_US = 4000.0  # contractions: multiply-adds per microsecond on one core
TRANSFER_LATENCY_US = 30.0  # one send/recv between CPU devices (rendezvous hand-off, thread wake-up)
TRANSFER_BYTES_PER_US = 4000.0  # ~4 GB/s: one memcpy between host buffers
# Between tasks (processes, maybe machines): a Ray call and the object store or the network.
TASK_TRANSFER_LATENCY_US = 1000.0
TASK_TRANSFER_BYTES_PER_US = 1000.0  # ~1 GB/s

# Ops with no operands that are cheaper to recreate than to move: placed with their first consumer,
# and duplicated by `partition` for consumers on other devices.
FREE_CREATIONS = frozenset({"constant", "iota"})


@dataclass
class _Unit:
    """A top-level op with its regions: placed as one. `constraint` merges every nested op's."""

    op: Op
    constraint: DeviceSpec | None
    constraint_op: Op | None  # the op whose constraint `constraint` came from (for errors)
    variables: frozenset[str]


def _full_device(name: str) -> Device:
    spec = DeviceSpec.parse(name)
    if not spec.is_full:
        raise FlowjitValueError(
            f"placement needs full device names like '/job:localhost/task:0/device:cpu:0'; found {name!r}"
        )
    return Device(spec)


def _parse(op: Op) -> DeviceSpec | None:
    return DeviceSpec.parse(op.device) if op.device else None


def merge_constraints(a: DeviceSpec, b: DeviceSpec) -> DeviceSpec | None:
    """The constraint satisfying both `a` and `b`, or None when they contradict each other."""
    fields = []
    for x, y in zip((a.job, a.task, a.device_type, a.index), (b.job, b.task, b.device_type, b.index)):
        if x is not None and y is not None and x != y:
            return None
        fields.append(x if x is not None else y)
    return DeviceSpec(*fields)


def _contradiction(op: Op, spec: DeviceSpec, other: Op, other_spec: DeviceSpec, why: str) -> FlowjitValueError:
    return FlowjitValueError(
        f"{op.loc}: op '{op.name}' is constrained to '{spec}' but {why}, and op '{other.name}' at {other.loc} is "
        f"constrained to '{other_spec}'; these constraints contradict each other. Put both under one "
        "`with fj.device(...)` or drop one of them"
    )


def _unit(op: Op) -> _Unit:
    constraint, source = _parse(op), op
    variables = set()
    for inner in [op, *(o for r in op.regions for o in r.walk())]:
        if "var" in inner.attrs and get_opdef(inner.name).effectful:
            variables.add(inner.attrs["var"])
        spec = _parse(inner)
        if spec is None or inner is op:
            continue
        merged = spec if constraint is None else merge_constraints(constraint, spec)
        if merged is None:
            raise _contradiction(
                inner, spec, source, constraint, f"it is inside the region of '{op.name}' at {op.loc}, placed as a unit"
            )
        constraint, source = merged, source if constraint is not None else inner
    return _Unit(op, constraint, source if constraint is not None else None, frozenset(variables))


def _variable_groups(units: list[_Unit]) -> dict[int, int]:
    """Union-find over units: units touching a common variable share a group (index of its root)."""
    parent = list(range(len(units)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_user: dict[str, int] = {}
    for i, unit in enumerate(units):
        for var in sorted(unit.variables):
            j = first_user.setdefault(var, i)
            parent[root(i)] = root(j)
    return {i: root(i) for i in range(len(units))}


def op_cost_us(op: Op) -> float:
    """Estimated run time of `op` (with its regions, bodies counted once) in microseconds."""
    if op.regions:
        return sum(op_cost_us(inner) for region in op.regions for inner in region.ops)
    sizes = [v.type.size for v in op.operands]
    out = sum(v.type.size for v in op.results)
    if get_opdef(op.name).family == CONTRACTION and len(sizes) == 2:
        # sqrt(|a| |b| |out|) is M*N*K for a matmul (M x K) @ (K x N).
        return math.sqrt(float(sizes[0]) * sizes[1] * max(out, 1)) / FLOPS_PER_US
    return (sum(sizes) + out) / ELEMENTS_PER_US


def transfer_us(value: Value, source: str | None = None, dest: str | None = None) -> float:
    """Estimated cost of moving `value` from device `source` to device `dest` in microseconds:
    between two CPU devices of one process, or (when the names' tasks differ) between tasks."""
    if source is not None and dest is not None and _task(source) != _task(dest):
        return TASK_TRANSFER_LATENCY_US + value.type.nbytes / TASK_TRANSFER_BYTES_PER_US
    return TRANSFER_LATENCY_US + value.type.nbytes / TRANSFER_BYTES_PER_US


def _task(device: str) -> tuple[str | None, int | None]:
    spec = DeviceSpec.parse(device)
    return spec.job, spec.task


class _Scheduler:
    """Earliest-finish-time list scheduling over candidate devices."""

    def __init__(self, all_devices: list[Device]):
        self.free_at = {d.name: 0.0 for d in all_devices}
        self.order = {d.name: i for i, d in enumerate(all_devices)}
        self.home: dict[Value, str] = {}  # value -> device that computes it
        self.ready: dict[tuple[Value, str], float] = {}  # (value, device) -> time it is available there
        self.last = all_devices[0].name  # the device of the op placed last

    def arrival(self, value: Value, device: str) -> tuple[float, int]:
        """When `value` can be read on `device`, and the bytes moved to get it there."""
        home = self.home.get(value)
        if home is None:  # a parameter or a free creation: available everywhere at time 0
            return 0.0, 0
        if (value, device) in self.ready:
            return self.ready[(value, device)], 0
        return self.ready[(value, home)] + transfer_us(value, home, device), value.type.nbytes

    def estimate(self, op: Op, device: str) -> tuple[float, int]:
        start, moved = self.free_at[device], 0
        for v in op.operands:
            t, nbytes = self.arrival(v, device)
            start, moved = max(start, t), moved + nbytes
        return start + op_cost_us(op), moved

    def affinity(self, op: Op, bound_for: str | None) -> str:
        """The device `op` leans to: where most of its operand bytes are computed, else where its
        results are bound for, else where the previous op went (so a program's ops stay together
        unless splitting pays)."""
        weights: dict[str, int] = {}
        for v in op.operands:
            if v in self.home:
                weights[self.home[v]] = weights.get(self.home[v], 0) + v.type.nbytes
        if not weights:
            return bound_for or self.last
        return min(weights, key=lambda d: (-weights[d], self.order[d]))

    def choose(self, op: Op, candidates: list[Device], bound_for: str | None) -> tuple[str, str]:
        """The best device for `op` and the reason. `bound_for` is the device its results will be
        needed on (a pinned consumer downstream), if known: elsewhere they would cost a transfer."""
        scored = {}
        for d in candidates:
            finish, moved = self.estimate(op, d.name)
            if bound_for is not None and d.name != bound_for:
                finish += sum(transfer_us(r, d.name, bound_for) for r in op.results)
            scored[d.name] = (finish, moved)
        best = min(scored, key=lambda d: (*scored[d], self.order[d]))
        home = self.affinity(op, bound_for)
        # Leaving the affine device costs at least one transfer later (results join again), so a
        # move must gain more than that.
        if home in scored and best != home and scored[best][0] + TRANSFER_LATENCY_US >= scored[home][0]:
            best = home
        finish, moved = scored[best]
        reason = f"cost model: finishes first (~{finish:.1f} us, {moved} bytes moved in)"
        return best, reason

    def commit(self, op: Op, device: str) -> None:
        start = self.free_at[device]
        for v in op.operands:
            t, _ = self.arrival(v, device)
            start = max(start, t)
            if self.home.get(v) is not None:
                self.ready[(v, device)] = t
        finish = start + op_cost_us(op)
        self.free_at[device] = finish
        self.last = device
        for r in op.results:
            self.home[r] = device
            self.ready[(r, device)] = finish


# Device types that get only ops constrained to them.
EXPLICIT_ONLY = frozenset({"gpu"})


def _candidates(op: Op, constraint: DeviceSpec | None, source: Op | None, local: list[Device]) -> list[Device]:
    """The devices fitting `constraint` (which `source` set on `op`'s unit); an error when none does.
    An op without a constraint stays in the task of the first device (this process): work goes to
    another task only where the program says so. Nor does it go to a GPU: until placement knows
    which ops the GPU lowers (issue #38), a GPU runs only what the program places there."""
    if constraint is None:
        home = (local[0].spec.job, local[0].spec.task)
        found = [d for d in local if (d.spec.job, d.spec.task) == home]
        return [d for d in found if d.device_type not in EXPLICIT_ONLY] or found
    found = [d for d in local if constraint.matches(d)]
    if not found:
        op = source or op
        raise FlowjitValueError(
            f"{op.loc}: op '{op.name}': no device matches the constraint '{constraint}'; the devices are "
            f"{', '.join(d.name for d in local)} (set FLOWJIT_CPU_DEVICES=N for N local CPU devices)"
        )
    return found


def _bound_for(units: list[_Unit], pinned: dict[int, str]) -> dict[Op, str]:
    """For each unit's op, the device of the first pinned op its results flow into (backwards
    from the pinned ops: the update of a variable pulls the ops computing its new value)."""
    users: dict[Value, list[Op]] = {}
    for unit in units:
        for v in unit.op.operands:
            users.setdefault(v, []).append(unit.op)
    bound: dict[Op, str] = {}
    for i in reversed(range(len(units))):
        op = units[i].op
        if i in pinned:
            bound[op] = pinned[i]
            continue
        for user in (u for r in op.results for u in users.get(r, [])):
            if user in bound:
                bound[op] = bound[user]
                break
    return bound


def _set_device(op: Op, device: str) -> None:
    op.device = device
    for region in op.regions:
        for inner in region.walk():
            inner.device = device


@register("place")
def place_pass(graph: Graph) -> Graph:
    """The registered `place` pass: `place` on the devices the graph says it may use."""
    if not graph.devices:
        raise CompileError(
            f"graph '{graph.name}' has no device set to place on: set `graph.devices` to the devices it may "
            "use (the frontend and `flowjit opt` use the local devices) or call place(graph, devices)"
        )
    return place(graph, graph.devices)


def place(graph: Graph, devices: Sequence[Device | str]) -> Graph:
    """Assign every op one of `devices` and record why in `graph.placement` (op -> reason).

    Algorithm:
    1. Treat each top-level op with its regions as one unit; merge the constraints inside it.
    2. Group units that touch a common variable (colocation); merge the group's constraints, and
       report contradicting ones naming both source lines.
    3. Walking backwards, note for each unit the device of the first pinned unit (one fitting
       device) its results flow into.
    4. Walk units in program order: a unit whose group is placed joins it; a constrained unit with
       one fitting device takes it; free creations (constants) wait for their first consumer;
       everything else goes to the fitting device where the cost model says it finishes first
       (counting a transfer of its results when they are bound for another device).
    5. Free creations take their first consumer's device (partition copies them to other users).
    """
    local = [d if isinstance(d, Device) else _full_device(d) for d in devices]
    if not local:
        raise CompileError(f"graph '{graph.name}': placement needs at least one device")
    graph.devices = tuple(d.name for d in local)
    units = [_unit(op) for op in graph.ops]
    groups = _variable_groups(units)
    group_constraint: dict[int, tuple[DeviceSpec, Op]] = {}
    for i, unit in enumerate(units):
        if unit.constraint is None:
            continue
        g = groups[i]
        if g not in group_constraint:
            group_constraint[g] = (unit.constraint, unit.constraint_op)
            continue
        spec, source = group_constraint[g]
        merged = merge_constraints(spec, unit.constraint)
        if merged is None:
            shared = sorted(unit.variables & units[g].variables) or sorted(unit.variables)
            raise _contradiction(
                unit.constraint_op,
                unit.constraint,
                source,
                spec,
                f"it uses variable '{shared[0]}', which must live on one device with every op that reads or updates it",
            )
        group_constraint[g] = (merged, source)

    pinned = {}  # unit index -> its device, when its constraint leaves one
    for i, unit in enumerate(units):
        spec, source = group_constraint.get(groups[i], (None, None))
        fitting = _candidates(unit.op, spec, source, local)
        if spec is not None and len(fitting) == 1:
            pinned[i] = fitting[0].name
    bound_for = _bound_for(units, pinned)
    scheduler = _Scheduler(local)
    reasons: dict[Op, str] = {}
    group_device: dict[int, tuple[str, Op]] = {}
    first_consumer: dict[Op, str] = {}
    deferred = []
    for i, unit in enumerate(units):
        op, g = unit.op, groups[i]
        constrained = group_constraint.get(g)
        in_group = bool(unit.variables)  # only units touching variables share groups
        if g in group_device and in_group:
            device, leader = group_device[g]
            var = sorted(unit.variables)[0]
            reasons[op] = f"colocated with variable '{var}' (as op '{leader.name}' at {leader.loc})"
        elif op.name in FREE_CREATIONS and constrained is None and not op.operands:
            deferred.append(op)
            continue
        else:
            spec, source = constrained if constrained else (None, None)
            fitting = _candidates(op, spec, source, local)
            if len(fitting) == 1 and spec is not None:
                device = fitting[0].name
                reasons[op] = f"constraint '{spec}' ({source.loc})"
            elif len(fitting) == 1:
                device, reasons[op] = fitting[0].name, "the only device"
            else:
                device, reasons[op] = scheduler.choose(op, fitting, bound_for.get(op))
                if spec is not None:
                    reasons[op] += f" among devices matching '{spec}' ({source.loc})"
            if in_group:
                group_device[g] = (device, op)
        scheduler.commit(op, device)
        _set_device(op, device)
        for v in op.operands:
            if v.producer is not None:
                first_consumer.setdefault(v.producer, device)
    for op in deferred:
        device = first_consumer.get(op, local[0].name)
        _set_device(op, device)
        reasons[op] = "created where first used" if op in first_consumer else "unused: default device"
    graph.placement = {op: reasons[op] for op in graph.ops}
    return graph
