"""Is a memory-bound workload held back by memory or by compute? `python benchmarks/bound.py [NAME...]`.

For each named workload whose machine limit is memory bandwidth (default: all of `SCALES`), runs
flowjit back to back (no pause) on the full size and on sizes scaled down until the data stays in
cache, and prints the time per element next to the traffic limit's (compulsory bytes per element
over the measured bandwidth, `machine.measure`). A time per element well above the limit even on
cache-resident data means the kernel is compute-bound there: memory is not what it waits for.
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("FLOWJIT_CACHE", "0")

import numpy as np
from machine import measure
from workloads import WORKLOADS

# How each workload's full size is scaled down: the size key and the factors applied to it.
SCALES = {
    "elementwise": ("n", (1 / 256, 1 / 64, 1 / 16, 1)),
    "softmax": ("rows", (1 / 64, 1 / 16, 1 / 4, 1)),
    "layernorm": ("rows", (1 / 64, 1 / 16, 1 / 4, 1)),
}


def _best_per_call(fn, inputs, budget_s: float = 0.3) -> float:
    fn(*inputs)
    start = time.perf_counter()
    fn(*inputs)
    once = time.perf_counter() - start
    reps = max(1, int(budget_s / 7 / max(once, 1e-6)))
    best = math.inf
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*inputs)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(SCALES), help=f"workloads (of {', '.join(SCALES)})")
    args = parser.parse_args(argv)
    bandwidth = measure(reps=4).bandwidth_gbs
    print(f"memory bandwidth {bandwidth:.3g} GB/s (best of numpy copy/triad, machine.measure)")
    for workload in WORKLOADS:
        if workload.name not in args.names:
            continue
        key, factors = SCALES[workload.name]
        full = workload.sizes["full"]
        elements_per_unit = math.prod(v for k, v in full.items() if k != key)
        for factor in factors:
            size = {**full, key: max(1, int(full[key] * factor))}
            inputs = workload.inputs(np.random.default_rng(0), **size)
            seconds = _best_per_call(workload.flowjit(), inputs)
            elements = size[key] * elements_per_unit
            traffic = workload.traffic_bytes(**size)
            limit_ns = traffic / elements / bandwidth
            print(
                f"{workload.name:12s} {key}={size[key]:9d}  {traffic / 2**20:7.1f} MiB moved  "
                f"{seconds * 1e3:8.3f} ms  {seconds / elements * 1e9:.3f} ns/element  "
                f"(traffic limit {limit_ns:.3f} ns/element: {limit_ns / (seconds / elements * 1e9):.0%})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
