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
import os
import shlex
import signal
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
    p.add_argument("--no-loop-grad", action="store_true", help="skip the LSTM gradient through loops (loop_grad.py)")
    p.add_argument("--no-vmap", action="store_true", help="skip per-example gradients (per_example_grads.py)")
    p.add_argument("--no-donation", action="store_true", help="skip the donated updates (donation.py)")
    p.add_argument("--no-distributed", action="store_true", help="skip the distributed runtime's costs (Ray)")
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


def run_workload(workload, args, policy, backend: str | None, crash: str | None) -> WorkloadRun:
    size = workload.sizes[args.sizes]
    print(f"{workload.name}: {workload.title} [{', '.join(f'{k}={v}' for k, v in size.items())}]", flush=True)
    print(f"  flowjit backend: {backend or '—'}", flush=True)
    inputs = workload.inputs(np.random.default_rng(0), **size)
    reference = workload.reference(*inputs)
    peer_list = [peers.make_peer(name, workload) for name in args.peer_names]
    if crash:
        peer_list = [harness.Peer("flowjit", make=_raiser(crash)) if p.name == "flowjit" else p for p in peer_list]
    results = harness.run_peers(peer_list, inputs, reference, policy)
    for r in results:
        if r.ok:
            print(f"  {r.name:14s} median {r.median_s * 1e3:10.3f} ms  min {r.min_s * 1e3:10.3f} ms", flush=True)
    return WorkloadRun(workload, size, backend, results)


def _raiser(message: str):
    def make():
        raise harness.Failed(message)

    return make


def _how_it_died(returncode: int, stderr: str) -> str:
    last = (stderr.strip().splitlines() or [""])[-1][:200]
    how = f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit {returncode}"
    return f"{how}: {last}" if last else how


def preflight(workloads, sizes: str) -> dict[str, tuple[str | None, str | None]]:
    """name -> (flowjit's backend, None), or (None, how flowjit crashed the process) for a workload whose
    first call killed a fresh process: that would take the whole suite down, so flowjit sits it out.
    An exception is left to happen again in-process, where the harness reports it in flowjit's row."""
    pending, out = [w.name for w in workloads], {}
    while pending:
        command = [sys.executable, str(HERE / "preflight.py"), sizes, *pending]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=HERE)
            stdout, died = proc.stdout, None if proc.returncode == 0 else _how_it_died(proc.returncode, proc.stderr)
        except subprocess.TimeoutExpired as e:
            stdout, died = (e.stdout or b"").decode(), "did not finish in 600 s"
        for line in stdout.splitlines():
            if not line.startswith("{"):  # anything else flowjit may print
                continue
            answer = json.loads(line)
            out[answer["name"]] = (answer.get("backend"), None)
        pending = [name for name in pending if name not in out]
        if died is None or not pending:
            break
        out[pending.pop(0)] = (None, f"crashed a fresh process on its first call ({died})")
    return out


def _subprocess(script: str, *args: str) -> tuple[dict | None, str | None]:
    """Run benchmarks/SCRIPT in a fresh process: (its JSON answer, None) or (None, what went wrong)."""
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=600, cwd=HERE
        )
    except subprocess.TimeoutExpired:
        return None, f"{script} did not finish in 600 s"
    if proc.returncode != 0:
        return None, _how_it_died(proc.returncode, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def measure_memory(n: int) -> dict:
    """Run the memory probe in a fresh process, so other peers' allocations do not blur it."""
    answer, error = _subprocess("memory.py", str(n))
    return answer if answer is not None else {"error": error}


def _standalone_section(script: str, title: str, quick: bool) -> str:
    """The Markdown section (from `title` on) that a standalone benchmark script prints, run in a
    fresh process; a short "Not measured" section when it fails or runs over 900 s."""
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / script), *(["--quick"] if quick else [])],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=HERE,
        )
    except subprocess.TimeoutExpired:
        return f"{title}\n\nNot measured: {script} did not finish in 900 s.\n"
    if proc.returncode != 0:
        return f"{title}\n\nNot measured: {_how_it_died(proc.returncode, proc.stderr)}\n"
    return proc.stdout[proc.stdout.index(title) :]


