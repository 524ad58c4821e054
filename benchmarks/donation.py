"""Donation: a parameter update written into the donated arrays against the same update returning
fresh arrays, and against PyTorch's in-place updates.

    python benchmarks/donation.py [--quick] [--size 10000000]

Two updates of `size` float32 parameters:
- SGD, `p - 0.01 * g`: flowjit jitted without and with `donate_argnums=0`; PyTorch's in-place
  `p.sub_(g, alpha=0.01)` (one pass, no temporary);
- Adam (`flowjit.optim.Adam`), one step jitted without and with the parameters and the optimizer
  state donated; `torch.optim.Adam.step()` with its default (single-tensor) implementation, with
  `foreach=True` and with `fused=True`.
A donated update reads and writes each array once, in place; an undonated one writes fresh
arrays (which flowjit's output recycling takes from the results the caller dropped).

SGD is also timed two more ways, to tell the kernels from the OpenMP runtimes: the donated update
and PyTorch's `sub_` each in processes of its own (`--alone`; in one process flowjit's libiomp5 and
PyTorch's libgomp share the cores), and every implementation on one thread (`--one-thread`, a
process started with OMP_NUM_THREADS=1).

Each implementation first takes one step from the same inputs, checked against numpy. Times are
wall clock on the CPU, after a warm-up call that compiles: `rounds` rounds that time every
implementation in turn (`call_times`), the minimum and the median over all calls. Prints a Markdown
table with each time's ratio to the donated flowjit update.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from harness import call_times, run_line
from machine import load_average

LR = 0.01


def sgd_peers(size: int) -> tuple[dict, np.ndarray]:
    """name -> (one step from fresh inputs -> the new parameters, a timed step), and numpy's step."""
    import torch

    import flowjit as fj

    rng = np.random.default_rng(0)
    p0, g = rng.standard_normal(size, np.float32), rng.standard_normal(size, np.float32)

    def sgd(p, g):
        return p - LR * g

    plain, donated = fj.jit(sgd), fj.jit(sgd, donate_argnums=0)
    p_torch, g_torch = torch.from_numpy(p0.copy()), torch.from_numpy(g)

    def flowjit_timed(jitted):
        carried = [p0.copy()]

        def run():
            carried[0] = jitted(carried[0], g)

        return run

    peers = {
        "flowjit": (lambda: plain(p0.copy(), g), flowjit_timed(plain)),
        "flowjit, donated": (lambda: donated(p0.copy(), g), flowjit_timed(donated)),
        "PyTorch p.sub_(g, alpha=lr)": (
            lambda: torch.from_numpy(p0.copy()).sub_(g_torch, alpha=LR).numpy(),
            lambda: p_torch.sub_(g_torch, alpha=LR),
        ),
    }
    return peers, p0 - np.float32(LR) * g


def adam_peers(size: int) -> tuple[dict, np.ndarray]:
    """name -> (one step from fresh inputs -> the new parameters, a timed step), and numpy's step."""
    import torch

    import flowjit as fj
    from flowjit import optim

    rng = np.random.default_rng(1)
    p0, g = rng.standard_normal(size, np.float32), rng.standard_normal(size, np.float32)
    opt = optim.Adam(LR)

    def step(params, state, grads):
        return opt.update(grads, state, params)

    plain, donated = fj.jit(step), fj.jit(step, donate_argnums=(0, 1))
    grads = {"w": g}

    def flowjit_first(jitted):
        params = {"w": p0.copy()}
        return jitted(params, opt.init(params), grads)[0]["w"]

    def flowjit_timed(jitted):
        params = {"w": p0.copy()}
        carried = [params, opt.init(params)]

        def run():
            carried[:] = jitted(*carried, grads)

        return run

    def torch_step(**kwargs):
        p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        p.grad = torch.from_numpy(g.copy())
        torch_opt = torch.optim.Adam([p], lr=LR, **kwargs)
        return p, torch_opt.step

    def torch_first(**kwargs):
        p, run = torch_step(**kwargs)
        run()
        return p.detach().numpy()

    peers = {
        "flowjit": (lambda: flowjit_first(plain), flowjit_timed(plain)),
        "flowjit, donated": (lambda: flowjit_first(donated), flowjit_timed(donated)),
        **{
            f"torch.optim.Adam{label}": (lambda k=kwargs: torch_first(**k), torch_step(**kwargs)[1])
            for label, kwargs in (("", {}), (" foreach", {"foreach": True}), (" fused", {"fused": True}))
        },
    }
    m = np.float32(1 - 0.9) * g
    v = np.float32(1 - 0.999) * (g * g)
    direction = (m / np.float32(1 - 0.9)) / (np.sqrt(v / np.float32(1 - 0.999)) + np.float32(1e-8))
    return peers, p0 - np.float32(LR) * direction


