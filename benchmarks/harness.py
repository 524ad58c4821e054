"""Timing and checking of peers on one workload: first call, interleaved steady state, error.

A *peer* is one implementation of a workload (numpy, flowjit, jax, torch, torch.compile). Every peer
is timed in the same process, in rounds, so that machine noise (other jobs on the 2 shared cores,
frequency changes) hits all of them alike instead of whichever happened to run during the noise.

Peers disturb each other too: after a call, a library's worker threads keep spinning for a while
(OpenBLAS about 0.1 s, Intel OpenMP's KMP_BLOCKTIME 0.2 s), taking the cores from the next peer; on
the suite's 2-core AMD EPYC Zen 4 VM numpy's BLAS spinning doubles the time of a flowjit call right
after it. So each round runs the peers in a fresh random order (no peer always follows the same
one), and a sample starts only after a pause of `settle_s`, long enough for the previous peer's
threads to go to sleep.

The pause also puts the timed peer's own threads to sleep, and on a VM a sleeping core takes
milliseconds to wake: the call right after it runs a threaded kernel at about one core's speed
(JAX's and PyTorch's threaded calls alike), and so do a few calls more. Timed that way every sample
would measure waking from idle, not the steady state of a program that calls its function in a
loop. So after each pause one call runs first, timed on its own (`after_pause_s`, reported next to
the steady state), then calls for `warm_s` more, untimed, and only then the sample (`samples_s`),
which brings the medians close to the minima.

First calls are the median of `first_calls` fresh functions per peer (3 in full and quick runs),
taken in rounds of one per peer in a rotated order: a single first call after a pause moves by up
to half its value from run to run on a VM, and a slow phase of the machine would fall on whichever
peer it met.

Peers also leave garbage: torch.compile's graphs and tensors sit in reference cycles that only
Python's cyclic collector frees, and it runs inside whichever call next allocates enough, freeing
another peer's tensors on that peer's clock (a flowjit first call whose compile triggers the
collection of torch.compile's garbage takes several times as long). So garbage is collected before
every first call and once before the steady state, outside the timing. Not before every sample:
freeing memory there makes the next big output land on fresh pages, which a VM faults in slowly.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


class Skip(Exception):
    """Raised by a peer's factory when that peer cannot run this workload (the message says why)."""


class Failed(Exception):
    """Raised by a peer's factory when that peer is known to fail (the message says how)."""


@dataclass
class Peer:
    """How to run one implementation: build a fresh function, convert inputs in and outputs out."""

    name: str
    make: Callable[[], Callable]  # a fresh function object each call, so its first call compiles
    to_native: Callable[[np.ndarray], object] = lambda a: a
    to_numpy: Callable[[object], np.ndarray] = np.asarray
    block: Callable[[object], object] = lambda out: out  # wait for asynchronous results (JAX)


@dataclass
class PeerResult:
    """What was measured for one peer on one workload."""

    name: str
    status: str = "ok"  # "ok", "skipped: ...", or "failed: ..."
    first_call_s: float = math.nan  # the median of `first_calls_s`
    first_calls_s: list[float] = field(default_factory=list)  # fresh functions' first calls, in order
    samples_s: list[float] = field(default_factory=list)
    after_pause_s: list[float] = field(default_factory=list)  # the call after each settling pause
    inner: int = 1  # calls per timed sample (tiny workloads repeat to get above timer noise)
    max_abs_err: float = math.nan
    rel_err: float = math.nan
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.samples_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s) if self.samples_s else math.nan

    @property
    def min_s(self) -> float:
        return min(self.samples_s) if self.samples_s else math.nan

    @property
    def after_pause_median_s(self) -> float:
        return statistics.median(self.after_pause_s) if self.after_pause_s else math.nan


@dataclass(frozen=True)
class TimingPolicy:
    """How long to measure: at least `min_reps` rounds, then stop at `max_reps` or after `budget_s`."""

    name: str
    min_reps: int
    max_reps: int
    budget_s: float
    min_sample_s: float  # a sample repeats the call until it lasts at least this long
    settle_s: float  # pause before each sample, for the previous peer's spinning threads to sleep
    # (then one call, timed apart from the sample: see the module docstring)
    warm_s: float = 0.0  # untimed calls for this long after that one, before the sample
    first_calls: int = 1  # fresh functions per peer whose first calls are timed (the median is reported)


FULL = TimingPolicy(
    "full", min_reps=5, max_reps=25, budget_s=14.0, min_sample_s=0.005, settle_s=0.25, warm_s=0.05, first_calls=3
)
QUICK = TimingPolicy(
    "quick", min_reps=3, max_reps=8, budget_s=4.0, min_sample_s=0.002, settle_s=0.25, warm_s=0.02, first_calls=3
)
SMOKE = TimingPolicy("smoke", min_reps=2, max_reps=3, budget_s=0.5, min_sample_s=0.001, settle_s=0.0)  # tiny sizes


def run_line(script: str, started: float, load_before: str) -> str:
    """How a standalone script's section was measured: its command, the date, the CPUs, how long it
    ran, and the machine's load before and after (other jobs shift every timing)."""
    import datetime
    import os
    import shlex
    import sys

    from machine import load_average

    command = "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{script}", *sys.argv[1:]])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"`{command}`, {date}, {os.cpu_count()} CPUs, {time.perf_counter() - started:.0f} s in all, load average "
        f"(1/5/15 min) before / after {load_before} / {load_average()}."
    )


