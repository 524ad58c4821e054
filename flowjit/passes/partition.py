"""The `partition` pass: cut a placed graph into per-device parts joined by `send`/`recv` pairs.

Assumes: `place` ran (every op has a full device name; a region's body is on its op's device).
Guarantees: no op reads a value computed on another device. Each cross-device edge reads a `recv`
on the consumer's device, fed by a `send` right after the producer (each sending device ends with
one `send_done`); the pair shares a rendezvous key `src->dst:%name` (`cpu:0->cpu:1:%3`, `%3` being
the value's name in the partitioned graph). There is one send per (value, destination device),
however many ops there read it. Constants and `iota` read on another device are copied there
instead of sent. Parameters are host buffers every partition reads directly; results are
collected from the partition that computes them. `graph.transfers` lists the transfers (for the
"placement" report). With one device the pass changes nothing.

`split_partitions` then turns the partitioned graph into one self-contained graph per device,
which the runtime compiles and runs concurrently (`flowjit.runtime.executor`). Each carries
`graph.awaited_sends` (`awaited_sends`): for each of its recvs, which of its own sends must have
been made before that recv can complete, for a backend that runs a partition's communication
out of program order (the GPU's, `backends/gpu/staging.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flowjit.errors import CompileError
from flowjit.ir.builder import make_op
from flowjit.ir.devices import LOCAL_JOB, DeviceSpec
from flowjit.ir.graph import Graph, Op, Value
from flowjit.passes.place import FREE_CREATIONS
from flowjit.passes.registry import register


@dataclass
class Transfer:
    """One send/recv pair: what moves, between which devices, under which key."""

    key: str
    src: str
    dst: str
    nbytes: int
    value_name: str
    producer: Op
    value: Value
    consumers: list[Op]
    ops: tuple[Op, Op]  # (send, recv)


def short_device_name(name: str) -> str:
    """`cpu:1` for a local device (`/job:localhost/task:0/device:cpu:1`), else the full name."""
    spec = DeviceSpec.parse(name)
    if spec.job == LOCAL_JOB and spec.task == 0 and spec.device_type and spec.index is not None:
        return f"{spec.device_type}:{spec.index}"
    return name


def rendezvous_key(src: str, dst: str, value_name: str) -> str:
    """The key a send and its recv meet at: `cpu:0->cpu:1:%3`."""
    return f"{short_device_name(src)}->{short_device_name(dst)}:{value_name}"


def value_names(graph: Graph) -> dict[Value, str]:
    """Each op result's name as the printer writes it (`%3`, `%4#1`): ops with results are numbered
    in program order, nested region ops included."""
    names = {}
    for n, op in enumerate(op for op in graph.walk() if op.results):
        for i, r in enumerate(op.results):
            names[r] = f"%{n}" if len(op.results) == 1 else f"%{n}#{i}"
    return names


def graph_devices(graph: Graph) -> list[str]:
    """The devices of the top-level ops, in order of first appearance."""
    found = []
    for op in graph.ops:
        if op.device is None:
            raise CompileError(f"{op.loc}: op '{op.name}' has no device; run the 'place' pass before 'partition'")
        if op.device not in found:
            found.append(op.device)
    return found


@register("partition")
def partition(graph: Graph) -> Graph:
    """Replace every cross-device edge by a send/recv pair; see the module docstring.

    Algorithm:
    1. Walk ops in order. For each operand computed on another device: reuse the recv already made
       for (value, this device), else copy a constant here, else add a send right after the
       producer and a recv right before this op.
    2. Rebuild the op list with the sends after their producers, and end each sending device's ops
       with a `send_done` reading its sent values (native sends lend their buffers until there).
    3. Key each pair by the sent value's printed name in the new graph; record the transfers.
    """
    graph.transfers = []
    if len(graph_devices(graph)) <= 1:
        return graph
    reasons = graph.placement = getattr(graph, "placement", {})
    here: dict[tuple[Value, str], Value] = {}  # (value, device) -> the value readable on that device
    sends_after: dict[Op, list[Op]] = {}
    consumers: dict[tuple[Value, str], list[Op]] = {}
    new_ops: list[Op] = []
    for op in graph.ops:
        for i, v in enumerate(op.operands):
            producer = v.producer
            if producer is None or producer.device == op.device:
                continue
            key = (v, op.device)
            if key not in here:
                if producer.name in FREE_CREATIONS and not producer.operands:
                    copy = make_op(producer.name, [], producer.attrs, producer.loc, device=op.device)
                    new_ops.append(copy)
                    reasons[copy] = (
                        f"copy of the constant on {short_device_name(producer.device)} (cheaper than a transfer)"
                    )
                    here[key] = copy.result
                else:
                    recv = _add_transfer(graph, v, op.device, sends_after)
                    new_ops.append(recv)
                    here[key] = recv.result
            consumers.setdefault(key, []).append(op)
            op.operands[i] = here[key]
        new_ops.append(op)
    ordered = []
    for op in new_ops:
        ordered.append(op)
        ordered.extend(sends_after.get(op, []))
    ordered += _send_dones(graph.transfers, reasons)
    graph.ops = ordered
    # Keys name each value as the partitioned graph prints it, so the IR and the report agree.
    final_names = value_names(graph)
    for transfer in graph.transfers:
        transfer.consumers = consumers[(transfer.value, transfer.dst)]
        transfer.value_name = final_names[transfer.value]
        transfer.key = rendezvous_key(transfer.src, transfer.dst, transfer.value_name)
        for op in transfer.ops:
            op.attrs["key"] = transfer.key
            reasons[op] = f"transfer {transfer.key} ({transfer.nbytes} bytes)"
    return graph


def _send_dones(transfers: list[Transfer], reasons: dict) -> list[Op]:
    """One `send_done` per sending device, reading every value it sent: the last op there."""
    sent: dict[str, list[Value]] = {}
    for t in transfers:
        values = sent.setdefault(t.src, [])
        if t.value not in values:
            values.append(t.value)
    dones = []
    for device, values in sent.items():
        done = make_op("send_done", values, {}, values[-1].producer.loc, device=device)
        reasons[done] = f"keeps the {len(values)} value(s) sent from {short_device_name(device)} until received"
        dones.append(done)
    return dones


def _add_transfer(graph: Graph, v: Value, dst: str, sends_after: dict) -> Op:
    """A send after `v`'s producer and a recv on `dst` (returned); keys are set once all are made."""
    src = v.producer.device
    key = rendezvous_key(src, dst, "?")
    attrs = {"key": key, "src": short_device_name(src), "dst": short_device_name(dst)}
    send = make_op("send", [v], attrs, v.producer.loc, device=src)
    recv = make_op("recv", [], {**attrs, "shape": v.type.shape, "dtype": v.type.dtype}, v.producer.loc, device=dst)
    sends_after.setdefault(v.producer, []).append(send)
    graph.transfers.append(Transfer(key, src, dst, v.type.nbytes, "?", v.producer, v, [], (send, recv)))
    return recv


