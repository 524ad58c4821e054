"""flowjit.numpy's wider numpy coverage against numpy: sorting, searching and counting, order
statistics, nan-aware reductions, reduction keywords (`initial=`, `where=`), triangles and
diagonals, stacking and splitting, inverse trigonometry and friends, boolean masks, norms.

Each function runs eagerly on plain arrays and traced under `fj.jit` (on the reference interpreter,
as in test_numpy_api.py); a few programs also compile for the CPU. Results match numpy in shape,
dtype (numpy's float64 for integer inputs is float32 here, as everywhere in flowjit.numpy) and value.
"""

import math
import warnings

import numpy as np
import pytest
from test_numpy_api import bf16, check, f32, i32, jit

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.cpu import schedule
from flowjit.errors import FlowjitError

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.0, 3.0], np.float32)
X = f32(3, 4)


def with_nans(*shape, fraction=0.3):
    x = f32(*shape)
    x[np.random.default_rng(7).random(shape) < fraction] = np.nan
    return x


# --- elementwise -------------------------------------------------------------------------------------

UNARY = {
    "arcsin": (lambda: f32(3, 4, lo=-1, hi=1), 1e-6),
    "arccos": (lambda: f32(3, 4, lo=-1, hi=1), 1e-6),
    "arctan": (lambda: f32(3, 4, lo=-9, hi=9), 1e-6),
    "arcsinh": (lambda: np.concatenate([f32(6, lo=-5, hi=5), [1e-6, -1e-7, 3e20, -1e30]]).astype(np.float32), 1e-6),
    "arccosh": (lambda: np.concatenate([f32(6, lo=1, hi=9), [1.0, 1.0001, 3e20]]).astype(np.float32), 2e-6),
    "arctanh": (lambda: np.concatenate([f32(6, lo=-0.99, hi=0.99), [1e-6, 1.0, -1.0]]).astype(np.float32), 1e-6),
    "cbrt": (lambda: np.array([8.0, -27.0, 0.001, 2.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30], np.float32), 1e-6),
    "deg2rad": (lambda: f32(5, lo=-360, hi=360), 1e-6),
    "rad2deg": (lambda: f32(5), 1e-6),
    "degrees": (lambda: f32(5), 1e-6),
    "radians": (lambda: f32(5), 1e-6),
    "sinc": (lambda: np.array([0.0, 0.5, -1.5, 2.0, 1e-3], np.float32), 2e-6),
    "trunc": (lambda: SPECIAL, 0),
    "fix": (lambda: SPECIAL, 0),
    "rint": (lambda: np.array([0.5, 1.5, 2.5, -0.5, -1.7], np.float32), 0),
    "signbit": (lambda: SPECIAL, 0),
    "isposinf": (lambda: SPECIAL, 0),
    "isneginf": (lambda: SPECIAL, 0),
    "nan_to_num": (lambda: SPECIAL, 0),
    "positive": (lambda: SPECIAL, 0),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name):
    make, rtol = UNARY[name]
    x = make()
    with np.errstate(all="ignore"):
        check(getattr(fnp, name), x, ref=getattr(np, name), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("name", ["arcsin", "cbrt", "deg2rad", "sinc", "trunc", "signbit"])
def test_unary_float64_and_ints(name):
    check(getattr(fnp, name), f32(4, lo=-1, hi=1).astype(np.float64), ref=getattr(np, name), rtol=1e-12)
    ints = np.array([-2, 0, 1, 3], np.int32)
    with np.errstate(invalid="ignore"):  # arcsin(-2), arcsin(3): nan on purpose
        expected = getattr(np, name)(ints)
        check(getattr(fnp, name), ints, ref=getattr(np, name), dtype=np.float32 if expected.dtype.kind == "f" else None)


def test_arcsin_outside_domain_is_nan():
    got = fnp.arcsin(np.array([1.5, -2.0], np.float32))
    assert np.isnan(got).all()


# Composite float functions, compiled for the CPU, in float32 ulps against numpy in float64, over
# magnitudes from 1e-8 to the edge of overflow: the cancellations and overflows a formula can hide
# from an rtol test (sinh as (e^x - e^-x) / 2 lost every digit below 1e-3, 1 - x^2 in arccos 380
# ulps near 1, exp(x ln 2) 32 ulps near 128, e^x / 2 overflowed for sinh(89)).
COMPOSITE_ULP = {
    "sinh": ((-89.4, 89.4), 2.5),
    "cosh": ((-89.4, 89.4), 2.5),
    "exp2": ((-149.0, 127.9), 0.5),
    "arcsin": ((-1.0, 1.0), 2.0),
    "arccos": ((-1.0, 1.0), 1.6),
    "arctanh": ((-1.0, 1.0), 2.2),
    "log2": ((0.0, 3.4e38), 1.6),
    "log10": ((0.0, 3.4e38), 2.0),
}


def _magnitudes(lo: float, hi: float) -> np.ndarray:
    """float32 values from the range's ends down to 1e-8 in magnitude, log-spaced, both signs, and the ends."""
    rng = np.random.default_rng(11)
    top = max(abs(lo), abs(hi))
    x = np.exp(rng.uniform(math.log(1e-8), math.log(top), 20000))
    x = np.concatenate([x, -x, [lo, hi, 0.0, -0.0]]).astype(np.float32)
    return x[(x >= np.float32(lo)) & (x <= np.float32(hi))]


@pytest.mark.parametrize("name", sorted(COMPOSITE_ULP))
def test_composite_accuracy_in_ulps(name):
    (lo, hi), bound = COMPOSITE_ULP[name]
    x = _magnitudes(lo, hi)
    got = fj.jit(getattr(fnp, name))(x).astype(np.float64)
    with np.errstate(all="ignore"):
        want = getattr(np, name)(x.astype(np.float64))
    rounded = want.astype(np.float32)
    finite = np.isfinite(rounded)
    assert (got[~finite] == rounded[~finite]).all(), f"{name}: infinities where numpy's are"
    spacing = np.spacing(np.abs(rounded[finite])).astype(np.float64)
    ulps = np.abs(got[finite] - want[finite]) / spacing
    worst = int(np.argmax(ulps))
    assert ulps[worst] <= bound, f"{name}({x[finite][worst]!r}) = {got[finite][worst]!r}: {ulps[worst]:.1f} ulps"
    assert (np.signbit(got) == np.signbit(rounded)).all(), f"{name}: sign of zero"


def test_log2_log10_exact_at_powers():
    """numpy's log2(2^k) is k for every float32 power of two, denormals included, and log10 of the
    float32 nearest 10^k is k in the normal range: `floor(log2(x))` must not come out one short."""
    twos = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    np.testing.assert_array_equal(fj.jit(fnp.log2)(twos), np.arange(-149, 128, dtype=np.float32))
    np.testing.assert_array_equal(fnp.log2(twos), np.arange(-149, 128, dtype=np.float32))
    tens = (10.0 ** np.arange(-37, 39)).astype(np.float32)
    np.testing.assert_array_equal(fj.jit(fnp.log10)(tens), np.arange(-37, 39, dtype=np.float32))
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -2.0, 1e-45], np.float32)
    for name in ("log2", "log10"):
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(fj.jit(getattr(fnp, name))(special), getattr(np, name)(special))


