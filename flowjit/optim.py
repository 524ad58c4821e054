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
from collections.abc import Callable
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


def _checked_lr(optimizer) -> None:
    """A learning rate is a number >= 0 or a schedule: a callable of the step count."""
    if not callable(optimizer.lr):
        _check(optimizer, "lr")


def _lr_at(lr, state):
    """The learning rate for this update: a schedule sees the number of updates done so far (traced
    inside jit)."""
    return lr(state["step"]) if callable(lr) else lr


def _scaled(lr, x):
    """lr * x in x's dtype: a Python float lr is weak; a schedule's value (float64) is cast to it."""
    if isinstance(lr, int | float):
        return lr * x
    return fnp.astype(lr, _dtype(x)) * x


def _step_state(lr) -> dict:
    """A step counter in the state of optimizers whose learning rate is a schedule."""
    return {"step": np.zeros((), np.int64)} if callable(lr) else {}


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay (added to the
    gradient, as PyTorch's `weight_decay`). `lr` is a number or a schedule of the step count."""

    lr: float | Callable
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self):
        _checked_lr(self)
        _check(self, "momentum", 0.0, 1.0)
        _check(self, "weight_decay")
        if self.nesterov and self.momentum == 0.0:
            raise FlowjitValueError(f"{_construction_site()}: SGD: Nesterov momentum needs momentum > 0")

    def init(self, params):
        state = _step_state(self.lr)
        if self.momentum != 0.0:
            state["velocity"] = tree_map(_like, params)
        return state or ()

    def update(self, grads, state, params):
        lr = _lr_at(self.lr, state)
        new_state = {"step": fnp.add(state["step"], 1)} if callable(self.lr) else {}
        if self.weight_decay:
            grads = tree_map(lambda g, p: g + self.weight_decay * p, grads, params)
        if self.momentum == 0.0:
            return tree_map(lambda p, g: p - _scaled(lr, g), params, grads), new_state or state
        velocity = tree_map(lambda v, g: self.momentum * v + g, state["velocity"], grads)
        if self.nesterov:
            step = tree_map(lambda g, v: g + self.momentum * v, grads, velocity)
        else:
            step = velocity
        return tree_map(lambda p, s: p - _scaled(lr, s), params, step), {**new_state, "velocity": velocity}


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba) with bias correction; `weight_decay` adds L2 to the gradient. `lr` is a
    number or a schedule of the step count."""

    lr: float | Callable = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        _checked_lr(self)
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
        lr = _lr_at(self.lr, state)
        step, m, v, c1, c2 = self._moments(grads, state)
        direction = self._direction(m, v, c1, c2)
        new_params = tree_map(lambda p, d: p - fnp.astype(_scaled(lr, d), _dtype(p)), params, direction)
        return new_params, {"m": m, "v": v, "step": step}


@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): p -= lr * (adam_step + wd * p)."""

    weight_decay: float = 0.01

    def update(self, grads, state, params):
        lr = _lr_at(self.lr, state)
        step, m, v, c1, c2 = self._moments(grads, state)
        direction = self._direction(m, v, c1, c2)
        new_params = tree_map(
            lambda p, d: p - fnp.astype(_scaled(lr, d + self.weight_decay * p), _dtype(p)), params, direction
        )
        return new_params, {"m": m, "v": v, "step": step}


@dataclass(frozen=True)
class RMSprop:
    """RMSprop as PyTorch defines it: a running mean of squared gradients (decay `alpha`) divides the
    gradient; `centered` subtracts the squared running mean gradient first; optional momentum on the
    divided gradient and L2 `weight_decay` added to the gradient."""

    lr: float | Callable = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    def __post_init__(self):
        _checked_lr(self)
        _check(self, "alpha", 0.0, 1.0)
        _check(self, "eps")
        _check(self, "weight_decay")
        _check(self, "momentum", 0.0, 1.0)

    def init(self, params):
        state = {**_step_state(self.lr), "square_avg": tree_map(_like, params)}
        if self.centered:
            state["grad_avg"] = tree_map(_like, params)
        if self.momentum:
            state["momentum_buffer"] = tree_map(_like, params)
        return state

    def update(self, grads, state, params):
        new_state = {"step": fnp.add(state["step"], 1)} if callable(self.lr) else {}
        lr = _lr_at(self.lr, state)
        if self.weight_decay:
            grads = tree_map(lambda g, p: g + self.weight_decay * p, grads, params)
        a = self.alpha
        square_avg = tree_map(lambda s, g: a * s + (1.0 - a) * (g * g), state["square_avg"], grads)
        new_state["square_avg"] = square_avg
        if self.centered:
            grad_avg = tree_map(lambda s, g: a * s + (1.0 - a) * g, state["grad_avg"], grads)
            new_state["grad_avg"] = grad_avg
            denominator = tree_map(lambda s, m: fnp.sqrt(s - m * m) + self.eps, square_avg, grad_avg)
        else:
            denominator = tree_map(lambda s: fnp.sqrt(s) + self.eps, square_avg)
        direction = tree_map(lambda g, d: g / d, grads, denominator)
        if self.momentum:
            direction = tree_map(lambda b, d: self.momentum * b + d, state["momentum_buffer"], direction)
            new_state["momentum_buffer"] = direction
        return tree_map(lambda p, d: p - _scaled(lr, d), params, direction), new_state


