"""flowjit IR -> MLIR text: one `func.func` per compiled function, for any target.

The function takes bare pointers to static memrefs (`use-bare-ptr-memref-call-conv`): the inputs,
then the outputs, then one `i8` workspace buffer. Every flowjit op is one kernel on tensors:

    operands:  bufferization.to_tensor %buffer restrict          (params, outputs, workspace views)
    compute:   lowerings.tensor[op.name](em, op, operand tensors) -> result tensors   (linalg, tensor, arith, math)
    result:    bufferization.materialize_in_destination %r in restrict writable %destination

Destinations are the outputs for graph results and otherwise `memref.view`s into the workspace at
offsets chosen by `plan_workspace` (liveness-based reuse, 64-byte alignment). A top-level reshape
has no destination: its result is a view of its operand's buffer (`_reshape_aliases`). The workspace ends
with a scratch area for kernel temporaries (`LoweringTable.scratch`: packed matmul panels), sized for the op that
needs most and shared by all, since kernels run one after another. Kernels stay
separate on purpose: a later fusion pass groups ops into one kernel by emitting several ops
between one set of reads and one set of writes.

bool tensors are `i1` in registers and numpy's one-byte bools (`i8`) in memory; reads and writes
of bool buffers convert. Constants are inlined (`arith.constant dense<...>`) when small or splat,
and module globals of bytes (`memref.global`, read through a typed `memref.view`) otherwise, so a
call never re-materializes them.

Ops whose kernels are the same text (a deep network's identical layers) become one private
function of the module, called from each of them, so that it is compiled once (`shared_kernels`).

Lowerings register in their target's table (`target.LoweringTable`), which `lower_graph` takes with
the target; the CPU's modules that fill its table are imported by `flowjit.backends.cpu.compiler`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flowjit.backends.mlir.emitter import (
    KernelEmitter,
    elem_type,
    memory_elem_type,
    memref_type,
    scalar_literal,
    tensor_type,
)
from flowjit.backends.mlir.in_place import in_place_outputs
from flowjit.backends.mlir.sharing import (
    INTERNAL_LINKAGE,
    Piece,
    may_repeat,
    op_pieces,
    shared_kernels,
)
from flowjit.backends.mlir.target import LoweringTable, Target, no_lowering_error
from flowjit.backends.mlir.workspace import ALIGNMENT, aligned, plan_workspace
from flowjit.errors import CompileError
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import single_value
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.types import TensorType

# Non-splat constants with at most this many elements are inlined in the kernels that use them;
# larger ones become read-only module globals.
INLINE_CONSTANT_ELEMENTS = 64


def unit_lead(shape: tuple[int, ...]) -> int:
    """How many leading unit dims `shape` has, keeping at least one dim."""
    lead = 0
    while lead < len(shape) - 1 and shape[lead] == 1:
        lead += 1
    return lead


def can_collapse(shape: tuple[int, ...], collapsed: tuple[int, ...]) -> bool:
    """Whether `collapse_groups(shape, collapsed)` exists for `collapsed` without its leading unit
    dims (`unit_lead`), as `store_through` views take it."""
    try:
        collapse_groups(shape, collapsed[unit_lead(collapsed) :])
    except (CompileError, IndexError):
        return False
    return True


def collapse_groups(shape: tuple[int, ...], collapsed: tuple[int, ...]) -> list[list[int]]:
    """The dims of `shape` that each dim of `collapsed` (the same row-major data, fewer dims) spans,
    in order, as `collapse_shape` takes them; a trailing run of size-1 dims joins the last group."""
    groups: list[list[int]] = []
    i = 0
    for j, extent in enumerate(collapsed):
        group, product = [i], shape[i]
        i += 1
        while i < len(shape) and (product != extent or (j == len(collapsed) - 1)):
            group.append(i)
            product *= shape[i]
            i += 1
        if product != extent:
            raise CompileError(f"internal error: {collapsed} is not a collapse of {shape}")
        groups.append(group)
    return groups


@dataclass(frozen=True)
class MlirModule:
    """The generated MLIR and what the runtime needs to call it. `parts`: when the function was split
    (`lower_graph(split=...)`), the modules that together define it, the first holding the entry
    (`text` then shows them one after the other); empty otherwise. `kernel_kinds`: the kinds of
    kernels the lowerings made (`KernelEmitter.kernel_kinds`), which a target's code generation may
    tune itself to."""

    text: str
    entry: str
    workspace_bytes: int
    inputs: tuple[TensorType, ...]
    outputs: tuple[TensorType, ...]
    parts: tuple[str, ...] = ()
    kernel_kinds: frozenset[str] = frozenset()


# --- constants ---------------------------------------------------------------------------------


def splat_value(value: Value):
    """The scalar every element of `value` equals when it is a splat constant (possibly broadcast
    or reshaped), else None."""
    op = value.producer
    while op is not None and op.name in ("broadcast", "reshape"):
        op = op.operands[0].producer
    if op is None or op.name != "constant":
        return None
    array = op.attrs["value"]
    if array.size == 0 or value.type.size == 0:
        return None
    return array.flat[0] if single_value(array) else None


def dense_literal(array: np.ndarray, dtype: dt.DType) -> str:
    """`dense<...>` for `array`: its raw little-endian bytes in hex (bools as one byte each)."""
    data = np.ascontiguousarray(array, dtype=dtype.np_dtype)
    return f'dense<"0x{data.tobytes().hex().upper()}">'


# --- the driver --------------------------------------------------------------------------------


class _FunctionLowering:
    """State of one `lower_graph` call: where each value lives and how to read it."""

    def __init__(self, graph: Graph, name: str, target: Target):
        self.graph = graph
        self.name = name
        self.target = target
        self.lowerings = target.lowerings
        self.em = KernelEmitter(target)
        self.globals: list[str] = self.em.globals
        self.buffers: dict[Value, str] = {}  # value -> memref SSA name holding it
        self.inline: dict[Value, str] = {}  # constant value -> tensor SSA name (emitted on first read)
        self.result_outputs: dict[Value, str] = {}  # op result that is a graph result -> its output arg
        self.virtual = _virtual_splats(graph, target.lowerings)  # splats only read as scalars: never computed or stored
        self.global_symbols: dict[Value, str] = {}  # large constant -> its module global
        self.op_local: set[Value] = set()  # values whose `buffers` entry is an SSA name of the current op
        self.lowered: list[Op] = []  # the top-level ops lowered, in order (each begins a `starts` entry)
        self.slice_views: dict[Value, SliceView] = {}  # slices no kernel computes (`_slice_views`)

    def start_op(self) -> None:
        """Forget what earlier ops emitted (constants, global reads), so that each op's lines use only
        the function's arguments and prologue: any run of ops is then a function body of its own."""
        self.inline.clear()
        for value in self.op_local:
            del self.buffers[value]
        self.op_local.clear()

    # Reading a value as a tensor.
    def read(self, value: Value) -> str:
        if value in self.inline:
            return self.inline[value]
        if value.type.size == 0:  # no data: never touches memory
            return self.em.empty(value.type)
        if value in self.virtual:  # a placeholder: the consumer uses the splat scalar
            self.inline[value] = self.em.empty(value.type)
            return self.inline[value]
        if value.producer is not None and value.producer.name == "constant" and value not in self.buffers:
            return self._constant_tensor(value)
        if value in self.slice_views:  # its reader copies the slice's blocks from the source itself
            return self.read(self.slice_views[value].source)
        buffer = self.buffers[value]
        t = value.type
        memory_tensor = tensor_type(t, memory_elem_type(t.dtype))
        loaded = self.em.op(f"bufferization.to_tensor {buffer} restrict : {memref_type(t)} to {memory_tensor}")
        if not t.dtype.is_bool:
            return loaded
        return bool_from_bytes(self.em, loaded, t)

    def _constant_tensor(self, value: Value) -> str:
        array = value.producer.attrs["value"]
        t = value.type
        splat = splat_value(value)
        if splat is not None and array.size > INLINE_CONSTANT_ELEMENTS and not t.dtype.is_bool:
            # A fill, not a splat literal: bufferization would make the literal a full-size global.
            e = elem_type(t.dtype)
            scalar = self.em.op(f"arith.constant {scalar_literal(splat, t.dtype)} : {e}")
            tensor = self.em.op(
                f"linalg.fill ins({scalar} : {e}) outs({self.em.empty(t)} : {tensor_type(t)}) -> {tensor_type(t)}"
            )
            self.inline[value] = tensor
            return tensor
        if array.size <= INLINE_CONSTANT_ELEMENTS:
            literal = dense_literal(array, t.dtype)
            tensor = self.em.literal(literal, tensor_type(t, memory_elem_type(t.dtype)))
            if t.dtype.is_bool:  # as bytes, so no i1 constant buffer can arise
                tensor = bool_from_bytes(self.em, tensor, t)
            self.inline[value] = tensor
            return tensor
        # Held as bytes and viewed with its type: MLIR's translation writes an array of i8 as one
        # string (c"..."), but an array of floats element by element, and llvmlite then parses them
        # back: seconds for a closed-over (512, 512) float32.
        data = np.ascontiguousarray(array, dtype=t.dtype.np_dtype)
        bytes_type = f"memref<{max(data.nbytes, 1)}xi8>"
        symbol = self.global_symbols.get(value)
        if symbol is None:
            symbol = self.global_symbols[value] = f"cst{len(self.globals)}"
            self.globals.append(
                f'  memref.global "private" constant @{symbol} : {bytes_type} = '
                f'dense<"0x{data.tobytes().hex().upper()}"> {{alignment = {ALIGNMENT} : i64}}'
            )
        stored = self.em.op(f"memref.get_global @{symbol} : {bytes_type}")
        start = self.em.op("arith.constant 0 : index")
        self.buffers[value] = self.em.op(f"memref.view {stored}[{start}][] : {bytes_type} to {memref_type(t)}")
        self.op_local.add(value)
        return self.read(value)

    # Writing a kernel's result tensor to its buffer.
    def write(self, tensor: str, value: Value, buffer: str) -> None:
        t = value.type
        if t.size == 0:
            return
        if t.dtype.is_bool:
            tensor = bool_to_bytes(self.em, tensor, t)
        view = self.em.flat_views.get(tensor)
        if view is not None and (self.em.target is None or self.em.target.store_through_views):
            # store the kernel's result through a collapsed view of the buffer
            flat, shape = view
            kernel_t = TensorType(shape, t.dtype)
            buffer = self._viewed_as(buffer, t, kernel_t)
            tensor, t = flat, kernel_t
        elif t.rank == 0 and self.em.target is not None and not self.em.target.rank0_kernels:
            # A target without rank-0 kernels computed it as one element of rank 1: stored through
            # a rank-1 view of the buffer, that kernel writes the buffer itself (no copy kernel).
            one, elem = t.with_shape((1,)), memory_elem_type(t.dtype)
            into = f"{tensor_type(t, elem)} into {tensor_type(one, elem)}"
            tensor = self.em.op(f"tensor.expand_shape {tensor} [] output_shape [1] : {into}")
            buffer = self.em.op(
                f"memref.expand_shape {buffer} [] output_shape [1] : {memref_type(t)} into {memref_type(one)}"
            )
            t = one
        self.em.line(
            f"bufferization.materialize_in_destination {tensor} in restrict writable {buffer} : "
            f"({tensor_type(t, memory_elem_type(t.dtype))}, {memref_type(t)}) -> ()"
        )

    def reshaped_buffer(self, source: Value, t: TensorType) -> str:
        """The buffer of `source` viewed with `t`'s shape (a reshape that copies nothing)."""
        buffer, s = self.buffers[source], source.type
        if s.rank > 1:
            flat = s.with_shape((s.size,))
            groups = ", ".join(str(d) for d in range(s.rank))
            buffer = self.em.op(
                f"memref.collapse_shape {buffer} [[{groups}]] : {memref_type(s)} into {memref_type(flat)}"
            )
            s = flat
        if t.rank > 1:
            groups = ", ".join(str(d) for d in range(t.rank))
            shape = ", ".join(str(d) for d in t.shape)
            into = f"{memref_type(s)} into {memref_type(t)}"
            buffer = self.em.op(f"memref.expand_shape {buffer} [[{groups}]] output_shape [{shape}] : {into}")
        return buffer

    def _viewed_as(self, buffer: str, t: TensorType, kernel: TensorType) -> str:
        """`buffer` (of type `t`) viewed with the shape of `kernel` (`store_through`): collapsed to it,
        leading unit dims of the kernel's shape added back by an expand (a gather's (1, count,
        inner) rows, which no collapse of the result's shape gives)."""
        lead = unit_lead(kernel.shape)
        core = kernel.with_shape(kernel.shape[lead:])
        if t.shape != core.shape:
            groups = ", ".join(f"[{', '.join(map(str, g))}]" for g in collapse_groups(t.shape, core.shape))
            into = f"{memref_type(t)} into {memref_type(core)}"
            buffer = self.em.op(f"memref.collapse_shape {buffer} [{groups}] : {into}")
        if lead:
            groups = [list(range(lead + 1))] + [[d] for d in range(lead + 1, kernel.rank)]
            text = ", ".join(f"[{', '.join(map(str, g))}]" for g in groups)
            buffer = self.em.op(
                f"memref.expand_shape {buffer} [{text}] output_shape [{', '.join(map(str, kernel.shape))}] "
                f": {memref_type(core)} into {memref_type(kernel)}"
            )
        return buffer

    def lower_op(self, op: Op) -> None:
        table = self.lowerings
        if op.name in table.buffer:
            table.buffer[op.name](self, op)
            return
        if op.name in table.call and table.call[op.name](self, op):
            return
        fn = table.tensor.get(op.name)
        if fn is None:
            raise no_lowering_error(op, table.target)
        operands = [self.read(v) for v in op.operands]
        self.em.operand_slices = {i: self.slice_views[v] for i, v in enumerate(op.operands) if v in self.slice_views}
        try:
            results = fn(self.em, op, operands)
        finally:
            self.em.operand_slices = {}
        if len(results) != len(op.results):
            raise CompileError(
                f"internal error: the {table.target} lowering of '{op.name}' returned {len(results)} results, "
                f"expected {len(op.results)}"
            )
        for value, tensor in zip(op.results, results):
            self.write(tensor, value, self.buffers.get(value))  # zero-size values have no buffer


