"""The workloads: one class each, with the input maker and one version per peer.

Each peer's factory (`flowjit`, `jax`, `torch`, `torch_compile`) returns a *fresh* function object,
so that timing its first call measures trace + compile + run. Each version is what a user of that
library would write: the numpy versions spell everything out (numpy has no softmax or conv), the
others call their library's layers (`torch.softmax`, `jax.nn.softmax`, `flowjit.nn.softmax`, ...).
The flowjit versions use only the public API (`fj.jit`, `fj.grad`, `flowjit.numpy`, `flowjit.nn`).
Sizes come from the project's issues; `tiny` sizes keep the smoke test fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from harness import Skip

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp


@dataclass(frozen=True)
class Target:
    """A goal from the issues: flowjit's speedup over numpy (t_numpy / t_flowjit) must reach `min_speedup`."""

    min_speedup: float
    text: str


class Workload:
    """Base: sizes, float64 reference, torch.compile from the torch version, traffic/flop counts."""

    name = ""
    title = ""
    bound = "memory"  # which machine limit applies: "memory" (GB/s), "compute" (GFLOP/s) or "overhead"
    sizes: dict[str, dict] = {}
    target: Target | None = None

    def inputs(self, rng: np.random.Generator, **size) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def numpy(self, *args):
        raise NotImplementedError

    def reference(self, *args):
        """The numpy version in float64: the accuracy reference for every peer."""
        return self.numpy(*(a.astype(np.float64) if a.dtype.kind == "f" else a for a in args))

    def flowjit(self):
        raise NotImplementedError

    def jax(self):
        raise NotImplementedError

    def torch(self):
        raise NotImplementedError

    def torch_compile(self):
        import torch

        return torch.compile(self.torch())

    def traffic_bytes(self, **size) -> int:
        """Compulsory memory traffic of one call: every input read once, every output written once."""
        return 0

    def flops(self, **size) -> int:
        return 0


# --- elementwise chain --------------------------------------------------------------------------------


class Elementwise(Workload):
    name = "elementwise"
    title = "elementwise chain tanh(x*0.7+0.1)*sigmoid(x)+0.5*x, f32"
    sizes = {"full": {"n": 16 * 2**20}, "tiny": {"n": 1000}}
    target = Target(3.0, ">= 3x numpy")

    def inputs(self, rng, n):
        return (rng.standard_normal(n, dtype=np.float32),)

    def numpy(self, x):
        return np.tanh(x * 0.7 + 0.1) * (1.0 / (1.0 + np.exp(-x))) + 0.5 * x

    def flowjit(self):
        return fj.jit(lambda x: fnp.tanh(x * 0.7 + 0.1) * fnp.logistic(x) + 0.5 * x)

    def jax(self):
        import jax
        import jax.numpy as jnp

        return jax.jit(lambda x: jnp.tanh(x * 0.7 + 0.1) * jax.nn.sigmoid(x) + 0.5 * x)

    def torch(self):
        import torch

        return lambda x: torch.tanh(x * 0.7 + 0.1) * torch.sigmoid(x) + 0.5 * x

    def traffic_bytes(self, n):
        return 2 * 4 * n

    def flops(self, n):
        return 8 * n


# --- matmul ---------------------------------------------------------------------------------------------


class Matmul(Workload):
    bound = "compute"
    target = Target(0.5, ">= 0.5x numpy BLAS")

    def __init__(self, n: int):
        self.n = n
        self.name = f"matmul{n}"
        self.title = f"matmul {n}x{n} @ {n}x{n}, f32"
        self.sizes = {"full": {"n": n}, "tiny": {"n": 8}}

    def inputs(self, rng, n):
        return rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)

    def numpy(self, a, b):
        return a @ b

    def flowjit(self):
        return fj.jit(lambda a, b: a @ b)

    def jax(self):
        import jax

        return jax.jit(lambda a, b: a @ b)

    def torch(self):
        return lambda a, b: a @ b

    def traffic_bytes(self, n):
        return 3 * 4 * n * n

    def flops(self, n):
        return 2 * n**3


# --- row softmax ----------------------------------------------------------------------------------------


