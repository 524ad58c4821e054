"""Placement with a GPU among the devices (no driver needed: graphs are placed on explicit device
lists, or `fj.devices()` is told there is one GPU): which ops a GPU may take (the GPU backend's
model, `backends/gpu/placement.py`), soft placement of constrained ops it cannot run, the cost
model's GPU speeds and host<->GPU copies, and the report's reasons."""

import re

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends.gpu import driver
from flowjit.backends.gpu import target as gpu_target
from flowjit.errors import CompileError
from flowjit.ir.graph import Value
from flowjit.ir.types import TensorType
from flowjit.passes import place as place_module
from flowjit.passes.partition import partition, placement_report
from flowjit.passes.place import place

CPU0 = "/job:localhost/task:0/device:cpu:0"
GPU0 = "/job:localhost/task:0/device:gpu:0"
BIG = np.ones((512, 512), np.float32)
SMALL = np.ones(8, np.float32)


def placed(fn, *args, devices=(CPU0, GPU0)):
    """`fn`'s optimized graph placed on `devices` and partitioned (the report's input)."""
    graph = fj.jit(fn).lower(*args).graph("optimized").copy()
    return partition(place(graph, devices))


def device_of(graph, name):
    found = {op.device for op in graph.walk() if op.name == name}
    assert len(found) == 1, (name, found)
    return found.pop()


def reason_of(graph, name):
    (op,) = [op for op in graph.ops if op.name == name]
    return graph.placement[op]


def test_a_loop_constrained_to_the_gpu_runs_on_the_cpu_and_the_report_says_why():
    def f(x):
        with fj.device("gpu:0"):
            return fj.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, fnp.tanh(c[1])), (0, x))[1]

    graph = placed(f, SMALL)
    assert device_of(graph, "while") == CPU0
    reason = reason_of(graph, "while")
    assert re.match(r"soft placement: constraint '/device:gpu:0' \(.*test_gpu_placement.py:\d+\) names a gpu", reason)
    assert "control flow: its predicate or trip count would be read on the host" in reason
    assert reason.endswith("the only device of its task that can run it")
    assert "soft placement" in placement_report(graph)


def test_a_variable_constrained_to_the_gpu_stays_there_with_its_updates():
    # The GPU backend compiles state (variables in device memory, docs/gpu-backend.md).
    v = fj.Variable(np.zeros(8, np.float32), name="gpu_placement.v")

    def f(x):
        with fj.device("gpu:0"):
            v.assign_add(x)
            return v.value * 2.0

    graph = placed(f, SMALL)
    assert device_of(graph, "assign_add") == device_of(graph, "read_variable") == GPU0
    assert "soft placement" not in reason_of(graph, "assign_add")


def test_an_op_the_gpu_cannot_run_goes_to_the_cpu_with_its_reason_the_others_stay(monkeypatch):
    # CPU_ONLY's entries are control flow and send/recv; one for sin stands in for any op
    # the GPU cannot run, and the reason placement reports is CPU_ONLY's own.
    monkeypatch.setitem(gpu_target.CPU_ONLY, "sin", "a reason CPU_ONLY gives for sin")

    def f(x):
        with fj.device("gpu:0"):
            return fnp.sin(x), fnp.exp(x)

    graph = placed(f, SMALL)
    assert device_of(graph, "sin") == CPU0
    assert "a reason CPU_ONLY gives for sin" in reason_of(graph, "sin")
    assert device_of(graph, "exp") == GPU0 and reason_of(graph, "exp").startswith("constraint '/device:gpu:0'")


def test_a_fused_region_goes_to_the_cpu_naming_the_op_inside_it_the_gpu_cannot_run(monkeypatch):
    monkeypatch.setitem(gpu_target.CPU_ONLY, "sin", "a reason CPU_ONLY gives for sin")

    def f(x):
        with fj.device("gpu:0"):
            return fnp.sin(x) * 2.0 + 1.0

    graph = placed(f, SMALL)
    (fusion,) = [op for op in graph.ops if op.name == "fusion"]
    assert fusion.device == CPU0
    assert re.search(r"its op 'sin' \(.*test_gpu_placement.py:\d+\): a reason CPU_ONLY", graph.placement[fusion])


def test_without_a_cpu_an_op_no_device_can_run_is_an_error_naming_its_line():
    def f(x):
        return fj.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]

    with pytest.raises(CompileError, match=r"test_gpu_placement.py:\d+: op 'while': none of the devices") as e:
        placed(f, SMALL, devices=(GPU0,))
    assert "gpu: control flow" in str(e.value)


