"""The machine: what it is (CPU, ISA, memory, libraries, threads) and what it can do at best
(memory bandwidth, sgemm GFLOP/s), so each workload can be reported as a fraction of its limit."""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from peers import thread_settings, versions

ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, list[str]]:
    """(model name, ISA flags) of the first CPU in /proc/cpuinfo."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields.get("model name", platform.processor() or "unknown"), fields.get("flags", "").split()


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def load_average() -> str:
    """1, 5 and 15 minute load averages: other jobs on the machine shift every timing."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def cpu_times() -> tuple[float, float] | None:
    """(seconds the CPUs ran anything, seconds the hypervisor gave them to other guests: "steal"),
    summed over the CPUs, from /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields[:8]) / ticks, steal / ticks


def steal_share(before: tuple[float, float] | None, after: tuple[float, float] | None) -> str:
    """The share of CPU time between two `cpu_times` readings that a VM's host reports giving to other
    guests (0% on bare metal). It does not catch every slow phase: a run whose sgemm probe finds
    half the usual rate can report 0%, so the machine-limit probes in the same report are the
    better sign of a disturbed run."""
    if before is None or after is None or after[0] <= before[0]:
        return "unknown"
    return f"{100 * (after[1] - before[1]) / (after[0] - before[0]):.1f}%"


def describe() -> dict[str, str]:
    """A flat description of the machine and the software on it."""
    model, flags = _cpuinfo()
    desc = {
        "CPU": model,
        "cores (os.cpu_count)": str(os.cpu_count()),
        "vector ISA": " ".join(f for f in ISA_FLAGS if f in flags) or "(none of the listed)",
        "memory": f"{_memory_gib():.1f} GiB",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
    }
    desc.update({f"{name} version": v for name, v in versions().items()})
    desc.update({f"threads: {k}": v for k, v in thread_settings().items()})
    # OpenBLAS core-type overrides can make numpy's BLAS pick slower kernels; record them.
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        desc[var] = os.environ.get(var, "(unset)")
    desc["numpy BLAS"] = _numpy_blas()
    return desc


def _numpy_blas() -> str:
    try:
        config = np.show_config(mode="dicts")
        blas = config["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except (TypeError, KeyError):
        return "unknown"


@dataclass
class Limits:
    """Best measured memory bandwidth and sgemm throughput, with how each was obtained."""

    bandwidth_gbs: float = 0.0
    sgemm_gflops: float = 0.0
    details: dict[str, float] = field(default_factory=dict)


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(reps: int = 8, n: int = 32 * 2**20, m: int = 2048) -> Limits:
    """Stream copy/triad with numpy (one thread) and torch (all threads) on f32 arrays of `n` elements
    (the default, 128 MiB, is far beyond any cache), sgemm of `m`x`m` with numpy and torch."""
    a = np.ones(n, np.float32)
    b = np.full(n, 2.0, np.float32)
    c = np.empty(n, np.float32)
    limits = Limits()
    # copy moves 2 arrays; triad (c = a + 3*b as two numpy passes) moves 2 + 3. Write-allocate is not counted.
    limits.details["numpy copy GB/s"] = 2 * 4 * n / _best(lambda: np.copyto(c, a), reps) / 1e9
    limits.details["numpy triad GB/s"] = 5 * 4 * n / _best(lambda: _triad(c, a, b), reps) / 1e9
    x = np.random.default_rng(0).standard_normal((m, m), dtype=np.float32)
    limits.details["numpy sgemm GFLOP/s"] = 2 * m**3 / _best(lambda: x @ x, reps) / 1e9
    torch = sys.modules.get("torch")  # only when a torch peer was asked for
    if torch is not None:
        ta, tc, tx = torch.from_numpy(a), torch.from_numpy(c), torch.from_numpy(x)
        limits.details["torch copy GB/s"] = 2 * 4 * n / _best(lambda: tc.copy_(ta), reps) / 1e9
        limits.details["torch sgemm GFLOP/s"] = 2 * m**3 / _best(lambda: tx @ tx, reps) / 1e9
    limits.bandwidth_gbs = max(v for k, v in limits.details.items() if k.endswith("GB/s"))
    limits.sgemm_gflops = max(v for k, v in limits.details.items() if k.endswith("GFLOP/s"))
    return limits


def _triad(c, a, b):
    np.multiply(b, 3.0, out=c)
    np.add(c, a, out=c)
