"""The multi-device executor: runs the partitions of one call concurrently, joined by a rendezvous.

    plan = split_partitions(partitioned_graph)       # one self-contained graph per device
    exe = PartitionedExecutable(plan, target)         # each partition compiled on its own
    exe.run(args, variables)                          # one call = one step

Each call creates a fresh `Rendezvous` (its own namespace and step id), so concurrent calls of one
function are independent. The first partition runs on the calling thread and the others on
workers of a shared pool (one per partition in flight); native partitions release the GIL, so
devices really run at the same time. When a partition fails, the step is cancelled: waiting recvs
wake with an error, native code finishes with zero-filled inputs, and the caller gets the first
real failure (with the op's source line and device), with the cancelled partitions listed in its
notes. A recv whose send can no longer come (every other partition finished or waits too) fails
at once, and recvs time out as a last resort (`FLOWJIT_RECV_TIMEOUT`), so a call never hangs.

Partitions on devices of other tasks (`/job:ps/task:0/...`) are handed to the running cluster
(`runtime.tasks.remote_runner`), which loads them into their tasks' processes; a step then starts
them there, runs this process's partitions on a `TaskStep`, and gathers every task's outputs
(docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Sequence

import numpy as np

from flowjit.backends.base import Executable
from flowjit.backends.interpreter import PartitionError
from flowjit.backends.registry import backend_for
from flowjit.ir.graph import Graph
from flowjit.passes.partition import PartitionPlan, short_device_name
from flowjit.runtime.rendezvous import Rendezvous, TransferError
from flowjit.runtime.tasks import TaskStep, is_local, remote_runner, task_name, variables_of
from flowjit.runtime.transports import Transport, transport_for

__all__ = ["PartitionError", "PartitionedExecutable", "crossings", "routes", "routes_between", "run_partitions"]


class Partition:
    """One partition compiled by the backend of its device (or the one `target` names for it:
    `registry.backend_for`)."""

    def __init__(self, graph: Graph, device: str, target):
        self.device = short_device_name(device)
        self.backend = backend_for(device, target)
        self.executable = self.backend.compile(graph, device)

    def run(self, args: Sequence[np.ndarray], variables: dict, rendezvous: Rendezvous) -> list[np.ndarray]:
        return self.executable.run_step(args, variables, rendezvous)


def _endpoints(graphs: Sequence[Graph], devices: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Each rendezvous key's (sending device, receiving device), among these partitions."""
    senders, receivers = {}, {}
    for graph, device in zip(graphs, devices):
        for op in graph.ops:
            if op.name == "send":
                senders[op.attrs["key"]] = device
            elif op.name == "recv":
                receivers[op.attrs["key"]] = device
    return {key: (senders[key], receivers[key]) for key in receivers if key in senders}


def routes_between(graphs: Sequence[Graph], devices: Sequence[str]) -> dict[str, Transport]:
    """The transport of each key sent and received among these partitions (on `devices`) whose
    send and recv are in one task."""
    return {
        key: transport_for(src, dst)
        for key, (src, dst) in _endpoints(graphs, devices).items()
        if task_name(src) == task_name(dst)
    }


def routes(plan: PartitionPlan) -> dict[str, Transport]:
    """The transport of each key of `plan` whose send and recv are in one task."""
    return routes_between([p.graph for p in plan.partitions], [p.device for p in plan.partitions])


def crossings(plan: PartitionPlan) -> dict[str, tuple[str, str]]:
    """The keys whose send and recv are in different tasks, with their (sending, receiving) device."""
    ends = _endpoints([p.graph for p in plan.partitions], [p.device for p in plan.partitions])
    return {key: pair for key, pair in ends.items() if task_name(pair[0]) != task_name(pair[1])}


def run_partitions(
    parts: Sequence[Partition],
    inputs: Sequence[Sequence[int]],
    args: Sequence[np.ndarray],
    variables: dict,
    rendezvous: Rendezvous,
) -> list[list[np.ndarray]]:
    """Run one step of `parts` (partition n reads `args[i]` for i in `inputs[n]`) on `rendezvous`,
    each on its own thread (the first on the caller's). A failure cancels the step and is raised
    once every partition has stopped: the root failure, noting the others."""
    outs: list[list | None] = [None] * len(parts)
    errors: list[BaseException | None] = [None] * len(parts)

    def work(n: int) -> None:
        part_args = [args[i] for i in inputs[n]]
        try:
            outs[n] = parts[n].run(part_args, variables, rendezvous)
        except BaseException as e:  # noqa: BLE001 (any failure must cancel the step, then reach the caller)
            errors[n] = e
            rendezvous.cancel(e)
        finally:
            rendezvous.leave()

    finished = [WORKERS.submit(functools.partial(work, n)) for n in range(1, len(parts))]
    if parts:
        work(0)
    for event in finished:
        event.wait()
    if any(e is not None for e in errors):
        raise step_error([(parts[n].device, e) for n, e in enumerate(errors) if e is not None])
    return outs


def step_error(failed: list[tuple[str, BaseException]]) -> BaseException:
    """The root failure of a step (not a recv woken by the cancellation), noting the others."""
    roots = [(d, e) for d, e in failed if not (isinstance(e, TransferError) and "cancelled" in str(e))]
    _, root = (roots or failed)[0]
    for other_device, other in failed:
        if other is not root:
            root.add_note(f"partition on {other_device} stopped: {other}")
    return root


