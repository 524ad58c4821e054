"""The device check's peers (`device_check.py run`): PyTorch eager, `torch.compile` and JAX twins
of the timed programs, each timed on the peer device and checked against the expected outputs, and
the measurements flowjit's own timing shares (`compare`, `median_ms`).

PyTorch and JAX are imported only inside the peers' code, so `run` needs neither: a peer that
cannot run (no package, no device for it, a compile failure) is a record with its reason.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

from harness import call_times  # noqa: E402 (the benchmarks' timing loop)

PEERS = ("torch", "torch.compile", "jax")


# --- the peers' twins of the programs ----------------------------------------------------------
# PyTorch (eager and torch.compile) and JAX versions of every timed program; imported only inside
# the peers' code, so `run` needs neither.


def _torch(name: str):
    import torch
    import torch.nn.functional as F

    def train_step(loss_of_output):
        def step(x, y, w1, b1, w2):
            def loss(w1, b1, w2):
                return loss_of_output(torch.tanh(x @ w1 + b1) @ w2, y)

            g1, gb, g2 = torch.func.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)
            return w1 - 0.01 * g1, b1 - 0.01 * gb, w2 - 0.01 * g2

        return step

    return {
        "chain": lambda x, y: torch.tanh(x * y + 1.0) * torch.exp(-x) + torch.log(y * y + 1.0),
        "softmax": lambda x: torch.softmax(x, dim=1),
        "layer_norm": lambda x, g: (
            (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * g
        ),
        "whole_sum": lambda x: x.sum(),
        "column_sum": lambda x: x.sum(0),
        "mlp_forward": lambda x, w1, b1, w2: torch.tanh(x @ w1 + b1) @ w2,
        "mlp_train_step": train_step(lambda out, y: ((out - y) ** 2).mean()),
        "mlp_xent_step": train_step(lambda logits, labels: F.cross_entropy(logits, labels.long())),
        "matmul_f32": lambda a, b: a @ b,
        "matmul_bf16": lambda a, b: a @ b,
        "conv_layer": lambda x, w, b: torch.relu(F.conv2d(x, w, b, padding=1)),
    }[name]


def _jax(name: str):
    """The JAX twin; its products and convolutions ask for full float32 precision (JAX's default
    on a GPU is TF32-like, flowjit's and PyTorch's is not)."""
    import jax
    import jax.numpy as jnp

    highest = jax.lax.Precision.HIGHEST

    def mm(a, b):
        return jnp.matmul(a, b, precision=highest)

    def train_step(loss_of_output):
        def step(x, y, w1, b1, w2):
            def loss(w1, b1, w2):
                return loss_of_output(mm(jnp.tanh(mm(x, w1) + b1), w2), y)

            g1, gb, g2 = jax.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)
            return w1 - 0.01 * g1, b1 - 0.01 * gb, w2 - 0.01 * g2

        return step

    def cross_entropy(logits, labels):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    def conv_layer(x, w, b):
        dims = ("NCHW", "OIHW", "NCHW")
        conv = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dims, precision=highest)
        return jax.nn.relu(conv + b.reshape(1, -1, 1, 1))

    return {
        "chain": lambda x, y: jnp.tanh(x * y + 1.0) * jnp.exp(-x) + jnp.log(y * y + 1.0),
        "softmax": lambda x: jax.nn.softmax(x, axis=1),
        "layer_norm": lambda x, g: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) * g,
        "whole_sum": lambda x: jnp.sum(x),
        "column_sum": lambda x: jnp.sum(x, axis=0),
        "mlp_forward": lambda x, w1, b1, w2: mm(jnp.tanh(mm(x, w1) + b1), w2),
        "mlp_train_step": train_step(lambda out, y: jnp.mean((out - y) ** 2)),
        "mlp_xent_step": train_step(cross_entropy),
        "matmul_f32": mm,
        "matmul_bf16": mm,
        "conv_layer": conv_layer,
    }[name]


def compare(outputs, p: dict, elementwise: bool = True) -> dict:
    """The largest absolute error of `outputs` (of their sample, for a program with one) and
    whether they match the expected outputs: each element within the program's tolerance
    (`elementwise`, for flowjit), or every error within `rtol` times the output's largest magnitude
    plus `atol` (for the peers: their own summation order in a 784-long dot product is off by more
    than `rtol` of an element near zero)."""
    if "sample" in p:  # a program checked on a sample of its outputs (device_check.Sampled)
        outputs = p["sample"](outputs)
    expected = p["expected"]
    shapes = [np.shape(o) for o in outputs] == [e.shape for e in expected]
    if not shapes:
        return {"max_abs_error": float("inf"), "matches": False}
    errors = [np.abs(np.asarray(o, np.float64) - e.astype(np.float64)) for o, e in zip(outputs, expected)]
    if elementwise:
        close = all(
            np.allclose(o, e, rtol=p["rtol"], atol=p["atol"], equal_nan=True) for o, e in zip(outputs, expected)
        )
    else:
        bounds = [p["atol"] + p["rtol"] * float(np.max(np.abs(e), initial=0.0)) for e in expected]
        close = all(float(np.max(err, initial=0.0)) <= bound for err, bound in zip(errors, bounds))
    return {"max_abs_error": max((float(np.max(err, initial=0.0)) for err in errors), default=0.0), "matches": close}


def median_ms(call: Callable[[], object], repeat: int) -> float:
    """The median of `repeat` timed calls, in ms, after three untimed ones (`call_times` makes the
    third)."""
    call()
    call()
    return float(np.median(call_times(call, repeat)) * 1e3)


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


# --- the peers: each times its twin of a program and checks its own result -----------------------


def run_peer(peer: str, p: dict, repeat: int, device_kind: str) -> dict:
    """The peer's times and errors, or {"error": its exception's first line}."""
    timers = {"torch": _time_torch_eager, "torch.compile": _time_torch_compile, "jax": _time_jax}
    try:
        return timers[peer](p, repeat, device_kind)
    except Exception as error:  # a peer that cannot run is a result to report, never the run's end
        return {"error": first_line(error)}


def _torch_on(device_kind: str):
    """(torch, the device, a function that waits for it)."""
    import torch

    if device_kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"PyTorch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
    # full float32 products and convolutions (cuBLAS and cuDNN without TF32), as flowjit's and JAX's
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(device_kind)
    return torch, device, (torch.cuda.synchronize if device_kind == "cuda" else lambda: None)


def _host(outputs) -> list[np.ndarray]:
    """A peer's result (one array or a tuple) as host arrays."""
    items = outputs if isinstance(outputs, tuple | list) else (outputs,)
    return [_from_torch(o) if hasattr(o, "cpu") else np.asarray(o) for o in items]


