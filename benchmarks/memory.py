"""Peak memory of one call of the elementwise chain, measured in a fresh process.

Run by run.py as `python benchmarks/memory.py N`; prints one JSON object. Two views of the peak:
tracemalloc sees every numpy-allocated buffer (flowjit's host buffers are numpy arrays); the RSS
high-water mark (reset through /proc/self/clear_refs) also sees native allocations that bypass it.
"""

from __future__ import annotations

import json
import sys
import time
import tracemalloc

import numpy as np

MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size to the current one
        return True
    except OSError:
        return False


def peak_of(call) -> dict[str, float]:
    """Extra memory (MiB above what was live before) at the peak of `call()`."""
    can_reset = _reset_rss_peak()
    rss_before = _status_kib("VmRSS")
    tracemalloc.start()
    start = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_peak = _status_kib("VmHWM") if can_reset else float("nan")
    del out
    return {
        "tracemalloc_peak_mib": traced_peak / MIB,
        "rss_peak_delta_mib": (rss_peak - rss_before) / 1024,
        "seconds": seconds,
    }


def main(n: int) -> dict:
    from workloads import Elementwise

    workload = Elementwise()
    x = workload.inputs(np.random.default_rng(0), n)[0]
    f = workload.flowjit()
    report = {"n": n, "inputs_plus_output_mib": 2 * x.nbytes / MIB}
    report["numpy"] = peak_of(lambda: workload.numpy(x))
    report["flowjit_first_call"] = peak_of(lambda: f(x))
    report["flowjit_steady"] = peak_of(lambda: f(x))
    return report


if __name__ == "__main__":
    try:
        result = main(int(sys.argv[1]))
    except Exception as e:  # reported in RESULTS.md instead of a traceback
        from harness import short_error

        result = {"error": short_error(e)}
    print(json.dumps(result))