def test_big_unconstrained_work_goes_to_the_gpu_small_scalar_work_stays_on_the_cpu():
    def f(a, b, s):
        return fnp.tanh(a @ b) @ b, s * 2.0 + 1.0

    graph = placed(f, BIG, BIG, np.float32(3.0))
    assert device_of(graph, "dot_general") == GPU0
    first = graph.ops[0]  # tanh(a @ b): both 1 MiB arguments copied in
    assert re.match(r"cost model: finishes first \(~[\d.]+ us, 2097152 bytes moved in\)", graph.placement[first])
    scalar = [op for op in graph.ops if op.name in ("fusion", "mul", "add") and op.results[0].type.rank == 0]
    assert scalar and {op.device for op in scalar} == {CPU0}
    assert not [op for op in graph.ops if op.name == "send"], "nothing crosses: each part reads only parameters"


def test_small_work_next_to_gpu_work_stays_where_it_avoids_a_transfer():
    def f(a, b):
        with fj.device("gpu:0"):
            y = a @ b
        return fnp.sum(y) * 2.0  # a scalar from GPU data: computed there, one small copy back

    graph = placed(f, BIG, BIG)
    reductions = [op for op in graph.walk() if op.name == "reduce_sum"]
    assert reductions and {op.device for op in reductions} == {GPU0}
    assert not [op for op in graph.ops if op.name == "send"]

    def g(a, s):
        return fnp.sum(a) + s * 3.0  # tiny: the CPU, where the arguments are

    tiny = placed(g, SMALL, np.float32(1.0))
    assert {op.device for op in tiny.ops} == {CPU0}


def test_gpu_costs_launch_speed_and_host_copies():
    matmul = fj.jit(lambda a, b: a @ b).lower(BIG, BIG).graph("optimized").ops[0]
    cpu = place_module.op_cost_us(matmul, "cpu")
    assert cpu == pytest.approx(512**3 / place_module.FLOPS_PER_US)
    assert place_module.op_cost_us(matmul, "gpu") == pytest.approx(5.0 + cpu / 20)
    tanh = fj.jit(fnp.tanh).lower(BIG).graph("optimized").ops[0]
    assert place_module.op_cost_us(tanh, "gpu") == pytest.approx(5.0 + place_module.op_cost_us(tanh) / 50)
    value = Value(TensorType((1000,), "float32"))
    between_cpus = place_module.transfer_us(value, CPU0, "/job:localhost/task:0/device:cpu:1")
    assert between_cpus == pytest.approx(30.0 + 4000 / 4000)  # the rendezvous hand-off and a memmove
    assert place_module.transfer_us(value, CPU0, GPU0) == pytest.approx(between_cpus + 10.0 + 4000 / 20000)
    assert place_module.transfer_us(value, GPU0, CPU0) == place_module.transfer_us(value, CPU0, GPU0)
    gpu1 = "/job:localhost/task:0/device:gpu:1"  # through the host: both device copies
    assert place_module.transfer_us(value, GPU0, gpu1) == pytest.approx(between_cpus + 2 * (10.0 + 4000 / 20000))


def test_a_model_must_have_positive_speeds():
    with pytest.raises(fj.FlowjitValueError, match="elementwise_speedup must be positive"):
        place_module.DeviceTypeModel(lambda op: None, elementwise_speedup=0.0)


@pytest.fixture
def one_gpu(monkeypatch):
    """`fj.devices()` lists gpu:0 (no driver is asked)."""
    monkeypatch.setattr(driver, "local_gpu_count", lambda: 1)
    assert [d.name for d in fj.devices()] == [CPU0, GPU0]


def test_plain_jit_puts_big_work_on_the_gpu_and_a_target_keeps_it_on_the_cpu(one_gpu):
    def f(a, b):
        return fnp.tanh(a @ b)

    def devices(text):
        return set(re.findall(r"^//\s+%\d+ \w+\s+(\S+)", text, re.MULTILINE))

    assert devices(fj.jit(f).lower(BIG, BIG).as_text("placement")) == {"gpu:0"}
    assert devices(fj.jit(f, target="cpu").lower(BIG, BIG).as_text("placement")) == {"cpu:0"}
    assert devices(fj.jit(f, device="cpu:0").lower(BIG, BIG).as_text("placement")) == {"cpu:0"}


def test_the_placement_stage_shows_soft_placement_and_each_transfers_direction(one_gpu):
    def f(x):
        with fj.device("cpu:0"):
            h = fnp.tanh(x)
        with fj.device("gpu:0"):
            y = fj.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 2.0), (0, h))[1]
            return fnp.exp(y) + h

    text = fj.jit(f).lower(SMALL).as_text("placement")
    while_line = next(line for line in text.splitlines() if " while " in line)
    assert " cpu:0 " in while_line and "soft placement" in while_line and "control flow" in while_line
    assert re.search(r"^//   cpu:0->gpu:0:%\d+: 32 bytes, cpu:0 -> gpu:0, ", text, re.MULTILINE), text
