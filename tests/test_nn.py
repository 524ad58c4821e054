"""flowjit.nn against independent float64 numpy references: eagerly, under `fj.jit` on the default CPU
target and on the reference interpreter, across float dtypes. Compiled functions are module-level and
shared across parametrizations (one compile per dtype and shape)."""

import inspect
import math

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
import flowjit.nn as nn
from flowjit.errors import FlowjitTypeError, FlowjitValueError

MODES = ("eager", "cpu", "interpreter")
_JITTED = {}


def run(mode, fn, *args):
    """`fn(*args)` eagerly, or through one shared `fj.jit(fn)` per (fn, mode)."""
    if mode == "eager":
        return fn(*args)
    if (fn, mode) not in _JITTED:
        _JITTED[fn, mode] = fj.jit(fn, target=None if mode == "cpu" else "interpreter")
    return _JITTED[fn, mode](*args)


# (rtol, atol) against the float64 reference evaluated on the same (rounded) inputs.
TOLERANCES = {
    np.float32: (2e-5, 2e-6),
    np.float64: (1e-12, 1e-13),
    np.float16: (2e-2, 2e-2),
    ml_dtypes.bfloat16: (5e-2, 5e-2),
}
FLOAT_DTYPES = list(TOLERANCES)


def close(actual, expected, dtype, scale=1.0):
    rtol, atol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol * scale, atol=atol * scale)


# --- float64 references -------------------------------------------------------------------------------

_erf = np.vectorize(math.erf)


def ref_logsumexp(x, axis=-1, keepdims=False):
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    out = np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True)) + peak
    return out if keepdims else np.squeeze(out, axis=axis)


def ref_log_softmax(x, axis=-1):
    return x - ref_logsumexp(x, axis, keepdims=True)


def ref_softmax(x, axis=-1):
    return np.exp(ref_log_softmax(x, axis))


def ref_layer_norm(x, gamma, beta, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


ACTIVATIONS = {
    "relu": (nn.relu, lambda x: np.maximum(x, 0.0)),
    "relu6": (nn.relu6, lambda x: np.clip(x, 0.0, 6.0)),
    "leaky_relu": (lambda x: nn.leaky_relu(x, 0.2), lambda x: np.where(x > 0, x, 0.2 * x)),
    "sigmoid": (nn.sigmoid, lambda x: 1.0 / (1.0 + np.exp(-x))),
    "silu": (nn.silu, lambda x: x / (1.0 + np.exp(-x))),
    "softplus": (nn.softplus, lambda x: np.logaddexp(0.0, x)),
    "gelu": (nn.gelu, lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))),
    "gelu_tanh": (
        lambda x: nn.gelu(x, approximate=True),
        lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    ),
    "logsumexp": (nn.logsumexp, ref_logsumexp),
    "logsumexp_axis0_keepdims": (
        lambda x: nn.logsumexp(x, axis=0, keepdims=True),
        lambda x: ref_logsumexp(x, 0, keepdims=True),
    ),
    "softmax": (nn.softmax, ref_softmax),
    "softmax_axis0": (lambda x: nn.softmax(x, axis=0), lambda x: ref_softmax(x, 0)),
    "log_softmax": (nn.log_softmax, ref_log_softmax),
    "layer_norm_plain": (nn.layer_norm, lambda x: ref_layer_norm(x, 1.0, 0.0)),
    "layer_norm_affine": (
        lambda x: nn.layer_norm(x, 1.5, -0.25),
        lambda x: ref_layer_norm(x, 1.5, -0.25),
    ),
}


def all_activations(x):
    return {name: fn(x) for name, (fn, _) in ACTIVATIONS.items()}


