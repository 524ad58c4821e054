"""Run the benchmark suite: flowjit against numpy, and JAX / PyTorch (eager and torch.compile) when
they are installed. Writes a markdown report (default benchmarks/RESULTS.md).

    python benchmarks/run.py                  # full suite, a few minutes on 2 cores
    python benchmarks/run.py --quick          # fewer repetitions
    python benchmarks/run.py --only softmax --only matmul1024
    python benchmarks/run.py --sizes tiny --peers numpy,flowjit --out /tmp/r.md   # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import harness
import machine
import numpy as np
import peers
from report import WorkloadRun, render
from workloads import WORKLOADS

HERE = Path(__file__).resolve().parent


def parse_args(argv):
    names = [w.name for w in WORKLOADS]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and a shorter time budget per workload")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help=f"run only these: {', '.join(names)}")
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="where to write the report")
    p.add_argument("--peers", default=",".join(peers.available()), help="comma-separated peers to run")
    p.add_argument("--sizes", choices=("full", "tiny"), default="full", help="'tiny' is for smoke tests only")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probe")
    args = p.parse_args(argv)
    only = {n for item in args.only for n in item.split(",") if n}
    unknown = only - set(names)
    if unknown:
        p.error(f"unknown workload(s) {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    args.workloads = [w for w in WORKLOADS if not only or w.name in only]
    args.peer_names = [n for n in args.peers.split(",") if n]
    bad = [n for n in args.peer_names if n not in peers.available()]
    if bad:
        p.error(f"peer(s) {', '.join(bad)} not available here; available: {', '.join(peers.available())}")
    return args


def run_workload(workload, args, policy) -> WorkloadRun:
    size = workload.sizes[args.sizes]
    rng = np.random.default_rng(0)
    inputs = workload.inputs(rng, **size)
    tiny_inputs = workload.inputs(rng, **workload.sizes["tiny"])
    try:
        backend = peers.flowjit_backend(workload, tiny_inputs)
    except harness.Skip:
        backend = None  # the flowjit row says why
    except Exception as e:  # reported in the flowjit row as well; keep going
        backend = f"unknown ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    reference = workload.reference(*inputs)
    print(f"{workload.name}: {workload.title} [{', '.join(f'{k}={v}' for k, v in size.items())}]", flush=True)
    print(f"  flowjit backend: {backend or '(flowjit skipped)'}", flush=True)
    results = harness.run_peers(
        [peers.make_peer(name, workload) for name in args.peer_names], inputs, reference, policy
    )
    for r in results:
        if r.ok:
            print(f"  {r.name:14s} median {r.median_s * 1e3:10.3f} ms  min {r.min_s * 1e3:10.3f} ms", flush=True)
    return WorkloadRun(workload, size, backend, results)


def measure_memory(n: int) -> dict:
    """Run the memory probe in a fresh process, so other peers' allocations do not blur it."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "memory.py"), str(n)], capture_output=True, text=True, timeout=600, cwd=HERE
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    peers.prepare(args.peer_names)
    policy = harness.QUICK if args.quick else harness.FULL
    started = time.perf_counter()
    command = "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    description = machine.describe()
    print("measuring machine limits ...", flush=True)
    if args.sizes == "tiny":
        limits = machine.measure(reps=1, n=2**20, m=256)
    else:
        limits = machine.measure(reps=3 if args.quick else 8)
    startup = peers.warm_up(args.peer_names)
    runs = [run_workload(w, args, policy) for w in args.workloads]
    memory = None
    if not args.no_memory:
        print("measuring peak memory of the elementwise chain ...", flush=True)
        memory = measure_memory(WORKLOADS[0].sizes[args.sizes]["n"])
    mode = (
        f"{'quick' if args.quick else 'full'} (rounds {policy.min_reps}..{policy.max_reps}, "
        f"budget {policy.budget_s} s per workload), sizes {args.sizes}, peers {', '.join(args.peer_names)}; "
        f"total run time {time.perf_counter() - started:.0f} s"
    )
    missing = [n for n in peers.PEER_NAMES if n not in peers.available()]
    text = render(command, date, mode, description, startup, limits, runs, memory, missing)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
