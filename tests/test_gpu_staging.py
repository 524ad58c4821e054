"""Host<->GPU Send/Recv (backends/gpu/staging.py): a GPU partition's recvs become inputs of its GPU
calls and its sends outputs, with the rendezvous done on the host around each call, in stages
where a recv waits (through other partitions) for one of the partition's own sends.

Without a driver: which sends each recv waits for (`passes.partition.awaited_sends`), the stages,
and whole steps with the stages' graphs run by the interpreter in place of the GPU. On the fake
driver (tests/fake_cuda) with every launch emulated on the CPU (tests/gpu_emulator.py): cpu:0+gpu:0
programs through the executor, the rendezvous, the GPU runtime's copies and launches, against the
CPU-only run. Nothing here ran on a real GPU.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flowjit.backends.gpu import staging
from flowjit.backends.registry import get_backend
from flowjit.ir.parser import parse_graph
from flowjit.passes.partition import awaited_sends, split_partitions
from flowjit.runtime import executor
from flowjit.runtime.rendezvous import Rendezvous, TransferError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU0 = "/job:localhost/task:0/device:cpu:0"
GPU0 = "/job:localhost/task:0/device:gpu:0"


def _partitioned(body: str, results: str) -> str:
    """A partitioned graph in text: `@C`/`@G` name the devices, and each send/recv gets its ends."""
    lines = []
    for n, line in enumerate(textwrap.dedent(body).strip().splitlines()):
        on_cpu = line.endswith("@C")
        if line.startswith("send ") or "= recv " in line:
            sending = on_cpu == line.startswith("send ")
            ends = 'src = "cpu:0", dst = "gpu:0"' if sending else 'src = "gpu:0", dst = "cpu:0"'
            line = line.replace('key = "', f'{ends}, key = "')
        line = line.replace("@C", f'device("{CPU0}")').replace("@G", f'device("{GPU0}")')
        lines.append(f'  {line} loc("m.py":{n + 1})')
    lines = "\n".join(lines)
    return f"func @f(%x: tensor<4xf32>) -> ({results}) {{\n{lines}\n  return {{RESULTS}}\n}}\n"


# gpu:0 computes y = exp(tanh(x)) and sends it; cpu:0 sends back sin(y); gpu:0 returns sin(y) * y.
# The second recv on gpu:0 waits for its own send: two stages.
ROUND_TRIP = _partitioned(
    """
    %0 = tanh %x : tensor<4xf32> @C
    send %0 {key = "k1"} : () @C
    %1 = recv {dtype = f32, key = "k1", shape = [4]} : tensor<4xf32> @G
    %2 = exp %1 : tensor<4xf32> @G
    send %2 {key = "k2"} : () @G
    %3 = recv {dtype = f32, key = "k2", shape = [4]} : tensor<4xf32> @C
    %4 = sin %3 : tensor<4xf32> @C
    send %4 {key = "k3"} : () @C
    %5 = recv {dtype = f32, key = "k3", shape = [4]} : tensor<4xf32> @G
    %6 = mul %5, %2 : tensor<4xf32> @G
    send_done %0, %4 : () @C
    send_done %2 : () @G
    """,
    "tensor<4xf32>",
).replace("{RESULTS}", "%6 : tensor<4xf32>")

# cpu:0 sends cos(x) only after receiving y (program order), though cos(x) does not read y: gpu:0's
# recv of k3 waits for its send of k2 all the same.
PROGRAM_ORDER = _partitioned(
    """
    %0 = tanh %x : tensor<4xf32> @C
    send %0 {key = "k1"} : () @C
    %1 = recv {dtype = f32, key = "k1", shape = [4]} : tensor<4xf32> @G
    %2 = exp %1 : tensor<4xf32> @G
    send %2 {key = "k2"} : () @G
    %3 = recv {dtype = f32, key = "k2", shape = [4]} : tensor<4xf32> @C
    %4 = sin %3 : tensor<4xf32> @C
    %5 = cos %x : tensor<4xf32> @C
    send %5 {key = "k3"} : () @C
    %6 = recv {dtype = f32, key = "k3", shape = [4]} : tensor<4xf32> @G
    %7 = mul %6, %6 : tensor<4xf32> @G
    send_done %0, %5 : () @C
    send_done %2 : () @G
    """,
    "tensor<4xf32>, tensor<4xf32>",
).replace("{RESULTS}", "%4, %7 : tensor<4xf32>, tensor<4xf32>")

X = np.linspace(-1, 1, 4, dtype=np.float32)


def test_a_recv_waits_for_the_sends_that_reach_it_through_other_partitions():
    graph = parse_graph(ROUND_TRIP)
    assert awaited_sends(graph, GPU0) == {"k1": frozenset(), "k3": frozenset({"k2"})}
    assert awaited_sends(graph, CPU0) == {"k2": frozenset({"k1"})}


def test_a_recv_waits_for_sends_before_it_in_another_partitions_program_order():
    assert awaited_sends(parse_graph(PROGRAM_ORDER), GPU0) == {"k1": frozenset(), "k3": frozenset({"k2"})}


def test_independent_recvs_share_a_stage():
    graph = parse_graph(
        _partitioned(
            """
            %0 = tanh %x : tensor<4xf32> @C
            send %0 {key = "k1"} : () @C
            %1 = exp %x : tensor<4xf32> @G
            send %1 {key = "k2"} : () @G
            %2 = recv {dtype = f32, key = "k1", shape = [4]} : tensor<4xf32> @G
            %3 = recv {dtype = f32, key = "k2", shape = [4]} : tensor<4xf32> @C
            %4 = mul %2, %1 : tensor<4xf32> @G
            send_done %0 : () @C
            send_done %1 : () @G
            """,
            "tensor<4xf32>, tensor<4xf32>",
        ).replace("{RESULTS}", "%3, %4 : tensor<4xf32>, tensor<4xf32>")
    )
    gpu = split_partitions(graph).partitions[1].graph
    assert gpu.awaited_sends == {"k1": frozenset()}  # k1 is sent before cpu:0 waits for anything
    (stage,) = staging.split_stages(gpu)
    assert [op.attrs["key"] for op in stage.recvs] == ["k1"] and [op.attrs["key"] for op in stage.sends] == ["k2"]
    assert [op.name for op in stage.graph.ops] == ["exp", "mul"] and len(stage.outputs) == 2
    gpu.awaited_sends = None  # split elsewhere: every earlier send is assumed awaited
    assert len(staging.split_stages(gpu)) == 2


def test_stages_of_a_round_trip():
    gpu = split_partitions(parse_graph(ROUND_TRIP)).partitions[1].graph
    first, second = staging.split_stages(gpu)
    assert [op.attrs["key"] for op in first.recvs] == ["k1"] and [op.attrs["key"] for op in first.sends] == ["k2"]
    assert [op.name for op in first.graph.ops] == ["exp"] and first.inputs == [first.recvs[0].result]
    assert [op.attrs["key"] for op in second.recvs] == ["k3"] and second.sends == []
    # exp(tanh(x)) is read again in stage 1: an output of stage 0 and an input of stage 1
    assert second.inputs == [second.recvs[0].result, first.outputs[0]]
    assert [op.name for op in second.graph.ops] == ["mul"] and second.outputs == gpu.results


def _run_split(text: str, awaited=...):
    """One step of a partitioned graph: cpu:0 by the interpreter, gpu:0 as a StagedExecutable whose
    stages the interpreter runs in place of the GPU."""
    plan = split_partitions(parse_graph(text))
    cpu, gpu = (p.graph for p in plan.partitions)
    if awaited is not ...:
        gpu.awaited_sends = awaited
    interpreter = get_backend("interpreter")
    staged = staging.StagedExecutable(gpu, interpreter.compile)

    class Part:
        def __init__(self, device, executable):
            self.device, self.executable = device, executable

        def run(self, args, variables, rendezvous):
            return self.executable.run_step(args, variables, rendezvous)

    parts = [Part("cpu:0", interpreter.compile(cpu)), Part("gpu:0", staged)]
    rendezvous = Rendezvous(timeout_s=60, parties=2, routes=executor.routes(plan))
    outs = executor.run_partitions(parts, [p.inputs for p in plan.partitions], [X], {}, rendezvous)
    return [outs[source[1]][source[2]] for source in plan.result_sources], staged


def test_a_round_trip_through_the_gpu_partition_runs_in_two_stages():
    (result,), staged = _run_split(ROUND_TRIP)
    y = np.exp(np.tanh(X))
    np.testing.assert_allclose(result, np.sin(y) * y, rtol=1e-6)
    assert len(staged.host_stages) == 2 and "stage 1:\n  recv k3 (m.py:9)" in staged.stages["staging"]


def test_program_order_needs_a_second_stage_and_one_stage_would_never_complete():
    (sin_y, cos_sq), _ = _run_split(PROGRAM_ORDER)
    np.testing.assert_allclose(sin_y, np.sin(np.exp(np.tanh(X))), rtol=1e-6)
    np.testing.assert_allclose(cos_sq, np.cos(X) ** 2, rtol=1e-6)
    with pytest.raises(TransferError, match=r"m.py:10: recv 'k3' .* can never complete"):
        _run_split(PROGRAM_ORDER, awaited={})  # k3 received before k2 is sent: what stages avoid


def test_the_routes_between_cpu_and_gpu_are_the_staging_transport():
    routes = executor.routes(split_partitions(parse_graph(ROUND_TRIP)))
    assert {key: t.name for key, t in routes.items()} == dict.fromkeys(
        ("k1", "k2", "k3"), "host copy, then the GPU call's copy to or from the device"
    )


# --- on the fake driver, every launch emulated on the CPU ----------------------------------------


@pytest.fixture(scope="module")
def fake_driver(fake_libcuda):
    from flowjit.backends.gpu import driver

    if isinstance(driver._bindings(), driver.GpuRuntimeError):
        pytest.skip("cuda-bindings is not installed (the extra flowjit[gpu]): nothing would call the fake driver")
    return fake_libcuda


SPLIT_PROGRAMS = """
    import ctypes, json, sys, numpy as np, flowjit as fj, flowjit.numpy as fnp
    sys.path.insert(0, "tests")
    import gpu_emulator
    from flowjit.backends.gpu import cubin
    from flowjit.runtime.executor import PartitionedExecutable
    cubin.find_ptxas = lambda: None  # PTX only: the emulator's hook finds each kernel by its PTX

    def round_trip(x, w):
        with fj.device("cpu:0"):
            h = fnp.tanh(x @ w)
        with fj.device("gpu:0"):
            y = fnp.exp(h) * 2.0
        with fj.device("cpu:0"):
            z = fnp.sin(y) + 1.0
        with fj.device("gpu:0"):
            out = z * y
        return fnp.sum(out, axis=1), y

    def default_placement(a, b, n):
        # unconstrained: the matmuls go to gpu:0; the loop, which the GPU cannot run, stays on cpu:0
        h = fnp.tanh(a @ b) @ b
        with fj.device("gpu:0"):
            k = fj.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 0.5), (0, fnp.sum(h)))[1]
        return h * k

    def loss(w1, w2, x):
        with fj.device("cpu:0"):
            h = fnp.tanh(x @ w1)
        with fj.device("gpu:0"):
            y = h @ w2
        return fnp.sum(y * y) + fnp.sum(h)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w = (rng.standard_normal((16, 16)) * 0.3).astype(np.float32)
    big = (rng.standard_normal((256, 256)) * 0.05).astype(np.float32)
    cases = [
        ("round_trip", round_trip, (x, w)),
        ("default_placement", default_placement, (big, big, np.int32(3))),
        ("gradient", fj.grad(loss, argnums=(0, 1)), (w, w[:, :4].copy(), x)),
    ]
    lowered = [fj.jit(fn).lower(*args) for _, fn, args in cases]
    executables = [lo.compile() and lo._executable for lo in lowered]
    gpu_parts = [[p.executable for p in e.parts if p.device == "gpu:0"] for e in executables]
    calls = [g for parts in gpu_parts for staged in parts for g in staged.executables]
    hook = gpu_emulator.run_launches_of(ctypes.CDLL("libcuda.so.1"), calls)
    report = {}
    for (name, fn, args), lo, executable, parts in zip(cases, lowered, executables, gpu_parts):
        expected = fj.jit(fn, target="cpu")(*args)
        expected = expected if isinstance(expected, tuple) else (expected,)
        errors = []
        for _ in range(2):
            got = lo.compile()(*args)
            got = got if isinstance(got, tuple) else (got,)
            for g, e in zip(got, expected):
                assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, e.dtype, g.shape, e.shape)
                scale = 1.0 + float(np.max(np.abs(e), initial=0))
                errors.append(float(np.max(np.abs(g.astype(np.float64) - e), initial=0)) / scale)
        report[name] = {
            "partitioned": isinstance(executable, PartitionedExecutable),
            "errors": errors,
            "staging": parts[0].stages["staging"] if parts else "",
            "placement": lo.as_text("placement").split("func @")[0],
        }
    print(json.dumps(report))