@pytest.mark.parametrize("name", ["sinh", "cosh", "arctanh", "exp2", "log2", "log10"])
def test_composite_gradients(name):
    """At 0 (where |x| would give the derivative 0) and far out (where a branch not taken must not
    turn the gradient into nan), float64 against central differences."""
    if name.startswith("log"):  # at powers of the base too, where the result is snapped
        x = np.array([0.01, 0.1, 0.5, 1.0, 3.0, 8.0, 100.0])
    else:
        x = np.array([0.0, -0.0, 1e-5, -0.4, 0.75] + ([30.0, -30.0] if name != "arctanh" else []))
    g = fj.jit(fj.grad(lambda a: fnp.sum(getattr(fnp, name)(a))))(x)
    step = 1e-6
    fd = (getattr(np, name)(x + step) - getattr(np, name)(x - step)) / (2 * step)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
    if name in ("sinh", "cosh"):  # float32: e^95 overflows, e^80 does not
        far = fj.jit(fj.grad(lambda a: fnp.sum(getattr(fnp, name)(a))))(np.array([95.0, -95.0, 80.0], np.float32))
        assert np.isinf(far[:2]).all() and np.isfinite(far[2]), far


BINARY = {
    "hypot": (lambda: (f32(3, 4, lo=-1e20, hi=1e20), f32(4, lo=-1e-20, hi=1e-20)), 1e-6),
    "logaddexp": (lambda: (f32(3, 4, lo=-100, hi=100), f32(3, 1, lo=-100, hi=100)), 1e-6),
    "logaddexp2": (lambda: (f32(3, 4, lo=-100, hi=100), f32(4, lo=-100, hi=100)), 1e-6),
    "copysign": (lambda: (SPECIAL, SPECIAL[::-1].copy()), 0),
    "heaviside": (lambda: (SPECIAL, np.float32(0.5)), 0),
    "fmax": (lambda: (SPECIAL, np.roll(SPECIAL, 1)), 0),
    "fmin": (lambda: (SPECIAL, np.roll(SPECIAL, 3)), 0),
    "float_power": (lambda: (f32(4, lo=0.1, hi=3), np.float32(1.5)), 1e-12),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name):
    make, rtol = BINARY[name]
    with np.errstate(all="ignore"):
        check(getattr(fnp, name), *make(), ref=getattr(np, name), rtol=rtol, atol=1e-6)


def test_binary_special_values():
    inf = np.float32(np.inf)
    for name in ("hypot", "logaddexp", "logaddexp2"):
        pairs = np.array([[inf, -inf, inf, np.nan, -inf, 0.0], [inf, -inf, np.nan, inf, 1.0, 0.0]], np.float32)
        with np.errstate(all="ignore"):
            check(getattr(fnp, name), pairs[0], pairs[1], ref=getattr(np, name))


def test_isclose_allclose_array_equal():
    a = np.array([1.0, np.nan, np.inf, -np.inf, 1e-9, 100.0], np.float32)
    b = np.array([1.0 + 1e-6, np.nan, np.inf, np.inf, 0.0, 100.001], np.float32)
    for equal_nan in (False, True):
        check(
            lambda x, y, e=equal_nan: fnp.isclose(x, y, equal_nan=e),
            a,
            b,
            ref=lambda x, y, e=equal_nan: np.isclose(x, y, equal_nan=e),
        )
    check(
        lambda x, y: fnp.isclose(x, y, rtol=0.1, atol=0.5),
        X,
        X + 0.3,
        ref=lambda x, y: np.isclose(x, y, rtol=0.1, atol=0.5),
    )
    assert fnp.allclose(X, X + 1e-7) is True and fnp.allclose(X, X + 1) is False
    assert bool(jit(lambda x: fnp.allclose(x, x + 1e-7))(X))
    assert fnp.array_equal(a, a) is False and fnp.array_equal(a, a, equal_nan=True) is True
    assert fnp.array_equal(X, X[:2]) is False
    assert not bool(jit(lambda x, y: fnp.array_equal(x, y))(X, X + 1))


# --- reductions --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_reduction_initial_and_where(name, axis):
    mask = X > -1
    check(
        lambda x: getattr(fnp, name)(x, axis=axis, initial=2.0),
        X,
        ref=lambda x: getattr(np, name)(x, axis=axis, initial=2.0),
    )
    check(
        lambda x: getattr(fnp, name)(x, axis=axis, where=mask, initial=1.0),
        X,
        ref=lambda x: getattr(np, name)(x, axis=axis, where=mask, initial=1.0),
    )
    if name in ("sum", "prod"):
        check(
            lambda x: getattr(fnp, name)(x, axis=axis, where=mask),
            X,
            ref=lambda x: getattr(np, name)(x, axis=axis, where=mask),
        )


def test_reduction_keywords_edge_cases():
    empty = np.zeros((0, 3), np.float32)
    check(lambda x: fnp.max(x, axis=0, initial=-5.0), empty, ref=lambda x: np.max(x, axis=0, initial=-5.0))
    with np.errstate(invalid="ignore"), warnings.catch_warnings():  # rows with no x > 0: nan, as numpy
        warnings.simplefilter("ignore", RuntimeWarning)
        check(lambda x: fnp.mean(x, axis=1, where=x > 0), X, ref=lambda x: np.mean(x, axis=1, where=x > 0))
    check(
        lambda x: fnp.sum(x, where=np.array([True, False, True, True])),
        X,
        ref=lambda x: np.sum(x, where=[True, False, True, True]),
    )
    with pytest.raises(FlowjitError, match="initial="):
        fnp.max(X, where=X > 0)
    with pytest.raises(FlowjitError, match="initial="):
        fnp.min(empty, axis=0)


INT_NAN_RESULT = {
    "nansum": np.int32,
    "nanprod": np.int32,
    "nanmean": np.float32,
    "nanvar": np.float32,
    "nanstd": np.float32,
}
NAN_REDUCTIONS = ["nansum", "nanprod", "nanmax", "nanmin", "nanmean", "nanvar", "nanstd", "nanargmax", "nanargmin"]


@pytest.mark.parametrize("name", NAN_REDUCTIONS)
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_nan_reductions(name, axis):
    x = with_nans(4, 5)
    x[:, 0] = 1.0  # no all-nan slice: numpy's nanargmax raises there
    check(
        lambda a: getattr(fnp, name)(a, axis=axis),
        x,
        ref=lambda a: getattr(np, name)(a, axis=axis),
        rtol=1e-5,
        atol=1e-5,
    )
    check(
        lambda a: getattr(fnp, name)(a),
        i32(2, 3),
        ref=getattr(np, name),
        # integer sums keep their dtype (flowjit.numpy's rule); float results are float32
        dtype=INT_NAN_RESULT.get(name),
    )


