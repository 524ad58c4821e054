"""What a partition's `send`/`recv` talk to: the channel of one step.

Every backend's send and recv go through a `Channel`: the reference interpreter calls it with
arrays, native code with raw buffers. The runtime's `Rendezvous` is the channel of a partitioned
call (it matches keys, picks a transport per device pair, cancels and times out); a graph run on
its own, outside the executor, gets this thread's `loopback()`, where its sends reach its own
later recvs. The IR defines the interface so that backends and the interpreter, below the
runtime, can be written against it; docs/architecture.md lists what a channel guarantees.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Protocol

import numpy as np

from flowjit.errors import FlowjitError


class TransferError(FlowjitError):
    """A recv that could not complete: its step was cancelled, or its send never came."""


class Channel(Protocol):
    """The sends and recvs of one step, as one partition sees them. Keys are the rendezvous keys
    of the partition pass; each is sent once and received once per step."""

    def send(self, key: str, value: np.ndarray) -> None:
        """Deposit `value` (which the sender never changes again) under `key`; never blocks."""

    def send_bytes(self, key: str, address: int, nbytes: int) -> bool:
        """Deliver `nbytes` at `address` under `key`; never waits for the receiver. True: the
        buffer was lent, and must stay intact until `wait_returned`; False: it is free again."""

    def recv_into(self, key: str, address: int, nbytes: int, where: str = "") -> None:
        """Wait for `key` and copy its bytes to `address`; raises TransferError when the step is
        cancelled, the value can never come, or the timeout passes (`where` prefixes the message)."""

    def recv(self, key: str, where: str = "") -> np.ndarray:
        """Wait for `key` and return its value as an array (what a `send` deposited, itself; a
        copy of bytes sent with `send_bytes`); raises like `recv_into`."""

    def wait_returned(self, keys: list[str], where: str = "") -> None:
        """Wait until every buffer lent under `keys` has been read by its receiver."""


class Loopback:
    """The channel of a graph run on its own: a send is kept (copied, for a raw buffer) until a
    later recv of its key on the same thread takes it. A recv with nothing sent before it fails
    at once: no other partition can send it."""

    def __init__(self):
        self._values: dict[str, np.ndarray] = {}

    def send(self, key: str, value: np.ndarray) -> None:
        self._values[key] = value

    def send_bytes(self, key: str, address: int, nbytes: int) -> bool:
        self._values[key] = snapshot(address, nbytes)
        return False

    def recv_into(self, key: str, address: int, nbytes: int, where: str = "") -> None:
        value = np.ascontiguousarray(self.recv(key, where))
        ctypes.memmove(address, value.ctypes.data, min(nbytes, value.nbytes))

    def recv(self, key: str, where: str = "") -> np.ndarray:
        value = self._values.pop(key, None)
        if value is None:
            raise TransferError(
                f"{where}recv '{key}' can never complete: nothing was sent under that key before it, and "
                "a graph run on its own has no other partition to send it"
            )
        return value

    def wait_returned(self, keys: list[str], where: str = "") -> None:
        return None  # nothing is lent: sends copy


def snapshot(address: int, nbytes: int) -> np.ndarray:
    """A copy of the `nbytes` at `address`, as bytes (a send that must free its buffer at once)."""
    copy = np.empty(nbytes, np.uint8)
    ctypes.memmove(copy.ctypes.data, address, nbytes)
    return copy


_local = threading.local()


def loopback() -> Loopback:
    """This thread's loopback channel (for graphs run outside the executor)."""
    channel = getattr(_local, "loopback", None)
    if channel is None:
        channel = _local.loopback = Loopback()
    return channel


def receive_array(channel: Channel, key: str, shape: tuple[int, ...], dtype: np.dtype, where: str = "") -> np.ndarray:
    """A new array of `shape` and `dtype` holding the value received under `key`."""
    out = np.empty(shape, dtype)
    channel.recv_into(key, out.ctypes.data, out.nbytes, where)
    return out