def _virtual_splats(graph: Graph, table: LoweringTable) -> set[Value]:
    users = graph.uses()
    results = set(graph.results)
    return {
        v
        for op in graph.ops
        for v in op.results
        if v not in results
        and v in users
        and all(_inlines_splat(table, u, v) for u in users[v])
        and splat_value(v) is not None
    }


def _inlines_splat(table: LoweringTable, user: Op, v: Value) -> bool:
    """Whether `user`'s lowering reads its operand `v` as a scalar when `v` is a splat."""
    positions = table.inlines_splat_operands.get(user.name, set())
    return user.name in table.inlines_splats or all(i in positions for i, o in enumerate(user.operands) if o is v)


def call_lowering(match: Callable, needs_scratch: bool = False) -> Callable[..., bool]:
    """A `LoweringTable.call` entry for a precompiled library: `match(op)` says how `op` calls it (an
    object whose `emit(em, *buffers)` writes the call on its operands' and results' buffers) or
    None; the entry returns False, and the op gets its tensor lowering, when it does not, when a
    value has no buffer (`call_buffers`) or, with `needs_scratch`, when the function has no scratch
    area."""

    def lower(fl, op: Op) -> bool:
        call = match(op)
        buffers = call_buffers(fl, op) if call is not None else None
        if buffers is None or (needs_scratch and fl.em.scratch is None):
            return False
        call.emit(fl.em, *buffers)
        return True

    return lower


