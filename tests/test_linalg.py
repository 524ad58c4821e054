"""flowjit.numpy.linalg's decompositions and solvers and flowjit.scipy.linalg: compiled results
against numpy/scipy (float32 and float64, stacks of matrices, sizes 1 to 64, ill-conditioned
cases), eager results (LAPACK) with flowjit's dtypes, gradients and JVPs against central finite
differences, and the errors users see. Compiling dominates the run time, so each jitted function
below computes many results at once and is shared by the tests."""

import numpy as np
import pytest
import scipy.linalg as sl

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.numpy.linalg.eigh import largest_entry_signs

L = fnp.linalg
TOL = {np.float32: 2e-4, np.float64: 1e-10}


def _close(found, expected, dtype, scale=1.0):
    """|found - expected| <= tol * scale * max(1, max|expected|), and the dtype kept."""
    found, expected = np.asarray(found), np.asarray(expected)
    assert found.shape == expected.shape, (found.shape, expected.shape)
    assert found.dtype == dtype, found.dtype
    bound = TOL[dtype] * scale * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    assert np.max(np.abs(found - expected), initial=0.0) <= bound, np.max(np.abs(found - expected))


def _signed_eigh(a):
    w, v = np.linalg.eigh(a)
    return w, v * largest_entry_signs(v)


def _signed_svd(a, full_matrices):
    u, s, vh = np.linalg.svd(a, full_matrices=full_matrices)
    k = s.shape[-1]
    signs = largest_entry_signs(u[..., :k])
    u = np.concatenate([u[..., :k] * signs, u[..., k:]], axis=-1)
    return u, s, np.concatenate([vh[..., :k, :] * np.swapaxes(signs, -1, -2), vh[..., k:, :]], axis=-2)


def _problem(shape, dtype, seed=0):
    """(spd, general, rhs): a well-conditioned symmetric positive definite and a general stack."""
    rng = np.random.default_rng(seed)
    n = shape[-1]
    a = rng.standard_normal(shape)
    spd = a @ np.swapaxes(a, -1, -2) + n * np.eye(n)
    rhs = rng.standard_normal(shape[:-1] + (3,))
    return spd.astype(dtype), a.astype(dtype), rhs.astype(dtype)


@fj.jit
def square_results(spd, a, b):
    return {
        "cholesky": L.cholesky(spd),
        "cholesky_upper": L.cholesky(spd, upper=True),
        "solve": L.solve(a, b),
        "solve_vector": L.solve(a, b[(0,) * (b.ndim - 2) + (slice(None), 0)]),
        "inv": L.inv(a),
        "det": L.det(a),
        "slogdet": tuple(L.slogdet(a)),
        "eigh": tuple(L.eigh(a)),
        "eigh_upper": tuple(L.eigh(a, UPLO="U")),
    }


@fj.jit
def rectangular_results(a):
    return {
        "qr": tuple(L.qr(a)),
        "qr_complete": tuple(L.qr(a, mode="complete")),
        "qr_r": L.qr(a, mode="r"),
        "svd": tuple(L.svd(a)),
        "svd_reduced": tuple(L.svd(a, full_matrices=False)),
        "svd_values": L.svd(a, compute_uv=False),
    }


def _square_expected(spd, a, b):
    lower = np.tril(a) + np.swapaxes(np.tril(a, -1), -1, -2)
    upper = np.triu(a) + np.swapaxes(np.triu(a, 1), -1, -2)
    vector = b[(0,) * (b.ndim - 2) + (slice(None), 0)]
    return {
        "cholesky": np.linalg.cholesky(spd),
        "cholesky_upper": np.swapaxes(np.linalg.cholesky(spd), -1, -2),
        "solve": np.linalg.solve(a, b),
        "solve_vector": np.linalg.solve(a, vector),
        "inv": np.linalg.inv(a),
        "det": np.linalg.det(a),
        "slogdet": tuple(np.linalg.slogdet(a)),
        "eigh": _signed_eigh(lower),
        "eigh_upper": _signed_eigh(upper),
    }


