"""`fd.Trainer`: between-graph data-parallel training with parameters on parameter-server tasks.

    trainer = fd.Trainer(cluster, loss_fn, params, fj.optim.Adam(1e-3), mode="sync", replicas_to_aggregate=2)
    history = trainer.fit(batches, steps=500, checkpoint_dir="ckpt", checkpoint_every=50)
    params = trainer.params()

The parameters (a pytree of arrays) are sharded over the `ps` tasks, largest leaf first onto the
least loaded shard (TensorFlow's greedy `replica_device_setter`); each shard keeps its optimizer
state and applies its update where it lives (a jitted `optimizer.update` on that task). Each
`worker` task holds the jitted `value_and_grad(loss_fn)`; for a step it pulls the shards, computes
on its batch and deposits each shard's gradient on its PS (one Ray call per worker/PS pair).

- mode="sync": a step aggregates the gradients of the first `replicas_to_aggregate` workers to
  finish it (the others are backups: TensorFlow's SyncReplicasOptimizer). The driver names the
  chosen workers to every shard, so all shards average the same replicas; a gradient deposited for
  another step, or by a worker not chosen, is dropped (counted in `dropped`). Applying a step is
  idempotent: a retried call for a step already applied changes nothing.
- mode="async": every deposited gradient is applied as it arrives, against whatever parameters the
  worker read (Hogwild-style staleness, as in the paper's asynchronous replication).
- sparse: parameters named there (embedding tables) travel from workers as (indices, rows) of the
  rows their gradient touches; the PS scatter-adds them into a dense gradient before the update,
  so results equal dense training while only touched rows cross the network.
- compress="bf16": gradients and pulled parameters cross as bfloat16 (rounded to nearest even).
- Checkpoints (`checkpoint_dir`, `checkpoint_every`): every shard's parameters, optimizer state and
  step, written atomically (`fj.save_checkpoint` to a temporary file, then renamed). A worker whose
  process dies is restarted by Ray and given its replica again; a dead PS is restarted and every
  shard restored from the last checkpoint (or the initial parameters), and training goes on from
  there. Each is reported in the history; no wait is unbounded.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from flowjit.distributed import ray_support
from flowjit.distributed.cluster import Cluster
from flowjit.errors import FlowjitValueError
from flowjit.frontend.checkpoint import load_checkpoint, save_checkpoint
from flowjit.frontend.grad import value_and_grad
from flowjit.frontend.jit import jit
from flowjit.frontend.pytree import leaf_paths, tree_flatten, tree_unflatten
from flowjit.ir.location import user_location
from flowjit.runtime.tasks import TaskError

__all__ = ["History", "Trainer", "shard_by_size"]

_PS_ROLE = "flowjit.parameter_shard"
_REPLICA_ROLE = "flowjit.replica"


# --- bfloat16 on the wire ---------------------------------------------------------------------------
def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(x: np.ndarray, compress: str | None):
    """What crosses the network for array `x`: itself, or ("bf16", its bits) for a float32 array
    under compress="bf16"."""
    return ("bf16", to_bf16(x)) if compress == "bf16" and x.dtype == np.float32 else x


def decode(value) -> np.ndarray:
    """The array an `encode`d value stands for."""
    return from_bf16(value[1]) if isinstance(value, tuple) and value[0] == "bf16" else value


def wire_gradient(g: np.ndarray, sparse: bool, compress: str | None):
    """What crosses the network for gradient `g`: the array (bf16 bits with compress="bf16"), or
    for a sparse parameter ("rows", indices, rows) of the rows that are not all zero."""
    if not sparse:
        return encode(g, compress)
    rows = np.flatnonzero(np.any(g.reshape(g.shape[0], -1) != 0, axis=1))
    return ("rows", rows, encode(g[rows], compress))


def shard_by_size(sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Leaf names per shard: largest first onto the least loaded shard (ties: the lower shard)."""
    load = [0] * shards
    placed: list[list[str]] = [[] for _ in range(shards)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        k = min(range(shards), key=lambda i: (load[i], i))
        placed[k].append(name)
        load[k] += sizes[name]
    return placed


# --- the roles living in tasks ----------------------------------------------------------------------
class ParameterShard:
    """Some of the parameters, their optimizer state and the step count, on one PS task."""

    def __init__(self, params: dict[str, np.ndarray], optimizer, mode: str, compress: str | None):
        self.params = {k: np.array(v) for k, v in params.items()}
        self.optimizer = optimizer
        self.opt_state = optimizer.init(self.params)
        self.mode = mode
        self.compress = compress
        self.step = 0
        self._delays: dict[int, float] = {}
        self.dropped = 0
        self._deposits: dict[tuple[int, int], dict] = {}
        self._cond = threading.Condition()

        def update(grads, state, params):
            return optimizer.update(grads, state, params)

        self._update = jit(update)

    def pull(self, min_step: int, timeout_s: float) -> tuple[int, dict]:
        """(step, parameters) once this shard has reached `min_step`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.step >= min_step, timeout=timeout_s):
                raise TaskError(f"parameter shard at step {self.step}: step {min_step} not reached in {timeout_s:g} s")
            return self.step, {k: encode(v, self.compress) for k, v in self.params.items()}

    def deposit(self, step: int, worker: int, grads: dict) -> None:
        """A worker's gradient for `step` (sync: kept until the step is applied; async: applied now)."""
        with self._cond:
            if self.mode == "async":
                self._apply([grads])
                return
            if step < self.step:
                self.dropped += 1  # stale: its step was applied without it
                return
            self._deposits[(step, worker)] = grads
            self._cond.notify_all()

    def apply(self, step: int, workers: list[int], timeout_s: float) -> int:
        """Apply `step` as the average of the named workers' gradients (once: a retry of an applied
        step changes nothing). Returns the shard's step afterwards."""
        with self._cond:
            if step != self.step:
                return self.step
            ready = self._cond.wait_for(lambda: all((step, w) in self._deposits for w in workers), timeout=timeout_s)
            if not ready:
                missing = [w for w in workers if (step, w) not in self._deposits]
                raise TaskError(f"step {step}: gradients of workers {missing} never arrived")
            self._apply([self._deposits.pop((step, w)) for w in workers])
            for key in [k for k in self._deposits if k[0] <= step]:
                del self._deposits[key]
                self.dropped += 1
            return self.step

    def _apply(self, gradients: list[dict]) -> None:
        total = {k: np.zeros_like(v) for k, v in self.params.items()}
        for grads in gradients:
            for k, g in grads.items():
                if isinstance(g, tuple) and g[0] == "rows":  # sparse: (indices, rows)
                    np.add.at(total[k], g[1], decode(g[2]))
                else:
                    total[k] += decode(g)
        mean = {k: (v / len(gradients)).astype(v.dtype) for k, v in total.items()}
        self.params, self.opt_state = self._update(mean, self.opt_state, self.params)
        self.params = {k: np.asarray(v) for k, v in self.params.items()}
        self.step += 1
        self._cond.notify_all()

    def state(self) -> dict:
        with self._cond:
            return {"params": self.params, "opt_state": self.opt_state, "step": self.step, "dropped": self.dropped}

    def restore(self, state: dict) -> None:
        with self._cond:
            self.params = {k: np.array(v) for k, v in state["params"].items()}
            opt_state = state["opt_state"]
            self.opt_state = self.optimizer.init(self.params) if opt_state is None else opt_state
            self.step = int(state["step"])
            self._deposits.clear()
            self._cond.notify_all()


class Replica:
    """A worker's model replica: the jitted value-and-gradient of the loss."""

    def __init__(self, index: int, loss_fn, treedef, names, shards, ps_handles, sparse, compress, timeout_s):
        self.index = index
        self.treedef, self.names, self.shards = treedef, names, shards
        self.ps = ps_handles
        self.sparse = set(sparse)
        self.compress = compress
        self.timeout_s = timeout_s
        self._grad = jit(value_and_grad(loss_fn))

    def compute(self, step: int, batch, sync: bool, delay_s: float = 0.0) -> tuple[int, float, float]:
        """Pull the parameters of `step` (sync) or the latest (async), compute on `batch`, deposit
        each shard's gradient on its PS. Returns (step, loss, seconds)."""
        start = time.perf_counter()
        if delay_s:
            time.sleep(delay_s)  # a simulated straggler
        pulls = [ps.call.remote(_PS_ROLE, "pull", step if sync else 0, self.timeout_s) for ps in self.ps]
        pulled = ray_support.get(pulls, f"worker {self.index} pulling parameters", timeout=self.timeout_s)
        values = {}
        for _, shard in pulled:
            values.update({k: decode(v) for k, v in shard.items()})
        params = tree_unflatten(self.treedef, [values[n] for n in self.names])
        loss, grads = self._grad(params, batch)
        flat = dict(zip(self.names, tree_flatten(grads)[0]))
        deposits = []
        for k, names in enumerate(self.shards):
            part = {}
            for n in names:
                part[n] = wire_gradient(np.asarray(flat[n]), n in self.sparse, self.compress)
            deposits.append(self.ps[k].call.remote(_PS_ROLE, "deposit", step, self.index, part))
        if not sync:  # applied when this returns, so the driver's count of applied steps is right
            ray_support.get(deposits, f"worker {self.index} pushing gradients", timeout=self.timeout_s)
        return step, float(loss), time.perf_counter() - start


# --- the driver ---------------------------------------------------------------------------------------
@dataclass
class History:
    """What `fit` did: per applied step its loss, time and the workers aggregated; totals."""

    loss: list[float] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)
    workers: list[list[int]] = field(default_factory=list)
    dropped: int = 0
    recoveries: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.loss)


