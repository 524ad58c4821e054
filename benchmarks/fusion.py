"""Fused vs unfused vs numpy: the elementwise chain (16M f32), row softmax and layer norm
(4096x1024 f32), plus the peak memory of one call of the chain, fused and unfused.

    .venv/bin/python benchmarks/fusion.py [--repeat N] [--scale S]

"unfused" compiles the same optimized graph without the `fuse` pass (one kernel per op, planned
workspace); "fused" is what `fj.jit` runs. Prints a Markdown table (median milliseconds, wall
and CPU time, over N interleaved calls after one warm-up call) and the memory line;
docs/cpu-fusion.md describes the fusion it measures.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory import peak_of  # noqa: E402

import flowjit as fj  # noqa: E402
import flowjit.nn as nn  # noqa: E402
import flowjit.numpy as fnp  # noqa: E402
from flowjit.backends import compile_graph  # noqa: E402
from flowjit.ir.parser import parse_graph  # noqa: E402
from flowjit.ir.printer import print_graph  # noqa: E402
from flowjit.passes.fuse import kernel_count  # noqa: E402
from flowjit.passes.registry import run_pipeline  # noqa: E402


def chain(x):
    return fnp.tanh(x * 0.7 + 0.1) * nn.sigmoid(x) + 0.5 * x


def chain_np(x):
    return np.tanh(x * 0.7 + 0.1) * (1 / (1 + np.exp(-x))) + 0.5 * x


def softmax(x):
    return nn.softmax(x, axis=-1)


def softmax_np(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layernorm(x, g, b):
    mean = fnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = fnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered / fnp.sqrt(var + 1e-5) * g + b


def layernorm_np(x, g, b):
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(axis=-1, keepdims=True)
    return centered / np.sqrt(var + 1e-5) * g + b


def mlp_loss(params, x, labels):
    w1, b1, w2, b2, w3, b3 = params
    h = nn.relu(x @ w1 + b1)
    h = nn.relu(h @ w2 + b2)
    return nn.cross_entropy(h @ w3 + b3, labels)


def mlp_grad(*flat):
    *params, x, labels = flat
    return fj.grad(mlp_loss)(tuple(params), x, labels)


def mlp_grad_np(*flat):
    """The same gradient by hand in numpy (the reference the MLP row's numpy column times)."""
    w1, b1, w2, b2, w3, b3, x, labels = flat
    h1 = np.maximum(x @ w1 + b1, 0)
    h2 = np.maximum(h1 @ w2 + b2, 0)
    logits = h2 @ w3 + b3
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1
    g3 = p / len(labels)
    g2 = (g3 @ w3.T) * (h2 > 0)
    g1 = (g2 @ w2.T) * (h1 > 0)
    return x.T @ g1, g1.sum(0), h1.T @ g2, g2.sum(0), h2.T @ g3, g3.sum(0)


def compiled(fn, args, fuse: bool):
    graph = parse_graph(print_graph(fj.jit(fn).lower(*args).graph("traced")))
    graph = run_pipeline(graph, ["canonicalize", "fuse"] if fuse else ["canonicalize"])
    return compile_graph(graph, "cpu"), kernel_count(graph)


def median_ms(calls: dict, repeat: int, clock=time.perf_counter) -> dict[str, float]:
    """Median milliseconds of each call, measured interleaved (load on a shared machine hits all
    alike), after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeat):
        for name, call in calls.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--scale", type=int, default=1, help="divide the sizes by this (smoke runs)")
    opts = parser.parse_args()
    rng = np.random.default_rng(0)
    n, rows = (1 << 24) // opts.scale, 4096 // opts.scale
    x = rng.standard_normal(n).astype(np.float32)
    m = rng.standard_normal((rows, 1024)).astype(np.float32)
    g, b = rng.standard_normal(1024).astype(np.float32), rng.standard_normal(1024).astype(np.float32)
    shapes = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
    mlp = [(rng.standard_normal(shape) * 0.03).astype(np.float32) for shape in shapes]
    mlp += [rng.standard_normal((256, 784)).astype(np.float32), rng.integers(0, 10, 256)]
    workloads = [
        ("elementwise chain, 16M f32", chain, chain_np, (x,)),
        ("softmax 4096x1024", softmax, softmax_np, (m,)),
        ("layernorm 4096x1024", layernorm, layernorm_np, (m, g, b)),
        ("MLP 784-1024-1024-10 gradient, batch 256", mlp_grad, mlp_grad_np, tuple(mlp)),
    ]
    print("ms, wall / CPU time (median); (kernels)")
    print("| workload | fused (kernels) | unfused (kernels) | numpy | max abs diff fused vs unfused |")
    print("|---|---|---|---|---|")
    executables = {}
    for name, fn, ref, args in workloads:
        fused, fused_kernels = compiled(fn, args, True)
        unfused, unfused_kernels = compiled(fn, args, False)
        executables[name] = (fused, unfused)
        fused_out, unfused_out = fused.run(list(args)), unfused.run(list(args))
        diff = max(float(np.max(np.abs(a - c))) for a, c in zip(fused_out, unfused_out))
        # numpy runs on its own: its BLAS threads keep spinning after a call and would slow the
        # OpenMP threads of whichever flowjit call comes next.
        wall, cpu = {}, {}
        for calls in (
            {"fused": functools.partial(fused.run, list(args)), "unfused": functools.partial(unfused.run, list(args))},
            {"numpy": functools.partial(ref, *args)},
        ):
            wall.update(median_ms(calls, opts.repeat))
            cpu.update(median_ms(calls, opts.repeat, time.process_time))
        cells = [f"{wall[k]:.1f} / {cpu[k]:.1f}" for k in ("fused", "unfused", "numpy")]
        print(f"| {name} | {cells[0]} ({fused_kernels}) | {cells[1]} ({unfused_kernels}) | {cells[2]} | {diff:.1e} |")
    fused, unfused = executables[workloads[0][0]]
    mib = x.nbytes / 2**20
    for label, exe in (("fused", fused), ("unfused", unfused)):
        peak = peak_of(lambda exe=exe: exe.run([x]))
        print(
            f"peak extra memory of one chain call, {label}: RSS +{peak['rss_peak_delta_mib']:.0f} MiB, "
            f"numpy-allocated +{peak['tracemalloc_peak_mib']:.0f} MiB (input {mib:.0f} MiB, output {mib:.0f} MiB); "
            f"planned workspace {exe.workspace_bytes / 2**20:.0f} MiB (allocated on the first call, then reused)"
        )


if __name__ == "__main__":
    main()