def test_nan_reductions_of_all_nan_slices():
    x = np.array([[np.nan, np.nan], [1.0, np.nan]], np.float32)
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        for name in ("nanmax", "nanmin", "nanmean"):
            check(lambda a, n=name: getattr(fnp, n)(a, axis=1), x, ref=lambda a, n=name: getattr(np, n)(a, axis=1))
    check(lambda a: fnp.nansum(a, axis=1, keepdims=True), x, ref=lambda a: np.nansum(a, axis=1, keepdims=True))


@pytest.mark.parametrize("axis", [None, 0, -1])
def test_cumprod_ptp_diff(axis):
    x = np.array([[1, -2, 0, 3], [2, 2, -1, 5], [1, 1, 1, 7]], np.int32)
    check(lambda a: fnp.cumprod(a, axis=axis), x, ref=lambda a: np.cumprod(a, axis=axis), dtype=np.int32)
    check(lambda a: fnp.cumprod(a, axis=axis), X, ref=lambda a: np.cumprod(a, axis=axis), rtol=1e-5)
    check(lambda a: fnp.ptp(a, axis=axis), X, ref=lambda a: np.ptp(a, axis=axis))
    if axis is not None:
        for n in (1, 2, 5):
            check(lambda a, n=n: fnp.diff(a, n=n, axis=axis), X, ref=lambda a, n=n: np.diff(a, n=n, axis=axis))
    check(lambda a: fnp.cumprod(a), np.zeros((0,), np.float32), ref=np.cumprod)
    check(lambda a: fnp.cumprod(a), np.float32(3.0), ref=np.cumprod)


def test_diff_prepend_append_and_bools():
    check(
        lambda a: fnp.diff(a, prepend=0.0, append=a[:, :1]),
        X,
        ref=lambda a: np.diff(a, prepend=0.0, append=a[:, :1]),
        dtype=np.float32,  # a Python float is weak here (numpy's gives float64)
    )
    check(lambda a: fnp.diff(a, axis=0), X > 0, ref=lambda a: np.diff(a, axis=0))


def test_average():
    w = f32(4, lo=0.1, hi=2)
    check(lambda a: fnp.average(a, axis=1, weights=w), X, ref=lambda a: np.average(a, axis=1, weights=w))
    check(lambda a: fnp.average(a, weights=a * a), X, ref=lambda a: np.average(a, weights=a * a), rtol=1e-5)
    check(lambda a: fnp.average(a, axis=0, returned=True), X, ref=lambda a: np.average(a, axis=0, returned=True))


def test_count_nonzero():
    x = np.array([[0.0, np.nan, -0.0, 2.0], [1.0, 0.0, 0.0, 3.0]], np.float32)
    check(fnp.count_nonzero, x, ref=lambda a: np.asarray(np.count_nonzero(a), np.int64))
    check(lambda a: fnp.count_nonzero(a, axis=1), x, ref=lambda a: np.count_nonzero(a, axis=1).astype(np.int64))
    check(
        lambda a: fnp.count_nonzero(a > 0, axis=0, keepdims=True),
        x,
        ref=lambda a: np.count_nonzero(a > 0, axis=0, keepdims=True),
    )


# --- creation, triangles, diagonals ------------------------------------------------------------------------


def test_creation():
    np.testing.assert_array_equal(fnp.identity(3), np.identity(3, np.float32))
    assert fnp.empty((2, 3)).shape == (2, 3) and fnp.empty(4, dtype=np.int32).dtype == np.int32
    assert fnp.empty_like(X).shape == X.shape and fnp.empty_like(X).dtype == np.float32
    np.testing.assert_array_equal(fnp.tri(3, 4, 1), np.tri(3, 4, 1, np.float32))
    assert jit(lambda: fnp.identity(2, dtype=np.int32))().dtype == np.int32


@pytest.mark.parametrize("k", [-2, 0, 1, 5])
def test_triu_tril(k):
    a3 = f32(2, 3, 4)
    for fn in ("triu", "tril"):
        check(lambda a, f=fn: getattr(fnp, f)(a, k), X, ref=lambda a, f=fn: getattr(np, f)(a, k))
        check(lambda a, f=fn: getattr(fnp, f)(a, k), a3, ref=lambda a, f=fn: getattr(np, f)(a, k))
        check(lambda a, f=fn: getattr(fnp, f)(a, k), X > 0, ref=lambda a, f=fn: getattr(np, f)(a, k))
        check(lambda a, f=fn: getattr(fnp, f)(a, k), f32(3), ref=lambda a, f=fn: getattr(np, f)(a, k))


@pytest.mark.parametrize("k", [-3, -1, 0, 2, 7])
def test_diag_diagonal_trace(k):
    check(lambda v: fnp.diag(v, k), f32(4), ref=lambda v: np.diag(v, k))
    check(lambda a: fnp.diag(a, k), X, ref=lambda a: np.diag(a, k))
    a3 = f32(2, 3, 4)
    check(lambda a: fnp.diagonal(a, k, 2, 0), a3, ref=lambda a: np.diagonal(a, k, 2, 0))
    check(lambda a: fnp.trace(a, k), X, ref=lambda a: np.trace(a, k), atol=1e-5)
    check(lambda a: fnp.trace(a, k, 1, 2), a3, ref=lambda a: np.trace(a, k, 1, 2), atol=1e-5)
    check(fnp.trace, i32(3, 3), ref=lambda a: np.trace(a).astype(np.int32))


@pytest.mark.parametrize("indexing", ["xy", "ij"])
@pytest.mark.parametrize("sparse", [False, True])
def test_meshgrid(indexing, sparse):
    a, b, c = f32(3), f32(4), f32(2)
    check(
        lambda *xs: fnp.meshgrid(*xs, indexing=indexing, sparse=sparse),
        a,
        b,
        c,
        ref=lambda *xs: tuple(np.meshgrid(*xs, indexing=indexing, sparse=sparse)),
    )
    check(
        lambda *xs: fnp.meshgrid(*xs, indexing=indexing),
        a,
        b,
        ref=lambda *xs: tuple(np.meshgrid(*xs, indexing=indexing)),
    )


# --- shapes: roll, stacks, splits ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shift, axis", [(1, None), (-5, None), (1, 1), (-1, 0), (9, -1), ((1, -2), (0, 1)), (2, (0, 1)), (0, 0)]
)
def test_roll(shift, axis):
    check(lambda a: fnp.roll(a, shift, axis), X, ref=lambda a: np.roll(a, shift, axis))
    check(lambda a: fnp.roll(a, 3), np.zeros((0,), np.float32), ref=lambda a: np.roll(a, 3))


