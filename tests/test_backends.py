"""The seams between devices: a program placed on two device types is compiled per partition by the
backend of each device's type (through the `Backend` interface), and each value crossing between
them moves through the transport of its device pair. The second device type here is the reference
interpreter registered as a backend of its own, as a GPU backend registers itself."""

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.backends import registry
from flowjit.backends.interpreter import InterpreterBackend
from flowjit.runtime import devices as runtime_devices
from flowjit.runtime import transports


class RecordingBackend(InterpreterBackend):
    """The interpreter as the backend of device type 'ref', recording what it compiled."""

    name = "ref"

    def __init__(self):
        self.compiled: list[str] = []

    def compile(self, graph, device=None, options=None, aliases=None):
        self.compiled.append(device)
        return super().compile(graph, device, options, aliases)


class CountingCopy(transports.HostCopy):
    """A host copy that counts the bytes it moved."""

    def __init__(self, name: str):
        self.name = name
        self.bytes = 0

    def copy(self, dest, source, nbytes):
        self.bytes += nbytes
        super().copy(dest, source, nbytes)


@pytest.fixture
def ref_device():
    backend = RecordingBackend()
    to_ref, from_ref = CountingCopy("cpu->ref"), CountingCopy("ref->cpu")
    unregister = runtime_devices.register_device_provider("ref", lambda: 1)
    registry.register_backend(backend, device_types=("ref",))
    transports.register_transport("cpu", "ref", to_ref)
    transports.register_transport("ref", "cpu", from_ref)
    try:
        yield backend, to_ref, from_ref
    finally:
        transports.unregister_transport("cpu", "ref")
        transports.unregister_transport("ref", "cpu")
        registry.unregister_backend("ref")
        unregister()
    with pytest.raises(fj.FlowjitError, match="unknown device type 'ref'"):
        fj.device("ref:0").__enter__()


def two_device_types(x, w):
    with fj.device("cpu:0"):
        h = fnp.tanh(x @ w)
    with fj.device("ref:0"):
        s = fnp.sin(h) * 3.0
    with fj.device("cpu:0"):
        return (s + h).sum(axis=1)


def test_partitions_compile_by_their_device_type_and_values_cross_through_the_pair_transport(ref_device):
    backend, to_ref, from_ref = ref_device
    assert [d.name for d in fj.devices()] == [
        "/job:localhost/task:0/device:cpu:0",
        "/job:localhost/task:0/device:ref:0",
    ]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 32), np.float32)
    lowered = fj.jit(two_device_types).lower(x, w)
    out = lowered.compile()(x, w)
    h = np.tanh(x @ w)
    np.testing.assert_allclose(out, (np.sin(h) * 3.0 + h).sum(axis=1), rtol=1e-5, atol=1e-5)
    assert backend.compiled == ["/job:localhost/task:0/device:ref:0"]
    kinds = {p.device: p.backend.name for p in lowered._executable.parts}
    assert kinds == {"cpu:0": "cpu", "ref:0": "ref"}
    # h goes to ref:0 and s comes back: 8 x 32 float32 each way, once per call
    assert (to_ref.bytes, from_ref.bytes) == (h.nbytes, h.nbytes)
    lowered.compile()(x, w)
    assert (to_ref.bytes, from_ref.bytes) == (2 * h.nbytes, 2 * h.nbytes)
    placement = lowered.as_text("placement")
    assert "device:ref:0" in placement and "cpu:0->ref:0" in placement


def test_a_device_pair_without_a_transport_is_an_error_at_compile_time(ref_device):
    transports.unregister_transport("ref", "cpu")
    x, w = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    with pytest.raises(fj.FlowjitError, match=r"no transport from a 'ref' device to a 'cpu' device .*registered: "):
        fj.jit(two_device_types)(x, w)


def test_placement_uses_the_devices_it_is_given():
    from flowjit.ir.parser import parse_graph
    from flowjit.passes.place import place, place_pass

    text = """func @f(%x: tensor<4xf32>) -> (tensor<4xf32>) {
  %0 = exp %x : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""
    graph = place(parse_graph(text), ["/job:worker/task:3/device:cpu:0"])
    assert [op.device for op in graph.ops] == ["/job:worker/task:3/device:cpu:0"]
    with pytest.raises(fj.FlowjitError, match="has no device set to place on"):
        place_pass(parse_graph(text))  # the registered pass places on graph.devices, set by its caller


def test_fusion_fits_the_limits_of_every_device_type_the_graph_may_run_on(ref_device):
    from flowjit.passes import fuse

    def dense(x, w):
        return fnp.maximum(x @ w, 0.0)  # a 16 KiB product and its epilogue

    def product_fused_with_its_epilogue() -> bool:
        graph = fj.jit(dense).lower(x, w).graph("optimized")
        return any(
            inner.name == "dot_general" for op in graph.ops if op.name == "fusion" for inner in op.regions[0].ops
        )

    x = w = np.ones((64, 64), np.float32)
    assert product_fused_with_its_epilogue()  # the CPU's limits (ref:0 registered none): one kernel
    tight = fuse.FusionLimits(
        max_internal_bytes=1024, conv_epilogue_min_depth=8, dot_epilogue_min_columns=1000, max_pool_taps=4
    )
    fuse.register_fusion_limits("ref", tight)
    try:
        assert not product_fused_with_its_epilogue()  # a ref device could not hold the product: two kernels
    finally:
        del fuse.FUSION_LIMITS["ref"]
    with pytest.raises(ValueError, match="max_pool_taps must be a non-negative int"):
        fuse.FusionLimits(1, 1, 1, -1)
