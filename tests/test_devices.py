"""Device names, partial specs and `with fj.device(...)` scopes."""

import numpy as np
import pytest

import flowjit as fj
from flowjit.runtime.devices import DeviceSpec, resolve


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cpu:1", DeviceSpec(None, None, "cpu", 1)),
        ("/device:gpu:0", DeviceSpec(None, None, "gpu", 0)),
        ("gpu:*", DeviceSpec(None, None, "gpu", None)),
        ("/job:ps", DeviceSpec("ps", None, None, None)),
        ("/job:worker/task:17/device:gpu:3", DeviceSpec("worker", 17, "gpu", 3)),
        ("/job:parameters/task:4/device:CPU:0", DeviceSpec("parameters", 4, "cpu", 0)),
    ],
)
def test_parse(text, expected):
    assert DeviceSpec.parse(text) == expected
    assert DeviceSpec.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["tpu:0", "/job", "cpu:x", "", "/task:a", "/foo:1"])
def test_bad_names_are_clear_errors(text):
    with pytest.raises(fj.FlowjitValueError, match="device"):
        DeviceSpec.parse(text)


def test_local_devices_and_matching(monkeypatch):
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "3")
    devs = fj.devices()
    assert [d.short_name for d in devs] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [d.short_name for d in resolve("cpu:*")] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [d.short_name for d in resolve("/job:localhost/task:0/device:cpu:2")] == ["cpu:2"]
    assert resolve("/job:ps") == []
    assert resolve("gpu:0") == []


def test_nested_scopes_merge_into_op_devices():
    @fj.jit(target="interpreter", device="/job:localhost")
    def f(x):
        with fj.device("/task:0"):
            with fj.device("cpu:1"):
                y = x * 2
            z = y + 1
        return z - 1

    ops = f.lower(np.ones(2, np.float32)).graph("traced").ops
    devices = {op.name: op.device for op in ops if op.name in ("mul", "add", "sub")}
    assert devices == {
        "mul": "/job:localhost/task:0/device:cpu:1",
        "add": "/job:localhost/task:0",
        "sub": "/job:localhost",
    }
