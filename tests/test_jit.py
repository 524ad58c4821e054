"""`fj.jit`: pytrees in and out, argument kinds, static arguments, the trace cache and its log,
`lower`/`compile`, stage dumps, and concurrent calls."""

import os
import re
import threading
from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.frontend.trace import current_trace

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 8)).astype(np.float32)
W = RNG.standard_normal((8, 3)).astype(np.float32)

Pair = namedtuple("Pair", ["a", "b"])


def line_of(marker: str) -> int:
    """The line of this file holding `marker` (in a comment), so tests name exact lines."""
    with open(__file__) as f:
        lines = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, marker
    return lines[0]


class Counter:
    """Counts traces: the Python body runs once per trace, never on a cached call."""

    def __init__(self):
        self.n = 0

    def __call__(self):
        self.n += 1


# --- arguments and results ------------------------------------------------------------------------


def test_arrays_in_numpy_out():
    f = fj.jit(lambda x, w: fnp.tanh(x @ w))
    out = f(X, W)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_allclose(out, np.tanh(X @ W), rtol=1e-5, atol=1e-6)


def test_pytree_arguments_and_results():
    @fj.jit
    def f(params, batch):
        h = batch["x"] @ params[0]["w"] + params[0]["b"]
        return {"h": h, "pair": Pair(h.sum(), batch["x"]), "none": None, "list": [h * 2, (h,)]}

    b = np.ones(3, np.float32)
    out = f([{"w": W, "b": b}], {"x": X, "unused": None})
    h = X @ W + b
    assert set(out) == {"h", "pair", "none", "list"} and out["none"] is None
    np.testing.assert_allclose(out["h"], h, rtol=1e-5)
    assert isinstance(out["pair"], Pair)
    np.testing.assert_allclose(out["pair"].a, h.sum(), rtol=1e-4)
    np.testing.assert_array_equal(out["pair"].b, X)
    assert isinstance(out["list"], list) and isinstance(out["list"][1], tuple)
    np.testing.assert_allclose(out["list"][1][0], h, rtol=1e-5)


def test_python_scalars_kwargs_defaults_and_varargs():
    traces = Counter()

    @fj.jit
    def f(x, *rest, scale=2.0, **extra):
        traces()
        return x * scale + sum(rest) + extra.get("bias", 0)

    np.testing.assert_allclose(f(X), X * 2)  # an omitted parameter keeps its Python default
    np.testing.assert_allclose(f(X, scale=3.0), X * 3)  # a Python float passed in is a dynamic f32 scalar
    np.testing.assert_allclose(f(X, scale=4.0), X * 4)
    assert traces.n == 2
    np.testing.assert_allclose(f(X, X, X, scale=1.0, bias=np.float32(0.5)), X * 3 + 0.5, rtol=1e-6)
    assert traces.n == 3
    assert f(1.5, scale=2.0).dtype == np.float32  # Python float -> f32, as JAX
    assert f(3, scale=2).dtype == np.int64  # Python int -> i64
    assert f(X, scale=2).dtype == np.float32  # f32 * i64 scalar stays f32


def test_keyword_and_positional_calls_share_one_trace():
    traces = Counter()

    @fj.jit
    def f(x, w):
        traces()
        return x @ w

    f(X, W)
    f(x=X, w=W)
    f(X, w=W)
    assert traces.n == 1


def test_zero_arguments():
    np.testing.assert_array_equal(fj.jit(lambda: fnp.ones((2, 3)))(), np.ones((2, 3), np.float32))


def test_returning_python_scalars():
    out = fj.jit(lambda x: (3, 2.5, x))(X)
    assert out[0] == 3 and out[0].dtype == np.int64
    assert out[1] == 2.5 and out[1].dtype == np.float32
    np.testing.assert_array_equal(out[2], X)


def test_returning_a_python_bool():
    out = fj.jit(lambda x: True)(X)
    assert out == True and out.dtype == np.bool_  # noqa: E712


