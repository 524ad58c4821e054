"""Per-example gradients of an MLP: flowjit's `vmap(grad)`, JAX's `vmap(grad)`, PyTorch's `torch.func`.

    python benchmarks/per_example_grads.py [--quick] [--batch 32 128] [--hidden 256]

The loss of one example (a 784-feature image through two tanh layers of `hidden` units to 10
logits, softmax cross-entropy) is differentiated with respect to the shared parameters and mapped
over the batch, so each call returns one gradient per example (batch x parameters). All three
frameworks are checked to agree before they are timed.

Times are the best of repeated calls (wall clock, after a warm-up call that compiles), on the CPU.
Prints a Markdown table of milliseconds per call and flowjit's ratio to the fastest peer.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from harness import call_times, run_line
from machine import load_average

FEATURES, CLASSES = 784, 10


def make_inputs(batch: int, hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    sizes = (FEATURES, hidden, hidden, CLASSES)
    params = {}
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{k}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{k}"] = np.zeros(b, np.float32)
    x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, batch).astype(np.int32)
    return {"params": params, "x": x, "y": y}


def example_loss(np_, log_softmax):
    """The loss of one example, written once for flowjit and JAX."""

    def loss(params, x, y):
        h = np_.tanh(x @ params["w0"] + params["b0"])
        h = np_.tanh(h @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        return -log_softmax(logits)[y]

    return loss


def flowjit_grads(inputs):
    import flowjit as fj
    import flowjit.numpy as fnp

    loss = example_loss(fnp, fj.nn.log_softmax)
    fn = fj.jit(fj.vmap(fj.grad(loss), in_axes=(None, 0, 0)))
    return lambda: {k: np.asarray(v) for k, v in fn(inputs["params"], inputs["x"], inputs["y"]).items()}


def jax_grads(inputs):
    import jax
    import jax.numpy as jnp

    loss = example_loss(jnp, jax.nn.log_softmax)
    fn = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))
    params = {k: jnp.asarray(v) for k, v in inputs["params"].items()}
    x, y = jnp.asarray(inputs["x"]), jnp.asarray(inputs["y"])
    return lambda: {k: np.asarray(v.block_until_ready()) for k, v in fn(params, x, y).items()}


def torch_grads(inputs):
    import torch
    from torch.func import grad, vmap

    def loss(params, x, y):
        h = torch.tanh(x @ params["w0"] + params["b0"])
        h = torch.tanh(h @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        return -torch.gather(torch.log_softmax(logits, dim=-1), 0, y[None])[0]

    fn = vmap(grad(loss), in_dims=(None, 0, 0))
    params = {k: torch.tensor(v) for k, v in inputs["params"].items()}
    x, y = torch.tensor(inputs["x"]), torch.tensor(inputs["y"]).long()
    return lambda: {k: v.numpy() for k, v in fn(params, x, y).items()}


TITLE = "## Per-example gradients (vmap, benchmarks/per_example_grads.py)"
FRAMEWORKS = {"flowjit": flowjit_grads, "jax": jax_grads, "pytorch": torch_grads}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else 20
    load_before, started = load_average(), time.perf_counter()
    rows = []
    for batch in args.batch:
        inputs = make_inputs(batch, args.hidden)
        fns = {name: make(inputs) for name, make in FRAMEWORKS.items()}
        reference = fns["jax"]()
        for name, fn in fns.items():
            out = fn()
            for key, want in reference.items():
                np.testing.assert_allclose(out[key], want, rtol=2e-3, atol=2e-5, err_msg=f"{name} {key}")
        rows.append((batch, {name: min(call_times(fn, repeats)) for name, fn in fns.items()}))
    lines = [
        TITLE,
        "",
        f"{run_line('per_example_grads.py', started, load_before)} MLP {FEATURES}-{args.hidden}-{args.hidden}-"
        f"{CLASSES} (tanh, softmax cross-entropy), the gradient of one example's loss mapped over the batch: "
        "flowjit `jit(vmap(grad))`, JAX `jit(vmap(grad))`, PyTorch `torch.func.vmap(grad)`. Best of "
        f"{repeats} calls, ms; the results are checked to agree first.",
        "",
        "| batch | " + " | ".join(FRAMEWORKS) + " | flowjit / fastest peer |",
        "|---|" + "---|" * (len(FRAMEWORKS) + 1),
    ]
    for batch, times in rows:
        peer = min(t for name, t in times.items() if name != "flowjit")
        cells = [f"{t * 1e3:.2f}" for t in times.values()]
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {times['flowjit'] / peer:.2f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