def _rectangular_expected(a):
    return {
        "qr": tuple(np.linalg.qr(a)),
        "qr_complete": tuple(np.linalg.qr(a, mode="complete")),
        "qr_r": np.linalg.qr(a, mode="r"),
        "svd": _signed_svd(a, True),
        "svd_reduced": _signed_svd(a, False),
        "svd_values": np.linalg.svd(a, compute_uv=False),
    }


# Sizes 1 (the loops run once), 2, odd sizes (Jacobi pads them), 64; stacks of matrices.
SQUARE = [((1, 1), np.float64), ((3, 7, 7), np.float64), ((64, 64), np.float64), ((2, 8, 8), np.float32)]


@pytest.mark.parametrize("shape,dtype", SQUARE, ids=lambda v: str(v) if isinstance(v, tuple) else v.__name__)
def test_square_decompositions_compiled_match_numpy(shape, dtype):
    spd, a, b = _problem(shape, dtype)
    found = square_results(spd, a, b)
    expected = _square_expected(spd.astype(np.float64), a.astype(np.float64), b.astype(np.float64))
    scale = shape[-1]  # error bounds grow with n (and the condition of a random matrix)
    for name, want in expected.items():
        got = found[name]
        for g, w in zip(got, want) if isinstance(want, tuple) else [(got, want)]:
            _close(g, w.astype(dtype), dtype, scale if "det" not in name else scale * 10)


RECTANGULAR = [((1, 1), np.float64), ((2, 5, 3), np.float64), ((40, 33), np.float64), ((4, 9), np.float32)]


@pytest.mark.parametrize("shape,dtype", RECTANGULAR, ids=lambda v: str(v) if isinstance(v, tuple) else v.__name__)
def test_qr_and_svd_compiled_match_numpy(shape, dtype):
    a = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    found = rectangular_results(a)
    expected = _rectangular_expected(a.astype(np.float64))
    k = min(shape[-2:])
    u, s, vh = found["svd"]
    found["svd"] = (u[..., :k], s, vh[..., :k, :])  # the rest of a full U or Vh is any orthonormal completion
    u_np, s_np, vh_np = expected["svd"]
    expected["svd"] = (u_np[..., :k], s_np, vh_np[..., :k, :])
    for name, want in expected.items():
        got = found[name]
        for g, w in zip(got, want) if isinstance(want, tuple) else [(got, want)]:
            _close(g, w.astype(dtype), dtype, max(shape[-2:]))
    for q in (u, np.swapaxes(vh, -1, -2), found["qr_complete"][0]):
        assert np.abs(np.swapaxes(q, -1, -2) @ q - np.eye(q.shape[-1])).max() <= 10 * TOL[dtype] * k
    np.testing.assert_allclose((u[..., :k] * s[..., None, :]) @ vh[..., :k, :], a, atol=10 * TOL[dtype] * k)


def test_results_are_numpys_named_tuples():
    spd, a, b = _problem((4, 4), np.float64)
    for call in (lambda x: x, fj.jit(lambda x: x)):
        assert set(L.eigh(call(spd))._fields) == {"eigenvalues", "eigenvectors"}
    assert L.slogdet(a)._fields == np.linalg.slogdet(a)._fields
    assert L.qr(a)._fields == np.linalg.qr(a)._fields
    assert L.svd(a)._fields == np.linalg.svd(a)._fields
    w, v = fj.jit(L.eigh)(spd)
    assert isinstance(fj.jit(L.eigh)(spd), L.EighResult) and w.shape == (4,) and v.shape == (4, 4)


def test_eager_calls_run_lapack_with_flowjits_dtypes():
    spd, a, b = _problem((2, 5, 5), np.float32)
    for name, fn, args in [
        ("cholesky", L.cholesky, (spd,)),
        ("solve", L.solve, (a, b)),
        ("inv", L.inv, (a,)),
        ("det", L.det, (a,)),
    ]:
        got = fn(*args)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32, name
        np.testing.assert_allclose(got, getattr(np.linalg, name)(*args), rtol=1e-6, err_msg=name)
    w, v = L.eigh(spd)
    np.testing.assert_allclose(w, np.linalg.eigh(spd)[0], rtol=1e-6)
    assert np.all(np.take_along_axis(v, np.abs(v).argmax(-2)[..., None, :], -2) > 0)  # flowjit's sign rule
    ints = np.array([[4, 2], [2, 3]], np.int32)
    assert L.cholesky(ints).dtype == np.float32 and fj.jit(L.cholesky)(ints).dtype == np.float32
    assert L.solve(a.astype(np.float64), b).dtype == np.float64  # float32 with float64 promotes