def awaited_sends(graph: Graph, device: str) -> dict[str, frozenset[str]]:
    """For each recv on `device` of the partitioned `graph`, the keys of the sends on `device` that
    must have been made before the recv can complete.

    Every other partition runs its ops in program order (a native partition calls send and recv in
    that order; a recv blocks), so an op there waits for everything before it on its device; on
    `device` an op waits only for its operands (its backend may reorder), and a recv waits for
    its send. Sends never block.

    Algorithm: walk the ops in order, giving each op the set of `device`'s sends it waits for: the
    union of its operands' sets, with everything earlier on its own device for ops elsewhere,
    its send's set for a recv, and its own key for a send on `device`."""
    waits: dict[Op, frozenset[str]] = {}
    before: dict[str, frozenset[str]] = {}  # device -> what its ops so far waited for (not `device`)
    sends: dict[str, Op] = {}
    found: dict[str, frozenset[str]] = {}
    for op in graph.ops:
        keys = set(before.get(op.device, frozenset())) if op.device != device else set()
        for v in op.operands:
            keys |= waits.get(v.producer, frozenset())
        key = op.attrs.get("key")
        if op.name == "send":
            sends[key] = op
            if op.device == device:
                keys.add(key)
        elif op.name == "recv" and key in sends:
            keys |= waits[sends[key]]
        waits[op] = frozenset(keys)
        if op.device != device:
            before[op.device] = waits[op]
        elif op.name == "recv":
            found[key] = waits[op]
    return found


