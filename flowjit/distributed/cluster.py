"""`fd.Cluster`: the tasks of jobs (`/job:ps/task:0`, `/job:worker/task:2`, ...) as Ray actors.

    with fd.Cluster({"ps": 2, "worker": 3}) as cluster:    # a local Ray on 127.0.0.1
        with fj.device("/job:ps/task:0"):
            w = fj.Variable(...)                            # lives in that task's process
        step = fj.jit(...)                                  # ops under fj.device("/job:worker/task:1") run there

While the cluster runs, its tasks' devices (`/job:JOB/task:N/device:cpu:0`) are offered to placement
beside the local ones (`flowjit.runtime.devices.register_task_devices`), and it loads the
partitions of other tasks into their actors (`flowjit.runtime.tasks.register_remote_runner`).
`address="HOST:PORT"` (or `RAY_ADDRESS`) joins an existing Ray cluster with Ray's own address and
authentication; without one, a local Ray starts on the loopback interface only. Tasks are spread
over the cluster's nodes by a placement group (one bundle per task, strategy SPREAD). Leaving the
`with` block (normally, by an exception or Ctrl-C) copies the variables that live in tasks back
into this process, kills the actors, removes the placement group and, for a local cluster, stops
Ray: no process is left behind.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np

from flowjit.distributed import ray_support
from flowjit.distributed.task import PUT_MIN_BYTES, Inbox, TaskActor, fetch_staged, stage_for_ray
from flowjit.errors import FlowjitValueError
from flowjit.ir.devices import Device, DeviceSpec
from flowjit.ir.location import user_location
from flowjit.runtime import tasks as task_runtime
from flowjit.runtime.devices import register_task_devices, variable_placement
from flowjit.runtime.tasks import LOCAL_TASK, TaskError, TaskStep, task_name, variables_of

__all__ = ["Cluster"]

_RESERVED_JOBS = {"localhost"}


def _check_spec(spec) -> dict[str, int]:
    if not isinstance(spec, dict) or not spec:
        raise FlowjitValueError(
            f"{user_location()}: a cluster spec maps job names to task counts, e.g. {{'ps': 2, 'worker': 3}}; "
            f"found {spec!r}"
        )
    checked = {}
    for job, count in spec.items():
        if not isinstance(job, str) or not job.isidentifier() or job in _RESERVED_JOBS:
            raise FlowjitValueError(
                f"{user_location()}: job name {job!r} must be a plain name (not 'localhost', this process's job)"
            )
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise FlowjitValueError(f"{user_location()}: job '{job}' needs a positive number of tasks; found {count!r}")
        checked[job] = count
    return checked


class Cluster:
    """Tasks of jobs on Ray, each a process holding its partitions and variables.

    spec: job name -> number of tasks. address: an existing Ray cluster ("HOST:PORT", "auto"), else
    `RAY_ADDRESS`, else a new local one on 127.0.0.1 with `num_cpus` CPUs (default: this machine's).
    cpus_per_task: the CPUs each task reserves (default: an equal share of the cluster's, at most 1).
    max_restarts: how often Ray restarts a task whose process died (its state is gone: a `Trainer`
    gives it its role again; a jitted program's partitions must be compiled again).
    """

    def __init__(
        self,
        spec: dict[str, int],
        address: str | None = None,
        num_cpus: int | None = None,
        cpus_per_task: float | None = None,
        max_restarts: int = 5,
    ):
        self.spec = _check_spec(spec)
        self.address = address if address is not None else os.environ.get("RAY_ADDRESS")
        self.num_cpus = num_cpus
        self.cpus_per_task = cpus_per_task
        self.max_restarts = max_restarts
        self.tasks = [f"/job:{job}/task:{i}" for job, n in self.spec.items() for i in range(n)]
        self._actors: dict[str, object] = {}
        self._inbox = None
        self._placement_group = None
        self._owns_ray = False
        self._undo: list = []
        self._lock = threading.Lock()
        self.running = False

    # --- lifetime ---------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> Cluster:
        """Start Ray (or join it) and one actor per task; returns once every task answers."""
        if self.running:
            return self
        if not self.address:  # read by Ray when it is imported: before the first import
            for key, value in ray_support.LOCAL_ENV.items():
                os.environ.setdefault(key, value)
        ray = ray_support.ray()
        try:
            if not ray.is_initialized():
                if not self.address:
                    ray_support.loopback_only(ray)
                if self.address:
                    ray.init(address=self.address, include_dashboard=False, log_to_driver=True)
                else:
                    ray.init(
                        address="local",
                        num_cpus=self.num_cpus or os.cpu_count(),
                        include_dashboard=False,
                        _node_ip_address="127.0.0.1",
                    )
                self._owns_ray = True
            self._start_actors(ray)
            self._undo.append(register_task_devices(self.devices))
            self._undo.append(task_runtime.register_remote_runner(_Runner(self)))
            self.running = True
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start_actors(self, ray) -> None:
        available = _free_cpus(ray, at_least=0.01 * len(self.tasks) if self.cpus_per_task is None else 0.0)
        share = self.cpus_per_task if self.cpus_per_task is not None else min(1.0, available / len(self.tasks))
        share = math.floor(share * 100) / 100  # rounded down: the bundles must fit
        if share < 0.01:
            raise TaskError(
                f"the Ray cluster has {available:g} CPUs free for the {len(self.tasks)} tasks of {self.spec}: "
                "pass cpus_per_task= (a fraction is fine) or free some"
            )
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement_group = placement_group([{"CPU": share} for _ in self.tasks], strategy="SPREAD")
        try:
            ray_support.get(self._placement_group.ready(), "placing the cluster's tasks on Ray's nodes", timeout=60)
        except TaskError:
            raise TaskError(
                f"Ray could not place the {len(self.tasks)} tasks of {self.spec} with {share:g} CPUs each within 60 s "
                f"(free CPUs: {ray.available_resources().get('CPU', 0.0):g}); pass a smaller cpus_per_task="
            ) from None
        environment = {k: v for k, v in os.environ.items() if k.startswith("FLOWJIT_")}
        actor_class = ray.remote(max_concurrency=64)(TaskActor)
        for i, task in enumerate(self.tasks):
            strategy = PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=i)
            self._actors[task] = actor_class.options(
                num_cpus=share, scheduling_strategy=strategy, max_restarts=self.max_restarts
            ).remote(task, environment)
        self._inbox = ray.remote(max_concurrency=64)(Inbox).options(num_cpus=0).remote()
        ray_support.get([a.ping.remote() for a in self._actors.values()], "starting the cluster's tasks")

    def shutdown(self) -> None:
        """Copy variables living in tasks back here, stop every task, and stop a Ray this cluster started."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if self.running:
            self._bring_variables_home()
        self.running = False
        ray = ray_support.ray()
        if ray.is_initialized():
            for actor in [*self._actors.values(), self._inbox]:
                if actor is not None:
                    try:
                        ray.kill(actor)
                    except Exception:  # noqa: BLE001 (an actor already gone is fine)
                        pass
            if self._placement_group is not None:
                _remove_placement_group(self._placement_group)
        self._actors.clear()
        self._inbox = self._placement_group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    def _bring_variables_home(self) -> None:
        for name, home in task_runtime.variable_homes().items():
            if isinstance(home, ActorHome) and home.cluster is self:
                try:
                    np.copyto(home.buffer, home.read(), casting="unsafe")
                except TaskError:
                    pass  # the task died: the variable keeps the value it had when it moved there
                task_runtime.set_variable_home(name, None)

    # --- facts ------------------------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """The devices of the cluster's tasks (one CPU device each)."""
        return [Device(DeviceSpec(*_job_task(t), "cpu", 0)) for t in self.tasks]

    def shard_variables(self, job: str = "ps"):
        """A block in which each Variable created without a device goes to a task of `job`: the
        least loaded one by bytes so far (TensorFlow's replica_device_setter with its greedy
        strategy). Use it around the model's variables:

            with cluster.shard_variables():
                params = {k: fj.Variable(v, name=k) for k, v in init.items()}
        """
        if job not in self.spec:
            raise FlowjitValueError(f"{user_location()}: the cluster {self.spec} has no job '{job}'")
        load = [0] * self.spec[job]

        def placer(nbytes: int) -> str:
            k = min(range(len(load)), key=lambda i: (load[i], i))
            load[k] += nbytes
            return f"/job:{job}/task:{k}"

        return variable_placement(placer)

    def where(self) -> dict[str, tuple[str, int]]:
        """Each task's (Ray node id, process id), asked now (a restarted task has a new process)."""
        refs = [self.actor(t).where.remote() for t in self.tasks]
        return dict(zip(self.tasks, ray_support.get(refs, "asking the tasks where they run")))

    def actor(self, task: str):
        """The Ray actor of `task` ('/job:ps/task:0')."""
        if not self.running:
            raise TaskError(f"the cluster {self.spec} is not running (it was shut down): start a new one")
        actor = self._actors.get(task)
        if actor is None:
            raise FlowjitValueError(f"no task {task} in the cluster {self.spec}; its tasks are {', '.join(self.tasks)}")
        return actor

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Cluster({self.spec}, {state})"


def _free_cpus(ray, at_least: float, wait_s: float = 10.0) -> float:
    """The CPUs Ray has free, waiting (bounded) for `at_least` of them: resources a stopped
    cluster gave back reach Ray's accounting a moment later."""
    deadline = time.monotonic() + wait_s
    free = ray.available_resources().get("CPU", 0.0)
    while free < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
        free = ray.available_resources().get("CPU", 0.0)
    return free


def _remove_placement_group(group, timeout_s: float = 10.0) -> None:
    """Remove `group` and wait (bounded) until Ray has taken it back, so its CPUs are free for the
    next cluster when this call returns."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    try:
        remove_placement_group(group)
        deadline = time.monotonic() + timeout_s
        while placement_group_table(group).get("state") != "REMOVED" and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 (a group already gone is fine)
        pass


def _job_task(task: str) -> tuple[str, int]:
    spec = DeviceSpec.parse(task)
    return spec.job, spec.task


class ActorHome:
    """A variable living in a task's actor; `buffer` is this process's copy, refreshed on shutdown."""

    def __init__(self, cluster: Cluster, task: str, name: str, buffer: np.ndarray):
        self.cluster, self.task, self.name, self.buffer = cluster, task, name, buffer

    def read(self) -> np.ndarray:
        actor = self.cluster.actor(self.task)
        return ray_support.get(actor.read_variable.remote(self.name), f"reading variable '{self.name}' on {self.task}")

    def write(self, value: np.ndarray) -> None:
        actor = self.cluster.actor(self.task)
        ray_support.get(actor.write_variable.remote(self.name, value), f"writing variable '{self.name}' on {self.task}")

    def left(self) -> None:
        """Nothing to give back: the task's copy is simply no longer read (whoever took it read it)."""


class _Runner:
    """Loads the partitions of a program that live in this cluster's tasks."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def load(self, partitions: dict[int, tuple], crossings: dict[str, tuple[str, str]], target: str | None):
        by_task: dict[str, dict[int, tuple]] = {}
        for n, part in partitions.items():
            by_task.setdefault(task_name(part[1]), {})[n] = part
        program_id = uuid.uuid4().hex[:12]
        peers = {t: self.cluster.actor(t) for t in self.cluster.tasks}
        peers[LOCAL_TASK] = self.cluster._inbox
        loads = []
        for task, parts in by_task.items():
            loads.append(self.cluster.actor(task).load.remote(program_id, parts, crossings, target, peers))
        ray_support.get(loads, f"compiling partitions on {', '.join(sorted(by_task))}")
        return _ClusterProgram(self.cluster, program_id, by_task)


class _ClusterProgram:
    """A program's partitions in the cluster's tasks; `start` runs one step on all of them."""

    def __init__(self, cluster: Cluster, program_id: str, by_task: dict[str, dict[int, tuple]]):
        self.cluster = cluster
        self.program_id = program_id
        self.by_task = by_task
        self.variables = {
            task: variables_of(graph for graph, _, _ in parts.values()) for task, parts in by_task.items()
        }
        self._steps = itertools.count(1)
        self._start_order: list[str] | None = None  # planned on the first step (`_plan_inputs`)

    def new_step_key(self) -> str:
        return f"{self.program_id}:{next(self._steps)}"

    def usable(self) -> bool:
        return self.cluster.running

    @staticmethod
    def stage(address: int, nbytes: int):
        return stage_for_ray(address, nbytes)

    def post(self, step_key: str, task: str, batch: dict[str, np.ndarray]) -> None:
        self.cluster.actor(task).deliver.remote(self.program_id, step_key, batch)

    def start(
        self, step_key: str, args: Sequence[np.ndarray], variables: dict[str, np.ndarray], local: TaskStep
    ) -> _Step:
        if self._start_order is None:
            self._plan_inputs(args)
        runs = {}
        shared: dict[int, object] = {}
        for task in self._start_order:  # tasks reading fewer input bytes start first
            parts = self.by_task[task]
            first = self._move_variables(task, variables)
            for i in self._task_inputs[task]:
                if i in self._shared and i not in shared:
                    shared[i] = ray_support.ray().put(args[i])
            task_args = {n: [shared.get(i, args[i]) for i in part[2]] for n, part in parts.items()}
            runs[task] = self.cluster.actor(task).run.remote(self.program_id, step_key, task_args, first)
        return _Step(self, step_key, runs, local)

    def _plan_inputs(self, args: Sequence[np.ndarray]) -> None:
        """Once per program: which inputs each task reads; the large ones read by several tasks go
        into the object store once per step (each task fetches the same object) instead of once per
        run call; and the tasks reading the fewest input bytes start first (a parameter server
        that only sends variables is not held back by the workers' inputs)."""
        self._task_inputs = {
            t: sorted({i for part in parts.values() for i in part[2]}) for t, parts in self.by_task.items()
        }
        readers: dict[int, int] = {}
        for inputs in self._task_inputs.values():
            for i in inputs:
                readers[i] = readers.get(i, 0) + 1
        size = {i: np.asarray(args[i]).nbytes for i in readers}
        self._shared = {i for i, count in readers.items() if count > 1 and size[i] >= PUT_MIN_BYTES}
        self._start_order = sorted(self.by_task, key=lambda t: sum(size[i] for i in self._task_inputs[t]))

    def _move_variables(self, task: str, variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The values of the variables that start living in `task` with this step (taken from where
        they lived: this process or another task), their homes updated."""
        first = {}
        for name in self.variables[task]:
            home = task_runtime.variable_home(name)
            if home is not None and home.task == task:
                continue
            if name not in variables:
                raise TaskError(f"variable '{name}' used on {task} was not passed to the step")
            first[name] = home.read() if home is not None else variables[name]
            task_runtime.set_variable_home(name, ActorHome(self.cluster, task, name, variables[name]))
        return first


class _Step:
    """One step running in the tasks. A supervisor thread (when this process's partitions take
    values from tasks) takes those values from the inbox and cancels the local step as soon as a
    task fails, so no local recv waits for a value that cannot come."""

    def __init__(self, program: _ClusterProgram, step_key: str, runs: dict, local: TaskStep):
        self.program, self.step_key, self.runs, self.local = program, step_key, runs, local
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._supervisor = None
        if local.incoming:
            self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="flowjit-step")
            self._supervisor.start()

    def _supervise(self) -> None:
        ray = ray_support.ray()
        inbox = self.program.cluster._inbox
        expected = set(self.local.incoming)
        pending = dict(self.runs)
        take = inbox.take.remote(self.step_key, 0.5) if expected else None
        try:
            while not self._stop.is_set() and (expected or pending):
                refs = list(pending.values()) + ([take] if take is not None else [])
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
                for ref in ready:
                    if ref is take:
                        batch = ray_support.get(take, f"taking the values tasks sent in step {self.step_key}")
                        self.local.deliver(fetch_staged(batch, f"values tasks sent in step {self.step_key}"))
                        expected -= set(batch)
                        take = inbox.take.remote(self.step_key, 0.5) if expected else None
                        continue
                    task = next(t for t, r in pending.items() if r is ref)
                    del pending[task]
                    try:
                        ray_support.get(ref, f"step {self.step_key} on {task}")
                    except BaseException as e:  # noqa: BLE001 (reported by join; here it only cancels)
                        self.local.cancel(e)
                        return
        except BaseException as e:  # noqa: BLE001
            self._failure = e
            self.local.cancel(e)

    def join(self) -> dict[int, list[np.ndarray]]:
        self._stop.set()
        outs: dict[int, list[np.ndarray]] = {}
        errors = []
        for task, ref in self.runs.items():
            try:
                outs.update(ray_support.get(ref, f"step {self.step_key} on {task}"))
            except BaseException as e:  # noqa: BLE001
                errors.append((task, e))
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        if self.program.cluster._inbox is not None and self.local.incoming:
            self.program.cluster._inbox.discard.remote(self.step_key)
        if errors:
            roots = [(t, e) for t, e in errors if "cancelled" not in str(e)] or errors
            task, root = roots[0]
            for other_task, other in errors:
                if other is not root:
                    root.add_note(f"task {other_task} stopped: {other}")
            raise root
        if self._failure is not None:
            raise self._failure
        return outs

    def cancel(self, error: BaseException) -> None:
        for task in self.runs:
            self.program.cluster.actor(task).cancel.remote(self.step_key, str(error))