def call_buffers(fl, op: Op) -> list[tuple[str, str]] | None:
    """For a call into a precompiled library (`LoweringTable.call`): the buffers (memref, type) of `op`'s
    operands, then its results, or None when one has none (a splat, a slice no kernel computes).
    A large constant operand is read first: a view of its module global."""
    for v in op.operands:
        if v not in fl.buffers and v.producer is not None and v.producer.name == "constant":
            fl.read(v)
    values = (*op.operands, *op.results)
    if any(v not in fl.buffers for v in values):
        return None
    return [(fl.buffers[v], memref_type(v.type)) for v in values]


def _as_one_element(em: KernelEmitter, tensor: str, t: TensorType, elem: str) -> str:
    return em.op(f"tensor.expand_shape {tensor} [] output_shape [1] : {tensor_type(t, elem)} into tensor<1x{elem}>")


def _without_rank0_kernels(em: KernelEmitter, t: TensorType) -> bool:
    return t.rank == 0 and em.target is not None and not em.target.rank0_kernels


def bool_from_bytes(em: KernelEmitter, tensor: str, t: TensorType) -> str:
    """numpy bool bytes (i8) -> i1 tensor (any nonzero byte is true)."""
    if _without_rank0_kernels(em, t):  # one element of rank 1 (`Target.rank0_kernels`)
        one = bool_from_bytes(em, _as_one_element(em, tensor, t, "i8"), t.with_shape((1,)))
        result = em.op(f"tensor.collapse_shape {one} [] : tensor<1xi1> into tensor<i1>")
        em.bool_bytes[result] = tensor
        return result
    zero_map = em.identity_map(t.rank)

    def body(b, args):
        zero = b.const(0, "i8")
        return b.op(f"arith.cmpi ne, {args[0]}, {zero} : i8")

    result = em.generic(
        [(tensor, tensor_type(t, "i8"))],
        (em.empty(t), tensor_type(t)),
        [zero_map, zero_map],
        ["parallel"] * t.rank,
        body,
        ["i8"],
        "i1",
    )
    em.bool_bytes[result] = tensor
    return result


