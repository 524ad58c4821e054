"""flowjit's main demo (`make demo`): trace a small model, show its IR, run it compiled, compare to numpy.

It grows with the project: training on scikit-learn's bundled `digits` data, placement, AOT.
"""

from __future__ import annotations

import time

import numpy as np

import flowjit as fj
import flowjit.numpy as fnp


@fj.jit
def predict(x, w1, b1, w2, b2):
    """A two-layer MLP's forward pass: logits and the row-wise softmax."""
    hidden = fnp.tanh(x @ w1 + b1)
    logits = hidden @ w2 + b2
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = fnp.exp(shifted) / fnp.exp(shifted).sum(axis=1, keepdims=True)
    return logits, probs


def numpy_predict(x, w1, b1, w2, b2):
    hidden = np.tanh(x @ w1 + b1)
    logits = hidden @ w2 + b2
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    return logits, probs


def section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    params = (
        (rng.standard_normal((64, 128)) * 0.1).astype(np.float32),
        np.zeros(128, np.float32),
        (rng.standard_normal((128, 10)) * 0.1).astype(np.float32),
        np.zeros(10, np.float32),
    )

    lowered = predict.lower(x, *params)
    section("traced IR (one op per line, with the source line that created it)")
    print(lowered.as_text("traced"))
    section("optimized IR")
    print(lowered.as_text("optimized"))
    for stage in ("mlir", "asm"):
        if stage in lowered.stages:
            text = lowered.as_text(stage).splitlines()
            section(f"{stage} (first 25 of {len(text)} lines)")
            print("\n".join(text[:25]))

    section("run")
    start = time.perf_counter()
    logits, probs = predict(x, *params)
    first = time.perf_counter() - start
    start = time.perf_counter()
    predict(x, *params)
    steady = time.perf_counter() - start
    ref_logits, ref_probs = numpy_predict(x, *params)
    print(f"first call (trace + compile + run): {first * 1e3:8.2f} ms")
    print(f"second call:                        {steady * 1e3:8.2f} ms")
    print(f"max |logits - numpy|: {np.abs(logits - ref_logits).max():.3e}")
    print(f"max |probs  - numpy|: {np.abs(probs - ref_probs).max():.3e}")
    print(f"row 0 probabilities (flowjit): {np.array2string(probs[0], precision=3)}")
    print(f"row 0 probabilities (numpy):   {np.array2string(ref_probs[0], precision=3)}")


if __name__ == "__main__":
    main()
