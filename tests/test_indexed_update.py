"""`x.at[index].set/add/subtract/multiply/min/max/get`: against numpy's in-place forms (`y[i] = v`,
`np.add.at`, ...) under jit (compiled) and eagerly (`fnp.at`), for every index kind, with
out-of-range traced indices, masks, int and bool dtypes; gradients against finite differences."""

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp

RNG = np.random.default_rng(7)
X = RNG.standard_normal((4, 5))


def _numpy_update(method: str, x: np.ndarray, index, values) -> np.ndarray:
    """The reference: numpy's unbuffered in-place update on a copy (`y[index] = v` for set: the
    last of repeated indices wins, as in flowjit)."""
    y = x.copy()
    if method == "set":
        y[index] = values
        return y
    ufunc = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "min": np.minimum, "max": np.maximum}
    ufunc[method].at(y, index, values)
    return y


METHODS = ("set", "add", "subtract", "multiply", "min", "max")

# (id, index, values' shape): static indices of every kind; repeated positions in the last three.
INDEXES = [
    ("int", 2, ()),
    ("negative-int", -1, (5,)),
    ("slice-and-int", (slice(1, None), 0), (3,)),
    ("strided-reversed", (slice(None, None, -2), slice(1, 4)), (2, 3)),
    ("ellipsis-newaxis", (Ellipsis, None, 1), ()),
    ("int-array-rows", np.array([0, 2, 0, 3]), (4, 5)),
    ("two-int-arrays", (np.array([1, 1, 3]), np.array([0, 0, -1])), (3,)),
    ("array-and-slice", (slice(None), np.array([[4, 4], [0, 1]])), (4, 2, 2)),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("index_id, index, values_shape", INDEXES, ids=[i[0] for i in INDEXES])
def test_at_matches_numpy_under_jit_and_eagerly(method, index_id, index, values_shape):
    values = RNG.uniform(-2, 2, values_shape)
    expected = _numpy_update(method, X, index, values)
    compiled = fj.jit(lambda x, v: getattr(x.at[index], method)(v))(X, values)
    np.testing.assert_allclose(compiled, expected, rtol=1e-12)
    np.testing.assert_allclose(getattr(fnp.at(X)[index], method)(values), expected, rtol=1e-12)
    np.testing.assert_array_equal(X, X.copy())  # never in place


@pytest.mark.parametrize("method", METHODS)
def test_traced_indices_repeat_accumulate_and_out_of_range_ones_are_dropped(method):
    idx = np.array([3, -1, 3, 9, -7, 0])  # 9 and -7 are out of range for 4 rows: dropped (JAX's mode)
    values = RNG.uniform(-2, 2, (6, 5))
    keep = (idx >= -4) & (idx < 4)
    expected = _numpy_update(method, X, idx[keep], values[keep])
    out = fj.jit(lambda x, i, v: getattr(x.at[i], method)(v))(X, idx, values)
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    clipped = fj.jit(lambda x, i, v: getattr(x.at[i], method)(v, mode="clip"))(X, idx, values)
    np.testing.assert_allclose(
        clipped, _numpy_update(method, X, np.clip(np.where(idx < 0, idx + 4, idx), 0, 3), values)
    )


def test_get_clamps_by_default_and_fills_with_mode_fill():
    x = np.arange(4, dtype=np.float32)
    idx = np.array([0, 5, -1, -9])
    np.testing.assert_array_equal(fj.jit(lambda x, i: x.at[i].get())(x, idx), [0.0, 3.0, 3.0, 0.0])
    filled = fj.jit(lambda x, i: x.at[i].get(mode="fill", fill_value=-1.0))(x, idx)
    np.testing.assert_array_equal(filled, [0.0, -1.0, 3.0, -1.0])
    assert np.isnan(fj.jit(lambda x, i: x.at[i].get(mode="fill"))(x, idx)[1])  # nan by default, as JAX
    np.testing.assert_array_equal(fj.jit(lambda x: x.at[1:3].get())(x), [1.0, 2.0])


def test_masks_traced_update_where_true_and_numpy_ones_select_their_elements():
    mask = X > 0
    np.testing.assert_array_equal(fj.jit(lambda x, m: x.at[m].set(0.0))(X, mask), np.where(mask, 0.0, X))
    np.testing.assert_allclose(fj.jit(lambda x: x.at[x > 0].multiply(x))(X), np.where(mask, X * X, X))
    values = np.arange(mask.sum(), dtype=np.float64)  # one value per true element, as numpy's x[mask] = v
    np.testing.assert_array_equal(fj.jit(lambda x: x.at[mask].set(values))(X), _numpy_update("set", X, mask, values))
    with pytest.raises(fj.FlowjitTypeError, match="traced boolean mask must have x's shape"):
        fj.jit(lambda x, m: x.at[m].set(0.0))(X, mask[0])


def test_int_and_bool_arrays():
    ints = np.arange(6, dtype=np.int32)
    out = fj.jit(lambda x: x.at[np.array([1, 1, 2])].add(5))(ints)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [0, 11, 7, 3, 4, 5])
    np.testing.assert_array_equal(fj.jit(lambda x: x.at[::2].max(3))(ints), [3, 1, 3, 3, 4, 5])
    flags = fj.jit(lambda x: x.at[1:3].set(True))(np.zeros(4, bool))
    assert flags.dtype == np.bool_
    np.testing.assert_array_equal(flags, [False, True, True, False])
    np.testing.assert_array_equal(fj.jit(lambda x: x.at[0].set(2.7))(ints)[:2], [2, 1])  # cast to x's dtype


