"""A large function's MLIR half in parts (`lowering.lower_graph(split, CPU=n)`, `parallel_mlir`): the parts
are valid modules that call each other, the split compile gives the same results as the whole one
(variables updated in place included), and a failing, crashing or hanging part process becomes a
clear CompileError instead of a hang."""

import faulthandler
import os
import time

import numpy as np
import pytest

import flowjit as fj
from flowjit.backends.cpu import compiler, parallel_mlir, toolchain
from flowjit.backends.cpu.target import CPU
from flowjit.backends.mlir import lowering, sharing
from flowjit.errors import CompileError

pytestmark = pytest.mark.skipif(parallel_mlir.processes() < 2, reason="needs os.fork and two cores")


def _loss(w1, w2, x):
    h = fj.numpy.tanh(w1 @ x)
    return fj.numpy.sum((w2 @ h) ** 2)


def _inputs():
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((64, 96)).astype(np.float32) * 0.1,
        rng.standard_normal((96, 64)).astype(np.float32) * 0.1,
        rng.standard_normal((96, 32)).astype(np.float32),
    )


@pytest.fixture
def split_everything(monkeypatch):
    """Split every function with two or more ops, whatever its size."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(lowering, "SPLIT_MIN_LINES", 0)


def _graph(fn, *args):
    captured = {}
    original = compiler.generate_mlir

    def capture(graph, options=None, split=1):
        captured["graph"] = graph
        return original(graph, options, split)

    compiler.generate_mlir = capture
    try:
        fj.jit(fn).lower(*args).compile()
    finally:
        compiler.generate_mlir = original
    return captured["graph"]


def test_parts_are_modules_that_chain(split_everything):
    graph = _graph(fj.grad(_loss, argnums=(0, 1)), *_inputs())
    module = lowering.lower_graph(graph, CPU, split=2)
    assert len(module.parts) == 2
    first, second = module.parts
    assert first.startswith("// part 1 of 2 of flowjit function") and second.startswith("// part 2 of 2")
    assert f"func.func @{module.entry}(" in first and f"func.call @{module.entry}_part1(" in first
    assert f"func.func private @{module.entry}_part1(" in first and f"func.func @{module.entry}_part1(" in second
    assert f"func.call @{module.entry}" not in second  # the last part returns to the entry
    for part in module.parts:  # each parses, and lowers to LLVM IR on its own
        assert toolchain.lower_to_llvm_ir(part).llvm_ir
    whole = lowering.lower_graph(graph, CPU)
    assert not whole.parts and whole.workspace_bytes == module.workspace_bytes


def test_small_or_one_op_functions_stay_whole(monkeypatch):
    graph = _graph(fj.grad(_loss, argnums=(0, 1)), *_inputs())
    lines = lowering.lower_graph(graph, CPU).text.count("\n")
    monkeypatch.setattr(lowering, "SPLIT_MIN_LINES", lines)  # more than the body's lines
    assert not lowering.lower_graph(graph, CPU, split=2).parts
    monkeypatch.setattr(lowering, "SPLIT_MIN_LINES", lines // 2)
    assert len(lowering.lower_graph(graph, CPU, split=2).parts) == 2
    monkeypatch.setattr(lowering, "SPLIT_MIN_LINES", 0)
    one_op = _graph(lambda a: a * 2.0 + 1.0, np.ones(8, np.float32))
    assert not lowering.lower_graph(one_op, CPU, split=2).parts


def test_the_cut_balances_the_parts_compile_cost_not_their_lines():
    """Kernels vectorized by a transform schedule cost more to compile than their lines say (the
    MLP step's loss: 241 lines, 14 scheduled kernels, as long as a 700-line matmul): the cut
    weighs each by `SCHEDULED_KERNEL_COST` lines, so it comes before such a piece when that evens
    the parts, and where lines alone would put it when no piece has a schedule."""

    def piece(lines: int, scheduled: int = 0):
        return sharing.Piece(["  %v = arith.constant 0 : index"] * lines, ["schedule"] * scheduled)

    def cut(pieces):
        starts = lowering._piece_starts(pieces, 0)
        ((_, index),) = lowering._cuts(starts, sum(p.cost for p in pieces), 2)
        return index

    # lines alone: 850 | 600 (cut before the fourth piece) is the most even
    assert cut([piece(300), piece(250), piece(300), piece(300), piece(300)]) == 3
    # the second piece's 14 scheduled kernels make it the costliest: 300 + (250 + 14 kernels) | 900
    assert cut([piece(300), piece(250, scheduled=14), piece(300), piece(300), piece(300)]) == 2


def test_split_compile_matches_whole(split_everything, monkeypatch):
    inputs = _inputs()
    compiled = fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*inputs).compile()
    assert len(compiled.executable.stages.mlir.parts) == 2
    assert len(compiled.executable.native.objects) == 2  # one LLVM part per MLIR part, linked
    got = compiled(*inputs)
    # The stages are the whole module's: "mlir" parses as one module.
    mlir = compiled.executable.stages["mlir"]
    assert "// part" not in mlir and toolchain.lower_to_llvm_ir(mlir).llvm_ir
    monkeypatch.setattr(lowering, "SPLIT_MIN_LINES", 10**9)
    want = fj.jit(fj.grad(_loss, argnums=(0, 1)))(*inputs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_split_training_step_updates_variables_in_place(split_everything, monkeypatch):
    """Late outputs (variables written last, aliasing their inputs) go with the last part."""

    def run():
        w = fj.Variable(np.linspace(-1, 1, 96 * 64, dtype=np.float32).reshape(96, 64), name="w")
        x = np.ones((64, 8), np.float32)

        @fj.jit
        def step(x):
            loss, g = fj.value_and_grad(lambda w: fj.numpy.sum(fj.numpy.tanh(w @ x) ** 2))(w.value)
            w.assign(w.value - 0.01 * g)
            return loss

        losses = [float(step(x)) for _ in range(3)]
        return losses, np.array(w.value)

    split = run()
    monkeypatch.setattr(lowering, "SPLIT_MIN_LINES", 10**9)
    whole = run()
    assert split[0] == whole[0]
    np.testing.assert_array_equal(split[1], whole[1])


def _failing_in_part_two(action):
    """`toolchain.lower_to_llvm_ir` that runs `action` on the module defining a second part."""
    original = toolchain.lower_to_llvm_ir

    def lower(text, *args, **kwargs):
        if "func.func @fj_" in text and "_part1(" in text.split("func.func @fj_", 1)[1].split("\n", 1)[0]:
            action()
        return original(text, *args, **kwargs)

    return lower


def _raise():
    raise RuntimeError("boom in part two")


def test_an_error_in_a_part_process_is_raised(split_everything, monkeypatch):
    monkeypatch.setattr(toolchain, "lower_to_llvm_ir", _failing_in_part_two(_raise))
    with pytest.raises(CompileError, match="boom in part two.*part 2 of a split function"):
        fj.jit(fj.grad(_loss, argnums=(0, 1)))(*_inputs())


def _abort():
    faulthandler.disable()  # pytest's handler would print the child's stack on the abort
    os.abort()


def test_a_crashed_part_process_is_reported(split_everything, monkeypatch):
    monkeypatch.setattr(toolchain, "lower_to_llvm_ir", _failing_in_part_two(_abort))
    with pytest.raises(CompileError, match=r"part 2 of the function through MLIR died \(signal 6\)"):
        fj.jit(fj.grad(_loss, argnums=(0, 1)))(*_inputs())


def _hang_in_a_child(parent: int):
    def hang():
        if os.getpid() != parent:
            time.sleep(60)

    return hang


def test_a_hanging_part_process_is_stopped_and_its_part_lowered_here(split_everything, monkeypatch):
    """A child that hangs where the parent would not (a lock held forever in its copy of the
    process) is stopped after its deadline and its part lowered in this process."""
    inputs = _inputs()
    want = fj.jit(fj.grad(_loss, argnums=(0, 1)))(*inputs)
    monkeypatch.setattr(toolchain, "lower_to_llvm_ir", _failing_in_part_two(_hang_in_a_child(os.getpid())))
    monkeypatch.setattr(parallel_mlir, "PART_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="part 2 of a split function through MLIR did not finish in time"):
        compiled = fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*inputs).compile()
    assert time.monotonic() - start < 30
    assert len(compiled.executable.stages.mlir.parts) == 2
    for g, w in zip(compiled(*inputs), want):
        np.testing.assert_array_equal(g, w)


def test_a_part_process_is_stopped_at_the_longest_wait(split_everything, monkeypatch):
    monkeypatch.setattr(toolchain, "lower_to_llvm_ir", _failing_in_part_two(_hang_in_a_child(os.getpid())))
    monkeypatch.setattr(parallel_mlir, "PART_GRACE_S", 1000.0)
    monkeypatch.setattr(parallel_mlir, "PART_TIMEOUT_S", 2.0)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not finish in time"):
        fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*_inputs()).compile()
    assert time.monotonic() - start < 30


def test_parts_are_lowered_here_when_no_process_can_be_forked(split_everything, monkeypatch):
    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")

    inputs = _inputs()
    want = fj.jit(fj.grad(_loss, argnums=(0, 1)))(*inputs)
    monkeypatch.setattr(os, "fork", no_fork)
    compiled = fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*inputs).compile()
    assert len(compiled.executable.stages.mlir.parts) == 2
    for g, w in zip(compiled(*inputs), want):
        np.testing.assert_array_equal(g, w)


def test_children_reaped_elsewhere_are_fine(split_everything):
    """A program that ignores SIGCHLD has its children reaped by the kernel: waitpid finds none."""
    import signal

    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        inputs = _inputs()
        compiled = fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*inputs).compile()
        assert len(compiled.executable.stages.mlir.parts) == 2
        assert all(np.all(np.isfinite(g)) for g in compiled(*inputs))
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_split_compiles_on_several_threads_at_once(split_everything):
    """Forks happen while other threads compile (LLVM on the pool threads, MLIR waiting for the
    toolchain's lock): every compile finishes, with the right results."""
    from concurrent.futures import ThreadPoolExecutor

    inputs = _inputs()
    want = fj.jit(fj.grad(_loss, argnums=(0, 1)))(*inputs)

    def compile_and_run(_):
        return fj.jit(fj.grad(_loss, argnums=(0, 1)))(*inputs)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(compile_and_run, range(6), timeout=600))
    for got in results:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_forks_hold_llvmlites_lock(split_everything, monkeypatch):
    """Children are forked while this thread holds llvmlite's lock, which every engine's disposal
    takes: an engine freed on another thread meanwhile (its exception-handling frames deregistered
    under the C++ unwinder's mutex) left the child waiting forever at its first C++ exception."""
    from llvmlite.binding import ffi

    real_fork, held = os.fork, []

    def fork():
        held.append((ffi.lib._lock._lock._is_owned(), toolchain.lock()._is_owned()))
        return real_fork()

    monkeypatch.setattr(parallel_mlir.os, "fork", fork)
    inputs = _inputs()
    compiled = fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*inputs).compile()
    assert len(compiled.executable.stages.mlir.parts) == 2
    assert held == [(True, True)]


def test_one_process_means_no_split(split_everything, monkeypatch):
    monkeypatch.setenv("FLOWJIT_COMPILE_THREADS", "1")
    assert parallel_mlir.processes() == 1
    inputs = _inputs()
    compiled = fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*inputs).compile()
    assert not compiled.executable.stages.mlir.parts