@pytest.mark.parametrize("fn", ["atleast_1d", "atleast_2d", "atleast_3d"])
def test_atleast(fn):
    for x in (np.float32(2.0), f32(3), X, f32(2, 3, 4)):
        check(getattr(fnp, fn), x, ref=getattr(np, fn))
    check(lambda a, b: getattr(fnp, fn)(a, b), np.float32(1.0), f32(2), ref=lambda a, b: tuple(getattr(np, fn)(a, b)))


@pytest.mark.parametrize("fn", ["vstack", "hstack", "dstack", "column_stack"])
def test_stacks(fn):
    for xs in ((f32(3), f32(3)), (X, X), (f32(2, 3, 4), f32(2, 3, 4))):
        if fn == "column_stack" and xs[0].ndim == 3:
            continue
        check(lambda *a: getattr(fnp, fn)(list(a)), *xs, ref=lambda *a: getattr(np, fn)(list(a)))


def test_splits():
    a = f32(7, 6, 4)
    for sections in (3, 4, 7, [2, 5]):
        check(
            lambda x, s=sections: tuple(fnp.array_split(x, s)), a, ref=lambda x, s=sections: tuple(np.array_split(x, s))
        )
    check(lambda x: tuple(fnp.array_split(x, 4, axis=-1)), a, ref=lambda x: tuple(np.array_split(x, 4, axis=-1)))
    check(lambda x: tuple(fnp.hsplit(x, 3)), a, ref=lambda x: tuple(np.hsplit(x, 3)))
    check(lambda x: tuple(fnp.vsplit(x, [1, 3])), a, ref=lambda x: tuple(np.vsplit(x, [1, 3])))
    check(lambda x: tuple(fnp.dsplit(x, 2)), a, ref=lambda x: tuple(np.dsplit(x, 2)))
    check(lambda x: tuple(fnp.hsplit(x, 2)), f32(6), ref=lambda x: tuple(np.hsplit(x, 2)))
    check(fnp.flipud, X, ref=np.flipud)
    check(fnp.fliplr, X, ref=np.fliplr)


# --- indexing: take_along_axis, boolean masks --------------------------------------------------------------


def test_take_along_axis():
    idx = np.argsort(X, axis=1)
    check(lambda a: fnp.take_along_axis(a, idx, 1), X, ref=lambda a: np.take_along_axis(a, idx, 1))
    check(
        lambda a: fnp.take_along_axis(a, idx[:, :2] - 4, -1), X, ref=lambda a: np.take_along_axis(a, idx[:, :2] - 4, -1)
    )
    col = np.array([[2], [0], [1]])
    check(lambda a: fnp.take_along_axis(a, col, 1), X, ref=lambda a: np.take_along_axis(a, col, 1))
    check(
        lambda a: fnp.take_along_axis(a, np.array([[0, 2, 1, 0]]), 0),
        X,
        ref=lambda a: np.take_along_axis(a, np.array([[0, 2, 1, 0]]), 0),
    )
    check(
        lambda a: fnp.take_along_axis(a, np.array([5, 0]), None),
        X,
        ref=lambda a: np.take_along_axis(a, np.array([5, 0]), None),
    )
    # traced indices: computed in the function (argsort), out-of-range ones clamp
    check(lambda a: fnp.take_along_axis(a, fnp.argsort(a, axis=0), 0), X, ref=lambda a: np.sort(a, axis=0))
    got = jit(lambda a, i: fnp.take_along_axis(a, i, 1))(X, np.array([[9], [-9], [1]]))
    np.testing.assert_array_equal(got, X[[0, 1, 2], [3, 0, 1]][:, None])
    with pytest.raises(FlowjitError, match="rank"):
        fnp.take_along_axis(X, np.array([0, 1]), 1)
    with pytest.raises(FlowjitError, match="out of bounds"):
        fnp.take_along_axis(X, np.array([[4]]), 1)


def test_scatter_add_along_axis_is_the_transpose_of_take_along_axis():
    idx = np.array([[1, 1, 0], [3, 0, 2], [0, 0, 0]])
    upd = f32(3, 3)
    want = np.zeros_like(X)
    np.add.at(want, (np.arange(3)[:, None], idx), upd)
    check(lambda x, u: fnp.scatter_add_along_axis(x, idx, u, 1), np.zeros_like(X), upd, ref=lambda x, u: want)


MASK_KEYS = [
    np.array([True, False, True]),
    (slice(None), np.array([True, False, True, True])),
    X > 0,
    (np.array([False, True, True]), 2),
    (Ellipsis, np.array([False, False, False, False])),
    [True, False, False],
]


@pytest.mark.parametrize("key", MASK_KEYS, ids=range(len(MASK_KEYS)))
def test_static_boolean_masks(key):
    check(
        lambda a: a[key], X, ref=lambda a: a[tuple(key) if isinstance(key, tuple) else np.asarray(key)], modes=("jit",)
    )
    check(lambda a: fnp.getitem(a, key), X, ref=lambda a: a[tuple(key) if isinstance(key, tuple) else np.asarray(key)])