def test_errors_name_the_users_line():
    x = np.zeros((2, 2), np.float32)
    with pytest.raises(fj.FlowjitValueError, match=r"test_indexed_update.py:\d+: .*index 7 is out of bounds"):
        fj.jit(lambda x: x.at[7].set(1.0))(x)
    with pytest.raises(fj.FlowjitValueError, match=r"test_indexed_update.py:\d+: .*do not broadcast to the indexed"):
        fj.jit(lambda x: x.at[0].set(np.ones(3, np.float32)))(x)
    with pytest.raises(fj.FlowjitValueError, match="unknown mode"):
        fj.jit(lambda x: x.at[0].set(1.0, mode="wrap"))(x)

    def assign(x):
        x[0] = 1.0
        return x

    with pytest.raises(fj.FlowjitTypeError, match=r"x = x.at\[...\].set\(v\)"):
        fj.jit(assign)(x)


def _finite_difference_grad(f, args, argnum, eps=1e-6):
    args = [np.array(a, np.float64) for a in args]
    grad = np.zeros_like(args[argnum])
    for i in np.ndindex(grad.shape):
        up = [a.copy() for a in args]
        down = [a.copy() for a in args]
        up[argnum][i] += eps
        down[argnum][i] -= eps
        grad[i] = (f(*up) - f(*down)) / (2 * eps)
    return grad


WEIGHTS = RNG.standard_normal((4, 5))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "index", [(slice(1, 3), 2), np.array([1, 3, 1]), (np.array([0, 2, 0]), np.array([4, 4, 4]))], ids=repr
)
def test_gradients_match_finite_differences(method, index):
    # Repeated positions included: multiply/min/max combine them (JAX differentiates scatter_mul only
    # with unique indices). Values well apart, so min/max have no ties.
    x = RNG.permutation(20).reshape(4, 5) / 4.0 - 2.3
    shape = np.zeros((4, 5))[index].shape
    values = RNG.permutation(int(np.prod(shape))).reshape(shape) / 3.0 - 1.1  # k/4 - 2.3 != j/3 - 1.1

    def loss(x, v):
        return fnp.sum(getattr(x.at[index], method)(v) ** 2 * WEIGHTS)

    def reference(x, v):
        return float(np.sum(_numpy_update(method, x, index, v) ** 2 * WEIGHTS))

    gx, gv = fj.jit(fj.grad(loss, argnums=(0, 1)))(x, values)
    np.testing.assert_allclose(gx, _finite_difference_grad(reference, (x, values), 0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gv, _finite_difference_grad(reference, (x, values), 1), rtol=1e-6, atol=1e-6)
