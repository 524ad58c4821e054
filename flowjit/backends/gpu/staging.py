"""Host<->GPU Send/Recv: a GPU partition's communication, done on the host around its GPU calls.

A partition of a multi-device function placed on a GPU reads values computed on other devices
(`recv`), computes values other devices read (`send`), and ends with a `send_done`. A kernel
cannot call the host's rendezvous, so `StagedExecutable` compiles the partition without them: each
received value becomes an input of a GPU call and each sent value an output, and the host does the
rendezvous around the call. One step (`run_step`), for each stage in order:

    1. send the values of this stage already on the host (arguments, received values, results of
       earlier stages): a send never waits;
    2. receive this stage's values (`channel.recv_into` into host arrays: each wait is bounded by
       the rendezvous's timeout, FLOWJIT_RECV_TIMEOUT, and wakes when the step is cancelled);
    3. one GPU call (`GpuExecutable.run`: the inputs copied in through the runner's pinned block
       with asynchronous copies on its stream, the launches, the outputs copied back on the same
       stream; the wait for the stream is bounded by FLOWJIT_GPU_TIMEOUT_S);
    4. send the values the call computed.

Stages. Doing every recv before the call and every send after it is only valid when no recv
waits, through other partitions, for one of the partition's own sends: that recv would wait for
a send that comes after it. `split_partitions` records, for each recv, the sends it waits for
(`graph.awaited_sends`; where a graph was split elsewhere, every send before the recv is assumed);
a recv that waits for a send goes to a later stage than that send, and each op to the stage of its
latest operand. A value computed in one stage and read in a later one goes back to the host and
in again (results cannot stay on the device yet).

Sent values are the arrays the GPU call returned (fresh, never written again), so nothing is
lent and `send_done` has nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.backends.base import Executable
from flowjit.ir.channel import Channel, loopback, receive_array
from flowjit.ir.graph import Graph, Op, Value
from flowjit.passes.place import FREE_CREATIONS

COMMUNICATION_OPS = frozenset({"send", "recv", "send_done"})


def communicates(graph: Graph) -> bool:
    """Whether `graph` has send, recv or send_done ops (at the top level, where partition puts them)."""
    return any(op.name in COMMUNICATION_OPS for op in graph.ops)


@dataclass
class Stage:
    """The recvs, the GPU call and the sends of one stage. `inputs`/`outputs` are the values of
    the partition graph the call reads and computes (its graph's parameters and results, in order);
    `graph` is None when the stage computes nothing."""

    recvs: list[Op]
    sends: list[Op]
    graph: Graph | None
    inputs: list[Value]
    outputs: list[Value]
    executable: Executable | None = None


def stage_numbers(graph: Graph) -> dict[Op, int]:
    """The stage of each op of `graph` but `send_done`: a recv comes after the sends it waits for,
    any other op with its latest operand (see the module docstring)."""
    awaited = graph.awaited_sends
    stage: dict[Op, int] = {}
    of_value: dict[Value, int] = {}
    sent: dict[str, int] = {}  # send key -> stage
    for op in graph.ops:
        if op.name == "send_done":
            continue
        if op.name == "recv":
            keys = awaited.get(op.attrs["key"], ()) if awaited is not None else sent  # else: every earlier send
            n = max((sent[k] + 1 for k in keys if k in sent), default=0)
        else:
            n = max((of_value.get(v, 0) for v in op.operands), default=0)
        stage[op] = n
        if op.name == "send":
            sent[op.attrs["key"]] = n
        for r in op.results:
            of_value[r] = n
    return stage


def split_stages(graph: Graph) -> list[Stage]:
    """The stages of a GPU partition: its recvs, sends, and a graph of the ops between them whose
    parameters are the values the ops read from elsewhere and whose results are the values sent,
    read by later stages or returned. Constants are made again in every stage reading them."""
    numbers = stage_numbers(graph)
    count = max(numbers.values(), default=0) + 1
    exported = set(graph.results) | {op.operands[0] for op in graph.ops if op.name == "send"}
    read_in: dict[Value, set[int]] = {}  # value -> the stages whose computing ops read it
    for op in graph.ops:
        if op.name not in COMMUNICATION_OPS:
            for v in op.operands:
                read_in.setdefault(v, set()).add(numbers[op])
    stages = []
    for k in range(count):
        members = [
            op for op in graph.ops if op.name not in COMMUNICATION_OPS and _in_stage(op, k, numbers, read_in, exported)
        ]
        local = {r for op in members for r in op.results}
        inputs = list(dict.fromkeys(v for op in members for v in op.operands if v not in local))
        outputs = [
            r
            for op in members
            if numbers[op] == k
            for r in op.results
            if r in exported or (op.name not in FREE_CREATIONS and any(n > k for n in read_in.get(r, ())))
        ]
        recvs = [op for op in graph.ops if op.name == "recv" and numbers[op] == k]
        sends = [op for op in graph.ops if op.name == "send" and numbers[op] == k]
        sub = _stage_graph(f"{graph.name}.stage{k}", members, inputs, outputs) if outputs else None
        stages.append(Stage(recvs, sends, sub, inputs if sub else [], outputs))
    return stages


def _in_stage(op: Op, k: int, numbers: dict[Op, int], read_in: dict, exported: set) -> bool:
    """Whether `op` computes in stage `k`: in its own stage, and a constant also in every stage
    reading it (made again there rather than copied back and in)."""
    if op.name in FREE_CREATIONS and not op.operands:
        return any(k in read_in.get(r, ()) or (k == numbers[op] and r in exported) for r in op.results)
    return numbers[op] == k


def _stage_graph(name: str, ops: list[Op], inputs: list[Value], outputs: list[Value]) -> Graph:
    sub = Graph(name)
    mapping = {v: sub.add_param(v.type, v.name_hint) for v in inputs}
    for op in ops:
        copy = Op(op.name, [mapping[v] for v in op.operands], [r.type for r in op.results], op.attrs, op.loc,
                  op.device, op.regions)  # fmt: skip
        mapping.update(zip(op.results, copy.results))
        sub.append(copy)
    sub.results = [mapping[v] for v in outputs]
    return sub


class StagedExecutable(Executable):
    """A GPU partition with send/recv: its stages' GPU calls (compiled by `compile_stage`, a graph
    without communication -> GpuExecutable) with the rendezvous done on the host around them.
    `host_stages` are its `Stage`s, in order."""

    def __init__(self, graph: Graph, compile_stage: Callable[[Graph], Executable]):
        self.name = graph.name
        self.graph = graph
        self.host_stages = split_stages(graph)
        for stage in self.host_stages:
            if stage.graph is not None:
                stage.executable = compile_stage(stage.graph)
        self.executables = [s.executable for s in self.host_stages if s.executable is not None]
        inner = self.executables[0].backend if self.executables else "cuda"
        self.backend = f"{inner}; send/recv on the host around {len(self.executables)} GPU call(s)"
        self.stages = {"staging": self._staging_text()}
        for stage_name in dict.fromkeys(name for e in self.executables for name in e.stages):
            self.stages[stage_name] = "\n".join(
                f"// GPU call {n}: {e.name}\n{e.stages[stage_name]}"
                for n, e in enumerate(self.executables)
                if stage_name in e.stages
            )

    def _staging_text(self) -> str:
        lines = [f"'{self.name}': {len(self.host_stages)} stage(s), send/recv on the host around each GPU call"]
        for k, stage in enumerate(self.host_stages):
            lines.append(f"stage {k}:")
            lines += [f"  recv {op.attrs['key']} ({op.loc})" for op in stage.recvs]
            if stage.executable is not None:
                lines.append(
                    f"  GPU call {stage.graph.name}: {len(stage.inputs)} input(s) copied in, "
                    f"{len(stage.outputs)} output(s) copied out"
                )
            lines += [f"  send {op.attrs['key']} ({op.loc})" for op in stage.sends]
        return "\n".join(lines)

    def run(self, args, variables=None, outputs=None):
        """The partition on its own (outside a multi-device step): its sends reach its own recvs."""
        return self.run_step(args, variables or {}, loopback())

    def run_step(self, args: Sequence[np.ndarray], variables: dict, channel: Channel) -> list[np.ndarray]:
        """One step; each stage's GPU call takes the variables it reads or updates from `variables`
        (their host buffers, current before and after each call: `GpuExecutable.run`), so stages
        that share a variable see each other's updates in order."""
        host: dict[Value, np.ndarray] = dict(zip(self.graph.params, args))
        sent: set[Op] = set()
        for stage in self.host_stages:
            _send_ready(stage.sends, host, sent, channel)
            for op in stage.recvs:
                t = op.result.type
                host[op.result] = receive_array(channel, op.attrs["key"], t.shape, t.dtype.np_dtype, f"{op.loc}: ")
            if stage.executable is not None:
                results = stage.executable.run([host[v] for v in stage.inputs], variables)
                host.update(zip(stage.outputs, results))
            _send_ready(stage.sends, host, sent, channel)
        return [host[r] for r in self.graph.results]


def _send_ready(sends: list[Op], host: dict[Value, np.ndarray], sent: set[Op], channel: Channel) -> None:
    """Send each of `sends` whose value is on the host and that was not sent yet."""
    for op in sends:
        if op not in sent and op.operands[0] in host:
            channel.send(op.attrs["key"], host[op.operands[0]])
            sent.add(op)
