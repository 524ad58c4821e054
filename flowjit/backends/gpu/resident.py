"""Variables in device memory: one `DeviceVariable` per (variable, device), kept in its context
(`DeviceContext.residents`) between calls.

A GPU program that reads or updates a variable uses its device copy: copied in from the host
buffer once, when the copy is not current (first use, or the host wrote the variable since);
an update is written into a fresh block of the allocator, which becomes the device copy (the old
one goes back to the allocator after the call: no kernel reads the old value while another writes
the new). The host buffer is brought up to date only when the host reads it.

Coherence: a `DeviceVariable` is also the variable's home (`flowjit.runtime.tasks.VariableHome`,
matched by shape: this layer does not import the runtime) while its copy may be newer than the host
buffer; the frontend registers it after a call (`set_variable_home`). Every host access then goes
through it: `read` (`.value`, `.numpy()`, checkpoints, a CPU program's `bring_home`) copies the
device copy out when the host buffer is stale; `write` (`assign` outside jit) writes the host
buffer and marks the device copy stale; `left` (the variable stopped living here: a CPU program
brought it home, a cluster moved it to a task) marks it stale too, so the next GPU call copies it
in again. Every such access holds the variable's lock, as every compiled call using it does.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from flowjit.backends.gpu.driver import GpuRuntimeError
from flowjit.backends.gpu.runtime import DeviceContext
from flowjit.ir.devices import LOCAL_JOB

_lock = threading.Lock()  # guards every context's `residents`


class DeviceVariable:
    """The copy of variable `name` (host buffer `host`) in `ctx`'s memory, and its home while the
    device copy may be the newer one."""

    task = f"/job:{LOCAL_JOB}/task:0"  # a home's task (runtime.tasks.VariableHome): this process

    def __init__(self, ctx: DeviceContext, name: str, host: np.ndarray):
        self.ctx = ctx
        self.name = name
        self._host = weakref.ref(host)  # the variable's buffer; the variable owns it
        self.nbytes = host.nbytes
        self.address = ctx.allocator.allocate(host.nbytes)
        self.device_current = False  # the device copy holds the variable's value
        self.host_current = True  # the host buffer holds it

    def host(self) -> np.ndarray:
        host = self._host()
        if host is None:
            raise GpuRuntimeError(f"internal error: variable '{self.name}' is gone, but its device copy was used")
        return host

    # --- what a GPU call does ---------------------------------------------------------------------
    def address_for_call(self) -> int:
        """The device copy, copied in from the host buffer first when it is not current."""
        if not self.device_current:
            self.ctx.copier().to_device(self.address, self.host(), f"variable '{self.name}' to the device")
            self.device_current = True
        return self.address

    def updated(self, address: int) -> None:
        """A call wrote the variable's new value into `address` (a block of the context's
        allocator, now owned here): it is the device copy, and the host buffer is stale."""
        self.ctx.allocator.release(self.address)
        self.address = address
        self.device_current, self.host_current = True, False

    def written_to_host(self) -> None:
        """A call wrote the variable's new value into the host buffer (not kept on the device)."""
        self.device_current, self.host_current = False, True

    # --- the home: what host accesses do -----------------------------------------------------------
    def read(self) -> np.ndarray:
        """A copy of the current value; the host buffer is brought up to date first."""
        host = self.host()
        if not self.host_current:
            self.ctx.copier().to_host(self.address, host, f"variable '{self.name}' to the host")
            self.host_current = True
        return host.copy()

    def write(self, value: np.ndarray) -> None:
        """The host sets the variable: the host buffer holds it, the device copy is stale."""
        np.copyto(self.host(), value, casting="unsafe")
        self.device_current, self.host_current = False, True

    def left(self) -> None:
        """This is no longer the variable's home: whoever took it read it first (`bring_home`,
        a cluster moving it to a task), and may change the host buffer without telling us."""
        if not self.host_current and self._host() is not None:
            self.read()
        self.device_current = False

    def detach(self) -> None:
        """The context is going away: the value goes to the host buffer; the copy is gone."""
        try:
            if not self.host_current and self._host() is not None:
                self.read()
        except GpuRuntimeError:
            pass  # at exit the driver may be gone; the host buffer keeps its last value
        self.device_current, self.host_current = False, True
        self.address = 0

    def __repr__(self) -> str:
        state = "current" if self.device_current else "stale"
        return f"DeviceVariable({self.name!r} on GPU {self.ctx.ordinal}, device copy {state})"


def device_variable(ctx: DeviceContext, name: str, host: np.ndarray, create: bool = True) -> DeviceVariable | None:
    """The device copy of variable `name` whose buffer is `host` in `ctx`: made (stale) on first
    use when `create`, else None. A copy made for an earlier variable of that name (gone since) is
    dropped."""
    with _lock:
        found = ctx.residents.get(name)
        if found is not None and found._host() is host:
            return found
        if not create:
            return None
        if found is not None:  # a variable of that name that died: its block goes back
            del ctx.residents[name]
            ctx.allocator.release(found.address)
        made = ctx.residents[name] = DeviceVariable(ctx, name, host)
    forget = weakref.finalize(host, _forget, ctx, name, made)  # the variable died: free its device copy
    forget.atexit = False  # at exit the context's teardown brings the value home (`detach`) instead
    return made


def _forget(ctx: DeviceContext, name: str, copy: DeviceVariable) -> None:
    with _lock:
        if ctx.closed or ctx.residents.get(name) is not copy:
            return
        del ctx.residents[name]
    ctx.allocator.release(copy.address)
