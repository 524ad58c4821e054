"""LLVM's half of a compile split into parts compiled on separate threads (`parallel_codegen`)."""

import faulthandler
import threading

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.cpu import parallel_codegen
from flowjit.errors import CompileError

# A module as mlir-translate prints it: an entry, two outlined OpenMP bodies, a shared constant.
_MODULE = """; ModuleID = 'LLVMDialectModule'
source_filename = "LLVMDialectModule"

@__constant_4xf32 = private constant [4 x float] [float 1.0, float 2.0, float 3.0, float 4.0]

declare void @__kmpc_fork_call(ptr, i32, ptr, ...)

define void @fj_f(ptr %0, ptr %1) {
  call void (ptr, i32, ptr, ...) @__kmpc_fork_call(ptr null, i32 1, ptr @fj_f..omp_par, ptr %0)
  call void (ptr, i32, ptr, ...) @__kmpc_fork_call(ptr null, i32 1, ptr @fj_f..omp_par.1, ptr %1)
{filler}  ret void
}

define internal void @fj_f..omp_par(ptr noalias %tid.addr, ptr noalias %zero.addr, ptr %0) #0 {
  %v = load float, ptr @__constant_4xf32, align 4
{filler}  store float %v, ptr %0, align 4
  ret void
}

define internal void @fj_f..omp_par.1(ptr noalias %tid.addr, ptr noalias %zero.addr, ptr %0) #0 {
{filler}  ret void
}

attributes #0 = { nounwind }
"""


def _module(filler_lines: int, extra: str = "") -> str:
    filler = "".join(f"  %f{i} = add i64 {i}, 1\n" for i in range(filler_lines))
    return extra + _MODULE.replace("{filler}", filler)


def test_outlined_bodies_go_to_other_parts_with_declarations():
    parts = parallel_codegen.split_llvm_ir(_module(400), 2)
    assert len(parts) == 2
    entry, other = parts
    assert "define void @fj_f(" in entry and "define void @fj_f(" not in other
    # The body moved out is defined with external linkage where it lives and declared where it is used.
    moved = "fj_f..omp_par" if "define void @fj_f..omp_par(" in other else "fj_f..omp_par.1"
    assert f"define void @{moved}(" in other and f"declare void @{moved}(" in entry
    # Module-level lines (the constant, declarations, attributes) are in every part.
    for part in parts:
        assert "@__constant_4xf32 = private constant" in part and "attributes #0" in part


def test_parts_parse_and_link(monkeypatch):
    parts = parallel_codegen.split_llvm_ir(_module(400), 2)
    optimized = parallel_codegen.optimize_parts(parts, "fj_f", 3)
    assert parallel_codegen.undefined_symbols([m for m, _ in optimized]) == ["__kmpc_fork_call"]
    objects = parallel_codegen.emit_objects(optimized)
    assert len(objects) == 2 and all(o.startswith(b"\x7fELF") for o in objects)


@pytest.mark.parametrize(
    "text",
    [
        _module(10),  # too small to pay
        _module(400, extra="@counter = internal global i64 0\n"),  # a mutable global would be duplicated
    ],
    ids=["small", "mutable-global"],
)
def test_not_split(text):
    assert parallel_codegen.split_llvm_ir(text, 2) == [text]


def test_one_thread_means_no_split():
    text = _module(400)
    assert parallel_codegen.split_llvm_ir(text, 1) == [text]


def test_threads_setting(monkeypatch):
    monkeypatch.setenv("FLOWJIT_COMPILE_THREADS", "3")
    assert parallel_codegen.threads() == 3
    monkeypatch.setenv("FLOWJIT_COMPILE_THREADS", "many")
    with pytest.raises(CompileError, match="FLOWJIT_COMPILE_THREADS must be a whole number; found 'many'"):
        parallel_codegen.threads()


def _loss(w1, w2, x):
    h = fnp.tanh(x @ w1)
    z = h @ w2
    return fnp.mean(fnp.exp(z - fnp.max(z, axis=1, keepdims=True)))


def _inputs():
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 512)).astype(np.float32) * 0.05
    w2 = rng.standard_normal((512, 256)).astype(np.float32) * 0.05
    x = rng.standard_normal((512, 256)).astype(np.float32)
    return w1, w2, x


