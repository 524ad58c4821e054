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
only take the ops the program puts there. `graph.unconstrained_device_types`, when set, limits them
further to those device types (the frontend keeps them on CPUs when the program names a target).

Device types other than the CPU register what placement must know of them
(`register_device_type_model`, from their backend: passes cannot import backends): which ops they
cannot run and why, how fast they run the rest, and what a copy between them and the host costs.
An op goes only to a device whose type runs it. One constrained to a device that cannot run it goes
to a device of the same task that can (soft placement, as TensorFlow's `allow_soft_placement`),
and the report says why.

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

On a device type with a model, an op costs the model's launch overhead plus its CPU cost divided by
the model's speed-up (elementwise or contraction); a device that does not compute in host memory
(a GPU) pays a host copy for each parameter it reads (once) and each function result it computes,
and a send/recv to or from it costs what one between CPU devices does (the rendezvous hand-off
and a host copy: a GPU partition's send/recv run on the host) plus the model's copy for each end
that has its own memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class DeviceTypeModel:
    """What placement knows of one device type, registered by its backend.

    `cannot_run(op)` is None when the device type runs `op` (with its regions), else the reason a
    placement report shows. Speeds are relative to one CPU core (`ELEMENTS_PER_US`,
    `FLOPS_PER_US`); `launch_us` is paid once per kernel. A copy between such a device and the host
    costs `transfer_latency_us` plus bytes at `transfer_bytes_per_us`. `host_memory` False: the
    device computes in its own memory, so parameters (host buffers) and results cost a copy."""

    cannot_run: Callable[[Op], str | None]
    elementwise_speedup: float = 1.0
    contraction_speedup: float = 1.0
    launch_us: float = 0.0
    transfer_latency_us: float = TRANSFER_LATENCY_US
    transfer_bytes_per_us: float = TRANSFER_BYTES_PER_US
    host_memory: bool = True

    def __post_init__(self):
        for name in ("elementwise_speedup", "contraction_speedup", "transfer_bytes_per_us"):
            if not getattr(self, name) > 0:
                raise FlowjitValueError(f"DeviceTypeModel.{name} must be positive; found {getattr(self, name)!r}")
        if self.launch_us < 0 or self.transfer_latency_us < 0:
            raise FlowjitValueError("DeviceTypeModel: launch_us and transfer_latency_us must not be negative")


def _runs_everything(op: Op) -> None:
    return None


# The CPU runs every op; other device types register their model.
CPU_MODEL = DeviceTypeModel(_runs_everything)
DEVICE_TYPE_MODELS: dict[str, DeviceTypeModel] = {}


def register_device_type_model(device_type: str, model: DeviceTypeModel) -> None:
    """Tell placement which ops devices of `device_type` run, how fast, and what copies to and from
    them cost (a backend calls this for the device types it serves)."""
    if device_type == "cpu":
        raise FlowjitValueError("the CPU's model is placement's own; register another device type")
    DEVICE_TYPE_MODELS[device_type] = model


def unregister_device_type_model(device_type: str) -> None:
    DEVICE_TYPE_MODELS.pop(device_type, None)


def device_type_model(device_type: str | None) -> DeviceTypeModel:
    """The registered model of `device_type` (the CPU's for the CPU and unknown types)."""
    return DEVICE_TYPE_MODELS.get(device_type, CPU_MODEL)


def cannot_run_reason(op: Op, device_type: str) -> str | None:
    """Why devices of `device_type` cannot run `op`, or None when they can."""
    return device_type_model(device_type).cannot_run(op)


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


def op_cost_us(op: Op, device_type: str = "cpu") -> float:
    """Estimated run time of `op` (with its regions, bodies counted once) in microseconds on one
    device of `device_type`: its kernels' launches and its work."""
    model = device_type_model(device_type)
    return model.launch_us * _kernels(op) + _work_us(op, model)


def _work_us(op: Op, model: DeviceTypeModel) -> float:
    if op.regions:
        return sum(_work_us(inner, model) for region in op.regions for inner in region.ops)
    sizes = [v.type.size for v in op.operands]
    out = sum(v.type.size for v in op.results)
    if get_opdef(op.name).family == CONTRACTION and len(sizes) == 2:
        # sqrt(|a| |b| |out|) is M*N*K for a matmul (M x K) @ (K x N).
        return math.sqrt(float(sizes[0]) * sizes[1] * max(out, 1)) / FLOPS_PER_US / model.contraction_speedup
    return (sum(sizes) + out) / ELEMENTS_PER_US / model.elementwise_speedup


def _kernels(op: Op) -> int:
    """Kernels a region op launches: one, and one more per reduction in a fused region (the GPU
    writes each reduction of a region as its own kernel)."""
    if op.name != "fusion":
        return 1
    return 1 + sum(1 for region in op.regions for inner in region.walk() if inner.name.startswith("reduce_"))


def transfer_us(value: Value, source: str | None = None, dest: str | None = None) -> float:
    """Estimated cost of moving `value` from device `source` to device `dest` in microseconds:
    between tasks; or within one, the rendezvous hand-off and one host copy (between CPU devices),
    plus the copy to or from each end that has its own memory (its model's cost; a GPU's)."""
    return _transfer_cost_us(value.type.nbytes, source, dest)


def _transfer_cost_us(nbytes: int, source: str | None, dest: str | None) -> float:
    if source is not None and dest is not None and _task(source) != _task(dest):
        return TASK_TRANSFER_LATENCY_US + nbytes / TASK_TRANSFER_BYTES_PER_US
    legs = [_device_model(d) for d in (source, dest) if d is not None and not _device_model(d).host_memory]
    device_copies = sum(m.transfer_latency_us + nbytes / m.transfer_bytes_per_us for m in legs)
    return TRANSFER_LATENCY_US + nbytes / TRANSFER_BYTES_PER_US + device_copies


def _device_model(device: str) -> DeviceTypeModel:
    return device_type_model(DeviceSpec.parse(device).device_type)


def _host_copy_us(value: Value, device: str) -> float:
    """The cost of copying `value` between the host and `device` (0 where it computes in host memory)."""
    model = _device_model(device)
    if model.host_memory:
        return 0.0
    return model.transfer_latency_us + value.type.nbytes / model.transfer_bytes_per_us


def _task(device: str) -> tuple[str | None, int | None]:
    spec = DeviceSpec.parse(device)
    return spec.job, spec.task


class _Scheduler:
    """Earliest-finish-time list scheduling over candidate devices. `results` are the function's
    results: computed on a device that does not compute in host memory, they cost a copy back."""

    def __init__(self, all_devices: list[Device], results: frozenset[Value] = frozenset()):
        self.free_at = {d.name: 0.0 for d in all_devices}
        self.order = {d.name: i for i, d in enumerate(all_devices)}
        self.types = {d.name: d.device_type for d in all_devices}
        self.results = results
        self.home: dict[Value, str] = {}  # value -> device that computes it
        self.ready: dict[tuple[Value, str], float] = {}  # (value, device) -> time it is available there
        self.last = all_devices[0].name  # the device of the op placed last

    def arrival(self, value: Value, device: str) -> tuple[float, int]:
        """When `value` can be read on `device`, and the bytes moved to get it there."""
        if (value, device) in self.ready:
            return self.ready[(value, device)], 0
        home = self.home.get(value)
        if home is None and value.producer is None:  # a parameter: a host buffer, copied to a device's own memory
            copy = _host_copy_us(value, device)
            return copy, value.type.nbytes if copy else 0
        if home is None:  # a free creation: made on every device that reads it
            return 0.0, 0
        return self.ready[(value, home)] + transfer_us(value, home, device), value.type.nbytes

    def estimate(self, op: Op, device: str) -> tuple[float, int]:
        start, moved = self.free_at[device], 0
        for v in op.operands:
            t, nbytes = self.arrival(v, device)
            start, moved = max(start, t), moved + nbytes
        copies_back = sum(_host_copy_us(r, device) for r in op.results if r in self.results)
        return start + op_cost_us(op, self.types[device]) + copies_back, moved

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
        if home in scored and best != home and scored[best][0] + _transfer_cost_us(0, best, home) >= scored[home][0]:
            best = home
        finish, moved = scored[best]
        reason = f"cost model: finishes first (~{finish:.1f} us, {moved} bytes moved in)"
        return best, reason

    def commit(self, op: Op, device: str) -> None:
        start = self.free_at[device]
        for v in op.operands:
            t, _ = self.arrival(v, device)
            start = max(start, t)
            if self.home.get(v) is not None or v.producer is None:
                self.ready[(v, device)] = t
        finish = start + op_cost_us(op, self.types[device])
        self.free_at[device] = finish
        self.last = device
        for r in op.results:
            self.home[r] = device
            self.ready[(r, device)] = finish


def _candidates(
    op: Op, constraint: DeviceSpec | None, source: Op | None, local: list[Device], types: tuple[str, ...] | None
) -> tuple[list[Device], str | None]:
    """The devices fitting `constraint` (which `source` set on `op`'s unit) whose type runs `op`,
    and a note when none of the matching ones can (soft placement: the devices of their task that
    can run it instead); an error when no device matches, or none of the task can run it.

    An op without a constraint stays in the task of the first device (this process): work goes to
    another task only where the program says so; `types` (when not None) limits it further to those
    device types."""
    if constraint is None:
        home = (local[0].spec.job, local[0].spec.task)
        found = [d for d in local if (d.spec.job, d.spec.task) == home]
        found = [d for d in found if types is None or d.device_type in types] or found
        able = [d for d in found if cannot_run_reason(op, d.device_type) is None]
        if not able:
            raise _cannot_run_anywhere(op, found)
        return able, None
    found = [d for d in local if constraint.matches(d)]
    if not found:
        op = source or op
        raise FlowjitValueError(
            f"{op.loc}: op '{op.name}': no device matches the constraint '{constraint}'; the devices are "
            f"{', '.join(d.name for d in local)} (set FLOWJIT_CPU_DEVICES=N for N local CPU devices)"
        )
    able = [d for d in found if cannot_run_reason(op, d.device_type) is None]
    if able:
        return able, None
    tasks = {(d.spec.job, d.spec.task) for d in found}
    instead = [d for d in local if (d.spec.job, d.spec.task) in tasks and cannot_run_reason(op, d.device_type) is None]
    if not instead:
        why = f"constrained to '{constraint}' ({source.loc}), and no device of its task can run it"
        raise _cannot_run_anywhere(op, found, why)
    refused = found[0].device_type
    note = (
        f"soft placement: constraint '{constraint}' ({source.loc}) names a {refused}, which cannot run it: "
        f"{cannot_run_reason(op, refused)}"
    )
    return instead, note


def _cannot_run_anywhere(op: Op, devices: list[Device], why: str = "") -> CompileError:
    reasons = "; ".join(f"{t}: {cannot_run_reason(op, t)}" for t in dict.fromkeys(d.device_type for d in devices))
    where = why or f"none of the devices it may use ({', '.join(d.name for d in devices)}) can run it"
    return CompileError(
        f"{op.loc}: op '{op.name}': {where} ({reasons}); add a CPU device to the devices placement may use, "
        "or constrain the op to one"
    )


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
       (counting a transfer of its results when they are bound for another device). Fitting
       devices run the op (their type's model says so); when every device a constraint matches
       refuses it, the devices of their task that run it fit instead (soft placement, noted).
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

    types = getattr(graph, "unconstrained_device_types", None)
    pinned = {}  # unit index -> its device, when its constraint leaves one
    for i, unit in enumerate(units):
        spec, source = group_constraint.get(groups[i], (None, None))
        fitting, _ = _candidates(unit.op, spec, source, local, types)
        if spec is not None and len(fitting) == 1:
            pinned[i] = fitting[0].name
    bound_for = _bound_for(units, pinned)
    scheduler = _Scheduler(local, frozenset(graph.results))
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
            fitting, soft = _candidates(op, spec, source, local, types)
            if len(fitting) == 1 and spec is not None and soft is None:
                device = fitting[0].name
                reasons[op] = f"constraint '{spec}' ({source.loc})"
            elif len(fitting) == 1:
                device, reasons[op] = fitting[0].name, "the only device"
            else:
                device, reasons[op] = scheduler.choose(op, fitting, bound_for.get(op))
                if spec is not None and soft is None:
                    reasons[op] += f" among devices matching '{spec}' ({source.loc})"
            if soft is not None:
                reasons[op] = f"{soft}; {reasons[op]} of its task that can run it"
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
