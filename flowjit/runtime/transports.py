"""Transports: how a sent value's bytes reach the receiving device, chosen per device pair.

The rendezvous of a step matches each recv with its send; the transport of the key's (sending
device, receiving device) pair moves the bytes. Registered per pair of device types within one
task (process):

    (cpu, cpu)   HostCopy: one memmove between host buffers

A GPU backend registers (cpu, gpu), (gpu, cpu) and (gpu, gpu) transports (asynchronous copies
ordered by stream events); values between tasks go through a process transport (Ray), which the
distributed runtime supplies. A pair with no transport is an error when the function is compiled,
never a silent host copy. docs/architecture.md lists what a transport must guarantee.
"""

from __future__ import annotations

import ctypes

from flowjit.errors import FlowjitValueError
from flowjit.ir.devices import DeviceSpec


class Transport:
    """Moves the bytes of one value from the sender's buffer to the receiver's, both addressable
    in this process. `copy` returns once the destination holds the bytes and the source may be
    reused (an asynchronous transport waits for its copy before returning)."""

    name = ""

    def copy(self, dest: int, source: int, nbytes: int) -> None:
        raise NotImplementedError


class HostCopy(Transport):
    """Between buffers in host memory: one memmove."""

    name = "host copy"

    def copy(self, dest: int, source: int, nbytes: int) -> None:
        ctypes.memmove(dest, source, nbytes)


HOST_COPY = HostCopy()

# (sending device type, receiving device type) -> transport, within one task
TRANSPORTS: dict[tuple[str, str], Transport] = {("cpu", "cpu"): HOST_COPY}


def register_transport(sender_type: str, receiver_type: str, transport: Transport) -> None:
    """Use `transport` for values sent from devices of `sender_type` to devices of `receiver_type`."""
    TRANSPORTS[(sender_type, receiver_type)] = transport


def unregister_transport(sender_type: str, receiver_type: str) -> None:
    if (sender_type, receiver_type) != ("cpu", "cpu"):
        TRANSPORTS.pop((sender_type, receiver_type), None)


def transport_for(sender: str, receiver: str) -> Transport:
    """The transport for a value sent from device `sender` to device `receiver` (full names)."""
    s, r = DeviceSpec.parse(sender), DeviceSpec.parse(receiver)
    if (s.job, s.task) != (r.job, r.task):
        raise FlowjitValueError(
            f"no transport from {sender} to {receiver}: values between tasks need the distributed runtime"
        )
    transport = TRANSPORTS.get((s.device_type, r.device_type))
    if transport is None:
        known = ", ".join(f"{a}->{b}" for a, b in sorted(TRANSPORTS))
        raise FlowjitValueError(
            f"no transport from a '{s.device_type}' device to a '{r.device_type}' device ({sender} -> {receiver}); "
            f"registered: {known}"
        )
    return transport
