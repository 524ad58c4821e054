"""One task of a cluster: a Ray actor (one process) holding its compiled partitions and variables.

    host(role, factory, ...); call(role, method, ...)    # library objects living in the task
    load(program, partitions, crossings, target, peers)   # compile this task's partitions
    run(program, step, args, first_values)                # one step; returns each partition's outputs
    deliver(program, step, batch)                         # values another task sent in that step
    cancel(step, why)                                     # another task failed: stop the step

Steps of one program on one task may run concurrently (the actor is threaded); a step's variables
are locked in name order for its duration, as in one process. A message for a step that has not
started yet creates the step (messages and the run call race); one for a step already finished
is dropped. `Inbox` stands in for the driver, which cannot receive calls: tasks post the values
bound for it there, and the driver takes them.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading

import numpy as np

from flowjit.distributed import ray_support
from flowjit.ir.channel import snapshot
from flowjit.runtime.executor import Partition, routes_between, run_partitions
from flowjit.runtime.tasks import TaskError, TaskStep, task_name, variables_of

_FINISHED_KEPT = 4096  # finished step keys remembered, to drop their late messages


class _LoadedProgram:
    def __init__(self, task: str, partitions: dict, crossings: dict, target: str | None, peers: dict):
        self.indices = sorted(partitions)
        self.parts = [Partition(partitions[n][0], partitions[n][1], target) for n in self.indices]
        self.inputs = [partitions[n][2] for n in self.indices]
        self.routes = routes_between([partitions[n][0] for n in self.indices], [partitions[n][1] for n in self.indices])
        self.outgoing = {k: task_name(dst) for k, (src, dst) in crossings.items() if task_name(src) == task}
        self.incoming = {k for k, (src, dst) in crossings.items() if task_name(dst) == task}
        self.peers = peers
        self.variables = variables_of(partitions[n][0] for n in self.indices)


class TaskActor:
    """The process of one task (`/job:ps/task:0`)."""

    def __init__(self, task: str, environment: dict[str, str]):
        os.environ.update(environment)  # the driver's FLOWJIT_* settings (cache folder, timeouts)
        self.task = task
        self._lock = threading.Lock()
        self._programs: dict[str, _LoadedProgram] = {}
        self._steps: dict[str, TaskStep] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.variables: dict[str, np.ndarray] = {}
        self._variable_locks: dict[str, threading.RLock] = collections.defaultdict(threading.RLock)
        self._roles: dict[str, object] = {}

    def ping(self) -> int:
        return os.getpid()

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this task."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    # --- roles: library objects living in this task (a parameter shard, a training replica) -------
    def host(self, role: str, factory, *args, **kwargs) -> None:
        """Create `factory(*args, **kwargs)` in this process under the name `role`."""
        self._roles[role] = factory(*args, **kwargs)

    def hosts(self, role: str) -> bool:
        return role in self._roles

    def call(self, role: str, method: str, *args, **kwargs):
        """`role.method(*args, **kwargs)` in this process."""
        target = self._roles.get(role)
        if target is None:
            raise TaskError(f"{self.task} hosts no '{role}' (a restarted task must be given it again)")
        return getattr(target, method)(*args, **kwargs)

    def load(self, program_id: str, partitions: dict, crossings: dict, target: str | None, peers: dict) -> None:
        program = _LoadedProgram(self.task, partitions, crossings, target, peers)
        with self._lock:
            self._programs[program_id] = program

    def unload(self, program_id: str) -> None:
        with self._lock:
            self._programs.pop(program_id, None)

    def run(self, program_id: str, step_key: str, args: dict, first_values: dict) -> dict[int, list[np.ndarray]]:
        """One step of this task's partitions of `program_id`; `args[n]` are partition n's inputs,
        `first_values` the values of variables that move to this task now."""
        program = self._program(program_id)
        step = self._step(program_id, step_key)
        if step is None:
            raise TaskError(f"{self.task}: step {step_key} was cancelled before it started")
        for name, value in first_values.items():
            with self._variable_locks[name]:
                self.variables[name] = np.array(value, order="C")  # writable, owned by this task
        locks = [self._variable_locks[name] for name in program.variables]
        for lock in locks:
            lock.acquire()
        try:
            missing = [name for name in program.variables if name not in self.variables]
            if missing:
                raise TaskError(f"{self.task}: variables {missing} were never sent to this task")
            flat, inputs = [], []
            for n in program.indices:
                inputs.append(list(range(len(flat), len(flat) + len(args[n]))))
                flat.extend(args[n])
            flat = fetch_refs(flat, f"{self.task}: the inputs of step {step_key}")
            outs = run_partitions(program.parts, inputs, flat, self.variables, step)
            return dict(zip(program.indices, outs))
        finally:
            for lock in reversed(locks):
                lock.release()
            self._finish(step_key)

    def deliver(self, program_id: str, step_key: str, batch: dict) -> None:
        step = self._step(program_id, step_key)
        if step is not None:
            step.deliver(fetch_staged(batch, f"{self.task}: values of step {step_key}"))

    def cancel(self, step_key: str, why: str) -> None:
        with self._lock:
            step = self._steps.get(step_key)
            if step is None and step_key not in self._finished:
                self._remember_finished(step_key)  # its run, if it still comes, fails at once
        if step is not None:
            step.cancel(TaskError(f"{self.task}: step cancelled: {why}"))

    def read_variable(self, name: str) -> np.ndarray:
        with self._variable_locks[name]:
            if name not in self.variables:
                raise TaskError(f"{self.task} holds no variable '{name}'")
            return self.variables[name].copy()

    def write_variable(self, name: str, value: np.ndarray) -> None:
        with self._variable_locks[name]:
            self.variables[name] = np.array(value, order="C")

    def variable_values(self) -> dict[str, np.ndarray]:
        return {name: self.read_variable(name) for name in list(self.variables)}

    # --- steps ------------------------------------------------------------------------------------
    def _program(self, program_id: str) -> _LoadedProgram:
        with self._lock:
            program = self._programs.get(program_id)
        if program is None:
            raise TaskError(f"{self.task} has no program {program_id}: it was not loaded here (a restarted task?)")
        return program

    def _step(self, program_id: str, step_key: str) -> TaskStep | None:
        program = self._program(program_id)
        with self._lock:
            if step_key in self._finished:
                return None
            step = self._steps.get(step_key)
            if step is None:
                post = _Poster(program_id, step_key, program.peers)
                step = TaskStep(
                    step_key,
                    len(program.parts),
                    program.routes,
                    program.incoming,
                    program.outgoing,
                    post,
                    stage=stage_for_ray,
                )
                self._steps[step_key] = step
            return step

    def _finish(self, step_key: str) -> None:
        with self._lock:
            self._steps.pop(step_key, None)
            self._remember_finished(step_key)

    def _remember_finished(self, step_key: str) -> None:
        self._finished[step_key] = None
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)


# Values from this size up cross tasks through the object store: put there straight from the
# sender's buffer (one copy, no snapshot), read zero-copy by a receiver on the same node. Smaller
# ones travel inside the message (Ray inlines arguments up to 100 KiB).
PUT_MIN_BYTES = 100 * 1024


def stage_for_ray(address: int, nbytes: int):
    """What a send to another task posts: an object-store reference for a large value, else a copy."""
    if nbytes < PUT_MIN_BYTES:
        return snapshot(address, nbytes)
    import ray

    view = np.frombuffer((ctypes.c_char * nbytes).from_address(address), np.uint8)
    return ray.put(view)


def fetch_refs(values: list, what: str) -> list:
    """`values` with the object-store references among them fetched (within the timeout)."""
    import ray

    at = [i for i, v in enumerate(values) if isinstance(v, ray.ObjectRef)]
    if not at:
        return values
    values = list(values)
    for i, value in zip(at, ray_support.get([values[i] for i in at], what)):
        values[i] = value
    return values


def fetch_staged(batch: dict, what: str) -> dict[str, np.ndarray]:
    """A message's values, with object-store references fetched."""
    return dict(zip(batch, fetch_refs(list(batch.values()), what)))


class _Poster:
    """Sends one step's outbox to another task (or the driver's inbox): one call, not awaited
    (a dead receiver fails the step through its own run call)."""

    def __init__(self, program_id: str, step_key: str, peers: dict):
        self.program_id, self.step_key, self.peers = program_id, step_key, peers

    def __call__(self, task: str, batch: dict[str, np.ndarray]) -> None:
        self.peers[task].deliver.remote(self.program_id, self.step_key, batch)


class Inbox:
    """The driver's mailbox: tasks post the values bound for the driver here, the driver takes them."""

    def __init__(self):
        self._cond = threading.Condition()
        self._batches: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)

    def deliver(self, program_id: str, step_key: str, batch: dict[str, np.ndarray]) -> None:
        with self._cond:
            self._batches[step_key].update(batch)
            self._cond.notify_all()

    def take(self, step_key: str, timeout_s: float) -> dict[str, np.ndarray]:
        """Everything posted for `step_key` so far, waiting up to `timeout_s` for something."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._batches.get(step_key)), timeout=timeout_s)
            return self._batches.pop(step_key, {})

    def discard(self, step_key: str) -> None:
        with self._cond:
            self._batches.pop(step_key, None)