class PartitionedExecutable(Executable):
    """All partitions of one function, run together per call. Each is compiled by the backend of
    its device's type, or by the backend `target` names for all (e.g. 'interpreter') or for its
    device type ({'cpu': 'interpreter'}); each value
    crossing devices moves through the transport of its device pair. Partitions on devices of
    other tasks are loaded into those tasks by the running cluster (`flowjit.runtime.tasks`) and
    run there, joined to this process's partitions by one message per (step, task pair)."""

    def __init__(self, plan: PartitionPlan, target: str | None = None):
        self.plan = plan
        self.routes = routes(plan)
        self.local = [n for n, p in enumerate(plan.partitions) if is_local(p.device)]
        self.parts = [Partition(plan.partitions[n].graph, plan.partitions[n].device, target) for n in self.local]
        self.inputs = [plan.partitions[n].inputs for n in self.local]
        remote = {n: (p.graph, p.device, p.inputs) for n, p in enumerate(plan.partitions) if not is_local(p.device)}
        self.remote = None
        # variables the partitions of other tasks read or update (they live there)
        self.remote_variables = frozenset(variables_of(graph for graph, _, _ in remote.values()))
        if remote:
            cut = crossings(plan)
            self.outgoing = {k: task_name(dst) for k, (src, dst) in cut.items() if is_local(src)}
            self.incoming = {k for k, (src, dst) in cut.items() if is_local(dst)}
            self._load_remote = functools.partial(self._load, remote, cut, target)
            self.remote = self._load_remote()
        names = ", ".join(short_device_name(p.device) for p in plan.partitions)
        inner = sorted({p.executable.backend for p in self.parts} | ({"remote tasks"} if remote else set()))
        self.backend = f"{len(plan.partitions)} partitions on {names}, each {' / '.join(inner)}"
        self.stages = _PartitionStages(self.parts)

    def run(
        self, args: Sequence[np.ndarray], variables: dict | None = None, outputs: dict | None = None
    ) -> list[np.ndarray]:
        """One step: every partition on its own thread, results gathered in the original order.
        Partitioned functions do not take donated buffers (`aliases` is empty): results are fresh."""
        variables = variables or {}
        if self.remote is None:
            rendezvous = Rendezvous(parties=len(self.parts), routes=self.routes)
            local = run_partitions(self.parts, self.inputs, args, variables, rendezvous)
            outs = dict(zip(self.local, local))
        else:
            outs = self._run_across_tasks(args, variables)
        return [
            args[source[1]] if source[0] == "param" else outs[source[1]][source[2]]
            for source in self.plan.result_sources
        ]

    def _load(self, remote: dict, cut: dict, target: str | None):
        return remote_runner([p.device for p in self.plan.partitions]).load(remote, cut, target)

    def _run_across_tasks(self, args, variables) -> dict[int, list[np.ndarray]]:
        if not self.remote.usable():  # its cluster stopped: load the partitions into the running one
            self.remote = self._load_remote()
        step_key = self.remote.new_step_key()
        rendezvous = TaskStep(
            step_key,
            parties=len(self.parts),
            routes=self.routes,
            incoming=self.incoming,
            outgoing=self.outgoing,
            post=functools.partial(self.remote.post, step_key),
            stage=self.remote.stage,
        )
        remote = self.remote.start(step_key, args, variables, rendezvous)
        try:
            local = run_partitions(self.parts, self.inputs, args, variables, rendezvous)
        except BaseException as e:
            remote.cancel(e)
            with contextlib.suppress(Exception):  # the root failure is the local one
                remote.join()
            raise
        outs = remote.join()
        outs.update(zip(self.local, local))
        return outs


class _WorkerPool:
    """Threads that run partitions, kept between calls (starting a thread costs more than a small
    step). It grows whenever every worker is busy: a partition may wait in a recv for another one,
    so a bounded pool could deadlock under concurrent calls."""

    def __init__(self):
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def submit(self, task) -> threading.Event:
        """Run `task()` on an idle worker (or a new one); the event is set when it returns."""
        done = threading.Event()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True, name="flowjit-partition").start()
        inbox.put((task, done))
        return done

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            task, done = inbox.get()
            try:
                task()  # partition work catches its own errors and records them for the step
            finally:
                with self._lock:
                    self._idle.append(inbox)
                done.set()


WORKERS = _WorkerPool()


class _PartitionStages:
    """Backend stage texts of a partitioned function: each partition's, one after the other."""

    def __init__(self, parts: list[Partition]):
        self.parts = parts

    def __getitem__(self, stage: str) -> str:
        return "\n".join(
            f"// partition on {p.device}\n{p.executable.stages[stage]}"
            for p in self.parts
            if stage in p.executable.stages
        )

    def __iter__(self):
        return iter(self.keys())

    def __contains__(self, stage) -> bool:
        return stage in self.keys()

    def __len__(self) -> int:
        return len(self.keys())

    def keys(self):
        """The stages any partition's backend has, in the order they first appear."""
        return list(dict.fromkeys(stage for p in self.parts for stage in p.executable.stages))
