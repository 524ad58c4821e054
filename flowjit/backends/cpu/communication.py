"""The native side of send/recv: the C functions CPU code calls, bound to a step's channel.

Native partitions reach their step's channel (`flowjit.ir.channel.Channel`, the runtime's
rendezvous) through three C-ABI functions (`lower_communication.py` emits the calls; pointers
travel as 64-bit integers):

    void    flowjit_send(const char *key, const void *data, int64_t nbytes);
    int32_t flowjit_recv(const char *key, void *dest, int64_t nbytes);
    int64_t flowjit_recv_view(const char *key, int64_t nbytes);   /* the value's address */
    void    flowjit_send_done(void);   /* returns once every receiver has read what was sent */

The channel a call belongs to is bound to the calling thread (`StepBinding`) before the partition's
entry point runs; send/recv sit at the top level of the entry (never inside a parallel loop), so
they run on that thread. This keeps every entry point's signature `(inputs, outputs, workspace)`;
a runtime without Python (the AOT library's `aot_runtime.c`) binds its step the same way. A send
hands its buffer to the channel (`send_bytes`: copied straight into a waiting receiver, or lent);
`send_done` waits until its lent buffers were read, and the partition pass keeps every sent value
alive until then (they are its operands), so no workspace slot is reused under a reader.
`flowjit_recv` returns 0 on delivery and 1 when the step was cancelled or timed out (the
destination is then zero-filled so the partition can finish; `run_step` raises afterwards).
`flowjit_recv_view` serves a value that comes from another task, which arrives as an array (read
zero-copy from Ray's object store when large): it returns the address of the value's bytes where
they lie, and the binding keeps the array alive until the partition's entry point returns; the
code only reads it. A value not 64-byte aligned is copied first, and a failed recv gives zeros.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from flowjit.ir.channel import Channel, TransferError, loopback

SEND_PROTOTYPE = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
SEND_DONE_PROTOTYPE = ctypes.CFUNCTYPE(None)
RECV_PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
RECV_VIEW_PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
# The alignment of the buffers the code's kernels are given (the workspace's slots).
VIEW_ALIGNMENT = 64

# Ops whose native code calls the functions below.
COMMUNICATION_OPS = frozenset({"send", "recv", "send_done"})

_bound = threading.local()


class StepBinding:
    """Binds one partition's step to the calling thread while its native code runs: the native
    send/recv calls made on this thread use `channel`. `where` maps a key to its recv's source
    location (for errors); `error` keeps the first failure a native recv met."""

    def __init__(self, channel: Channel, where: dict[str, str]):
        self.channel = channel
        self.where = where
        self.error: BaseException | None = None
        self.lent: list[str] = []  # keys whose buffers receivers may still read
        self.viewed: list[np.ndarray] = []  # received arrays the native code reads in place

    def __enter__(self) -> StepBinding:
        _bound.step = self
        return self

    def __exit__(self, *exc) -> None:
        _bound.step = None


def _native_send(key: int, data: int, nbytes: int) -> None:
    name = ctypes.string_at(key).decode()
    step = getattr(_bound, "step", None)
    if step is None:  # a function called on its own: its sends reach its own recvs
        loopback().send_bytes(name, data, nbytes)
        return
    if step.channel.send_bytes(name, data, nbytes):
        step.lent.append(name)


def _native_send_done() -> None:
    step = getattr(_bound, "step", None)
    if step is None or not step.lent:
        return
    try:
        step.channel.wait_returned(step.lent)
    except TransferError as e:
        if step.error is None:
            step.error = e
    step.lent.clear()


def _receiving(key: int) -> tuple[str, StepBinding | None, Channel, str]:
    """A native recv's key name, its step binding (None for a graph run on its own, whose channel
    is this thread's loopback), channel, and the prefix of its errors (the recv's source line)."""
    name = ctypes.string_at(key).decode()
    step = getattr(_bound, "step", None)
    if step is None:
        return name, None, loopback(), ""
    where = step.where.get(name, "")
    return name, step, step.channel, f"{where}: " if where else ""


def _native_recv(key: int, dest: int, nbytes: int) -> int:
    # An exception must not escape a ctypes callback (it would be printed and ignored): failures
    # are recorded on the step and reported once the native call returns.
    name, step, channel, where = _receiving(key)
    try:
        channel.recv_into(name, dest, nbytes, where)
    except TransferError as e:
        if step is not None and step.error is None:
            step.error = e
        ctypes.memset(dest, 0, nbytes)
        return 1
    return 0


def _native_recv_view(key: int, nbytes: int) -> int:
    name, step, channel, where = _receiving(key)
    try:
        value = _viewable(channel.recv(name, where), nbytes)
    except TransferError as e:
        if step is not None and step.error is None:
            step.error = e
        value = np.zeros(max(nbytes, 1), np.uint8)
    if step is not None:
        step.viewed.append(value)
    else:  # a graph run on its own: kept until the next recv of its key on this thread
        views = getattr(_bound, "unbound_views", None)
        if views is None:
            views = _bound.unbound_views = {}
        views[name] = value
    return value.ctypes.data


def _viewable(value: np.ndarray, nbytes: int) -> np.ndarray:
    """`value` itself when native code can read its `nbytes` in place (contiguous, aligned as the
    workspace's slots, as many bytes), else an aligned copy (zero-padded if short)."""
    value = np.asarray(value)
    if value.flags.c_contiguous and value.nbytes == nbytes and value.ctypes.data % VIEW_ALIGNMENT == 0:
        return value
    raw = np.zeros(nbytes + VIEW_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % VIEW_ALIGNMENT
    aligned = raw[start : start + nbytes]
    flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)[:nbytes]
    aligned[: flat.size] = flat
    return aligned


# Kept alive for the life of the process: native code holds their addresses.
_SEND_CALLBACK = SEND_PROTOTYPE(_native_send)
_RECV_CALLBACK = RECV_PROTOTYPE(_native_recv)
_RECV_VIEW_CALLBACK = RECV_VIEW_PROTOTYPE(_native_recv_view)
_SEND_DONE_CALLBACK = SEND_DONE_PROTOTYPE(_native_send_done)


def native_symbols() -> dict[str, int]:
    """The addresses native code links `flowjit_send` / `flowjit_recv` / `flowjit_recv_view` /
    `flowjit_send_done` to."""
    return {
        "flowjit_send": ctypes.cast(_SEND_CALLBACK, ctypes.c_void_p).value,
        "flowjit_recv": ctypes.cast(_RECV_CALLBACK, ctypes.c_void_p).value,
        "flowjit_recv_view": ctypes.cast(_RECV_VIEW_CALLBACK, ctypes.c_void_p).value,
        "flowjit_send_done": ctypes.cast(_SEND_DONE_CALLBACK, ctypes.c_void_p).value,
    }


@functools.cache
def link_native_symbols() -> None:
    """Make the functions above resolvable by JIT-compiled and cache-loaded native code."""
    import llvmlite.binding as binding

    for name, address in native_symbols().items():
        binding.add_symbol(name, address)


def run_in_step(call, channel: Channel, where: dict[str, str]):
    """`call()` (a native entry point's call) with its send/recv bound to `channel`; raises the
    first transfer failure once the native code has returned."""
    with StepBinding(channel, where) as step:
        outs = call()
    if step.error is not None:
        raise step.error
    return outs
