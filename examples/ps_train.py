"""Parameter-server training of the digits MLP on a local Ray cluster: 2 PS tasks, 3 workers.

The parameters are sharded over the two PS tasks, where the optimizer updates them; each worker
computes gradients on its own batches. Training is synchronous with one backup worker: a step
averages the first 2 of the 3 workers' gradients. Worker 2 is made slow on purpose, so its
gradients arrive late and are dropped, and the steps do not wait for it. The same model trained in
one process on the same number of examples per step gives the accuracy to reach.

    python examples/ps_train.py [--steps N] [--slow SECONDS]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from train_digits import BATCH, init_mlp, load_digits, mlp_logits, mlp_loss  # noqa: E402

import flowjit as fj  # noqa: E402
import flowjit.numpy as fnp  # noqa: E402
from flowjit import distributed as fd  # noqa: E402

AGGREGATE = 2  # gradients averaged per step (of 3 workers: one backup)


def loss_fn(params, batch):
    x, y = batch
    return mlp_loss(params, x, y)


def batch_source(x, y, seed=0):
    """`batches(step, worker)`: worker w's batch of step s, the same whichever process asks."""

    def batches(step, worker):
        rng = np.random.default_rng((seed, step, worker))
        idx = rng.choice(len(x), BATCH, replace=False)
        return x[idx], y[idx]

    return batches


def accuracy(params, test) -> float:
    predict = fj.jit(lambda p, x: fnp.argmax(mlp_logits(p, x), axis=1))
    return float(np.mean(predict(params, test[0]) == test[1]))


def train_one_process(params, batches, steps, lr):
    """The reference: each step averages the gradients of workers 0 and 1's batches."""
    opt = fj.optim.Adam(lr)

    @fj.jit
    def step(params, state, xs, ys):
        grads = [fj.grad(loss_fn)(params, (xs[i], ys[i])) for i in range(AGGREGATE)]
        mean = fj.tree_map(lambda *g: sum(g) / AGGREGATE, *grads)
        return opt.update(mean, state, params)

    state = opt.init(params)
    for s in range(steps):
        pairs = [batches(s, w) for w in range(AGGREGATE)]
        params, state = step(params, state, np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))
    return params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--slow", type=float, default=0.2, help="seconds worker 2 straggles per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    (x, y), test = load_digits()
    batches = batch_source(x, y)
    params = init_mlp(fj.random.key(0))

    started = time.perf_counter()
    reference = accuracy(train_one_process(params, batches, args.steps, args.lr), test)
    print(
        f"one process: test accuracy {reference:.2%} after {args.steps} steps ({time.perf_counter() - started:.1f} s)"
    )

    started = time.perf_counter()
    with fd.Cluster({"ps": 2, "worker": 3}) as cluster:
        tasks = ", ".join(cluster.tasks)
        print(f"cluster of {len(cluster.tasks)} tasks up in {time.perf_counter() - started:.1f} s: {tasks}")
        trainer = fd.Trainer(
            cluster, loss_fn, params, fj.optim.Adam(args.lr), mode="sync", replicas_to_aggregate=AGGREGATE
        )
        for k, names in enumerate(trainer.shards):
            print(f"  /job:ps/task:{k} holds {len(names)} of the {len(trainer.names)} parameter arrays")
        history = trainer.fit(batches, steps=args.steps, worker_delay={2: args.slow})
        distributed = accuracy(trainer.params(), test)
    used = sum(2 in w for w in history.workers)
    print(
        f"2 PS + 3 workers: test accuracy {distributed:.2%} after {history.steps} steps, "
        f"median step {np.median(history.step_time) * 1e3:.1f} ms; the slow worker's gradients: "
        f"{history.dropped} dropped, {used} used"
    )
    return {"one_process": reference, "distributed": distributed, "dropped": history.dropped, "slow_used": used}


if __name__ == "__main__":
    main()
