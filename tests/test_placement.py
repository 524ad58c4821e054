"""The `place` pass: constraints, variable colocation, regions as units, the cost model, the report."""

import re

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph
from flowjit.passes.place import place as place_on
from flowjit.runtime.executor import PartitionedExecutable


def place(graph):
    """The `place` pass on the local devices, as `fj.jit` runs it."""
    return place_on(graph, fj.devices())


CPU0 = "/job:localhost/task:0/device:cpu:0"
CPU1 = "/job:localhost/task:0/device:cpu:1"
X = np.arange(12, dtype=np.float32).reshape(3, 4) / 10


@pytest.fixture(autouse=True)
def two_devices(monkeypatch):
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "2")


def placed(fn, *args):
    """The placed (and partitioned) graph of `fn` under jit, on the interpreter."""
    return fj.jit(fn, target="interpreter").lower(*args).graph("placement")


def ops_named(graph, name):
    return [op for op in graph.ops if op.name == name]


def test_full_and_partial_constraints():
    def f(x):
        with fj.device("cpu:1"):
            a = fnp.tanh(x)
        with fj.device("/job:localhost/task:0"):  # partial: any device of this task
            b = fnp.exp(a)
        return b

    graph = placed(f, X)
    (tanh,) = ops_named(graph, "tanh")
    (exp,) = ops_named(graph, "exp")
    assert tanh.device == CPU1
    assert (
        graph.placement[tanh].startswith("constraint '/device:cpu:1'") and "test_placement.py:" in graph.placement[tanh]
    )
    # The cost model picks, among the matching devices, the one that needs no transfer.
    assert exp.device == CPU1
    assert graph.placement[exp].startswith("cost model") and "matching '/job:localhost/task:0'" in graph.placement[exp]


def test_jit_device_constrains_every_op():
    graph = fj.jit(lambda x: fnp.tanh(x) * 2, device="cpu:1", target="interpreter").lower(X).graph("placement")
    assert {op.device for op in graph.ops} == {CPU1}
    assert not ops_named(graph, "send")


def test_constraint_no_device_matches():
    def f(x):
        with fj.device("cpu:7"):
            return fnp.tanh(x)

    with pytest.raises(fj.FlowjitValueError, match=r"test_placement.py:\d+: op 'tanh': no device matches .*cpu:7") as e:
        placed(f, X)
    assert "FLOWJIT_CPU_DEVICES" in str(e.value)


def test_variable_is_colocated_with_its_readers_and_updates():
    v = fj.Variable(np.zeros((3, 4), np.float32), name="placement.v")

    def f(x):
        with fj.device("cpu:1"):
            current = v.value
        v.assign_add(x)  # unconstrained: must follow the variable to cpu:1
        return current

    graph = placed(f, X)
    (read,) = ops_named(graph, "read_variable")
    (update,) = ops_named(graph, "assign_add")
    assert read.device == update.device == CPU1
    assert "colocated with variable 'placement.v'" in graph.placement[update]


def test_contradictory_variable_constraints_name_both_lines():
    v = fj.Variable(np.zeros((3, 4), np.float32), name="placement.split")

    def f(x):
        with fj.device("cpu:0"):
            current = v.value
        with fj.device("cpu:1"):
            v.assign_add(x)
        return current

    with pytest.raises(fj.FlowjitValueError) as e:
        placed(f, X)
    message = str(e.value)
    assert len(set(re.findall(r"test_placement.py:(\d+)", message))) == 2, message  # both source lines
    assert "variable 'placement.split'" in message and "contradict" in message
    assert "cpu:0" in message and "cpu:1" in message


def test_region_is_placed_as_a_unit():
    def f(x):
        def true_fn(x):
            with fj.device("cpu:1"):
                return fnp.tanh(x)

        return fj.cond(x.sum() > 0, true_fn, lambda x: x * 2, x)

    graph = placed(f, X)
    (cond,) = ops_named(graph, "cond")
    assert cond.device == CPU1
    assert all(inner.device == CPU1 for region in cond.regions for inner in region.walk())


def test_contradictory_constraints_inside_a_region():
    def f(x):
        def true_fn(x):
            with fj.device("cpu:1"):
                y = fnp.tanh(x)
            with fj.device("cpu:0"):
                return fnp.exp(y)

        return fj.cond(x.sum() > 0, true_fn, lambda x: x * 2, x)

    with pytest.raises(fj.FlowjitValueError, match="placed as a unit") as e:
        placed(f, X)
    assert str(e.value).count("test_placement.py:") >= 2


def test_cost_model_keeps_chains_together_and_spreads_big_independent_work():
    big = np.ones((256, 256), np.float32)

    def f(a, b):
        left = fnp.tanh(a @ a) @ a  # two independent chains of large matmuls
        right = fnp.tanh(b @ b) @ b
        return left + right

    graph = placed(f, big, big)
    dots = [op for op in graph.walk() if op.name == "dot_general"]  # some may sit inside fusions
    assert {op.device for op in dots} == {CPU0, CPU1}
    # Each chain stays on one device: exactly one transfer, to the final add.
    assert len(ops_named(graph, "send")) == 1

    small = placed(lambda a, b: fnp.tanh(a) + fnp.exp(b), X, X)
    assert {op.device for op in small.ops} == {CPU0}, "tiny work must not pay for a transfer"


def test_placement_is_deterministic():
    text = (
        "func @f(%x: tensor<64x64xf32>) -> (tensor<64x64xf32>) {\n"
        "  %0 = tanh %x : tensor<64x64xf32>\n"
        "  %1 = exp %x : tensor<64x64xf32>\n"
        "  %2 = add %0, %1 : tensor<64x64xf32>\n"
        "  return %2 : tensor<64x64xf32>\n"
        "}\n"
    )
    first, second = place(parse_graph(text)), place(parse_graph(text))
    assert print_graph(first) == print_graph(second)
    assert list(first.placement.values()) == list(second.placement.values())


def test_one_device_changes_nothing(monkeypatch):
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "1")

    def f(x):
        with fj.device("cpu:0"):
            return fnp.tanh(x) + 1

    lowered = fj.jit(f, target="interpreter").lower(X)
    graph = lowered.graph("placement")
    assert {op.device for op in graph.ops} == {CPU0}
    assert not ops_named(graph, "send") and not ops_named(graph, "recv")
    assert not isinstance(lowered.compile().executable, PartitionedExecutable)


def test_placement_stage_text():
    def f(x):
        with fj.device("cpu:0"):
            h = fnp.tanh(x)
        with fj.device("cpu:1"):
            return fnp.exp(h) + h

    lowered = fj.jit(f, target="interpreter").lower(X)
    assert "placement" in lowered.stages
    text = lowered.as_text("placement")
    assert "// stage: placement" in text and "// devices: cpu:0, cpu:1" in text
    tanh_line = next(line for line in text.splitlines() if " tanh " in line and line.startswith("//"))
    assert "cpu:0" in tanh_line and "constraint '/device:cpu:0'" in tanh_line
    assert "// transfers: 1 (48 bytes per call)" in text
    transfer = next(line for line in text.splitlines() if line.startswith("//   cpu:0->cpu:1:%"))
    assert "48 bytes, cpu:0 -> cpu:1, 'tanh' (tests/test_placement.py:" in transfer and " -> '" in transfer
    # The key in the report is the one the IR below it carries.
    key = transfer.split(": ")[0].removeprefix("//   ")
    assert text.count(f'key = "{key}"') == 2
