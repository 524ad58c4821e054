"""The gradient of an LSTM written with a loop: `fj.fori_loop` and `fj.scan`, JAX's two, PyTorch eager.

    python benchmarks/loop_grad.py [--quick] [--steps 25 50 100 200] [--hidden 256] [--batch 32]

The `fori_loop` body reads one step of the closed-over input sequence (`xs[i]`) and the `scan` step
gets it as its `x`; either way the reverse pass must add that step's cotangent into the sequence's
gradient without touching the other steps: the time per step should not grow with the number of
steps T. The loss is the sum of the last hidden state;
the gradient is taken with respect to the weights and the input sequence.

Times are the best of repeated calls (wall clock, after a warm-up call that compiles), on the CPU.
Prints a Markdown table: milliseconds per gradient and microseconds per step for each framework.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from harness import call_times


def best_seconds(fn, repeats: int) -> float:
    """The fastest call: on a shared machine the minimum is the least noisy estimate."""
    return min(call_times(fn, repeats))


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
    rows = []
    for steps in args.steps:
        inputs = lstm_inputs(steps, args.batch, args.hidden)
        rows.append((steps, {name: best_seconds(make(inputs), repeats) for name, make in FRAMEWORKS.items()}))
    print(f"LSTM gradient, hidden {args.hidden}, batch {args.batch}: ms per gradient (us per step)\n")
    print("| T | " + " | ".join(FRAMEWORKS) + " |")
    print("|---|" + "---|" * len(FRAMEWORKS))
    for steps, times in rows:
        cells = [f"{t * 1e3:.1f} ({t * 1e6 / steps:.0f})" for t in times.values()]
        print(f"| {steps} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