def _to_torch(torch, a: np.ndarray):
    """A host array as a tensor on the host, without a copy (numpy's bfloat16 from ml_dtypes through
    its 16 bits, which PyTorch cannot take as they are)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _from_torch(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy()


def _time_torch_eager(p: dict, repeat: int, device_kind: str) -> dict:
    torch, device, wait = _torch_on(device_kind)
    fn = _torch(p["name"])
    on_device = [_to_torch(torch, a).to(device) for a in p["inputs"]]

    def end_to_end():
        return _host(fn(*[_to_torch(torch, a).to(device) for a in p["inputs"]]))

    def device_only():
        fn(*on_device)
        wait()

    return {
        "end_to_end_ms": median_ms(end_to_end, repeat),
        "on_device_ms": median_ms(device_only, repeat),
        **compare(end_to_end(), p, elementwise=False),
    }


def _time_torch_compile(p: dict, repeat: int, device_kind: str) -> dict:
    """`torch.compile` (default mode) on device-resident tensors; the first call (tracing and
    compiling) is timed apart."""
    torch, device, wait = _torch_on(device_kind)
    compiled = torch.compile(_torch(p["name"]))
    on_device = [_to_torch(torch, a).to(device) for a in p["inputs"]]
    start = time.perf_counter()
    first = compiled(*on_device)
    wait()
    compile_ms = (time.perf_counter() - start) * 1e3

    def device_only():
        compiled(*on_device)
        wait()

    return {
        "compile_ms": compile_ms,
        "on_device_ms": median_ms(device_only, repeat),
        **compare(_host(first), p, elementwise=False),
    }


def _time_jax(p: dict, repeat: int, device_kind: str) -> dict:
    """`jax.jit` on the peer device: end to end (`jax.device_put` in, host arrays out) and on
    device-resident arrays (`block_until_ready`); the first call (compiling) is timed apart."""
    import jax

    device = jax.devices("gpu" if device_kind == "cuda" else "cpu")[0]
    fn = jax.jit(_jax(p["name"]))
    on_device = [jax.device_put(a, device) for a in p["inputs"]]
    start = time.perf_counter()
    jax.block_until_ready(fn(*on_device))
    compile_ms = (time.perf_counter() - start) * 1e3

    def end_to_end():
        return _host(fn(*[jax.device_put(a, device) for a in p["inputs"]]))

    return {
        "compile_ms": compile_ms,
        "end_to_end_ms": median_ms(end_to_end, repeat),
        "on_device_ms": median_ms(lambda: jax.block_until_ready(fn(*on_device)), repeat),
        **compare(end_to_end(), p, elementwise=False),
    }
