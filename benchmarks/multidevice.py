"""Multi-device costs on one host: Send/Recv between CPU devices, and two branches on two devices.

    FLOWJIT_CPU_DEVICES is set by the script (2 devices); run it as
    python benchmarks/multidevice.py [--quick] [--threads-per-device N]

1. rendezvous: one send + recv hand-off between two Python threads (the runtime's floor), and the
   cost of one call of a tiny function on one device vs split over two.
2. transfer: a chain of `hops` elementwise ops alternating between cpu:0 and cpu:1, minus the same
   chain on one device, per hop: microseconds per Send/Recv for a small tensor, GB/s for a large one.
3. branches: two independent matmul chains, pinned to cpu:0 and cpu:1 vs both on cpu:0.
   With OMP_NUM_THREADS unset each device's kernels already use every core, so the two-device
   speedup is bounded by idle cores; `--threads-per-device 1` models one core per device.

Times are the best of repeated calls (wall clock, after a warm-up call that compiles).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np
from harness import call_times

os.environ["FLOWJIT_CPU_DEVICES"] = "2"


def best_seconds(fn, repeats: int) -> float:
    """The fastest call: on a shared machine the minimum is the least noisy estimate."""
    return min(call_times(fn, repeats))


def rendezvous_handoff_us(rounds: int) -> float:
    """Ping-pong between two threads through per-step rendezvous: microseconds per one-way hand-off."""
    from flowjit.runtime.rendezvous import Rendezvous

    value = np.zeros(4, np.float32)
    steps = [Rendezvous(timeout_s=30) for _ in range(rounds)]

    def echo():
        for step in steps:
            step.send("pong", step.recv("ping"))

    thread = threading.Thread(target=echo)
    thread.start()
    start = time.perf_counter()
    for step in steps:
        step.send("ping", value)
        step.recv("pong")
    elapsed = time.perf_counter() - start
    thread.join()
    return elapsed / (2 * rounds) * 1e6


def call_overhead_us(repeats: int) -> tuple[float, float]:
    """(one device, two devices) microseconds per call of `(x + 1) * 2` on 16 floats."""
    import flowjit as fj

    def placed(x):
        with fj.device("cpu:0"):
            a = x + 1.0
        with fj.device("cpu:1"):
            return a * 2.0

    x = np.ones(16, np.float32)
    one, two = fj.jit(lambda x: (x + 1.0) * 2.0), fj.jit(placed)
    return best_seconds(lambda: one(x), repeats) * 1e6, best_seconds(lambda: two(x), repeats) * 1e6


def hop_chain(hops: int, placed: bool):
    import flowjit as fj

    def chain(x):
        for i in range(hops):
            with fj.device(f"cpu:{i % 2 if placed else 0}"):
                x = x * 1.0001 + 1.0
        return x

    return fj.jit(chain)


def transfer_cost(nbytes: int, hops: int, repeats: int) -> tuple[float, float]:
    """(microseconds per hop, GB/s) of a Send/Recv of `nbytes` between cpu:0 and cpu:1."""
    x = np.ones(nbytes // 4, np.float32)
    placed, single = hop_chain(hops, True), hop_chain(hops, False)
    t_placed = best_seconds(lambda: placed(x), repeats)
    t_single = best_seconds(lambda: single(x), repeats)
    per_hop = max(t_placed - t_single, 0.0) / (hops - 1)  # hops - 1 cut edges
    return per_hop * 1e6, (nbytes / per_hop / 1e9) if per_hop > 0 else float("inf")


def branches(n: int, depth: int, repeats: int) -> tuple[float, float]:
    """(seconds on one device, seconds on two devices) for two independent matmul chains."""
    import flowjit as fj
    import flowjit.numpy as fnp

    def make(second: str):
        def f(a, b):
            with fj.device("cpu:0"):
                for _ in range(depth):
                    a = fnp.tanh(a @ a)
            with fj.device(second):
                for _ in range(depth):
                    b = fnp.tanh(b @ b)
            return a.sum() + b.sum()

        return fj.jit(f)

    rng = np.random.default_rng(0)
    a = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    b = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    one, two = make("cpu:0"), make("cpu:1")
    np.testing.assert_allclose(one(a, b), two(a, b), rtol=1e-5)
    return best_seconds(lambda: one(a, b), repeats), best_seconds(lambda: two(a, b), repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller tensors")
    parser.add_argument("--threads-per-device", type=int, default=0, help="set OMP_NUM_THREADS (0: leave it)")
    args = parser.parse_args(argv)
    if args.threads_per_device:
        os.environ["OMP_NUM_THREADS"] = str(args.threads_per_device)
    repeats = 5 if args.quick else 30
    print(f"host: {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"rendezvous hand-off (Python threads): {rendezvous_handoff_us(200 if args.quick else 2000):.1f} us")
    one, two = call_overhead_us(200 if args.quick else 2000)
    print(f"call of a tiny function: one device {one:.1f} us, split over two devices {two:.1f} us")
    sizes = [64, 1 << 20] if args.quick else [64, 1 << 20, 64 << 20]
    for nbytes in sizes:
        us, gbs = transfer_cost(nbytes, hops=16, repeats=repeats)
        print(f"send/recv cpu:0 -> cpu:1, {nbytes:>9} bytes: {us:9.1f} us per transfer, {gbs:6.2f} GB/s")
    n, depth = (256, 2) if args.quick else (768, 4)
    t_one, t_two = branches(n, depth, max(3, repeats // 4))
    print(
        f"two independent branches ({depth} x tanh(x @ x), {n}x{n}): one device {t_one * 1e3:.1f} ms, "
        f"two devices {t_two * 1e3:.1f} ms, speedup {t_one / t_two:.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
