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
notes. A recv whose send can no longer come
(every other partition finished or waits too) fails at once, and recvs time out as a last resort
(`FLOWJIT_RECV_TIMEOUT`), so a call never hangs.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Sequence

import numpy as np

from flowjit.backends import Executable, compile_graph
from flowjit.errors import FlowjitError
from flowjit.ir.graph import Graph
from flowjit.ir.interpreter import RunContext, check_array, eval_op
from flowjit.passes.partition import PartitionPlan, short_device_name
from flowjit.runtime.rendezvous import Rendezvous, StepBinding, TransferError


class PartitionError(FlowjitError):
    """An op of one partition failed while running."""


class InterpretedPartition:
    """A partition run op by op by the reference interpreter (target 'interpreter')."""

    def __init__(self, graph: Graph, device: str):
        self.graph = graph
        self.device = short_device_name(device)

    def run(self, args: Sequence[np.ndarray], variables: dict, rendezvous: Rendezvous) -> list[np.ndarray]:
        context = RunContext(variables, rendezvous)
        env = dict(zip(self.graph.params, args))
        for op in self.graph.ops:
            try:
                outs = eval_op(op, [env[v] for v in op.operands], context)
            except (FlowjitError, TransferError):
                raise
            except Exception as e:
                raise PartitionError(
                    f"{op.loc}: op '{op.name}' on {self.device} failed: {type(e).__name__}: {e}"
                ) from e
            for result, value in zip(op.results, outs):
                check_array(value, result.type, f"internal error: result of op '{op.name}' at {op.loc}")
                env[result] = value
        return [env[r] for r in self.graph.results]


class NativePartition:
    """A partition compiled to one native entry point; its send/recv call the rendezvous of the step
    bound to the calling thread."""

    def __init__(self, graph: Graph, device: str, target: str):
        self.device = short_device_name(device)
        self.executable = compile_graph(graph, target)
        self.uses_variables = any("var" in op.attrs for op in graph.walk())
        self.recv_locations = {op.attrs["key"]: str(op.loc) for op in graph.ops if op.name == "recv"}

    def run(self, args: Sequence[np.ndarray], variables: dict, rendezvous: Rendezvous) -> list[np.ndarray]:
        with StepBinding(rendezvous, self.recv_locations) as step:
            if self.uses_variables:
                outs = self.executable.run(args, variables)
            else:  # the caller checked and converted the arguments of the whole function
                outs = self.executable.run_trusted(args)
        if step.error is not None:
            raise step.error
        return outs


class PartitionedExecutable(Executable):
    """All partitions of one function, each compiled for `target`, run together per call."""

    def __init__(self, plan: PartitionPlan, target: str):
        self.plan = plan
        self.parts = [
            InterpretedPartition(p.graph, p.device)
            if target == "interpreter"
            else NativePartition(p.graph, p.device, target)
            for p in plan.partitions
        ]
        names = ", ".join(p.device for p in self.parts)
        inner = "reference interpreter" if target == "interpreter" else self.parts[0].executable.backend
        self.backend = f"{len(self.parts)} partitions on {names}, each {inner}"
        self.stages = {} if target == "interpreter" else _PartitionStages(self.parts)

    def run(
        self, args: Sequence[np.ndarray], variables: dict | None = None, outputs: dict | None = None
    ) -> list[np.ndarray]:
        """One step: every partition on its own thread, results gathered in the original order.
        Partitioned functions do not take donated buffers (`aliases` is empty): results are fresh."""
        variables = variables or {}
        rendezvous = Rendezvous(parties=len(self.parts))
        outs: list[list | None] = [None] * len(self.parts)
        errors: list[BaseException | None] = [None] * len(self.parts)

        def work(n: int) -> None:
            part_args = [args[i] for i in self.plan.partitions[n].inputs]
            try:
                outs[n] = self.parts[n].run(part_args, variables, rendezvous)
            except BaseException as e:  # noqa: BLE001 (any failure must cancel the step, then reach the caller)
                errors[n] = e
                rendezvous.cancel(e)
            finally:
                rendezvous.leave()

        finished = [WORKERS.submit(functools.partial(work, n)) for n in range(1, len(self.parts))]
        work(0)
        for event in finished:
            event.wait()
        if any(e is not None for e in errors):
            raise self._step_error(errors)
        return [
            args[source[1]] if source[0] == "param" else outs[source[1]][source[2]]
            for source in self.plan.result_sources
        ]

    def _step_error(self, errors: list[BaseException | None]) -> BaseException:
        """The root failure of a step (not a recv woken by the cancellation), noting the others."""
        failed = [(self.parts[n].device, e) for n, e in enumerate(errors) if e is not None]
        roots = [(d, e) for d, e in failed if not (isinstance(e, TransferError) and "cancelled" in str(e))]
        device, root = (roots or failed)[0]
        for other_device, other in failed:
            if other is not root:
                root.add_note(f"partition on {other_device} stopped: {other}")
        return root


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

    def __init__(self, parts: list[NativePartition]):
        self.parts = parts

    def __getitem__(self, stage: str) -> str:
        return "\n".join(f"// partition on {p.device}\n{p.executable.stages[stage]}" for p in self.parts)

    def __iter__(self):
        return iter(self.parts[0].executable.stages)

    def __contains__(self, stage) -> bool:
        return stage in self.parts[0].executable.stages

    def __len__(self) -> int:
        return len(self.parts[0].executable.stages)

    def keys(self):
        return list(self)
