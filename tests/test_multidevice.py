"""The multi-device runtime: partitioned calls equal single-device calls (forward, gradients,
variables; interpreter and native CPU partitions), concurrent calls, errors that cancel the step."""

import contextlib
import ctypes
import importlib.util
import os
import threading

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.cpu import communication
from flowjit.ir import interpreter
from flowjit.ir.channel import loopback
from flowjit.runtime import executor
from flowjit.runtime.executor import PartitionedExecutable
from flowjit.runtime.rendezvous import Rendezvous, TransferError

RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, 16)).astype(np.float32)
W1 = (RNG.standard_normal((16, 32)) * 0.3).astype(np.float32)
W2 = (RNG.standard_normal((32, 4)) * 0.3).astype(np.float32)


@pytest.fixture(autouse=True)
def two_devices(monkeypatch):
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "2")


def two_layer(x, w1, w2):
    with fj.device("cpu:0"):
        h = fnp.tanh(x @ w1)
    with fj.device("cpu:1"):
        y = h @ w2
    return fnp.sum(y * y) + fnp.sum(h), h


def unplaced(x, w1, w2):
    """`two_layer` without device constraints: the single-device reference."""
    h = fnp.tanh(x @ w1)
    y = h @ w2
    return fnp.sum(y * y) + fnp.sum(h), h


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_forward_equals_single_device(target, monkeypatch):
    f = fj.jit(two_layer, target=target)
    out = f(X, W1, W2)
    assert isinstance(f.lower(X, W1, W2).compile().executable, PartitionedExecutable)
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "1")
    with pytest.raises(fj.FlowjitValueError, match="no device matches"):
        fj.jit(two_layer, target=target)(X, W1, W2)  # cpu:1 does not exist: constraints are honoured
    reference = fj.jit(unplaced, target=target)(X, W1, W2)
    for got, want in zip(out, reference):
        np.testing.assert_array_equal(got, want)


def test_a_target_per_device_type_compiles_only_those_partitions():
    """`target={"cpu": "interpreter"}` runs CPU partitions on the interpreter (how the GPU device
    check runs a CPU+GPU split on a machine without a CPU compiler); a type it does not name keeps
    its own backend, and placement is as without a target."""
    f = fj.jit(two_layer, target={"cpu": "interpreter"})
    exe = f.lower(X, W1, W2).compile().executable
    assert {p.backend.name for p in exe.parts} == {"interpreter"}
    reference = fj.jit(unplaced, target="interpreter")(X, W1, W2)
    for got, want in zip(f(X, W1, W2), reference):
        np.testing.assert_array_equal(got, want)
    other = fj.jit(two_layer, target={"gpu": "interpreter"}).lower(X, W1, W2).compile().executable
    assert {p.backend.name for p in other.parts} == {"cpu"}
    single = fj.jit(unplaced, target={"cpu": "interpreter"}).lower(X, W1, W2).compile().executable
    assert single.backend == "interpreter"
    assert fj.jit(two_layer, target=(("cpu", "interpreter"),)).target == (("cpu", "interpreter"),)