def test_ill_conditioned_but_fine_inputs():
    n = 7  # the shapes of SQUARE and RECTANGULAR, so nothing new compiles
    hilbert = 1.0 / (np.arange(n)[:, None] + np.arange(n)[None, :] + 1.0)  # condition ~5e8
    x_true = np.linspace(1.0, 2.0, n)[:, None] * np.ones(3)
    stack = np.stack([hilbert] * 3)
    found = square_results(stack, stack, stack @ x_true)
    np.testing.assert_allclose(found["solve"], np.broadcast_to(x_true, (3, n, 3)), rtol=1e-6)
    chol = found["cholesky"]
    np.testing.assert_allclose(chol @ np.swapaxes(chol, -1, -2), stack, atol=1e-15)
    w, v = found["eigh"]
    np.testing.assert_allclose(w[0], np.linalg.eigh(hilbert)[0], rtol=1e-6, atol=1e-15)
    np.testing.assert_allclose((v[0] * w[0]) @ v[0].T, hilbert, atol=1e-14)
    values = np.array([1e-10, 1e5, 3e-7])
    rotation = np.linalg.qr(np.arange(25.0).reshape(5, 5) ** 0.5)[0]
    graded = rotation[:, :3] * values  # singular values spread over 15 orders of magnitude
    rank_one = np.outer(np.arange(1.0, 6.0), [1.0, 2.0, 0.5])
    found = rectangular_results(np.stack([graded, rank_one]))
    np.testing.assert_allclose(found["svd_values"][0], np.sort(values)[::-1], rtol=1e-6)  # relative accuracy
    u, s, vh = found["svd"]
    np.testing.assert_allclose(u[1].T @ u[1], np.eye(5), atol=1e-12)  # U is completed where s is zero
    np.testing.assert_allclose((u[1, :, :3] * s[1]) @ vh[1], rank_one, atol=1e-12)


def test_singular_and_indefinite_matrices():
    singular = np.ones((3, 7, 7)) + np.diag(np.arange(7.0) % 3)  # rank 3
    found = square_results(-np.stack([np.eye(7)] * 3), singular, np.ones((3, 7, 3)))
    np.testing.assert_array_equal(found["det"], 0.0)
    np.testing.assert_array_equal(found["slogdet"][0], 0.0)
    np.testing.assert_array_equal(found["slogdet"][1], -np.inf)
    assert np.isnan(found["cholesky"]).any()  # not positive definite: nan, as in JAX
    assert L.det(singular[0]) == 0.0
    with pytest.raises(L.LinAlgError, match="test_linalg.py:.*op 'solve': Singular matrix"):
        L.solve(singular[0], np.ones(7))
    with pytest.raises(np.linalg.LinAlgError):  # flowjit's error is also numpy's
        L.cholesky(-np.eye(2))


# --- scipy.linalg -------------------------------------------------------------------------------------

TRIANGULAR_CASES = [(trans, lower, unit) for trans in (0, 1, "T") for lower in (True, False) for unit in (False, True)]


