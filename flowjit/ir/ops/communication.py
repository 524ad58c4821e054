"""Communication: the `send`/`recv` pairs the partition pass puts on every cross-device edge.

A pair meets at a rendezvous `key` (`cpu:0->cpu:1:%3`: source, destination, the value's name in the
placed graph). Both ops are effectful: passes never delete, merge or reorder them, and their
semantics need a runtime (a per-call rendezvous), so they have no numpy implementation; the
interpreter and the CPU backend each provide one.

    send (value) {key, src, dst} -> ()
    recv {key, src, dst, shape, dtype} -> value
    send_done (*sent values) -> ()     last op of a partition that sends: its sent buffers stay
                                       intact (and alive) until every receiver has read them
"""

from __future__ import annotations

from flowjit.errors import ShapeError
from flowjit.ir import dtypes as dt
from flowjit.ir.ops.registry import COMMUNICATION, defop
from flowjit.ir.ops.rules import int_tuple
from flowjit.ir.types import TensorType

SEND_ATTRS = ("key", "src", "dst")
RECV_ATTRS = ("key", "src", "dst", "shape", "dtype")


def _check_endpoints(attrs) -> None:
    for name in SEND_ATTRS:
        if not isinstance(attrs[name], str) or not attrs[name]:
            raise ShapeError(f"'{name}' must be a non-empty string; found {attrs[name]!r}")
    if attrs["src"] == attrs["dst"]:
        raise ShapeError(f"a transfer needs two devices; source and destination are both {attrs['src']!r}")


def _send_rule(types, attrs):
    _check_endpoints(attrs)
    return []


def _recv_rule(types, attrs):
    _check_endpoints(attrs)
    return [TensorType(int_tuple(attrs["shape"], "shape"), dt.dtype(attrs["dtype"]))]


defop("send", COMMUNICATION, _send_rule, None, 1, attrs=SEND_ATTRS, doc="deliver the value to the rendezvous key")
defop("recv", COMMUNICATION, _recv_rule, None, 0, attrs=RECV_ATTRS, doc="wait for the value sent to the key")


def _send_done_rule(types, attrs):
    return []


defop(
    "send_done",
    COMMUNICATION,
    _send_done_rule,
    None,
    None,
    doc="wait until every receiver has read the values this partition sent (which stay alive until here)",
)