class Softmax(Workload):
    name = "softmax"
    title = "row softmax (max-subtracted) over the last axis, f32"
    sizes = {"full": {"rows": 4096, "cols": 1024}, "tiny": {"rows": 4, "cols": 16}}
    target = Target(2.0, ">= 2x numpy")

    def inputs(self, rng, rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32),)

    def numpy(self, x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def flowjit(self):
        return fj.jit(lambda x: nn.softmax(x, axis=-1))

    def jax(self):
        import jax

        return jax.jit(lambda x: jax.nn.softmax(x, axis=-1))

    def torch(self):
        import torch

        return lambda x: torch.softmax(x, dim=-1)

    def traffic_bytes(self, rows, cols):
        return 2 * 4 * rows * cols

    def flops(self, rows, cols):
        return 5 * rows * cols


# --- layernorm ------------------------------------------------------------------------------------------

EPS = 1e-5


class LayerNorm(Workload):
    name = "layernorm"
    title = "layernorm over the last axis with gamma/beta, eps=1e-5, f32"
    sizes = {"full": {"rows": 4096, "cols": 1024}, "tiny": {"rows": 4, "cols": 16}}
    target = Target(2.0, ">= 2x numpy")

    def inputs(self, rng, rows, cols):
        x = rng.standard_normal((rows, cols), dtype=np.float32)
        gamma = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        beta = rng.uniform(-0.5, 0.5, cols).astype(np.float32)
        return x, gamma, beta

    def numpy(self, x, gamma, beta):
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + EPS) * gamma + beta

    def flowjit(self):
        return fj.jit(lambda x, gamma, beta: nn.layer_norm(x, gamma, beta, eps=EPS))

    def jax(self):
        import jax

        def layernorm(x, gamma, beta):
            mean = x.mean(axis=-1, keepdims=True)
            var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
            return (x - mean) * jax.lax.rsqrt(var + EPS) * gamma + beta

        return jax.jit(layernorm)

    def torch(self):
        import torch.nn.functional as F

        return lambda x, gamma, beta: F.layer_norm(x, (x.shape[-1],), gamma, beta, EPS)

    def traffic_bytes(self, rows, cols):
        return 2 * 4 * rows * cols + 2 * 4 * cols

    def flops(self, rows, cols):
        return 8 * rows * cols


# --- CNN forward ----------------------------------------------------------------------------------------


