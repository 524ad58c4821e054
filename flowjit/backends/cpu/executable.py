"""A compiled CPU function: one native entry point `void f(in..., out..., workspace)` taking bare
pointers, called once per call through ctypes (which releases the GIL for the duration).

Outputs are new numpy arrays; a large output's memory is recycled once the caller has
dropped every reference to an earlier result (`OutputRecycler`); the workspace for intermediates
comes from a per-executable pool, so concurrent calls never share one and sequential calls reuse
the same memory.

The call goes through a trampoline (one per argument count, compiled once per process): ctypes hands
it the array *objects* and native code reads each one's data pointer, so Python never computes an
address (`array.ctypes.data` costs about 1 us per array, fifty times the trampoline's read, on a
2-core AMD EPYC Zen 4 VM).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import sysconfig
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowjit.backends.base import Executable
from flowjit.backends.cpu import host, toolchain
from flowjit.backends.cpu.communication import run_in_step
from flowjit.errors import CompileError, FlowjitTypeError
from flowjit.ir import dtypes as dt
from flowjit.ir.types import TensorType

WORKSPACE_ALIGNMENT = 64
# Outputs of at least this many bytes are recycled (`OutputRecycler`). glibc's malloc maps blocks
# from its mmap threshold up (32 MiB, set by `host.keep_kernel_temporaries`) fresh on every
# allocation and unmaps them on free, so each call page-faults such an output in (the kernel zeroes
# every page first): 40% of the elementwise benchmark's call (64 MiB out) on a 2-core AMD EPYC Zen 4
# VM. Smaller blocks come back from malloc's heap already faulted in, and recycling them gains nothing.
RECYCLE_MIN_BYTES = 32 << 20
# Recycled outputs start on a 64-byte line (`OutputRecycler`): numpy's (malloc's) large blocks start
# 16 bytes past one, so every 64-byte vector store of a kernel writing such an output would straddle
# two lines: aligned, the elementwise benchmark's chain into a 64 MiB output runs 20% faster on a
# 2-core Xeon VM (AVX-512). Aligning smaller, non-recycled outputs the same way (a view into a
# 64-byte longer block) gains nothing measurable, so they are left as numpy makes them.
OUTPUT_ALIGNMENT = 64
# Recycled outputs also start far, within a 4 KiB page, from where the call's large inputs start
# (`placement_in_page`): a load whose address matches an earlier, still pending store's in its low
# 12 bits waits for it ("4K aliasing"). numpy's large arrays start 16 bytes into a page, so an output
# 64 bytes in would have the elementwise chain's loads of x run 48 bytes behind its stores to y:
# 12% slower over 16M floats than with the output 256 bytes or more from the input's place (2-core
# AMD EPYC Zen 4 VM; docs/cpu-backend.md). Streamed outputs are placed alike.
PAGE_BYTES = 4096
# Inputs from this size on count as streams that an output should not alias.
STREAM_MIN_BYTES = 1 << 20
# Recycling decides from reference counts, which free-threaded Python builds defer.
_CAN_RECYCLE = not sysconfig.get_config_var("Py_GIL_DISABLED")


@dataclass(frozen=True)
class Buffer:
    """The shape and dtype name of one argument or result buffer (what the cache stores)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def np_dtype(self) -> np.dtype:
        return dt.dtype(self.dtype).np_dtype


class Layout(tuple):
    """The buffers of a function's inputs or outputs, in order."""

    @staticmethod
    def of(types: Sequence[TensorType]) -> Layout:
        return Layout(Buffer(tuple(t.shape), t.dtype.name) for t in types)


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


