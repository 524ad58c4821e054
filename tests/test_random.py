"""flowjit.random: determinism (eager, CPU, interpreter bit-identical), independence of split and
fold_in streams, and distribution sanity with fixed keys and generous tolerances."""

import math

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
import flowjit.random as fr
from flowjit.errors import FlowjitValueError

ARRAY = np.arange(24.0).reshape(4, 6)
LOGITS = np.log(np.array([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]], np.float32))
PROBS = np.array([0.1, 0.0, 0.6, 0.3])


def draws(seed):
    """Every generator from one seed: compiled once per target and compared bit for bit."""
    key = fr.key(seed)
    k1, k2, k3 = fr.split(key, 3)
    return {
        "key": key,
        "split": fr.split(key),
        "fold_in": fr.fold_in(key, 7),
        "fold_in_traced": fr.fold_in(key, seed),
        "uniform32": fr.uniform(k1, (3, 5)),
        "uniform64": fr.uniform(k1, (7,), "float64", -2.0, 3.0),
        "uniform16": fr.uniform(k1, (6,), "float16"),
        "normal32": fr.normal(k2, (2, 4)),
        "normal64": fr.normal(k2, (5,), "float64", mean=1.0, stddev=2.0),
        "bernoulli": fr.bernoulli(k3, 0.3, (9,)),
        "randint": fr.randint(k3, (4, 2), -5, 17),
        "randint32": fr.randint(k3, (6,), 0, 3, "int32"),
        "permutation": fr.permutation(k1, 11),
        "scalar": fr.uniform(k2),
        "permutation_array": fr.permutation(k2, ARRAY, axis=1),
        "shuffle": fr.shuffle(k3, ARRAY),
        "gumbel": fr.gumbel(k1, (3, 4)),
        "gumbel64": fr.gumbel(k1, (5,), "float64"),
        "categorical": fr.categorical(k2, LOGITS),
        "categorical_shape": fr.categorical(k2, LOGITS[0], shape=(6,)),
        "choice": fr.choice(k3, 10, (2, 3)),
        "choice_array": fr.choice(k3, ARRAY, (2,), axis=1),
        "choice_p": fr.choice(k1, 4, (5,), p=PROBS),
        "choice_no_replace": fr.choice(k2, 12, (7,), replace=False),
        "choice_no_replace_p": fr.choice(k3, 4, (3,), replace=False, p=PROBS),
        "truncated_normal": fr.truncated_normal(k1, -1.0, 2.0, (4, 3)),
        "truncated_normal64": fr.truncated_normal(k2, 0.5, float("inf"), (6,), "float64"),
    }


_compiled = {target: fj.jit(draws, target=target) for target in (None, "interpreter")}


def test_eager_cpu_and_interpreter_are_bit_identical():
    eager = draws(np.int64(123))
    for target, fn in _compiled.items():
        out = fn(np.int64(123))
        assert out.keys() == eager.keys()
        for name, value in eager.items():
            got = out[name]
            if isinstance(value, list):
                for a, b in zip(got, value):
                    np.testing.assert_array_equal(a, b, err_msg=f"{name} {target}")
                continue
            assert got.dtype == np.asarray(value).dtype and got.shape == np.shape(value), (name, target)
            # log, cos and erf may differ by an ulp between libms; the bits may not. Near 0 (Gumbel's
            # log of a log close to 1, the normal quantile at p = 0.5) that ulp is relative to 1.
            if name.startswith(("normal", "gumbel", "truncated_normal")):
                eps = np.finfo(got.dtype).eps
                np.testing.assert_allclose(got, value, rtol=4 * eps, atol=8 * eps, err_msg=f"{name} {target}")
                continue
            np.testing.assert_array_equal(got, value, err_msg=f"{name} {target}")


