"""Steady-state calls after an idle pause: `python benchmarks/idle_pause.py [--pause S] [--n N] [--rounds R]`.

The suite's harness sleeps before each sample (`harness.TimingPolicy.settle_s`), so a threaded kernel
starts with its OpenMP worker asleep (flowjit sets `KMP_BLOCKTIME=1` ms). This times an N x N f32
matmul for flowjit and JAX, alternating, each call after `--pause` seconds of sleep (0 = back to
back), and prints wall and process-CPU medians: CPU close to twice the wall time means both cores
worked the whole call; close to the wall time, one core did most of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FLOWJIT_CACHE", "0")

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause", type=float, default=0.25, help="seconds of sleep before each call")
    parser.add_argument("--n", type=int, default=1024, help="matrix size")
    parser.add_argument("--rounds", type=int, default=16, help="calls per peer")
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp

    import flowjit as fj

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((args.n, args.n)).astype(np.float32) for _ in range(2))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    flowjit_fn, jax_fn = fj.jit(lambda a, b: a @ b), jax.jit(lambda a, b: a @ b)
    calls = {"flowjit": lambda: flowjit_fn(a, b), "jax": lambda: jax_fn(ja, jb).block_until_ready()}
    for call in calls.values():
        call()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for i in range(args.rounds):
        for name in calls if i % 2 else reversed(list(calls)):
            time.sleep(args.pause)
            wall, cpu = time.perf_counter(), time.process_time()
            calls[name]()
            samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    for name, values in samples.items():
        wall = statistics.median(v[0] for v in values) * 1e3
        cpu = statistics.median(v[1] for v in values) * 1e3
        print(
            f"pause {args.pause} s  {name:8s} wall median {wall:6.2f} ms  min {min(v[0] for v in values) * 1e3:6.2f}"
            f"  process CPU median {cpu:6.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