class OutputRecycler:
    """Result arrays of one shape and dtype, each a new ndarray object, whose memory is reused once
    nothing made from an earlier result is left (a caching allocator for large outputs).

    A result is a view of a block, a uint8 array that owns the memory; the recycler keeps the last
    `KEEP` blocks. numpy points every view of a view at the array that owns the memory, so a result
    and everything made from it (views, memoryviews, ctypes objects) hold a reference to its block:
    a block whose only reference is the recycler's is free, and `take` hands it out again under a
    new result, starting on a 64-byte line (`OUTPUT_ALIGNMENT`). Weak references to a dropped result
    are cleared as for any array. Two blocks serve the usual loop `y = f(x)`, where the previous
    result is alive during the next call. The cost:
    up to `KEEP` blocks stay allocated while the executable lives, and a result does not own its
    memory (`ndarray.resize` refuses it; `.base` is the block).
    """

    KEEP = 2

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape, self.dtype = shape, dtype
        self._nbytes = _nbytes(shape, dtype)
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, in_page: int = 0) -> np.ndarray:
        """A new result array in a free block, or in a new block if none is free, starting `in_page`
        bytes into a page (a multiple of `OUTPUT_ALIGNMENT`; see `placement_in_page`)."""
        blocks = self._blocks
        with self._lock:
            for i in range(len(blocks)):
                # 2: the list's reference and getrefcount's argument. Nothing else can reach a block
                # that low, so its count cannot rise behind our back; the view made here raises it
                # before the lock is released, so no other call takes the same block.
                if sys.getrefcount(blocks[i]) == 2:
                    return self._result_in(blocks[i], in_page)
            block = np.empty(self._nbytes + PAGE_BYTES, np.uint8)
            blocks.append(block)
            if len(blocks) > self.KEEP:
                del blocks[0]  # all in use: the oldest becomes ordinary memory, freed with its results
            return self._result_in(block, in_page)

    def _result_in(self, block: np.ndarray, in_page: int) -> np.ndarray:
        return _view_in_page(block, self.shape, self.dtype, in_page)


@functools.lru_cache(maxsize=256)
def _farthest_in_page(taken: tuple[int, ...]) -> int:
    """The multiple of `OUTPUT_ALIGNMENT` in a page farthest, going round the page, from every
    offset in `taken`."""

    def gap(offset: int) -> int:
        return min(min((offset - t) % PAGE_BYTES, (t - offset) % PAGE_BYTES) for t in taken)

    return max(range(0, PAGE_BYTES, OUTPUT_ALIGNMENT), key=gap)


def placement_in_page(arrays: Sequence[np.ndarray]) -> int:
    """Where in a page a large output of a call on `arrays` should start (`PAGE_BYTES`): as far as
    it can from where each of them of `STREAM_MIN_BYTES` or more starts; on a line (0) if none is
    that large. About a microsecond per large array (its address), so only for outputs of
    `RECYCLE_MIN_BYTES` or more."""
    taken = tuple(sorted({_address(a) % PAGE_BYTES for a in arrays if a.nbytes >= STREAM_MIN_BYTES}))
    return _farthest_in_page(taken) if taken else 0


def _view_in_page(block: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, in_page: int) -> np.ndarray:
    """An array of `shape` and `dtype` in `block` (at least `PAGE_BYTES` longer) starting `in_page`
    bytes into a page."""
    offset = (in_page - _address(block)) % PAGE_BYTES
    return block[offset : offset + _nbytes(shape, dtype)].view(dtype).reshape(shape)


def _placed_empty(shape: tuple[int, ...], dtype: np.dtype, in_page: int = 0) -> np.ndarray:
    """`np.empty(shape, dtype)` starting `in_page` bytes into a page (`.base` is the block holding it)."""
    return _view_in_page(np.empty(_nbytes(shape, dtype) + PAGE_BYTES, np.uint8), shape, dtype, in_page)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _allocators(shapes, dtypes, streamed: Sequence[int] = ()) -> list[Callable[[int], np.ndarray] | None]:
    """How each output nobody provides is made, given where in a page it should start
    (`placement_in_page`, a multiple of 64): by a recycler from `RECYCLE_MIN_BYTES` on; in a block of
    its own if the code writes it with non-temporal stores (`streamed`, output indices: their fast
    branch needs whole aligned lines, and softmax's and layer norm's outputs run slower on the
    other); by `np.empty` (None) otherwise."""
    allocators: list[Callable[[int], np.ndarray] | None] = []
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        nbytes = _nbytes(shape, dtype)
        if _CAN_RECYCLE and nbytes >= RECYCLE_MIN_BYTES:
            allocators.append(OutputRecycler(shape, dtype).take)
        elif index in streamed:
            allocators.append(functools.partial(_placed_empty, shape, dtype))
        else:
            allocators.append(None)
    return allocators


# --- the trampolines -------------------------------------------------------------------------------


def _data_pointer_offset() -> int:
    """Where an ndarray object keeps its data pointer: right after the object header (numpy's C ABI,
    `PyArrayObject_fields.data`, which `PyArray_DATA` reads). Checked on live arrays, a view included."""
    offset = object.__basicsize__
    for probe in (np.empty(3, np.float32), np.arange(6.0)[2:], np.zeros((2, 0))):
        if ctypes.c_void_p.from_address(id(probe) + offset).value != _address(probe):
            raise CompileError(
                "internal error: numpy arrays of this Python/numpy build do not keep their data pointer "
                f"at byte {offset} of the object; the CPU backend's call trampoline cannot read it"
            )
    return offset