def test_same_key_same_values_and_dtypes():
    first, second = draws(5), draws(5)
    for name in first:
        np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(second[name]), err_msg=name)
    assert first["key"].dtype == np.int64 and first["key"].shape == ()
    assert first["uniform32"].dtype == np.float32 and first["uniform64"].dtype == np.float64
    assert first["uniform16"].dtype == np.float16 and first["normal64"].dtype == np.float64
    assert first["bernoulli"].dtype == np.bool_ and first["randint"].dtype == np.int64
    assert first["randint32"].dtype == np.int32 and first["scalar"].shape == ()


def test_different_keys_give_different_streams():
    key = fr.key(0)
    keys = [key, fr.key(1), *fr.split(key, 4), fr.fold_in(key, 0), fr.fold_in(key, 1), fr.fold_in(fr.key(1), 0)]
    assert len({int(k) for k in keys}) == len(keys)
    assert int(fr.fold_in(key, 3)) == int(fr.fold_in(key, np.int32(3))) and int(fr.key(-1)) == int(fr.key(2**64 - 1))
    streams = np.stack([fr.uniform(k, (2000,)) for k in keys])
    # Independent uniform streams: every pairwise correlation is ~N(0, 1/2000), so below 0.1 by far.
    correlation = np.corrcoef(streams)
    assert np.abs(correlation[~np.eye(len(keys), dtype=bool)]).max() < 0.1


def test_split_of_split_and_fold_in_chain():
    a, b = fr.split(fr.key(9))
    aa, ab = fr.split(a)
    seen = {int(k) for k in (a, b, aa, ab, fr.fold_in(a, 1), fr.fold_in(b, 1), fr.fold_in(fr.fold_in(a, 1), 1))}
    assert len(seen) == 7


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_uniform_moments_and_range(dtype):
    u = fr.uniform(fr.key(11), (200_000,), dtype, -1.5, 2.5)
    assert u.dtype == dtype and u.min() >= -1.5 and u.max() < 2.5
    assert abs(u.mean() - 0.5) < 0.02  # std of the mean: 4/sqrt(12)/sqrt(2e5) ~ 0.0026
    assert abs(u.var() - 16.0 / 12.0) < 0.02
    histogram = np.histogram(u, bins=16, range=(-1.5, 2.5))[0]
    assert np.abs(histogram / len(u) * 16 - 1.0).max() < 0.05


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("bounds", [(0.0, 1.0), (2.0, 3.0), (-1.0, 0.0)])
def test_uniform_never_returns_maxval(dtype, bounds):
    # Rounding the last step (to the target dtype, or unit * span + min) must not reach maxval.
    u = fr.uniform(fr.key(2), (100_000,), dtype, *bounds)
    assert u.dtype == dtype
    assert float(u.min()) >= bounds[0] and float(u.max()) < bounds[1]


def test_float64_uniform_uses_53_bits():
    u = fr.uniform(fr.key(4), (4096,), "float64")
    scaled = u * 2.0**53
    np.testing.assert_array_equal(scaled, np.round(scaled))  # on the 2^-53 grid
    assert (u * 2.0**24 != np.round(u * 2.0**24)).mean() > 0.99  # and not on the float32 one
    low_bits = scaled.astype(np.int64) & ((1 << 29) - 1)
    assert abs(low_bits.mean() / (1 << 29) - 0.5) < 0.05


def test_float32_uniform_uses_24_bits():
    u = fr.uniform(fr.key(4), (4096,))
    np.testing.assert_array_equal(u * 2.0**24, np.round(u * 2.0**24))
    assert len(np.unique(u)) > 4000


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normal_moments(dtype):
    z = fr.normal(fr.key(21), (200_000,), dtype, mean=3.0, stddev=0.5)
    assert z.dtype == dtype and np.isfinite(z).all()
    assert abs(z.mean() - 3.0) < 0.01 and abs(z.std() - 0.5) < 0.01
    standard = (z - 3.0) / 0.5
    assert abs(np.mean(standard**3)) < 0.05 and abs(np.mean(standard**4) - 3.0) < 0.1
    # Tails as a normal's: P(|z| > 2) = 0.0455, P(|z| > 3) = 0.0027.
    assert abs(np.mean(np.abs(standard) > 2) - 0.0455) < 0.003
    assert abs(np.mean(np.abs(standard) > 3) - 0.0027) < 0.001


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.97, 1.0])
def test_bernoulli_rate(p):
    b = fr.bernoulli(fr.key(13), p, (100_000,))
    assert b.dtype == np.bool_
    assert abs(b.mean() - p) < 0.01
    if p in (0.0, 1.0):
        assert b.mean() == p


