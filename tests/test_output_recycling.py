"""The CPU backend recycles large outputs' memory (`executable.OutputRecycler`): each result is a new
array, whose memory is an earlier result's only after the caller dropped everything made from that
one; a result in recycled memory is exact."""

import threading
import weakref

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.cpu import executable

N = 4096


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _chain(x):
    return fnp.tanh(x * 0.7 + 0.1) * fnp.logistic(x) + 0.5 * x


@pytest.fixture
def small_threshold(monkeypatch):
    """Recycle outputs from 1 KiB up, so the tests run on small arrays (recyclers are made per executable)."""
    monkeypatch.setattr(executable, "RECYCLE_MIN_BYTES", 1024)


def _inputs(k: int) -> list[np.ndarray]:
    rng = np.random.default_rng(k)
    return [rng.standard_normal(N, dtype=np.float32) for _ in range(4)]


def test_a_dropped_results_memory_is_reused_and_exact(small_threshold):
    xs = _inputs(0)
    f = fj.jit(_chain)
    fresh = [f(x) for x in xs]  # all alive: each in new memory
    assert len({_address(a) for a in fresh}) == len(xs)
    kept = {_address(fresh[2]), _address(fresh[3])}  # the two blocks the recycler keeps
    want = [a.copy() for a in fresh]
    del fresh
    for x, w in zip(xs, want):
        y = f(x)
        assert _address(y) in kept  # a dropped result's memory came back
        np.testing.assert_array_equal(y, w)  # bit-identical to a result in new memory
        np.testing.assert_allclose(y, np.tanh(x * 0.7 + 0.1) / (1 + np.exp(-x)) + 0.5 * x, rtol=1e-5, atol=1e-6)


def test_recycled_results_start_on_a_64_byte_line(small_threshold):
    """A recycled result starts on an `OUTPUT_ALIGNMENT` boundary of its block (numpy's own large
    arrays start 16 bytes past one, so each 64-byte vector store would straddle two lines), new
    block or reused, through the fast call path and through `run_trusted` (two results)."""
    xs = _inputs(3)
    one = fj.jit(_chain)
    two = fj.jit(lambda x: (x * 2.0, x + 1.0))
    for _ in range(3):  # new blocks, then reused ones
        results = [one(xs[0]), *two(xs[1])]
        for y in results:
            assert _address(y) % executable.OUTPUT_ALIGNMENT == 0
            assert y.base is not None and y.base.dtype == np.uint8 and y.flags.c_contiguous
        np.testing.assert_array_equal(results[1], xs[1] * 2.0)
        np.testing.assert_array_equal(results[2], xs[1] + 1.0)
        del results, y


def _in_page_at(offset: int, n: int, k: int) -> np.ndarray:
    """n float32 starting `offset` bytes into a page, as numpy's large arrays start 16 bytes in."""
    block = np.empty(n * 4 + 2 * executable.PAGE_BYTES, np.uint8)
    start = (offset - _address(block)) % executable.PAGE_BYTES
    x = block[start : start + n * 4].view(np.float32)
    x[:] = np.random.default_rng(k).standard_normal(n, dtype=np.float32)
    return x


def _page_gap(a: int, b: int) -> int:
    page = executable.PAGE_BYTES
    return min((a - b) % page, (b - a) % page)


def test_recycled_results_start_far_in_a_page_from_the_inputs(small_threshold, monkeypatch):
    """A load whose address matches a pending store's in its low 12 bits waits for it (4K aliasing):
    each recycled result starts half a page from a large input (and from the results made before
    it), on a line, new block or reused; small inputs leave it on a line at a page's start."""
    monkeypatch.setattr(executable, "STREAM_MIN_BYTES", 1024)
    one = fj.jit(_chain)
    two = fj.jit(lambda x: (x * 2.0, x + 1.0))
    for offset in (16, 64, 2048, 4080):
        x = _in_page_at(offset, N, offset)
        for _ in range(3):  # a new block, then reused ones
            y = one(x)
            assert _address(y) % executable.OUTPUT_ALIGNMENT == 0
            assert _page_gap(_address(y), _address(x)) >= executable.PAGE_BYTES // 2 - executable.OUTPUT_ALIGNMENT
            np.testing.assert_allclose(y, _chain(x), rtol=1e-6, atol=1e-7)  # numpy's tanh, not ours
            a, b = two(x)
            pairs = [(x, a), (x, b), (a, b)]
            assert min(_page_gap(_address(p), _address(q)) for p, q in pairs) >= 1024
            np.testing.assert_array_equal(a, x * 2.0)
            np.testing.assert_array_equal(b, x + 1.0)
            del y, a, b
    monkeypatch.setattr(executable, "STREAM_MIN_BYTES", 1 << 30)
    assert _address(one(_in_page_at(16, N, 0))) % executable.PAGE_BYTES == 0


def test_the_farthest_place_in_a_page():
    assert executable._farthest_in_page((16,)) == 2048
    assert executable._farthest_in_page((0, 2048)) in (1024, 3072)
    assert executable._farthest_in_page((4080,)) == 2048  # 2032 from 4080 one way, 2064 the other