# --- sorting, searching, counting --------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [-1, 0, 1, None])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.bool_])
def test_sort_argsort(axis, dtype):
    x = np.random.default_rng(3).integers(-3, 4, (5, 7)).astype(dtype)  # many ties: stability shows
    if dtype in (np.float32, np.float64):
        x[1, 2] = x[3, 0] = x[3, 6] = np.nan
        x[0, 0], x[0, 1] = -0.0, 0.0
    check(lambda a: fnp.sort(a, axis=axis), x, ref=lambda a: np.sort(a, axis=axis))
    check(
        lambda a: fnp.argsort(a, axis=axis), x, ref=lambda a: np.argsort(a, axis=axis, kind="stable").astype(np.int64)
    )


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 63, 1000, 4097])
def test_sort_of_every_pass_count(n):
    """One or two leading passes (odd or even pass counts), then pairs in a loop: every split
    sorts stably, with payloads (argsort)."""
    x = np.random.default_rng(n).integers(-20, 20, (3, n)).astype(np.float32)
    x[0, n // 2] = np.nan
    check_jit(lambda a: fnp.sort(a, axis=-1), x, ref=lambda a: np.sort(a, axis=-1))
    check_jit(lambda a: fnp.argsort(a, axis=-1), x, ref=lambda a: np.argsort(a, axis=-1, kind="stable"))


@pytest.mark.parametrize("n", [1 << 15, (1 << 15) + 77, 100_003])
def test_a_long_single_row_splits_each_merge_pass_over_the_cores(n):
    """One row of at least `SPLIT_PASSES_MIN_ROW`: each pass's pairs of runs are split over the
    threads, each merging into its own part of the row (the last pass has one pair)."""
    x = np.random.default_rng(n).integers(-1000, 1000, n).astype(np.float32)
    x[::997] = np.nan
    mlir = fj.jit(fnp.sort).lower(x).as_text("mlir")
    if schedule.threads() > 1:
        assert mlir.count("scf.forall") > 1  # the rows' forall, and one per pass
    check_jit(fnp.sort, x, ref=np.sort)
    check_jit(fnp.argsort, x, ref=lambda a: np.argsort(a, kind="stable"))


def test_sort_code_does_not_grow_with_the_row_length():
    """The merge passes after the first are one loop: a million-element row is no more code
    than a thousand-element one (unrolled, it would be 20 pass bodies)."""

    def loops(n):
        return fj.jit(fnp.sort).lower(fj.ShapeDtype((n,), "float32")).as_text("mlir").count("scf.for")

    assert loops(1000) == loops(16_000)  # one thread per row (even pass counts: 10 and 14)
    assert loops(1 << 16) == loops(1 << 20)  # passes split over the cores


def test_sort_edge_cases():
    for x in (np.zeros((0,), np.float32), np.zeros((3, 0), np.int32), f32(1), f32(4, 1)):
        check(fnp.sort, x, ref=np.sort)
        check(fnp.argsort, x, ref=lambda a: np.argsort(a).astype(np.int64))
    check(lambda a: fnp.sort(a, axis=None), np.float32(2.0), ref=lambda a: np.sort(a, axis=None))
    check_jit(lambda a: a.argsort(axis=0), X, ref=lambda a: np.argsort(a, axis=0, kind="stable"))
    with pytest.raises(FlowjitError, match="0-d"):
        fnp.sort(np.float32(1.0))


def check_jit(fn, *args, **kwargs):
    check(fn, *args, modes=("jit",), **kwargs)


@pytest.mark.parametrize("side", ["left", "right"])
def test_searchsorted(side):
    a = np.array([-1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 5.0, np.nan], np.float32)
    v = np.array([[-3.0, -1.0, 0.0, 1.0], [2.0, 5.0, 9.0, np.nan]], np.float32)
    check(
        lambda x, y: fnp.searchsorted(x, y, side=side),
        a,
        v,
        ref=lambda x, y: np.searchsorted(x, y, side=side).astype(np.int64),
    )
    ints = np.array([1, 3, 3, 7], np.int32)
    check(
        lambda x: fnp.searchsorted(x, 3, side=side),
        ints,
        ref=lambda x: np.asarray(np.searchsorted(x, 3, side=side), np.int64),
    )
    order = np.array([2, 0, 1])
    check(
        lambda x, y: fnp.searchsorted(x, y, side, sorter=order),
        np.array([5.0, 9.0, 1.0], np.float32),
        np.float32(6.0),
        ref=lambda x, y: np.asarray(np.searchsorted(x, y, side, sorter=order), np.int64),
    )
    check(
        lambda x, y: fnp.searchsorted(x, y, side=side),
        np.zeros((0,), np.float32),
        v,
        ref=lambda x, y: np.searchsorted(x, y, side=side).astype(np.int64),
    )


def test_data_dependent_functions_eagerly():
    x = np.array([[0, 3, 0], [1, 0, 3]], np.int32)
    got = fnp.nonzero(x)
    assert len(got) == 2 and all(g.dtype == np.int64 for g in got)
    for g, w in zip(got, np.nonzero(x)):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(fnp.flatnonzero(x), np.flatnonzero(x))
    np.testing.assert_array_equal(fnp.argwhere(x), np.argwhere(x))
    np.testing.assert_array_equal(fnp.unique(x), np.unique(x))
    for g, w in zip(fnp.where(x > 0), np.where(x > 0)):
        np.testing.assert_array_equal(g, w)
    for g, w in zip(jit(lambda a: fnp.where(a > 0, size=3))(x), np.where(x > 0)):
        np.testing.assert_array_equal(g, w[:3])
    values, counts = fnp.unique(np.array([2.0, np.nan, 1.0, np.nan, 2.0], np.float32), return_counts=True)
    np.testing.assert_array_equal(values, [1.0, 2.0, np.nan])
    np.testing.assert_array_equal(counts, [1, 2, 2])


@pytest.mark.parametrize("name", ["nonzero", "flatnonzero", "argwhere", "unique"])
def test_data_dependent_functions_under_jit_need_size(name):
    with pytest.raises(FlowjitError, match=r"size=N") as info:
        jit(lambda a: getattr(fnp, name)(a))(X)
    assert "test_numpy_functions.py" in str(info.value)


@pytest.mark.parametrize("size", [1, 4, 9])
def test_nonzero_with_size(size):
    x = np.array([[0, 3, 0], [1, 0, 3]], np.int32)

    def padded(rows, fill):
        out = np.full(size, fill, np.int64)
        out[: min(size, len(rows))] = rows[:size]
        return out

    want = tuple(padded(r, 0) for r in np.nonzero(x))
    check(lambda a: fnp.nonzero(a, size=size), x, ref=lambda a: want)
    check(lambda a: fnp.flatnonzero(a, size=size, fill_value=-1), x, ref=lambda a: padded(np.flatnonzero(a), -1))
    check(lambda a: fnp.argwhere(a, size=size), x, ref=lambda a: np.stack(want, axis=1))
    check(
        lambda a: fnp.nonzero(a, size=size, fill_value=(7, 8)),
        x,
        ref=lambda a: (padded(np.nonzero(a)[0], 7), padded(np.nonzero(a)[1], 8)),
    )
    check(lambda a: fnp.flatnonzero(a, size=size), np.zeros((0,), np.float32), ref=lambda a: np.zeros(size, np.int64))


@pytest.mark.parametrize("size", [1, 3, 6])
def test_unique_with_size(size):
    x = np.array([3.0, -0.0, np.nan, 3.0, 1.5, np.nan, -2.0], np.float32)
    values, counts = np.unique(x, return_counts=True)
    fill = np.float32(-9.0)

    def padded(v, f):
        out = np.full(size, f, v.dtype)
        out[: min(size, len(v))] = v[:size]
        return out

    check(lambda a: fnp.unique(a, size=size), x, ref=lambda a: padded(values, values[0]))
    check(
        lambda a: fnp.unique(a, size=size, fill_value=fill, return_counts=True),
        x,
        ref=lambda a: (padded(values, fill), padded(counts.astype(np.int64), 0)),
    )
    ints = np.array([[4, 1], [4, 4]], np.int32)
    check(lambda a: fnp.unique(a, size=size, fill_value=0), ints, ref=lambda a: padded(np.unique(a), 0))
    check(lambda a: fnp.unique(a, size=size), np.array([True, True]), ref=lambda a: padded(np.unique(a), True))


# --- statistics ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_median_percentile_quantile(axis, keepdims):
    x = f32(3, 5, 4)
    check(
        lambda a: fnp.median(a, axis=axis, keepdims=keepdims),
        x,
        ref=lambda a: np.median(a, axis=axis, keepdims=keepdims),
    )
    q = np.array([0.0, 12.5, 50.0, 99.0, 100.0])
    check(
        lambda a: fnp.percentile(a, q, axis=axis, keepdims=keepdims),
        x,
        ref=lambda a: np.percentile(a, q, axis=axis, keepdims=keepdims).astype(np.float32),
    )
    check(
        lambda a: fnp.quantile(a, 0.3, axis=axis, keepdims=keepdims),
        x,
        ref=lambda a: np.quantile(a, 0.3, axis=axis, keepdims=keepdims).astype(np.float32),
    )


def test_order_statistics_with_nans_and_ints():
    x = with_nans(4, 6)
    x[0] = np.nan
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        for name in ("nanmedian", "nanpercentile", "nanquantile"):
            args = () if name == "nanmedian" else ((25.0,) if name == "nanpercentile" else (0.75,))
            check(
                lambda a, n=name, q=args: getattr(fnp, n)(a, *q, axis=1),
                x,
                ref=lambda a, n=name, q=args: getattr(np, n)(a, *q, axis=1).astype(np.float32),
            )
    check(lambda a: fnp.median(a, axis=1), x, ref=lambda a: np.median(a, axis=1))
    check(fnp.median, i32(5), ref=lambda a: np.median(a).astype(np.float32))
    check(lambda a: fnp.percentile(a, [10, 90]), i32(2, 3), ref=lambda a: np.percentile(a, [10, 90]).astype(np.float32))
    traced_q = jit(lambda a, q: fnp.quantile(a, q))(X, np.float32(0.25))
    np.testing.assert_allclose(traced_q, np.quantile(X, 0.25), rtol=1e-6)
    with pytest.raises(FlowjitError, match=r"\[0, 1\]"):
        fnp.percentile(X, 101)


def test_cov_corrcoef():
    x = f32(3, 10)
    check(fnp.cov, x, ref=lambda a: np.cov(a).astype(np.float32), rtol=1e-5, atol=1e-5)
    check(
        lambda a: fnp.cov(a, rowvar=False, bias=True),
        x.T.copy(),
        ref=lambda a: np.cov(a, rowvar=False, bias=True).astype(np.float32),
        rtol=1e-5,
        atol=1e-5,
    )
    check(
        lambda a, b: fnp.cov(a, b), x[0], x[1], ref=lambda a, b: np.cov(a, b).astype(np.float32), rtol=1e-5, atol=1e-5
    )
    check(fnp.cov, x[0], ref=lambda a: np.cov(a).astype(np.float32), rtol=1e-5)
    check(fnp.corrcoef, x, ref=lambda a: np.corrcoef(a).astype(np.float32), rtol=1e-5, atol=1e-5)


def test_interp():
    xp = np.array([0.0, 1.0, 1.5, 4.0], np.float32)
    fp = np.array([1.0, -1.0, 2.0, 0.5], np.float32)
    x = np.array([[-1.0, 0.0, 0.3, 1.0], [1.2, 3.9, 4.0, 9.0]], np.float32)
    check(lambda a: fnp.interp(a, xp, fp), x, ref=lambda a: np.interp(a, xp, fp).astype(np.float32))
    check(
        lambda a: fnp.interp(a, xp, fp, left=-7.0, right=7.0),
        x,
        ref=lambda a: np.interp(a, xp, fp, left=-7.0, right=7.0).astype(np.float32),
    )
    check(lambda a: fnp.interp(a, [2.0], [3.0]), x, ref=lambda a: np.interp(a, [2.0], [3.0]).astype(np.float32))
    check(
        lambda a: fnp.interp(a, [0, 1], [1, 2]), f32(4), ref=lambda a: np.interp(a, [0, 1], [1, 2]).astype(np.float32)
    )


def test_histogram():
    x = np.array([0.5, 1.0, 1.5, 2.0, 2.0, 3.9, 4.0, -1.0], np.float32)
    for bins, range_ in ((4, None), (3, (0.0, 2.0)), (np.array([0.0, 1.0, 2.5, 4.0], np.float32), None)):
        counts, edges = np.histogram(x, bins, range_)
        check(
            lambda a, b=bins, r=range_: fnp.histogram(a, b, r),
            x,
            ref=lambda a, c=counts, e=edges: (c.astype(np.int64), e.astype(np.float32)),
        )
    w = f32(8, lo=0, hi=1)
    counts, edges = np.histogram(x, 5, weights=w, density=True)
    check(
        lambda a: fnp.histogram(a, 5, weights=w, density=True),
        x,
        ref=lambda a: (counts.astype(np.float32), edges.astype(np.float32)),
        rtol=1e-5,
    )
    check(
        lambda a: fnp.histogram(a, 2)[0],
        np.full(3, 2.0, np.float32),
        ref=lambda a: np.histogram(a, 2)[0].astype(np.int64),
    )


# --- linalg ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ord_", [None, 1, 2, np.inf, -np.inf, 0, 3, 0.5])
def test_vector_norm(ord_):
    v = f32(6)
    check(lambda a: fnp.linalg.norm(a, ord_), v, ref=lambda a: np.linalg.norm(a, ord_), rtol=1e-5)
    check(
        lambda a: fnp.linalg.norm(a, ord_, axis=1, keepdims=True),
        X,
        ref=lambda a: np.linalg.norm(a, ord_, axis=1, keepdims=True),
        rtol=1e-5,
    )


@pytest.mark.parametrize("ord_", [None, "fro", 1, -1, np.inf, -np.inf, 2, -2, "nuc"])
def test_matrix_norm(ord_):
    check(lambda a: fnp.linalg.norm(a, ord_), X, ref=lambda a: np.linalg.norm(a, ord_), rtol=1e-5)
    a3 = f32(2, 3, 4)
    check(
        lambda a: fnp.linalg.norm(a, ord_, axis=(2, 0)),
        a3,
        ref=lambda a: np.linalg.norm(a, ord_, axis=(2, 0)),
        rtol=1e-5,
    )
    check(
        lambda a: fnp.linalg.norm(a, ord_, axis=(2, 0), keepdims=True),
        a3,
        ref=lambda a: np.linalg.norm(a, ord_, axis=(2, 0), keepdims=True),
        rtol=1e-5,
    )
    with pytest.raises(FlowjitError, match="is not one of"):
        fnp.linalg.norm(X, 3)


def test_kron():
    check(fnp.kron, X, f32(2, 3), ref=np.kron)
    check(fnp.kron, f32(3), f32(2, 2), ref=np.kron)


# --- gradients and compiled code ------------------------------------------------------------------------


def _finite_difference(f, x, eps=1e-3):
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        hi, lo = x.copy(), x.copy()
        hi[i] += eps
        lo[i] -= eps
        grad[i] = (f(hi) - f(lo)) / (2 * eps)
    return grad


def test_gradients_through_sort_median_and_take_along_axis():
    x = np.random.default_rng(5).permutation(20).astype(np.float64).reshape(4, 5) * 0.31
    weights = np.linspace(1, 2, 5)

    def loss(a):
        return (
            fnp.sum(fnp.sort(a, axis=1) * weights)
            + fnp.sum(fnp.median(a, axis=0))
            + fnp.sum(fnp.take_along_axis(a, fnp.argsort(a, axis=0), 0)[0])
        )

    def numpy_loss(a):
        return np.sum(np.sort(a, axis=1) * weights) + np.sum(np.median(a, axis=0)) + np.sum(np.sort(a, axis=0)[0])

    got = fj.grad(loss)(x)
    np.testing.assert_allclose(got, _finite_difference(numpy_loss, x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(jit(fj.grad(loss))(x), got, rtol=1e-12)


def test_gradient_of_sort_reuses_the_forward_permutation():
    lowered = fj.jit(fj.grad(lambda a: fnp.sum(fnp.sort(a) * np.arange(5.0, dtype=np.float32)))).lower(f32(3, 5))
    assert lowered.as_text("optimized").count(" = sort ") == 1


def test_compiled_programs_match_numpy():
    x = with_nans(6, 33)

    @fj.jit
    def stats(a):
        return (
            fnp.sort(a, axis=0),
            fnp.argsort(a),
            fnp.nanmedian(a, axis=1),
            fnp.unique(fnp.floor(a * 2), size=8, fill_value=0.0),
            fnp.searchsorted(fnp.sort(a[0]), a[1]),
            fnp.cumprod(fnp.tril(a[:6, :6]) + 1, axis=1),
        )

    got = stats(x)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy warns about all-nan rows
        want = (
            np.sort(x, axis=0),
            np.argsort(x, kind="stable"),
            np.nanmedian(x, axis=1),
            None,
            np.searchsorted(np.sort(x[0]), x[1]),
            np.cumprod(np.tril(x[:6, :6]) + 1, axis=1),
        )
    for i, (g, w) in enumerate(zip(got, want)):
        if w is not None:
            np.testing.assert_allclose(g, w.astype(g.dtype), rtol=1e-5, equal_nan=True, err_msg=str(i))
    uniq = np.unique(np.floor(x * 2))
    expected_unique = np.zeros(8, np.float32)
    expected_unique[: min(8, len(uniq))] = uniq[:8]
    np.testing.assert_array_equal(got[3], expected_unique)


def test_more_sorting_and_searching():
    x = np.array([[3, 1, 2, 1], [0, 5, 5, 4]], np.int32)
    check(lambda a: fnp.partition(a, 2, axis=1)[:, 2], x, ref=lambda a: np.partition(a, 2, axis=1)[:, 2])
    check(
        lambda a: fnp.take_along_axis(a, fnp.argpartition(a, 1, axis=0), 0)[1],
        x,
        ref=lambda a: np.take_along_axis(a, np.argpartition(a, 1, axis=0), 0)[1],
    )
    surnames, names = np.array([2, 1, 2, 0, 1], np.int32), np.array([0.5, 0.1, -1.0, 3.0, 0.1], np.float32)
    check(lambda a, b: fnp.lexsort((a, b)), surnames, names, ref=lambda a, b: np.lexsort((a, b)).astype(np.int64))
    bins = np.array([0.0, 1.0, 2.5], np.float32)
    v = np.array([-1.0, 0.0, 1.0, 2.0, 2.5, 7.0], np.float32)
    for right in (False, True):
        check(
            lambda a, r=right: fnp.digitize(a, bins, r),
            v,
            ref=lambda a, r=right: np.digitize(a, bins, r).astype(np.int64),
        )
    ints = np.array([1, 4, 1, 0, 4, 4], np.int32)
    np.testing.assert_array_equal(fnp.bincount(ints, minlength=7), np.bincount(ints, minlength=7))
    check(lambda a: fnp.bincount(a, length=3), ints, ref=lambda a: np.bincount(a)[:3].astype(np.int64))
    w = f32(6)
    check(
        lambda a: fnp.bincount(a, w, length=7),
        ints,
        ref=lambda a: np.bincount(a, w, minlength=7).astype(np.float32),
        rtol=1e-6,
    )
    with pytest.raises(FlowjitError, match="length=N"):
        jit(fnp.bincount)(ints)
    check(lambda a: fnp.isin(a, [1, 4]), x, ref=lambda a: np.isin(a, [1, 4]))
    check(lambda a: fnp.isin(a, np.array([5]), invert=True), x, ref=lambda a: np.isin(a, [5], invert=True))


def test_more_shape_functions():
    a3 = f32(2, 3, 4)
    for k in (-1, 0, 1, 2, 3, 5):
        check(lambda a, k=k: fnp.rot90(a, k), X, ref=lambda a, k=k: np.rot90(a, k))
        check(lambda a, k=k: fnp.rot90(a, k, axes=(2, 0)), a3, ref=lambda a, k=k: np.rot90(a, k, axes=(2, 0)))
    check(lambda a, b: fnp.broadcast_arrays(a, b), f32(3, 1), f32(4), ref=lambda a, b: np.broadcast_arrays(a, b))
    check(lambda a: fnp.append(a, a[:1], axis=0), X, ref=lambda a: np.append(a, a[:1], axis=0))
    check(lambda a: fnp.append(a, np.float32(2.0)), X, ref=lambda a: np.append(a, np.float32(2.0)))
    check(
        lambda a: fnp.select([a > 1, a < -1], [a, -a], 0.5), X, ref=lambda a: np.select([a > 1, a < -1], [a, -a], 0.5)
    )
    np.testing.assert_allclose(fnp.logspace(0, 2, 3), np.logspace(0, 2, 3), rtol=1e-6)
    np.testing.assert_allclose(fnp.geomspace(1, 8, 4), np.geomspace(1, 8, 4), rtol=1e-6)


@pytest.mark.parametrize(
    "shape, axis",
    [((2, 300), 1), ((300, 3), 0), ((1024, 40), 1), ((7, 33, 24), 1), ((5000,), 0), ((3, 70, 2), 2), ((70, 5, 9), 0)],
)
def test_cumsum_is_one_op_and_numpys_sequential_sum(shape, axis):
    """One `cumsum` op (no matmuls, no cond), compiled to running sums in numpy's order: float32
    results bit for bit numpy's, along any axis (groups of rows, narrow columns, blocks of columns
    and their partial edges); and through `grad`, the reversed running sum."""
    x = f32(*shape, lo=-9, hi=9)
    fn = fj.jit(lambda a: fnp.cumsum(a, axis=axis))
    assert [op.name for op in fn.lower(x).graph("traced").ops] == ["cumsum"]
    np.testing.assert_array_equal(fn(x), np.cumsum(x, axis=axis))
    expected = np.flip(np.cumsum(np.flip(x, axis), axis=axis), axis)
    grad = fj.jit(fj.grad(lambda a, w: fnp.sum(fnp.cumsum(a, axis=axis) * w)))(np.zeros_like(x), x)
    np.testing.assert_array_equal(grad, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("shape, axis", [((2, 300), 1), ((300, 3), 0), ((7, 33, 24), 1), ((5000,), 0), ((3, 70, 2), 2)])
def test_cumprod_is_a_linear_recurrence_and_numpys_products(shape, axis, dtype):
    """cumprod is one `linear_recurrence` op (a = x, b = x first then -0.0): numpy's products bit for
    bit (zeros and -0.0 among them, ints wrapping as numpy's), eager and compiled; its gradient is
    exact with zeros (no division): sum over j >= i of w[j] times the product of x[k], k <= j,
    k != i."""
    rng = np.random.default_rng(5)
    if np.dtype(dtype).kind == "f":
        x = rng.uniform(0.9, 1.1, shape).astype(dtype)
        x.flat[::13] = 0.0
        x.flat[5::17] = -0.0
    else:
        x = rng.integers(-3, 4, shape).astype(dtype)
    fn = fj.jit(lambda a: fnp.cumprod(a, axis=axis))
    assert "linear_recurrence" in [op.name for op in fn.lower(x).graph("traced").ops]
    want = np.cumprod(x, axis=axis, dtype=dtype)
    for got in (fn(x), fnp.cumprod(x, axis=axis)):
        assert got.dtype == want.dtype and np.asarray(got).tobytes() == want.tobytes()
    if np.dtype(dtype).kind != "f":
        return
    v = np.moveaxis(x.astype(np.float64), axis, -1)[..., :12]  # a short axis for the O(n^2) reference
    w = np.random.default_rng(6).standard_normal(v.shape)
    grad = fj.jit(fj.grad(lambda a: fnp.sum(fnp.cumprod(a, axis=-1) * w)))(v)
    n = v.shape[-1]
    want_grad = np.zeros_like(v)
    for i in range(n):
        for j in range(i, n):
            others = np.prod(np.delete(v[..., : j + 1], i, axis=-1), axis=-1)
            want_grad[..., i] += w[..., j] * others
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12, atol=1e-12)


def test_cumsum_of_bools_and_half_types():
    """Bools sum as int64 (numpy's); half types in float32, each running sum rounded once."""
    x = f32(3, 50, lo=-4, hi=4)
    check(lambda a: fnp.cumsum(a > 0, axis=1), x, ref=lambda a: np.cumsum(a > 0, axis=1).astype(np.int64))
    h = x.astype(np.float16)
    np.testing.assert_array_equal(
        fj.jit(lambda a: fnp.cumsum(a, axis=1))(h), np.cumsum(h.astype(np.float32), axis=1).astype(np.float16)
    )
    b = f32(40, 3, lo=-4, hi=4).astype(bf16)
    np.testing.assert_array_equal(
        fj.jit(lambda a: fnp.cumsum(a, axis=0))(b), np.cumsum(b.astype(np.float32), axis=0).astype(b.dtype)
    )


@pytest.mark.parametrize("n", [5, 300])
@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_cumsum_with_inf_and_nan_is_sequential(n, target):
    """numpy's running sum: an inf or nan changes the positions from it on, never those before (the
    zeros of a triangular matmul times inf would make nan of every earlier position)."""
    x = np.ones((2, n), np.float32)
    x[0, n // 2], x[1, 1], x[1, n - 1] = np.inf, -np.inf, np.nan
    got = fj.jit(lambda a: fnp.cumsum(a, axis=1), target=target)(x)
    np.testing.assert_array_equal(got, np.cumsum(x, axis=1))
    np.testing.assert_array_equal(fnp.cumsum(x, axis=1), np.cumsum(x, axis=1))


def test_gcd_lcm():
    a = np.array([[12, -18, 0, 7, 0, 1 << 40]], np.int64)
    b = np.array([[8], [27]], np.int64)
    check(fnp.gcd, a, b, ref=np.gcd)
    check(fnp.lcm, a, b, ref=np.lcm)
    check(lambda x: fnp.gcd(x, 6), i32(5), ref=lambda x: np.gcd(x, 6).astype(np.int32))
    np.testing.assert_array_equal(fj.jit(fnp.gcd)(a, b), np.gcd(a, b))  # compiled: one while loop
    with pytest.raises(FlowjitError, match="integer"):
        fnp.gcd(X, 2)


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_nancumsum_nancumprod(axis):
    x = with_nans(3, 4)
    check(lambda a: fnp.nancumsum(a, axis), x, ref=lambda a: np.nancumsum(a, axis), rtol=1e-5, atol=1e-5)
    check(lambda a: fnp.nancumprod(a, axis), x, ref=lambda a: np.nancumprod(a, axis), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
@pytest.mark.parametrize("dtype", [np.float16, bf16], ids=["f16", "bf16"])
def test_half_precision_statistics_use_float32_intermediates(target, dtype):
    """As numpy: float16 means and variances accumulate in float32 and round once. In float16 the
    count of 70,000 elements is inf, and a sum of values around 2 overflows."""
    x = (np.random.default_rng(8).random((3, 70000)) * 4).astype(dtype)
    x[0, 5] = np.nan
    exact = x.astype(np.float64)
    for name in ("mean", "var", "std", "nanmean", "nanvar", "nanstd"):
        got = fj.jit(lambda a, name=name: getattr(fnp, name)(a, axis=1), target=target)(x)
        with np.errstate(invalid="ignore"):
            want = getattr(np, name)(exact, axis=1)
        assert got.dtype == dtype, name
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2, err_msg=name)
    assert fj.jit(fnp.mean, target=target)(np.ones(100000, dtype)) == 1


def test_trapezoid():
    """numpy.trapezoid (and the old name trapz): spacing, 1-D sample points, sample points of y's
    shape, another axis; ints integrate in float32 (numpy: float64)."""
    y, x = f32(3, 7), np.sort(f32(7))
    x2 = np.sort(f32(3, 7), axis=1)
    check(lambda a: fnp.trapezoid(a), y, ref=np.trapezoid)
    check(lambda a: fnp.trapezoid(a, dx=0.5), y, ref=lambda a: np.trapezoid(a, dx=0.5))
    check(lambda a, b: fnp.trapezoid(a, b), y, x, ref=np.trapezoid)
    check(lambda a, b: fnp.trapz(a, b), y, x2, ref=np.trapezoid)
    check(lambda a, b: fnp.trapezoid(a, b, axis=0), y, np.sort(f32(3)), ref=lambda a, b: np.trapezoid(a, b, axis=0))
    check(lambda a: fnp.trapezoid(a), np.arange(5), ref=np.trapezoid, dtype=np.float32)
