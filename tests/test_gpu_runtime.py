"""The GPU runtime (flowjit/backends/gpu: plan.py, driver.py, runtime.py, cache.py) as far as it can be
checked without a GPU, and on a GPU where there is one.

Without a device: launch plans extracted from the host function (their buffers, launches, loops;
every launch's packed parameters against its kernel's PTX `.param` list; every view inside its
buffer), the caching allocator's bookkeeping (on a fake malloc/free: our logic, not the driver's),
the disk cache (a second process runs from it without importing MLIR), the exact error when the
package, the driver or a device is missing, GPU devices and the chip they compile for. With a
device (skipped here with the reason): compiled programs against numpy.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.gpu import backend as gpu_backend
from flowjit.backends.gpu import cache, cubin, driver, lower_kernels, plan, runtime
from flowjit.backends.gpu.compiler import lower_to_ptx
from flowjit.backends.gpu.pipeline import GpuOptions
from flowjit.backends.gpu.plan import PARAM_BYTES, LaunchPlan, Loop, MemrefArg, ScalarArg, ptx_params
from flowjit.backends.gpu.target import CPU_ONLY, FUNCTIONALIZED
from flowjit.errors import CompileError
from flowjit.ir import dtypes as dt

sys.path.insert(0, os.path.dirname(__file__))
import gpu_emulator  # noqa: E402
from op_table import ROWS, assert_close, build_case, tolerance  # noqa: E402
from test_gpu_codegen import GRADIENT_PARAMS, gradient_case  # noqa: E402

from flowjit.ir.interpreter import interpret  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = driver.unavailable_reason()
HAS_BINDINGS = not isinstance(driver._bindings(), driver.GpuRuntimeError)
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"no CUDA device: {NO_GPU}")


def chain(x, y):
    return fnp.tanh(x * y + 1.0) * fnp.exp(-x) + fnp.log(y * y + 1.0)


def softmax(x):
    m = fnp.max(x, axis=1, keepdims=True)
    e = fnp.exp(x - m)
    return e / fnp.sum(e, axis=1, keepdims=True)


def whole_sum(x):
    return fnp.sum(x)


def column_sum(x):
    return fnp.sum(x, axis=0)


_X = np.linspace(-2, 2, 33 * 100, dtype=np.float32).reshape(33, 100)
_X300 = np.linspace(-1, 1, 64 * 300, dtype=np.float32).reshape(64, 300)
PROGRAMS = {
    "elementwise": (chain, (_X, _X + 3.0)),
    "two-kernel reduction": (whole_sum, (np.linspace(0, 1, 4096, dtype=np.float32),)),
    "fused softmax": (softmax, (_X,)),
    "temporary and unrolled loop": (column_sum, (np.ones((10, 5, 7), np.float32),)),
    "temporary and kept loop": (column_sum, (np.ones((300, 5, 7), np.float32),)),
}


def compiled(name, chip="sm_80"):
    fn, args = PROGRAMS[name]
    graph = fj.jit(fn).lower(*args).graph("optimized")
    return lower_to_ptx(graph, GpuOptions(chip=chip))


# --- the launch plan -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_packed_parameters_match_each_kernels_ptx(name):
    module = compiled(name, "sm_90")
    ptx_of = {k.name: k.ptx for k in module.kernels}
    assert module.plan.launch_count() >= 1
    for launch, _ in module.plan.launches():
        declared = ptx_params(ptx_of[launch.module], launch.function)
        packed = launch.param_kinds()
        assert len(packed) == len(declared), (launch, declared)
        assert [PARAM_BYTES[k] for k in packed] == [int(t[1:]) // 8 for t in declared]
        # a memref's two pointers are the parameters PTX marks as pointers
        pointers = [i for i, t in enumerate(_raw_params(ptx_of[launch.module])) if ".ptr" in t]
        expected, at = [], 0
        for arg in launch.args:
            if isinstance(arg, MemrefArg):
                expected += [at, at + 1]
            at += len(arg.param_kinds())
        assert set(pointers) <= set(expected)


def _raw_params(ptx: str) -> list[str]:
    entry = ptx[ptx.index(".entry") :]
    return [line.strip() for line in entry[: entry.index(")")].splitlines() if ".param" in line]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_every_view_stays_inside_its_buffer_and_the_plan_survives_json(name):
    module = compiled(name)
    p = module.plan
    for launch, loops in p.launches():
        for arg in launch.args:
            if not isinstance(arg, MemrefArg):
                continue
            buffer = p.buffers[arg.buffer]
            offset = arg.offset.at(loops)
            last = offset + sum((s - 1) * st for s, st in zip(arg.sizes, arg.strides)) if all(arg.sizes) else offset
            assert 0 <= offset and last < max(1, np.prod(buffer.shape)), (launch, loops, buffer)
    assert LaunchPlan.from_json(json.loads(json.dumps(p.to_json()))) == p


@pytest.fixture
def host_loops():
    """Reductions lowered the simple way, with serial loops on the host (`gpu_emulator.host_loops`)."""
    with gpu_emulator.host_loops():
        yield


def test_buffers_are_the_inputs_outputs_workspace_and_temporaries(host_loops):
    p = compiled("temporary and kept loop").plan
    kinds = [(b.kind, b.index, b.element, b.shape, b.nbytes) for b in p.buffers]
    assert kinds[:3] == [
        ("input", 0, "f32", (300, 5, 7), 300 * 35 * 4),
        ("output", 0, "f32", (5, 7), 35 * 4),
        ("workspace", 0, "i8", (0,), 0),  # no kernel takes it: its slots are temporaries of their own
    ]
    assert [b.kind for b in p.buffers[3:]] == ["temporary"]  # the accumulator
    # the reduction over 300 rows is one loop step of 300 trips whose launch takes the row index
    loops = [s for s in p.steps if isinstance(s, Loop)]
    assert len(loops) == 1 and loops[0].trips == 300 and len(loops[0].body) == 1
    (inner,) = loops[0].body
    assert any(isinstance(a, ScalarArg) and a.value.terms == ((loops[0].var, 1),) for a in inner.args)
    assert p.launch_count() == 302


def _bias_tanh(x, b):
    return fnp.tanh(x + b) * 2.0


def test_a_fused_elementwise_result_is_one_kernel_writing_the_output():
    """No temporary and no copy kernel: the fused n-d kernel stores into the output's own buffer."""
    x, b = np.ones((3, 5, 300), np.float32), np.ones((300,), np.float32)
    p = lower_to_ptx(fj.jit(_bias_tanh).lower(x, b).graph("optimized"), GpuOptions()).plan
    assert p.launch_count() == 1
    assert [b.kind for b in p.buffers] == ["input", "input", "output", "workspace"]


