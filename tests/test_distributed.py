"""flowjit.distributed on a local Ray cluster (2 CPUs, loopback): in-graph parameter-server steps,
the Trainer's sync/async modes, sparse and bf16 transfers, failures and recovery.

One cluster ({"ps": 2, "worker": 3}) serves the module; the tests that kill tasks run last.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.errors import FlowjitError

ray = pytest.importorskip("ray", reason="the `distributed` extra (Ray) is not installed")
fd = pytest.importorskip("flowjit.distributed")


@pytest.fixture(scope="module")
def cluster():
    os.environ["FLOWJIT_RAY_TIMEOUT"] = "60"
    with fd.Cluster({"ps": 2, "worker": 3}, num_cpus=2, cpus_per_task=0.2) as c:  # leaves 1 CPU free
        yield c
    os.environ.pop("FLOWJIT_RAY_TIMEOUT", None)


def _mse(w, x, y):
    return fnp.mean((x @ w - y) ** 2)


def _data(seed=0, n=2):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 16, 8)).astype(np.float32), rng.standard_normal((n, 16, 4)).astype(np.float32)


def test_remote_partitions_need_a_running_cluster():
    @fj.jit
    def f(x):
        with fj.device("/job:worker/task:0"):
            return x + 1

    with pytest.raises(FlowjitError, match="no device matches"):
        f(np.ones(3, np.float32))  # no cluster yet (this test runs first): the task's devices do not exist


def test_a_local_cluster_stays_on_the_loopback_interface(cluster):
    assert ray._private.worker.global_worker.node.node_ip_address == "127.0.0.1"
    assert all(len(node) > 0 for node, _ in cluster.where().values())


# --- in-graph replication: variables on PS tasks, gradients on workers -------------------------------
def test_in_graph_ps_step_equals_one_process(cluster):
    xs, ys = _data()
    with fj.device("/job:ps/task:0"):
        w = fj.Variable(np.zeros((8, 4), np.float32), name="w_ingraph")

    @fj.jit
    def step(xs, ys):
        grads, losses = [], []
        for i in range(2):
            with fj.device(f"/job:worker/task:{i}"):
                grads.append(fj.grad(_mse)(w.value, xs[i], ys[i]))
                losses.append(_mse(w.value, xs[i], ys[i]))
        with fj.device("/job:ps/task:0"):
            w.assign_sub(0.1 * (grads[0] + grads[1]) / 2)
        return losses[0] + losses[1]

    report = step.lower(xs, ys).as_text("placement")
    assert "/job:worker/task:1/device:cpu:0" in report and "/job:ps/task:0/device:cpu:0->" in report
    assert "(128 bytes)" in report  # each transfer with its bytes

    ref = np.zeros((8, 4), np.float32)
    reference = fj.jit(lambda w, x, y: (fj.grad(_mse)(w, x, y), _mse(w, x, y)))
    for _ in range(4):
        loss = step(xs, ys)
        outs = [reference(ref, xs[i], ys[i]) for i in range(2)]
        np.testing.assert_allclose(loss, outs[0][1] + outs[1][1], rtol=1e-5)
        ref = ref - 0.1 * (outs[0][0] + outs[1][0]) / 2
        np.testing.assert_allclose(w.value, ref, rtol=1e-5, atol=1e-7)  # read from the PS task
    w.assign(np.ones((8, 4), np.float32))  # outside jit: written on the PS task
    np.testing.assert_array_equal(w.numpy(), np.ones((8, 4), np.float32))


def test_variables_sharded_over_the_ps_tasks_by_size(cluster):
    sizes = {"big": (64, 64), "small1": (4,), "mid": (32, 32), "small2": (8,)}
    with cluster.shard_variables():
        variables = {k: fj.Variable(np.ones(shape, np.float32), name=f"shard_{k}") for k, shape in sizes.items()}
    devices = {k: v.device for k, v in variables.items()}
    assert devices == {
        "big": "/job:ps/task:0",
        "small1": "/job:ps/task:1",
        "mid": "/job:ps/task:1",
        "small2": "/job:ps/task:1",
    }

    @fj.jit
    def scale_all():
        for v in variables.values():
            v.assign(v.value * 2.0)

    scale_all()
    report = scale_all.lower().as_text("placement")
    assert "/job:ps/task:0/device:cpu:0" in report and "/job:ps/task:1/device:cpu:0" in report
    assert all(np.all(v.numpy() == 2.0) for v in variables.values())


def test_unconstrained_work_stays_in_this_process(cluster):
    @fj.jit
    def f(xs):
        return fnp.tanh(xs[0] @ xs[1]) + fnp.tanh(xs[1] @ xs[0])  # two independent products

    xs = np.ones((2, 64, 64), np.float32)
    placed = f.lower(xs).graph("placement")
    assert {op.device for op in placed.ops} == {"/job:localhost/task:0/device:cpu:0"}


def test_a_variable_a_task_held_comes_back_for_a_local_program(cluster):
    v = fj.Variable(np.ones(4, np.float32), name="roaming")  # no device: it goes where it is used

    @fj.jit
    def on_worker():
        with fj.device("/job:worker/task:1"):
            v.assign(v.value * 5.0)

    on_worker()  # v now lives in the worker's process
    local = fj.jit(lambda: v.value + 1.0)
    np.testing.assert_array_equal(local(), np.full(4, 6.0, np.float32))  # not the stale 1 + 1
    on_worker()  # and it can move there again
    np.testing.assert_array_equal(v.numpy(), np.full(4, 25.0, np.float32))


def test_values_flow_both_ways_between_driver_and_tasks(cluster):
    """The driver computes, a worker uses it, the driver uses the worker's value again."""

    @fj.jit
    def f(x):
        a = fnp.sin(x) * 2.0  # on the driver
        with fj.device("/job:worker/task:2"):
            b = fnp.tanh(a) + 1.0
        return fnp.exp(b) - a

    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    np.testing.assert_allclose(f(x), np.exp(np.tanh(np.sin(x) * 2) + 1) - np.sin(x) * 2, rtol=1e-5)