@pytest.mark.parametrize(
    "target, message",
    [
        ({"tpu": "cpu"}, "no device type 'tpu'; device types: cpu, gpu"),
        ({"cpu": "nope"}, "unknown target 'nope'; available: "),
        ({"cpu": 1}, "the backend of 'cpu' must be a target name; found 1"),
        (3, r"expected a target name \(.*\) or a mapping \{device type: target name\}; found int"),
    ],
)
def test_a_wrong_target_is_refused_at_the_jit_line(target, message):
    with pytest.raises(fj.FlowjitValueError, match=r"test_multidevice.py:\d+: jit: (target: )?" + message):
        fj.jit(two_layer, target=target)


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_gradients_equal_single_device(target):
    def loss(w1, w2, x):
        return two_layer(x, w1, w2)[0]

    g = fj.jit(fj.grad(loss, argnums=(0, 1)), target=target)
    lowered = g.lower(W1, W2, X)
    assert "send" in lowered.as_text("placement")
    got = g(W1, W2, X)
    want = fj.jit(fj.grad(lambda w1, w2, x: unplaced(x, w1, w2)[0], argnums=(0, 1)), target=target)(W1, W2, X)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_training_with_variables_equals_single_device(target):
    """Two layers' weights live on two devices; each step's loss and updates equal the
    single-device step's."""

    def make(placed: bool):
        w1 = fj.Variable(W1, name=f"md.{target}.{placed}.w1")
        w2 = fj.Variable(W2, name=f"md.{target}.{placed}.w2")

        def loss(a, b, x):
            return two_layer(x, a, b)[0] if placed else unplaced(x, a, b)[0]

        @fj.jit(target=target)
        def step(x):
            with fj.device("cpu:0") if placed else contextlib.nullcontext():
                a = w1.value
            with fj.device("cpu:1") if placed else contextlib.nullcontext():
                b = w2.value
            value, (ga, gb) = fj.value_and_grad(loss, argnums=(0, 1))(a, b, x)
            w1.assign_sub(0.1 * ga)
            w2.assign_sub(0.1 * gb)
            return value

        return step, w1, w2

    step_md, w1_md, w2_md = make(True)
    step_one, w1_one, w2_one = make(False)
    text = step_md.lower(X).as_text("placement")
    assert f"colocated with variable 'md.{target}.True.w1'" in text
    assert f"colocated with variable 'md.{target}.True.w2'" in text
    for i in range(3):
        x = X + i
        np.testing.assert_allclose(step_md(x), step_one(x), rtol=1e-6)
    np.testing.assert_allclose(w1_md.value, w1_one.value, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(w2_md.value, w2_one.value, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(w1_md.value, W1)


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_concurrent_calls_are_independent(target):
    f = fj.jit(two_layer, target=target)
    f(X, W1, W2)  # compile once
    inputs = [X * (1 + k / 10) for k in range(16)]
    expected = [unplaced(x, W1, W2) for x in inputs]
    failures, done = [], []

    def worker(k):
        try:
            for _ in range(10):
                loss, h = f(inputs[k], W1, W2)
                np.testing.assert_allclose(h, expected[k][1], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(loss, expected[k][0], rtol=1e-4)
            done.append(k)
        except BaseException as e:  # noqa: BLE001 (reported below)
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)  # a deadlock fails here instead of hanging the suite
    assert not failures, failures[0]
    assert sorted(done) == list(range(len(inputs)))


def test_failing_partition_cancels_the_others_interpreter(monkeypatch):
    def f(x):
        with fj.device("cpu:0"):
            h = fnp.tanh(x)
        with fj.device("cpu:1"):
            g = fnp.exp(h)  # this op will fail
        with fj.device("cpu:0"):
            return g + h  # cpu:0 waits for g: it must be woken, not left hanging

    jitted = fj.jit(f, target="interpreter")
    jitted.lower(X)

    def broken(*args, **kwargs):
        raise FloatingPointError("injected failure")

    monkeypatch.setitem(interpreter.HANDLERS, "exp", lambda op, args, ctx: broken())
    monkeypatch.setenv("FLOWJIT_RECV_TIMEOUT", "60")
    with pytest.raises(executor.PartitionError) as e:
        jitted(X)
    message = str(e.value)
    assert "test_multidevice.py:" in message and "op 'exp' on cpu:1 failed" in message
    assert "injected failure" in message
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "partition on cpu:0 stopped" in notes and "cancelled" in notes and "timed out" not in notes


def test_failing_native_partition_cancels_the_other(monkeypatch):
    f = fj.jit(two_layer, target="cpu")
    executable = f.lower(X, W1, W2).compile().executable
    first, second = executable.parts  # cpu:0 sends h, cpu:1 receives it

    def fail(*args, **kwargs):
        raise fj.FlowjitError("injected: cpu:0 failed")

    monkeypatch.setattr(first, "run", fail)
    monkeypatch.setenv("FLOWJIT_RECV_TIMEOUT", "60")
    with pytest.raises(fj.FlowjitError, match="injected: cpu:0 failed") as e:
        executable.run([X, W1, W2])
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "partition on cpu:1 stopped" in notes and "cancelled" in notes
    assert "test_multidevice.py:" in notes  # the recv's source line
    # The executable still works after a failed step.
    monkeypatch.undo()
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "2")
    np.testing.assert_allclose(executable.run([X, W1, W2])[1], np.tanh(X @ W1), rtol=1e-5, atol=1e-6)


def test_recv_times_out_instead_of_hanging():
    rendezvous = Rendezvous(timeout_s=0.05)
    with pytest.raises(TransferError, match=r"m.py:3: recv 'cpu:0->cpu:1:%2' .* timed out after 0.05 s"):
        rendezvous.recv("cpu:0->cpu:1:%2", "m.py:3: ")


def test_a_recv_no_partition_can_satisfy_fails_at_once():
    alone = Rendezvous(timeout_s=600, parties=1)
    with pytest.raises(TransferError, match="can never complete"):
        alone.recv("missing")
    pair, errors = Rendezvous(timeout_s=600, parties=2), []

    def wait():
        try:
            pair.recv("missing")
        except TransferError as e:
            errors.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    pair.leave()  # the other partition finishes without sending
    waiter.join(timeout=30)
    assert not waiter.is_alive() and "can never complete" in str(errors[0])


def test_cancel_wakes_a_waiting_recv():
    rendezvous = Rendezvous(timeout_s=60)
    errors = []

    def wait():
        try:
            rendezvous.recv("k")
        except TransferError as e:
            errors.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    rendezvous.cancel(RuntimeError("boom"))
    waiter.join(timeout=30)
    assert not waiter.is_alive() and "cancelled" in str(errors[0])


def test_send_then_recv_delivers_the_same_buffer():
    rendezvous, value = Rendezvous(timeout_s=5), np.arange(4.0)
    rendezvous.send("k", value)
    assert rendezvous.recv("k") is value  # no copy between devices sharing host memory


def test_raw_transfers_in_both_orders():
    """Native send/recv move raw bytes with one copy: straight into a waiting receiver's buffer,
    or, when the sender comes first, out of its lent buffer, which it keeps until `send_done`."""
    source = np.arange(1000, dtype=np.float32)
    late, early = np.zeros_like(source), np.zeros_like(source)
    rendezvous = Rendezvous(timeout_s=30)
    assert rendezvous.send_bytes("first", source.ctypes.data, source.nbytes)  # lent: nobody waits yet
    returned = threading.Event()

    def sender_done():
        rendezvous.wait_returned(["first"])
        returned.set()

    sender = threading.Thread(target=sender_done, daemon=True)
    sender.start()
    assert not returned.wait(0.05), "send_done must wait until the receiver has read the loan"
    rendezvous.recv_into("first", late.ctypes.data, late.nbytes)
    sender.join(timeout=30)
    assert returned.is_set()
    np.testing.assert_array_equal(late, source)

    receiver = threading.Thread(target=rendezvous.recv_into, args=("second", early.ctypes.data, early.nbytes))
    receiver.start()
    while "second" not in rendezvous._waiting:  # the receiver is registered and waiting
        receiver.join(timeout=0.001)
    assert not rendezvous.send_bytes("second", source.ctypes.data, source.nbytes)  # copied: not lent
    receiver.join(timeout=30)
    assert not receiver.is_alive()
    np.testing.assert_array_equal(early, source)


def test_a_value_from_another_task_is_read_in_place():
    """`flowjit_recv_view` (a native recv from another task) returns the delivered array's own
    address when native code can read it there; a misaligned or non-contiguous one is copied
    (aligned), a loan is copied out, and a failed recv gives zeros and records the error."""
    rendezvous = Rendezvous(timeout_s=5)
    raw = np.zeros(4096 + 64, np.uint8)
    start = -raw.ctypes.data % communication.VIEW_ALIGNMENT
    aligned = raw[start : start + 4096].view(np.float32)
    aligned[:] = np.arange(1024)
    rendezvous.send("aligned", aligned)
    rendezvous.send("shifted", raw[start + 4 : start + 4 + 4096])
    strided = np.arange(2048, dtype=np.float32)[::2]
    rendezvous.send("strided", strided)
    source = np.arange(1024, dtype=np.float32)
    assert rendezvous.send_bytes("lent", source.ctypes.data, source.nbytes)
    key = {name: ctypes.create_string_buffer(name.encode()) for name in ("aligned", "shifted", "strided", "lent")}
    with communication.StepBinding(rendezvous, {}) as step:
        assert communication._native_recv_view(ctypes.addressof(key["aligned"]), 4096) == aligned.ctypes.data
        for name, want in (
            ("shifted", raw[start + 4 : start + 4 + 4096]),
            ("strided", strided.copy()),
            ("lent", source),
        ):
            address = communication._native_recv_view(ctypes.addressof(key[name]), 4096)
            assert address % communication.VIEW_ALIGNMENT == 0
            np.testing.assert_array_equal(np.frombuffer(ctypes.string_at(address, 4096), np.uint8), want.view(np.uint8))
        rendezvous.wait_returned(["lent"])  # the loan was copied out
        assert len(step.viewed) == 4 and step.error is None
        rendezvous.cancel(RuntimeError("the sender failed"))
        missing = ctypes.create_string_buffer(b"missing")
        address = communication._native_recv_view(ctypes.addressof(missing), 64)
        assert ctypes.string_at(address, 64) == bytes(64) and isinstance(step.error, TransferError)
    # A graph run on its own (no binding): the loopback's value, copied to align it, stays alive.
    shifted = raw[start + 4 : start + 4 + 4096]
    loopback().send("unbound", shifted)
    unbound = ctypes.create_string_buffer(b"unbound")
    address = communication._native_recv_view(ctypes.addressof(unbound), 4096)
    garbage = [np.full(4096, 7, np.uint8) for _ in range(64)]  # would reuse freed memory
    assert garbage and ctypes.string_at(address, 4096) == shifted.tobytes()


def test_send_done_withdraws_loans_when_the_step_is_cancelled():
    rendezvous = Rendezvous(timeout_s=30)
    buffer = np.ones(4, np.float32)
    assert rendezvous.send_bytes("k", buffer.ctypes.data, buffer.nbytes)
    rendezvous.cancel(RuntimeError("receiver failed"))
    rendezvous.wait_returned(["k"])  # returns: the loan is withdrawn, nobody reads it any more
    with pytest.raises(TransferError, match="cancelled"):
        rendezvous.recv_into("k", np.zeros(4, np.float32).ctypes.data, 16)


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_variable_assigned_a_received_value(target):
    """A variable on cpu:1 takes a value computed on cpu:0, while cpu:1 keeps computing values of
    the same size afterwards (in native code the received value waits in a workspace slot that
    those must not reuse before the update is written)."""
    v = fj.Variable(np.zeros((16, 16), np.float32), name=f"md.received.{target}")
    a = RNG.standard_normal((16, 16)).astype(np.float32)

    @fj.jit(target=target)
    def step(x):
        with fj.device("cpu:0"):
            new = x @ x
        with fj.device("cpu:1"):
            v.assign(new)
            y = x @ a
            z = y @ a
            return z @ a

    x = RNG.standard_normal((16, 16)).astype(np.float32)
    out = step(x)
    np.testing.assert_allclose(v.value, x @ x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, x @ a @ a @ a, rtol=1e-4, atol=1e-4)


def test_model_parallel_demo_matches_single_device(monkeypatch, capsys):
    pytest.importorskip("sklearn")
    examples = os.path.join(os.path.dirname(__file__), "..", "examples")
    monkeypatch.syspath_prepend(examples)
    spec = importlib.util.spec_from_file_location("model_parallel", os.path.join(examples, "model_parallel.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.main(["--epochs", "1"])  # exits with an error when the two trainings differ
    out = capsys.readouterr().out
    assert "identical to single-device training: True (largest weight difference 0)" in out
    assert "training step: 2 partitions on cpu:0, cpu:1" in out
    assert "ops by rule: colocation with a variable" in out and "// transfers:" in out


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_transfers_of_every_kind_of_value(target):
    """bool (bytes in memory), integers, half floats, scalars and empty arrays cross devices."""

    def f(x, n, e):
        with fj.device("cpu:0"):
            positive = x > 0
            halves = x.astype(fnp.float16) * 2
            count = fnp.sum(n * 3)
            empty = e + 1.0
        with fj.device("cpu:1"):
            return fnp.where(positive, x, 0.0), halves + 1, count - 1, empty * 2

    x = np.linspace(-1, 1, 10, dtype=np.float32)
    n = np.arange(6, dtype=np.int64)
    e = np.zeros((0, 3), np.float32)
    lowered = fj.jit(f, target=target).lower(x, n, e)
    assert lowered.as_text("placement").count("send %") >= 3
    got = fj.jit(f, target=target)(x, n, e)
    want = (np.where(x > 0, x, 0), x.astype(np.float16) * 2 + 1, np.sum(n * 3) - 1, e)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-3)


@pytest.mark.parametrize("target", ["interpreter", "cpu"])
def test_control_flow_on_another_device(target):
    """A loop placed on cpu:1 as a unit, fed from and feeding cpu:0."""

    def f(x):
        with fj.device("cpu:0"):
            start = fnp.tanh(x)
        with fj.device("cpu:1"):
            looped = fj.fori_loop(0, 3, lambda i, c: c * 0.5 + 1.0, start)
        with fj.device("cpu:0"):
            return fj.cond(looped.sum() > 0, lambda v: v * 2.0, lambda v: -v, looped)

    graph = fj.jit(f, target=target).lower(X).graph("placement")
    (loop,) = [op for op in graph.ops if op.name == "for"]
    assert loop.device.endswith("cpu:1") and all(o.device == loop.device for o in loop.regions[0].walk())
    expected = np.tanh(X)
    for _ in range(3):
        expected = expected * 0.5 + 1.0
    expected = expected * 2.0 if expected.sum() > 0 else -expected
    np.testing.assert_allclose(fj.jit(f, target=target)(X), expected, rtol=1e-5)


def test_lent_buffer_stays_intact_until_received():
    """cpu:0 sends `s` while cpu:1 is still busy, so the send lends its workspace slot; cpu:0's
    later values of the same size must not reuse that slot before cpu:1 has read it."""
    big = (RNG.standard_normal((192, 192)) / 14).astype(np.float32)
    x = RNG.standard_normal((192, 192)).astype(np.float32)

    def f(x, big):
        with fj.device("cpu:0"):
            s = fnp.tanh(x @ big)
            t = fnp.exp(s @ big)
            u = fnp.sin(t @ big)
        with fj.device("cpu:1"):
            w = fnp.tanh(big @ big) @ big
            w = fnp.tanh(w @ big) @ big
            r = w + s
        return u, r

    jitted = fj.jit(f, target="cpu")
    s = np.tanh(x @ big)
    w = np.tanh(np.tanh(big @ big) @ big @ big) @ big
    for _ in range(5):
        u, r = jitted(x, big)
        np.testing.assert_allclose(r, w + s, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(u, np.sin(np.exp(s @ big) @ big), rtol=1e-4, atol=1e-5)