_LAUNCH = re.compile(r"threads in \((%c\d+), (%c\d+), (%c\d+)\)")
_STORE = re.compile(r"(memref|vector)\.store %\w+, %\w+\[([^\]]*)\] .*: memref<(?:\d+x)+f32>(?:, vector<(\d+)xf32>)?")


@pytest.mark.parametrize(
    "fn,shapes",
    [
        (_bias_tanh, [(64, 300), (300,)]),
        (_bias_tanh, [(2, 7, 300), (300,)]),
        (lambda x, y: x * fnp.exp(y), [(40, 50), (40, 50)]),
        # a per-element kernel (linalg.index): K below a step of the tiled products (lower_matmul)
        (lambda x, w: x @ w, [(48, 12), (12, 96)]),
    ],
)
def test_consecutive_threads_write_consecutive_elements(fn, shapes):
    """The n-d kernels give a block's threads the contiguous (last) dimension: the index of that
    dimension in the output's store is the block's thread id plus an offset (times the vector's
    width where each thread stores a vector: `wide_accesses.py`), so a warp's stores are coalesced
    (with a block's threads on the first dimension, each would be a row apart)."""
    args = [np.ones(s, np.float32) for s in shapes]
    text = lower_to_ptx(fj.jit(fn).lower(*args).graph("optimized"), GpuOptions()).gpu_mlir
    host, kernel = text.split("gpu.module", 1)
    (threads,) = _LAUNCH.findall(host)
    constants = dict(re.findall(r"(%c\d+) = arith.constant (\d+) : index", host))
    (axis,) = ["xyz"[i] for i, c in enumerate(threads) if constants[c] != "1"]  # the block's one wide axis
    ((kind, indices, width),) = _STORE.findall(kernel)
    last = indices.split(", ")[-1]
    if kind == "vector":  # consecutive threads store consecutive vectors of `width` elements
        scaled = re.search(rf"{re.escape(last)} = arith\.muli (%\w+), (%c\d+) .*: index", kernel)
        assert scaled is not None and re.search(rf"{scaled.group(2)} = arith.constant {width} : index", kernel)
        last = scaled.group(1)
    definition = re.search(rf"{re.escape(last)} = arith\.addi (%\w+), (%\w+) : index", kernel)
    assert definition is not None and f"%thread_id_{axis}" in definition.groups(), (indices, definition)


def test_a_small_loop_is_unrolled_into_the_same_launches(host_loops, monkeypatch):
    unrolled = compiled("temporary and unrolled loop").plan
    assert not any(isinstance(s, Loop) for s in unrolled.steps)
    monkeypatch.setattr(plan, "UNROLL_MAX_LAUNCHES", 0)
    kept = compiled("temporary and unrolled loop").plan
    assert any(isinstance(s, Loop) for s in kept.steps)

    def concrete(p):
        out = []
        for launch, loops in p.launches():
            values = [
                (a.buffer, a.offset.at(loops), a.sizes, a.strides)
                if isinstance(a, MemrefArg)
                else (a.kind, a.value.at(loops) if isinstance(a.value, plan.Affine) else a.value)
                for a in launch.args
            ]
            out.append((launch.module, launch.grid, launch.block, values))
        return out

    assert concrete(kept) == concrete(unrolled) and len(concrete(kept)) == 12


def _plan(fn, *args):
    return lower_to_ptx(fj.jit(fn).lower(*args).graph("optimized"), GpuOptions()).plan


def test_a_reduction_with_few_results_is_split_over_many_threads():
    """64 row maxima of 300 elements: 30 partials per row (the divisor of 300 nearest the 32 that
    would keep 65536 threads busy; partial c is the max of every 30th element from c, so
    consecutive threads read consecutive elements), then one kernel combining each row's partials;
    a (300, 5, 7) column sum likewise, with no loop of launches on the host."""
    rows = _plan(lambda x: fnp.max(x, axis=1), _X300)
    assert rows.launch_count() == 2
    assert [b.shape for b in rows.buffers if b.kind == "temporary"] == [(64, 30)]
    columns = compiled("temporary and kept loop").plan
    assert columns.launch_count() == 2 and not any(isinstance(s, Loop) for s in columns.steps)
    assert lower_kernels.partials_per_result(64, 300) == 32 and lower_kernels.partials_per_result(100_000, 64) == 1
    assert lower_kernels.partials_per_result(1, 10_000_000) == lower_kernels.PARTIALS_MAX


def test_the_elementwise_kernels_computing_a_reduced_value_run_inside_its_partials():
    """A sum of squares reads x once: the square is computed in the partials' kernel (a generic
    reading x through an indexing map, into which elementwise fusion puts its producers), for
    rows, columns and a whole-array mean alike; where no divisor of the reduced extent is near the
    wanted partial count, the partials read x element by element (strided) instead."""
    for fn, x in (
        (lambda x: fnp.sum(x * x, axis=1), _X300),
        (lambda x: fnp.sum(x * x, axis=0), _X300.T.copy()),
        (lambda x: fnp.mean((x - 1.0) ** 2), _X300),
    ):
        p = _plan(fn, x)
        assert not [b for b in p.buffers if b.kind == "temporary" and math.prod(b.shape) == x.size], p.buffers
    assert lower_kernels.partials_per_result(64, 293) == 32  # 293 is prime: strided partials
    strided = _plan(lambda x: fnp.sum(x, axis=1), np.ones((64, 293), np.float32))
    assert [b.shape for b in strided.buffers if b.kind == "temporary"] == [(64, 32)]
    (got,) = _emulated(fj.jit(lambda x: fnp.sum(x, axis=1)).lower(_X300[:, :293]).graph("optimized"), (_X300[:, :293],))
    np.testing.assert_allclose(got, _X300[:, :293].sum(axis=1), rtol=1e-5, atol=1e-5)


def _broadcast_product(x, w, b):
    return fnp.tanh(x @ w)[:, None, :] + b