@fj.jit
def scipy_results(a, spd, b):
    solves = [
        fj.scipy.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit)
        for trans, lower, unit in TRIANGULAR_CASES
    ]
    vectors = fj.scipy.linalg.solve_triangular(a, b[..., 0], lower=True)
    factors = [fj.scipy.linalg.cho_factor(spd, lower=lower)[0] for lower in (False, True)]
    cho = [fj.scipy.linalg.cho_solve((c, lower), b) for c, lower in zip(factors, (False, True))]
    return solves, vectors, factors, cho


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scipy_linalg_matches_scipy(dtype):
    spd, a, b = _problem((6, 6), dtype, seed=3)
    a = a + 4 * np.eye(6, dtype=dtype)  # well-conditioned triangles
    solves, vectors, factors, cho = scipy_results(a, spd, b)
    for (trans, lower, unit), got in zip(TRIANGULAR_CASES, solves):
        want = sl.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit)
        _close(got, want, dtype, 10)
        _close(fj.scipy.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit), want, dtype, 10)
    _close(vectors, sl.solve_triangular(a, b[..., 0], lower=True), dtype, 10)
    for got, lower in zip(factors, (False, True)):
        _close(got, sl.cholesky(spd, lower=lower), dtype, 10)
        _close(fj.scipy.linalg.cholesky(spd, lower=lower), sl.cholesky(spd, lower=lower), dtype, 10)
    for got, lower in zip(cho, (False, True)):
        _close(got, sl.cho_solve(sl.cho_factor(spd, lower=lower), b), dtype, 10)


def test_triangular_solve_ignores_the_other_triangle_and_batches():
    rng = np.random.default_rng(4)
    a = np.tril(rng.standard_normal((3, 5, 5))) + 3 * np.eye(5)
    b = rng.standard_normal((1, 5, 2))  # broadcast against a's stack
    garbage = a + np.triu(np.full((5, 5), np.nan), 1)
    got = fj.jit(lambda a, b: fj.scipy.linalg.solve_triangular(a, b, lower=True))(garbage, b)
    np.testing.assert_allclose(got, np.linalg.solve(a, b), rtol=1e-10)
    import flowjit.scipy.linalg

    assert fj.scipy.linalg is flowjit.scipy.linalg


# --- gradients ----------------------------------------------------------------------------------------------