def activation_input(shape, dtype):
    x = np.random.default_rng(1).standard_normal(shape) * 3.0
    x.flat[:4] = [-30.0, 30.0, 0.0, -1e-3][: x.size]
    return x.astype(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype,shape",
    [(np.float32, (4, 7)), (np.float64, (4, 7)), (np.float16, (4, 7)), (ml_dtypes.bfloat16, (4, 7))]
    + [(np.float32, (2, 3, 5))],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_activations_match_float64(mode, dtype, shape):
    x = activation_input(shape, dtype)
    out = run(mode, all_activations, x)
    x64 = x.astype(np.float64)
    for name, (_, ref) in ACTIVATIONS.items():
        assert out[name].dtype == x.dtype, name
        # layer_norm divides by a small standard deviation: half precision loses more there.
        scale = 4.0 if name.startswith("layer_norm") and dtype in (np.float16, ml_dtypes.bfloat16) else 1.0
        try:
            close(out[name], ref(x64), dtype, scale)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


# --- numerically hard inputs -------------------------------------------------------------------------------

HARD_LOGITS = np.array(
    [
        [1e4, 0.0, -np.inf, 1.0],
        [-np.inf, -np.inf, 3.0, -np.inf],
        [1.0, 2.0, 3.0, 4.0],
        [-1e4, -1e4 + 1.0, -1e4 + 2.0, -1e4 + 3.0],
        [1e4, 1e4, -1e4, 0.0],
    ]
)
HARD_LABELS = np.array([0, 2, 1, 3, 1], np.int32)


def hard_functions(logits, labels):
    return {
        "softmax": nn.softmax(logits),
        "log_softmax": nn.log_softmax(logits),
        "logsumexp": nn.logsumexp(logits),
        "ce_none": nn.cross_entropy(logits, labels, reduction="none"),
        "ce_mean": nn.cross_entropy(logits, labels),
        "ce_sum": nn.cross_entropy(logits, labels, reduction="sum"),
        "softplus": nn.softplus(logits),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hard_logits(mode, dtype):
    logits = HARD_LOGITS.astype(dtype)
    out = run(mode, hard_functions, logits, HARD_LABELS)
    log_probs = ref_log_softmax(HARD_LOGITS)
    losses = -log_probs[np.arange(5), HARD_LABELS]
    expected = {
        "softmax": ref_softmax(HARD_LOGITS),
        "log_softmax": log_probs,
        "logsumexp": ref_logsumexp(HARD_LOGITS),
        "ce_none": losses,
        "ce_mean": losses.mean(),
        "ce_sum": losses.sum(),
        "softplus": np.logaddexp(0.0, HARD_LOGITS),
    }
    assert np.isfinite(losses).all()
    for name, want in expected.items():
        got = np.asarray(out[name], np.float64)
        assert got.dtype == np.float64 and out[name].dtype == dtype, name
        # Infinite entries must be the same infinities; finite ones close (1e4 logits keep ~1e-3 absolute in f32).
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=name)
        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-13, atol=1e-6, err_msg=name)


def test_hard_logits_gradients_are_finite_and_exact():
    ce = fj.grad(lambda z: nn.cross_entropy(z, HARD_LABELS))(HARD_LOGITS)
    np.testing.assert_allclose(ce, (ref_softmax(HARD_LOGITS) - np.eye(4)[HARD_LABELS]) / 5, atol=1e-15)
    lse = fj.grad(lambda z: nn.logsumexp(z).sum())(HARD_LOGITS)
    np.testing.assert_allclose(lse, ref_softmax(HARD_LOGITS), atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softplus_extremes(dtype):
    x = np.array([-100.0, -30.0, 0.0, 30.0, 100.0], dtype)
    got = np.asarray(nn.softplus(x), np.float64)
    want = np.array([math.exp(-100.0), math.log1p(math.exp(-30.0)), math.log(2.0), 30.0 + math.exp(-30.0), 100.0])
    # exp(-100) is a float32 subnormal: compare it in absolute terms.
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-44)
    assert got[0] > 0.0


# --- gradients ----------------------------------------------------------------------------------------