"""


def _with_fake_driver(folder, code: str, tmp_path, **env):
    log = tmp_path / "driver.log"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": ROOT,
            "LD_LIBRARY_PATH": str(folder),
            "FAKE_CUDA_LOG": str(log),
            "FLOWJIT_CACHE_DIR": str(tmp_path / "cache"),
            **env,
        },
    )
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


def test_cpu_gpu_splits_compute_the_cpu_only_values_on_the_fake_driver(fake_driver, tmp_path):
    done, calls = _with_fake_driver(fake_driver, SPLIT_PROGRAMS, tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, case in report.items():
        assert case["partitioned"], (name, case["placement"])
        assert len(case["errors"]) >= 2 and max(case["errors"]) <= 1e-5, (name, case["errors"])
    assert report["round_trip"]["staging"].count("\n  GPU call ") == 2  # y goes out, sin(y) + 1 comes back
    placement = report["default_placement"]["placement"]
    assert "dot_general" in placement and "soft placement" in placement
    assert all(" gpu:0 " in line for line in placement.splitlines() if "dot_general" in line)
    assert all(" cpu:0 " in line for line in placement.splitlines() if " while " in line)
    names = [c[0] for c in calls]
    assert names.count("cuLaunchKernel") > 0 and names.count("cuMemcpyHtoDAsync") > 0
    assert names.count("cuMemcpyDtoHAsync") > 0 and names[-1] == "cuDevicePrimaryCtxRelease"


VARIABLE_SPLIT = """
    import ctypes, json, sys, numpy as np, flowjit as fj, flowjit.numpy as fnp
    sys.path.insert(0, "tests")
    import gpu_emulator
    from flowjit.backends.gpu import cubin
    cubin.find_ptxas = lambda: None

    def make_step(v):
        def step(x):
            with fj.device("cpu:0"):
                h = fnp.tanh(x)
            with fj.device("gpu:0"):
                v.assign_add(h * 0.5)  # updated in the GPU partition
                y = v.value * 2.0
            with fj.device("cpu:0"):
                return fnp.sum(fnp.sin(y), axis=1)
        return step

    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    on_gpu = fj.Variable(np.ones((4, 8), np.float32), name="v_split")
    on_cpu = fj.Variable(np.ones((4, 8), np.float32), name="v_reference")
    split, reference = fj.jit(make_step(on_gpu)), fj.jit(make_step(on_cpu), target="cpu")
    lowered = split.lower(x)
    lowered.compile()
    calls = [g for p in lowered._executable.parts if p.device == "gpu:0" for g in p.executable.executables]
    hook = gpu_emulator.run_launches_of(ctypes.CDLL("libcuda.so.1"), calls)
    errors = []
    for _ in range(3):
        errors.append(float(np.max(np.abs(split(x) - reference(x)))))
    errors.append(float(np.max(np.abs(on_gpu.numpy() - on_cpu.numpy()))))
    print(json.dumps({"errors": errors, "value": on_gpu.numpy().tolist()}))