def test_a_loop_kernel_broadcast_is_computed_once():
    """A product broadcast over a new axis: fused into the broadcast, each of its dot products would
    run 16 times (once per element of the larger result); it is computed once into a temporary of
    its own size, which the broadcast kernel reads."""
    args = (_X[:, :20], np.linspace(-1, 1, 20 * 8, dtype=np.float32).reshape(20, 8), np.ones((33, 16, 8), np.float32))
    module = lower_to_ptx(fj.jit(_broadcast_product).lower(*args).graph("optimized"), GpuOptions())
    assert module.plan.launch_count() == 2
    assert [math.prod(b.shape) for b in module.plan.buffers if b.kind == "temporary"] == [33 * 8]
    assert sum(kernel.count("scf.for") for kernel in module.gpu_mlir.split("gpu.module")[1:]) == 1
    (got,) = _emulated(fj.jit(_broadcast_product).lower(*args).graph("optimized"), args)
    np.testing.assert_allclose(got, np.tanh(args[0] @ args[1])[:, None, :] + args[2], rtol=1e-5, atol=1e-6)


def test_two_kernel_reduction_plan():
    p = compiled("two-kernel reduction").plan
    temporaries = [b for b in p.buffers if b.kind == "temporary"]
    assert (1, lower_kernels.partials_per_result(1, 4096)) in [b.shape for b in temporaries]  # the partials
    # partials, then their total written straight into the rank-0 output (no copy kernel)
    assert p.launch_count() == 2 and len(p.kernels()) == p.launch_count()
    assert [b.kind for b in p.buffers].count("temporary") == 1


def test_a_plan_that_disagrees_with_the_ptx_is_a_compile_error():
    module = compiled("elementwise")
    launch = module.plan.steps[0]
    short = plan.LaunchPlan(module.plan.function, module.plan.buffers, (plan.Launch(
        launch.module, launch.function, launch.grid, launch.block, 0, launch.args[:-1]),))  # fmt: skip
    with pytest.raises(CompileError, match="launch plan passes kernel"):
        plan.check_against_ptx(short, {k.name: k.ptx for k in module.kernels})


# --- the plan replayed on the CPU (tests/gpu_emulator.py: the kernels' MLIR compiled for the host) --


def _emulated(graph, args):
    module = lower_to_ptx(graph, GpuOptions())
    outputs = [(tuple(t.shape), t.dtype.np_dtype) for t in module.mlir.outputs]
    return gpu_emulator.run(module.plan, gpu_emulator.EmulatedKernels(module.gpu_mlir), list(args), outputs)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_replaying_the_plan_computes_the_programs(name):
    fn, args = PROGRAMS[name]
    (got,) = _emulated(fj.jit(fn).lower(*args).graph("optimized"), args)
    expected = np.asarray(fj.jit(fn, target="cpu")(*args))
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)


def _mlp_train_step(x, y, w1, b1, w2):
    def loss(w1, b1, w2):
        return fnp.mean((fnp.tanh(x @ w1 + b1) @ w2 - y) ** 2)

    g1, gb, g2 = fj.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)
    return w1 - 0.01 * g1, b1 - 0.01 * gb, w2 - 0.01 * g2


def test_replaying_an_mlp_training_step_computes_its_new_parameters():
    # the device check's training step, small: matmuls, their gradients, tanh and the update in one plan
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((6, 12), (6, 3), (12, 16), (16,), (16, 3))]
    got = _emulated(fj.jit(_mlp_train_step).lower(*args).graph("optimized"), args)
    expected = fj.jit(_mlp_train_step, target="cpu")(*args)
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)


def test_the_replay_sees_a_wrong_argument(host_loops):
    """The emulation can fail: the same plan reading row 4 where it should read row 3 computes
    something else."""
    x = np.arange(350, dtype=np.float32).reshape(10, 5, 7)
    module = compiled("temporary and unrolled loop")
    kernels = gpu_emulator.EmulatedKernels(module.gpu_mlir)
    (right,) = gpu_emulator.run(module.plan, kernels, [x], [((5, 7), np.float32)])
    np.testing.assert_array_equal(right, x.sum(axis=0))

    def row_4_for_3(arg):
        if isinstance(arg, ScalarArg) and arg.value == plan.Affine(3):
            return ScalarArg(arg.kind, plan.Affine(4))
        return arg

    steps = tuple(
        plan.Launch(s.module, s.function, s.grid, s.block, s.shared_bytes, tuple(map(row_4_for_3, s.args)))
        for s in module.plan.steps
    )
    assert steps != module.plan.steps
    wrong_plan = plan.LaunchPlan(module.plan.function, module.plan.buffers, steps)
    (wrong,) = gpu_emulator.run(wrong_plan, kernels, [x], [((5, 7), np.float32)])
    np.testing.assert_array_equal(wrong, x.sum(axis=0) - x[3] + x[4])


def _row_params():
    """Every float32 row of an op the GPU compiles (the others are placed on the CPU), and the
    first float16 and int32 row of each op."""
    seen = set()
    for row in ROWS:
        if row.op in CPU_ONLY or row.op in FUNCTIONALIZED or "scalar" in row.name:
            continue
        for dtype in row.dtypes:
            if dtype == dt.float32 or (dtype in (dt.float16, dt.int32) and (row.op, dtype) not in seen):
                seen.add((row.op, dtype))
                yield pytest.param(row, dtype, id=f"{row.name}-{dtype.name}".replace(" ", ""))


@pytest.mark.parametrize("row,dtype", list(_row_params()))
def test_replaying_the_plan_computes_the_op_rows(row, dtype):
    case = build_case(row, dtype)
    got = _emulated(case.graph, case.inputs)
    assert len(got) == len(case.expected)
    for actual, expected in zip(got, case.expected):
        assert_close(actual, expected, case.tol, f"{row.name} {dtype.name}")


_FIRST_GRADIENTS = [
    pytest.param(p.values[0], p.values[1], id=p.id)
    for p in GRADIENT_PARAMS
    if "sm_90" in p.values[2] and p.values[0].op not in CPU_ONLY
]


@pytest.mark.parametrize("row,dtype", _FIRST_GRADIENTS)
def test_replaying_the_plan_computes_the_gradient_graphs(row, dtype):
    """The first gradient graph of each op through the whole GPU pipeline (loop order, two-stage
    reductions, launches) on the emulator, against the interpreter."""
    graph, args = gradient_case(row, dtype)
    for got, expected in zip(_emulated(graph, args), interpret(graph, args)):
        assert_close(got, np.asarray(expected), tolerance(dtype, 8.0))