def measure_loop_gradients(quick: bool) -> str:
    """The section of `loop_grad.py`: an LSTM's gradient through fori_loop and scan, against JAX's
    and PyTorch's."""
    print("measuring loop gradients (an LSTM through fori_loop and scan) ...", flush=True)
    return _standalone_section("loop_grad.py", "## Loop gradients (LSTM, benchmarks/loop_grad.py)", quick)


def measure_distributed(quick: bool) -> str:
    """The section of `distributed.py` (Ray on loopback)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "## Distributed (Ray)\n\nNot measured: the `distributed` extra (Ray) is not installed.\n"
    print("measuring the distributed runtime (a local Ray cluster) ...", flush=True)
    return _standalone_section("distributed.py", "## Distributed", quick)


def main(argv=None) -> int:
    args = parse_args(argv)
    # flowjit's on-disk compile cache would turn first calls (and the preflight's compiles) into loads.
    os.environ["FLOWJIT_CACHE"] = "0"
    peers.prepare(args.peer_names)
    policy = harness.SMOKE if args.sizes == "tiny" else harness.QUICK if args.quick else harness.FULL
    started = time.perf_counter()
    command = "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    description = machine.describe()
    load_before, cpu_before = machine.load_average(), machine.cpu_times()
    print("measuring machine limits ...", flush=True)
    if args.sizes == "tiny":
        limits = machine.measure(reps=1, n=2**20, m=256)
    else:
        limits = machine.measure(reps=3 if args.quick else 8)
    startup = peers.warm_up(args.peer_names)
    checked = {}
    if "flowjit" in args.peer_names:
        print("preflight: flowjit's first call of each workload in a fresh process ...", flush=True)
        checked = preflight(args.workloads, args.sizes)
    runs = [run_workload(w, args, policy, *checked.get(w.name, (None, None))) for w in args.workloads]
    memory = None
    if not args.no_memory:
        print("measuring peak memory of the elementwise chain ...", flush=True)
        memory = measure_memory(WORKLOADS[0].sizes[args.sizes]["n"])
    mode = (
        f"{policy.name} (rounds {policy.min_reps}..{policy.max_reps}, "
        f"budget {policy.budget_s} s per workload, {policy.settle_s} s settling pause, one call timed apart "
        f"and {policy.warm_s} s of untimed calls before each sample; first call: the median of "
        f"{policy.first_calls} fresh functions' first calls, peers alternated), "
        f"sizes {args.sizes}, peers {', '.join(args.peer_names)}, "
        "flowjit's on-disk compile cache off (FLOWJIT_CACHE=0); "
        f"total run time {time.perf_counter() - started:.0f} s"
    )
    description["load average (1/5/15 min) before / after"] = f"{load_before} / {machine.load_average()}"
    description["CPU time stolen by the VM host during the run"] = machine.steal_share(cpu_before, machine.cpu_times())
    missing = [n for n in peers.PEER_NAMES if n not in peers.available()]
    text = render(command, date, mode, description, startup, limits, runs, memory, missing)
    if not args.no_loop_grad:
        text += "\n" + measure_loop_gradients(args.quick)
    if not args.no_vmap:
        print("measuring per-example gradients (vmap of grad) ...", flush=True)
        title = "## Per-example gradients (vmap, benchmarks/per_example_grads.py)"
        text += "\n" + _standalone_section("per_example_grads.py", title, args.quick)
    if not args.no_donation:
        print("measuring donated updates (SGD, Adam) ...", flush=True)
        title = "## Donation (SGD and Adam updates, benchmarks/donation.py)"
        text += "\n" + _standalone_section("donation.py", title, args.quick)
    if not args.no_distributed:
        text += "\n" + measure_distributed(args.quick)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