def test_results_are_new_objects_and_weak_references_to_dropped_ones_are_cleared(small_threshold):
    xs = _inputs(6)
    f = fj.jit(lambda x: x * 2.0)
    cache = weakref.WeakValueDictionary()
    cache["first"] = first = f(xs[0])
    ref = weakref.ref(first)
    address = _address(first)
    del first
    assert ref() is None and "first" not in cache
    second = f(xs[1])
    assert _address(second) == address  # same memory, new array
    np.testing.assert_array_equal(second, xs[1] * 2.0)


def test_results_still_referenced_are_never_overwritten(small_threshold):
    xs = _inputs(1)
    f = fj.jit(lambda x: x * 3.0 + 1.0)
    held = f(xs[0])
    view = f(xs[1])[5:]  # only a view of the second result survives
    buffer = memoryview(f(xs[2]))  # only a memoryview of the third
    results = [f(x) for x in xs]  # the usual loop keeps the previous result while the next runs
    for x, r in zip(xs, results):
        np.testing.assert_array_equal(r, x * 3.0 + 1.0)
    np.testing.assert_array_equal(held, xs[0] * 3.0 + 1.0)
    np.testing.assert_array_equal(view, (xs[1] * 3.0 + 1.0)[5:])
    np.testing.assert_array_equal(np.asarray(buffer), xs[2] * 3.0 + 1.0)
    pointers = {_address(a) for a in (held, view.base, np.asarray(buffer), *results)}
    assert len(pointers) == 3 + len(results)


def test_a_loop_rebinding_its_result_alternates_two_buffers(small_threshold):
    xs = _inputs(2)
    f = fj.jit(lambda x: x - 2.0)
    addresses = set()
    y = previous = None
    for i in range(12):
        y = f(xs[i % 4])  # the previous result is alive during the call
        if previous is not None:
            np.testing.assert_array_equal(previous, xs[(i - 1) % 4] - 2.0)
        np.testing.assert_array_equal(y, xs[i % 4] - 2.0)
        addresses.add(_address(y))
        previous = y
    assert len(addresses) == 2  # two buffers serve


def test_results_changed_in_place_do_not_change_later_results(small_threshold):
    x = _inputs(3)[0]
    f = fj.jit(lambda x: x + 1.0)
    reshaped = f(x)
    reshaped.shape = (64, N // 64)
    reshaped[:] = 7.0
    del reshaped
    frozen = f(x)
    frozen.flags.writeable = False
    del frozen
    for y in (f(x), f(x), f(x)):
        assert y.shape == (N,) and y.flags.writeable and y.flags.c_contiguous and y.flags.aligned
        np.testing.assert_array_equal(y, x + 1.0)


def test_several_outputs_and_a_workspace_go_through_run_trusted(small_threshold):
    xs = _inputs(4)

    def two(x):
        e = fnp.exp(x)
        return e / e.sum(), x * 2.0

    f = fj.jit(two)
    first = f(xs[0])
    addresses = [_address(a) for a in first]
    del first
    for _ in range(3):
        for x in xs:
            a, b = f(x)
            assert [_address(a), _address(b)] == addresses  # each dropped before the next call, then reused
            e = np.exp(x.astype(np.float64))
            np.testing.assert_allclose(a, e / e.sum(), rtol=1e-5)
            np.testing.assert_array_equal(b, x * 2.0)
            del a, b


def test_donated_outputs_are_the_callers_and_never_recycled(small_threshold):
    step = fj.jit(lambda p, g: p - 0.5 * g, donate_argnums=0)
    g = np.ones(N, np.float32)
    p = np.ones(N, np.float32)
    q = step(p, g)
    assert q is p
    q2 = step(np.ones(N, np.float32), g)
    del q2
    np.testing.assert_array_equal(p, np.full(N, 0.5, np.float32))  # the caller's array, not a recycled one
    assert step(p, g) is p


def test_concurrent_calls_never_share_an_output(small_threshold):
    f = fj.jit(lambda x: x * 0.5 + 0.25)
    xs = _inputs(5)
    failures = []

    def worker(k):
        x = xs[k % 4]
        for _ in range(200):
            y = f(x)
            if not np.array_equal(y, x * 0.5 + 0.25):
                failures.append(k)
            del y

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_only_outputs_from_the_threshold_up_are_recycled():
    f32 = np.dtype(np.float32)
    limit = executable.RECYCLE_MIN_BYTES // 4
    small, large = executable._allocators([(limit - 1,), (limit,)], [f32, f32])
    assert isinstance(large.__self__, executable.OutputRecycler)
    assert small is None or not isinstance(getattr(small, "__self__", None), executable.OutputRecycler)
    x = np.ones(limit, np.float32)
    f = fj.jit(lambda x: x + 1.0)
    first = _address(f(x))  # dropped at once: its memory is kept for reuse (on by default from the threshold)
    assert _address(f(x)) == first