def test_large_values_from_other_tasks_are_read_where_they_arrive(cluster):
    """Values of 256 KiB travel through the object store; the driver's partition reads the one
    the worker sends in place (`flowjit_recv_view`, no copy into a workspace slot)."""

    @fj.jit
    def f(x):
        a = x * 2.0  # on the driver
        with fj.device("/job:worker/task:1"):
            b = fnp.tanh(a) + 1.0
        return fnp.sum(b * x, axis=0), a

    x = np.linspace(-1, 1, 256 * 256, dtype=np.float32).reshape(256, 256)
    for _ in range(3):
        total, a = f(x)
        np.testing.assert_allclose(total, np.sum((np.tanh(x * 2) + 1) * x, axis=0), rtol=2e-5, atol=2e-4)
        np.testing.assert_array_equal(a, x * 2.0)
    assert "@flowjit_recv_view" in f.lower(x).as_text("mlir")


def test_a_constraint_naming_a_task_the_cluster_lacks_is_a_placement_error(cluster):
    @fj.jit
    def g(x):
        with fj.device("/job:worker/task:9"):
            return x + 1

    with pytest.raises(FlowjitError, match="no device matches the constraint '/job:worker/task:9'"):
        g(np.ones(3, np.float32))


# --- the Trainer ------------------------------------------------------------------------------------
def _mlp_loss(p, batch):
    x, y = batch
    h = fnp.tanh(x @ p["w1"] + p["b1"])
    return nn.cross_entropy(h @ p["w2"], y)


def _mlp_setup(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": (rng.standard_normal((8, 16)) * 0.3).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.standard_normal((16, 3)) * 0.3).astype(np.float32),
    }
    x = rng.standard_normal((512, 8)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)

    def batches(step, worker):
        i = (step * 3 + worker) % 16
        return x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32]

    return params, batches


def _replay(params, batches, history, lr):
    """The single-process computation of the steps the trainer aggregated."""
    p = {k: v.copy() for k, v in params.items()}
    grad = fj.jit(fj.grad(_mlp_loss))
    for step, workers in enumerate(history.workers):
        gs = [grad(p, batches(step, w)) for w in workers]
        p = {k: p[k] - lr * (sum(g[k] for g in gs) / len(gs)) for k in p}
    return p