def test_returning_an_input_unchanged_does_not_alias_it():
    a = X.copy()
    same = fj.jit(lambda x: x)(a)
    same[0, 0] = 100.0  # the result must not alias the caller's array
    assert a[0, 0] == X[0, 0]


def test_closure_over_numpy_array_becomes_a_constant():
    bias = np.arange(8, dtype=np.float32)
    f = fj.jit(lambda x: x + bias)
    np.testing.assert_allclose(f(X), X + bias)
    assert "constant" in f.lower(X).as_text("traced")


@pytest.mark.parametrize("fill", [0.0, -0.0, 2.5, np.nan, np.inf])
def test_large_constants_of_one_value_are_a_broadcast_scalar(fill):
    """fnp.zeros / ones / full of a large shape (and a closed-over array of one value) reach the
    graph as a scalar and a broadcast, not a literal of every element (which went through every
    compile as hex: 64 MiB for a (4096, 4096) f32); the value is kept bit for bit."""
    shape = (300, 40)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    f = fj.jit(lambda x: fnp.maximum(x, fnp.full(shape, fill, np.float32)) + fnp.zeros_like(x))
    want = np.maximum(x, np.float32(fill)) + np.float32(0)
    np.testing.assert_array_equal(f(x), want)
    traced = f.lower(x).as_text("traced")
    hex_literal = re.compile(r"array<[^,]*, 0x")
    assert "broadcast" in traced and not hex_literal.search(traced)
    same = np.full(shape, fill, np.float32)
    g = fj.jit(lambda x: x * same)
    np.testing.assert_array_equal(g(x), x * same)
    assert not hex_literal.search(g.lower(x).as_text("traced"))
    if fill == 0:  # the sign of zero is kept (bits, not ==): 0.0 * -1 is -0.0, -0.0 * -1 is 0.0
        negated = fj.jit(lambda x: same * x)(-np.ones(shape, np.float32))
        np.testing.assert_array_equal(np.signbit(negated), not np.signbit(fill))
    varied = np.arange(1200, dtype=np.float32).reshape(30, 40)
    assert hex_literal.search(fj.jit(lambda x: x + varied).lower(np.ones((30, 40), np.float32)).as_text("traced"))


@pytest.mark.parametrize("size", [8, 5000])
def test_constants_of_mixed_signed_zeros_are_not_splats(size):
    """[-0.0, 0.0, ...] is not one value: canonicalize once turned `x + c` into `x` (the rule for a
    splat -0.0) and the CPU lowering filled such a constant with its first element."""
    c = np.zeros(size, np.float32)
    c[::2] = -0.0
    x = np.full(size, -0.0, np.float32)
    np.testing.assert_array_equal(np.signbit(fj.jit(lambda x: x + c)(x)), np.signbit(x + c))
    joined = fj.jit(lambda x: fnp.concatenate([x, c]))(x)
    np.testing.assert_array_equal(np.signbit(joined), np.signbit(np.concatenate([x, c])))


def test_a_large_array_read_twice_is_one_constant_unless_changed_between():
    """A closed-over array used several times is one constant of the graph (not a copy per use),
    unless it changed in between (the second read then sees the new values)."""
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    f = fj.jit(lambda x: fnp.tanh(x @ w) @ w + x * w)
    x = np.ones((64, 64), np.float32)
    assert f.lower(x).as_text("traced").count("= constant") == 1
    np.testing.assert_allclose(f(x), np.tanh(x @ w) @ w + x * w, rtol=1e-5, atol=1e-5)
    a = np.arange(2000, dtype=np.float32)

    def g(x):
        y = x + a
        a[0] = 100.0
        return y + a

    np.testing.assert_array_equal(fj.jit(g)(np.zeros(2000, np.float32))[:3], [100.0, 2.0, 4.0])