class CNN(Workload):
    name = "cnn"
    title = "CNN forward: conv3x3 1->32 (pad 1) + bias + relu + maxpool2 + dense->10, NCHW, f32"
    bound = "compute"
    sizes = {"full": {"batch": 64, "hw": 28}, "tiny": {"batch": 2, "hw": 4}}

    def inputs(self, rng, batch, hw):
        x = rng.standard_normal((batch, 1, hw, hw), dtype=np.float32)
        w = (rng.standard_normal((32, 1, 3, 3), dtype=np.float32) / 3).astype(np.float32)
        b = rng.uniform(-0.1, 0.1, 32).astype(np.float32)
        wd = (rng.standard_normal((32 * (hw // 2) ** 2, 10), dtype=np.float32) * 0.02).astype(np.float32)
        bd = rng.uniform(-0.1, 0.1, 10).astype(np.float32)
        return x, w, b, wd, bd

    def numpy(self, x, w, b, wd, bd):
        """Conv as a matmul of the weights with the 9 shifted views of the padded input (im2col)."""
        n, cin, h, wid = x.shape
        cout = w.shape[0]
        padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        patches = np.stack([padded[:, :, i : i + h, j : j + wid] for i in range(3) for j in range(3)], axis=2)
        cols = patches.reshape(n, cin * 9, h * wid)
        conv = (w.reshape(cout, cin * 9) @ cols).reshape(n, cout, h, wid) + b.reshape(1, cout, 1, 1)
        act = np.maximum(conv, 0.0)
        pooled = act.reshape(n, cout, h // 2, 2, wid // 2, 2).max(axis=(3, 5))
        return pooled.reshape(n, -1) @ wd + bd

    def flowjit(self):
        def cnn(x, w, b, wd, bd):
            act = nn.relu(nn.conv2d(x, w, b, padding=1))
            pooled = nn.max_pool2d(act, 2)
            return pooled.reshape(pooled.shape[0], -1) @ wd + bd

        return fj.jit(cnn)

    def jax(self):
        import jax

        def cnn(x, w, b, wd, bd):
            dims = ("NCHW", "OIHW", "NCHW")
            conv = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dims)
            act = jax.nn.relu(conv + b.reshape(1, -1, 1, 1))
            n, c, h, wid = act.shape
            pooled = act.reshape(n, c, h // 2, 2, wid // 2, 2).max(axis=(3, 5))
            return pooled.reshape(n, -1) @ wd + bd

        return jax.jit(cnn)

    def torch(self):
        import torch
        import torch.nn.functional as F

        def cnn(x, w, b, wd, bd):
            act = torch.relu(F.conv2d(x, w, b, padding=1))
            return F.max_pool2d(act, 2).flatten(1) @ wd + bd

        return cnn

    def traffic_bytes(self, batch, hw):
        return 4 * (batch * hw * hw + 32 * 9 + 32 + 32 * (hw // 2) ** 2 * 10 + 10 + batch * 10)

    def flops(self, batch, hw):
        return 2 * batch * 32 * hw * hw * 9 + 2 * batch * 32 * (hw // 2) ** 2 * 10


# --- a ResNet conv layer ----------------------------------------------------------------------------------


class ConvLayer(Workload):
    """A deep convolution as in a ResNet's first stage: the CNN above has one input channel (9
    multiply-adds per output), this one 576 per output, where a conv is a large matrix product."""

    name = "conv_layer"
    title = "conv layer: conv3x3 64->64 (pad 1) + bias + relu, 8x64x56x56, NCHW, f32"
    bound = "compute"
    sizes = {"full": {"batch": 8, "channels": 64, "hw": 56}, "tiny": {"batch": 2, "channels": 4, "hw": 6}}

    def inputs(self, rng, batch, channels, hw):
        x = rng.standard_normal((batch, channels, hw, hw), dtype=np.float32)
        w = (rng.standard_normal((channels, channels, 3, 3), dtype=np.float32) / (3 * channels**0.5)).astype(np.float32)
        b = rng.uniform(-0.1, 0.1, channels).astype(np.float32)
        return x, w, b

    def numpy(self, x, w, b):
        """im2col: the 9 shifted views of the padded input, one batched matmul with the weights."""
        n, cin, h, wid = x.shape
        cout = w.shape[0]
        padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        patches = np.stack([padded[:, :, i : i + h, j : j + wid] for i in range(3) for j in range(3)], axis=2)
        conv = w.reshape(cout, cin * 9) @ patches.reshape(n, cin * 9, h * wid)
        return np.maximum(conv.reshape(n, cout, h, wid) + b.reshape(1, cout, 1, 1), 0.0)

    def flowjit(self):
        return fj.jit(lambda x, w, b: nn.relu(nn.conv2d(x, w, b, padding=1)))

    def jax(self):
        import jax

        def layer(x, w, b):
            dims = ("NCHW", "OIHW", "NCHW")
            conv = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dims)
            return jax.nn.relu(conv + b.reshape(1, -1, 1, 1))

        return jax.jit(layer)

    def torch(self):
        import torch
        import torch.nn.functional as F

        return lambda x, w, b: torch.relu(F.conv2d(x, w, b, padding=1))

    def traffic_bytes(self, batch, channels, hw):
        return 4 * (2 * batch * channels * hw * hw + channels * channels * 9 + channels)

    def flops(self, batch, channels, hw):
        return 2 * batch * channels * channels * 9 * hw * hw


# --- sum ------------------------------------------------------------------------------------------------


class Sum(Workload):
    name = "sum"
    title = "sum of all elements, f32"
    sizes = {"full": {"n": 64 * 2**20}, "tiny": {"n": 1000}}
    target = Target(1.0, ">= 1x numpy")

    def inputs(self, rng, n):
        return (rng.random(n, dtype=np.float32),)

    def numpy(self, x):
        return np.sum(x)

    def flowjit(self):
        return fj.jit(lambda x: fnp.sum(x))

    def jax(self):
        import jax
        import jax.numpy as jnp

        return jax.jit(lambda x: jnp.sum(x))

    def torch(self):
        import torch

        return lambda x: torch.sum(x)

    def traffic_bytes(self, n):
        return 4 * n

    def flops(self, n):
        return n


# --- call overhead --------------------------------------------------------------------------------------


class CallOverhead(Workload):
    name = "call_overhead"
    title = "call overhead: x + 1 on shape (1,), f32"
    bound = "overhead"
    sizes = {"full": {"n": 1}, "tiny": {"n": 1}}

    def inputs(self, rng, n):
        return (np.ones((n,), np.float32),)

    def numpy(self, x):
        return x + 1

    def flowjit(self):
        return fj.jit(lambda x: x + 1)

    def jax(self):
        import jax

        return jax.jit(lambda x: x + 1)

    def torch(self):
        return lambda x: x + 1


# --- MLP train step -------------------------------------------------------------------------------------

LR = 0.01


class MLPTrainStep(Workload):
    name = "mlp_train_step"
    title = "MLP train step 784-1024-1024-10, relu, softmax cross-entropy (mean), SGD lr=0.01, f32"
    bound = "compute"
    sizes = {"full": {"batch": 256, "dims": (784, 1024, 1024, 10)}, "tiny": {"batch": 4, "dims": (6, 5, 4, 3)}}

    def inputs(self, rng, batch, dims):
        params = []
        for fan_in, fan_out in zip(dims[:-1], dims[1:]):
            params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32))
            params.append(rng.uniform(-0.1, 0.1, fan_out).astype(np.float32))
        x = rng.standard_normal((batch, dims[0]), dtype=np.float32)
        y = rng.integers(0, dims[-1], batch).astype(np.int64)
        return (*params, x, y)

    def numpy(self, w1, b1, w2, b2, w3, b3, x, y):
        """Forward and hand-written backward pass, then SGD: returns the six updated parameters."""
        h1 = x @ w1 + b1
        a1 = np.maximum(h1, 0)
        h2 = a1 @ w2 + b2
        a2 = np.maximum(h2, 0)
        z = a2 @ w3 + b3
        e = np.exp(z - z.max(axis=1, keepdims=True))
        dz = e / e.sum(axis=1, keepdims=True)
        dz[np.arange(len(y)), y] -= 1
        dz /= len(y)
        da2 = (dz @ w3.T) * (h2 > 0)
        da1 = (da2 @ w2.T) * (h1 > 0)
        grads = (x.T @ da1, da1.sum(0), a1.T @ da2, da2.sum(0), a2.T @ dz, dz.sum(0))
        return tuple(p - LR * g for p, g in zip((w1, b1, w2, b2, w3, b3), grads))

    def flowjit(self):
        if not hasattr(fj, "grad"):
            raise Skip("fj.grad is not available yet")

        def loss(params, x, y):
            w1, b1, w2, b2, w3, b3 = params
            a1 = nn.relu(x @ w1 + b1)
            a2 = nn.relu(a1 @ w2 + b2)
            return nn.cross_entropy(a2 @ w3 + b3, y)

        def step(w1, b1, w2, b2, w3, b3, x, y):
            params = (w1, b1, w2, b2, w3, b3)
            grads = fj.grad(loss)(params, x, y)
            return tuple(p - LR * g for p, g in zip(params, grads))

        return fj.jit(step)

    def jax(self):
        import jax
        import jax.numpy as jnp

        def loss(params, x, y):
            w1, b1, w2, b2, w3, b3 = params
            a1 = jax.nn.relu(x @ w1 + b1)
            a2 = jax.nn.relu(a1 @ w2 + b2)
            logp = jax.nn.log_softmax(a2 @ w3 + b3, axis=1)
            return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()

        def step(w1, b1, w2, b2, w3, b3, x, y):
            params = (w1, b1, w2, b2, w3, b3)
            grads = jax.grad(loss)(params, x, y)
            return tuple(p - LR * g for p, g in zip(params, grads))

        return jax.jit(step)

    def torch(self):
        import torch
        import torch.nn.functional as F

        def loss(params, x, y):
            w1, b1, w2, b2, w3, b3 = params
            a1 = torch.relu(x @ w1 + b1)
            a2 = torch.relu(a1 @ w2 + b2)
            return F.cross_entropy(a2 @ w3 + b3, y)

        def step(w1, b1, w2, b2, w3, b3, x, y):
            params = (w1, b1, w2, b2, w3, b3)
            grads = torch.func.grad(loss)(params, x, y)
            return tuple(p - LR * g for p, g in zip(params, grads))

        return step

    def traffic_bytes(self, batch, dims):
        weights = sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
        return 4 * (2 * weights + batch * dims[0]) + 8 * batch

    def flops(self, batch, dims):
        return 3 * 2 * batch * sum(a * b for a, b in zip(dims[:-1], dims[1:]))


WORKLOADS: list[Workload] = [
    Elementwise(),
    Matmul(1024),
    Matmul(2048),
    Softmax(),
    LayerNorm(),
    CNN(),
    ConvLayer(),
    Sum(),
    CallOverhead(),
    MLPTrainStep(),
]