@dataclass
class Partition:
    """The ops of one device as a self-contained function. `inputs[i]` is the index of the original
    parameter its i-th parameter is; `outputs[j]` the index of the original result its j-th is."""

    device: str
    graph: Graph
    inputs: list[int]
    outputs: list[int]


@dataclass
class PartitionPlan:
    """How a partitioned function runs: its partitions, and for each original result where it comes
    from: `("param", i)` (an argument passed through) or `("partition", p, j)`."""

    partitions: list[Partition]
    result_sources: list[tuple]


def split_partitions(graph: Graph) -> PartitionPlan:
    """One graph per device from a partitioned graph (op objects are copied, regions shared)."""
    param_index = {p: i for i, p in enumerate(graph.params)}
    partitions, mappings = [], []
    for device in graph_devices(graph):
        ops = [op for op in graph.ops if op.device == device]
        used = sorted({param_index[v] for op in ops for v in op.operands if v in param_index})
        sub = Graph(f"{graph.name}.{re.sub(r'[^A-Za-z0-9_]', '_', short_device_name(device))}")
        mapping = {graph.params[i]: sub.add_param(graph.params[i].type, graph.params[i].name_hint) for i in used}
        for op in ops:
            operands = []
            for v in op.operands:
                if v not in mapping:
                    raise CompileError(
                        f"{op.loc}: op '{op.name}' on {device} reads a value computed on another device; "
                        "run the 'partition' pass first"
                    )
                operands.append(mapping[v])
            copy = Op(op.name, operands, [r.type for r in op.results], op.attrs, op.loc, op.device, op.regions)
            mapping.update(zip(op.results, copy.results))
            sub.append(copy)
        sub.awaited_sends = awaited_sends(graph, device)
        partitions.append(Partition(device, sub, used, []))
        mappings.append(mapping)
    sources = []
    by_device = {p.device: n for n, p in enumerate(partitions)}
    for k, r in enumerate(graph.results):
        if r.producer is None:
            sources.append(("param", param_index[r]))
            continue
        n = by_device[r.producer.device]
        part = partitions[n]
        part.outputs.append(k)
        sources.append(("partition", n, len(part.graph.results)))
        part.graph.results.append(mappings[n][r])
    return PartitionPlan(partitions, sources)


def placement_report(graph: Graph) -> str:
    """The "placement" stage: each op's device and the rule that chose it, then each transfer's
    key, endpoints, bytes and the ops on both ends."""
    names = value_names(graph)
    reasons = getattr(graph, "placement", {})
    transfers = getattr(graph, "transfers", [])
    devices = graph_devices(graph) if graph.ops else []
    lines = [f"devices: {', '.join(short_device_name(d) for d in devices) or '(no ops)'}", "ops:"]
    for op in graph.ops:
        name = ", ".join(names[r] for r in op.results) or "-"
        nested = f" (+{sum(1 for r in op.regions for _ in r.walk())} ops in its regions)" if op.regions else ""
        lines.append(
            f"  {name:>6} {op.name:<16} {short_device_name(op.device):<8} {str(op.loc):<24} "
            f"{reasons.get(op, 'placed before this report')}{nested}"
        )
    total = sum(t.nbytes for t in transfers)
    lines.append(f"transfers: {len(transfers)} ({total} bytes per call)")
    for t in transfers:
        readers = ", ".join(f"'{c.name}' ({c.loc})" for c in t.consumers)
        lines.append(
            f"  {t.key}: {t.nbytes} bytes, {short_device_name(t.src)} -> {short_device_name(t.dst)}, "
            f"'{t.producer.name}' ({t.producer.loc}) -> {readers}"
        )
    return "\n".join(lines)
