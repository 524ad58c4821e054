"""Where flowjit's first call of each workload goes: `python benchmarks/compile_time.py [--reps N] [NAME...]`.

For each workload (all by default), N fresh function objects (`FLOWJIT_CACHE=0`) are called once, after
one warm-up compile in this process (as the suite's first calls are timed after flowjit's start-up).
Printed per workload, each the minimum over the N first calls:
- `first`: the first call's wall time (trace + compile + run);
- the CPU time of the process in each compile phase: `lower` (flowjit IR -> MLIR text), `mlir`
  (transform schedule, MLIR pipelines, translation to LLVM IR; summed over the processes that lower
  a split function's parts, `parallel_mlir`), `llvm-opt` (llvmlite O3, or the light pass list:
  `compiler.light_pipeline`) and `codegen` (machine code), the last two summed over the threads
  that compile a large module in parts (`parallel_codegen`). CPU time, unlike wall time, hardly
  moves when other jobs share the cores;
- `mlir-wall` and `mlir-parts`: the MLIR phase's wall time and how many processes ran it;
- `llvm-wall`: the wall time of the two LLVM phases (less than their CPU time when split);
- `parts`: how many parts LLVM compiled in parallel (in the "llvm" stage, which is lowered whole);
- `lines`: the size of the optimized LLVM IR, which the two LLVM phases scale with.
docs/cpu-compile-time.md says what the phases are and what keeps them short.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

os.environ["FLOWJIT_CACHE"] = "0"  # a cache hit would skip every phase measured here

import numpy as np
from harness import Skip
from workloads import WORKLOADS

import flowjit as fj
from flowjit.backends.cpu import compiler, parallel_codegen, parallel_mlir, toolchain

PHASES = [("lower", compiler, "generate_mlir"), ("mlir", parallel_mlir, "lower_parts")]
PHASES += [("llvm-opt", toolchain, "optimize"), ("llvm-opt", parallel_codegen, "optimize_parts")]
PHASES += [("codegen", toolchain, "jit_compile"), ("codegen", parallel_codegen, "emit_objects")]
PHASES += [("codegen", toolchain, "load_objects")]


def instrument(spent: dict[str, float]) -> None:
    """Wrap each phase's functions so that they add their CPU time (this process's and its finished
    children's: the MLIR parts of a split function) to `spent[phase]`, the MLIR and LLVM phases their
    wall time to `spent["mlir-wall"]` and `spent["llvm-wall"]`, and the MLIR phase its number of
    parts to `spent["mlir-parts"]`."""
    for phase, module, name in PHASES:
        original = getattr(module, name)

        def timed(*args, _original=original, _phase=phase, **kwargs):
            start, wall = _cpu(), time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_phase] = spent.get(_phase, 0.0) + _cpu() - start
                if _phase in ("mlir", "llvm-opt", "codegen"):
                    key = "mlir-wall" if _phase == "mlir" else "llvm-wall"
                    spent[key] = spent.get(key, 0.0) + time.perf_counter() - wall
                if _phase == "mlir":
                    spent["mlir-parts"] = len(args[0])

        setattr(module, name, timed)


def _cpu() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="workloads (default: all)")
    parser.add_argument("--reps", type=int, default=3, help="fresh functions per workload (minimum reported)")
    args = parser.parse_args(argv)
    spent: dict[str, float] = {}
    instrument(spent)
    fj.jit(lambda x: x * 2)(np.ones(4, np.float32))
    header = f"{'workload':15s} {'first':>8s} {'lower':>7s} {'mlir':>7s} {'mlir-wall':>9s} {'mlir-parts':>5s}"
    print(f"{header} {'llvm-opt':>8s} {'codegen':>8s} {'llvm-wall':>9s} {'parts':>5s} {'lines':>6s}")
    for workload in WORKLOADS:
        if args.names and workload.name not in args.names:
            continue
        inputs = workload.inputs(np.random.default_rng(0), **workload.sizes["full"])
        best: dict[str, float] = {}
        try:
            for _ in range(args.reps):
                spent.clear()
                fn = workload.flowjit()
                start = time.perf_counter()
                fn(*inputs)
                spent["first"] = time.perf_counter() - start
                for phase, seconds in spent.items():
                    best[phase] = min(best.get(phase, seconds), seconds)
        except Skip as e:
            print(f"{workload.name:15s} skipped: {e}")
            continue
        llvm = fn.lower(*inputs).as_text("llvm")
        parts = max(1, llvm.count("; ---- part "))
        phases = ("first", "lower", "mlir", "mlir-wall", "llvm-opt", "codegen", "llvm-wall")
        ms = [best.get(p, 0.0) * 1e3 for p in phases]
        row = f"{ms[0]:8.0f} {ms[1]:7.1f} {ms[2]:7.1f} {ms[3]:9.1f} {int(best.get('mlir-parts', 1)):5d} "
        row += f"{ms[4]:8.1f} {ms[5]:8.1f} {ms[6]:9.1f} {parts:5d} {llvm.count(chr(10)):6d}"
        print(f"{workload.name:15s} {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
