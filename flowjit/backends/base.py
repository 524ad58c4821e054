"""What every backend provides: a `Backend` compiles a graph for one kind of device into an
`Executable`, which runs on buffers of that device. The registry (`flowjit.backends.registry`)
says which backend serves which device type."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flowjit.ir.channel import Channel
from flowjit.ir.graph import Graph


class Executable:
    """A compiled function: `run(arrays) -> arrays`, plus the text of each backend stage."""

    backend: str = ""
    stages: dict[str, str]
    fresh_outputs: bool = False  # True: results are always new arrays, never an argument passed through
    # Donation: output index -> input index. The call may write that output into the input's buffer
    # (`run(..., outputs={j: buffer})`); the backend then reads the input completely first.
    aliases: dict[int, int] = {}
    takes_device_arrays: bool = False  # True: `run` takes arrays in its device's memory (`DeviceArray`) as they are

    def run(
        self,
        args: Sequence[np.ndarray],
        variables: dict[str, np.ndarray] | None = None,
        outputs: dict[int, np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """Run on host arrays; `variables` maps each variable name the graph uses to its live buffer,
        which the call reads and updates in place. `outputs` maps output indices in `aliases` to
        donated buffers to write them into (backends without donation return fresh arrays)."""
        raise NotImplementedError

    def run_resident(
        self,
        args: Sequence[np.ndarray],
        variables: dict[str, np.ndarray] | None = None,
        outputs: dict[int, np.ndarray] | None = None,
        keep_results: bool = False,
    ) -> tuple[list, dict[str, object]]:
        """`run` for a caller that keeps variables' homes (`flowjit.runtime.tasks`), as a jitted
        function does. Returns (results, homes): `homes` maps each variable the executable now keeps
        in its device's memory to that copy, a `VariableHome` the caller registers before the host
        reads or writes the variable again (its host buffer may be stale). With `keep_results`,
        results stay on the device where the backend has device memory (`DeviceArray`s); a host
        backend's results are host arrays, which are on its device already."""
        return self.run(args, variables, outputs), {}

    def keeps(self, home) -> bool:
        """True when `home` (a variable's registered home) is this executable's copy of it in its
        device's memory: a call uses it there, so the caller does not bring the variable home."""
        return False

    def run_trusted(self, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`run` for C-contiguous arrays already known to match the signature (the jit fast path);
        backends with a cheaper unchecked call override it."""
        return self.run(args)

    def caller(self, single_output: bool) -> Callable[[Sequence[np.ndarray]], object]:
        """The jit fast path's call: a function of arrays known to match the signature (any layout)
        returning the list of outputs, or with `single_output` the one output; never an argument
        itself. Backends whose `run_trusted` costs more than the call's own work override it."""

        def call(args):
            arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args]
            outs = self.run_trusted(arrays)
            if not self.fresh_outputs:  # an input passed through must not alias the caller's array
                outs = [np.array(o) if any(o is a for a in args) else o for o in outs]
            return outs[0] if single_output else outs

        return call

    def run_step(
        self, args: Sequence[np.ndarray], variables: dict[str, np.ndarray], channel: Channel
    ) -> list[np.ndarray]:
        """Run as one partition of a partitioned call (one step): like `run`, with the graph's
        send/recv going through `channel`, the step's rendezvous as this partition sees it. A recv
        that fails raises its `TransferError` once the partition has finished."""
        raise NotImplementedError(f"backend '{self.backend}' cannot run a partition of a multi-device function")


class Backend:
    """Compiles graphs for one kind of device. `compile` returns an executable whose `run` and
    `run_step` take buffers that live on that device (host arrays for the CPU and the interpreter).

    A backend is registered with the device types it serves (`registry.register_backend`); a
    partitioned function compiles each partition with the backend of its device's type."""

    name: str = ""

    def compile(
        self, graph: Graph, device: str | None = None, options=None, aliases: dict[int, int] | None = None
    ) -> Executable:
        """Compile `graph` for `device` (a full device name; None: the backend's default device).
        `aliases` (output index -> input index of the same type) are the outputs callers may write
        into donated inputs' buffers; the executable's `aliases` says which ones it honors."""
        raise NotImplementedError
