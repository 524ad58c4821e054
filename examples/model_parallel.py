"""Model parallelism on one machine: the digits MLP with its layers on two CPU devices.

Each layer's weights, bias and Adam moments are `fj.Variable`s pinned to one device
(`with fj.device("cpu:1")`); the placer colocates every update with its variable, puts the
gradient ops next to the ops they differentiate, and places the rest by its cost model. The
partitioner cuts the step into one function per device joined by send/recv pairs, and the runtime
runs both at once. The same model trained on one device gives identical results.

    FLOWJIT_CPU_DEVICES=2 python examples/model_parallel.py [--epochs N]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("FLOWJIT_CPU_DEVICES", "2")  # before flowjit reads it: two CPU devices

import numpy as np  # noqa: E402
from train_digits import batches, init_mlp, load_digits  # noqa: E402

import flowjit as fj  # noqa: E402
import flowjit.nn as nn  # noqa: E402
import flowjit.numpy as fnp  # noqa: E402

# The placement rules, by how their reasons start (flowjit/passes/place.py, partition.py).
RULES = (
    ("constraint", "a device constraint"),
    ("colocated", "colocation with a variable"),
    ("cost model", "the cost model"),
    ("transfer", "send/recv of a cut edge"),
    ("created where", "constant, where used"),
    ("copy of the constant", "constant, where used"),
)


class PlacedMLP:
    """An MLP whose layer i lives on `layer_devices[i]`: weights, bias and Adam moments."""

    def __init__(self, params, layer_devices, lr=1e-2):
        self.opt = fj.optim.Adam(lr)
        self.layers = len(params) // 2
        tag = "-".join(layer_devices)
        self.device = {k: layer_devices[int(k[1:])] for k in params}
        self.params = {k: fj.Variable(v, name=f"mp.{tag}.{k}") for k, v in params.items()}
        state = self.opt.init(params)
        self.m = {k: fj.Variable(v, name=f"mp.{tag}.m.{k}") for k, v in state["m"].items()}
        self.v = {k: fj.Variable(v, name=f"mp.{tag}.v.{k}") for k, v in state["v"].items()}
        self.count = fj.Variable(state["step"], name=f"mp.{tag}.step")
        self.step = fj.jit(self._step)

    def logits(self, params, x):
        h = x.reshape(x.shape[0], -1)
        for i in range(self.layers):
            with fj.device(self.device[f"w{i}"]):
                h = h @ params[f"w{i}"] + params[f"b{i}"]
                if i < self.layers - 1:
                    h = nn.relu(h)
        return h

    def _read(self, variables):
        values = {}
        for k, variable in variables.items():
            with fj.device(self.device[k]):  # read where the variable lives
                values[k] = variable.value
        return values

    def _step(self, x, y):
        params = self._read(self.params)
        state = {"m": self._read(self.m), "v": self._read(self.v), "step": self.count.value}
        loss, grads = fj.value_and_grad(lambda p: nn.cross_entropy(self.logits(p, x), y))(params)
        new_params, new_state = self.opt.update(grads, state, params)
        for k in params:
            self.params[k].assign(new_params[k])
            self.m[k].assign(new_state["m"][k])
            self.v[k].assign(new_state["v"][k])
        self.count.assign(new_state["step"])
        return loss

    def weights(self) -> dict:
        return {k: v.value for k, v in self.params.items()}

    def accuracy(self, x, y) -> float:
        predict = fj.jit(lambda params, x: fnp.argmax(self.logits(params, x), axis=1))
        return float(np.mean(predict(self.weights(), x) == y))


def train(model, train_set, epochs):
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(epochs):
        losses += [float(model.step(xb, yb)) for xb, yb in batches(*train_set, rng)]
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--full-report", action="store_true", help="print every op of the placement report")
    args = parser.parse_args(argv)
    print("devices:", ", ".join(d.name for d in fj.devices()))
    if len(fj.devices()) < 2:
        raise SystemExit("this demo needs two CPU devices: run it with FLOWJIT_CPU_DEVICES=2")
    train_set, test_set = load_digits()
    init = init_mlp(fj.random.key(0))
    placed = PlacedMLP(init, ("cpu:0", "cpu:1"))
    single = PlacedMLP(init, ("cpu:0", "cpu:0"))

    x0, y0 = next(batches(*train_set, np.random.default_rng(1)))
    lowered = placed.step.lower(x0, y0)
    report = lowered.as_text("placement").split("\nfunc @")[0].splitlines()
    print("\n=== placement of one training step " + "=" * 40)
    if args.full_report:
        print("\n".join(report))
    else:  # how many ops each rule put on each device, then the transfers
        graph = lowered.graph("placement")
        tally: dict[tuple[str, str], int] = {}
        for op in graph.ops:
            reason = graph.placement[op]
            rule = next((name for prefix, name in RULES if reason.startswith(prefix)), reason)
            key = (op.device.rsplit("device:", 1)[1], rule)
            tally[key] = tally.get(key, 0) + 1
        for (device, rule), count in sorted(tally.items()):
            print(f"//   {device}: {count:3d} ops by rule: {rule}")
        print("\n".join(line for line in report if line.startswith(("// transfers", "//   cpu"))))
        print("(--full-report prints every op with its device, source line and reason)")

    results = {}
    for name, model in (("two devices", placed), ("one device", single)):
        start = time.perf_counter()
        losses = train(model, train_set, args.epochs)
        seconds = time.perf_counter() - start
        results[name] = (losses, model)
        print(
            f"{name}: final loss {losses[-1]:.4f}, test accuracy {model.accuracy(*test_set):.2%}, "
            f"{args.epochs} epochs in {seconds:.1f} s"
        )
    (losses_2, model_2), (losses_1, model_1) = results["two devices"], results["one device"]
    print(f"training step: {placed.step.lower(x0, y0).compile().executable.backend}")
    worst = max(float(np.max(np.abs(model_2.params[k].value - model_1.params[k].value))) for k in model_1.params)
    same = losses_2 == losses_1 and worst == 0.0
    print(f"identical to single-device training: {same} (largest weight difference {worst:g})")
    if not same:
        raise SystemExit("model-parallel training diverged from single-device training")


if __name__ == "__main__":
    main()