def bool_to_bytes(em: KernelEmitter, tensor: str, t: TensorType) -> str:
    """i1 tensor -> numpy bool bytes (0 or 1); the bytes it was read from when there are some."""
    if tensor in em.bool_bytes:
        return em.bool_bytes[tensor]
    if _without_rank0_kernels(em, t):  # one element of rank 1 (`Target.rank0_kernels`)
        one = bool_to_bytes(em, _as_one_element(em, tensor, t, "i1"), t.with_shape((1,)))
        result = em.op(f"tensor.collapse_shape {one} [] : tensor<1xi8> into tensor<i8>")
        em.bool_bytes[tensor] = result
        return result
    identity = em.identity_map(t.rank)
    result = em.generic(
        [(tensor, tensor_type(t))],
        (em.empty(t, "i8"), tensor_type(t, "i8")),
        [identity, identity],
        ["parallel"] * t.rank,
        lambda b, args: b.op(f"arith.extui {args[0]} : i1 to i8"),
        ["i1"],
        "i8",
    )
    em.bool_bytes[tensor] = result
    return result


def _arg_type(t: TensorType) -> str:
    # Zero-size buffers are never accessed; a placeholder type keeps every argument a bare pointer
    # (the bare-pointer convention silently falls back to descriptors for shapes with a 0 extent).
    return "memref<1xi8>" if t.size == 0 else memref_type(t)