def _trampoline_ir(num_arrays: int, offset: int) -> str:
    """`void fj_call_N(ptr fn, ptr array0, ..., ptr workspace)`: calls `fn(data0, ..., workspace)`."""
    params = ", ".join(["ptr %fn", *(f"ptr %a{i}" for i in range(num_arrays)), "ptr %ws"])
    loads = "".join(
        f"  %p{i} = getelementptr inbounds i8, ptr %a{i}, i64 {offset}\n  %d{i} = load ptr, ptr %p{i}, align 8\n"
        for i in range(num_arrays)
    )
    pointers = ", ".join([*(f"ptr %d{i}" for i in range(num_arrays)), "ptr %ws"])
    return f"define void @fj_call_{num_arrays}({params}) {{\n{loads}  tail call void %fn({pointers})\n  ret void\n}}\n"


_trampolines: dict[int, tuple[toolchain.NativeModule, object]] = {}
_trampolines_lock = threading.Lock()


def trampoline(num_arrays: int):
    """The ctypes function `(entry address, *arrays, workspace address)` for entries taking
    `num_arrays` array pointers and the workspace. Each array must be a C-contiguous numpy array."""
    found = _trampolines.get(num_arrays)
    if found is None:
        with _trampolines_lock:
            found = _trampolines.get(num_arrays)
            if found is None:
                module = host.llvm().parse_assembly(_trampoline_ir(num_arrays, _data_pointer_offset()))
                native = toolchain.jit_compile(module, toolchain.target_machine())
                prototype = ctypes.CFUNCTYPE(None, ctypes.c_void_p, *([ctypes.py_object] * num_arrays), ctypes.c_void_p)
                found = _trampolines[num_arrays] = native, prototype(native.address(f"fj_call_{num_arrays}"))
    return found[1]


# A workspace of 0 bytes is never read or written, so every call of such a function can share this one.
_NO_WORKSPACE = np.zeros(WORKSPACE_ALIGNMENT, np.uint8)
_NO_WORKSPACE_ADDRESS = _address(_NO_WORKSPACE)