@dataclass(frozen=True)
class Adagrad:
    """Adagrad (Duchi et al.) as PyTorch defines it: the gradient divided by the root of the sum of all
    squared gradients so far (starting from `initial_accumulator_value`), plus `eps`."""

    lr: float | Callable = 1e-2
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self):
        _checked_lr(self)
        _check(self, "eps")
        _check(self, "weight_decay")
        _check(self, "initial_accumulator_value")

    def init(self, params):
        start = self.initial_accumulator_value
        return {**_step_state(self.lr), "sum": tree_map(lambda p: _like(p) + start, params)}

    def update(self, grads, state, params):
        new_state = {"step": fnp.add(state["step"], 1)} if callable(self.lr) else {}
        lr = _lr_at(self.lr, state)
        if self.weight_decay:
            grads = tree_map(lambda g, p: g + self.weight_decay * p, grads, params)
        total = tree_map(lambda s, g: s + g * g, state["sum"], grads)
        direction = tree_map(lambda g, s: g / (fnp.sqrt(s) + self.eps), grads, total)
        return tree_map(lambda p, d: p - _scaled(lr, d), params, direction), {**new_state, "sum": total}


# --- gradient clipping ------------------------------------------------------------------------------------


def global_norm(tree):
    """sqrt of the sum of squares of every leaf: float64 if any leaf is float64, else float32."""
    leaves = tree_flatten(tree)[0]
    work = "float64" if any(_dtype(leaf) == np.float64 for leaf in leaves) else "float32"
    total = fnp.zeros((), work)
    for leaf in leaves:
        leaf = fnp.astype(leaf, work)
        total = fnp.add(total, fnp.sum(fnp.multiply(leaf, leaf)))
    return fnp.sqrt(total)


def clip_by_global_norm(grads, max_norm: float):
    """`grads` scaled by max_norm / global_norm(grads) when that norm exceeds `max_norm` (so the
    clipped tree's norm is max_norm), unchanged otherwise; as optax's and PyTorch's `clip_grad_norm_`."""
    if not max_norm > 0:
        raise FlowjitValueError(f"{user_location()}: clip_by_global_norm: max_norm must be > 0; found {max_norm}")
    norm = global_norm(grads)
    scale = fnp.divide(max_norm, fnp.maximum(norm, max_norm))
    return tree_map(lambda g: g * fnp.astype(scale, _dtype(g)), grads)


# --- learning-rate schedules ----------------------------------------------------------------------------
#
# A schedule maps the number of updates done so far (0 for the first update; an int, or the traced
# int64 step count inside jit) to a float64 learning rate, as optax's schedules do.


def _float_step(step):
    return fnp.astype(step, "float64")


def constant_schedule(value: float) -> Callable:
    """lr(step) = value."""
    return lambda step: fnp.full((), value, "float64")


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Callable:
    """From init_value to end_value linearly over transition_steps, then end_value."""

    def schedule(step):
        fraction = fnp.minimum(_float_step(step) / max(transition_steps, 1), 1.0)
        return init_value + (end_value - init_value) * fraction

    return schedule


def exponential_decay(init_value: float, decay_steps: int, decay_rate: float, staircase: bool = False) -> Callable:
    """init_value * decay_rate ** (step / decay_steps), the exponent floored if `staircase`."""
    if decay_steps <= 0:
        raise FlowjitValueError(f"{user_location()}: exponential_decay: decay_steps must be > 0; found {decay_steps}")

    def schedule(step):
        exponent = _float_step(step) / decay_steps
        if staircase:
            exponent = fnp.floor(exponent)
        return init_value * fnp.power(np.float64(decay_rate), exponent)

    return schedule


def step_decay(init_value: float, step_size: int, gamma: float = 0.1) -> Callable:
    """init_value * gamma ** floor(step / step_size): PyTorch's StepLR."""
    return exponential_decay(init_value, step_size, gamma, staircase=True)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Callable:
    """From init_value to alpha * init_value along half a cosine over decay_steps, then constant."""
    if decay_steps <= 0:
        raise FlowjitValueError(
            f"{user_location()}: cosine_decay_schedule: decay_steps must be > 0; found {decay_steps}"
        )

    def schedule(step):
        progress = fnp.minimum(_float_step(step), float(decay_steps)) / decay_steps
        cosine = 0.5 * (1.0 + fnp.cos(np.pi * progress))
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Callable:
    """Linear warmup from init_value to peak_value over warmup_steps, then a cosine decay to end_value
    reached at decay_steps (counted from 0, warmup included), as optax's."""
    if not 0 <= warmup_steps < decay_steps:
        raise FlowjitValueError(
            f"{user_location()}: warmup_cosine_decay_schedule needs 0 <= warmup_steps < decay_steps; found "
            f"{warmup_steps} and {decay_steps}"
        )
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    decay = cosine_decay_schedule(peak_value - end_value, decay_steps - warmup_steps)

    def schedule(step):
        t = _float_step(step)
        return fnp.where(t < warmup_steps, warmup(t), decay(t - warmup_steps) + end_value)

    return schedule


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


__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "RMSprop",
    "apply_to_variables",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "global_norm",
    "linear_schedule",
    "step_decay",
    "warmup_cosine_decay_schedule",
]
