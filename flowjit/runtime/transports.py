"""Transports: how a sent value's bytes reach the receiving device, chosen per device pair.

The rendezvous of a step matches each recv with its send; the transport of the key's (sending
device, receiving device) pair moves the bytes. Registered per pair of device types within one
task (process):

    (cpu, cpu)   HostCopy: one memmove between host buffers
    (cpu, gpu)   GpuStaging: a GPU partition's send/recv happen on the host around its GPU calls
    (gpu, cpu)   (`backends/gpu/staging.py`), so the rendezvous moves host bytes (one memmove);
    (gpu, gpu)   the copy to or from device memory is the GPU call's own (asynchronous copies on
                 its stream through pinned memory, waited for with a deadline); between two GPUs
                 the value goes through the host (no peer copy)

Values between tasks go through a process transport (Ray), which the distributed runtime
supplies. A pair with no transport is an error when the function is compiled, never a silent
host copy. docs/architecture.md lists what a transport must guarantee.
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


class GpuStaging(HostCopy):
    """Between a CPU partition's buffer and the host array a GPU partition receives into or sends
    from (its send/recv run on the host around its GPU calls): one memmove. The device copy is
    the GPU call's (`backends/gpu/staging.py`), so the bytes reach device memory before any kernel
    reads them and leave it only once the kernels that computed them finished."""

    name = "host copy, then the GPU call's copy to or from the device"


GPU_STAGING = GpuStaging()

# (sending device type, receiving device type) -> transport, within one task
TRANSPORTS: dict[tuple[str, str], Transport] = {
    ("cpu", "cpu"): HOST_COPY,
    ("cpu", "gpu"): GPU_STAGING,
    ("gpu", "cpu"): GPU_STAGING,
    ("gpu", "gpu"): GPU_STAGING,
}


_BUILT_IN = frozenset(TRANSPORTS)


def register_transport(sender_type: str, receiver_type: str, transport: Transport) -> None:
    """Use `transport` for values sent from devices of `sender_type` to devices of `receiver_type`."""
    TRANSPORTS[(sender_type, receiver_type)] = transport


def unregister_transport(sender_type: str, receiver_type: str) -> None:
    if (sender_type, receiver_type) not in _BUILT_IN:
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