# A function is split (`lower_graph(split=n)`) only when its body has at least this many lines: a
# part's MLIR pipelines then run in a forked process (`parallel_mlir`), whose start costs a few
# milliseconds and slows this process's own part by its copy-on-write faults. On a 2-core AMD EPYC
# Zen 4 VM the MLP training step (2,750 lines) gains a fifth of its first call, while the CNN
# forward (650 lines) gains nothing.
SPLIT_MIN_LINES = 1200


def _lower_function(
    graph: Graph, target: Target, name: str, late_outputs: frozenset[int], in_place: frozenset[int], by_op: bool
):
    """The function's lines: (lowering state, arguments, prologue length, where each op's lines and
    schedules begin, workspace bytes). `by_op`: each op's lines use only the arguments and the
    prologue (`start_op`), so that any run of ops can be a function of its own. Late outputs in
    `in_place` are their producers' destinations like other outputs."""
    fl = _FunctionLowering(graph, name, target)
    em = fl.em
    args = []
    for i, p in enumerate(graph.params):
        fl.buffers[p] = f"%in{i}"
        args.append(f"%in{i}: {_arg_type(p.type)}")
    outputs = [f"%out{i}" for i in range(len(graph.results))]
    # Outputs may carry a target's attribute (the CPU's non-temporal stores); not late ones, which may
    # be an input's buffer.
    read = sum(p.type.nbytes for p in graph.params)
    written = sum(r.type.nbytes for r in graph.results)
    for index, (out, result) in enumerate(zip(outputs, graph.results)):
        attribute = None if index in late_outputs else target.output_attribute(result.type.nbytes, read, written)
        args.append(f"{out}: {_arg_type(result.type)}{f' {{{attribute}}}' if attribute else ''}")

    # The first output holding a value produced by an op is that op's destination; other outputs
    # (params, constants, repeated results) get a copy at the end.
    for index, (out, value) in enumerate(zip(outputs, graph.results)):
        if index in late_outputs and index not in in_place:
            continue
        if value.producer is not None and value.producer.name != "constant" and value not in fl.result_outputs:
            fl.result_outputs[value] = out
            fl.buffers[value] = out

    views = target.lowerings.views

    def needs_slot(v: Value) -> bool:
        return (
            v.type.size > 0
            and v not in fl.result_outputs
            and v.producer.name != "constant"
            and not (v.producer.name in views and views[v.producer.name](v.producer))
            and v not in fl.virtual
            and v not in aliases
            and v not in fl.slice_views
        )

    aliases: dict[Value, Value] = {}
    aliases.update(_reshape_aliases(graph, fl, needs_slot))
    fl.slice_views = _slice_views(graph, fl)
    # A slice view's source lives as long as the view's readers (through a reshape alias, its root).
    viewed = {v: aliases.get(view.source, view.source) for v, view in fl.slice_views.items()}
    offsets, planned = plan_workspace(graph, needs_slot, {**aliases, **viewed})
    planned = aligned(planned)
    scratch_bytes = target.lowerings.scratch
    scratch = aligned(max((scratch_bytes[op.name](op) for op in graph.walk() if op.name in scratch_bytes), default=0))
    workspace = planned + scratch
    ws_type = f"memref<{max(workspace, 1)}xi8>"
    args.append(f"%ws: {ws_type}")
    for value, offset in offsets.items():
        c = em.op(f"arith.constant {offset} : index")
        fl.buffers[value] = em.op(f"memref.view %ws[{c}][] : {ws_type} to {memref_type(value.type)}")
    if scratch:
        c = em.op(f"arith.constant {planned} : index")
        em.scratch = (em.op(f"memref.view %ws[{c}][] : {ws_type} to memref<{scratch}xi8>"), scratch)
    for alias in aliases:  # in op order: an alias of an alias views the first one's view
        fl.buffers[alias] = fl.reshaped_buffer(alias.producer.operands[0], alias.type)

    prologue = len(em.body)
    starts: list[tuple[int, int]] = []  # (body line, schedule) where each lowered op begins
    for op in graph.ops:
        if op.name != "constant" and not (
            op.results and all(v in fl.virtual or v in aliases or v in fl.slice_views for v in op.results)
        ):
            if by_op:
                fl.start_op()
            starts.append((len(em.body), len(em.schedules)))
            fl.lowered.append(op)
            fl.lower_op(op)
    if by_op:
        fl.start_op()  # the copies to late and repeated outputs go with the last op
    for out, value in zip(outputs, graph.results):
        if fl.result_outputs.get(value) != out:
            fl.write(fl.read(value), value, out)
    return fl, args, prologue, starts, workspace