# --- the caching allocator (our bookkeeping, on a fake malloc/free) -----------------------------


class FakeDevice:
    """Records the allocator's malloc/free calls; fails the mallocs numbered in `fail`."""

    def __init__(self, fail=()):
        self.next, self.calls, self.fail, self.live = 0x1000, [], set(fail), set()

    def malloc(self, n):
        self.calls.append(("malloc", n))
        if len([c for c in self.calls if c[0] == "malloc"]) in self.fail:
            raise driver.GpuRuntimeError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_OUT_OF_MEMORY")
        self.next += 1 << 24
        self.live.add(self.next)
        return self.next

    def free(self, address):
        self.calls.append(("free", address))
        self.live.remove(address)


def test_size_classes():
    assert [runtime.size_class(n) for n in (1, 512, 513, 1000, 4096, 4097, 1 << 20)] == [
        512, 512, 1024, 1024, 4096, 8192, 1 << 20,
    ]  # fmt: skip
    assert runtime.size_class((1 << 20) + 1) == 2 << 20 and runtime.size_class((5 << 20) + 7) == 6 << 20


def test_allocator_reuses_blocks_of_a_class_and_frees_everything_on_teardown():
    device = FakeDevice()
    alloc = runtime.CachingAllocator(device.malloc, device.free)
    a, b = alloc.allocate(1000), alloc.allocate(600)  # both 1 KiB blocks
    assert a != b and alloc.driver_allocations == 2 and alloc.bytes_in_use == 2048
    assert alloc.allocate(0) == 0
    alloc.release(a)
    assert alloc.bytes_cached == 1024 and alloc.allocate(1024) == a  # same class: the cached block
    assert alloc.driver_allocations == 2
    c = alloc.allocate(5000)  # another class: a new block
    assert alloc.driver_allocations == 3 and c not in (a, b)
    alloc.release(c)
    with pytest.raises(driver.GpuRuntimeError, match="released but not allocated"):
        alloc.release(c)
    alloc.free_all()
    assert device.live == set() and alloc.bytes_in_use == 0 and alloc.bytes_cached == 0


def test_allocator_frees_its_cache_and_retries_once_when_the_device_is_full():
    device = FakeDevice(fail={3})
    alloc = runtime.CachingAllocator(device.malloc, device.free)
    a = alloc.allocate(4096)
    alloc.allocate(512)
    alloc.release(a)
    c = alloc.allocate(1 << 20)  # the 3rd malloc fails: the cached 4 KiB block is freed, then it succeeds
    assert ("free", a) in device.calls and device.calls[-1] == ("malloc", 1 << 20) and c in device.live
    device.fail = {5, 6}
    with pytest.raises(driver.GpuRuntimeError, match="OUT_OF_MEMORY"):
        alloc.allocate(8 << 20)


def test_a_call_that_cannot_allocate_all_its_buffers_keeps_none():
    device = FakeDevice(fail={2, 3})  # the second buffer fails, and again after the cache is freed
    runner = object.__new__(runtime.PlanRunner)
    runner.plan = compiled("elementwise").plan
    runner.ctx = types.SimpleNamespace(allocator=runtime.CachingAllocator(device.malloc, device.free))
    with pytest.raises(driver.GpuRuntimeError, match="OUT_OF_MEMORY"):
        runner._allocate({0: 0xD0})  # buffer 0 is given (a device-resident input): not ours to release
    assert runner.ctx.allocator.bytes_in_use == 0 and runner.ctx.allocator.bytes_cached == 16384


def test_cubins_are_used_only_where_they_run():
    assert runtime._cubin_runs_on("sm_80", "sm_86") and runtime._cubin_runs_on("sm_90", "sm_90")
    assert not runtime._cubin_runs_on("sm_86", "sm_80") and not runtime._cubin_runs_on("sm_80", "sm_90")
    with pytest.raises(driver.GpuRuntimeError, match="compiled for sm_90, but the device is sm_80"):
        runtime._check_ptx_target(".version 8.0\n.target sm_90\n", "k", "sm_80")


def test_timeout_must_be_positive(monkeypatch):
    monkeypatch.setenv("FLOWJIT_GPU_TIMEOUT_S", "0")
    with pytest.raises(driver.GpuRuntimeError, match="FLOWJIT_GPU_TIMEOUT_S"):
        runtime.timeout_s()
    monkeypatch.setenv("FLOWJIT_GPU_TIMEOUT_S", "2.5")
    assert runtime.timeout_s() == 2.5


# --- no package, no driver, no device: the exact reason -----------------------------------------


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
    )


def test_import_flowjit_does_not_import_cuda_bindings():
    done = _python("import sys, flowjit\nassert 'cuda' not in sys.modules and 'cuda.bindings' not in sys.modules\n")
    assert done.returncode == 0, done.stderr


def test_without_cuda_bindings_the_reason_names_the_package():
    done = _python(
        """
        import sys
        sys.modules["cuda"] = None  # as if cuda-bindings were not installed
        import flowjit as fj
        from flowjit.backends.gpu import driver
        print(driver.unavailable_reason())
        print(len(fj.devices("gpu")))
        """
    )
    assert done.returncode == 0, done.stderr
    reason, gpus = done.stdout.strip().splitlines()
    assert reason.startswith("running on a GPU needs the package cuda-bindings") and gpus == "0"


@pytest.mark.skipif(NO_GPU is None, reason="a CUDA device is present")
def test_without_a_gpu_running_raises_the_drivers_reason():
    with pytest.raises(driver.GpuRuntimeError, match=r"cannot run 'chain' on GPU 0: ") as info:
        fj.jit(chain, target="cuda")(_X, _X)
    assert NO_GPU.rstrip(".") in str(info.value)
    assert fj.devices("gpu") == []
    if driver._bindings() is not None and not isinstance(driver._bindings(), driver.GpuRuntimeError):
        # cuda-bindings is installed here: cuInit is what fails (it raises: no libcuda.so)
        assert "cuInit failed" in NO_GPU


# --- the disk cache: compile here, run there -----------------------------------------------------


def test_cache_key_names_the_gpu_arch_and_cpu_target():
    assert json.loads(cache.fingerprint("sm_90"))["gpu-arch"] == "sm_90"
    assert json.loads(cache.fingerprint("sm_90"))["cpu-target"] == "any"
    keys = {cache.cache_key("graph", GpuOptions(chip=chip)) for chip in ("sm_80", "sm_90")}
    assert len(keys) == 2