def central_difference(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        g[i] = (float(f(xp)) - float(f(xm))) / (2 * h)
    return g


_rng = np.random.default_rng(7)
GRAD_LABELS = np.array([2, 0, 4], np.int64)
GRAD_TARGET = _rng.standard_normal((3, 5))
GRAD_WEIGHTS = _rng.standard_normal((3, 5))

LOSSES = {
    "cross_entropy_mean": lambda x: nn.cross_entropy(x, GRAD_LABELS),
    "cross_entropy_sum": lambda x: nn.cross_entropy(x, GRAD_LABELS, reduction="sum"),
    "mse_loss": lambda x: nn.mse_loss(x, GRAD_TARGET),
    "logsumexp": lambda x: (nn.logsumexp(x) * GRAD_WEIGHTS[:, 0]).sum(),
    "log_softmax": lambda x: (nn.log_softmax(x, axis=0) * GRAD_WEIGHTS).sum(),
    "layer_norm": lambda x: (nn.layer_norm(x) * GRAD_WEIGHTS).sum(),
    "gelu": lambda x: (nn.gelu(x) * GRAD_WEIGHTS).sum(),
    "softplus": lambda x: (nn.softplus(x) * GRAD_WEIGHTS).sum(),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_gradients_match_finite_differences(name):
    x = np.random.default_rng(3).standard_normal((3, 5))
    loss = LOSSES[name]
    got = fj.grad(loss)(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_allclose(got, central_difference(loss, x), rtol=1e-6, atol=1e-8)


def cross_entropy_grad(logits):
    return fj.grad(lambda z: nn.cross_entropy(z, GRAD_LABELS))(logits)


@pytest.mark.parametrize("mode", ["cpu", "interpreter"])
def test_cross_entropy_gradient_under_jit(mode):
    logits = np.random.default_rng(4).standard_normal((3, 5))
    expected = (ref_softmax(logits) - np.eye(5)[GRAD_LABELS]) / 3
    np.testing.assert_allclose(run(mode, cross_entropy_grad, logits), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(run(mode, cross_entropy_grad, logits.astype(np.float32)), expected, rtol=1e-5, atol=1e-6)


# --- cross_entropy errors -------------------------------------------------------------------------------


def test_cross_entropy_float_labels_error_names_user_line():
    where = f"test_nn.py:{inspect.currentframe().f_lineno + 2}"
    with pytest.raises(FlowjitTypeError, match=r"integer class labels") as info:
        nn.cross_entropy(np.zeros((2, 3), np.float32), np.zeros(2, np.float32))
    assert where in str(info.value)


def test_cross_entropy_shape_mismatch_error_names_user_line_under_jit():
    def loss(logits, labels):
        return nn.cross_entropy(logits, labels)

    where = f"test_nn.py:{loss.__code__.co_firstlineno + 1}"
    with pytest.raises(FlowjitTypeError, match=r"labels of shape") as info:
        fj.jit(loss, target="interpreter")(np.zeros((4, 3), np.float32), np.zeros(3, np.int32))
    assert where in str(info.value) and "(4,)" in str(info.value)


def test_cross_entropy_bad_reduction():
    with pytest.raises(FlowjitValueError, match="reduction"):
        nn.cross_entropy(np.zeros((2, 3)), np.zeros(2, np.int32), reduction="avg")


# --- conv2d and pooling vs direct loops ---------------------------------------------------------------------


def ref_conv2d(x, w, b, stride, pads, dilation):
    """Direct 7-loop cross-correlation in float64; pads = ((top, bottom), (left, right))."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), *pads))
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh = (h - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    for ni, oi, i, j in np.ndindex(n, o, oh, ow):
        acc = 0.0 if b is None else float(b[oi])
        for ci, ki, kj in np.ndindex(c, kh, kw):
            acc += x[ni, ci, i * stride[0] + ki * dilation[0], j * stride[1] + kj * dilation[1]] * w[oi, ci, ki, kj]
        out[ni, oi, i, j] = acc
    return out


def same_pads(size, kernel, stride, dilation):
    """TensorFlow/XLA 'SAME': output ceil(size / stride), extra padding at the end."""
    out = -(-size // stride)
    total = max((out - 1) * stride + dilation * (kernel - 1) + 1 - size, 0)
    return (total // 2, total - total // 2)


# (x shape, w shape, stride, padding, dilation, bias, explicit pads for the reference or None for SAME)
CONV_CASES = [
    ((2, 3, 6, 5), (4, 3, 3, 3), 1, 0, 1, True, ((0, 0), (0, 0))),
    ((1, 2, 7, 7), (3, 2, 3, 3), 2, "VALID", 1, False, ((0, 0), (0, 0))),
    ((1, 2, 6, 7), (2, 2, 3, 2), (2, 1), "SAME", 1, True, None),
    ((1, 2, 5, 5), (2, 2, 3, 3), 1, "same", 1, False, None),
    ((2, 1, 8, 8), (2, 1, 3, 3), 1, 2, 2, True, ((2, 2), (2, 2))),
    ((1, 2, 9, 8), (3, 2, 3, 3), 2, "SAME", (2, 1), False, None),
    ((1, 2, 5, 6), (2, 2, 2, 3), (1, 2), (1, 0), 1, True, ((1, 1), (0, 0))),
    ((1, 1, 5, 5), (1, 1, 3, 3), 1, ((0, 1), (2, 0)), 1, False, ((0, 1), (2, 0))),
]


def conv_inputs(dtype):
    rng = np.random.default_rng(11)
    xs, ws, bs = [], [], []
    for x_shape, w_shape, *_ in CONV_CASES:
        xs.append(rng.standard_normal(x_shape).astype(dtype))
        ws.append(rng.standard_normal(w_shape).astype(dtype))
        bs.append(rng.standard_normal(w_shape[0]).astype(dtype))
    return xs, ws, bs


def all_convs(xs, ws, bs):
    return [
        nn.conv2d(x, w, b if bias else None, stride=stride, padding=padding, dilation=dilation)
        for x, w, b, (_, _, stride, padding, dilation, bias, _) in zip(xs, ws, bs, CONV_CASES)
    ]


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_matches_direct_loop(mode, dtype):
    xs, ws, bs = conv_inputs(dtype)
    outs = run(mode, all_convs, xs, ws, bs)
    for k, (x, w, b, out) in enumerate(zip(xs, ws, bs, outs)):
        _, _, stride, _, dilation, bias, pads = CONV_CASES[k]
        stride, dilation = _pair(stride), _pair(dilation)
        if pads is None:
            pads = tuple(same_pads(x.shape[2 + i], w.shape[2 + i], stride[i], dilation[i]) for i in range(2))
            assert out.shape[2:] == tuple(-(-x.shape[2 + i] // stride[i]) for i in range(2)), k
        want = ref_conv2d(x, w, b if bias else None, stride, pads, dilation)
        assert out.dtype == dtype and out.shape == want.shape, k
        np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5, err_msg=k)


def ref_pool(kind, x, window, stride, pads):
    fill = -np.inf if kind == "max" else 0.0
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), *pads), constant_values=fill)
    n, c, h, wd = x.shape
    oh, ow = (h - window[0]) // stride[0] + 1, (wd - window[1]) // stride[1] + 1
    out = np.zeros((n, c, oh, ow))
    for ni, ci, i, j in np.ndindex(n, c, oh, ow):
        patch = x[ni, ci, i * stride[0] : i * stride[0] + window[0], j * stride[1] : j * stride[1] + window[1]]
        out[ni, ci, i, j] = patch.max() if kind == "max" else patch.sum() / patch.size
    return out


# (kind, window, stride, padding, explicit pads for the reference or None for SAME)
POOL_CASES = [
    ("max", 2, None, 0, ((0, 0), (0, 0))),
    ("avg", 2, None, 0, ((0, 0), (0, 0))),
    ("max", 3, 2, 1, ((1, 1), (1, 1))),
    ("avg", 3, 2, 1, ((1, 1), (1, 1))),
    ("max", (2, 3), (1, 2), "VALID", ((0, 0), (0, 0))),
    ("max", 3, 2, "SAME", None),
    ("avg", (3, 2), 1, "SAME", None),
]
POOL_INPUT = np.random.default_rng(5).standard_normal((2, 3, 7, 6)) - 2.0  # negative: -inf padding matters


def all_pools(x):
    pool = {"max": nn.max_pool2d, "avg": nn.avg_pool2d}
    return [pool[kind](x, window, stride, padding) for kind, window, stride, padding, _ in POOL_CASES]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pooling_matches_direct_loop(mode, dtype):
    x = POOL_INPUT.astype(dtype)
    outs = run(mode, all_pools, x)
    for (kind, window, stride, _, pads), out in zip(POOL_CASES, outs):
        window = _pair(window)
        stride = window if stride is None else _pair(stride)
        if pads is None:
            pads = tuple(same_pads(x.shape[2 + i], window[i], stride[i], 1) for i in range(2))
        want = ref_pool(kind, x, window, stride, pads)
        assert out.dtype == dtype and out.shape == want.shape, (kind, window)
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=f"{kind} {window}")


def test_pooling_rejects_non_nchw():
    with pytest.raises(FlowjitTypeError, match="NCHW"):
        nn.max_pool2d(np.zeros((3, 4, 4), np.float32))


# --- small layers -------------------------------------------------------------------------------------------


def small_layers(table, ids, x, w, b, logits, labels):
    return {
        "embedding": nn.embedding(table, ids),
        "embedding_torch_order": nn.embedding(ids, table),
        "one_hot": nn.one_hot(labels, 5),
        "linear": nn.linear(x, w, b),
        "linear_no_bias": nn.linear(x, w),
        "accuracy": nn.accuracy(logits, labels),
        "mse": nn.mse_loss(x, x * 0.5),
    }


@pytest.mark.parametrize("mode", MODES)
def test_small_layers(mode):
    rng = np.random.default_rng(2)
    table = rng.standard_normal((6, 3)).astype(np.float32)
    ids = np.array([[0, 5, 2], [2, 2, 1]], np.int32)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((4, 3), (3, 2), (2,)))
    logits = np.array([[0.0, 1.0, 0.0, 0, 0], [3.0, 1.0, 0, 0, 0], [0, 0, 0, 0, 9.0], [1.0, 0, 0, 0, 0]], np.float32)
    labels = np.array([1, 0, 2, 3], np.int32)
    out = run(mode, small_layers, table, ids, x, w, b, logits, labels)
    np.testing.assert_array_equal(out["embedding"], table[ids])
    np.testing.assert_array_equal(out["embedding_torch_order"], table[ids])
    np.testing.assert_array_equal(out["one_hot"], np.eye(5, dtype=np.float32)[labels])
    assert out["one_hot"].dtype == np.float32
    np.testing.assert_allclose(out["linear"], x.astype(np.float64) @ w + b, rtol=1e-5)
    np.testing.assert_allclose(out["linear_no_bias"], x.astype(np.float64) @ w, rtol=1e-5)
    assert float(out["accuracy"]) == 0.5
    np.testing.assert_allclose(out["mse"], np.mean((0.5 * x.astype(np.float64)) ** 2), rtol=1e-6)


# --- dropout -------------------------------------------------------------------------------------------------


def dropout_pair(key, x):
    return nn.dropout(key, x, 0.3), nn.dropout(key, x, 0.3)


def test_dropout_identity_cases():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    key = fj.random.key(0)
    assert nn.dropout(key, x, 0.0) is x
    assert nn.dropout(key, x, 0.9, deterministic=True) is x
    with pytest.raises(FlowjitValueError, match="rate"):
        nn.dropout(key, x, 1.0)
    with pytest.raises(FlowjitValueError, match="rate"):
        nn.dropout(key, x, -0.1)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_keep_fraction_scaling_and_determinism(mode):
    x = np.random.default_rng(8).uniform(1.0, 2.0, (64, 128)).astype(np.float32)
    first, second = run(mode, dropout_pair, fj.random.key(42), x)
    np.testing.assert_array_equal(first, second)  # same key, same mask
    kept = first != 0
    assert abs(kept.mean() - 0.7) < 0.02  # 8192 draws: std of the fraction ~0.005
    np.testing.assert_allclose(first[kept], x[kept] / 0.7, rtol=1e-6)
    other, _ = run(mode, dropout_pair, fj.random.key(43), x)
    assert (other != 0).mean() > 0.65 and not np.array_equal(other != 0, kept)
    if mode != "eager":
        np.testing.assert_array_equal(first, dropout_pair(fj.random.key(42), x)[0])


def test_dropout_in_half_precision_keeps_dtype():
    x = np.ones((16, 16), np.float16)
    out = nn.dropout(fj.random.key(1), x, 0.5)
    assert out.dtype == np.float16
    assert set(np.unique(out).tolist()) <= {0.0, 2.0}


# --- initializers --------------------------------------------------------------------------------------------


def test_initializers_shapes_dtypes_and_scales():
    key = fj.random.key(3)
    init = nn.initializers
    assert (init.zeros(key, (2, 3)) == 0).all() and init.zeros(key, (2, 3)).dtype == np.float32
    assert (init.ones(key, (4,), "float64") == 1).all() and init.ones(key, (4,), "float64").dtype == np.float64
    w = init.glorot_uniform(key, (200, 300))
    limit = math.sqrt(6.0 / 500)
    assert w.shape == (200, 300) and w.dtype == np.float32
    assert np.abs(w).max() <= limit and np.abs(w).max() > 0.95 * limit
    np.testing.assert_allclose(w.std(), limit / math.sqrt(3.0), rtol=0.03)
    conv = init.he_normal(key, (64, 16, 3, 3), "float64")
    assert conv.dtype == np.float64
    np.testing.assert_allclose(conv.std(), math.sqrt(2.0 / (16 * 9)), rtol=0.05)
    np.testing.assert_allclose(init.lecun_normal(key, (400, 100)).std(), math.sqrt(1.0 / 400), rtol=0.03)
    np.testing.assert_allclose(init.glorot_normal(key, (100, 300)).std(), math.sqrt(2.0 / 400), rtol=0.03)
    np.testing.assert_allclose(init.he_uniform(key, (100, 300)).std(), math.sqrt(6.0 / 100 / 3), rtol=0.03)
    np.testing.assert_allclose(init.normal(0.5)(key, (100, 100)).std(), 0.5, rtol=0.03)
    assert np.abs(init.uniform(0.2)(key, (50, 50))).max() <= 0.2
    assert not np.array_equal(init.he_normal(key, (8, 8)), init.he_normal(fj.random.key(4), (8, 8)))