@pytest.mark.usefixtures("specialized_matmul")  # large kernels: a module worth splitting
def test_split_compile_matches_one_thread(monkeypatch, tmp_path):
    """A gradient with several parallel kernels compiles in two parts; same results as in one part,
    and the two-object cache entry loads in a fresh compile."""
    inputs = _inputs()
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setenv("FLOWJIT_COMPILE_THREADS", "1")
    single = fj.jit(fj.grad(_loss, argnums=(0, 1)))
    expected = single(*inputs)
    assert "; ---- part" not in single.lower(*inputs).as_text("llvm")

    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLOWJIT_CACHE", "1")
    monkeypatch.setenv("FLOWJIT_COMPILE_THREADS", "2")
    split = fj.jit(fj.grad(_loss, argnums=(0, 1)))
    compiled = split.lower(*inputs).compile()
    assert len(compiled.executable.native.objects) == 2
    llvm = split.lower(*inputs).as_text("llvm")
    assert "; ---- part 1 of 2" in llvm and "; ---- part 2 of 2" in llvm
    assert "\n# ---- part 2 of 2" in split.lower(*inputs).as_text("asm")
    for got, want in zip(split(*inputs), expected):
        np.testing.assert_array_equal(got, want)

    again = fj.jit(fj.grad(_loss, argnums=(0, 1))).lower(*inputs).compile()  # a cache hit: two objects, linked
    assert len(again.executable.native.objects) == 2 and not again.executable.stages.parts
    for got, want in zip(again(*inputs), expected):
        np.testing.assert_array_equal(got, want)


def test_threads_compiling_with_and_without_loop_strength_reduction(monkeypatch):
    """Code generations that want loop strength reduction (a row-tile nest: softmax, one part, MCJIT
    under the toolchain lock) and ones that do not (a gradient with matmul kernels in parallel
    parts) run from several threads at once: each waits for the other setting to finish, none
    hangs, every result is the one compiled alone."""
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setenv("FLOWJIT_COMPILE_THREADS", "2")
    inputs = _inputs()
    rows = inputs[2]

    def softmax(x):
        e = fnp.exp(x - fnp.max(x, axis=1, keepdims=True))
        return e / fnp.sum(e, axis=1, keepdims=True)

    want_grad = fj.jit(fj.grad(_loss, argnums=(0, 1)))(*inputs)
    want_rows = fj.jit(softmax)(rows)
    assert fj.jit(softmax).lower(rows).as_text("asm").startswith("# code generation: with loop")
    failures, done = [], []

    def compile_many(k: int):
        try:
            for _ in range(3):
                if k % 2:
                    got = fj.jit(fj.grad(_loss, argnums=(0, 1)))(*inputs)
                    for g, w in zip(got, want_grad):
                        np.testing.assert_array_equal(g, w)
                else:
                    np.testing.assert_array_equal(fj.jit(softmax)(rows), want_rows)
            done.append(k)
        except Exception as e:  # reported below, on the test's thread
            failures.append(e)

    threads = [threading.Thread(target=compile_many, args=(k,)) for k in range(4)]
    # Seen once (a slow machine): one thread not done at its join, no error. Should it
    # happen again, every thread's stack goes to stderr first, to show where it waits.
    faulthandler.dump_traceback_later(110)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not failures and sorted(done) == [0, 1, 2, 3]


def test_compiles_in_a_child_forked_after_a_split_compile(monkeypatch):
    """The compile threads do not survive fork: a child must start its own instead of queueing work
    on the parent's pool (which would hang)."""
    import multiprocessing

    parts = parallel_codegen.split_llvm_ir(_module(400), 2)
    parallel_codegen.emit_objects(parallel_codegen.optimize_parts(parts, "fj_f", 1))  # the parent's pool
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        result = pool.apply_async(_objects_in_child, (parts,))
        assert result.get(timeout=120) == 2


def _objects_in_child(parts):
    return len(parallel_codegen.emit_objects(parallel_codegen.optimize_parts(parts, "fj_f", 1)))


_GC_SCRIPT = """
import gc
from flowjit.backends.cpu import parallel_codegen
import test_parallel_codegen as t
for _ in range(20):
    parts = parallel_codegen.optimize_parts(parallel_codegen.split_llvm_ir(t._module(400), 2), "fj_f", 1)
    module, _ = parts[1]
    cycle = [module._context, module, parts]  # collected together, the context finalized first
    cycle.append(cycle)
    del parts, module, cycle
    gc.collect()
print("ok")
"""


def test_part_modules_and_their_contexts_die_together_in_any_order():
    """A part's module and its LLVM context collected in one garbage cycle: the module must be
    disposed of before the context (it crashed the interpreter when the context went first)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    out = subprocess.run([sys.executable, "-c", _GC_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _names(part: str, prefix: str) -> set[str]:
    return {line.split("@")[1].split("(")[0] for line in part.splitlines() if line.startswith(prefix)}


def test_more_threads_than_outlined_bodies():
    parts = parallel_codegen.split_llvm_ir(_module(400), 8)
    assert len(parts) == 3  # the entry's part and one per outlined body
    for part in parts:
        defined, declared = _names(part, "define "), _names(part, "declare void @fj")
        assert len(defined) == 1 and not defined & declared
    assert "declare void @fj_f..omp_par(" in parts[0] and "declare void @fj_f..omp_par.1(" in parts[0]