class SliceView(NamedTuple):
    """A top-level slice no kernel computes (`_slice_views`): its readers copy its blocks straight
    from `source`, starting at `start`."""

    source: Value
    start: tuple[int, ...]


def _slice_views(graph: Graph, fl: _FunctionLowering) -> dict[Value, SliceView]:
    """Top-level slices read only by concatenates along the one axis they cut (unit strides, every
    other axis whole: `fnp.roll`'s two pieces, `concatenate([x[..., h:], x[..., :h]])`): each such
    slice is a run of contiguous blocks of its source, which the concatenate copies from the source
    directly (`lower_movement._concatenate_blocks`) instead of from a copy of the slice made by a
    kernel of its own: one kernel instead of three, two to three times faster, and a shorter first
    call. The source then lives until the concatenate (its
    workspace slot is not reused before). Not for bool slices (moved as bytes) or a graph result
    (it has an output to fill)."""
    users = graph.uses()
    results = set(graph.results)
    views: dict[Value, SliceView] = {}
    for op in graph.ops:
        if op.name != "slice":
            continue
        (source,), (result,) = op.operands, op.results
        readers = users.get(result, [])
        start, stride = tuple(op.attrs["start"]), tuple(op.attrs["stride"])
        if (
            not readers
            or result in results
            or result.type.size == 0
            or result.type.dtype.is_bool
            or source in fl.virtual
            or any(s != 1 for s in stride)
        ):
            continue
        if all(reader.name == "concatenate" and _cuts_only(op, reader.attrs["axis"]) for reader in readers):
            views[result] = SliceView(source, start)
    return views


def _cuts_only(op: Op, axis: int) -> bool:
    """Whether slice `op` keeps every axis of its operand whole but `axis`."""
    source, result = op.operands[0].type, op.result.type
    return all(
        op.attrs["start"][d] == 0 and result.shape[d] == source.shape[d] for d in range(source.rank) if d != axis
    )


def _reshape_aliases(graph: Graph, fl: _FunctionLowering, needs_slot: Callable[[Value], bool]) -> dict[Value, Value]:
    """Top-level reshapes whose result is a view of their operand's buffer instead of a copy into a
    slot of its own (a CNN's (64, 32, 14, 14) -> (64, 6272) before its dense layer: 1.6 MB copied
    per call): result -> the value whose memory it views. The operand must have a buffer from the
    prologue on (an input, an output, a slot); the result must not be a graph result (an output
    of its own)."""
    aliases: dict[Value, Value] = {}
    results = set(graph.results)
    for op in graph.ops:
        if op.name != "reshape":
            continue
        (source,), (result,) = op.operands, op.results
        root = aliases.get(source, source)
        has_buffer = root in graph.params or root in fl.result_outputs or (root.producer and needs_slot(root))
        if (
            has_buffer
            and result not in results
            and result not in fl.virtual
            and result.type.size > 0
            and source.type.rank > 0
            and result.type.rank > 0
        ):
            aliases[result] = root
    return aliases