def test_sync_with_a_backup_worker_equals_one_process(cluster):
    params, batches = _mlp_setup()
    trainer = fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.5), mode="sync", replicas_to_aggregate=2)
    warm = trainer.fit(batches, steps=2, progress=False)  # every worker compiles: then the pace is even
    history = trainer.fit(batches, steps=8, progress=False, worker_delay={2: 0.5})
    assert history.steps == 8 and all(len(w) == 2 for w in warm.workers + history.workers)
    assert history.dropped > 0 and not any(2 in w for w in history.workers)  # the straggler's are dropped
    warm.workers += history.workers  # the replay: every step, with the workers it aggregated
    expected = _replay(params, batches, warm, 0.5)
    got = trainer.params()
    for k in params:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6)
    assert history.loss[-1] < warm.loss[0]


def test_async_training_converges(cluster):
    params, batches = _mlp_setup(1)
    trainer = fd.Trainer(cluster, _mlp_loss, params, fj.optim.Adam(0.02), mode="async")
    history = trainer.fit(batches, steps=60, progress=False)
    assert history.steps >= 1 and trainer.step == 60
    assert np.mean(history.loss[-5:]) < 0.7 * np.mean(history.loss[:5])


def _embedding_loss(p, batch):
    ids, y = batch
    e = nn.embedding(p["emb"], ids).mean(axis=1)
    return fnp.mean((e @ p["w"] - y) ** 2)


def test_sparse_embedding_updates_equal_dense_ones_and_move_only_touched_rows(cluster):
    rng = np.random.default_rng(3)
    params = {
        "emb": rng.standard_normal((1000, 8)).astype(np.float32),
        "w": rng.standard_normal((8, 2)).astype(np.float32),
    }
    ids = rng.integers(0, 40, (6, 16, 4)).astype(np.int32)  # only rows < 40 are touched
    ys = rng.standard_normal((6, 16, 2)).astype(np.float32)

    def batches(step, worker):
        return ids[(step + worker) % 6], ys[(step + worker) % 6]

    results = {}
    for sparse in ((), ("emb",)):
        trainer = fd.Trainer(cluster, _embedding_loss, params, fj.optim.Adam(0.05), sparse=sparse)
        trainer.fit(batches, steps=5, progress=False)
        results[sparse] = trainer.params()
    for k in params:
        np.testing.assert_allclose(results[("emb",)][k], results[()][k], rtol=1e-5, atol=1e-6)
    # The worker's message for the table carries the touched rows only.
    from flowjit.distributed.trainer import wire_gradient

    grad = fj.jit(fj.grad(_embedding_loss))(params, batches(0, 0))["emb"]
    kind, rows, values = wire_gradient(grad, sparse=True, compress=None)
    assert kind == "rows" and set(rows) == set(np.unique(ids[0])) and values.shape == (len(rows), 8)
    np.testing.assert_array_equal(values, grad[rows])


def test_bf16_transfer_trains_close_to_float32(cluster):
    from flowjit.distributed.trainer import from_bf16, to_bf16

    x = np.array([1.0, 1.00390625, -3.14159, 1e-20, 65504.0], np.float32)
    np.testing.assert_allclose(from_bf16(to_bf16(x)), x, rtol=2**-8)
    params, batches = _mlp_setup(2)
    full = fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.5), replicas_to_aggregate=3)
    half = fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.5), replicas_to_aggregate=3, compress="bf16")
    a = full.fit(batches, steps=10, progress=False)
    b = half.fit(batches, steps=10, progress=False)
    assert abs(a.loss[-1] - b.loss[-1]) < 0.05


def test_trainer_checks_its_arguments(cluster):
    params, _ = _mlp_setup()
    with pytest.raises(FlowjitError, match="replicas_to_aggregate must be between 1 and the 3 workers"):
        fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.1), replicas_to_aggregate=4)
    with pytest.raises(FlowjitError, match="mode must be 'sync' or 'async'"):
        fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.1), mode="hogwild")
    with pytest.raises(FlowjitError, match="sparse parameter 'table' is not a leaf"):
        fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.1), sparse=["table"])
    with pytest.raises(FlowjitError, match="a cluster spec maps job names"):
        fd.Cluster([("ps", 1)])
    with pytest.raises(FlowjitError, match="job 'worker' needs a positive number"):
        fd.Cluster({"worker": 0})