def test_entry_round_trips_and_a_damaged_one_is_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    fn, args = PROGRAMS["fused softmax"]
    graph = fj.jit(fn).lower(*args).graph("optimized")
    entry = gpu_backend.compile_entry(graph, GpuOptions(chip="sm_90"))
    assert cache.decode(cache.encode(entry)) == entry
    cache.store("k", entry)
    assert cache.load("k") == entry
    monkeypatch.setattr(cache, "mlir_version", lambda: "another-mlir-1.0")
    assert cache.load("k") is None  # made by another MLIR than the one installed: compiled again
    path = cache.entry_path("k")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-5])
    monkeypatch.setattr(cache, "mlir_version", lambda: entry.toolchain["mlir"])
    assert cache.load("k") is None and not os.path.exists(path)


def test_a_cached_program_runs_without_importing_mlir(tmp_path):
    """Compile in one process; a second process in which `import mlir` fails gets the executable
    from the cache and goes as far as the driver (here: the clear error; on a GPU: the result)."""
    program = """
        import sys, numpy as np, flowjit as fj, flowjit.numpy as fnp
        {block}
        def chain(x, y):
            return fnp.tanh(x * y + 1.0) * fnp.exp(-x) + fnp.log(y * y + 1.0)
        x = np.linspace(-2, 2, 3300, dtype=np.float32).reshape(33, 100)
        lowered = fj.jit(chain, target="cuda-sm_90").lower(x, x)
        print(lowered.as_text("launch-plan").splitlines()[-1])
        try:
            out = lowered.compile()(x, x)
            print("ran", float(np.abs(out - np.asarray(chain(x, x))).max()))
        except fj.FlowjitError as e:
            print(type(e).__name__, e)
        print("mlir imported:", sys.modules.get("mlir") is not None)
    """
    block = "sys.modules['mlir'] = None  # any `import mlir` fails"
    env = {"FLOWJIT_CACHE_DIR": str(tmp_path)}
    first = _python(program.format(block=""), env)
    assert first.returncode == 0, first.stderr
    assert "from: compiled" in first.stdout
    second = _python(program.format(block=block), env)
    assert second.returncode == 0, second.stderr
    lines = second.stdout.strip().splitlines()
    assert lines[0] == "from: disk cache" and lines[-1] == "mlir imported: False"
    if NO_GPU is None:
        assert lines[1].startswith("ran ")
    else:
        assert re.match(r"GpuRuntimeError <string>:10: cannot run 'chain' on GPU 0", lines[1])  # the call's line


# --- devices ------------------------------------------------------------------------------------


def test_device_chip_follows_the_compute_capability(monkeypatch):
    for capability, chip in (((9, 0), "sm_90"), ((8, 6), "sm_86"), ((8, 7), "sm_86"), ((12, 0), "sm_90")):
        monkeypatch.setattr(driver, "compute_capability", lambda ordinal, c=capability: c)
        assert gpu_backend.device_chip(0) == chip
    monkeypatch.setattr(driver, "compute_capability", lambda ordinal: (7, 5))
    assert gpu_backend.device_chip(0) is None


def test_unconstrained_ops_join_gpu_work_when_that_saves_a_transfer(monkeypatch):
    """With a GPU listed, the cost model may give it unconstrained ops (tests/test_gpu_placement.py
    has the rules): here exp and add join the mul placed there, since the argument is copied in
    with the GPU call and the result back, where a split would add a transfer each way."""
    monkeypatch.setattr(driver, "local_gpu_count", lambda: 1)
    assert [d.name for d in fj.devices()][-1] == "/job:localhost/task:0/device:gpu:0"

    def f(x):
        y = fnp.exp(x)
        with fj.device("gpu:0"):
            z = y * 2.0
        return z + 1.0

    placement = fj.jit(f).lower(np.ones(8, np.float32)).as_text("placement")
    placed = dict(re.findall(r"^//\s+%\d+ (exp|mul|add)\s+(\S+)", placement, re.MULTILINE))
    assert placed == {"exp": "gpu:0", "mul": "gpu:0", "add": "gpu:0"}, placement
    assert "transfers: 0" in placement
    with_target = fj.jit(f, target="interpreter").lower(np.ones(8, np.float32)).as_text("placement")
    placed = dict(re.findall(r"^//\s+%\d+ (exp|mul|add)\s+(\S+)", with_target, re.MULTILINE))
    assert placed["mul"] == "gpu:0" and "cpu:0" in placed.values()  # a target keeps unconstrained ops on CPUs


# --- on a GPU -----------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_programs_match_numpy_on_the_gpu(name):
    fn, args = PROGRAMS[name]
    expected = fj.jit(fn, target="cpu")(*args)
    got = fj.jit(fn, target="cuda")(*args)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


# --- the runtime against a fake driver (tests/fake_cuda: no GPU, no kernel runs) -----------------
# What this checks is ours: that cuda-bindings accepts every argument the runtime passes, and the
# calls it makes: allocations from the caching allocator, copies of the right bytes to the right
# buffers, every launch of the plan with its grid, block and parameters, the bounded wait, the
# teardown. It says nothing about the kernels' results or the real driver's behaviour.


@pytest.fixture(scope="module")
def fake_driver(fake_libcuda):
    if not HAS_BINDINGS:
        pytest.skip("cuda-bindings is not installed (the extra flowjit[gpu]): nothing would call the fake driver")
    return fake_libcuda


def _with_fake_driver(folder, code: str, tmp_path, **env) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    log = tmp_path / "driver.log"
    done = _python(
        code,
        {
            "LD_LIBRARY_PATH": str(folder),
            "FAKE_CUDA_LOG": str(log),
            "FLOWJIT_CACHE_DIR": str(tmp_path / "cache"),
            **env,
        },
    )
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


_COLUMN_SUM = """
    import json, sys, numpy as np, flowjit as fj, flowjit.numpy as fnp
    from flowjit.backends.gpu import cubin
    {patch}
    def column_sum(x):
        return fnp.sum(x, axis=0)
    x = np.arange(300 * 35, dtype=np.float32).reshape(300, 5, 7)
    lowered = fj.jit(column_sum, device="gpu:0").lower(x)
    compiled = lowered.compile()
    result = {{"devices": [d.name for d in fj.devices()], "ptx": lowered.as_text("ptx")}}
    try:
        for _ in range(2):
            out = compiled(x)
        result["out"] = [list(out.shape), str(out.dtype)]
    except fj.FlowjitError as e:
        result["error"] = str(e)
        try:
            compiled(x)
        except fj.FlowjitError as again:
            result["again"] = str(again)
    executable = lowered._executable
    result["plan"] = executable.plan.to_json()
    result["loading"] = lowered.as_text("launch-plan").splitlines()[-2:]
    print(json.dumps(result))
"""
_NO_PTXAS = "cubin.find_ptxas = lambda: None  # PTX only: the fake driver logs the parameters of PTX kernels"


