"""Costs of running across tasks on a local Ray cluster (loopback): transfers, steps, stragglers, recovery.

    python benchmarks/distributed.py [--quick]

1. transfer: a 4 MiB float32 value made on /job:worker/task:0 and reduced on /job:worker/task:1,
   minus the same two-task program with the reduction on task 0, against a bare Ray actor call
   carrying the same numpy array from one actor to another (and waiting for its return): the
   ratio is the target.
2. step overhead: the in-graph parameter-server step of the README (2 workers compute gradients of
   a 256x64 linear model, the PS applies them), across 3 tasks vs the same function in one process;
   the difference, and the bytes that crossed tasks in a step.
3. straggler: fd.Trainer, sync, 3 workers, replicas_to_aggregate=2: the median step with no
   straggler, and with worker 2 made 10x slower than a worker's own step (a sleep).
4. recovery: kill -9 of a worker, then of a PS, during training: seconds from the kill until the
   next step completes.

Times are medians of repeated calls after a warm-up (wall clock); the machine is shared and noisy.
Prints a Markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import numpy as np
from harness import call_times

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flowjit as fj  # noqa: E402
import flowjit.numpy as fnp  # noqa: E402
from flowjit import distributed as fd  # noqa: E402

MIB4 = (1 << 20,)  # float32 elements in 4 MiB


def median_seconds(fn, repeats: int) -> float:
    """The median call."""
    return statistics.median(call_times(fn, repeats))


class Echo:
    """Bare Ray: an actor that forwards an array to a peer actor and waits for the call."""

    def __init__(self):
        self.array = np.ones(MIB4, np.float32)

    def take(self, array):
        return array.nbytes

    def forward(self, peer, repeats):
        import ray

        start = time.perf_counter()
        for _ in range(repeats):
            ray.get(peer.take.remote(self.array))
        return (time.perf_counter() - start) / repeats

    def forward_nothing(self, peer, repeats):
        import ray

        start = time.perf_counter()
        for _ in range(repeats):
            ray.get(peer.take.remote(np.ones(1, np.float32)))
        return (time.perf_counter() - start) / repeats


def transfer(repeats: int) -> dict:
    import ray

    def program(receiver: str):
        """Both programs run on two tasks and return a value from each; only in the first does
        the 4 MiB value cross from one to the other, so their difference is that transfer."""

        @fj.jit
        def f(s):
            with fj.device("/job:worker/task:0"):
                big = fnp.ones(MIB4, fnp.float32) * s
                small = s * 3.0
            with fj.device("/job:worker/task:1"):
                other = s + 1.0
            with fj.device(receiver):
                total = fnp.sum(big)
            return total, small, other

        return f

    s = np.float32(2.0)
    across, local = program("/job:worker/task:1"), program("/job:worker/task:0")
    assert float(across(s)[0]) == float(local(s)[0]) == 2.0 * MIB4[0]
    crossing = median_seconds(lambda: across(s), repeats)
    same = median_seconds(lambda: local(s), repeats)
    echo = ray.remote(Echo)
    a, b = echo.options(num_cpus=0).remote(), echo.options(num_cpus=0).remote()
    ray.get(a.forward.remote(b, 3), timeout=120)
    bare = statistics.median(ray.get([a.forward.remote(b, repeats) for _ in range(3)], timeout=300))
    empty = statistics.median(ray.get([a.forward_nothing.remote(b, repeats) for _ in range(3)], timeout=300))
    for actor in (a, b):
        ray.kill(actor)
    ours = crossing - same
    return {"ours_ms": ours * 1e3, "bare_ms": bare * 1e3, "empty_call_ms": empty * 1e3, "ratio": ours / bare}


def _mse(w, x, y):
    return fnp.mean((x @ w - y) ** 2)


def step_overhead(repeats: int) -> dict:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((2, 128, 256)).astype(np.float32)
    ys = rng.standard_normal((2, 128, 64)).astype(np.float32)

    with fj.device("/job:ps/task:0"):
        w = fj.Variable(np.zeros((256, 64), np.float32), name="bench_w")

    @fj.jit
    def step(xs, ys):
        grads = []
        for i in range(2):
            with fj.device(f"/job:worker/task:{i}"):
                grads.append(fj.grad(_mse)(w.value, xs[i], ys[i]))
        with fj.device("/job:ps/task:0"):
            w.assign_sub(0.01 * (grads[0] + grads[1]) / 2)

    w_local = fj.Variable(np.zeros((256, 64), np.float32), name="bench_w_local")

    @fj.jit
    def local_step(xs, ys):
        grads = [fj.grad(_mse)(w_local.value, xs[i], ys[i]) for i in range(2)]
        w_local.assign_sub(0.01 * (grads[0] + grads[1]) / 2)

    placed = step.lower(xs, ys).graph("placement")
    crossing = sum(t.nbytes for t in placed.transfers if t.src.split("/device")[0] != t.dst.split("/device")[0])
    across = median_seconds(lambda: step(xs, ys), repeats)
    one = median_seconds(lambda: local_step(xs, ys), repeats)
    return {
        "across_ms": across * 1e3,
        "one_process_ms": one * 1e3,
        "bytes": crossing,
        "inputs_bytes": xs.nbytes + ys.nbytes,
    }


def _loss(p, batch):
    x, y = batch
    return fnp.mean((fnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def _trainer_setup():
    rng = np.random.default_rng(1)
    params = {
        "w1": (rng.standard_normal((64, 256)) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((256, 8)) * 0.1).astype(np.float32),
    }
    x = rng.standard_normal((64, 64)).astype(np.float32)
    y = rng.standard_normal((64, 8)).astype(np.float32)
    return params, lambda step, worker: (x, y)


def straggler(cluster, steps: int) -> dict:
    params, batches = _trainer_setup()
    trainer = fd.Trainer(cluster, _loss, params, fj.optim.SGD(0.01), replicas_to_aggregate=2)
    trainer.fit(batches, steps=5, progress=False)  # compile on every worker
    normal = trainer.fit(batches, steps=steps, progress=False)
    worker_s = statistics.median(normal.step_time)
    slow = trainer.fit(batches, steps=steps, progress=False, worker_delay={2: 9 * worker_s})
    base, with_straggler = statistics.median(normal.step_time), statistics.median(slow.step_time)
    return {
        "step_ms": base * 1e3,
        "straggler_step_ms": with_straggler * 1e3,
        "delay_ms": 9 * worker_s * 1e3,
        "ratio": with_straggler / base,
        "dropped": slow.dropped,
    }


def recovery(cluster, task: str, steps: int) -> float:
    params, batches = _trainer_setup()
    trainer = fd.Trainer(cluster, _loss, params, fj.optim.SGD(0.01), replicas_to_aggregate=3)
    trainer.fit(batches, steps=3, progress=False)
    victim = cluster.where()[task][1]
    killed_at: list[float] = []
    recovered: list[float] = []

    def log(step, metrics):
        if step == 5 and not killed_at:
            os.kill(victim, signal.SIGKILL)
            killed_at.append(time.perf_counter())
        elif killed_at and not recovered and step > 5:
            recovered.append(time.perf_counter())

    tmp = os.path.join("/tmp", f"flowjit-bench-ckpt-{os.getpid()}")
    trainer.fit(batches, steps=steps, progress=False, log=log, checkpoint_dir=tmp, checkpoint_every=2)
    return (recovered[0] - killed_at[0]) if recovered else float("nan")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    repeats = 10 if args.quick else 40
    steps = 20 if args.quick else 60
    started = time.perf_counter()
    with fd.Cluster({"ps": 2, "worker": 3}) as cluster:
        t = transfer(repeats)
        s = step_overhead(repeats)
        g = straggler(cluster, steps)
        worker_recovery = recovery(cluster, "/job:worker/task:1", 15)
        ps_recovery = recovery(cluster, "/job:ps/task:0", 15)
    over = s["across_ms"] - s["one_process_ms"]
    rows = [
        (
            "4 MiB cross-task transfer",
            f"{t['ours_ms']:.2f} ms",
            f"bare Ray actor call with the array {t['bare_ms']:.2f} ms (empty call {t['empty_call_ms']:.2f} ms)",
            f"{t['ratio']:.2f}x",
            "<= 1.2x",
        ),
        (
            "in-graph PS step, 3 tasks",
            f"{s['across_ms']:.2f} ms",
            f"one process {s['one_process_ms']:.2f} ms",
            f"+{over:.2f} ms; {s['bytes'] / 1024:.0f} KiB across tasks + {s['inputs_bytes'] / 1024:.0f} KiB of inputs",
            "<= +2 ms + transfers",
        ),
        (
            f"sync step, 1 of 3 workers 10x slower (+{g['delay_ms']:.0f} ms)",
            f"{g['straggler_step_ms']:.2f} ms",
            f"no straggler {g['step_ms']:.2f} ms",
            f"{g['ratio']:.2f}x ({g['dropped']} gradients dropped)",
            "<= 1.3x",
        ),
        ("recovery after kill -9 of a worker", f"{worker_recovery:.1f} s", "", "", "reported"),
        ("recovery after kill -9 of a PS (all shards from the checkpoint)", f"{ps_recovery:.1f} s", "", "", "reported"),
    ]
    command = "python benchmarks/distributed.py" + (" --quick" if args.quick else "")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print("## Distributed (Ray, local loopback cluster: 2 PS + 3 worker tasks)\n")
    print(f"`{command}`, {when}, {os.cpu_count()} CPUs, {time.perf_counter() - started:.0f} s in all. Medians.\n")
    print("| measure | flowjit | reference | ratio | target |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    misses = []
    if t["ratio"] > 1.2:
        misses.append(
            f"- The transfer costs {t['ratio']:.2f}x the bare call (target 1.2x). Like the bare call it puts "
            "the array into the object store (from the sender's buffer); the receiver then copies it into "
            "the partition's buffer, and the receiving task's recv waits for the whole message where the bare "
            "call's receiver starts on it."
        )
    if over > 2.0:
        hops = 4 * t["empty_call_ms"]
        misses.append(
            f"- The in-graph step's overhead is {over:.1f} ms (target 2 ms plus transfers). Its critical path "
            "holds four Ray messages in sequence (driver -> PS run call, PS -> workers, workers -> PS, PS -> "
            f"driver): at this machine's {t['empty_call_ms']:.2f} ms per empty actor call that is {hops:.1f} ms "
            "before any byte moves, and each worker's run call carries the whole inputs (the slice is "
            "taken on the worker) through the object store."
        )
    if g["ratio"] > 1.3:
        misses.append(f"- With the straggler the step takes {g['ratio']:.2f}x (target 1.3x).")
    if misses:
        print("\nTargets missed in this run, by how much and why:\n")
        print("\n".join(misses))


if __name__ == "__main__":
    main()
