"""Tasks: the processes a program's devices may belong to, and how one step crosses them.

A device name says which task it lives in (`/job:worker/task:1/device:cpu:0`); this process is
`/job:localhost/task:0`. A placed program whose partitions live in several tasks runs each task's
partitions in that task's process (a Ray actor of `flowjit.distributed`), each with its own
`TaskStep`: the rendezvous of one step inside one task, which also knows the keys that cross
tasks. Values bound for another task are gathered per destination and posted in ONE message per
(step, task pair) whenever every partition of the task has finished or waits in a recv (so a
cut's tensors travel together, and nothing waits on a value held back); values from other tasks
arrive as such messages (`deliver`). The runtime defines the seams, the distributed package fills
them:

    register_remote_runner(runner)   # the running cluster: loads and runs other tasks' partitions
    set_variable_home(name, home)    # a Variable that lives in another task: reads go there

docs/distributed.md describes a step across tasks as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from flowjit.errors import FlowjitError, FlowjitValueError
from flowjit.ir.channel import snapshot
from flowjit.ir.devices import LOCAL_JOB, task_name
from flowjit.runtime.rendezvous import Rendezvous
from flowjit.runtime.transports import Transport

__all__ = [
    "LOCAL_TASK",
    "bring_home",
    "RemoteRunner",
    "TaskStep",
    "VariableHome",
    "is_local",
    "register_remote_runner",
    "remote_runner",
    "set_variable_home",
    "task_name",
    "variables_of",
    "variable_home",
    "variable_homes",
]

LOCAL_TASK = f"/job:{LOCAL_JOB}/task:0"


def variables_of(graphs) -> list[str]:
    """The names of the variables the ops of `graphs` read or update, sorted."""
    return sorted({op.attrs["var"] for graph in graphs for op in graph.walk() if "var" in op.attrs})


def is_local(device: str) -> bool:
    """True when `device` belongs to this process's task."""
    return task_name(device) == LOCAL_TASK


class TaskStep(Rendezvous):
    """The rendezvous of one step inside one task.

    Keys between this task's own partitions behave as in `Rendezvous`. A key in `outgoing` (key ->
    receiving task) is staged when sent (`stage(address, nbytes)`: by default a snapshot copy; the
    sender's buffer is free once it returns) and gathered into the outbox of its task;
    `post(task, {key: staged})` sends an outbox as one message when
    every partition of this task has finished or waits. A key in `incoming` comes from another
    task: `deliver` deposits it, and a recv waiting for one is never taken for a stuck step."""

    def __init__(
        self,
        step_key: str,
        parties: int,
        routes: dict[str, Transport],
        incoming: set[str],
        outgoing: dict[str, str],
        post: Callable[[str, dict[str, np.ndarray]], None],
        timeout_s: float | None = None,
        stage: Callable[[int, int], object] | None = None,
    ):
        super().__init__(timeout_s=timeout_s, parties=parties, routes=routes)
        self.step_id = self.step_key = step_key  # errors name the step as every task knows it
        self._incoming = incoming
        self._outgoing = outgoing
        self._post = post
        self._stage = stage or snapshot
        self._outbox: dict[str, dict[str, object]] = {}

    def send(self, key: str, value: np.ndarray) -> None:
        task = self._outgoing.get(key)
        if task is None:
            super().send(key, value)
            return
        with self._cond:
            self._outbox.setdefault(task, {})[key] = np.ascontiguousarray(value)
            self._flush_if_idle(waiting=len(self._blocked))

    def send_bytes(self, key: str, address: int, nbytes: int) -> bool:
        task = self._outgoing.get(key)
        if task is None:
            return super().send_bytes(key, address, nbytes)
        staged = self._stage(address, nbytes)  # the buffer is free again once this returns
        with self._cond:
            self._outbox.setdefault(task, {})[key] = staged
            self._flush_if_idle(waiting=len(self._blocked))
        return False

    @property
    def incoming(self) -> frozenset[str]:
        """The keys this task's partitions receive from other tasks in this step."""
        return frozenset(self._incoming)

    def deliver(self, batch: dict[str, np.ndarray]) -> None:
        """Values another task sent to this one in this step."""
        with self._cond:
            for key, value in batch.items():
                self._values[key] = value
            self._cond.notify_all()

    def leave(self) -> None:
        with self._cond:
            self._finished += 1
            self._flush_if_idle(waiting=len(self._blocked))
            self._cond.notify_all()

    def flush(self) -> None:
        """Post every gathered outbox now (the caller holds the lock)."""
        outbox, self._outbox = self._outbox, {}
        for task, batch in outbox.items():
            self._post(task, batch)

    def _flush_if_idle(self, waiting: int) -> None:
        # Posting while a partition still runs could split its cut in two messages; posting
        # later than the moment all of them wait would hold back a value some task waits for.
        if self._outbox and waiting >= self._parties - self._finished:
            self.flush()

    def _wait(self, key: str | None, deadline: float, where: str) -> None:
        self._flush_if_idle(waiting=len(self._blocked) + 1)
        super()._wait(key, deadline, where)

    def _stuck(self, waiting: int, key: str | None) -> bool:
        if any(k in self._incoming and k not in self._values for k in [*self._blocked, key]):
            return False  # another task may still send it (its failures cancel this step)
        return super()._stuck(waiting, key)


