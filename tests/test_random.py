"""flowjit.random: determinism (eager, CPU, interpreter bit-identical), independence of split and
fold_in streams, and distribution sanity with fixed keys and generous tolerances."""

import math

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
import flowjit.random as fr
from flowjit.errors import FlowjitValueError


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
            if name.startswith("normal"):  # log and cos may differ by an ulp between libms; the bits may not
                np.testing.assert_allclose(got, value, rtol=4 * np.finfo(got.dtype).eps, err_msg=f"{name} {target}")
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
