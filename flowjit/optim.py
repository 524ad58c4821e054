"""Optimizers as pure functions of pytrees, usable inside one jitted train step:

    opt = fj.optim.Adam(1e-3)
    state = opt.init(params)
    params, state = opt.update(grads, state, params)

`update` returns the new parameters and the new optimizer state (same tree structures). The
update rule of each optimizer is written once here as graph code; new optimizers are user code, as
the TensorFlow paper intended.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from flowjit import numpy as fnp
from flowjit.errors import FlowjitValueError
from flowjit.frontend.pytree import tree_flatten, tree_map
from flowjit.ir.location import UNKNOWN, Location, _display_path, is_internal_file, user_location


def _construction_site() -> Location:
    """The user's line that built the optimizer. `user_location` would stop at the `__init__` that
    dataclasses generate (file "<string>"), so those frames are skipped too."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_internal_file(filename) and not filename.startswith("<"):
            return Location(_display_path(filename), frame.f_lineno)
        frame = frame.f_back
    return UNKNOWN


def _check(optimizer, name: str, low: float = 0.0, high: float | None = None) -> None:
    value = getattr(optimizer, name)
    # Written so that nan fails too.
    if not (value >= low and (high is None or value < high)):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise FlowjitValueError(
            f"{_construction_site()}: {type(optimizer).__name__}: hyperparameter {name} must be {bound}; found {value}"
        )


def _dtype(x):
    """The dtype of a leaf. Not `fnp.asarray(x).dtype`: that treats a numpy float64 scalar (what eager
    arithmetic on 0-d arrays returns) as a weak Python float, i.e. float32."""
    return x.dtype if hasattr(x, "dtype") else fnp.asarray(x).dtype


def _like(p):
    return fnp.zeros(fnp.shape(p), _dtype(p))


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay."""

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self):
        _check(self, "lr")
        _check(self, "momentum", 0.0, 1.0)
        _check(self, "weight_decay")
        if self.nesterov and self.momentum == 0.0:
            raise FlowjitValueError(f"{_construction_site()}: SGD: Nesterov momentum needs momentum > 0")

    def init(self, params):
        if self.momentum == 0.0:
            return ()
        return {"velocity": tree_map(_like, params)}

    def update(self, grads, state, params):
        if self.weight_decay:
            grads = tree_map(lambda g, p: g + self.weight_decay * p, grads, params)
        if self.momentum == 0.0:
            return tree_map(lambda p, g: p - self.lr * g, params, grads), state
        velocity = tree_map(lambda v, g: self.momentum * v + g, state["velocity"], grads)
        if self.nesterov:
            step = tree_map(lambda g, v: g + self.momentum * v, grads, velocity)
        else:
            step = velocity
        return tree_map(lambda p, s: p - self.lr * s, params, step), {"velocity": velocity}


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba) with bias correction; `weight_decay` adds L2 to the gradient."""

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        _check(self, "lr")
        _check(self, "b1", 0.0, 1.0)
        _check(self, "b2", 0.0, 1.0)
        _check(self, "eps")
        _check(self, "weight_decay")

    def init(self, params):
        return {"m": tree_map(_like, params), "v": tree_map(_like, params), "step": np.zeros((), np.int64)}

    def _decay_grads(self, grads, params):
        if not self.weight_decay:
            return grads
        return tree_map(lambda g, p: g + self.weight_decay * p, grads, params)

    def _moments(self, grads, state):
        step = fnp.add(state["step"], 1)
        m = tree_map(lambda m, g: self.b1 * m + (1.0 - self.b1) * g, state["m"], grads)
        v = tree_map(lambda v, g: self.b2 * v + (1.0 - self.b2) * (g * g), state["v"], grads)
        # The corrections are scalars: computed in float64, then cast to each leaf's dtype (below), so
        # float64 parameters get exact bias correction and float32 ones stay float32 elementwise.
        t = fnp.astype(step, "float64")
        correction1 = fnp.subtract(1.0, fnp.power(np.float64(self.b1), t))
        correction2 = fnp.subtract(1.0, fnp.power(np.float64(self.b2), t))
        return step, m, v, correction1, correction2

    def _direction(self, m, v, c1, c2):
        def leaf(m_, v_):
            dtype = _dtype(m_)
            return (m_ / fnp.astype(c1, dtype)) / (fnp.sqrt(v_ / fnp.astype(c2, dtype)) + self.eps)

        return tree_map(leaf, m, v)

    def update(self, grads, state, params):
        grads = self._decay_grads(grads, params)
        step, m, v, c1, c2 = self._moments(grads, state)
        direction = self._direction(m, v, c1, c2)
        new_params = tree_map(lambda p, d: p - fnp.astype(self.lr * d, _dtype(p)), params, direction)
        return new_params, {"m": m, "v": v, "step": step}


@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): p -= lr * (adam_step + wd * p)."""

    weight_decay: float = 0.01

    def update(self, grads, state, params):
        step, m, v, c1, c2 = self._moments(grads, state)
        direction = self._direction(m, v, c1, c2)
        new_params = tree_map(
            lambda p, d: p - fnp.astype(self.lr * (d + self.weight_decay * p), _dtype(p)), params, direction
        )
        return new_params, {"m": m, "v": v, "step": step}


def apply_to_variables(variables, new_values) -> None:
    """Assign a tree of new values to a matching tree of `fj.Variable`s (inside or outside jit)."""
    targets, treedef = tree_flatten(variables)
    values = tree_flatten(new_values)[0]
    if len(values) != len(targets):
        raise FlowjitValueError(
            f"{user_location()}: apply_to_variables: expected {len(targets)} values for the variables {treedef}; "
            f"found {len(values)}"
        )
    for variable, value in zip(targets, values):
        variable.assign(value)


__all__ = ["SGD", "Adam", "AdamW", "apply_to_variables"]