def _ship_user_code_by_value() -> None:
    """Functions and classes of the user's own modules (files outside the Python installation and
    outside flowjit: a script, an example, a test) travel to tasks by value, as tasks may not be
    able to import them (their folder is not on the tasks' path)."""
    cloudpickle = ray_support.ray().cloudpickle
    installed = tuple(
        os.path.abspath(p) + os.sep
        for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(__file__))}
    )
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name == "__main__" or not path or os.path.abspath(path).startswith(installed):
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except (ValueError, TypeError):
            pass  # a module cloudpickle cannot take by value (a namespace package) stays by reference


class Trainer:
    """Parameter-server training of `loss_fn(params, batch) -> scalar` on a cluster's tasks."""

    def __init__(
        self,
        cluster: Cluster,
        loss_fn: Callable,
        params,
        optimizer,
        mode: str = "sync",
        replicas_to_aggregate: int | None = None,
        sparse: Iterable[str] = (),
        compress: str | None = None,
        ps_job: str = "ps",
        worker_job: str = "worker",
    ):
        if mode not in ("sync", "async"):
            raise FlowjitValueError(f"{user_location()}: mode must be 'sync' or 'async'; found {mode!r}")
        if compress not in (None, "bf16"):
            raise FlowjitValueError(f"{user_location()}: compress must be None or 'bf16'; found {compress!r}")
        for job in (ps_job, worker_job):
            if job not in cluster.spec:
                raise FlowjitValueError(f"{user_location()}: the cluster {cluster.spec} has no job '{job}'")
        self.cluster = cluster
        self.loss_fn, self.optimizer, self.mode, self.compress = loss_fn, optimizer, mode, compress
        self.ps_tasks = [f"/job:{ps_job}/task:{i}" for i in range(cluster.spec[ps_job])]
        self.worker_tasks = [f"/job:{worker_job}/task:{i}" for i in range(cluster.spec[worker_job])]
        n_workers = len(self.worker_tasks)
        self.replicas_to_aggregate = n_workers if replicas_to_aggregate is None else replicas_to_aggregate
        if not 1 <= self.replicas_to_aggregate <= n_workers:
            raise FlowjitValueError(
                f"{user_location()}: replicas_to_aggregate must be between 1 and the {n_workers} workers; "
                f"found {replicas_to_aggregate!r}"
            )
        leaves, self.treedef = tree_flatten(params)
        self.names = [f"p{i}" for i in range(len(leaves))]
        self.initial = {n: np.array(v) for n, v in zip(self.names, leaves)}
        paths = leaf_paths(params)  # "['emb']", "[0]['w']", ...
        self.sparse = []
        for name in sparse:
            matches = [i for i, p in enumerate(paths) if p in (name, f"[{name!r}]")]
            if not matches:
                raise FlowjitValueError(
                    f"{user_location()}: sparse parameter {name!r} is not a leaf of params "
                    f"(its leaves: {', '.join(paths)})"
                )
            self.sparse.append(self.names[matches[0]])
        self.shards = shard_by_size({n: v.nbytes for n, v in self.initial.items()}, len(self.ps_tasks))
        self.step = 0
        self._delays: dict[int, float] = {}
        self.dropped = 0  # gradients computed but not applied (sync: stragglers and extra backups)
        _ship_user_code_by_value()
        for k in range(len(self.ps_tasks)):
            self._host_shard(k, {n: self.initial[n] for n in self.shards[k]})
        for i in range(n_workers):
            self._host_replica(i)

    # --- roles --------------------------------------------------------------------------------------
    def _host_shard(self, k: int, params: dict) -> None:
        actor = self.cluster.actor(self.ps_tasks[k])
        ray_support.get(
            actor.host.remote(_PS_ROLE, ParameterShard, params, self.optimizer, self.mode, self.compress),
            f"starting parameter shard {self.ps_tasks[k]}",
        )

    def _host_replica(self, i: int) -> None:
        ps = [self.cluster.actor(t) for t in self.ps_tasks]
        ray_support.get(
            self.cluster.actor(self.worker_tasks[i]).host.remote(
                _REPLICA_ROLE,
                Replica,
                i,
                self.loss_fn,
                self.treedef,
                self.names,
                self.shards,
                ps,
                self.sparse,
                self.compress,
                ray_support.timeout_s(),
            ),
            f"starting replica {self.worker_tasks[i]}",
        )

    def _compute(self, i: int, step: int, batch):
        actor = self.cluster.actor(self.worker_tasks[i])
        delay = self._delays.get(i, 0.0)
        return actor.call.remote(_REPLICA_ROLE, "compute", step, batch, self.mode == "sync", delay)

    # --- training -----------------------------------------------------------------------------------
    def fit(
        self,
        batches,
        steps: int,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 0,
        progress: bool | None = None,
        log: Callable[[int, dict], None] | None = None,
        worker_delay: dict[int, float] | None = None,
    ) -> History:
        """Train for `steps` applied updates. `batches` is an iterable of batches (each handed to
        one worker) or a function `batches(step, worker) -> batch`. `log(step, metrics)` is called
        after each step; `progress` prints a progress line (default: when stderr is a terminal).
        `worker_delay` ({worker index: seconds}) makes workers straggle on purpose, to see backup
        workers at work. Returns the History."""
        self._delays = dict(worker_delay or {})
        if steps < 1:
            raise FlowjitValueError(f"{user_location()}: steps must be a positive number; found {steps!r}")
        source = _batch_source(batches)
        history = History()
        show = sys.stderr.isatty() if progress is None else progress
        if checkpoint_dir is not None:
            os.makedirs(checkpoint_dir, exist_ok=True)
        target = self.step + steps
        dropped_before = self.dropped
        outstanding: dict[int, tuple[int, object]] = {}  # worker -> (step, ref)
        ray = ray_support.ray()
        while self.step < target:
            started = time.perf_counter()
            try:
                chosen, losses = self._one_step(source, outstanding, ray, history)
            except TaskError as e:
                self._recover(e, outstanding, history)
                continue
            history.loss.append(float(np.mean(losses)))
            history.step_time.append(time.perf_counter() - started)
            history.workers.append(chosen)
            if checkpoint_dir is not None and checkpoint_every and self.step % checkpoint_every == 0:
                history.checkpoints.append(self.save(checkpoint_dir))
            metrics = {
                "loss": history.loss[-1],
                "step_time": history.step_time[-1],
                "workers": chosen,
                "dropped": self.dropped - dropped_before,
            }
            if log is not None:
                log(self.step, metrics)
            if show:
                done = steps - (target - self.step)
                print(
                    f"\rstep {self.step} [{done}/{steps}] loss {history.loss[-1]:.4f} "
                    f"{history.step_time[-1] * 1e3:.1f} ms/step, {metrics['dropped']} gradients dropped",
                    end="" if done < steps else "\n",
                    file=sys.stderr,
                )
        for i, (_, ref) in outstanding.items():  # stragglers still computing: their gradients are dropped
            try:
                ray_support.get(ref, f"worker {self.worker_tasks[i]}")
                self.dropped += self.mode == "sync"
            except TaskError as e:
                self._revive_worker(i, e, history)
        history.dropped = self.dropped - dropped_before
        return history

    def _one_step(self, source, outstanding: dict, ray, history: History) -> tuple[list[int], list[float]]:
        """Keep every idle worker busy on this step; wait for the first N (sync) or one (async) to
        finish; apply. A worker whose process died is given its replica again and goes on.
        Returns the workers aggregated and their losses."""
        step = self.step
        need = self.replicas_to_aggregate if self.mode == "sync" else 1
        finished: list[tuple[int, float]] = []
        deadline = time.monotonic() + ray_support.timeout_s()
        while len(finished) < need:
            for i in range(len(self.worker_tasks)):
                if i not in outstanding and (self.mode == "async" or i not in dict(finished)):
                    outstanding[i] = (step, self._compute(i, step, source(step, i)))
            current = {ref: i for i, (s, ref) in outstanding.items()}
            left = deadline - time.monotonic()
            if left <= 0:
                raise TaskError(f"step {step}: fewer than {need} workers finished in {ray_support.timeout_s():g} s")
            ready, _ = ray.wait(list(current), num_returns=1, timeout=left)
            for ref in ready:
                i = current[ref]
                done_step, _ = outstanding.pop(i)
                try:
                    _, loss, _ = ray_support.get(ref, f"worker {self.worker_tasks[i]}")
                except TaskError as e:
                    self._revive_worker(i, e, history)
                    continue
                if self.mode == "async" or (done_step == step and len(finished) < need):
                    finished.append((i, loss))
                else:
                    self.dropped += 1  # a straggler's gradient for a step applied without it
        chosen = [i for i, _ in finished]
        if self.mode == "sync":
            applies = [
                self.cluster.actor(t).call.remote(_PS_ROLE, "apply", step, chosen, ray_support.timeout_s())
                for t in self.ps_tasks
            ]
            ray_support.get(applies, f"applying step {step}")
            self.step = step + 1
        else:
            self.step += len(finished)
        return chosen, [loss for _, loss in finished]

    def _revive_worker(self, i: int, error: TaskError, history: History) -> None:
        """Worker i's step failed: if its process died (Ray restarts it), give it its replica
        again; if a PS died, raise for `_recover`; any other failure is the user's: raise it."""
        if not all(self._alive(t, _PS_ROLE) for t in self.ps_tasks):
            raise error
        if self._alive(self.worker_tasks[i], _REPLICA_ROLE):
            raise error
        self._host_replica(i)
        history.recoveries.append(f"worker {self.worker_tasks[i]} restarted and rejoined at step {self.step}")

    def _recover(self, error: TaskError, outstanding: dict, history: History) -> None:
        """A task died or timed out: wait for Ray to restart dead tasks, give each its role again
        (a PS from the last checkpoint: every shard rolls back, so they agree), then go on."""
        outstanding.clear()
        dead_ps, dead_workers = [], []
        for k, task in enumerate(self.ps_tasks):
            if not self._alive(task, _PS_ROLE):
                dead_ps.append(k)
        for i, task in enumerate(self.worker_tasks):
            if not self._alive(task, _REPLICA_ROLE):
                dead_workers.append(i)
        if not dead_ps and not dead_workers:
            raise error  # nothing died: a real failure (a bug in the loss, a timeout)
        if dead_ps:
            state = self._last_checkpoint_state()
            for k in range(len(self.ps_tasks)):
                if k in dead_ps:
                    self._host_shard(k, {n: self.initial[n] for n in self.shards[k]})
                actor = self.cluster.actor(self.ps_tasks[k])
                ray_support.get(actor.call.remote(_PS_ROLE, "restore", state[k]), f"restoring {self.ps_tasks[k]}")
            self.step = int(state[0]["step"])
            history.recoveries.append(
                f"parameter servers {[self.ps_tasks[k] for k in dead_ps]} restarted; "
                f"all shards restored to step {self.step}"
            )
        for i in dead_workers:
            self._host_replica(i)
            history.recoveries.append(f"worker {self.worker_tasks[i]} restarted and rejoined at step {self.step}")

    def _alive(self, task: str, role: str) -> bool:
        """Whether `task` answers and still hosts `role`; waits for Ray to restart a dead task."""
        actor = self.cluster.actor(task)
        deadline = time.monotonic() + ray_support.timeout_s()
        while time.monotonic() < deadline:
            try:
                ray_support.get(actor.ping.remote(), f"{task}", timeout=10)
                break
            except TaskError:
                time.sleep(0.2)  # restarting
        else:
            raise TaskError(f"{task} did not come back within {ray_support.timeout_s():g} s")
        return ray_support.get(actor.hosts.remote(role), task, timeout=10)

    # --- state --------------------------------------------------------------------------------------
    def _shard_states(self) -> list[dict]:
        refs = [self.cluster.actor(t).call.remote(_PS_ROLE, "state") for t in self.ps_tasks]
        return ray_support.get(refs, "reading the parameter shards")

    def params(self):
        """The current parameters (gathered from the shards), as the pytree given."""
        values = {}
        for state in self._shard_states():
            values.update(state["params"])
        return tree_unflatten(self.treedef, [np.asarray(values[n]) for n in self.names])

    def save(self, checkpoint_dir: str) -> str:
        """Write every shard's state atomically to `checkpoint_dir/step-N.fjckpt`; returns the path."""
        states = self._shard_states()
        path = os.path.join(checkpoint_dir, f"step-{states[0]['step']}.fjckpt")
        tmp = path + ".tmp"
        save_checkpoint(tmp, {"shards": states})
        os.replace(tmp, path)
        self._last_checkpoint = path
        return path

    def _last_checkpoint_state(self) -> list[dict]:
        path = getattr(self, "_last_checkpoint", None)
        if path is None:
            return [
                {"params": {n: self.initial[n] for n in names}, "opt_state": None, "step": 0, "dropped": 0}
                for names in self.shards
            ]
        return load_checkpoint(path)["shards"]


def _batch_source(batches) -> Callable[[int, int], object]:
    if callable(batches):
        return batches
    iterator: Iterator = iter(batches)

    def next_batch(step: int, worker: int):
        try:
            return next(iterator)
        except StopIteration:
            raise FlowjitValueError(f"{user_location()}: the batches ran out at step {step}") from None

    return next_batch
