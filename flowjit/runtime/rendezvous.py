"""The rendezvous where a `recv` meets its `send`: one per call (step) of a partitioned function.

A step's partitions run concurrently; `send(key, array)` deposits a buffer under its key and never
blocks; `recv(key)` waits until that key is deposited, the step is cancelled (another partition
failed), or the timeout passes. Every call gets a fresh `Rendezvous`, so concurrent calls of one
function never see each other's values (the step id names the namespace in errors).

Native partitions reach the rendezvous through two C-ABI functions (see `native_symbols`; the
pointers travel as 64-bit integers):

    void    flowjit_send(const char *key, const void *data, int64_t nbytes);
    int32_t flowjit_recv(const char *key, void *dest, int64_t nbytes);

The step a call belongs to is bound to the calling thread (`StepBinding`) before the partition's
entry point runs; send/recv sit at the top level of the entry (never inside a parallel loop), so
they run on that thread. This keeps every entry point's signature `(inputs, outputs, workspace)`;
a runtime without Python binds its step the same way. A send deposits a copy of its buffer (the
sender's workspace slot is reused right after, and sends must never wait for their receiver or
two partitions exchanging values would deadlock) unless the recv is already waiting, in which case
the sender copies straight into the buffer the received value lives in: one copy per native
transfer when the receiver is first, two when the sender is; none in the interpreter.
`flowjit_recv` returns 0 on delivery and 1 when the step was cancelled or timed out (the
destination is then zero-filled so the partition can finish; the executor raises).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time

import numpy as np

from flowjit.errors import FlowjitError

DEFAULT_TIMEOUT_S = 600.0


class TransferError(FlowjitError):
    """A recv that could not complete: its step was cancelled, or its send never came."""


def recv_timeout_s() -> float:
    """Seconds a recv waits for its send (`FLOWJIT_RECV_TIMEOUT`, default 600): the last resort
    against a partition stuck in native code; missing sends are detected without waiting."""
    raw = os.environ.get("FLOWJIT_RECV_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        raise FlowjitError(f"FLOWJIT_RECV_TIMEOUT must be a number of seconds; found {raw!r}") from None


_step_ids = itertools.count(1)


class Rendezvous:
    """The meeting point of one step's sends and recvs.

    Arrays (`send`/`recv`) are handed over as they are. Raw buffers (`send_bytes`/`recv_into`,
    used by native code) move with one copy when the receiver is already waiting (the sender copies
    straight into the receiver's destination), else with two (a snapshot, then the copy out).
    """

    def __init__(self, timeout_s: float | None = None, parties: int | None = None):
        self.step_id = next(_step_ids)
        # With `parties` (the step's partition count), a recv that no running partition can still
        # satisfy fails at once: every partition not finished (`leave`) is waiting in a recv.
        self._parties = parties
        self._finished = 0
        self._blocked: list[str] = []  # the keys recvs wait for right now
        self.timeout_s = recv_timeout_s() if timeout_s is None else timeout_s
        self._cond = threading.Condition()
        self._values: dict[str, np.ndarray] = {}
        self._waiting: dict[str, tuple[int, int]] = {}  # key -> (destination address, nbytes) of a recv_into
        self._delivered: set[str] = set()
        self._cancelled: BaseException | None = None

    def send(self, key: str, value: np.ndarray) -> None:
        """Deposit `value` under `key` and wake the waiting recv; never blocks on the receiver."""
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def send_bytes(self, key: str, address: int, nbytes: int) -> None:
        """Deliver `nbytes` at `address`: into a waiting `recv_into`'s destination if there is one,
        else as a snapshot. The caller may reuse the memory as soon as this returns."""
        with self._cond:
            claim = self._waiting.pop(key, None)
        if claim is None:
            snapshot = np.empty(nbytes, np.uint8)
            ctypes.memmove(snapshot.ctypes.data, address, nbytes)
            self.send(key, snapshot)
            return
        ctypes.memmove(claim[0], address, min(nbytes, claim[1]))
        with self._cond:
            self._delivered.add(key)
            self._cond.notify_all()

    def recv(self, key: str, where: str = "") -> np.ndarray:
        """The value sent under `key`, waiting for it; raises TransferError when the step is
        cancelled or nothing arrives within the timeout."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while key not in self._values:
                self._wait(key, deadline, where)
            return self._values.pop(key)

    def recv_into(self, key: str, address: int, nbytes: int, where: str = "") -> None:
        """Receive `key`'s bytes into the buffer at `address`; raises like `recv`."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            if key not in self._values:
                self._waiting[key] = (address, nbytes)
                try:
                    while key not in self._delivered and key not in self._values:
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
            value = self._values.pop(key)
        ctypes.memmove(address, value.ctypes.data, min(nbytes, value.nbytes))

    def leave(self) -> None:
        """One partition of the step has finished: it will send nothing more."""
        with self._cond:
            self._finished += 1
            self._cond.notify_all()

    def _wait(self, key: str, deadline: float, where: str) -> None:
        """Wait for a change under the lock; raise when the step is cancelled, no partition can
        send any more, or time is up."""
        if self._cancelled is not None:
            raise TransferError(f"{where}recv '{key}' of step {self.step_id} cancelled: another partition failed")
        if self._parties is not None and self._stuck(len(self._blocked) + 1):
            raise TransferError(
                f"{where}recv '{key}' of step {self.step_id} can never complete: every other partition has "
                "finished or waits in a recv too, and none sent this key (a compiler bug: please report it)"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(
                f"{where}recv '{key}' of step {self.step_id} timed out after {self.timeout_s:g} s waiting for its "
                "send (FLOWJIT_RECV_TIMEOUT sets the limit)"
            )
        self._blocked.append(key)
        try:
            self._cond.wait(left)
        finally:
            self._blocked.remove(key)

    def _stuck(self, waiting: int) -> bool:
        """True when `waiting` recvs are all the partitions still running and none of the keys
        they wait for has arrived (a woken waiter still counts until it runs: check its key)."""
        if waiting < self._parties - self._finished:
            return False
        return not any(k in self._values or k in self._delivered for k in self._blocked)

    def cancel(self, error: BaseException) -> None:
        """Wake every waiting recv with an error: `error` ended this step."""
        with self._cond:
            if self._cancelled is None:
                self._cancelled = error
            self._cond.notify_all()


# --- the C ABI for native partitions ---------------------------------------------------------------------

SEND_PROTOTYPE = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
RECV_PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)

_bound = threading.local()


class StepBinding:
    """Binds one partition's step to the calling thread while its native code runs: the native
    send/recv calls made on this thread use `rendezvous`. `where` maps a key to its recv's source
    location (for errors); `error` keeps the first failure a native recv met."""

    def __init__(self, rendezvous: Rendezvous, where: dict[str, str]):
        self.rendezvous = rendezvous
        self.where = where
        self.error: BaseException | None = None

    def __enter__(self) -> StepBinding:
        _bound.step = self
        return self

    def __exit__(self, *exc) -> None:
        _bound.step = None


def _native_send(key: int, data: int, nbytes: int) -> None:
    step = getattr(_bound, "step", None)
    if step is None:  # the entry point was called outside the executor: nothing can wait on this
        return
    step.rendezvous.send_bytes(ctypes.string_at(key).decode(), data, nbytes)


def _native_recv(key: int, dest: int, nbytes: int) -> int:
    # An exception must not escape a ctypes callback (it would be printed and ignored): failures
    # are recorded on the step and reported by the executor once the native call returns.
    step = getattr(_bound, "step", None)
    if step is None:  # the entry point was called outside the executor: no value will come
        ctypes.memset(dest, 0, nbytes)
        return 1
    name = ctypes.string_at(key).decode()
    where = step.where.get(name, "")
    try:
        step.rendezvous.recv_into(name, dest, nbytes, f"{where}: " if where else "")
    except TransferError as e:
        if step.error is None:
            step.error = e
        ctypes.memset(dest, 0, nbytes)
        return 1
    return 0


# Kept alive for the life of the process: native code holds their addresses.
_SEND_CALLBACK = SEND_PROTOTYPE(_native_send)
_RECV_CALLBACK = RECV_PROTOTYPE(_native_recv)


def native_symbols() -> dict[str, int]:
    """The addresses native code links `flowjit_send` / `flowjit_recv` to."""
    return {
        "flowjit_send": ctypes.cast(_SEND_CALLBACK, ctypes.c_void_p).value,
        "flowjit_recv": ctypes.cast(_RECV_CALLBACK, ctypes.c_void_p).value,
    }
