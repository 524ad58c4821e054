"""flowjit.optim against hand-written float64 numpy update rules over several steps on nested pytrees,
eagerly and inside jitted steps (CPU and interpreter); hyperparameter validation; Variables."""

import inspect
import math

import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit import optim
from flowjit.errors import FlowjitValueError
from flowjit.frontend.pytree import tree_flatten, tree_unflatten


def make_tree(rng, dtype):
    """A nested dict/list/tuple pytree with a matrix, a vector and a scalar leaf."""
    return {
        "w": rng.standard_normal((3, 2)).astype(dtype),
        "layers": [rng.standard_normal(4).astype(dtype), {"b": np.asarray(rng.standard_normal(), dtype)}],
        "pair": (rng.standard_normal((2, 2)).astype(dtype),),
    }


def gradient_sequence(steps, dtype):
    rng = np.random.default_rng(100)
    return [make_tree(rng, dtype) for _ in range(steps)]


# --- numpy references, one leaf at a time, float64 ---------------------------------------------------------


def ref_sgd(lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    def step(p, g, state, t):
        g = g + weight_decay * p
        if momentum == 0.0:
            return p - lr * g, state
        v = momentum * state + g
        return p - lr * (g + momentum * v if nesterov else v), v

    return step


def ref_adam(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False):
    def step(p, g, state, t):
        m, v = state
        if not decoupled:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        direction = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        if decoupled:
            direction = direction + weight_decay * p
        return p - lr * direction, (m, v)

    return step


def ref_rmsprop(lr, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False):
    def step(p, g, state, t):
        square, mean, buffer = state
        g = g + weight_decay * p
        square = alpha * square + (1 - alpha) * g * g
        mean = alpha * mean + (1 - alpha) * g
        direction = g / (np.sqrt(square - mean * mean if centered else square) + eps)
        if momentum:
            buffer = momentum * buffer + direction
            direction = buffer
        return p - lr * direction, (square, mean, buffer)

    return step


def ref_adagrad(lr, eps=1e-10, weight_decay=0.0):
    def step(p, g, total, t):
        g = g + weight_decay * p
        total = total + g * g
        return p - lr * g / (np.sqrt(total) + eps), total

    return step


def scheduled(rule_for_lr, schedule):
    """A reference rule whose learning rate at update t (from 1) is schedule(t - 1)."""

    def step(p, g, state, t):
        return rule_for_lr(schedule(t - 1))(p, g, state, t)

    return step


def run_reference(rule, initial_state, params, grads_seq):
    leaves, treedef = tree_flatten(params)
    leaves = [leaf.astype(np.float64) for leaf in leaves]
    states = [initial_state(leaf) for leaf in leaves]
    for t, grads in enumerate(grads_seq, start=1):
        g_leaves = [g.astype(np.float64) for g in tree_flatten(grads)[0]]
        stepped = [rule(p, g, s, t) for p, g, s in zip(leaves, g_leaves, states)]
        leaves, states = [p for p, _ in stepped], [s for _, s in stepped]
    return tree_unflatten(treedef, leaves)


def zero_momentum(p):
    return np.zeros_like(p)


def zero_moments(p):
    return (np.zeros_like(p), np.zeros_like(p))


def zero_triple(p):
    return (np.zeros_like(p), np.zeros_like(p), np.zeros_like(p))


def half_accumulator(p):
    return np.full_like(p, 0.5)


def ref_cosine(t, init=0.1, steps=4, alpha=0.1):
    return init * ((1 - alpha) * 0.5 * (1 + np.cos(np.pi * min(t, steps) / steps)) + alpha)


def ref_warmup_cosine(t):
    return 0.05 * t / 2 if t < 2 else 0.001 + (0.05 - 0.001) * 0.5 * (1 + np.cos(np.pi * min(t - 2, 3) / 3))


# (optimizer, numpy rule, initial reference state per leaf)
CASES = {
    "sgd": (optim.SGD(0.1), ref_sgd(0.1), zero_momentum),
    "sgd_wd": (optim.SGD(0.05, weight_decay=0.1), ref_sgd(0.05, weight_decay=0.1), zero_momentum),
    "momentum": (optim.SGD(0.1, momentum=0.9), ref_sgd(0.1, 0.9), zero_momentum),
    "nesterov_wd": (
        optim.SGD(0.1, momentum=0.8, nesterov=True, weight_decay=0.01),
        ref_sgd(0.1, 0.8, True, 0.01),
        zero_momentum,
    ),
    "adam": (optim.Adam(0.01), ref_adam(0.01), zero_moments),
    "adam_l2": (
        optim.Adam(0.02, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1),
        ref_adam(0.02, 0.8, 0.99, 1e-6, 0.1),
        zero_moments,
    ),
    "adamw": (optim.AdamW(0.01, weight_decay=0.1), ref_adam(0.01, weight_decay=0.1, decoupled=True), zero_moments),
    "rmsprop": (optim.RMSprop(0.01), ref_rmsprop(0.01), zero_triple),
    "rmsprop_centered_momentum": (
        optim.RMSprop(0.02, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.5, centered=True),
        ref_rmsprop(0.02, 0.9, 1e-6, 0.1, 0.5, True),
        zero_triple,
    ),
    "adagrad": (
        optim.Adagrad(0.1, eps=1e-8, weight_decay=0.05, initial_accumulator_value=0.5),
        ref_adagrad(0.1, 1e-8, 0.05),
        half_accumulator,
    ),
    "sgd_step_decay": (
        optim.SGD(optim.step_decay(0.1, 2, 0.5), momentum=0.9),
        scheduled(lambda lr: ref_sgd(lr, 0.9), lambda t: 0.1 * 0.5 ** (t // 2)),
        zero_momentum,
    ),
    "sgd_exponential": (
        optim.SGD(optim.exponential_decay(0.1, 3, 0.5)),
        scheduled(ref_sgd, lambda t: 0.1 * 0.5 ** (t / 3)),
        zero_momentum,
    ),
    "adam_cosine": (
        optim.Adam(optim.cosine_decay_schedule(0.1, 4, alpha=0.1)),
        scheduled(ref_adam, ref_cosine),
        zero_moments,
    ),
    "adamw_warmup_cosine": (
        optim.AdamW(optim.warmup_cosine_decay_schedule(0.0, 0.05, 2, 5, 0.001), weight_decay=0.1),
        scheduled(lambda lr: ref_adam(lr, weight_decay=0.1, decoupled=True), ref_warmup_cosine),
        zero_moments,
    ),
    "rmsprop_linear": (
        optim.RMSprop(optim.linear_schedule(0.02, 0.0, 4)),
        scheduled(ref_rmsprop, lambda t: 0.02 * max(1 - t / 4, 0.0)),
        zero_triple,
    ),
    "adagrad_constant": (optim.Adagrad(optim.constant_schedule(0.1)), ref_adagrad(0.1), np.zeros_like),
}
STEPS = 5


def leaves_close(actual, expected, rtol, atol):
    actual_leaves, actual_def = tree_flatten(actual)
    expected_leaves, expected_def = tree_flatten(expected)
    assert actual_def == expected_def
    for a, e in zip(actual_leaves, expected_leaves):
        assert np.shape(a) == np.shape(e)
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", list(CASES))
def test_eager_updates_match_numpy_float64(name):
    opt, rule, initial_state = CASES[name]
    params = make_tree(np.random.default_rng(0), np.float64)
    grads_seq = gradient_sequence(STEPS, np.float64)
    state = opt.init(params)
    new = params
    for grads in grads_seq:
        new, state = opt.update(grads, state, new)
    for leaf in tree_flatten(new)[0]:
        assert np.asarray(leaf).dtype == np.float64
    leaves_close(new, run_reference(rule, initial_state, params, grads_seq), rtol=1e-12, atol=1e-14)
    if isinstance(opt, optim.Adam):
        assert int(state["step"]) == STEPS


def opt_step(name):
    """One jitted update per optimizer (module-level so each case compiles once per target)."""
    opt = CASES[name][0]
    return lambda grads, state, params: opt.update(grads, state, params)


_STEPS = {}


@pytest.mark.parametrize("target", [None, "interpreter"])
@pytest.mark.parametrize(
    "name", ["sgd", "nesterov_wd", "adam", "adamw", "rmsprop_centered_momentum", "adagrad", "adamw_warmup_cosine"]
)
def test_jitted_updates_match_numpy_float32(name, target):
    if (name, target) not in _STEPS:
        _STEPS[name, target] = fj.jit(opt_step(name), target=target)
    step = _STEPS[name, target]
    opt, rule, initial_state = CASES[name]
    params = make_tree(np.random.default_rng(0), np.float32)
    grads_seq = gradient_sequence(STEPS, np.float32)
    state = opt.init(params)
    new = params
    for grads in grads_seq:
        new, state = step(grads, state, new)
    for leaf in tree_flatten(new)[0]:
        assert leaf.dtype == np.float32
    leaves_close(new, run_reference(rule, initial_state, params, grads_seq), rtol=2e-5, atol=2e-6)


def test_adam_bias_correction_first_step_is_lr_times_sign():
    # With zero moments, step 1 moves every coordinate by lr * g / (|g| + eps) ~ lr * sign(g).
    params = {"x": np.zeros(5)}
    grads = {"x": np.array([3.0, -0.5, 1e-3, -20.0, 0.25])}
    new, state = optim.Adam(0.1, eps=1e-12).update(grads, optim.Adam(0.1).init(params), params)
    np.testing.assert_allclose(new["x"], -0.1 * np.sign(grads["x"]), rtol=1e-9)
    np.testing.assert_allclose(state["m"]["x"], 0.1 * grads["x"], rtol=1e-12)
    np.testing.assert_allclose(state["v"]["x"], 0.001 * grads["x"] ** 2, rtol=1e-12)


def test_adamw_decay_is_decoupled_from_the_moments():
    params = {"x": np.full(3, 2.0)}
    zero = {"x": np.zeros(3)}
    adamw, adam_l2 = optim.AdamW(0.1, weight_decay=0.5), optim.Adam(0.1, weight_decay=0.5)
    new, state = adamw.update(zero, adamw.init(params), params)
    np.testing.assert_allclose(new["x"], 2.0 - 0.1 * 0.5 * 2.0)  # zero gradient: only the decay acts
    assert not state["m"]["x"].any()  # and it does not enter the moments
    new_l2, state_l2 = adam_l2.update(zero, adam_l2.init(params), params)
    np.testing.assert_allclose(state_l2["m"]["x"], 0.1 * 0.5 * 2.0)  # L2 goes through the moments
    np.testing.assert_allclose(new_l2["x"], 2.0 - 0.1, rtol=1e-6)


def test_state_structure_and_dtypes():
    params = make_tree(np.random.default_rng(0), np.float32)
    _, treedef = tree_flatten(params)
    assert optim.SGD(0.1).init(params) == ()
    velocity = optim.SGD(0.1, momentum=0.5).init(params)["velocity"]
    assert tree_flatten(velocity)[1] == treedef
    state = optim.Adam().init(params)
    assert tree_flatten(state["m"])[1] == treedef and tree_flatten(state["v"])[1] == treedef
    assert all(np.asarray(leaf).dtype == np.float32 and not np.any(leaf) for leaf in tree_flatten(state["m"])[0])
    assert np.asarray(state["step"]).dtype == np.int64 and int(state["step"]) == 0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.SGD(-0.1), "lr"),
        (lambda: optim.SGD(0.1, momentum=1.0), "momentum"),
        (lambda: optim.SGD(0.1, momentum=-0.5), "momentum"),
        (lambda: optim.SGD(0.1, nesterov=True), "Nesterov"),
        (lambda: optim.SGD(0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: optim.SGD(float("nan")), "lr"),
        (lambda: optim.Adam(b1=1.0), "b1"),
        (lambda: optim.Adam(b2=-0.1), "b2"),
        (lambda: optim.Adam(eps=-1e-8), "eps"),
        (lambda: optim.AdamW(weight_decay=-0.01), "weight_decay"),
    ],
)
def test_hyperparameter_validation(make, message):
    with pytest.raises(FlowjitValueError, match=message) as info:
        make()
    assert "test_optim.py:" in str(info.value)


def test_validation_error_names_the_user_line():
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(FlowjitValueError) as info:
        optim.Adam(lr=-1.0)
    assert f"test_optim.py:{line}" in str(info.value)


def test_mismatched_trees_are_an_error():
    params = {"a": np.zeros(2), "b": np.zeros(3)}
    with pytest.raises(FlowjitValueError, match="structure"):
        optim.SGD(0.1).update({"a": np.zeros(2)}, (), params)


# --- a whole train step in one jit ---------------------------------------------------------------------------

_X = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
_Y = (_X[:, 0] + _X[:, 1] > 0).astype(np.int32)
_ADAM = optim.Adam(0.05)


def _loss(params, x, y):
    hidden = nn.relu(nn.linear(x, params["w1"], params["b1"]))
    return nn.cross_entropy(nn.linear(hidden, params["w2"], params["b2"]), y)


def _train_step(params, state, x, y):
    loss, grads = fj.value_and_grad(_loss)(params, x, y)
    params, state = _ADAM.update(grads, state, params)
    return params, state, loss


def test_one_jitted_train_step_matches_eager_and_learns():
    rng = np.random.default_rng(2)
    params = {
        "w1": (rng.standard_normal((4, 8)) * 0.5).astype(np.float32),
        "b1": np.zeros(8, np.float32),
        "w2": (rng.standard_normal((8, 2)) * 0.5).astype(np.float32),
        "b2": np.zeros(2, np.float32),
    }
    step = fj.jit(_train_step)
    jit_params, jit_state = params, _ADAM.init(params)
    eager_params, eager_state = params, _ADAM.init(params)
    losses = []
    for _ in range(30):
        jit_params, jit_state, loss = step(jit_params, jit_state, _X, _Y)
        eager_params, eager_state, _ = _train_step(eager_params, eager_state, _X, _Y)
        losses.append(float(loss))
    leaves_close(jit_params, eager_params, rtol=1e-3, atol=1e-4)
    assert int(jit_state["step"]) == 30
    assert losses[-1] < 0.5 * losses[0]


# --- Variables -----------------------------------------------------------------------------------------------


def test_apply_to_variables_eager_and_inside_jit():
    opt = optim.SGD(0.5, momentum=0.5)
    variables = {
        "w": fj.Variable(np.ones((2, 2), np.float32), name="opt_w"),
        "b": [fj.Variable(np.zeros(2), name="opt_b")],
    }
    state = opt.init({"w": variables["w"].numpy(), "b": [variables["b"][0].numpy()]})

    @fj.jit
    def step(state, g):
        values = {"w": variables["w"].value, "b": [variables["b"][0].value]}
        grads = {"w": fnp.full((2, 2), g, "float32"), "b": [fnp.full((2,), g, "float64")]}
        new_values, state = opt.update(grads, state, values)
        optim.apply_to_variables(variables, new_values)
        return state

    state = step(state, np.float32(1.0))
    state = step(state, np.float32(1.0))
    # velocity 1 then 1.5; w = 1 - 0.5 * (1 + 1.5) = -0.25; b = 0 - 1.25 = -1.25
    np.testing.assert_allclose(variables["w"].numpy(), np.full((2, 2), -0.25))
    np.testing.assert_allclose(variables["b"][0].numpy(), np.full(2, -1.25))
    assert variables["b"][0].numpy().dtype == np.float64
    optim.apply_to_variables(variables, {"w": np.zeros((2, 2), np.float32), "b": [np.ones(2)]})
    np.testing.assert_array_equal(variables["w"].numpy(), 0.0)
    np.testing.assert_array_equal(variables["b"][0].numpy(), 1.0)
    with pytest.raises(FlowjitValueError, match="expected 2 values"):
        optim.apply_to_variables(variables, [np.zeros(2)])


# --- learning-rate schedules -----------------------------------------------------------------------------------

SCHEDULES = {
    "constant": (optim.constant_schedule(0.3), lambda t: 0.3),
    "linear": (optim.linear_schedule(1.0, 0.2, 4), lambda t: 1.0 - 0.8 * min(t, 4) / 4),
    "exponential": (optim.exponential_decay(2.0, 3, 0.5), lambda t: 2.0 * 0.5 ** (t / 3)),
    "staircase": (optim.exponential_decay(2.0, 3, 0.5, staircase=True), lambda t: 2.0 * 0.5 ** (t // 3)),
    "step_decay": (optim.step_decay(0.1, 4), lambda t: 0.1 * 0.1 ** (t // 4)),
    "cosine": (optim.cosine_decay_schedule(0.1, 4, alpha=0.1), ref_cosine),
    "warmup_cosine": (optim.warmup_cosine_decay_schedule(0.0, 0.05, 2, 5, 0.001), ref_warmup_cosine),
}


def all_schedules(step):
    return {name: schedule(step) for name, (schedule, _) in SCHEDULES.items()}


def test_schedules_eager_and_jitted_with_a_traced_step():
    jitted = fj.jit(all_schedules)
    for t in range(9):
        eager, traced = all_schedules(t), jitted(np.int64(t))
        for name, (_, ref) in SCHEDULES.items():
            np.testing.assert_allclose(float(eager[name]), ref(t), rtol=1e-12, err_msg=f"{name} {t}")
            assert traced[name].dtype == np.float64
            np.testing.assert_allclose(traced[name], ref(t), rtol=1e-12, err_msg=f"{name} {t} jit")


def test_scheduled_state_counts_steps():
    opt = optim.SGD(optim.constant_schedule(0.1))
    state = opt.init({"w": np.zeros(2)})
    assert int(state["step"]) == 0 and "velocity" not in state
    params, state = opt.update({"w": np.ones(2)}, state, {"w": np.zeros(2)})
    assert int(state["step"]) == 1
    np.testing.assert_allclose(params["w"], -0.1)
    assert optim.RMSprop().init({"w": np.zeros(2)}).keys() == {"square_avg"}
    assert optim.RMSprop(optim.constant_schedule(0.1), momentum=0.5, centered=True).init({"w": np.zeros(2)}).keys() == {
        "step",
        "square_avg",
        "grad_avg",
        "momentum_buffer",
    }


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.exponential_decay(0.1, 0, 0.5), "decay_steps"),
        (lambda: optim.cosine_decay_schedule(0.1, 0), "decay_steps"),
        (lambda: optim.warmup_cosine_decay_schedule(0.0, 0.1, 10, 10), "warmup_steps < decay_steps"),
        (lambda: optim.RMSprop(alpha=1.0), "alpha"),
        (lambda: optim.RMSprop(momentum=-0.1), "momentum"),
        (lambda: optim.Adagrad(eps=-1.0), "eps"),
        (lambda: optim.Adagrad(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    ],
)
def test_schedule_and_new_optimizer_validation(make, message):
    with pytest.raises(FlowjitValueError, match=message) as info:
        make()
    assert "test_optim.py:" in str(info.value)


# --- gradient clipping ---------------------------------------------------------------------------------------


def clip_tree(grads):
    return optim.clip_by_global_norm(grads, 1.5), optim.global_norm(grads)


@pytest.mark.parametrize("mode", ["eager", "cpu"])
@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_clip_by_global_norm(mode, scale):
    grads = make_tree(np.random.default_rng(5), np.float32)
    grads = fj.tree_map(lambda leaf: leaf * np.float32(scale), grads)
    grads["f64"] = np.array([0.5 * scale, -scale])
    leaves = [np.asarray(leaf, np.float64) for leaf in tree_flatten(grads)[0]]
    norm = math.sqrt(sum(float((leaf**2).sum()) for leaf in leaves))
    clipped, got_norm = (clip_tree if mode == "eager" else fj.jit(clip_tree))(grads)
    np.testing.assert_allclose(got_norm, norm, rtol=1e-6)
    assert np.asarray(got_norm).dtype == np.float64  # a float64 leaf makes the norm float64
    factor = min(1.0, 1.5 / norm)
    assert (factor < 1.0) == (scale == 10.0)
    for got, leaf, original in zip(tree_flatten(clipped)[0], leaves, tree_flatten(grads)[0]):
        assert got.dtype == np.asarray(original).dtype and got.shape == np.shape(original)
        np.testing.assert_allclose(got, leaf * factor, rtol=1e-6)
    clipped_leaves = [np.asarray(leaf, np.float64) for leaf in tree_flatten(clipped)[0]]
    assert math.sqrt(sum(float((leaf**2).sum()) for leaf in clipped_leaves)) <= 1.5 * (1 + 1e-6)


def test_clip_by_global_norm_rejects_a_bad_max_norm():
    with pytest.raises(FlowjitValueError, match="max_norm") as info:
        optim.clip_by_global_norm({"g": np.ones(2)}, 0.0)
    assert "test_optim.py:" in str(info.value)


# --- a ported PyTorch-style train step: every new piece in one jit ----------------------------------------------

_IMAGES = np.random.default_rng(6).standard_normal((8, 2, 6, 6)).astype(np.float32)
_CLASSES = (_IMAGES[:, 0].mean(axis=(1, 2)) > _IMAGES[:, 1].mean(axis=(1, 2))).astype(np.int64)
_SCHEDULED = optim.AdamW(optim.warmup_cosine_decay_schedule(0.0, 0.05, 3, 40), weight_decay=0.01)


def _cnn_loss(params, stats, x, y):
    h = nn.conv2d(x, params["depthwise"], padding=1, groups=2)
    h, mean, var = nn.batch_norm_train(nn.conv2d(h, params["pointwise"]), stats["mean"], stats["var"])
    logits = nn.linear(nn.global_avg_pool2d(nn.hard_swish(h)), params["head"])
    return nn.cross_entropy(logits, y, label_smoothing=0.1), {"mean": mean, "var": var}


def _cnn_step(params, stats, state, x, y):
    (loss, stats), grads = fj.value_and_grad(_cnn_loss, has_aux=True)(params, stats, x, y)
    params, state = _SCHEDULED.update(optim.clip_by_global_norm(grads, 1.0), state, params)
    return params, stats, state, loss


def test_cnn_train_step_with_batch_norm_schedule_and_clipping_matches_eager_and_learns():
    rng = np.random.default_rng(7)
    params = {
        "depthwise": (rng.standard_normal((4, 1, 3, 3)) * 0.5).astype(np.float32),
        "pointwise": (rng.standard_normal((6, 4, 1, 1)) * 0.5).astype(np.float32),
        "head": (rng.standard_normal((6, 2)) * 0.5).astype(np.float32),
    }
    stats = {"mean": np.zeros(6, np.float32), "var": np.ones(6, np.float32)}
    step = fj.jit(_cnn_step)
    jitted = eager = (params, stats, _SCHEDULED.init(params))
    losses = []
    for _ in range(25):
        *jitted, loss = step(*jitted, _IMAGES, _CLASSES)
        *eager, _ = _cnn_step(*eager, _IMAGES, _CLASSES)
        losses.append(float(loss))
    leaves_close(jitted[0], eager[0], rtol=1e-3, atol=1e-4)
    leaves_close(jitted[1], eager[1], rtol=1e-3, atol=1e-4)  # the running statistics moved the same way
    assert int(jitted[2]["step"]) == 25 and jitted[1]["var"].dtype == np.float32
    assert losses[-1] < 0.7 * losses[0]