def measure(peers: dict, reference: np.ndarray, rounds: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """name -> (min seconds, median seconds, max abs error of the first step)."""
    errors = {name: float(np.max(np.abs(np.asarray(first()) - reference))) for name, (first, _) in peers.items()}
    times: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(rounds):
        for name, (_, timed) in peers.items():
            times[name] += call_times(timed, repeats)
    return {name: (min(t), statistics.median(t), errors[name]) for name, t in times.items()}


def table(title: str, results: dict[str, tuple[float, float, float]]) -> str:
    base = results["flowjit, donated"][0]
    lines = [
        f"**{title}**",
        "",
        "| implementation | min | median | min / flowjit donated | max abs error vs numpy |",
        "|---|---|---|---|---|",
    ]
    for name, (best, median, error) in results.items():
        lines.append(f"| {name} | {best * 1e3:.2f} ms | {median * 1e3:.2f} ms | {best / base:.2f}x | {error:.1e} |")
    return "\n".join(lines)


TITLE = "## Donation (SGD and Adam updates, benchmarks/donation.py)"


ALONE = ("flowjit, donated", "PyTorch p.sub_(g, alpha=lr)")


def _alone(name: str, size: int, calls: int) -> None:
    """Time one SGD implementation in this process, with no other framework imported (so one
    OpenMP runtime); prints its call times (seconds) as JSON."""
    import json

    rng = np.random.default_rng(0)
    p0, g = rng.standard_normal(size, np.float32), rng.standard_normal(size, np.float32)
    if name == ALONE[0]:
        import flowjit as fj

        donated, carried = fj.jit(lambda p, g: p - LR * g, donate_argnums=0), [p0.copy()]

        def step():
            carried[0] = donated(carried[0], g)
    else:
        import torch

        p_torch, g_torch = torch.from_numpy(p0.copy()), torch.from_numpy(g)

        def step():
            p_torch.sub_(g_torch, alpha=LR)

    print(json.dumps(call_times(step, calls)))


def _separate_processes_sgd(args, rounds: int, repeats: int) -> str:
    """The donated SGD update and PyTorch's `sub_`, each timed in processes of its own (alternating,
    `rounds` each): in one process the two OpenMP runtimes (flowjit's libiomp5, PyTorch's libgomp)
    share the cores, and each one's idle threads spin while the other's work."""
    import json
    import subprocess

    times: dict[str, list[float]] = {name: [] for name in ALONE}
    for _ in range(rounds):
        for name in ALONE:
            argv = [sys.executable, __file__, "--alone", name, "--size", str(args.size), "--calls", str(repeats * 5)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                return f"(The separate-process SGD run of {name} failed: {done.stderr.strip().splitlines()[-1:]})"
            times[name] += json.loads(done.stdout.strip().splitlines()[-1])
    base = min(times[ALONE[0]])
    lines = [
        "**SGD p - 0.01 * g, each implementation in processes of its own (one OpenMP runtime per process)**",
        "",
        "| implementation | min | median | min / flowjit donated |",
        "|---|---|---|---|",
    ]
    for name, t in times.items():
        lines.append(f"| {name} | {min(t) * 1e3:.2f} ms | {statistics.median(t) * 1e3:.2f} ms | {min(t) / base:.2f}x |")
    return "\n".join(lines)


def _one_thread_sgd(args) -> str:
    """The SGD table again from a process whose OpenMP (flowjit's and PyTorch's) runs one thread:
    the kernels alone, without the two runtimes' ways of splitting a loop over the cores."""
    import os
    import subprocess

    argv = [sys.executable, __file__, "--one-thread", "--size", str(args.size), *(["--quick"] if args.quick else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        return f"(The one-thread SGD run failed: {done.stderr.strip().splitlines()[-1:]})"
    return done.stdout.strip().replace(
        "**SGD on one thread**", "**SGD p - 0.01 * g, one thread each (OMP_NUM_THREADS=1)**"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000, help="parameters (float32)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--one-thread", action="store_true", help="only SGD, every implementation on one thread")
    parser.add_argument("--alone", choices=ALONE, help="time this SGD implementation alone (JSON out)")
    parser.add_argument("--calls", type=int, default=50, help="with --alone: timed calls")
    args = parser.parse_args()
    rounds, repeats = (2, 5) if args.quick else (5, 10)
    if args.alone:
        _alone(args.alone, args.size, args.calls)
        return 0
    if args.one_thread:  # a process started with OMP_NUM_THREADS=1 (`_one_thread_sgd`)
        import torch

        torch.set_num_threads(1)
        print(table("SGD on one thread", measure(*sgd_peers(args.size), rounds, repeats)))
        return 0
    load_before, started = load_average(), time.perf_counter()
    tables = []
    for title, make in (("SGD p - 0.01 * g", sgd_peers), ("Adam step (flowjit.optim.Adam, lr 0.01)", adam_peers)):
        peers, reference = make(args.size)
        tables.append(table(f"{title}, {args.size:,} float32 parameters", measure(peers, reference, rounds, repeats)))
        if make is sgd_peers:
            tables.append(_separate_processes_sgd(args, rounds, repeats))
            tables.append(_one_thread_sgd(args))
    how = (
        f"{run_line('donation.py', started, load_before)} A parameter update jitted without and with its "
        f"parameters (and optimizer state) donated, against PyTorch's in-place updates: {rounds} rounds of "
        f"{repeats} timed calls per implementation after a warm-up call; the ratio is each minimum over the "
        "donated flowjit update's. Donated results are written in place by the kernel that computes them "
        "(docs/frontend.md, 'Donation')."
    )
    print("\n\n".join([TITLE, how, *tables]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