def lower_graph(
    graph: Graph,
    target: Target,
    name: str | None = None,
    late_outputs: frozenset[int] = frozenset(),
    split: int = 1,
    aliased: dict[int, int] | None = None,
) -> MlirModule:
    """The MLIR module (text) computing `graph` in one function with `target`'s lowerings, plus its
    calling layout.

    Outputs in `late_outputs` are written only at the very end of the function (from a workspace
    slot), never as a kernel's destination: the caller may pass the same buffer as one of the
    inputs (a variable updated in place), which must stay intact until its last read. `aliased`
    (late output -> the input whose buffer the caller may pass for it) lets the late outputs that
    `in_place_outputs` finds safe be written in place instead, by the kernel computing them.

    `split` > 1 asks for the function in up to that many modules (`MlirModule.parts`), so that their
    MLIR pipelines can run at once: each part is a function of the same arguments running a run of
    consecutive top-level ops, and ends by calling the next part. Ops talk only through buffers
    (outputs and workspace slots), so no value crosses a part's boundary; each op's lines are made
    to use only the arguments and the prologue's workspace views (`start_op`) when the body is
    large enough (`SPLIT_MIN_LINES`; estimated first, `_estimated_lines`, and lowered again when the
    estimate was wrong): a function that stays whole is the same text as with `split=1`. Graphs
    that send or receive (module-level runtime declarations) stay whole.
    """
    target.lowerings.check(graph)
    name = name or "fj_" + "".join(c if c.isalnum() or c == "_" else "_" for c in graph.name)
    whole_only = any(op.name in _UNSPLITTABLE for op in graph.walk())
    allowed = split > 1 and not whole_only
    may_share = not whole_only and may_repeat(graph)
    by_op = may_share or (allowed and _estimated_lines(graph) >= SPLIT_MIN_LINES)
    in_place = frozenset(in_place_outputs(graph, {o: i for o, i in (aliased or {}).items() if o in late_outputs}))
    fl, args, prologue, starts, workspace = _lower_function(graph, target, name, late_outputs, in_place, by_op)
    pieces = shared_kernels(fl.em, fl.lowered, name, args, prologue, starts) if may_share else None
    if pieces is None:
        splittable = allowed and len(fl.em.body) >= SPLIT_MIN_LINES and len(starts) >= 2
        if splittable != by_op:  # the estimate was wrong: lowered again, so that only split functions
            # have each op on its own (a function that stays whole keeps its shared constants)
            fl, args, prologue, starts, workspace = _lower_function(
                graph, target, name, late_outputs, in_place, splittable
            )
        pieces = op_pieces(fl.em, prologue, starts)
    else:
        splittable = allowed and sum(p.weight for p in pieces) >= SPLIT_MIN_LINES and len(pieces) >= 2
    em = fl.em
    header = (
        f"// flowjit function '{graph.name}' -> @{name}(inputs, outputs, workspace)\n// workspace: {workspace} bytes\n"
    )
    if in_place:
        pairs = ", ".join(f"%out{o} in %in{aliased[o]}" for o in sorted(in_place))
        header += f"// written in place: {pairs}\n"

    layout = (name, workspace, tuple(p.type for p in graph.params), tuple(r.type for r in graph.results))
    cuts = _cuts(_piece_starts(pieces, prologue), prologue + sum(p.cost for p in pieces), split) if splittable else []
    if not cuts:
        if any(p.function for p in pieces):
            body = em.body[:prologue] + [line for p in pieces for line in p.lines]
            schedules = [line for p in pieces for line in p.schedules]
            functions = [line for p in pieces for line in p.function]
        else:
            body, schedules, functions = em.body, em.schedules, []
        text = _module_text(fl, name, args, body, schedules, fl.globals, None, functions)
        return MlirModule(
            header + text,
            *layout,
            kernel_kinds=frozenset(em.kernel_kinds),
        )
    bounds = [0, *(index for _, index in cuts), len(pieces)]
    defined_in = {p.callee: k for k in range(len(bounds) - 1) for p in pieces[bounds[k] : bounds[k + 1]] if p.function}
    called_from = {}
    for k in range(len(bounds) - 1):
        for p in pieces[bounds[k] : bounds[k + 1]]:
            if p.callee is not None:
                called_from.setdefault(p.callee, set()).add(k)
    parts = []
    for k in range(len(bounds) - 1):
        mine = pieces[bounds[k] : bounds[k + 1]]
        body = em.body[:prologue] + [line for p in mine for line in p.lines]
        functions = []
        for p in mine:
            if p.function and called_from[p.callee] != {k}:  # called from other parts too: linked by name
                opening = (
                    p.function[0]
                    .replace("func.func private @", "func.func @", 1)
                    .replace(f" attributes {{{INTERNAL_LINKAGE}}}", "")
                )
                functions += [opening, *p.function[1:]]
            else:
                functions += p.function
        declarations = {
            p.callee: f"  func.func private @{p.callee}({p.types})"
            for p in mine
            if p.callee is not None and defined_in[p.callee] != k
        }
        used = set(_SYMBOL.findall("\n".join(body + functions)))
        globals_ = [g for g in fl.globals if _SYMBOL.search(g).group(1) in used]
        callee = f"{name}_part{k + 1}" if k + 2 < len(bounds) else None
        part_name = name if k == 0 else f"{name}_part{k}"
        schedules = [line for p in mine for line in p.schedules]
        text = _module_text(
            fl, part_name, args, body, schedules, globals_, callee, functions, list(declarations.values())
        )
        parts.append(f"// part {k + 1} of {len(bounds) - 1} of {header[3:]}{text}")
    return MlirModule(
        "\n".join(parts),
        *layout,
        parts=tuple(parts),
        kernel_kinds=frozenset(em.kernel_kinds),
    )