class CpuExecutable(Executable):
    """Native code for one flowjit function on the host CPU."""

    fresh_outputs = True
    recv_locations: dict[str, str] = {}  # rendezvous key -> its recv's source line (for errors)

    def run_step(self, args, variables, channel):
        """A partition's call (its arguments checked by the caller): send/recv use `channel`."""
        return run_in_step(lambda: self.run_trusted(args), channel, self.recv_locations)

    def __init__(self, native: toolchain.NativeModule, entry, stages, constants: tuple[np.ndarray, ...] = ()):
        """`constants`: arrays the native function takes after the caller's inputs (large constants
        lifted out of the module, `compiler.lift_constants`), passed on every call."""
        self.native = native  # keeps the machine code alive
        self.entry = entry
        self.stages = stages
        self.backend = f"cpu (MLIR -> LLVM, {host.host_cpu().name})"
        own = len(entry.inputs) - len(constants)
        if own < 0 or [(c.shape, c.dtype) for c in constants] != [(b.shape, b.np_dtype) for b in entry.inputs[own:]]:
            raise CompileError("internal error: the lifted constants do not match the function's last inputs")
        self.inputs = Layout(entry.inputs[:own])
        self.outputs = entry.outputs
        self.workspace_bytes = entry.workspace_bytes
        self._constants = tuple(constants)
        self._entry_address = native.address(entry.symbol)
        self._trampoline = trampoline(len(entry.inputs) + len(self.outputs))
        self._out_shapes = [b.shape for b in self.outputs]
        self._out_dtypes = [b.np_dtype for b in self.outputs]
        self._in_specs = [(b.shape, b.np_dtype) for b in self.inputs]
        self._allocators = _allocators(self._out_shapes, self._out_dtypes, entry.streamed_outputs)
        self._allocating = any(a is not None for a in self._allocators)
        self._pool: list[tuple[np.ndarray, int]] = []

    def _take_workspace(self) -> tuple[np.ndarray, int]:
        # list.pop/append are atomic: concurrent calls each get their own workspace, lock-free.
        try:
            return self._pool.pop()
        except IndexError:
            raw = np.empty(self.workspace_bytes + WORKSPACE_ALIGNMENT, np.uint8)
            address = _address(raw)
            return raw, address + (-address % WORKSPACE_ALIGNMENT)

    def check_args(self, args: Sequence[np.ndarray]) -> None:
        """Raise a FlowjitTypeError unless `args` match the compiled signature exactly."""
        if len(args) != len(self._in_specs):
            raise FlowjitTypeError(f"expected {len(self._in_specs)} arrays; found {len(args)}")
        for i, (a, (shape, dtype)) in enumerate(zip(args, self._in_specs)):
            if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dtype:
                found = f"{a.shape} {a.dtype}" if isinstance(a, np.ndarray) else type(a).__name__
                raise FlowjitTypeError(
                    f"argument {i}: expected an array of shape {shape} and dtype {dtype}; found {found}"
                )

    def run(
        self, args: Sequence[np.ndarray], variables: dict | None = None, outputs: dict | None = None
    ) -> list[np.ndarray]:
        """Call the native function on `args` (numpy arrays of the compiled shapes and dtypes);
        `outputs`: donated buffers for outputs in `aliases` (see `Executable.run`)."""
        if variables:
            raise FlowjitTypeError("compiled CPU functions do not take variables yet")
        self.check_args(args)
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in args]
        return self.run_trusted(arrays, self.donated_buffers(outputs))

    def donated_buffers(self, outputs: dict | None) -> dict[int, np.ndarray] | None:
        """The donated buffers this executable may write: outputs it aliases, of their exact layout."""
        if not outputs:
            return None
        kept = {}
        for index, buffer in outputs.items():
            shape, dtype = self._out_shapes[index], self._out_dtypes[index]
            if index not in self.aliases or not isinstance(buffer, np.ndarray):
                raise FlowjitTypeError(f"internal error: output {index} cannot be written into a donated buffer")
            if buffer.shape == shape and buffer.dtype == dtype and buffer.flags.c_contiguous and buffer.flags.writeable:
                kept[index] = buffer
        return kept

    def run_trusted(
        self, args: Sequence[np.ndarray], provided: dict[int, np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """`run` for arguments already known to be C-contiguous numpy arrays of the right types (the
        trampoline reads their data pointers unchecked). `provided` maps output indices to
        caller-owned buffers (C-contiguous, of the output's type) to write instead of fresh arrays."""
        if provided or self._allocating:  # only the outputs nobody provided are allocated (variables, donations)
            provided = provided or {}
            outs = []
            for i, (shape, dtype, make) in enumerate(zip(self._out_shapes, self._out_dtypes, self._allocators)):
                if i in provided:
                    outs.append(provided[i])
                elif make is None:
                    outs.append(np.empty(shape, dtype))
                else:  # clear of the inputs' pages and of the outputs made before it
                    outs.append(make(placement_in_page([*args, *self._constants, *outs])))
        else:
            outs = list(map(np.empty, self._out_shapes, self._out_dtypes))
        if not self.workspace_bytes:
            self._trampoline(self._entry_address, *args, *self._constants, *outs, _NO_WORKSPACE_ADDRESS)
        else:
            workspace = self._take_workspace()
            try:
                self._trampoline(self._entry_address, *args, *self._constants, *outs, workspace[1])
            finally:
                self._pool.append(workspace)
        return outs

    def caller(self, single_output: bool) -> Callable[[Sequence[np.ndarray]], object]:
        """`Executable.caller`; a function of one result and no workspace, the usual small call, gets
        a closure doing only the call's own work (half the time of going through `run_trusted`)."""
        if not single_output or self.workspace_bytes:
            return super().caller(single_output)
        trampoline, entry, constants = self._trampoline, self._entry_address, self._constants
        ((shape, dtype),) = zip(self._out_shapes, self._out_dtypes)
        empty, contiguous = np.empty, np.ascontiguousarray
        (make,) = self._allocators
        if make is not None:

            def call_allocating(args):
                for a in args:
                    if not a.flags.c_contiguous:
                        args = [contiguous(a) for a in args]
                        break
                out = make(placement_in_page(args))
                trampoline(entry, *args, *constants, out, _NO_WORKSPACE_ADDRESS)
                return out

            return call_allocating

        def call(args):
            for a in args:
                if not a.flags.c_contiguous:
                    args = [contiguous(a) for a in args]
                    break
            out = empty(shape, dtype)
            trampoline(entry, *args, *constants, out, _NO_WORKSPACE_ADDRESS)
            return out

        return call