def test_runtime_calls_on_a_fake_driver(fake_driver, tmp_path):
    dumps = tmp_path / "dump"
    done, calls = _with_fake_driver(
        fake_driver, _COLUMN_SUM.format(patch=_NO_PTXAS), tmp_path, FLOWJIT_DUMP_DIR=str(dumps)
    )
    assert done.returncode == 0, done.stderr
    last_plan = sorted(dumps.glob("*-launch-plan.*"))[-1].read_text()
    assert "loaded fj_column_sum_kernel: PTX through the driver's JIT (no cubin" in last_plan
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.get("error") is None and result["out"] == [[5, 7], "float32"]
    assert result["devices"][-1] == "/job:localhost/task:0/device:gpu:0"
    assert ".target sm_90" in result["ptx"]  # the fake device's compute capability is 9.0
    assert all("PTX through the driver's JIT" in line for line in result["loading"])
    p = LaunchPlan.from_json(result["plan"])
    names = [c[0] for c in calls]
    assert names.count("cuInit") == 1 and names.count("cuDevicePrimaryCtxRetain") == 1

    # one allocation per buffer, of its size class, on the first call only (the second reuses them)
    mallocs = [c for c in calls if c[0] == "cuMemAlloc"]
    assert [int(c[1]) for c in mallocs] == [runtime.size_class(b.nbytes) for b in p.buffers if b.nbytes]
    allocated = iter(int(c[2]) for c in mallocs)
    address = [next(allocated) if b.nbytes else 0 for b in p.buffers]  # no memory for an empty buffer
    x = np.arange(300 * 35, dtype=np.float32)
    copies_in = [c[2:] for c in calls if c[0] == "cuMemcpyHtoDAsync"]
    assert copies_in == [[str(x.nbytes), str(int(x.view(np.uint8).sum()))]] * 2
    assert [c[1] for c in calls if c[0] == "cuMemcpyHtoDAsync"][0] == str(address[0])

    # every launch of the plan, in order, with its grid, block and parameters
    expected = []
    for launch, loops in p.launches():
        params = []
        for arg in launch.args:
            if isinstance(arg, MemrefArg):
                base = address[arg.buffer]
                params += [base, base, arg.offset.at(loops), *arg.sizes, *arg.strides]
            else:
                params.append(arg.value.at(loops))
        expected.append([launch.function, *map(str, (*launch.grid, *launch.block, 0, *params))])
    launches = [c[1:] for c in calls if c[0] == "cuLaunchKernel"]
    n = len(expected)
    assert n == p.launch_count() and launches[:n] == expected
    # the second call: the same launches on the cached blocks, which may come back in another order
    # within a size class, consistently for every launch
    size_of = {str(a): runtime.size_class(b.nbytes) for a, b in zip(address, p.buffers) if b.nbytes}
    moved = {}
    for first, second in zip(launches[:n], launches[n:]):
        for a, b in zip(first, second):
            if a in size_of:
                assert moved.setdefault(a, b) == b and size_of[a] == size_of.get(b)
            else:
                assert a == b
    assert len(launches) == 2 * n and len(set(moved.values())) == len(moved)
    copies_out = [c[1:] for c in calls if c[0] == "cuMemcpyDtoHAsync"]
    assert copies_out == [[str(address[1]), str(35 * 4)], [moved[str(address[1])], str(35 * 4)]]
    assert names.count("cuEventRecord") == 2

    # teardown at exit: every block freed once, the modules unloaded, the context released last
    assert sorted(int(c[1]) for c in calls if c[0] == "cuMemFree") == sorted(a for a in address if a)
    assert names.count("cuModuleUnload") == names.count("cuModuleLoadDataEx") == len(p.kernels())
    assert names.count("cuStreamDestroy") == 1 and names.count("cuMemFreeHost") == 1
    assert names[-1] == "cuDevicePrimaryCtxRelease"


def test_executables_compute_through_the_whole_runtime_on_the_fake_driver(fake_driver, tmp_path):
    """GpuExecutable.run end to end: the fake driver hands each launch to the CPU emulation of its
    kernel (tests/gpu_emulator.py), so inputs copied in through the pinned block, every launch,
    and outputs copied out give the real results (twice: the second call on cached blocks)."""
    code = """
        import ctypes, json, sys, numpy as np, flowjit as fj, flowjit.numpy as fnp
        sys.path.insert(0, "tests")
        import gpu_emulator
        from flowjit.backends.gpu import cubin
        cubin.find_ptxas = lambda: None  # PTX only: the hook finds each kernel by its PTX

        def chain_and_total(x, y):
            return fnp.tanh(x * y + 1.0) * fnp.exp(-x) + fnp.log(y * y + 1.0), fnp.sum(y), x > y

        def softmax(x):
            e = fnp.exp(x - fnp.max(x, axis=1, keepdims=True))
            return e / fnp.sum(e, axis=1, keepdims=True)

        def column_sum(x):
            return fnp.sum(x, axis=0)

        def half(x):
            return fnp.exp(x) * x

        rng = np.random.default_rng(0)
        x = rng.standard_normal((33, 100)).astype(np.float32)
        cases = [
            (chain_and_total, (x, np.abs(x) + 1.0)),
            (softmax, (x,)),
            (column_sum, (rng.standard_normal((300, 5, 7)).astype(np.float32),)),
            (half, (x.astype(np.float16),)),
        ]
        compiled = [fj.jit(fn, target="cuda-sm_90").lower(*args) for fn, args in cases]
        executables = [c.compile() and c._executable for c in compiled]
        hook = gpu_emulator.run_launches_of(ctypes.CDLL("libcuda.so.1"), executables)
        errors = []
        for (fn, args), lowered in zip(cases, compiled):
            expected = fj.jit(fn, target="cpu")(*args)
            expected = expected if isinstance(expected, tuple) else (expected,)
            for _ in range(2):
                got = lowered.compile()(*args)
                got = got if isinstance(got, tuple) else (got,)
                for g, e in zip(got, expected):
                    assert g.dtype == e.dtype and g.shape == e.shape, (fn.__name__, g.dtype, e.dtype)
                    scale = 1.0 + float(np.max(np.abs(e.astype(np.float64)), initial=0))  # relative to the largest
                    errors.append([fn.__name__, float(np.max(np.abs(g.astype(np.float64) - e), initial=0)) / scale])
        print(json.dumps(errors))
    """
    done, calls = _with_fake_driver(fake_driver, code, tmp_path)
    assert done.returncode == 0, done.stderr
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert [name for name, _ in errors] == ["chain_and_total"] * 6 + ["softmax"] * 2 + ["column_sum"] * 2 + ["half"] * 2
    for name, error in errors:
        assert error <= (2e-3 if name == "half" else 1e-4), (name, error)
    assert [c[0] for c in calls].count("cuLaunchKernel") >= 2 * 6  # each program's launches, twice