def _piece_starts(pieces: list[Piece], prologue: int) -> list[tuple[int, int]]:
    """(where the piece begins, in the cost of the pieces before it, its index): `_cuts`'s input."""
    starts, line = [], prologue
    for index, piece in enumerate(pieces):
        starts.append((line, index))
        line += piece.cost
    return starts


# Ops whose lowerings add module-level declarations and globals of their own (runtime calls).
_UNSPLITTABLE = frozenset({"send", "recv", "send_done"})
# Rough lines of MLIR per op (nested ones included), to lower a function op by op at once when it
# will likely be split: contractions expand into packed kernels (the MLP step: 113 ops, 8 of them
# matmuls, 2,750 lines; the CNN: 14 ops, 650 lines).
_LINES_PER_OP = {"dot_general": 150, "conv2d": 150}
_LINES_PER_OTHER_OP = 12


def _estimated_lines(graph: Graph) -> int:
    return sum(_LINES_PER_OP.get(op.name, _LINES_PER_OTHER_OP) for op in graph.walk())


_SYMBOL = re.compile(r"@([\w$.-]+)")


def _cuts(starts: list[tuple[int, int]], end: int, parts: int) -> list[tuple[int, int]]:
    """Where to cut the ops (at most `parts - 1` of `starts`) so that the parts' lines are even."""
    if len(starts) < 2:
        return []
    parts = min(parts, len(starts))
    first, total = starts[0][0], end - starts[0][0]
    cuts: list[tuple[int, int]] = []
    for k in range(1, parts):
        target = first + total * k / parts
        best = min(starts[1:], key=lambda s: abs(s[0] - target))
        if best not in cuts and (not cuts or best[0] > cuts[-1][0]):
            cuts.append(best)
    return cuts


def _module_text(
    fl: _FunctionLowering,
    name: str,
    args: list[str],
    body: list[str],
    schedules: list[str],
    globals_: list[str],
    callee: str | None,
    functions: list[str] = (),
    declarations: list[str] = (),
) -> str:
    """One module: `@name(args)` running `body` (then calling `callee` with the same arguments)."""
    tail = []
    declarations = list(declarations)
    if callee is not None:
        names = ", ".join(a.split(":", 1)[0] for a in args)
        types = ", ".join(a.split(": ", 1)[1].split(" {", 1)[0] for a in args)  # without argument attributes
        tail.append(f"    func.call @{callee}({names}) : ({types}) -> ()")
        declarations.append(f"  func.func private @{callee}({types})")
    lines = [
        fl.em.module_prelude(),
        "module attributes {transform.with_named_sequence} {" if schedules else "module {",
        *globals_,
        *declarations,
        *functions,
        f"  func.func @{name}({', '.join(args)}) {{",
        *body,
        *tail,
        "    return",
        "  }",
        *fl.em.schedule_lines(schedules),
        "}",
        "",
    ]
    return "\n".join(lines)


__all__ = ["MlirModule", "call_lowering", "lower_graph", "plan_workspace"]