"""


def test_a_variable_updated_in_the_gpu_partition_of_a_split_matches_the_cpu(fake_driver, tmp_path):
    done, _ = _with_fake_driver(fake_driver, VARIABLE_SPLIT, tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(report["errors"]) <= 1e-5, report["errors"]
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_allclose(report["value"], 1.0 + 3 * 0.5 * np.tanh(x), rtol=1e-5, atol=1e-6)


FAILING = """
    import numpy as np, flowjit as fj, flowjit.numpy as fnp
    from flowjit.backends.gpu import cubin
    cubin.find_ptxas = lambda: None

    def f(x):
        with fj.device("cpu:0"):
            h = fnp.tanh(x)
        with fj.device("gpu:0"):
            y = fnp.exp(h)
        with fj.device("cpu:0"):
            return fnp.sin(y)  # waits for gpu:0, whose call fails: it must wake, not wait out its timeout

    try:
        fj.jit(f)(np.ones(4, np.float32))
    except fj.FlowjitError as e:
        print(type(e).__name__, e)
        print("notes:", " | ".join(getattr(e, "__notes__", [])))
"""


def test_a_failing_gpu_call_cancels_the_cpu_partition_waiting_for_it(fake_driver, tmp_path):
    done, _ = _with_fake_driver(
        fake_driver, FAILING, tmp_path, FAKE_CUDA_FAIL_MODULE_LOAD="1", FLOWJIT_RECV_TIMEOUT="60"
    )
    assert done.returncode == 0, done.stderr
    error, notes = done.stdout.strip().splitlines()[-2:]
    assert error.startswith("GpuRuntimeError cuModuleLoadDataEx failed: CUDA_ERROR_FAKE")
    assert "partition on cpu:0 stopped" in notes and "cancelled" in notes and "timed out" not in notes


def test_a_gpu_call_that_never_finishes_ends_the_step_within_its_timeout(fake_driver, tmp_path):
    done, _ = _with_fake_driver(
        fake_driver, FAILING, tmp_path, FAKE_CUDA_EVENT_NEVER_READY="1", FLOWJIT_GPU_TIMEOUT_S="0.3"
    )
    assert done.returncode == 0, done.stderr
    error, notes = done.stdout.strip().splitlines()[-2:]
    assert "GpuRuntimeError the GPU did not finish 'f.gpu_0.stage0' on sm_90 device 0 within 0.3 s" in error
    assert "partition on cpu:0 stopped" in notes and "cancelled" in notes


def test_two_gpu_partitions_exchange_values_through_the_host():
    """gpu:0 -> gpu:1 -> gpu:0, both staged (the interpreter stands in for each GPU)."""
    gpu1 = "/job:localhost/task:0/device:gpu:1"
    plan = split_partitions(parse_graph(ROUND_TRIP.replace(CPU0, gpu1).replace('"cpu:0"', '"gpu:1"')))
    interpreter = get_backend("interpreter")
    routes = executor.routes(plan)
    assert {t.name for t in routes.values()} == {"host copy, then the GPU call's copy to or from the device"}

    class Part:
        def __init__(self, device, graph):
            self.device, self.executable = device, staging.StagedExecutable(graph, interpreter.compile)

        def run(self, args, variables, rendezvous):
            return self.executable.run_step(args, variables, rendezvous)

    parts = [Part(p.device, p.graph) for p in plan.partitions]
    rendezvous = Rendezvous(timeout_s=60, parties=2, routes=routes)
    outs = executor.run_partitions(parts, [p.inputs for p in plan.partitions], [X], {}, rendezvous)
    (source,) = plan.result_sources
    y = np.exp(np.tanh(X))
    np.testing.assert_allclose(outs[source[1]][source[2]], np.sin(y) * y, rtol=1e-6)