class RemoteStep(Protocol):
    """One step's work on the other tasks, started by `RemoteProgram.start`."""

    def join(self) -> dict[int, list[np.ndarray]]:
        """Wait for every task (with a timeout) and return the outputs of each remote partition by
        its index in the plan; raises the first task's failure."""

    def cancel(self, error: BaseException) -> None:
        """Stop the step on every task (a local partition failed)."""


class RemoteProgram(Protocol):
    """A partitioned program's partitions that live in other tasks, loaded into those tasks."""

    def new_step_key(self) -> str:
        """A key naming one new step on every task."""

    def usable(self) -> bool:
        """False once the tasks it was loaded into are gone (its cluster stopped)."""

    def post(self, step_key: str, task: str, batch: dict[str, object]) -> None:
        """Send values of this process's partitions to `task` (one message)."""

    def stage(self, address: int, nbytes: int) -> object:
        """What a send of `nbytes` at `address` to another task puts in the outbox (the buffer
        is reused once this returns): a copy, or a handle the receiving task can fetch."""

    def start(
        self, step_key: str, args: Sequence[np.ndarray], variables: dict[str, np.ndarray], local: TaskStep
    ) -> RemoteStep:
        """Start one step on every task. Values sent to this process go into `local`, which a task's
        failure cancels; `variables` are this process's buffers (the first values of variables
        that move to a task)."""


class RemoteRunner(Protocol):
    """What a running cluster offers the executor: loading partitions into their tasks."""

    def load(
        self, partitions: dict[int, tuple], crossings: dict[str, tuple[str, str]], target: str | None
    ) -> RemoteProgram:
        """Load the partitions `{plan index: (graph, device, input indices)}` into their tasks;
        `crossings` maps each key that crosses tasks to its (sending, receiving) device."""


_runners: list[RemoteRunner] = []


def register_remote_runner(runner: RemoteRunner) -> Callable[[], None]:
    """Make `runner` run the partitions of other tasks until the returned function is called."""
    _runners.append(runner)

    def unregister() -> None:
        if runner in _runners:
            _runners.remove(runner)

    return unregister


def remote_runner(devices: Sequence[str]) -> RemoteRunner:
    """The runner of the running cluster (the innermost), for a program on `devices`."""
    if not _runners:
        tasks = sorted({task_name(d) for d in devices if not is_local(d)})
        raise FlowjitValueError(
            f"this program has partitions on other tasks ({', '.join(tasks)}), which need a running cluster: "
            "create it with `with flowjit.distributed.Cluster({...}):` around the calls"
        )
    return _runners[-1]


class VariableHome(Protocol):
    """Where a Variable lives when its host buffer in this process may not hold its value: another
    task of a cluster, or a GPU's memory (`backends/gpu/resident.py`)."""

    task: str

    def read(self) -> np.ndarray:
        """A copy of the variable's current value."""

    def write(self, value: np.ndarray) -> None:
        """Replace the variable's value."""

    def left(self) -> None:
        """It is no longer the variable's home (read first by whoever took the variable)."""


_homes: dict[str, VariableHome] = {}


def set_variable_home(name: str, home: VariableHome | None) -> None:
    """Record that variable `name` lives at `home` (None: in this process again); the home it
    had before is told it `left`."""
    old = _homes.pop(name, None) if home is None else _homes.get(name)
    if home is not None:
        _homes[name] = home
    if old is not None and old is not home:
        old.left()


def variable_home(name: str) -> VariableHome | None:
    """The home of variable `name` when it lives in another task, else None."""
    return _homes.get(name)


def variable_homes() -> dict[str, VariableHome]:
    """Every variable living in another task, by name (a copy)."""
    return dict(_homes)


def bring_home(buffers: dict[str, np.ndarray], skip=frozenset(), keep: Callable[[object], bool] | None = None) -> None:
    """Before this process runs code on `buffers` (variable name -> its local buffer): the values
    of those variables that live elsewhere (another task, a GPU's memory) come back into their
    buffers, and they live here again. Those in `skip` stay where they are (the code runs them
    there), and so do those whose home `keep(home)` accepts (the code's own device holds them)."""
    if not _homes:  # the common case, checked on every call of a function with variables
        return
    for name, buffer in buffers.items():
        home = _homes.get(name)
        if home is None or name in skip or (keep is not None and keep(home)):
            continue
        np.copyto(buffer, home.read(), casting="unsafe")
        del _homes[name]
        home.left()


class TaskError(FlowjitError):
    """A task of a cluster failed or could not be reached."""
