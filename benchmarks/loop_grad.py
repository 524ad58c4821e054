"""The gradient of an LSTM written with a loop: `fj.fori_loop` and `fj.scan`, JAX's two, PyTorch eager.

    python benchmarks/loop_grad.py [--quick] [--steps 25 50 100 200] [--hidden 256] [--batch 32]

The `fori_loop` body reads one step of the closed-over input sequence (`xs[i]`) and the `scan` step
gets it as its `x`; either way the reverse pass must add that step's cotangent into the sequence's
gradient without touching the other steps: the time per step should not grow with the number of
steps T. The loss is the sum of the last hidden state; the gradient is taken with respect to the
weights and the input sequence.

Times are the best of repeated calls (wall clock, after a warm-up call that compiles), on the CPU.
The frameworks' calls are interleaved, one call of each per round, so that other jobs on a shared
machine disturb them alike and the ratios of one run hold. Prints the Markdown section that
`run.py` puts into RESULTS.md: milliseconds per gradient and microseconds per step per framework.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import machine
import numpy as np
from harness import call_times, run_line


def best_seconds(fns: dict, repeats: int) -> dict[str, float]:
    """The fastest call of each function, timed round by round (one timed call of each per round,
    after an untimed one: the first compiles, the others warm what the other functions evicted); on
    a shared machine the minimum is the least noisy estimate."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], *call_times(fn, 1))
    return best


def lstm_inputs(steps: int, batch: int, hidden: int) -> dict[str, np.ndarray]:
    """Weights (input and hidden size `hidden`, the four gates side by side) and a (steps, batch, hidden) sequence."""
    rng = np.random.default_rng(0)
    scale = 1.0 / np.sqrt(hidden)
    return {
        "wx": (rng.standard_normal((hidden, 4 * hidden)) * scale).astype(np.float32),
        "wh": (rng.standard_normal((hidden, 4 * hidden)) * scale).astype(np.float32),
        "b": np.zeros(4 * hidden, np.float32),
        "xs": rng.standard_normal((steps, batch, hidden)).astype(np.float32),
    }


def lstm_loss(np_, sigmoid, fori_loop, steps: int, batch: int, hidden: int):
    """The loss, written once for flowjit and JAX: `np_` is their numpy (flowjit.numpy or
    jax.numpy), `sigmoid` and `fori_loop` theirs."""

    def loss(wx, wh, b, xs):
        def body(i, carry):
            h, c = carry
            gates = xs[i] @ wx + h @ wh + b
            f, g, o, u = (gates[:, k * hidden : (k + 1) * hidden] for k in range(4))
            c = sigmoid(f) * c + sigmoid(u) * np_.tanh(g)
            return sigmoid(o) * np_.tanh(c), c

        init = (np_.zeros((batch, hidden), np_.float32), np_.zeros((batch, hidden), np_.float32))
        h, _ = fori_loop(0, steps, body, init)
        return np_.sum(h)

    return loss


def lstm_scan_loss(np_, sigmoid, scan, steps: int, batch: int, hidden: int):
    """The same loss with the step as a `scan` body (`f(carry, x) -> (carry, y)`), for flowjit and JAX."""

    def loss(wx, wh, b, xs):
        def step(carry, x):
            h, c = carry
            gates = x @ wx + h @ wh + b
            f, g, o, u = (gates[:, k * hidden : (k + 1) * hidden] for k in range(4))
            c = sigmoid(f) * c + sigmoid(u) * np_.tanh(g)
            return (sigmoid(o) * np_.tanh(c), c), None

        init = (np_.zeros((batch, hidden), np_.float32), np_.zeros((batch, hidden), np_.float32))
        (h, _), _ = scan(step, init, xs)
        return np_.sum(h)

    return loss


def flowjit_gradient(inputs: dict[str, np.ndarray], loop: str = "fori_loop"):
    import flowjit as fj
    import flowjit.numpy as fnp

    make_loss = lstm_scan_loss if loop == "scan" else lstm_loss
    loss = make_loss(fnp, fj.nn.sigmoid, getattr(fj, loop), *inputs["xs"].shape)
    grad = fj.jit(fj.grad(loss, argnums=(0, 1, 2, 3)))
    args = (inputs["wx"], inputs["wh"], inputs["b"], inputs["xs"])
    return lambda: [np.asarray(g) for g in grad(*args)]