@pytest.mark.parametrize("bounds", [(0, 2), (-5, 17), (10, 11), (-1000, 1000)])
def test_randint_range_and_uniformity(bounds):
    low, high = bounds
    r = fr.randint(fr.key(17), (120_000,), low, high)
    assert r.dtype == np.int64 and r.min() >= low and r.max() < high
    counts = np.bincount(r - low, minlength=high - low)
    assert len(counts) == high - low
    if high - low <= 100:
        expected = len(r) / (high - low)
        assert (counts > 0).all() and np.abs(counts / expected - 1.0).max() < 0.1
    else:
        assert abs(r.mean() - (low + high - 1) / 2) < 0.02 * (high - low)


def test_randint_rejects_empty_range():
    with pytest.raises(FlowjitValueError, match="maxval"):
        fr.randint(fr.key(0), (3,), 5, 5)


@pytest.mark.parametrize("n", [1, 2, 10, 1500])
def test_permutation_is_a_permutation(n):
    p = fr.permutation(fr.key(n), n)
    assert p.dtype == np.int64 and p.shape == (n,)
    np.testing.assert_array_equal(np.sort(p), np.arange(n))


def test_permutation_ties_are_broken_by_index():
    # Ranking 3000 24-bit uniforms collides with probability ~0.24 per draw; the 64-bit scores and the
    # index tie-break make every draw a permutation.
    for seed in range(2):
        np.testing.assert_array_equal(np.sort(fr.permutation(fr.key(seed), 3000)), np.arange(3000))


def test_permutation_is_random():
    perms = np.stack([fr.permutation(k, 8) for k in fr.split(fr.key(0), 200)])
    assert len({tuple(p) for p in perms}) > 195  # 8! = 40320 orders
    # Each position takes each value about 200/8 = 25 times (std ~4.7).
    counts = np.stack([np.bincount(perms[:, i], minlength=8) for i in range(8)])
    assert counts.min() >= 8 and counts.max() <= 45
    assert math.isclose(perms.mean(), 3.5)


# --- truncated normal, Gumbel, categorical, choice, shuffle ---------------------------------------------------


def normal_pdf(x):
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def normal_cdf(x):
    return 0.5 * math.erfc(-x / math.sqrt(2.0))  # erfc: accurate in the lower tail


def truncated_moments(a, b):
    """Mean and variance of a standard normal conditioned on [a, b]."""
    mass = normal_cdf(b) - normal_cdf(a)
    mean = (normal_pdf(a) - normal_pdf(b)) / mass
    fa = a * normal_pdf(a) if math.isfinite(a) else 0.0
    fb = b * normal_pdf(b) if math.isfinite(b) else 0.0
    return mean, 1.0 + (fa - fb) / mass - mean * mean


def test_normal_quantile_inverts_the_cdf():
    p = np.concatenate([np.geomspace(1e-12, 0.02, 50), np.linspace(0.02, 0.98, 200)])
    x = fr._normal_quantile(p)
    # The quantile's own error, from the CDF's: dx = (cdf(x) - p) / pdf(x).
    error = np.array([(normal_cdf(v) - q) / normal_pdf(v) for v, q in zip(x, p)])
    assert (np.abs(error) <= 1.2e-9 * np.abs(x) + 1e-15).all()  # Acklam's bound
    central = (p > 0.03) & (p < 0.97)
    assert np.abs(error[central]).max() < 1e-14  # refined by the Halley step
    tail = np.geomspace(1e-6, 0.02, 20)
    np.testing.assert_allclose(fr._normal_quantile(1.0 - tail), -fr._normal_quantile(tail), rtol=1e-8)