def test_a_call_that_does_not_finish_times_out_and_the_executable_refuses_later_calls(fake_driver, tmp_path):
    done, calls = _with_fake_driver(
        fake_driver,
        _COLUMN_SUM.format(patch=_NO_PTXAS),
        tmp_path,
        FAKE_CUDA_EVENT_NEVER_READY="1",
        FLOWJIT_GPU_TIMEOUT_S="0.3",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "the GPU did not finish 'column_sum' on sm_90 device 0 within 0.3 s" in result["error"]
    assert result["again"].startswith("an earlier call of 'column_sum' on the GPU failed")
    names = [c[0] for c in calls]
    first_call = compiled("temporary and kept loop").plan.launch_count()
    assert names.count("cuLaunchKernel") == first_call  # the second call launched nothing
    # the blocks the unfinished call used were not handed out again, only freed at teardown
    assert names.count("cuMemFree") == names.count("cuMemAlloc")


def test_a_driver_without_devices_is_the_reason(fake_driver, tmp_path):
    code = """
        import numpy as np, flowjit as fj, flowjit.numpy as fnp
        print(len(fj.devices("gpu")))
        try:
            fj.jit(lambda x: fnp.exp(x), target="cuda")(np.ones(4, np.float32))
        except fj.FlowjitError as e:
            print(e)
    """
    done, calls = _with_fake_driver(fake_driver, code, tmp_path, FAKE_CUDA_NO_DEVICE="1")
    assert done.returncode == 0, done.stderr
    gpus, error = done.stdout.strip().splitlines()
    assert gpus == "0" and "on GPU 0: no CUDA device: the driver reports 0 devices" in error
    assert [c[0] for c in calls] == ["cuInit"]


def test_a_failing_driver_call_names_the_call_and_the_error(fake_driver, tmp_path):
    done, calls = _with_fake_driver(
        fake_driver, _COLUMN_SUM.format(patch=_NO_PTXAS), tmp_path, FAKE_CUDA_FAIL_MODULE_LOAD="1"
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] == "cuModuleLoadDataEx failed: CUDA_ERROR_FAKE: an error of the fake driver"
    assert ["cuModuleLoadDataEx", "refused"] in calls


@pytest.mark.skipif(cubin.find_ptxas() is None, reason="ptxas not found: no cubins are made")
def test_cubins_are_loaded_where_they_fit(fake_driver, tmp_path):
    done, calls = _with_fake_driver(fake_driver, _COLUMN_SUM.format(patch=""), tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.get("error") is None
    assert all(line.endswith(": cubin sm_90") for line in result["loading"])
    kernels = len(compiled("temporary and kept loop", "sm_90").kernels)
    assert [c[1] for c in calls if c[0] == "cuModuleLoadDataEx"] == ["cubin"] * kernels


# --- the device check script (benchmarks/gpu/device_check.py) ------------------------------------

DEVICE_CHECK = os.path.join(ROOT, "benchmarks", "gpu", "device_check.py")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepared")
    done = subprocess.run(
        [sys.executable, DEVICE_CHECK, "prepare", "--out", str(folder), "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return folder


def test_prepare_compiles_the_tiny_set_into_a_small_folder(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    status = {p["name"]: p["status"] for p in manifest["programs"]}
    assert status == {
        "chain": "compiled",
        "whole_sum": "compiled",
        "mlp_forward": "compiled",
        "mlp_xent_step": "compiled",
        "matmul_bf16": "compiled",
        "conv_layer": "compiled",
        "cpu_gpu_split": "compiled",
        "newton_sqrt": "not compiled",
    }
    (loop,) = [p for p in manifest["programs"] if p["name"] == "newton_sqrt"]
    assert "while" in loop["error"]
    assert manifest["chip"] == "sm_90"
    # the sampled programs' inputs are made there: no data file, their tolerance and flop count
    sampled = {p["name"]: p for p in manifest["programs"] if p.get("check") == "sampled"}
    assert set(sampled) == {"matmul_bf16", "conv_layer"} and not any("data" in p for p in sampled.values())
    assert sampled["matmul_bf16"]["flop"] == 2 * 16 * 24 * 8 and sampled["matmul_bf16"]["rtol"] == 8e-3
    assert sorted(f.name for f in (prepared / "data").iterdir()) == [
        f"{name}.npz" for name in ("chain", "cpu_gpu_split", "mlp_forward", "mlp_xent_step", "whole_sum")
    ]
    size = sum(f.stat().st_size for f in prepared.rglob("*") if f.is_file())
    # one entry per GPU program, and one for the split's GPU partition (one stage: it receives the
    # scaled input, computes, sends the layer back); its CPU partitions run on the interpreter
    assert len(list((prepared / "cache").glob("*.fjg"))) == 7 and size < 1 << 20


def test_a_sampled_program_is_checked_on_a_sample_of_its_result_against_float64():
    """The check of the programs whose inputs are made on the GPU machine (device_check.Sampled), at
    the tiny sizes: the CPU backend's result matches the float64 reference of its sample; the same
    result with one sampled element off by twice the tolerance does not."""
    code = """
        import json, sys
        import numpy as np
        import flowjit as fj
        sys.path.insert(0, "benchmarks/gpu")
        import device_check as dc
        from peers import compare

        results = {}
        for program in dc.PROGRAMS:
            if program.sampled is None:
                continue
            inputs = dc._inputs(program, tiny=True)
            check = program.sampled
            p = {"expected": check.reference(inputs), "sample": check.sample, "rtol": check.rtol, "atol": check.atol}
            exact = np.asarray(fj.jit(program.fn, target="cpu")(*inputs))
            off = exact.astype(np.float32)
            index = (0,) * off.ndim if program.name.startswith("matmul") else (-1,) + (0,) * (off.ndim - 1)
            off[index] += 2 * (check.atol + check.rtol * abs(float(off[index])))
            results[program.name] = [
                [list(e.shape) for e in p["expected"]],
                compare([exact], p)["matches"],
                compare([off.astype(exact.dtype)], p)["matches"],
            ]
        print(json.dumps(results))
    """
    done = _python(code)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {
        "matmul_f32": [[[16, 8]], True, False],
        "matmul_bf16": [[[16, 8]], True, False],
        "conv_layer": [[[2, 4, 6, 6]], True, False],  # its first and last image
    }


def test_run_loads_from_the_cache_without_mlir_up_to_the_device(prepared, tmp_path):
    done = subprocess.run(
        [sys.executable, DEVICE_CHECK, "run", "--dir", str(prepared), "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    # without a GPU the split cannot be placed (no gpu:0): it is listed as not loaded, with the reason
    loaded = 6 if NO_GPU is not None else 7
    assert f"loaded {loaded} of 8 programs" in done.stdout and "(mlir imported: False)" in done.stdout, done.stderr
    if NO_GPU is not None:
        assert done.returncode == 2
        assert re.search(r"GpuRuntimeError: \S+device_check.py:\d+: cannot run 'chain' on GPU 0: ", done.stdout)
    else:
        assert done.returncode == 0, done.stdout


def _device_check_run(prepared, fake_driver, tmp_path, *options):
    """`device_check.py run` on the fake driver (which runs no kernel, so flowjit's results cannot
    match: exit status 1); returns the finished process and its JSON report."""
    results = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, DEVICE_CHECK, "run", "--dir", str(prepared), "--json", str(results), *options],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LD_LIBRARY_PATH": str(fake_driver)},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    return done, json.loads(results.read_text())


def test_run_on_the_fake_driver_goes_through_every_program(prepared, fake_driver, tmp_path):
    """The whole run path (no kernel runs, so the results cannot match: 'mismatch' is expected)."""
    done, report = _device_check_run(prepared, fake_driver, tmp_path, "--repeat", "2")
    assert report["device"]["name"] == "fake CUDA driver (no GPU)" and report["device"]["capability"] == "9.0"
    assert report["mlir_imported"] is False
    programs = {p["name"]: p for p in report["programs"]}
    assert programs["newton_sqrt"]["status"] == "not compiled"
    for name in ("chain", "whole_sum", "mlp_forward", "mlp_xent_step", "matmul_bf16", "conv_layer"):
        assert programs[name]["status"] == "mismatch" and programs[name]["flowjit_ms"] > 0
        assert len(programs[name]["loaded"]) == 1
    for name in ("matmul_bf16", "conv_layer"):  # their TFLOP/s, in the JSON and under the program
        assert programs[name]["tflop_per_s"]["flowjit"] == programs[name]["flop"] / (
            programs[name]["flowjit_device_ms"] * 1e9
        )
    assert done.stdout.count("    TFLOP/s on device: flowjit ") == 2
    split = programs["cpu_gpu_split"]  # placed over cpu:0 and the fake gpu:0, the GPU part from the cache
    assert split["kind"] == "split" and split["status"] == "mismatch" and split["flowjit_ms"] > 0
    assert split["backends"].startswith("2 partitions on cpu:0, gpu:0, each cuda (MLIR -> NVVM -> PTX, sm_90;")
    assert split["backends"].endswith("send/recv on the host around 1 GPU call(s) / interpreter"), split
    assert "peers" not in split
    assert "program" in done.stdout and "newton_sqrt" in done.stdout


def test_run_times_each_program_and_its_peers_in_a_process_of_its_own(prepared, fake_driver, tmp_path):
    """`run --peer-device cpu` goes through every peer's code without a GPU: PyTorch eager,
    torch.compile (which needs a C++ compiler on the CPU) and JAX each time their twin of the
    program and check it against the expected outputs (a sample of them, for the sampled programs,
    whose inputs are made here: bfloat16 ones for matmul_bf16). The fake driver runs no kernel, so
    flowjit's results cannot match ('mismatch'); the peers' must."""
    names = ("chain", "mlp_forward", "mlp_xent_step", "matmul_bf16", "conv_layer")
    options = ("--repeat", "2", "--only", ",".join(names), "--peer-device", "cpu")
    done, report = _device_check_run(prepared, fake_driver, tmp_path, *options)
    assert report["mlir_imported"] is False and report["options"]["peer_device"] == "cpu"
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == set(names)
    assert len({p["pid"] for p in programs.values()} - {os.getpid()}) == len(names)  # a process each
    can_compile = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    for name, p in programs.items():
        assert p["status"] == "mismatch" and p["flowjit_ms"] > 0 and p["flowjit_device_ms"] > 0
        assert list(p["peers"]) == ["torch", "torch.compile", "jax"]
        for peer, record in p["peers"].items():
            module = peer.split(".")[0]
            if importlib.util.find_spec(module) is None or (peer == "torch.compile" and not can_compile):
                assert record["error"], record  # the reason is recorded; the other peers still ran
                continue
            assert "error" not in record, f"{name}, {peer}: {record['error']}"
            # a bfloat16 product is rounded to bfloat16: to within 2**-8 of its value
            assert record["matches"] and record["max_abs_error"] < (0.1 if name == "matmul_bf16" else 1e-4)
            assert record["on_device_ms"] > 0
            assert record.get("end_to_end_ms", 1.0) > 0 and record.get("compile_ms", 1.0) > 0
        on_device = {peer: r["on_device_ms"] for peer, r in p["peers"].items() if r.get("matches")}
        if on_device:
            fastest = min(on_device, key=on_device.get)
            versus = p["versus_fastest_peer"]["on_device"]
            assert versus == {"fastest_peer": fastest, "ratio": p["flowjit_device_ms"] / on_device[fastest]}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "fake CUDA driver (no GPU)" in markdown and "--only chain,mlp_forward," in markdown
    assert re.search(r"^\| chain \| mismatch \| [0-9.e+-]+ \| [0-9.]+ \|", markdown, re.MULTILINE), markdown
