"""The rendezvous where a `recv` meets its `send`: one per call (step) of a partitioned function.

A step's partitions run concurrently; `send(key, array)` deposits a buffer under its key and never
blocks; `recv(key)` waits until that key is deposited, the step is cancelled (another partition
failed), or the timeout passes. Every call gets a fresh `Rendezvous`, so concurrent calls of one
function never see each other's values (the step id names the namespace in errors). The bytes of
each key move through the transport of its (sending device, receiving device) pair
(`transports.py`, given as `routes`); the rendezvous itself only matches and waits. It is the
`flowjit.ir.channel.Channel` every backend's send/recv call: native code through the C ABI of its
backend (`backends/cpu/communication.py`), the interpreter directly.

A raw-buffer transfer is one copy: when the recv is waiting, the send copies straight into the
buffer the received value lives in; otherwise the send lends its buffer (without waiting: two
partitions exchanging values would deadlock) and the recv copies out of it. A partition's last op,
`send_done`, waits until its lent buffers were read (`wait_returned`).
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np

from flowjit.errors import FlowjitError
from flowjit.ir.channel import TransferError, snapshot
from flowjit.runtime.transports import HOST_COPY, Transport

__all__ = ["DEFAULT_TIMEOUT_S", "Rendezvous", "TransferError", "recv_timeout_s", "seconds_setting"]

DEFAULT_TIMEOUT_S = 600.0


def seconds_setting(variable: str, default: float) -> float:
    """A number of seconds from the environment variable `variable`, else `default`."""
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise FlowjitError(f"{variable} must be a number of seconds; found {raw!r}") from None


def recv_timeout_s() -> float:
    """Seconds a recv waits for its send (`FLOWJIT_RECV_TIMEOUT`, default 600): the last resort
    against a partition stuck in native code; missing sends are detected without waiting."""
    return seconds_setting("FLOWJIT_RECV_TIMEOUT", DEFAULT_TIMEOUT_S)


_step_ids = itertools.count(1)


class Rendezvous:
    """The meeting point of one step's sends and recvs.

    Arrays (`send`/`recv`) are handed over as they are. Raw buffers (`send_bytes`/`recv_into`,
    used by native code) move with one copy: straight into the receiver's destination when it is
    already waiting, else the sender lends its buffer and the receiver copies out of it; the sender
    keeps lent buffers intact until `wait_returned` (its partition's `send_done`).
    """

    def __init__(
        self, timeout_s: float | None = None, parties: int | None = None, routes: dict[str, Transport] | None = None
    ):
        self.step_id = next(_step_ids)
        # key -> the transport of its device pair; a key without a route moves between host buffers
        self._routes = routes or {}
        # With `parties` (the step's partition count), a recv that no running partition can still
        # satisfy fails at once: every partition not finished (`leave`) is waiting in a recv.
        self._parties = parties
        self._finished = 0
        self._blocked: list[str | None] = []  # the keys recvs wait for right now (None: a send_done)
        self.timeout_s = recv_timeout_s() if timeout_s is None else timeout_s
        self._cond = threading.Condition()
        self._values: dict[str, np.ndarray] = {}
        self._waiting: dict[str, tuple[int, int]] = {}  # key -> (destination address, nbytes) of a recv_into
        self._delivered: set[str] = set()
        self._loans: dict[str, tuple[int, int]] = {}  # key -> (source address, nbytes) lent by a sender
        self._copying: set[str] = set()  # loans a receiver is copying out of right now
        self._returned: set[str] = set()  # loans fully copied
        self._cancelled: BaseException | None = None

    def send(self, key: str, value: np.ndarray) -> None:
        """Deposit `value` under `key` and wake the waiting recv; never blocks on the receiver."""
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def send_bytes(self, key: str, address: int, nbytes: int) -> bool:
        """Deliver `nbytes` at `address`: into a waiting `recv_into`'s destination if there is one
        (returns False: the memory is free again), else as a loan (returns True: keep the memory
        intact until `wait_returned`). Never waits for the receiver."""
        with self._cond:
            claim = self._waiting.pop(key, None)
            if claim is None:
                self._loans[key] = (address, nbytes)
                self._cond.notify_all()
                return True
        self._routes.get(key, HOST_COPY).copy(claim[0], address, min(nbytes, claim[1]))
        with self._cond:
            self._delivered.add(key)
            self._cond.notify_all()
        return False

    def wait_returned(self, keys: list[str], where: str = "") -> None:
        """Wait until every loan in `keys` has been copied by its receiver (or the step was
        cancelled); afterwards no receiver reads those buffers. Raises like `recv` when a receiver
        can never come."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            try:
                while self._cancelled is None and any(k not in self._returned for k in keys):
                    self._wait(None, deadline, where)
            finally:
                for k in keys:  # unclaimed loans are withdrawn; claimed ones finish copying first
                    self._loans.pop(k, None)
                while any(k in self._copying for k in keys):
                    self._cond.wait()
                self._returned.difference_update(keys)

    def recv(self, key: str, where: str = "") -> np.ndarray:
        """The value sent under `key`, waiting for it: the array a `send` deposited, or a copy of
        the buffer a `send_bytes` lent (as bytes); raises TransferError when the step is cancelled
        or nothing arrives within the timeout."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while key not in self._values and key not in self._loans:
                self._wait(key, deadline, where)
            if key in self._values:
                return self._values.pop(key)
            source, nbytes = self._loans.pop(key)
            self._copying.add(key)
        try:
            return snapshot(source, nbytes)
        finally:
            self._copied_out(key)

    def recv_into(self, key: str, address: int, nbytes: int, where: str = "") -> None:
        """Receive `key`'s bytes into the buffer at `address`; raises like `recv`."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            if key not in self._values and key not in self._loans:
                self._waiting[key] = (address, nbytes)
                try:
                    while key not in self._delivered and key not in self._values and key not in self._loans:
                        self._wait(key, deadline, where)
                except TransferError:
                    if self._waiting.pop(key, None) is not None:
                        raise
                    # A sender claimed the destination and is copying: the copy ends soon.
                    while key not in self._delivered:
                        self._cond.wait()
                if key in self._delivered:
                    self._delivered.discard(key)
                    return
                self._waiting.pop(key, None)
            if key in self._values:
                value = self._values.pop(key)
                source, available = value.ctypes.data, value.nbytes
            else:
                value = None
                source, available = self._loans.pop(key)
                self._copying.add(key)
        try:
            self._routes.get(key, HOST_COPY).copy(address, source, min(nbytes, available))
        finally:
            if value is None:
                self._copied_out(key)

    def _copied_out(self, key: str) -> None:
        """A receiver has copied the loan of `key` (taken out of `_loans` into `_copying`)."""
        with self._cond:
            self._copying.discard(key)
            self._returned.add(key)
            self._cond.notify_all()

    def leave(self) -> None:
        """One partition of the step has finished: it will send nothing more."""
        with self._cond:
            self._finished += 1
            self._cond.notify_all()

    def _wait(self, key: str | None, deadline: float, where: str) -> None:
        """Wait for a change under the lock (`key` None: a send_done waiting for its receivers);
        raise when the step is cancelled, nothing can arrive any more, or time is up."""
        what = f"recv '{key}'" if key is not None else "send_done"
        if self._cancelled is not None:
            raise TransferError(f"{where}{what} of step {self.step_id} cancelled: another partition failed")
        if self._parties is not None and self._stuck(len(self._blocked) + 1, key):
            raise TransferError(
                f"{where}{what} of step {self.step_id} can never complete: every other partition has "
                "finished or waits too, with nothing to receive (a compiler bug: please report it)"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(
                f"{where}{what} of step {self.step_id} timed out after {self.timeout_s:g} s waiting for the other "
                "side (FLOWJIT_RECV_TIMEOUT sets the limit)"
            )
        self._blocked.append(key)
        try:
            self._cond.wait(left)
        finally:
            self._blocked.remove(key)

    def _stuck(self, waiting: int, key: str | None) -> bool:
        """True when `waiting` recvs (those blocked, and one about to wait for `key`) are all the
        partitions still running and none of the keys they wait for has arrived (a woken waiter
        still counts until it runs: check its key)."""
        if waiting < self._parties - self._finished:
            return False
        return not any(
            k is not None and (k in self._values or k in self._delivered or k in self._loans) for k in self._blocked
        )

    def cancel(self, error: BaseException) -> None:
        """Wake every waiting recv with an error: `error` ended this step."""
        with self._cond:
            if self._cancelled is None:
                self._cancelled = error
            self._cond.notify_all()