def _finite_difference_gradient(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[idx] = eps
        grad[idx] = (f(x + step) - f(x - step)) / (2 * eps)
    return grad


def _projected(fn, weights):
    """sum over outputs of <fn(x), weights>: a scalar that depends on every output element."""

    def scalar(*args):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(fnp.sum(o * w) for o, w in zip(outs, weights))

    return scalar


def _spd(seed=5, n=4):
    a = np.random.default_rng(seed).standard_normal((n, n))
    return a @ a.T + n * np.eye(n)


def _general(seed=6, shape=(2, 4, 4)):
    return np.random.default_rng(seed).standard_normal(shape) + 2 * np.eye(*shape[-2:])


_RHS = np.random.default_rng(7).standard_normal((2, 4, 2))
GRADIENTS = {
    "solve_a": (lambda a: L.solve(a, _RHS), _general),
    "solve_b": (lambda b: L.solve(_general(), b), lambda: _RHS),
    "inv": (L.inv, _general),
    "det": (L.det, _general),
    "slogdet": (lambda a: L.slogdet(a)[1], _general),
    "cholesky": (L.cholesky, _spd),
    "eigh": (lambda a: tuple(L.eigh(a)), _spd),
    "eigh_upper": (lambda a: tuple(L.eigh(a, UPLO="U")), lambda: _general(shape=(4, 4))),
    "solve_triangular": (lambda a: fj.scipy.linalg.solve_triangular(a, _RHS[0], lower=True), _spd),
    "solve_triangular_t_unit": (
        lambda a: fj.scipy.linalg.solve_triangular(a, _RHS[0], trans=1, unit_diagonal=True),
        _spd,
    ),
    "cho_solve": (lambda a: fj.scipy.linalg.cho_solve(fj.scipy.linalg.cho_factor(a), _RHS[0]), _spd),
    "qr": (lambda a: tuple(L.qr(a)), lambda: _general(shape=(5, 3))),
    "svd_tall": (lambda a: tuple(L.svd(a, full_matrices=False)), lambda: _general(shape=(5, 3))),
    "svd_wide_stack": (lambda a: tuple(L.svd(a, full_matrices=False)), lambda: _general(shape=(2, 3, 5))),
    "svd_square_full": (lambda a: tuple(L.svd(a)), _general),
    "svd_values": (lambda a: L.svd(a, compute_uv=False), lambda: _general(shape=(4, 6))),
}


@pytest.mark.parametrize("name", list(GRADIENTS))
def test_gradient_matches_finite_differences(name):
    fn, make = GRADIENTS[name]
    x = make()
    outs = fn(x)  # eager (LAPACK): the finite differences' reference
    outs = outs if isinstance(outs, tuple) else (outs,)
    rng = np.random.default_rng(8)
    weights = [rng.standard_normal(np.shape(o)) for o in outs]
    scalar = _projected(fn, weights)
    expected = _finite_difference_gradient(lambda z: float(scalar(z)), x)
    found = fj.jit(fj.grad(scalar))(x)
    np.testing.assert_allclose(found, expected, atol=1e-6 * max(1.0, np.abs(expected).max()))


def test_jvps_match_finite_differences():
    spd, general = _spd(), _general()
    rng = np.random.default_rng(9)
    t_spd, t_general = rng.standard_normal(spd.shape), rng.standard_normal(general.shape)
    eps = 1e-6

    @fj.jit
    def tangents(spd, general, t_spd, t_general):
        _, chol = fj.jvp(L.cholesky, (spd,), (t_spd,))
        _, (w, v) = fj.jvp(lambda a: tuple(L.eigh(a)), (spd,), (t_spd,))
        _, x = fj.jvp(lambda a: L.solve(a, _RHS), (general,), (t_general,))
        _, d = fj.jvp(L.det, (general,), (t_general,))
        return chol, w, v, x, d

    def central(fn, x, t):
        return (np.asarray(fn(x + eps * t)) - np.asarray(fn(x - eps * t))) / (2 * eps)

    chol, w, v, x, d = tangents(spd, general, t_spd, t_general)
    np.testing.assert_allclose(chol, central(L.cholesky, spd, t_spd), atol=1e-7)
    np.testing.assert_allclose(w, central(lambda a: L.eigh(a)[0], spd, t_spd), atol=1e-7)
    np.testing.assert_allclose(v, central(lambda a: L.eigh(a)[1], spd, t_spd), atol=1e-7)
    np.testing.assert_allclose(x, central(lambda a: L.solve(a, _RHS), general, t_general), atol=1e-7)
    np.testing.assert_allclose(d, central(L.det, general, t_general), atol=1e-6)


def test_the_gradient_of_a_full_u_is_a_clear_error():
    # the columns of a full U past min(m, n) are not determined by a (JAX refuses the same)
    with pytest.raises(fj.FlowjitTypeError, match="test_linalg.py:.*op 'svd': .*full_matrices=False"):
        fj.grad(lambda a: L.svd(a)[1].sum())(_general(shape=(5, 3)))


# --- errors ----------------------------------------------------------------------------------------------------


ERRORS = [
    (L.cholesky, (np.ones((2, 3)),), "op 'cholesky': needs square matrices .* found shape \\(2, 3\\)"),
    (L.inv, (np.ones(3),), "op 'inv': needs a matrix or a stack of matrices \\(rank >= 2\\); found shape"),
    (L.solve, (np.eye(3), np.ones((4, 1))), "op 'solve': b must have shape \\(3,\\) or \\(..., 3, K\\)"),
    (L.det, (np.eye(2, dtype=bool),), "op 'det': needs float32 or float64 matrices; found dtype bool"),
    (lambda a: L.eigh(a, UPLO="X"), (np.eye(2),), "op 'eigh': UPLO must be 'L' or 'U'"),
    (lambda a: L.qr(a, mode="raw"), (np.eye(2),), "op 'qr': mode must be one of reduced, complete, r"),
    (fj.scipy.linalg.solve_triangular, (np.eye(2), np.ones(3)), "op 'solve_triangular': b must have"),
    (
        lambda a, b: fj.scipy.linalg.solve_triangular(a, b, trans=3),
        (np.eye(2), np.ones(2)),
        "op 'solve_triangular': trans",
    ),
]


@pytest.mark.parametrize(
    "fn,args,message", ERRORS, ids=[f"{m.split(chr(39))[1]}-{i}" for i, (_, _, m) in enumerate(ERRORS)]
)
def test_errors_name_the_users_line(fn, args, message):
    for call in (fn, fj.jit(fn)):  # eagerly and while tracing
        with pytest.raises(fj.FlowjitError, match="test_linalg.py:[0-9]+: " + message):
            call(*args)