def test_method_on_an_object_keyed_by_identity_is_refused_never_stale():
    # The program: c.calc(3) gave 6, then c.mul = False, and c.calc(3) still gave 6.
    class Calc:
        def __init__(self):
            self.mul = True

        @fj.jit
        def calc(self, x):
            return x * 2 if self.mul else x

    @dataclass
    class Unhashable:  # eq=True without frozen: __hash__ is None
        w: np.ndarray

        @fj.jit
        def apply(self, x):
            return x @ self.w

    c = Calc()
    with pytest.raises(fj.FlowjitTypeError) as e:
        c.calc(3.0)  # identity-keyed self
    message = str(e.value)
    assert f"test_jit.py:{line_of('identity-keyed self')}:" in message
    assert "stale" in message and "register_dataclass" in message and "__hash__" in message
    with pytest.raises(fj.FlowjitTypeError, match="neither an array pytree nor hashable by value"):
        Unhashable(W).apply(X)


def test_method_on_a_pytree_self_traces_its_arrays_and_keys_its_static_fields_by_value():
    traces = Counter()

    @fj.tree_util.register_dataclass
    @dataclass
    class Layer:
        w: np.ndarray
        mul: bool = field(default=True, metadata={"static": True})

        @fj.jit
        def __call__(self, x):
            traces()
            return x @ self.w * 2 if self.mul else x @ self.w

    layer = Layer(W)
    np.testing.assert_allclose(layer(X), X @ W * 2, rtol=1e-5)
    layer.mul = False  # a static field: a new signature, traced again
    np.testing.assert_allclose(layer(X), X @ W, rtol=1e-5)
    layer.w = 3 * W  # an array: an argument of the compiled code, not a constant
    np.testing.assert_allclose(layer(X), X @ (3 * W), rtol=1e-5)
    np.testing.assert_allclose(Layer(-W, False)(X), -(X @ W), rtol=1e-5)
    assert traces.n == 2
    assert "%self.w: tensor<8x3xf32>" in layer.__call__.lower(X).as_text("traced")


def test_method_on_a_self_hashed_by_value_is_static_and_retraced_per_value():
    traces = Counter()

    @dataclass(frozen=True)
    class Scale:
        factor: float

        @fj.jit
        def apply(self, x):
            traces()
            return x * self.factor

    np.testing.assert_allclose(Scale(2.0).apply(X), 2 * X)
    np.testing.assert_allclose(Scale(2.0).apply(X), 2 * X)  # an equal value: cached
    np.testing.assert_allclose(Scale(3.0).apply(X), 3 * X)
    assert traces.n == 2


def test_static_argument_keyed_by_identity_is_refused():
    class Config:
        def __init__(self):
            self.scale = 2.0

    f = fj.jit(lambda x, cfg: x * cfg.scale, static_argnums=1)
    with pytest.raises(fj.FlowjitTypeError, match="hashes by identity.*stale"):
        f(X, Config())
    np.testing.assert_allclose(fj.jit(lambda x, act: act(x), static_argnums=1)(X, fnp.tanh), np.tanh(X), rtol=1e-6)
    np.testing.assert_allclose(fj.jit(lambda x, k: x if k is None else x * k, static_argnums=1)(X, None), X)


def test_wrappers_of_one_function_with_equal_options_share_one_cache():
    traces = Counter()

    def f(x, n):
        traces()
        return x * n

    for _ in range(3):  # the common `fj.jit(f)(x)` inside a loop
        np.testing.assert_allclose(fj.jit(f, static_argnums=1)(X, 2), 2 * X)
    assert traces.n == 1
    np.testing.assert_allclose(fj.jit(f)(X, 2), 2 * X)  # other options: another cache
    assert traces.n == 2
    fj.jit(f, static_argnums=1).clear_cache()
    fj.jit(f, static_argnums=1)(X, 2)
    assert traces.n == 3


