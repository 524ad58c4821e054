"""Run flowjit's first call of each workload in a fresh process, before the suite trusts it in-process.

A compiler bug can abort the process (an MLIR assertion, a crash in generated code); that must cost
one flowjit row, not the whole report. run.py calls `python benchmarks/preflight.py SIZES NAME...`,
which prints one JSON line per workload as it finishes it: the backend named in the optimized stage's
header (lowered on the tiny inputs, because the stage text prints constants in full), and the error
if lowering or the first call on SIZES raised. A workload that kills the process prints nothing;
run.py then starts a new process for the workloads after it.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from harness import Skip, short_error
from workloads import WORKLOADS


def check(workload, sizes: str) -> dict:
    """{"backend": ...}, plus "error" when lowering or the first call raised."""
    tiny = workload.inputs(np.random.default_rng(0), **workload.sizes["tiny"])
    try:
        lowered = workload.flowjit().lower(*tiny)
        header = lowered.as_text("optimized").splitlines()
    except Skip as e:
        return {"skip": str(e)}
    except Exception as e:
        return {"backend": f"unknown (lowering on the tiny inputs failed: {short_error(e)})", "error": short_error(e)}
    lines = [line.removeprefix("// backend:").strip() for line in header if line.startswith("// backend:")]
    backend = lines[0] if lines else "unknown (no backend line in the optimized stage header)"
    try:
        if sizes == "tiny":
            lowered.compile()(*tiny)
        else:
            workload.flowjit()(*workload.inputs(np.random.default_rng(0), **workload.sizes[sizes]))
    except Exception as e:
        return {"backend": backend, "error": short_error(e)}
    return {"backend": backend}


def main(sizes: str, names: list[str]) -> None:
    by_name = {w.name: w for w in WORKLOADS}
    for name in names:
        print(json.dumps({"name": name, **check(by_name[name], sizes)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