@pytest.mark.parametrize("bounds", [(-2.0, 2.0), (-1.0, 0.5), (1.5, float("inf")), (-float("inf"), -3.0), (4.0, 5.0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_truncated_normal_bounds_and_moments(bounds, dtype):
    z = fr.truncated_normal(fr.key(23), *bounds, (100_000,), dtype)
    assert z.dtype == dtype and np.isfinite(z).all()
    assert z.min() >= bounds[0] and z.max() <= bounds[1]
    mean, var = truncated_moments(*bounds)
    assert abs(z.mean() - mean) < 0.01 and abs(z.var() / var - 1.0) < 0.03


def test_truncated_normal_rejects_empty_interval():
    with pytest.raises(FlowjitValueError, match="lower < upper"):
        fr.truncated_normal(fr.key(0), 1.0, 1.0, (3,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gumbel_moments(dtype):
    g = fr.gumbel(fr.key(29), (200_000,), dtype)
    assert g.dtype == dtype and np.isfinite(g).all()
    assert abs(g.mean() - 0.5772156649) < 0.01 and abs(g.var() - math.pi**2 / 6) < 0.03


def test_categorical_frequencies_follow_softmax():
    logits = np.array([[0.0, 1.0, 2.0, -np.inf], [3.0, 3.0, 0.0, 0.0]])
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    draws_ = fr.categorical(fr.key(31), logits, shape=(20_000, 2))
    assert draws_.shape == (20_000, 2) and draws_.dtype == np.int64
    for row in range(2):
        counts = np.bincount(draws_[:, row], minlength=4) / 20_000
        np.testing.assert_allclose(counts, probs[row], atol=0.015)
    assert (draws_[:, 0] != 3).all()  # probability 0 is never drawn
    columns = fr.categorical(fr.key(31), logits.T, axis=0, shape=(20_000, 2))
    assert abs(np.mean(columns[:, 0] == 2) - probs[0, 2]) < 0.015


def test_choice_with_and_without_replacement():
    p = np.array([0.5, 0.0, 0.2, 0.3])
    weighted = fr.choice(fr.key(37), 4, (30_000,), p=p)
    np.testing.assert_allclose(np.bincount(weighted, minlength=4) / 30_000, p, atol=0.015)
    uniform = fr.choice(fr.key(37), 5, (30_000,))
    np.testing.assert_allclose(np.bincount(uniform, minlength=5) / 30_000, 0.2, atol=0.015)

    def draw(seed):
        key = fr.key(seed)
        return fr.choice(key, 9, (2, 3), replace=False), fr.choice(key, 4, (3,), replace=False, p=p)

    without_replacement = fj.jit(draw, target="interpreter")
    firsts = []
    for seed in range(2000):
        picked, weighted = without_replacement(np.int64(seed))
        assert picked.shape == (2, 3) and len(set(picked.ravel().tolist())) == 6 and picked.max() < 9
        assert len(set(weighted.tolist())) == 3 and 1 not in weighted.tolist()  # p = 0 is never picked
        firsts.append(weighted[0])
    # Without replacement, the first pick follows p.
    np.testing.assert_allclose(np.bincount(firsts, minlength=4) / 2000, p, atol=0.03)
    rows = fr.choice(fr.key(1), np.arange(12.0).reshape(6, 2), (4,), replace=False)
    assert rows.shape == (4, 2) and len({tuple(r) for r in rows.tolist()}) == 4
    with pytest.raises(FlowjitValueError, match="without replacement"):
        fr.choice(fr.key(0), 3, (4,), replace=False)


def test_shuffle_and_permutation_of_arrays():
    x = np.arange(30).reshape(10, 3)
    shuffled = fr.shuffle(fr.key(41), x)
    assert not np.array_equal(shuffled, x)
    np.testing.assert_array_equal(np.sort(shuffled[:, 0]), x[:, 0])
    np.testing.assert_array_equal(shuffled[:, 1:] - shuffled[:, :1], x[:, 1:] - x[:, :1])  # rows stay whole
    columns = fr.permutation(fr.key(41), x, axis=1)
    np.testing.assert_array_equal(np.sort(columns, axis=1), x)
