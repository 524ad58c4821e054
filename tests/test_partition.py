"""The `partition` pass and `split_partitions`: cut edges become send/recv pairs, one per (value,
destination); partitions are self-contained functions."""

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.ir.interpreter import interpret
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph
from flowjit.ir.verifier import verify
from flowjit.passes.partition import partition, split_partitions
from flowjit.passes.place import place as place_on
from flowjit.runtime.rendezvous import Rendezvous


def place(graph):
    """The `place` pass on the local devices, as `fj.jit` runs it."""
    return place_on(graph, fj.devices())


X = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)


@pytest.fixture(autouse=True)
def three_devices(monkeypatch):
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "3")


def placed_only(fn, *args):
    """The optimized graph of `fn`, placed but not partitioned."""
    graph = parse_graph(print_graph(fj.jit(fn, target="interpreter").lower(*args).graph("optimized")))
    return place(graph)


def cut_edges(graph):
    """Distinct (value, consumer device) pairs whose producer is on another device, ignoring
    constants (which partition copies instead of sending)."""
    return {
        (v, op.device)
        for op in graph.ops
        for v in op.operands
        if v.producer is not None and v.producer.device != op.device and v.producer.name != "constant"
    }


def three_way(x):
    with fj.device("cpu:0"):
        a = fnp.tanh(x)
        b = fnp.exp(x)
    with fj.device("cpu:1"):
        c = a * a + a - b  # a read by three ops, b by one: two cut edges into cpu:1
    with fj.device("cpu:2"):
        d = fnp.sin(a) + c * 2.0  # a again (a new destination), c: two more
    return d, c


FAN_OUT = """
func @fan_out(%x: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
  %0 = tanh %x : tensor<4xf32> device("cpu:0")
  %1 = exp %x : tensor<4xf32> device("cpu:0")
  %2 = mul %0, %0 : tensor<4xf32> device("cpu:1")
  %3 = add %2, %0 : tensor<4xf32> device("cpu:1")
  %4 = sub %3, %1 : tensor<4xf32> device("cpu:1")
  %5 = sin %0 : tensor<4xf32> device("cpu:2")
  %6 = add %5, %4 : tensor<4xf32> device("cpu:2")
  return %6, %4 : tensor<4xf32>, tensor<4xf32>
}
"""


def test_one_send_per_value_and_destination():
    graph = place(parse_graph(FAN_OUT))
    edges = cut_edges(graph)
    assert len(edges) == 4  # %0 to cpu:1 (three readers) and cpu:2, %1 to cpu:1, %4 to cpu:2
    partition(graph)
    verify(graph)
    sends, recvs = [op for op in graph.ops if op.name == "send"], [op for op in graph.ops if op.name == "recv"]
    assert len(sends) == len(recvs) == len(edges)
    assert sorted(op.attrs["key"] for op in sends) == sorted(op.attrs["key"] for op in recvs)
    assert len({op.attrs["key"] for op in sends}) == len(sends)
    assert not cut_edges(graph), "no op reads a value from another device after partition"
    for t in graph.transfers:
        assert t.key == f"{t.src[-5:]}->{t.dst[-5:]}:{t.value_name}"
    (to_cpu1,) = [t for t in graph.transfers if t.producer.name == "tanh" and t.dst.endswith("cpu:1")]
    assert [c.name for c in to_cpu1.consumers] == ["mul", "mul", "add"]


def test_cut_edges_of_a_traced_program():
    graph = placed_only(three_way, X)
    edges = cut_edges(graph)
    partition(graph)
    verify(graph)
    assert len([op for op in graph.ops if op.name == "send"]) == len(edges) > 0
    assert len([op for op in graph.ops if op.name == "recv"]) == len(edges)
    assert not cut_edges(graph)


def test_keys_name_values_as_printed():
    graph = partition(placed_only(three_way, X))
    text = print_graph(graph)
    for t in graph.transfers:
        name = t.key.rsplit(":", 1)[1]
        assert f"  {name} = {t.producer.name} " in text, (t.key, text)
    assert print_graph(parse_graph(text)) == text


def test_constants_are_copied_not_sent():
    text = (
        "func @f(%x: tensor<3xf32>) -> (tensor<3xf32>, tensor<3xf32>) {\n"
        "  %0 = constant {value = array<tensor<3xf32>, [1.0, 2.0, 3.0]>} : tensor<3xf32>\n"
        '  %1 = mul %x, %0 : tensor<3xf32> device("cpu:0")\n'
        '  %2 = add %x, %0 : tensor<3xf32> device("cpu:1")\n'
        "  return %1, %2 : tensor<3xf32>, tensor<3xf32>\n"
        "}\n"
    )
    graph = partition(place(parse_graph(text)))
    verify(graph)
    assert not [op for op in graph.ops if op.name == "send"]
    constants = [op for op in graph.ops if op.name == "constant"]
    assert sorted(c.device[-5:] for c in constants) == ["cpu:0", "cpu:1"]
    assert graph.placement[constants[0]] == "created where first used"
    assert "copy of the constant on cpu:0" in graph.placement[constants[1]]


def test_no_op_on_one_device():
    graph = place(parse_graph(print_graph(fj.jit(three_way, target="interpreter").lower(X).graph("optimized"))))
    for op in graph.ops:
        op.device = graph.ops[0].device
    before = print_graph(graph)
    assert print_graph(partition(graph)) == before
    assert graph.transfers == []


def test_partition_needs_placement():
    graph = parse_graph(print_graph(fj.jit(three_way, target="interpreter").lower(X).graph("optimized")))
    graph.ops[0].device = None
    with pytest.raises(fj.FlowjitError, match="run the 'place' pass"):
        partition(graph)


def test_split_partitions_are_self_contained_and_compute_the_function():
    graph = partition(placed_only(three_way, X))
    plan = split_partitions(graph)
    assert [p.device[-5:] for p in plan.partitions] == ["cpu:0", "cpu:1", "cpu:2"]
    for p in plan.partitions:
        verify(p.graph)
        assert print_graph(parse_graph(print_graph(p.graph))) == print_graph(p.graph)
        assert {op.device for op in p.graph.ops} == {p.device}
    # Run the partitions one after another on one rendezvous: sends come before their recvs in
    # device order here, so sequential execution suffices to check the data flow.
    rendezvous, outs = Rendezvous(timeout_s=5), []
    for p in plan.partitions:
        outs.append(interpret(p.graph, [X for _ in p.inputs], _Context(rendezvous)))
    results = [outs[source[1]][source[2]] for source in plan.result_sources]
    expected = three_way(X)
    for got, want in zip(results, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)


class _Context:
    def __init__(self, rendezvous):
        self.variables = {}
        self.rendezvous = rendezvous