def jax_gradient(inputs: dict[str, np.ndarray], loop: str = "fori_loop"):
    import jax
    import jax.numpy as jnp

    make_loss = lstm_scan_loss if loop == "scan" else lstm_loss
    loss = make_loss(jnp, jax.nn.sigmoid, getattr(jax.lax, loop), *inputs["xs"].shape)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    args = [jnp.asarray(inputs[k]) for k in ("wx", "wh", "b", "xs")]
    return lambda: [g.block_until_ready() for g in grad(*args)]


def torch_gradient(inputs: dict[str, np.ndarray]):
    import torch

    steps, batch, hidden = inputs["xs"].shape
    wx, wh, b, xs = (torch.tensor(inputs[k], requires_grad=True) for k in ("wx", "wh", "b", "xs"))

    def run():
        h = torch.zeros(batch, hidden)
        c = torch.zeros(batch, hidden)
        for i in range(steps):
            gates = xs[i] @ wx + h @ wh + b
            f, g, o, u = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(u) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return torch.autograd.grad(h.sum(), (wx, wh, b, xs))

    return run


FRAMEWORKS = {
    "flowjit fori_loop": flowjit_gradient,
    "flowjit scan": lambda inputs: flowjit_gradient(inputs, "scan"),
    "jax fori_loop": jax_gradient,
    "jax scan": lambda inputs: jax_gradient(inputs, "scan"),
    "pytorch": torch_gradient,
}


# The library each column needs (JAX and PyTorch come with the `bench` extra; a missing one is reported).
MODULES = {"flowjit fori_loop": "flowjit", "flowjit scan": "flowjit", "jax fori_loop": "jax", "jax scan": "jax"}
MODULES["pytorch"] = "torch"


# Where the time goes when flowjit's LSTM gradient is the slower (a `perf record`, T=25).
WHY_SLOWER = (
    "Where flowjit is slower than JAX: `perf record` of the fori_loop gradient at T=25 (2-core Zen 4) puts "
    "13% of the samples in OpenMP's barrier wait (`kmp_flag_64::wait`: each step's matmuls, 32x256 by "
    "256x1024, are split over both cores and joined, and the second core waits while the first runs the "
    "step's small single-threaded kernels) and under 1% in `memmove` (the loops' carried buffers are updated "
    "in place: docs/cpu-backend.md, 'Control flow')."
)


def section(rows, names: list[str], missing: list[str], how: str) -> str:
    """The Markdown section benchmarks/RESULTS.md holds (`run.py` inserts it): the table, how the time
    per step grows from the shortest to the longest sequence, and flowjit against JAX per loop."""
    lines = ["## Loop gradients (LSTM, benchmarks/loop_grad.py)", "", how, ""]
    lines += ["| T | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for steps, times in rows:
        cells = [f"{times[n] * 1e3:.1f} ({times[n] * 1e6 / steps:.0f})" for n in names]
        lines.append(f"| {steps} | " + " | ".join(cells) + " |")
    (first, t0), (last, t1), slower = rows[0], rows[-1], False
    growth = ", ".join(f"{n} {t1[n] / last / (t0[n] / first):.2f}x" for n in names)
    lines += ["", f"Time per step at T={last} over T={first} (1.00x: flat, O(T) in all): {growth}."]
    for loop in ("fori_loop", "scan"):
        ours, theirs = f"flowjit {loop}", f"jax {loop}"
        if ours in names and theirs in names:
            ratios = ", ".join(f"{t[ours] / t[theirs]:.2f} (T={steps})" for steps, t in rows)
            lines.append(f"flowjit ÷ JAX, `{loop}` (≤ 1.0: no slower): {ratios}.")
            slower = slower or any(t[ours] > t[theirs] for _, t in rows)
    if slower:
        lines += ["", WHY_SLOWER]
    if missing:
        lines += ["", f"Not measured: {', '.join(missing)} (install the `bench` extra)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
    names = [n for n in FRAMEWORKS if importlib.util.find_spec(MODULES[n]) is not None]
    missing = [n for n in FRAMEWORKS if n not in names]
    load_before, started = machine.load_average(), time.perf_counter()
    rows = []
    for steps in args.steps:
        inputs = lstm_inputs(steps, args.batch, args.hidden)
        rows.append((steps, best_seconds({n: FRAMEWORKS[n](inputs) for n in names}, repeats)))
    how = (
        f"{run_line('loop_grad.py', started, load_before)} The gradient of an LSTM "
        f"(hidden {args.hidden}, batch {args.batch}, T steps) with respect to its weights and input sequence, "
        f"written with a loop: ms per gradient (µs per step), the best of {repeats} calls, the columns' calls "
        "interleaved."
    )
    print(section(rows, names, missing, how))
    return 0


if __name__ == "__main__":
    sys.exit(main())