def test_decorator_forms_and_static_arguments_hashed_by_value():
    traces = Counter()

    @fj.jit(static_argnums=1, static_argnames="mode")
    def f(x, shape, mode="sum"):
        traces()
        y = x.reshape(shape)
        return y.sum(axis=0) if mode == "sum" else y.max(axis=0)

    np.testing.assert_allclose(f(X, (8, 4)), X.reshape(8, 4).sum(0), rtol=1e-5)
    np.testing.assert_allclose(f(X, tuple([8, 4])), X.reshape(8, 4).sum(0), rtol=1e-5)  # equal value: cached
    assert traces.n == 1
    np.testing.assert_allclose(f(X, (8, 4), mode="max"), X.reshape(8, 4).max(0))
    np.testing.assert_allclose(f(X, (16, 2)), X.reshape(16, 2).sum(0), rtol=1e-5)
    assert traces.n == 3


def test_static_values_of_another_type_retrace():
    g = fj.jit(lambda x, k: x * k, static_argnums=1)
    ints = np.arange(3, dtype=np.int32)
    assert g(ints, 2).dtype == np.int32
    out = g(ints, 2.0)  # 2 == 2.0 and hash alike, but int32 * 2.0 is float32
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])


def test_jit_of_jit_inlines_the_inner_function():
    inner_traces = Counter()

    @fj.jit
    def inner(x):
        inner_traces()
        return fnp.tanh(x)

    @fj.jit
    def outer(x, w):
        return inner(x @ w) * 2

    np.testing.assert_allclose(outer(X, W), np.tanh(X @ W) * 2, rtol=1e-5, atol=1e-6)
    assert inner_traces.n == 1  # traced once, as part of outer's trace
    text = outer.lower(X, W).as_text("traced")
    assert "tanh" in text and "call" not in text
    assert inner_traces.n == 2
    np.testing.assert_allclose(inner(X), np.tanh(X), rtol=1e-6)


def test_a_failed_trace_leaves_no_state_behind():
    traces = Counter()

    @fj.jit
    def f(x):
        traces()
        return x @ W

    with pytest.raises(fj.FlowjitTypeError):
        f(np.ones((2, 5), np.float32))
    assert current_trace() is None
    np.testing.assert_allclose(f(X), X @ W, rtol=1e-5)
    with pytest.raises(fj.FlowjitTypeError):
        f(np.ones((2, 5), np.float32))  # not cached: traces (and fails) again
    assert traces.n == 3


# --- the trace cache --------------------------------------------------------------------------------


def test_same_signature_does_not_retrace_and_any_change_does():
    traces = Counter()

    @fj.jit
    def f(x, y):
        traces()
        return x if y is None else x + y["a"]

    f(X, None)
    f(X.copy(), None)  # same shape, dtype and structure: cached
    assert traces.n == 1
    calls = [
        (np.ones((8, 8), np.float32), None),  # shape
        (X.astype(np.float64), None),  # dtype
        (X, {"a": X}),  # structure
        (X, {"a": 1.0}),  # leaf kind: Python scalar
    ]
    for i, args in enumerate(calls, start=2):
        f(*args)
        f(*args)
        assert traces.n == i


def test_calls_with_only_positional_arrays_still_respect_defaults_and_statics():
    traces = Counter()
    bias = np.full(8, 10, np.float32)

    @fj.jit(static_argnames="scale")
    def f(x, b=bias, scale=1):
        traces()
        return x * scale + b

    for _ in range(2):
        np.testing.assert_array_equal(f(X), X + bias)
        np.testing.assert_array_equal(f(X, X[0]), X + X[0])
        np.testing.assert_array_equal(f(X, X[0], 3), X * 3 + X[0])
        np.testing.assert_array_equal(f(X.astype(np.float64), X[0]), X.astype(np.float64) + X[0])
    assert traces.n == 4  # f(X) keeps the default `b` as a constant; passing `b` makes it an argument