def call_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall-clock seconds of `repeats` calls of `fn`, after one untimed call (it compiles and
    warms up). The standalone scripts take the minimum (least disturbed by other jobs) or the
    median of these."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _leaves(out) -> list:
    if isinstance(out, tuple | list):
        return [leaf for item in out for leaf in _leaves(item)]
    if isinstance(out, dict):
        return [leaf for key in sorted(out) for leaf in _leaves(out[key])]
    return [out]


def compare(out: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> tuple[float, float]:
    """(max abs error, that error relative to the largest reference magnitude) over all leaves."""
    if len(out) != len(reference):
        raise ValueError(f"{len(out)} outputs, reference has {len(reference)}")
    err, scale = 0.0, 0.0
    for got, want in zip(out, reference):
        got = np.asarray(got, np.float64)
        want = np.asarray(want, np.float64)
        if got.shape != want.shape:
            raise ValueError(f"output shape {got.shape}, reference shape {want.shape}")
        err = max(err, float(np.max(np.abs(got - want), initial=0.0)))
        scale = max(scale, float(np.max(np.abs(want), initial=0.0)))
    return err, err / scale if scale else err


def short_error(e: BaseException) -> str:
    """`Type: first line of the message`: compiler errors can carry whole IR dumps."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first[:160]}"


def run_peers(
    peers: Sequence[Peer], inputs: Sequence[np.ndarray], reference, policy: TimingPolicy, log=print
) -> list[PeerResult]:
    """First calls of fresh functions per peer (timed, the first one checked against `reference`),
    then interleaved steady-state timing of all peers that worked."""
    reference = [np.asarray(r) for r in _leaves(reference)]
    results = [PeerResult(peer.name) for peer in peers]
    pairs, calls = list(zip(peers, results)), {}
    for round_ in range(policy.first_calls if pairs else 0):
        # Alternated: each round runs every peer once, in a rotated order, so that a slow phase of
        # the machine does not fall on one peer's first calls only.
        shift = round_ % len(pairs)
        for peer, result in pairs[shift:] + pairs[:shift]:
            if result.status != "ok":
                continue
            _first_call(peer, result, inputs, reference, policy, calls, log)
    by_name = {r.name: r for r in results}
    for result in results:
        if result.status == "ok" and result.first_calls_s:
            result.first_call_s = statistics.median(result.first_calls_s)
            times = " ".join(f"{t:.4f}" for t in result.first_calls_s)
            log(f"  {result.name:14s} first call {result.first_call_s:9.4f} s (median of {times})")
    gc.collect()  # the first calls' garbage, before the steady state
    for name, call in calls.items():
        by_name[name].inner = _calibrate(call, policy.min_sample_s)
    _interleave(calls, by_name, policy)
    return results


def _first_call(peer: Peer, result: PeerResult, inputs, reference, policy: TimingPolicy, calls: dict, log) -> None:
    """One first call of a fresh function of `peer` (`result.first_calls_s`); the first one's output is
    checked and its function kept for the steady state (`calls`). A peer that cannot run or breaks
    gets its status, never fatal to the suite."""
    try:
        fn = peer.make()
        args = [peer.to_native(a) for a in inputs]
        gc.collect()
        time.sleep(policy.settle_s)
        start = time.perf_counter()
        out = peer.block(fn(*args))
        result.first_calls_s.append(time.perf_counter() - start)
        if peer.name not in calls:
            result.max_abs_err, result.rel_err = compare([peer.to_numpy(o) for o in _leaves(out)], reference)
            calls[peer.name] = _bind_call(fn, args, peer.block)
            log(f"  {peer.name:14s} max abs err {result.max_abs_err:.3g}")
    except Skip as e:
        result.status = f"skipped: {e}"
    except Failed as e:
        result.status = f"failed: {e}"
    except Exception as e:  # a peer that breaks is reported, never fatal to the suite
        result.status = f"failed: {short_error(e)}"
    if result.status != "ok":
        calls.pop(peer.name, None)
        log(f"  {peer.name:14s} {result.status}")


def _bind_call(fn, args, block):
    return lambda: block(fn(*args))


def _calibrate(call, min_sample_s: float) -> int:
    """Calls per sample so that one sample lasts at least `min_sample_s`, from the fastest of a few
    calls (at least 3, for at least `CALIBRATION_S`; a warm-up too). From one call, right after the
    first calls and a collection, threaded peers would measure waking their threads (a call of
    under a millisecond can take ten times as long), and samples of a single call would have medians
    well above the minimum, where samples of many calls average the steady loop."""
    times: list[float] = []
    deadline = time.perf_counter() + CALIBRATION_S
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        if len(times) >= 2 and min(times) >= min_sample_s:
            return 1  # a slow workload: two calls tell
    return min(100_000, math.ceil(min_sample_s / max(min(times), 1e-7)))


CALIBRATION_S = 0.02


def _interleave(calls: dict, results: dict[str, PeerResult], policy: TimingPolicy) -> None:
    """Rounds of one sample per peer, in a fresh random order each round, each after a settling pause
    and one call timed apart (`PeerResult.after_pause_s`)."""
    names = list(calls)
    if not names:
        return
    order = random.Random(0)
    start = time.perf_counter()
    for rep in range(policy.max_reps):
        if rep >= policy.min_reps and time.perf_counter() - start > policy.budget_s:
            break
        for name in order.sample(names, len(names)):
            call, inner = calls[name], results[name].inner
            time.sleep(policy.settle_s)
            t0 = time.perf_counter()
            call()
            results[name].after_pause_s.append(time.perf_counter() - t0)
            warm_until = time.perf_counter() + policy.warm_s
            while time.perf_counter() < warm_until:
                call()
            t0 = time.perf_counter()
            for _ in range(inner):
                call()
            results[name].samples_s.append((time.perf_counter() - t0) / inner)
