"""Train an MLP and a small CNN on scikit-learn's bundled `digits` data (8x8 images, no download).

The whole train step (forward, gradient, optimizer update) is one compiled function. The MLP keeps
its parameters and optimizer state in `fj.Variable`s, as the TensorFlow paper's programs do: the
step reads them, differentiates the loss with respect to their values, and assigns the updates in
place. The CNN is written functionally (parameters in, parameters out). Both are checkpointed and
reloaded at the end.

    python examples/train_digits.py [--epochs N] [--model mlp|cnn|both]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
from tqdm import tqdm

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp

BATCH = 64


def load_digits(seed: int = 0):
    """Digits as float32 in [0, 1], split 80/20 into train and test."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = (data.images / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def batches(x, y, rng):
    """Shuffled full batches (a fixed batch shape means one compiled step)."""
    order = rng.permutation(len(x))
    for start in range(0, len(x) - BATCH + 1, BATCH):
        idx = order[start : start + BATCH]
        yield x[idx], y[idx]


# --- MLP with its state in Variables -------------------------------------------------------------------


def init_mlp(key, sizes=(64, 128, 10)):
    params = {}
    keys = fj.random.split(key, len(sizes) - 1)
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = np.asarray(nn.initializers.he_normal(keys[i], (fan_in, fan_out)))
        params[f"b{i}"] = np.zeros(fan_out, np.float32)
    return params


def mlp_logits(params, x):
    h = x.reshape(x.shape[0], -1)
    layers = len(params) // 2
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = nn.relu(h)
    return h


def mlp_loss(params, x, y):
    return nn.cross_entropy(mlp_logits(params, x), y)


class MLPTrainer:
    """Parameters and Adam state live in Variables; `step(x, y)` updates them in place."""

    def __init__(self, params, lr=1e-2):
        self.opt = fj.optim.Adam(lr)
        self.params = {k: fj.Variable(v, name=f"mlp.{k}") for k, v in params.items()}
        state = self.opt.init(params)
        self.state = fj.tree_map(lambda v: fj.Variable(v, name="mlp.adam"), state)
        self.step = fj.jit(self._step)
        self.predict = fj.jit(lambda x: fnp.argmax(mlp_logits(self._values(self.params), x), axis=1))

    @staticmethod
    def _values(tree):
        return fj.tree_map(lambda v: v.value, tree)

    def _step(self, x, y):
        params, state = self._values(self.params), self._values(self.state)
        loss, grads = fj.value_and_grad(mlp_loss)(params, x, y)
        new_params, new_state = self.opt.update(grads, state, params)
        fj.optim.apply_to_variables(self.params, new_params)
        fj.optim.apply_to_variables(self.state, new_state)
        return loss

    def checkpoint(self):
        return {"params": self.params, "state": self.state}


# --- CNN, functional --------------------------------------------------------------------------------


def init_cnn(key, channels=16):
    k1, k2 = fj.random.split(key)
    return {
        "conv_w": np.asarray(nn.initializers.he_normal(k1, (channels, 1, 3, 3))),
        "conv_b": np.zeros(channels, np.float32),
        "dense_w": np.asarray(nn.initializers.glorot_uniform(k2, (channels * 4 * 4, 10))),
        "dense_b": np.zeros(10, np.float32),
    }


def cnn_logits(params, x):
    h = x.reshape(x.shape[0], 1, 8, 8)
    h = nn.relu(nn.conv2d(h, params["conv_w"], params["conv_b"], padding="SAME"))
    h = nn.max_pool2d(h, 2)
    return h.reshape(h.shape[0], -1) @ params["dense_w"] + params["dense_b"]


def cnn_loss(params, x, y):
    return nn.cross_entropy(cnn_logits(params, x), y)


OPT = fj.optim.SGD(0.1, momentum=0.9)


@fj.jit
def cnn_step(params, state, x, y):
    loss, grads = fj.value_and_grad(cnn_loss)(params, x, y)
    params, state = OPT.update(grads, state, params)
    return params, state, loss


@fj.jit
def cnn_predict(params, x):
    return fnp.argmax(cnn_logits(params, x), axis=1)


# --- driver ---------------------------------------------------------------------------------------------


def run_epochs(name, epochs, train, step):
    rng = np.random.default_rng(1)
    start = time.perf_counter()
    bar = tqdm(range(epochs), desc=f"{name} training", unit="epoch")
    for _ in bar:
        losses = [float(step(xb, yb)) for xb, yb in batches(*train, rng)]
        bar.set_postfix(loss=f"{np.mean(losses):.4f}")
    return time.perf_counter() - start


def train_mlp(epochs, train, test, workdir):
    trainer = MLPTrainer(init_mlp(fj.random.key(0)))
    seconds = run_epochs("MLP", epochs, train, trainer.step)
    accuracy = float(np.mean(trainer.predict(test[0]) == test[1]))
    print(f"MLP: test accuracy {accuracy:.2%} after {epochs} epochs in {seconds:.1f} s")
    path = os.path.join(workdir, "mlp.ckpt")
    fj.save_checkpoint(path, trainer.checkpoint())
    restored = MLPTrainer(init_mlp(fj.random.key(99)))
    loaded = fj.load_checkpoint(path)
    fj.optim.apply_to_variables(restored.params, loaded["params"])
    fj.optim.apply_to_variables(restored.state, loaded["state"])
    again = float(np.mean(restored.predict(test[0]) == test[1]))
    print(f"MLP: checkpoint {path} reloaded into fresh variables: accuracy {again:.2%}")
    return accuracy


def train_cnn(epochs, train, test, workdir):
    params = init_cnn(fj.random.key(0))
    state = OPT.init(params)
    box = {"params": params, "state": state}

    def step(xb, yb):
        box["params"], box["state"], loss = cnn_step(box["params"], box["state"], xb, yb)
        return loss

    seconds = run_epochs("CNN", epochs, train, step)
    accuracy = float(np.mean(cnn_predict(box["params"], test[0]) == test[1]))
    print(f"CNN: test accuracy {accuracy:.2%} after {epochs} epochs in {seconds:.1f} s")
    path = os.path.join(workdir, "cnn.ckpt")
    fj.save_checkpoint(path, box["params"])
    again = float(np.mean(cnn_predict(fj.load_checkpoint(path), test[0]) == test[1]))
    print(f"CNN: checkpoint {path} reloaded: accuracy {again:.2%}")
    return accuracy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--model", choices=("mlp", "cnn", "both"), default="both")
    args = parser.parse_args(argv)
    train, test = load_digits()
    print(f"digits: {len(train[0])} training and {len(test[0])} test images of 8x8")
    with tempfile.TemporaryDirectory() as workdir:
        results = {}
        if args.model in ("mlp", "both"):
            results["mlp"] = train_mlp(args.epochs, train, test, workdir)
        if args.model in ("cnn", "both"):
            results["cnn"] = train_cnn(args.epochs, train, test, workdir)
    return results


if __name__ == "__main__":
    main()