def test_log_compiles_explains_each_trace(monkeypatch, capsys):
    monkeypatch.setenv("FLOWJIT_LOG_COMPILES", "1")

    @fj.jit(static_argnames="k")  # log-def
    def f(x, y=None, *, k=1):
        return x * k if y is None else x + y["a"]

    f(np.ones((4, 8), np.float32))
    f(np.ones((4, 8), np.float32))
    f(np.ones((8, 8), np.float32))
    f(np.ones((8, 8), np.float32), k=2)
    f(np.ones((8, 8), np.float32), {"a": np.ones(8, np.float32)}, k=2)
    f(np.ones((8, 8), np.float32), {"a": np.ones(8, np.int32)}, k=2)
    f(np.ones((8, 8), np.float32), {"a": np.ones(8, np.int32)}, k=2.0)
    where = f"{__file__}:{line_of('log-def')}"
    reasons = [
        "first call",
        "argument x changed from tensor<4x8xf32> to tensor<8x8xf32>",
        "static argument 'k' changed from 1 to 2",
        "the dynamic arguments changed from (x) to (x, y)",  # y was omitted (its default is not traced)
        "argument y['a'] changed from tensor<8xf32> to tensor<8xi32>",
        "static argument 'k' changed from 2 (int) to 2.0 (float)",
    ]
    assert capsys.readouterr().err.splitlines() == [f"flowjit: tracing f ({where}) because {r}" for r in reasons]


def test_log_compiles_reports_lower_and_calls_separately(monkeypatch, capsys):
    monkeypatch.setenv("FLOWJIT_LOG_COMPILES", "1")

    @fj.jit  # log-lower
    def g(x):
        return x + 1

    g.lower(X)
    g(X)
    g(X[:2])
    where = f"{__file__}:{line_of('log-lower')}"
    reasons = ["lower() was called", "first call", "argument x changed from tensor<4x8xf32> to tensor<2x8xf32>"]
    assert capsys.readouterr().err.splitlines() == [f"flowjit: tracing g ({where}) because {r}" for r in reasons]


def test_log_compiles_is_silent_when_unset(monkeypatch, capsys):
    monkeypatch.delenv("FLOWJIT_LOG_COMPILES", raising=False)
    fj.jit(lambda x: x + 1)(X)
    assert capsys.readouterr().err == ""


