"""Several Ray nodes on one machine (`ray.cluster_utils.Cluster`) stand in for several machines:
each task of a flowjit cluster lands on its own node (its own raylet and object store), so values
between tasks really travel between object stores over TCP."""

from __future__ import annotations

import os

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp

ray = pytest.importorskip("ray", reason="the `distributed` extra (Ray) is not installed")
fd = pytest.importorskip("flowjit.distributed")


@pytest.fixture(scope="module")
def nodes():
    from ray.cluster_utils import Cluster as RayNodes

    from flowjit.distributed.ray_support import LOCAL_ENV

    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        ray.shutdown()
    head = RayNodes(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        head.add_node(num_cpus=1)
    head.wait_for_nodes()
    os.environ["FLOWJIT_RAY_TIMEOUT"] = "60"
    try:
        yield head
    finally:
        os.environ.pop("FLOWJIT_RAY_TIMEOUT", None)
        if ray.is_initialized():
            ray.shutdown()
        head.shutdown()


def _loss(w, x, y):
    return fnp.mean((x @ w - y) ** 2)


def test_tasks_on_three_nodes_train_as_one_process(nodes):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((2, 64, 32)).astype(np.float32)
    ys = rng.standard_normal((2, 64, 8)).astype(np.float32)
    with fd.Cluster({"ps": 1, "worker": 2}, address=nodes.address) as cluster:
        where = cluster.where()
        assert len({node for node, _ in where.values()}) == 3  # one task per node
        with fj.device("/job:ps/task:0"):
            w = fj.Variable(np.zeros((32, 8), np.float32), name="w_multinode")

        @fj.jit
        def step(xs, ys):
            grads = []
            for i in range(2):
                with fj.device(f"/job:worker/task:{i}"):
                    grads.append(fj.grad(_loss)(w.value, xs[i], ys[i]))
            with fj.device("/job:ps/task:0"):
                w.assign_sub(0.1 * (grads[0] + grads[1]) / 2)

        grad = fj.jit(fj.grad(_loss))
        expected = np.zeros((32, 8), np.float32)
        for _ in range(3):
            step(xs, ys)
            expected = expected - 0.1 * (grad(expected, xs[0], ys[0]) + grad(expected, xs[1], ys[1])) / 2
        np.testing.assert_allclose(w.value, expected, rtol=1e-5, atol=1e-7)

        params = {"w": np.zeros((32, 8), np.float32)}
        trainer = fd.Trainer(cluster, lambda p, b: _loss(p["w"], *b), params, fj.optim.SGD(0.1))
        history = trainer.fit(lambda step, i: (xs[i], ys[i]), steps=3, progress=False)
        np.testing.assert_allclose(trainer.params()["w"], expected, rtol=1e-5, atol=1e-7)
        assert history.steps == 3
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-5, atol=1e-7)  # brought back on exit