def _broken_loss(p, batch):
    x, y = batch
    return fnp.mean((x @ p["w2"] - y) ** 2)  # w2 is (16, 3): x is (32, 8)


def test_an_error_in_the_loss_reaches_the_driver_with_its_line(cluster):
    params, batches = _mlp_setup()
    trainer = fd.Trainer(cluster, _broken_loss, params, fj.optim.SGD(0.1))
    started = time.monotonic()
    with pytest.raises(FlowjitError, match=r"test_distributed.py:\d+"):
        trainer.fit(batches, steps=2, progress=False)
    assert time.monotonic() - started < 60


def test_checkpoints_are_written_atomically(cluster, tmp_path):
    params, batches = _mlp_setup()
    trainer = fd.Trainer(cluster, _mlp_loss, params, fj.optim.Adam(0.01), replicas_to_aggregate=3)
    history = trainer.fit(batches, steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=3, progress=False)
    assert [os.path.basename(p) for p in history.checkpoints] == ["step-3.fjckpt", "step-6.fjckpt"]
    assert not list(tmp_path.glob("*.tmp"))
    saved = fj.load_checkpoint(history.checkpoints[-1])["shards"]
    assert sum(len(s["params"]) for s in saved) == 3 and all(s["step"] == 6 for s in saved)


# --- failures: kill -9 of a worker and of a PS during training (last: they restart tasks) ------------
def test_killed_worker_is_restarted_and_rejoins(cluster):
    params, batches = _mlp_setup(4)
    trainer = fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.5), replicas_to_aggregate=2)
    victim = cluster.where()["/job:worker/task:1"][1]

    killed = []

    def log(step, metrics):
        if step == 4 and not killed:
            killed.append(os.kill(victim, signal.SIGKILL))

    history = trainer.fit(batches, steps=20, progress=False, log=log)
    assert trainer.step == 20
    assert any("worker /job:worker/task:1 restarted" in r for r in history.recoveries)
    assert cluster.where()["/job:worker/task:1"][1] != victim
    assert np.mean(history.loss[-3:]) < np.mean(history.loss[:3])


def test_killed_ps_is_restored_from_the_last_checkpoint(cluster, tmp_path):
    params, batches = _mlp_setup(5)
    trainer = fd.Trainer(cluster, _mlp_loss, params, fj.optim.SGD(0.5), replicas_to_aggregate=3)
    victim = cluster.where()["/job:ps/task:1"][1]

    killed = []

    def log(step, metrics):
        if step == 7 and not killed:  # after the roll-back to step 5, step 7 comes again
            killed.append(os.kill(victim, signal.SIGKILL))

    started = time.monotonic()
    history = trainer.fit(batches, steps=15, checkpoint_dir=str(tmp_path), checkpoint_every=5, progress=False, log=log)
    assert time.monotonic() - started < 60
    assert trainer.step == 15
    assert any("restored to step 5" in r for r in history.recoveries)
    assert np.mean(history.loss[-3:]) < np.mean(history.loss[:3])


def test_a_step_fails_clearly_when_its_task_dies(cluster):
    @fj.jit
    def f(x):
        with fj.device("/job:worker/task:0"):
            y = fnp.exp(x)
        return y * 2.0

    x = np.ones(4, np.float32)
    np.testing.assert_allclose(f(x), 2 * np.e, rtol=1e-6)
    os.kill(cluster.where()["/job:worker/task:0"][1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(FlowjitError, match="/job:worker/task:0"):
        f(x)  # the process died (or, restarted, lost the program): an error naming the task, no hang
    assert time.monotonic() - started < 60


def _scaled_on_a_worker(x):
    with fj.device("/job:worker/task:0"):
        return x * 3.0


def test_a_function_compiled_for_a_stopped_cluster_runs_on_the_next_one():
    x = np.ones(4, np.float32)
    for _ in range(2):  # jit wrappers of one function share their compiled code
        with fd.Cluster({"worker": 1}):
            np.testing.assert_array_equal(fj.jit(_scaled_on_a_worker)(x), 3 * x)


def test_leaving_the_cluster_leaves_no_process_behind():
    with fd.Cluster({"worker": 1}) as small:  # joins the module's Ray when it runs, else starts one
        pids = [pid for _, pid in small.where().values()]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for good
        return f.read().split()[2] != "Z"