def test_concurrent_calls_trace_once_per_signature():
    traces = Counter()
    lock = threading.Lock()

    @fj.jit
    def f(x):
        with lock:
            traces()
        return fnp.tanh(x) * 2

    inputs = [RNG.standard_normal(shape).astype(np.float32) for shape in [(4, 8), (2, 3)] * 8]
    barrier = threading.Barrier(len(inputs))
    results: dict[int, np.ndarray] = {}

    def worker(i):
        barrier.wait()
        for _ in range(3):
            results[i] = f(inputs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert traces.n == 2
    for i, x in enumerate(inputs):
        np.testing.assert_allclose(results[i], np.tanh(x) * 2, rtol=1e-6)


# --- lower, stages, compile, dumps -------------------------------------------------------------------


def test_lower_with_shape_dtypes_and_traced_text():
    @fj.jit
    def f(x, w):
        y = x @ w  # traced-matmul
        return fnp.tanh(y)  # traced-tanh

    lo = f.lower(fj.ShapeDtype((4, 8), "float32"), W)
    assert lo.stages[:2] == ["traced", "optimized"]
    text = lo.as_text("traced")
    ops = [line.strip() for line in text.splitlines() if " = " in line]
    assert len(ops) == 2
    for op, (name, marker) in zip(ops, [("dot_general", "traced-matmul"), ("tanh", "traced-tanh")]):
        assert op.startswith(f"%{ops.index(op)} = {name} ") and ": tensor<4x3xf32> loc(" in op
        path, line = re.search(r'loc\("([^"]+)":(\d+)\)', op).groups()
        assert os.path.samefile(path, __file__) and int(line) == line_of(marker)
    assert "func @f(%x: tensor<4x8xf32>, %w: tensor<8x3xf32>) -> (tensor<4x3xf32>)" in text
    np.testing.assert_allclose(lo.compile()(X, W), np.tanh(X @ W), rtol=1e-5, atol=1e-6)


def test_optimized_text_names_the_backend():
    lo = fj.jit(lambda x: x * 1.0 + 0.0).lower(X)
    backend_lines = [line for line in lo.as_text("optimized").splitlines() if line.startswith("// backend: ")]
    assert len(backend_lines) == 1
    assert lo.compile().executable.backend in backend_lines[0]
    note = fj.jit(lambda x: x, target="interpreter").lower(X).as_text("optimized")
    assert "reference interpreter" in note and "NOT compiled to native code" in note


def test_unknown_stage_lists_the_available_ones():
    lo = fj.jit(lambda x: x + 1).lower(X)
    with pytest.raises(fj.FlowjitValueError, match=r"no stage 'bogus' .*available: traced, optimized") as e:
        lo.as_text("bogus")
    assert ", ".join(lo.stages) in str(e.value)


def test_compiled_rejects_another_signature():
    compiled = fj.jit(lambda x, w: x @ w).lower(X, W).compile()
    np.testing.assert_allclose(compiled(X, W), X @ W, rtol=1e-5)
    with pytest.raises(fj.FlowjitTypeError) as e:
        compiled(np.ones((5, 8), np.float32), W)  # compiled-wrong
    msg = str(e.value)
    assert msg.startswith(f"{os.path.relpath(__file__)}:{line_of('compiled-wrong')}: ") or msg.startswith(
        f"{__file__}:{line_of('compiled-wrong')}: "
    )
    assert "compiled for (x: tensor<4x8xf32>, w: tensor<8x3xf32>)" in msg
    assert "argument x changed from tensor<4x8xf32> to tensor<5x8xf32>" in msg
    with pytest.raises(fj.FlowjitTypeError, match="the structure of argument w changed"):
        compiled(X, (W,))


def test_compiled_with_static_arguments():
    f = fj.jit(lambda x, n: x * n, static_argnums=1)
    compiled = f.lower(X, 3).compile()
    np.testing.assert_allclose(compiled(X, 3), X * 3)
    with pytest.raises(fj.FlowjitTypeError, match="static argument 'n' changed from 3 to 4"):
        compiled(X, 4)


def test_dump_dir_writes_numbered_stages(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWJIT_DUMP_DIR", str(tmp_path))

    @fj.jit
    def dumped(x):
        return x * 2.0 + 1.0

    dumped(X)
    files = sorted(os.listdir(tmp_path))
    assert [re.sub(r"^\d{4}-", "", name) for name in files][:2] == ["dumped-traced.fj", "dumped-canonicalize.fj"]
    numbers = [int(name[:4]) for name in files]
    assert numbers == sorted(set(numbers))
    for name in files:
        stage = re.match(r"\d{4}-dumped-(.+)\.\w+$", name).group(1)
        first = (tmp_path / name).read_text().splitlines()[0]
        assert first.endswith(f"flowjit stage '{stage}' of function 'dumped'")


def test_lambda_names_survive_the_text_round_trip():
    lo = fj.jit(lambda x: x + 1).lower(X)
    assert "func @lambda(" in lo.as_text("optimized")


def test_non_contiguous_and_scalar_numpy_arguments():
    f = fj.jit(lambda x, s: x * s)
    strided = np.asfortranarray(X)[:, ::2]
    np.testing.assert_allclose(f(strided, np.float32(3)), strided * 3)
    np.testing.assert_allclose(f(X.T, 2), X.T * 2)


# --- the call fast path (positional arrays of a signature seen before) ---------------------------------


def test_fast_path_takes_any_layout_of_the_compiled_shapes_and_dtypes():
    traces = Counter()

    @fj.jit
    def f(x, y):
        traces()
        return x * 2 + y

    np.testing.assert_array_equal(f(X, X), X * 2 + X)
    read_only = X.copy()
    read_only.flags.writeable = False
    offset_view = np.vstack([X + 1, X])[4:]  # C-contiguous, its data pointer inside another array
    calls = [
        (np.asfortranarray(X), X),
        (X, offset_view),
        (read_only, read_only),
        (np.broadcast_to(X[0], X.shape), X),  # zero strides
    ]
    for a, b in calls:
        np.testing.assert_array_equal(f(a, b), a * 2 + b)
    assert traces.n == 1


@pytest.mark.parametrize("target", ["cpu", "interpreter"])
def test_fast_path_results_are_fresh_arrays_every_call(target):
    f = fj.jit(lambda x: (x + 1, x), target=target)  # the interpreter returns the input itself: copied
    first, second = f(X), f(X)
    for a, b in zip(first, second):
        assert not np.shares_memory(a, b) and not np.shares_memory(a, X)
    first[0][...] = 0
    first[1][...] = 0
    np.testing.assert_array_equal(second[0], X + 1)
    np.testing.assert_array_equal(second[1], X)


def test_fast_path_with_many_or_no_native_arguments():
    f = fj.jit(lambda *xs: sum(xs[1:], xs[0]))
    xs = [np.full(3, i, np.float32) for i in range(40)]
    for _ in range(2):
        np.testing.assert_array_equal(f(*xs), np.full(3, sum(range(40)), np.float32))
    g = fj.jit(lambda x: None)
    assert g(X) is None and g(X) is None
    h = fj.jit(lambda x: x.sum())
    empty = np.zeros((0, 3), np.float32)
    assert h(empty) == 0 and h(empty) == 0


def test_non_native_byte_order_is_rejected_by_name():
    f = fj.jit(lambda x: x * 2)
    f(X)
    with pytest.raises(fj.FlowjitTypeError, match=r"float32 in non-native byte order \('>f4'\).*astype"):
        f(X.astype(">f4"))


def test_executable_checks_what_it_is_given():
    executable = fj.jit(lambda x, w: x @ w).lower(X, W).compile().executable
    np.testing.assert_allclose(executable.run([X, W])[0], X @ W, rtol=1e-5)
    with pytest.raises(fj.FlowjitTypeError, match=r"argument 1: expected an array of shape \(8, 3\)"):
        executable.run([X, X])
    with pytest.raises(fj.FlowjitTypeError, match="argument 0: .* found list"):
        executable.run([X.tolist(), W])
    with pytest.raises(fj.FlowjitTypeError, match="expected 2 arrays; found 1"):
        executable.run([X])


def test_variables_as_arguments_are_passed_by_reference():
    traces = Counter()
    v = fj.Variable(np.zeros(3, np.float32), name="jit_arg_v")
    u = fj.Variable(np.zeros(3, np.float32), name="jit_arg_u")

    @fj.jit(target="interpreter")  # the state ops' native lowering is tested in test_state.py
    def step(state, x):
        traces()
        state["acc"].assign_add(x)
        return state["acc"].value * 2

    one = np.ones(3, np.float32)
    np.testing.assert_array_equal(step({"acc": v}, one), [2, 2, 2])
    np.testing.assert_array_equal(step({"acc": v}, one), [4, 4, 4])
    assert traces.n == 1
    np.testing.assert_array_equal(step({"acc": u}, one), [2, 2, 2])  # another variable: another trace
    assert traces.n == 2
    np.testing.assert_array_equal(v.value, [2, 2, 2])
    np.testing.assert_array_equal(u.value, [1, 1, 1])
    text = step.lower({"acc": v}, one).as_text("traced")
    assert 'var = "jit_arg_v"' in text and "func @step(%x: tensor<3xf32>)" in text
