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
import flowjit.numpy as fnp
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


SELU_ALPHA, SELU_SCALE = 1.6732632423543772, 1.0507009873554805


def ref_glu(x, axis):
    a, b = np.split(x, 2, axis)
    return a / (1.0 + np.exp(-b))


def ref_cosine(a, b):
    norms = np.maximum(np.linalg.norm(a, axis=-1), 1e-8) * np.maximum(np.linalg.norm(b, axis=-1), 1e-8)
    return (a * b).sum(-1) / norms


def bn_statistics(channels, dtype):
    """Per-channel (mean, var, gamma, beta) for batch_norm tests."""
    grid = np.linspace(-1.0, 1.0, channels)
    return tuple(v.astype(dtype) for v in (0.3 * grid, 0.5 + grid * grid, 1.0 + 0.5 * grid, -0.2 * grid))


def ref_batch_norm(x, mean, var, gamma, beta, axis=1):
    shape = [1] * x.ndim
    shape[axis] = -1
    mean, var, gamma, beta = (v.astype(np.float64).reshape(shape) for v in (mean, var, gamma, beta))
    return (x - mean) / np.sqrt(var + 1e-5) * gamma + beta


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
    "tanh": (nn.tanh, np.tanh),
    "elu": (nn.elu, lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))),
    "selu": (nn.selu, lambda x: SELU_SCALE * np.where(x > 0, x, SELU_ALPHA * np.expm1(np.minimum(x, 0.0)))),
    "celu": (lambda x: nn.celu(x, 0.5), lambda x: np.maximum(x, 0) + np.minimum(0, 0.5 * np.expm1(x / 0.5))),
    "hard_sigmoid": (nn.hard_sigmoid, lambda x: np.clip(x + 3.0, 0.0, 6.0) / 6.0),
    "hard_tanh": (nn.hard_tanh, lambda x: np.clip(x, -1.0, 1.0)),
    "hard_tanh_bounds": (lambda x: nn.hard_tanh(x, -2.0, 0.5), lambda x: np.clip(x, -2.0, 0.5)),
    "hard_swish": (nn.hard_swish, lambda x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0),
    "softsign": (nn.softsign, lambda x: x / (1.0 + np.abs(x))),
    "log_sigmoid": (nn.log_sigmoid, lambda x: -np.logaddexp(0.0, -x)),
    "mish": (nn.mish, lambda x: x * np.tanh(np.logaddexp(0.0, x))),
    "swish": (nn.swish, lambda x: x / (1.0 + np.exp(-x))),
    "glu_axis0": (lambda x: nn.glu(x, axis=0), lambda x: ref_glu(x, 0)),
    "normalize": (nn.normalize, lambda x: x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)),
    "normalize_axis0": (lambda x: nn.normalize(x, axis=0), lambda x: x / np.linalg.norm(x, axis=0, keepdims=True)),
    "cosine_similarity": (
        lambda x: nn.cosine_similarity(x, fnp.add(fnp.square(x), 1.0)),
        lambda x: ref_cosine(x, x * x + 1.0),
    ),
    "rms_norm": (lambda x: nn.rms_norm(x, 1.5), lambda x: 1.5 * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)),
    "batch_norm": (
        lambda x: nn.batch_norm(x, *bn_statistics(fnp.shape(x)[1], x.dtype)),
        lambda x: ref_batch_norm(x, *bn_statistics(x.shape[1], np.float64)),
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


@pytest.mark.parametrize("mode", MODES)
def test_conv2d_takes_the_public_api_order_and_pytorchs(mode):
    """DESIGN.md's `nn.conv2d(x_nchw, w_oihw, stride, padding)` and PyTorch's `(x, w, b, stride,
    padding, dilation, groups)` (`bias=` too): a stride-like third argument (an int or a pair of
    ints) starts the public order. Bad combinations are errors that name the argument."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 9, 10)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    want = ref_conv2d(x, w, None, (2, 2), ((1, 1), (1, 1)), (1, 1))
    biased = ref_conv2d(x, w, b, (2, 1), ((1, 1), (0, 0)), (1, 1))

    def calls(x, w, b):
        return [
            nn.conv2d(x, w, 2, 1),
            nn.conv2d(x, w, (2, 2), padding=1),
            nn.conv2d(x, w, stride=2, padding=1),
            nn.conv2d(x, w, None, 2, 1),
            nn.conv2d(x, w, b, (2, 1), ((1, 1), (0, 0))),
            nn.conv2d(x, w, (2, 1), ((1, 1), (0, 0)), bias=b),
            nn.conv2d(x, w, bias=b, stride=(2, 1), padding=((1, 1), (0, 0))),
        ]

    outs = run(mode, calls, x, w, b)
    for k, out in enumerate(outs):
        np.testing.assert_allclose(out, want if k < 4 else biased, rtol=1e-5, atol=1e-5, err_msg=str(k))
    for bad, message in [
        (lambda: nn.conv2d(x, w, 2, 1, padding=1), "multiple values for 'padding'"),
        (lambda: nn.conv2d(x, w, 2, strides=1), "unexpected keyword argument 'strides'"),
        (lambda: nn.conv2d(x, w, 2, 1, 1, 1, 1), "at most 4 arguments after x and w"),
        (lambda: nn.conv2d(x, w, "SAME"), "third argument is the stride .* or the bias"),
    ]:
        with pytest.raises(FlowjitTypeError, match=message):
            bad()
    with pytest.raises(FlowjitValueError, match=r"bias must have one value per output channel, shape \(4,\)"):
        nn.conv2d(x, w, np.ones(5, np.float32))


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


@pytest.mark.parametrize("mode", MODES)
def test_one_hot_of_labels_outside_the_classes_is_all_zeros(mode):
    """one_hot compares in int32: labels outside [0, classes) (negative, ignore_index, too large,
    beyond int32) match no class, as they would in int64; cross_entropy leaves them out of the mean."""
    labels = np.array([-100, -1, 0, 4, 5, 2**32 + 2, 2**31, 3], np.int64)
    out = run(mode, lambda y: nn.one_hot(y, 5), labels)
    want = np.zeros((8, 5), np.float32)
    for i, label in enumerate(labels):
        if 0 <= label < 5:
            want[i, label] = 1.0
    np.testing.assert_array_equal(out, want)
    logits = np.random.default_rng(3).standard_normal((8, 5)).astype(np.float32)
    loss = run(mode, lambda lg, y: nn.cross_entropy(lg, y), logits, np.where(labels == 2**32 + 2, -100, labels))
    log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    picked = [-log_probs[i, y] if 0 <= y < 5 else 0.0 for i, y in enumerate(labels)]
    valid = (labels != -100) & (labels != 2**32 + 2)
    np.testing.assert_allclose(loss, np.sum(picked) / valid.sum(), rtol=1e-5)


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


# --- normalization layers ------------------------------------------------------------------------------------


def ref_group_norm(x, groups, gamma, beta, eps=1e-5):
    grouped = x.reshape(x.shape[0], groups, -1)
    mean = grouped.mean(-1, keepdims=True)
    var = grouped.var(-1, keepdims=True)
    normalized = ((grouped - mean) / np.sqrt(var + eps)).reshape(x.shape)
    channel = (1, -1) + (1,) * (x.ndim - 2)
    return normalized * gamma.reshape(channel) + beta.reshape(channel)


def normalizations(x, gamma, beta, running_mean, running_var):
    out, new_mean, new_var = nn.batch_norm_train(x, running_mean, running_var, gamma, beta, momentum=0.2)
    return {
        "group_norm": nn.group_norm(x, 2, gamma, beta),
        "group_norm_plain": nn.group_norm(x, 4),
        "instance_norm": nn.instance_norm(x, gamma, beta),
        "batch_norm_train": out,
        "running_mean": new_mean,
        "running_var": new_var,
        "batch_norm_last_axis": nn.batch_norm(fnp.moveaxis(x, 1, -1), running_mean, running_var, gamma, beta, axis=-1),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalization_layers(mode, dtype):
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((3, 4, 5, 2)) * 2.0 + 1.0).astype(dtype)
    gamma, beta, running_mean = (rng.standard_normal(4).astype(dtype) for _ in range(3))
    running_var = rng.uniform(0.5, 2.0, 4).astype(dtype)
    out = run(mode, normalizations, x, gamma, beta, running_mean, running_var)
    x64, g64, b64 = x.astype(np.float64), gamma.astype(np.float64), beta.astype(np.float64)
    batch_mean, batch_var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
    expected = {
        "group_norm": ref_group_norm(x64, 2, g64, b64),
        "group_norm_plain": ref_group_norm(x64, 4, np.ones(4), np.zeros(4)),
        "instance_norm": ref_group_norm(x64, 4, g64, b64),
        "batch_norm_train": ref_batch_norm(x64, batch_mean, batch_var, g64, b64),
        "running_mean": 0.8 * running_mean + 0.2 * batch_mean,
        "running_var": 0.8 * running_var + 0.2 * batch_var * 30 / 29,  # unbiased over 3 * 5 * 2 values
        "batch_norm_last_axis": np.moveaxis(ref_batch_norm(x64, running_mean, running_var, g64, b64), 1, -1),
    }
    for name, want in expected.items():
        assert out[name].dtype == dtype and out[name].shape == want.shape, name
        close(out[name], want, dtype, scale=4.0)


def layer_norms(x, gamma, beta):
    return {
        "ours": nn.layer_norm(x, gamma, beta),
        "torch": nn.layer_norm(x, (5,), gamma, beta),
        "torch_int_keywords": nn.layer_norm(x, 5, weight=gamma, bias=beta, eps=1e-5),
        "torch_two_axes": nn.layer_norm(x, x.shape[-2:]),
        "ours_two_axes": nn.layer_norm(x, axis=(-2, -1)),
        "rms_ours": nn.rms_norm(x, gamma),
        "rms_torch": nn.rms_norm(x, [5], gamma),
    }


@pytest.mark.parametrize("mode", MODES)
def test_layer_norm_takes_pytorchs_normalized_shape(mode):
    """`layer_norm(x, gamma, beta, eps, axis)` and PyTorch's `layer_norm(x, normalized_shape, weight,
    bias, eps)`: a shape second argument (an int or a tuple of ints) was taken for gamma and scaled
    the output by it, silently. rms_norm likewise."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    gamma, beta = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    out = run(mode, layer_norms, x, gamma, beta)
    x64 = x.astype(np.float64)

    def normalized(axes):
        centered = x64 - x64.mean(axes, keepdims=True)
        return centered / np.sqrt((centered**2).mean(axes, keepdims=True) + 1e-5)

    rms = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * gamma
    want = {"ours": normalized(-1) * gamma + beta, "torch_two_axes": normalized((-2, -1)), "rms_ours": rms}
    want |= {"torch": want["ours"], "torch_int_keywords": want["ours"], "ours_two_axes": want["torch_two_axes"]}
    want["rms_torch"] = rms
    for name, expected in want.items():
        np.testing.assert_allclose(out[name], expected, rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(FlowjitValueError, match=r"normalized_shape=\(4,\) normalizes the last 1 axes"):
        nn.layer_norm(x, (4,))
    with pytest.raises(FlowjitTypeError, match="multiple values for 'gamma'"):
        nn.layer_norm(x, gamma, gamma=gamma)
    with pytest.raises(FlowjitTypeError, match=r"at most 4 arguments after x \(normalized_shape, weight, bias, eps\)"):
        nn.layer_norm(x, (5,), gamma, beta, 1e-5, -1)


def test_normalization_errors():
    with pytest.raises(FlowjitValueError, match="4 groups") as info:
        nn.group_norm(np.zeros((2, 6, 3), np.float32), 4)
    assert "test_nn.py:" in str(info.value)
    with pytest.raises(FlowjitValueError, match="more than one value"):
        nn.batch_norm_train(np.zeros((1, 3)), np.zeros(3), np.ones(3))
    with pytest.raises(FlowjitValueError, match="channel axis"):
        nn.batch_norm(np.zeros(3), np.zeros(3), np.ones(3))
    with pytest.raises(FlowjitValueError, match="odd size 7"):
        nn.glu(np.zeros((2, 7)))


# --- losses --------------------------------------------------------------------------------------------------


def ref_reduce(losses, reduction):
    return {"none": losses, "sum": losses.sum(), "mean": losses.mean()}[reduction]


def ref_bce(p, t):
    with np.errstate(divide="ignore"):  # log(0) = -inf, clamped to -100
        return -(t * np.maximum(np.log(p), -100) + (1 - t) * np.maximum(np.log1p(-p), -100))


def ref_bce_logits(z, t, pos_weight=1.0):
    return -(pos_weight * t * -np.logaddexp(0.0, -z) + (1 - t) * -np.logaddexp(0.0, z))


def ref_huber(d, delta):
    return np.where(np.abs(d) < delta, 0.5 * d * d, delta * (np.abs(d) - 0.5 * delta))


def ref_kl(log_pred, target):
    logs = np.log(np.where(target > 0, target, 1.0))
    return np.where(target > 0, target * (logs - log_pred), 0.0)


LOSS_LABELS = np.array([1, 4, -100, 0, 2, -100], np.int64)  # -100: ignored, as in PyTorch


def ref_cross_entropy(logits, labels, smoothing=0.0):
    """(per-row losses with 0 where ignored, number of counted rows)."""
    log_probs = ref_log_softmax(logits)
    valid = labels != -100
    picked = -log_probs[np.arange(len(labels)), np.where(valid, labels, 0)]
    losses = (1 - smoothing) * picked - smoothing * log_probs.mean(-1)
    return np.where(valid, losses, 0.0), valid.sum()


def all_losses(logits, probs, targets, pred, soft):
    out = {}
    for reduction in ("mean", "sum", "none"):
        out[f"ce_{reduction}"] = nn.cross_entropy(logits, LOSS_LABELS, reduction=reduction)
        out[f"ce_smooth_{reduction}"] = nn.cross_entropy(logits, LOSS_LABELS, reduction, label_smoothing=0.1)
        out[f"ce_soft_{reduction}"] = nn.cross_entropy(logits, soft, reduction, label_smoothing=0.2)
        out[f"nll_{reduction}"] = nn.nll_loss(nn.log_softmax(logits), LOSS_LABELS, reduction)
        out[f"bce_{reduction}"] = nn.binary_cross_entropy(probs, targets, reduction)
        out[f"bce_logits_{reduction}"] = nn.binary_cross_entropy_with_logits(logits, targets, reduction)
        out[f"mse_{reduction}"] = nn.mse_loss(pred, targets, reduction)
        out[f"l1_{reduction}"] = nn.l1_loss(pred, targets, reduction)
        out[f"huber_{reduction}"] = nn.huber_loss(pred, targets, 0.5, reduction)
        out[f"smooth_l1_{reduction}"] = nn.smooth_l1_loss(pred, targets, 0.5, reduction)
        out[f"kl_{reduction}"] = nn.kl_div(nn.log_softmax(logits), soft, reduction)
    out["ce_no_ignore"] = nn.cross_entropy(logits, np.abs(LOSS_LABELS) % 5, ignore_index=None)
    out["bce_logits_pos_weight"] = nn.binary_cross_entropy_with_logits(logits, targets, "sum", pos_weight=soft[0])
    out["kl_batchmean"] = nn.kl_div(nn.log_softmax(logits), soft, "batchmean")
    out["kl_log_target"] = nn.kl_div(nn.log_softmax(logits), fnp.log(soft + 0.1), "sum", log_target=True)
    out["smooth_l1_beta0"] = nn.smooth_l1_loss(pred, targets, 0.0)
    return out


def loss_inputs(dtype):
    rng = np.random.default_rng(21)
    logits = (rng.standard_normal((6, 5)) * 2.0).astype(dtype)
    probs = rng.uniform(0.0, 1.0, (6, 5))
    probs[0, :2] = [0.0, 1.0]  # log(0) clamps at -100 as in PyTorch
    targets = rng.uniform(0.0, 1.0, (6, 5))
    pred = rng.standard_normal((6, 5))
    soft = rng.uniform(0.0, 1.0, (6, 5))
    soft[1, 2] = 0.0  # a zero target contributes 0, not 0 * log(0)
    soft /= soft.sum(-1, keepdims=True)
    return logits, *(a.astype(dtype) for a in (probs, targets, pred, soft))


def expected_losses(logits, probs, targets, pred, soft):
    logits, probs, targets, pred, soft = (a.astype(np.float64) for a in (logits, probs, targets, pred, soft))
    log_probs = ref_log_softmax(logits)
    want = {}
    for reduction in ("mean", "sum", "none"):
        for name, smoothing in (("ce", 0.0), ("ce_smooth", 0.1)):
            losses, count = ref_cross_entropy(logits, LOSS_LABELS, smoothing)
            want[f"{name}_{reduction}"] = losses.sum() / count if reduction == "mean" else ref_reduce(losses, reduction)
        smoothed = soft * 0.8 + 0.2 / 5
        want[f"ce_soft_{reduction}"] = ref_reduce(-(smoothed * log_probs).sum(-1), reduction)
        want[f"nll_{reduction}"] = want[f"ce_{reduction}"]
        want[f"bce_{reduction}"] = ref_reduce(ref_bce(probs, targets), reduction)
        want[f"bce_logits_{reduction}"] = ref_reduce(ref_bce_logits(logits, targets), reduction)
        want[f"mse_{reduction}"] = ref_reduce((pred - targets) ** 2, reduction)
        want[f"l1_{reduction}"] = ref_reduce(np.abs(pred - targets), reduction)
        want[f"huber_{reduction}"] = ref_reduce(ref_huber(pred - targets, 0.5), reduction)
        want[f"smooth_l1_{reduction}"] = ref_reduce(ref_huber(pred - targets, 0.5) / 0.5, reduction)
        want[f"kl_{reduction}"] = ref_reduce(ref_kl(log_probs, soft), reduction)
    labels = np.abs(LOSS_LABELS) % 5
    want["ce_no_ignore"] = -log_probs[np.arange(6), labels].mean()
    want["bce_logits_pos_weight"] = ref_bce_logits(logits, targets, soft[0]).sum()
    want["kl_batchmean"] = ref_kl(log_probs, soft).sum() / 6
    log_target = np.log(soft + 0.1)
    want["kl_log_target"] = (np.exp(log_target) * (log_target - log_probs)).sum()
    want["smooth_l1_beta0"] = np.abs(pred - targets).mean()
    return want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_losses_match_float64(mode, dtype):
    inputs = loss_inputs(dtype)
    out = run(mode, all_losses, *inputs)
    want = expected_losses(*inputs)
    assert out.keys() == want.keys()
    targets = inputs[2].astype(np.float64)
    np.testing.assert_allclose(out["bce_none"][0, :2], [100 * targets[0, 0], 100 * (1 - targets[0, 1])], rtol=1e-6)
    for name, value in want.items():
        assert out[name].dtype == dtype and out[name].shape == np.shape(value), name
        np.testing.assert_allclose(
            out[name], value, rtol=2e-5 if dtype == np.float32 else 1e-12, atol=1e-5, err_msg=name
        )


def test_binary_losses_on_saturated_inputs_are_finite():
    logits = np.array([-1e4, -50.0, 0.0, 50.0, 1e4])
    targets = np.array([1.0, 0.0, 0.5, 1.0, 0.0])
    np.testing.assert_allclose(
        nn.binary_cross_entropy_with_logits(logits, targets, "none"), [1e4, 0.0, math.log(2.0), 0.0, 1e4], atol=1e-12
    )
    grad = fj.grad(lambda z: nn.binary_cross_entropy_with_logits(z, targets, "sum"))(logits)
    np.testing.assert_allclose(grad, np.array([0.0, 0.0, 0.5, 1.0, 1.0]) - targets, atol=1e-15)
    probs = np.array([0.0, 1.0, 0.0, 1.0])
    hard = np.array([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_array_equal(nn.binary_cross_entropy(probs, hard, "none"), [100.0, 100.0, 0.0, 0.0])
    assert np.isfinite(fj.grad(lambda p: nn.binary_cross_entropy(p, hard))(probs)).all()


# --- gradients of the new functions vs finite differences -----------------------------------------------------

GRAD_PROBS = np.random.default_rng(9).uniform(0.05, 0.95, (3, 5))
GRAD_SOFT = GRAD_PROBS / GRAD_PROBS.sum(-1, keepdims=True)
GRAD_PARAMS = np.random.default_rng(10).standard_normal(5)

LOSSES.update(
    {
        "ce_smoothing": lambda x: nn.cross_entropy(x, GRAD_LABELS, label_smoothing=0.3),
        "ce_soft": lambda x: nn.cross_entropy(x, GRAD_SOFT),
        "ce_ignore": lambda x: nn.cross_entropy(x, np.array([2, -100, 4])),
        "nll": lambda x: nn.nll_loss(nn.log_softmax(x), GRAD_LABELS, "sum"),
        "bce": lambda x: nn.binary_cross_entropy(nn.sigmoid(x), GRAD_PROBS),
        "bce_logits": lambda x: nn.binary_cross_entropy_with_logits(x, GRAD_PROBS, pos_weight=2.0),
        "l1": lambda x: nn.l1_loss(x, GRAD_TARGET, "sum"),
        "huber": lambda x: nn.huber_loss(x, GRAD_TARGET, 0.7),
        "smooth_l1": lambda x: nn.smooth_l1_loss(x, GRAD_TARGET, 0.7),
        "kl_div": lambda x: nn.kl_div(nn.log_softmax(x), GRAD_SOFT, "batchmean"),
        "activations": lambda x: sum(
            (f(x) * GRAD_WEIGHTS).sum()
            for f in (nn.elu, nn.selu, nn.celu, nn.mish, nn.log_sigmoid, nn.softsign, nn.hard_swish, nn.tanh)
        ),
        "glu": lambda x: (nn.glu(x[:, :4]) * GRAD_WEIGHTS[:, :2]).sum(),
        "normalize": lambda x: (nn.normalize(x) * GRAD_WEIGHTS).sum(),
        "cosine_similarity": lambda x: (nn.cosine_similarity(x, GRAD_TARGET) * GRAD_WEIGHTS[:, 0]).sum(),
        "rms_norm": lambda x: (nn.rms_norm(x, GRAD_PARAMS) * GRAD_WEIGHTS).sum(),
        "batch_norm_train": lambda x: (nn.batch_norm_train(x, GRAD_PARAMS, GRAD_PARAMS**2)[0] * GRAD_WEIGHTS).sum(),
        "group_norm": lambda x: (
            nn.group_norm(x.reshape(1, 3, 5), 3, GRAD_PARAMS[:3]).reshape(3, 5) * GRAD_WEIGHTS
        ).sum(),
    }
)


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_gradients_match_finite_differences(name):
    x = np.random.default_rng(3).standard_normal((3, 5))
    loss = LOSSES[name]
    got = fj.grad(loss)(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_allclose(got, central_difference(loss, x), rtol=1e-6, atol=1e-8)


def test_zero_vector_and_elu_overflow_gradients_are_finite():
    x = np.array([[0.0, 0.0, 0.0], [1e3, -1e3, 800.0]])
    assert np.isfinite(fj.grad(lambda v: nn.normalize(v).sum())(x)).all()
    assert np.isfinite(fj.grad(lambda v: nn.cosine_similarity(v, x[::-1]).sum())(x)).all()
    for f in (nn.elu, nn.selu, nn.celu):
        np.testing.assert_array_equal(np.isfinite(fj.grad(lambda v, f=f: f(v).sum())(x)), True)


# --- errors users can cause ----------------------------------------------------------------------------------

BAD_REDUCTION = [
    lambda: nn.mse_loss(np.zeros(3), np.zeros(3), reduction="avg"),
    lambda: nn.l1_loss(np.zeros(3), np.zeros(3), reduction="avg"),
    lambda: nn.huber_loss(np.zeros(3), np.zeros(3), reduction="avg"),
    lambda: nn.smooth_l1_loss(np.zeros(3), np.zeros(3), reduction="avg"),
    lambda: nn.binary_cross_entropy(np.zeros(3), np.zeros(3), reduction="avg"),
    lambda: nn.binary_cross_entropy_with_logits(np.zeros(3), np.zeros(3), reduction="avg"),
    lambda: nn.kl_div(np.zeros(3), np.zeros(3), reduction="avg"),
    lambda: nn.nll_loss(np.zeros((2, 3)), np.zeros(2, np.int32), reduction="avg"),
]


@pytest.mark.parametrize("make", BAD_REDUCTION)
def test_every_loss_rejects_a_bad_reduction(make):
    with pytest.raises(FlowjitValueError, match="reduction must be 'mean', 'sum' or 'none'") as info:
        make()
    assert "test_nn.py:" in str(info.value)


def test_loss_shape_mismatch_names_user_line_under_jit():
    def loss(pred, target):
        return nn.mse_loss(pred, target)

    where = f"test_nn.py:{loss.__code__.co_firstlineno + 1}"
    with pytest.raises(FlowjitTypeError, match=r"\(4, 1\) and target of shape \(4,\)") as info:
        fj.jit(loss, target="interpreter")(np.zeros((4, 1), np.float32), np.zeros(4, np.float32))
    assert where in str(info.value)


def test_loss_label_errors():
    with pytest.raises(FlowjitTypeError, match="integer class labels"):
        nn.nll_loss(np.zeros((2, 3)), np.zeros(2))
    with pytest.raises(FlowjitTypeError, match="expected labels of shape"):
        nn.nll_loss(np.zeros((2, 3)), np.zeros(3, np.int64))
    with pytest.raises(FlowjitValueError, match="label_smoothing"):
        nn.cross_entropy(np.zeros((2, 3)), np.zeros(2, np.int64), label_smoothing=1.5)


# --- grouped, 1-D and transposed convolutions; adaptive pooling ------------------------------------------------


def ref_grouped_conv2d(x, w, b, stride, pads, dilation, groups):
    """The direct loop per group, concatenated over output channels."""
    c_in, c_out = x.shape[1] // groups, w.shape[0] // groups
    outs = [
        ref_conv2d(x[:, g * c_in : (g + 1) * c_in], w[g * c_out : (g + 1) * c_out], None, stride, pads, dilation)
        for g in range(groups)
    ]
    out = np.concatenate(outs, axis=1)
    return out if b is None else out + b.reshape(1, -1, 1, 1)


def ref_conv_transpose2d(x, w, b, stride, padding, output_padding, dilation, groups):
    """Scatter every input pixel times the kernel into the (cropped) output, per group."""
    n, c, h, wd = x.shape
    _, c_out, kh, kw = w.shape
    size = [(d - 1) * s - 2 * p + dl * (k - 1) + op + 1 for d, s, p, dl, k, op in
            zip((h, wd), stride, padding, dilation, (kh, kw), output_padding)]  # fmt: skip
    full = np.zeros((n, c_out * groups, size[0] + 2 * padding[0], size[1] + 2 * padding[1]))
    c_in = c // groups
    for ni, ci, i, j, o, ki, kj in np.ndindex(n, c, h, wd, c_out, kh, kw):
        g = ci // c_in
        row, col = i * stride[0] + ki * dilation[0], j * stride[1] + kj * dilation[1]
        if row < full.shape[2] and col < full.shape[3]:
            full[ni, g * c_out + o, row, col] += x[ni, ci, i, j] * w[ci, o, ki, kj]
    out = full[:, :, padding[0] : padding[0] + size[0], padding[1] : padding[1] + size[1]]
    return out if b is None else out + b.reshape(1, -1, 1, 1)


# (w shape, stride, padding, dilation, groups, bias) for x of shape (2, 4, 7, 6)
GROUPED_CASES = [
    ((4, 1, 3, 3), 1, 1, 1, 4, True),  # depthwise
    ((8, 1, 3, 2), (2, 1), "SAME", 1, 4, False),  # depthwise, channel multiplier 2
    ((6, 2, 3, 3), 1, 0, (1, 2), 2, True),
    ((2, 2, 2, 2), 2, ((1, 0), (0, 1)), 1, 2, False),
]
# (w shape, stride, padding, output_padding, dilation, groups, bias) for the same x
TRANSPOSED_CASES = [
    ((4, 3, 3, 3), 1, 0, 0, 1, 1, True),
    ((4, 2, 3, 2), 2, 1, 1, 1, 1, False),
    ((4, 3, 2, 3), (2, 3), (0, 2), (1, 0), (1, 2), 2, True),
    ((4, 1, 3, 3), 2, 3, 0, 1, 4, False),  # padding beyond the kernel's reach crops
    # groups 1, dilation 1, a stride: one stride-1 conv per phase (autodiff.conv2d_input_grad_by_phases)
    ((4, 3, 3, 3), 2, 3, 1, 1, 1, True),
    ((4, 2, 4, 1), (3, 2), (0, 1), (2, 1), 1, 1, True),
]
CONV1D_CASES = [((6, 4, 3), 1, 0, 1, 1), ((4, 2, 3), 2, "SAME", 1, 2), ((4, 1, 2), 1, (2, 1), 3, 4)]


def conv_variants(x, signal, weights, biases):
    outs = []
    for (_, stride, padding, dilation, groups, bias), w, b in zip(GROUPED_CASES, weights[0], biases[0]):
        outs.append(nn.conv2d(x, w, b if bias else None, stride, padding, dilation, groups=groups))
    for (_, stride, padding, out_pad, dilation, groups, bias), w, b in zip(TRANSPOSED_CASES, weights[1], biases[1]):
        outs.append(nn.conv_transpose2d(x, w, b if bias else None, stride, padding, out_pad, dilation, groups))
    for (_, stride, padding, dilation, groups), w in zip(CONV1D_CASES, weights[2]):
        outs.append(nn.conv1d(signal, w, None, stride, padding, dilation, groups))
    for size in (1, 3, (2, 4), (7, 6), (4, 4)):
        outs.append(nn.adaptive_avg_pool2d(x, size))
    outs.append(nn.global_avg_pool2d(x))
    return outs


def conv_variant_inputs(dtype):
    rng = np.random.default_rng(31)
    x = rng.standard_normal((2, 4, 7, 6)).astype(dtype)
    signal = rng.standard_normal((2, 4, 9)).astype(dtype)
    weights = [
        [rng.standard_normal(case[0]).astype(dtype) for case in cases]
        for cases in (GROUPED_CASES, TRANSPOSED_CASES, CONV1D_CASES)
    ]
    out_channels = [[c[0][0] for c in GROUPED_CASES], [c[0][1] * c[5] for c in TRANSPOSED_CASES]]
    biases = [[rng.standard_normal(o).astype(dtype) for o in outs] for outs in out_channels]
    return x, signal, weights, biases


def expected_conv_variants(x, signal, weights, biases):
    x, signal = x.astype(np.float64), signal.astype(np.float64)
    want = []
    for (_, stride, padding, dilation, groups, bias), w, b in zip(GROUPED_CASES, weights[0], biases[0]):
        stride, dilation = _pair(stride), _pair(dilation)
        if padding == "SAME":
            pads = tuple(same_pads(x.shape[2 + i], w.shape[2 + i], stride[i], dilation[i]) for i in range(2))
        else:
            pads = ((padding, padding),) * 2 if isinstance(padding, int) else padding
        want.append(ref_grouped_conv2d(x, w, b if bias else None, stride, pads, dilation, groups))
    for (_, stride, padding, out_pad, dilation, groups, bias), w, b in zip(TRANSPOSED_CASES, weights[1], biases[1]):
        args = (_pair(v) for v in (stride, padding, out_pad, dilation))
        want.append(ref_conv_transpose2d(x, w, b if bias else None, *args, groups))
    for (_, stride, padding, dilation, groups), w in zip(CONV1D_CASES, weights[2]):
        if padding == "SAME":
            pads = ((0, 0), same_pads(signal.shape[2], w.shape[2], stride, dilation))
        else:
            pads = ((0, 0), (padding, padding) if isinstance(padding, int) else padding)
        image = signal[:, :, None, :]
        want.append(
            ref_grouped_conv2d(image, w[:, :, None, :], None, (1, stride), pads, (1, dilation), groups)[:, :, 0]
        )
    for size in (1, 3, (2, 4), (7, 6), (4, 4)):
        want.append(ref_adaptive_avg_pool(x, _pair(size)))
    want.append(x.mean(axis=(2, 3)))
    return want


def ref_adaptive_avg_pool(x, size):
    """PyTorch's bins: [floor(i * n / out), ceil((i + 1) * n / out))."""
    (h, wd), (oh, ow) = x.shape[2:], size
    out = np.zeros(x.shape[:2] + size)
    for i, j in np.ndindex(oh, ow):
        rows = slice(i * h // oh, -(-(i + 1) * h // oh))
        cols = slice(j * wd // ow, -(-(j + 1) * wd // ow))
        out[:, :, i, j] = x[:, :, rows, cols].mean(axis=(2, 3))
    return out


# Compiling every variant takes a while: the CPU target runs float32 only.
@pytest.mark.parametrize(
    "mode, dtype",
    [("eager", np.float64), ("interpreter", np.float64), ("eager", np.float32), ("cpu", np.float32)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_conv_variants_and_adaptive_pooling_match_direct_loops(mode, dtype):
    inputs = conv_variant_inputs(dtype)
    outs = run(mode, conv_variants, *inputs)
    for k, (out, want) in enumerate(zip(outs, expected_conv_variants(*inputs), strict=True)):
        assert out.dtype == dtype and out.shape == want.shape, (k, out.shape, want.shape)
        np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5, err_msg=k)


# name: (layer(x, w), weight shape, output shape) for x of shape (1, 4, 5, 4)
CONV_GRADIENT_CASES = {
    "depthwise": (lambda x, w: nn.conv2d(x, w, stride=(2, 1), padding=((1, 0), (0, 0)), groups=4), (8, 1, 3, 3)),
    "grouped": (lambda x, w: nn.conv2d(x, w, groups=2), (4, 2, 2, 3)),
    "transposed": (
        lambda x, w: nn.conv_transpose2d(x, w, stride=2, padding=(1, 0), output_padding=1, groups=2),
        (4, 1, 3, 2),
    ),
    "conv1d": (lambda x, w: nn.conv1d(x.reshape(1, 4, 20), w, stride=3, padding=2, groups=2), (2, 2, 4)),
}


@pytest.mark.parametrize("name", list(CONV_GRADIENT_CASES))
def test_conv_variant_gradients_match_finite_differences(name):
    layer, w_shape = CONV_GRADIENT_CASES[name]
    rng = np.random.default_rng(32)
    x, w = rng.standard_normal((1, 4, 5, 4)), rng.standard_normal(w_shape)
    ct = rng.standard_normal(np.shape(layer(x, w)))
    gx, gw = fj.grad(lambda x, w: (layer(x, w) * ct).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, central_difference(lambda v: (layer(v, w) * ct).sum(), x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gw, central_difference(lambda v: (layer(x, v) * ct).sum(), w), rtol=1e-6, atol=1e-7)


def test_conv_variant_errors():
    x = np.zeros((1, 4, 5, 5), np.float32)
    with pytest.raises(FlowjitTypeError, match="groups=3") as info:
        nn.conv2d(x, np.zeros((6, 1, 3, 3), np.float32), groups=3)
    assert "test_nn.py:" in str(info.value)
    with pytest.raises(FlowjitTypeError, match="groups=2"):
        nn.conv2d(x, np.zeros((6, 1, 3, 3), np.float32), groups=2)  # needs (O, 2, kh, kw)
    with pytest.raises(FlowjitTypeError, match="NCL"):
        nn.conv1d(x, np.zeros((2, 4, 3), np.float32))
    with pytest.raises(FlowjitValueError, match="output_padding"):
        nn.conv_transpose2d(x, np.zeros((4, 2, 3, 3), np.float32), stride=2, output_padding=2)
    with pytest.raises(FlowjitTypeError, match="groups=3"):
        nn.conv_transpose2d(x, np.zeros((4, 2, 3, 3), np.float32), groups=3)


# --- attention -----------------------------------------------------------------------------------------------


def ref_attention(q, k, v, mask=None, causal=False, scale=None):
    scores = q @ np.swapaxes(k, -1, -2) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    return ref_softmax(scores) @ v


ATTN_RNG = np.random.default_rng(41)
ATTN_BOOL_MASK = ATTN_RNG.uniform(size=(5, 7)) > 0.4
ATTN_BOOL_MASK[:, 0] = True
ATTN_FLOAT_MASK = ATTN_RNG.standard_normal((2, 1, 5, 7))
ATTN_PARAMS = {
    **{n: ATTN_RNG.standard_normal((8, 8)) * 0.3 for n in ("wq", "wk", "wv", "wo")},
    **{n: ATTN_RNG.standard_normal(8) for n in ("bq", "bv", "bo")},
}


def attention_variants(q, k, v, x):
    params = {name: value.astype(x.dtype) for name, value in ATTN_PARAMS.items()}
    return {
        "plain": nn.scaled_dot_product_attention(q, k, v),
        "causal": nn.scaled_dot_product_attention(q, k, v, is_causal=True),
        "bool_mask": nn.scaled_dot_product_attention(q, k, v, ATTN_BOOL_MASK, scale=0.3),
        "float_mask": nn.scaled_dot_product_attention(q, k, v, ATTN_FLOAT_MASK.astype(x.dtype)),
        "fully_masked_row": nn.scaled_dot_product_attention(q, k, v, np.arange(7) > 9),
        "mha_causal": nn.multi_head_attention(x, x, x, params, num_heads=2, is_causal=True),
    }


def ref_multi_head_attention(x, params, heads, causal):
    def project(name):
        y = x @ params["w" + name] + params.get("b" + name, 0.0)
        return np.swapaxes(y.reshape(*y.shape[:-1], heads, -1), -2, -3)

    attended = ref_attention(project("q"), project("k"), project("v"), causal=causal)
    merged = np.swapaxes(attended, -2, -3).reshape(x.shape)
    return merged @ params["wo"] + params["bo"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_matches_numpy(mode, dtype):
    rng = np.random.default_rng(42)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)))
    x = rng.standard_normal((3, 5, 8)).astype(dtype)
    out = run(mode, attention_variants, q, k, v, x)
    q, k, v, x = (a.astype(np.float64) for a in (q, k, v, x))
    want = {
        "plain": ref_attention(q, k, v),
        "causal": ref_attention(q, k, v, causal=True),
        "bool_mask": ref_attention(q, k, v, ATTN_BOOL_MASK, scale=0.3),
        "float_mask": ref_attention(q, k, v, ATTN_FLOAT_MASK),
        "fully_masked_row": np.broadcast_to(v.mean(-2, keepdims=True), (2, 3, 5, 6)),  # uniform, not nan
        "mha_causal": ref_multi_head_attention(x, ATTN_PARAMS, 2, True),
    }
    for name, value in want.items():
        assert out[name].dtype == dtype and out[name].shape == value.shape, name
        np.testing.assert_allclose(
            out[name], value, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5, err_msg=name
        )


def test_attention_gradient_matches_finite_differences():
    rng = np.random.default_rng(43)
    q, k, v, ct = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3), (2, 3, 3)))

    def loss(q, k, v):
        return (nn.scaled_dot_product_attention(q, k, v, is_causal=True) * ct).sum()

    grads = fj.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for i, (arg, got) in enumerate(zip((q, k, v), grads)):
        f = lambda a, i=i: loss(*(a if j == i else b for j, b in enumerate((q, k, v))))  # noqa: E731
        np.testing.assert_allclose(got, central_difference(f, arg), rtol=1e-6, atol=1e-8, err_msg=i)


def test_attention_errors():
    with pytest.raises(FlowjitTypeError, match=r"query \[..., L, E\]") as info:
        nn.scaled_dot_product_attention(np.zeros((3, 4)), np.zeros((5, 3)), np.zeros((5, 2)))
    assert "test_nn.py:" in str(info.value)
    with pytest.raises(FlowjitValueError, match="not divisible by 3 heads"):
        nn.multi_head_attention(np.zeros((2, 4)), np.zeros((2, 4)), np.zeros((2, 4)), {}, num_heads=3)


# --- more initializers -------------------------------------------------------------------------------------


def orthogonal_draw(key):
    return nn.initializers.orthogonal(2.0)(key, (6, 3, 2))


def test_more_initializers():
    key = fj.random.key(5)
    init = nn.initializers
    np.testing.assert_array_equal(init.constant(0.5)(key, (2, 3), "float64"), np.full((2, 3), 0.5))
    np.testing.assert_allclose(init.xavier_normal(key, (100, 300)).std(), math.sqrt(2.0 / 400), rtol=0.03)
    np.testing.assert_allclose(init.kaiming_uniform(key, (100, 300)).std(), math.sqrt(2.0 / 100), rtol=0.03)
    w = init.lecun_uniform(key, (400, 100))
    assert np.abs(w).max() <= math.sqrt(3.0 / 400) and np.abs(w).max() > 0.95 * math.sqrt(3.0 / 400)
    t = init.truncated_normal(0.1)(key, (200, 200))
    assert t.dtype == np.float32 and np.abs(t).max() <= 0.2
    np.testing.assert_allclose(t.std(), 0.1 * 0.8796, rtol=0.03)  # the std of a normal cut at 2 sigma
    for distribution in ("truncated_normal", "normal", "uniform"):
        v = init.variance_scaling(2.0, "fan_avg", distribution)(key, (16, 8, 3, 3), "float64")
        assert v.dtype == np.float64
        np.testing.assert_allclose(v.std(), math.sqrt(2.0 / ((8 * 9 + 16 * 9) / 2)), rtol=0.05, err_msg=distribution)
    with pytest.raises(FlowjitValueError, match="fan_avg"):
        init.variance_scaling(1.0, "fan_sum")


@pytest.mark.parametrize("shape", [(5, 5), (8, 3), (3, 8), (6, 3, 2)])
def test_orthogonal_initializer(shape):
    q = nn.initializers.orthogonal(2.0)(fj.random.key(7), shape, "float64").reshape(shape[0], -1)
    assert q.dtype == np.float64
    gram = q.T @ q if q.shape[0] >= q.shape[1] else q @ q.T
    np.testing.assert_allclose(gram, 4.0 * np.eye(min(q.shape)), atol=1e-12)
    # Haar, not the identity or a fixed basis: another key gives another matrix.
    other = nn.initializers.orthogonal(2.0)(fj.random.key(8), shape, "float64").reshape(q.shape)
    assert np.abs(q - other).max() > 0.1


def test_orthogonal_initializer_under_jit_matches_eager():
    eager = orthogonal_draw(fj.random.key(3))
    jitted = fj.jit(orthogonal_draw)(fj.random.key(3))
    assert jitted.dtype == np.float32 and jitted.shape == (6, 3, 2)
    np.testing.assert_allclose(jitted, eager, atol=1e-5)
    flat = eager.reshape(6, 6).astype(np.float64)
    np.testing.assert_allclose(flat.T @ flat, 4.0 * np.eye(6), atol=1e-5)


def test_activation_gradients_at_their_kinks_match_pytorch_and_jax():
    """relu'(0) = 0 (not the 0.5 of maximum's tie rule), relu6 and hard_tanh 0 at their bounds,
    elu'(0) = alpha (not alpha / 2 from a tie inside min(x, 0)); nan passes through."""
    x = np.array([-1.0, 0.0, -0.0, 1.0, 6.0, 7.0])
    expected = {
        "relu": [0, 0, 0, 1, 1, 1],
        "relu6": [0, 0, 0, 1, 0, 0],
        "hard_tanh": [0, 1, 1, 0, 0, 0],
        "elu": [np.exp(-1.0), 1, 1, 1, 1, 1],
        "celu": [np.exp(-1.0), 1, 1, 1, 1, 1],
        "selu": [1.0507009873554805 * 1.6732632423543772 * e for e in (np.exp(-1.0), 1, 1)] + [1.0507009873554805] * 3,
        "leaky_relu": [0.01, 0.01, 0.01, 1, 1, 1],
    }
    for name, want in expected.items():
        fn = getattr(nn, name)
        got = fj.jit(fj.grad(lambda a, fn=fn: fnp.sum(fn(a))))(x)
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=name)
        assert np.isnan(fj.jit(fn)(np.array([np.nan, 1.0], np.float32))[0]), name
