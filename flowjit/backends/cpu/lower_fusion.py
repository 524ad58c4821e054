"""CPU lowering of `fusion` ops (made by the `fuse` pass): the whole group between one set of reads
and one set of writes, its elementwise work inside as few loop nests as possible.

Pointwise ops (elementwise ops and converts) are never kernels of their own: their scalar code is
inlined into the `linalg.generic` of whatever needs their value:
- a **reduction** whose input is pointwise runs that computation inside its own loop (softmax's
  `sum(exp(x - max))` reads x once and stores only the row sums);
- values the group returns, or that other members (reshapes, contractions, ...) read, are computed
  by one multi-result generic per shape;
- broadcasts become indexing maps and splat constants scalars, so neither is ever stored.
The scalar code is the one-op lowerings' own (`lower_elementwise`), rounding after every op as
they do, so fused and unfused results are bit-identical. Two exceptions sum floats in another
order: a reduction of a transposed group input, which reduces that input along the permuted axes
(`_reduce_transposed`: `x.T.sum(1)` is x's column sum, no transposed copy), and a reduction with no
(A, R, B) form (broadcast values, `sum((a[:, None] - b[None]) ** 2, -1)`, or axes in several
groups), which iterates the n-d space in blocks of its own and reduces several axes last first
(`_emit_reduction`, `schedule.reduction`).

Cost check: a pointwise value read by several consumers is recomputed in each (no intermediate
buffer) while its expression costs at most `RECOMPUTE_BUDGET` (in simple instructions per element,
transcendental functions ~8: over whole tensors, recomputing exp(x - max) in a sum and a division
is cheaper than a 16 MB round trip through memory); above it, it is computed once and stored.
Inside a row tile (`lower_rows`), where a stored tile stays in cache, a shared value with a math
function in it is computed once into an output's tile instead (`_store_in_output`).
Other members use their one-op lowerings on tensors, with their own schedules.

A member op's scalar code and cost are in `fusion_ops`, the schedules of the generics written here
in `fusion_schedule`, and a conv2d's or dot_general's epilogue group in `fusion_epilogue`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowjit.backends.cpu import contraction, lower_conv, lower_dot, lower_rows, row_library
from flowjit.backends.cpu.fusion_epilogue import FusedEpilogue
from flowjit.backends.cpu.fusion_ops import generic_body, is_pointwise, op_weight
from flowjit.backends.cpu.fusion_schedule import schedule_generic
from flowjit.backends.cpu.target import CALL_LOWERINGS, LOWERINGS, SCRATCH, lowering
from flowjit.backends.mlir import lower_reduction
from flowjit.backends.mlir.emitter import (
    KernelEmitter,
    ScalarBuilder,
    elem_type,
    memory_elem_type,
    scalar_literal,
    tensor_type,
)
from flowjit.backends.mlir.lower_elementwise import reshape_tensor
from flowjit.backends.mlir.lowering import bool_from_bytes, bool_to_bytes, call_lowering, dense_literal, splat_value
from flowjit.backends.mlir.target import no_lowering_error
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.ops.reduction import reduction_identity
from flowjit.ir.types import TensorType

RECOMPUTE_BUDGET = 24
_MANY = object()  # `_shared_values`: a value computed in more than one generic
# In a row tile, a value read by several ops that costs this much (a math function, or eight simple
# ops) is stored in an output's tile when one reads it (`_store_in_output`).
TILE_MATERIALIZE_COST = 8
_REDUCE_KINDS = lower_reduction.REDUCE_OPS


class _FusionLowering:
    """State of one fusion op's lowering: the tensor of each body value, emitted on demand."""

    def __init__(
        self, em: KernelEmitter, body: Graph, operands: list[str], tile: bool = False, destinations: dict | None = None
    ):
        self.em = em
        self.body = body
        self.tile = tile  # the body of a row loop nest (`lower_rows`): its kernels stay on one thread
        # result -> (1-D, shaped) tensor to compute it into (its slice of the nest's output)
        self.destinations: dict[Value, tuple[str, str]] = destinations or {}
        self.tensors: dict[Value, str] = dict(zip(body.params, operands))
        # A parameter whose buffer the result may be written into (`lower_fusion`), and whether it was.
        self.accumulator: Value | None = None
        self.accumulated = False
        users = body.uses()
        cost: dict[Value, int] = {}
        # A pointwise value read by several ops is recomputed in each generic that needs it when
        # that is cheap (memory traffic dominates), else stored once (`materialized`); one whose
        # readers all end in the same generic is computed once there, and never stored.
        self.materialized: set[Value] = set()
        # output -> the materialized value stored in its tile, which its generic overwrites in place
        self.in_place: dict[Value, Value] = {}
        shared = self._shared_values(users)
        for op in body.ops:
            if not self._pointwise(op):
                continue
            cost[op.result] = op_weight(op) + sum(cost.get(v, 0) for v in op.operands if v not in self.materialized)
            readers = len(set(users.get(op.result, ())))
            if readers > 1 and op.result in shared and cost[op.result] > RECOMPUTE_BUDGET:
                self.materialized.add(op.result)
            elif readers + (op.result in body.results) > 1 and cost[op.result] >= TILE_MATERIALIZE_COST:
                self._store_in_output(op.result)

    def _shared_values(self, users: dict[Value, list[Op]]) -> set[Value]:
        """The pointwise values that more than one generic would compute if no value were stored.
        Outside a row tile a pointwise value is computed in the generic of the body results of its
        shape, or of each non-pointwise op reading it (a reduction, a broadcast, a reshape), one for
        every such place its readers lead to; a value whose readers all lead to one place (an
        unrolled `x = x + dt * f(x)`: x read twice per step, every step in the one generic of the
        result) is an SSA value read twice in that generic. In a row tile every pointwise value
        counts as shared: the tile stores some values in its outputs (`_store_in_output`), which
        the readers' count alone decides."""
        pointwise = [op for op in self.body.ops if self._pointwise(op)]
        if self.tile:
            return {op.result for op in pointwise}
        results = set(self.body.results)
        place: dict[Value, object] = {}  # value -> the one place its readers lead to, or _MANY
        for op in reversed(pointwise):
            value = op.result
            found = {("result", value.type.shape)} if value in results else set()
            for user in set(users.get(value, ())):
                found.add(place.get(user.result) if self._pointwise(user) else ("op", user))
            found.discard(None)  # a dead reader
            place[value] = next(iter(found)) if len(found) == 1 else _MANY if found else None
        return {value for value, where in place.items() if where is _MANY}

    def _store_in_output(self, value: Value) -> None:
        """In a row tile, store `value` (read by several ops, a math function in it) once, in the
        tile of an output that reads it pointwise, if there is one; that output's generic then reads
        it from its own tile and overwrites it (softmax: exp(x - max) is computed once into the
        output tile, which stays in L1 for the sum, and divided in place). A value that is an output
        itself is computed into its own tile first and read back from there (cross-entropy with its
        gradient: the sum reads the stored exp(x - max) instead of computing it again)."""
        if not self.tile or value.dtype.is_bool:
            return
        if value in self.body.results:
            if value in self.destinations:
                self.materialized.add(value)
            return
        for r in self.body.results:
            if r in self.destinations and r not in self.in_place and r.type == value.type and self._reads(r, value):
                self.materialized.add(value)
                self.destinations[value] = self.destinations[r]
                self.in_place[r] = value
                return

    def _reads(self, result: Value, value: Value) -> bool:
        """Whether the generic computing pointwise `result` reads `value` as a leaf."""
        stack, seen = [result], set()
        while stack:
            v = stack.pop()
            op = v.producer
            if v in seen or op is None or not self._pointwise(op) or v in self.materialized:
                continue
            seen.add(v)
            if value in op.operands:
                return True
            stack.extend(op.operands)
        return False

    @staticmethod
    def _pointwise(op: Op) -> bool:
        return is_pointwise(op) and op.result.type.size > 0

    def _inline(self, value: Value) -> bool:
        op = value.producer
        return op is not None and value not in self.tensors and self._pointwise(op)

    def tensor(self, value: Value) -> str:
        """The tensor holding `value`, emitting what computes it if it is not there yet."""
        if value not in self.tensors:
            op = value.producer
            if op.name == "constant":
                self.tensors[value] = self._constant(value)
            elif self._inline(value):
                self._emit_generic([value])
            else:
                self._lower_member(op)
        return self.tensors[value]

    def _constant(self, value: Value) -> str:
        t = value.type
        literal = dense_literal(value.producer.attrs["value"], t.dtype)
        tensor = self.em.literal(literal, tensor_type(t, memory_elem_type(t.dtype)))
        return bool_from_bytes(self.em, tensor, t) if t.dtype.is_bool else tensor

    def _lower_member(self, op: Op) -> None:
        fn = LOWERINGS.get(op.name)
        if fn is None:
            raise no_lowering_error(op, self.em.lowerings.target)
        results = fn(self.em, op, [self.tensor(v) for v in op.operands])
        self.tensors.update(zip(op.results, results))

    def run(self) -> list[str]:
        streamed = self._contraction_with_epilogue()
        if streamed is not None:
            return streamed
        nested = self._row_nest()
        for op in self.body.ops:
            if op in nested:
                continue
            if self._pointwise(op):
                if op.result in self.materialized:
                    self._emit_generic([op.result])
            elif self._fusable_reduction(op):
                self._emit_reduction(op)
            elif op.name in _REDUCE_KINDS and op.attrs["axes"] and self._transposed(op.operands[0]):
                self._reduce_transposed(op)
            elif op.name not in ("constant", "broadcast", "slice", "transpose", "iota"):  # lowered when needed
                self._lower_member(op)
        pending: dict[tuple, list[Value]] = {}
        for v in self.body.results:
            if self._inline(v) and v not in pending.get(v.type.shape, ()):
                pending.setdefault(v.type.shape, []).append(v)
        for values in pending.values():  # results of one shape: one generic
            self._emit_generic(values)
        return [self.tensor(v) for v in self.body.results]

    def _contraction_with_epilogue(self) -> list[str] | None:
        """A conv2d or dot_general and the pointwise ops on its result (bias, activation: the
        `fuse` pass's epilogue group) lowered as one contraction whose chunks (conv) or register
        tiles (dot) go through the epilogue on their way to the output
        (`contraction.Epilogue`), so that the product is never stored whole; None when the
        group is not of that form (one result, not a bool, of the product's shape, that only
        pointwise ops compute from it, no value stored in between, no slice view)."""
        products = [op for op in self.body.ops if op.name in _STREAMED_CONTRACTIONS]
        if len(products) != 1 or len(self.body.results) != 1 or self.tile or self.materialized:
            return None
        product, (target,) = products[0], self.body.results
        users = self.body.uses()
        pool = target.producer if target.producer is not None and target.producer.name == "reduce_window" else None
        if pool is not None:  # a conv's epilogue ending in a pool (`fuse._tiling_pool`): `target` is what it pools
            target = pool.operands[0]
            if product.name != "conv2d" or users.get(target) != [pool]:
                return None
        if (
            target.type.shape != product.result.type.shape
            or target.dtype.is_bool  # a fusion's bool results are i1 tensors; an epilogue writes bytes
            or not (self._inline(target) or (pool is not None and target is product.result))
            or not all(self._pointwise(u) or u is pool for u in users.get(product.result, ()))
            or not contraction.streams_epilogue(product)
        ):
            return None
        ops, leaves, splats = self._collect([target])
        if product.result not in leaves or any(map(self._view, leaves)):
            return None
        if product.name == "conv2d" and product.result.type.rank != 4:
            return None
        leaves = [v for v in leaves if v is not product.result]
        shape = product.result.type.shape
        inputs = [(self._input(v, shape), self._read_dims(v, shape)) for v in leaves]
        epilogue = FusedEpilogue(product.result, target, (ops, leaves, splats), inputs, pool)
        if (
            self.accumulator in leaves
            and self.accumulator.type == target.type
            and self.accumulator not in product.operands
        ):
            epilogue.accumulator = leaves.index(self.accumulator)
        lower = _STREAMED_CONTRACTIONS[product.name]
        results = lower(self.em, product, [self.tensor(v) for v in product.operands], epilogue)
        self.accumulated = epilogue.accumulated
        return results

    def _row_nest(self) -> set[Op]:
        """Lower the row part of the body as one loop nest over row tiles when it has one (see
        `lower_rows`); returns its members. The MLIR says which way each region went."""
        if self.tile or not any(op.name in _REDUCE_KINDS for op in self.body.ops):
            return set()
        nest = lower_rows.plan(self.body, self._pointwise)
        if isinstance(nest, str):
            self.em.line(f"// fusion: whole-tensor kernels ({nest})")
            return set()
        self.em.line(f"// fusion: {nest.describe()}")
        tensors = [self.tensor(v) for v in nest.inputs]
        outputs = lower_rows.emit(
            self.em,
            nest,
            tensors,
            lambda graph, operands, destinations: _FusionLowering(self.em, graph, operands, True, destinations).run(),
        )
        for v, tensor in zip(nest.outputs, outputs):
            self.tensors[v] = tensor
        return set(nest.ops)

    def _fusable_reduction(self, op: Op) -> bool:
        """A reduction whose input is computed by pointwise ops: they run inside its loop."""
        if op.name not in _REDUCE_KINDS or not op.attrs["axes"]:
            return False
        (x,) = op.operands
        if not (self._inline(x) and x.dtype in (dt.float32, dt.float64)):
            return False
        # Over a strided view the loop cannot take the one-op lowering's collapsed (A, R, B) form,
        # nor its schedule and summation order: x is computed first, then reduced on its own.
        return not any(map(self._view, self._collect([x])[1]))

    def _collect(self, targets: list[Value]) -> tuple[list[Op], list[Value], list[Value]]:
        """The pointwise ops computing `targets` (in order) and what they read: tensors, splats."""
        ops: list[Op] = []
        leaves: list[Value] = []
        splats: list[Value] = []
        seen: set[Value] = set()

        def walk(v: Value) -> None:
            if v in seen:
                return
            seen.add(v)
            if self._inline(v) and (v in targets or v not in self.materialized):
                for u in v.producer.operands:
                    walk(u)
                ops.append(v.producer)
            elif splat_value(v) is not None:
                splats.append(v)
            else:
                leaves.append(v)

        for t in targets:
            walk(t)
        return ops, leaves, splats

    def _input(self, v: Value, shape: tuple[int, ...]) -> tuple[str, str, str]:
        """(tensor, tensor type, indexing map) reading leaf `v` in an iteration space of `shape`:
        a broadcast not stored yet is read from its source through a projected-permutation map
        (its size-1 source dimensions dropped by a reshape: `_read_dims`)."""
        em = self.em
        dims = [f"d{i}" for i in range(len(shape))]
        op = v.producer
        if self._view(v):
            return self._slice_view(v), tensor_type(v.type, memory_elem_type(v.dtype)), em.identity_map(len(shape))
        if op is None or op.name != "broadcast" or v in self.tensors:
            tensor = self.tensor(v)
            if v.dtype.is_bool:
                tensor = bool_to_bytes(em, tensor, v.type)
            return tensor, tensor_type(v.type, memory_elem_type(v.dtype)), em.identity_map(len(shape))
        source = op.operands[0]
        kept = self._read_dims(v, shape)
        squeezed = TensorType(tuple(extent for _, extent in kept), source.dtype)
        tensor = self.tensor(source)
        elem = memory_elem_type(source.dtype)
        if source.dtype.is_bool:
            tensor = bool_to_bytes(em, tensor, source.type)
        tensor = reshape_tensor(em, tensor, source.type, squeezed, elem=elem)
        input_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(f'd{d}' for d, _ in kept)})")
        return tensor, tensor_type(squeezed, elem), input_map

    def _read_dims(self, v: Value, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """(loop dimension, extent) of each dimension of the tensor through which `_input` reads
        leaf `v`: for a broadcast not stored yet, its source's dimensions but size-1 ones that
        broadcast; else `v`'s own, each read at the same loop dimension."""
        op = v.producer
        if op is None or op.name != "broadcast" or v in self.tensors or self._view(v):
            return list(enumerate(v.type.shape))
        source = op.operands[0].type.shape
        return [(d, source[i]) for i, d in enumerate(op.attrs["dims"]) if source[i] != 1 or shape[d] == 1]

    def _view(self, v: Value) -> bool:
        """Whether leaf `v` is a slice not stored yet: the generic reads it as a strided view."""
        op = v.producer
        return op is not None and op.name == "slice" and v not in self.tensors and op.operands[0].type.rank > 0

    def _transposed(self, v: Value) -> bool:
        """Whether `v` is a transpose (of a group input) not stored yet, which a reduction of it
        reads in place (`_reduce_transposed`)."""
        op = v.producer
        return op is not None and op.name == "transpose" and v not in self.tensors and v.type.rank > 0

    def _reduce_transposed(self, op: Op) -> None:
        """Reduction `op` of a transposed group input: the input reduced along the permuted axes by
        the one-op lowering (`x.T.sum(1)` sums x's columns: no transposed copy), and the kept
        dimensions put back in `op`'s order by a transpose of the (smaller) result if they moved.
        It sums in the order of the input's layout, as a reduction of a transposed copy sums in the
        copy's: the two may differ in the last bits."""
        (v,) = op.operands
        source, perm = v.producer.operands[0], v.producer.attrs["perm"]
        rank = v.type.rank
        axes = sorted(a % rank for a in op.attrs["axes"])
        kept = [perm[d] for d in range(rank) if d not in axes]  # source dims, in op's result order
        in_source_order = sorted(kept)
        reduced_type = source.type.with_shape(tuple(source.type.shape[d] for d in in_source_order))
        reduce = Op(op.name, [source], [reduced_type], {"axes": tuple(perm[a] for a in axes)}, op.loc, op.device)
        (reduced,) = LOWERINGS[op.name](self.em, reduce, [self.tensor(source)])
        if kept != in_source_order:
            back = [in_source_order.index(d) for d in kept]
            move = Op("transpose", [reduce.result], [op.result.type], {"perm": tuple(back)}, op.loc, op.device)
            (reduced,) = LOWERINGS["transpose"](self.em, move, [reduced])
        self.tensors[op.result] = reduced

    def _slice_view(self, v: Value) -> str:
        """Slice `v` as a `tensor.extract_slice` of its source (a group input): it bufferizes to a
        `memref.subview`, so the generic reading it reads the input in place, nothing copied."""
        op = v.producer
        source = op.operands[0]
        tensor = self.tensor(source)
        if source.dtype.is_bool:
            tensor = bool_to_bytes(self.em, tensor, source.type)
        start, stride = op.attrs["start"], op.attrs["stride"]
        return self.em.op(
            f"tensor.extract_slice {tensor}[{', '.join(map(str, start))}] [{', '.join(map(str, v.type.shape))}] "
            f"[{', '.join(map(str, stride))}] : {tensor_type(source.type, memory_elem_type(source.dtype))} "
            f"to {tensor_type(v.type, memory_elem_type(v.dtype))}"
        )

    def _uncovered_dims(self, leaves: list[Value], shape: tuple[int, ...]) -> set[int]:
        """Loop dimensions that no leaf's indexing map reads (see `_input`)."""
        uncovered = set(range(len(shape)))
        for v in leaves:
            op = v.producer
            if op is None or op.name != "broadcast" or v in self.tensors:
                return set()
            uncovered -= {d for d, _ in self._read_dims(v, shape)}
        return uncovered

    def _emit_generic(self, targets: list[Value], reduction: Op | None = None, merged: list[int] | None = None) -> None:
        """One `linalg.generic` computing `targets` (pointwise values of one shape) from their
        leaves, or, with `reduction`, that reduction of the single target; over `merged`, the
        reduction's axes, as one dimension (`_merged_space`)."""
        em = self.em
        ops, leaves, splats = self._collect(targets)
        # An iota of the loop's shape is its position in the loop (`linalg.index`), not a stored
        # tensor: triu's masks, `labels == iota` outside a row nest.
        shape = targets[0].type.shape
        iotas = [v for v in leaves if reduction is None and self._iota(v) and v.type.shape == shape]
        leaves = [v for v in leaves if v not in iotas]
        if merged:
            space = self._merged_space(targets[0].type, leaves, merged)
        else:
            space = self._iteration_space(targets, leaves, reduction, positions=bool(iotas))
        loop = space.loop
        if reduction is None:
            outputs = [
                (
                    self._destination(v, loop) or em.empty(loop.with_dtype(v.dtype), memory_elem_type(v.dtype)),
                    tensor_type(loop.with_dtype(v.dtype), memory_elem_type(v.dtype)),
                    em.identity_map(loop.rank),
                )
                for v in targets
            ]
            iterators = ["parallel"] * loop.rank
            out_elems = [memory_elem_type(v.dtype) for v in targets]
        else:
            acc_type = TensorType(
                tuple(d for i, d in enumerate(loop.shape) if i not in space.axes), reduction.result.dtype
            )
            outputs, iterators = self._accumulator(reduction, loop.shape, space.axes, acc_type)
            out_elems = [elem_type(reduction.result.dtype)]
        # A leaf stored in a target's tile (`in_place`) is read through that output's block argument.
        overwritten: dict[Value, int] = {}
        for k, v in enumerate(targets if reduction is None else ()):
            stored = self.in_place.get(v)
            if stored in leaves and loop.shape in (stored.type.shape, (stored.type.size,)):
                tile = reshape_tensor(em, self.tensors[stored], stored.type, loop, elem=memory_elem_type(stored.dtype))
                outputs[k] = (tile, *outputs[k][1:])
                overwritten[stored] = k
        inputs = [i for i, v in zip(space.inputs, leaves) if v not in overwritten]
        read = [v for v in leaves if v not in overwritten]
        in_elems = [memory_elem_type(v.dtype) for v in read]
        result = em.fresh()
        name = result if len(outputs) == 1 else f"{result}:{len(outputs)}"
        maps = [m for _, _, m in inputs] + [m for _, _, m in outputs]
        tensors = ", ".join(t for t, _, _ in inputs)
        ins = f"ins({tensors} : {', '.join(tt for _, tt, _ in inputs)}) " if inputs else ""
        iters = ", ".join(f'"{i}"' for i in iterators)
        result_types = ", ".join(t for _, t, _ in outputs)
        em.line(
            f"{name} = linalg.generic {{indexing_maps = [{', '.join(maps)}], iterator_types = [{iters}]}} "
            f"{ins}outs({', '.join(o for o, _, _ in outputs)} : {result_types}) {{"
        )
        args = [em.fresh("a") for _ in range(len(inputs) + len(outputs))]
        em.line(f"^bb0({', '.join(f'{a}: {e}' for a, e in zip(args, in_elems + out_elems))}):")
        b = ScalarBuilder(em, em.indent + "  ")
        leaf_args = dict(zip(read, args)) | {v: args[len(inputs) + k] for v, k in overwritten.items()}
        yielded = generic_body(b, ops, leaf_args, splats + iotas, targets, reduction, args[-1])
        em.body.extend(b.lines)
        em.line(f"  linalg.yield {', '.join(yielded)} : {', '.join(out_elems)}")
        em.line(f"}} -> {result_types}" if len(outputs) == 1 else f"}} -> ({result_types})")
        stored = reduction is None and any(v in self.materialized or v in self.in_place for v in targets)
        views = any(map(self._view, read))
        loop_axes, elems = (space.loop, space.axes), in_elems + out_elems
        schedule_generic(em, name, loop_axes, reduction, elems, coalesce=stored, views=views, ops=ops, tile=self.tile)
        if reduction is not None:
            self.tensors[reduction.result] = reshape_tensor(em, result, acc_type, reduction.result.type)
            return
        for k, v in enumerate(targets):
            tensor = result if len(outputs) == 1 else f"{result}#{k}"
            if space.flat:
                tensor = _expand(em, tensor, v.type)
            self.tensors[v] = bool_from_bytes(em, tensor, v.type) if v.dtype.is_bool else tensor

    def _destination(self, v: Value, loop: TensorType) -> str | None:
        """The tensor a generic iterating over `loop` computes `v` into, if `v` has a destination."""
        if v not in self.destinations:
            return None
        flat, shaped = self.destinations[v]
        return shaped if loop.shape == v.type.shape else flat if loop.shape == (v.type.size,) else None

    def _emit_reduction(self, op: Op) -> None:
        """Fused reduction `op` of a pointwise value: one generic computing it inside the reduction's
        loop. A reduction over several axes whose space has no (A, R, B) form (axes in several
        groups, or broadcast leaves: batch-norm statistics over (0, 2, 3) of NCHW `(x - mean) ** 2`,
        or over (0, 1, 2) of NHWC) reduces its last axis in that generic, vectorized (a row or a
        column reduction, `schedule.reduction`), and the other axes of the partial result with the
        one-op lowering; as one generic over all its axes it would be plain scalar loops. When the
        axes end in a run of consecutive ones up to the last (NCHW's (2, 3)) that every leaf reads
        whole or not at all (`_mergeable`), the generic reduces that run as one dimension
        (`_merged_space`): batch norm over (16, 32, 56, 56) reduces rows of 3136 rather than rows of
        56 (8 at a time, the last 8 columns peeled off) and then rows of 56 again in a third kernel,
        which is faster and about half the LLVM IR."""
        (x,) = op.operands
        rank = x.type.rank
        axes = sorted(a % rank for a in op.attrs["axes"])
        leaves = self._collect([x])[1]
        grouped = axes == list(range(axes[0], axes[-1] + 1)) and not any(map(self._read_through_map, leaves))
        if len(axes) < 2 or grouped or x.type.size == 0:
            self._emit_generic([x], reduction=op)
            return
        run = [axes[-1]]
        while len(run) < len(axes) and axes[-len(run) - 1] == run[0] - 1:
            run.insert(0, run[0] - 1)
        # Merged only when the run ends at the last axis: the generic is then a row reduction over
        # long rows, its rows over the cores. A run before the last axis (NHWC's (0, 1, 2)) would be
        # a column reduction of few columns, on one core, slower than reducing its last axis first.
        if len(run) < 2 or run[-1] != rank - 1 or not leaves or not self._mergeable(leaves, x.type.shape, run):
            run = [axes[-1]]
        partial = TensorType(tuple(d for i, d in enumerate(x.type.shape) if i not in run), op.result.dtype)
        last = Op(op.name, [x], [partial], {"axes": tuple(run)}, op.loc, op.device)
        self._emit_generic([x], reduction=last, merged=run if len(run) > 1 else None)
        if len(run) == len(axes):
            self.tensors[op.result] = self.tensors[last.result]
            return
        rest = Op(op.name, [last.result], [op.result.type], {"axes": tuple(axes[: -len(run)])}, op.loc, op.device)
        (self.tensors[op.result],) = LOWERINGS[op.name](self.em, rest, [self.tensors[last.result]])

    def _mergeable(self, leaves: list[Value], shape: tuple[int, ...], run: list[int]) -> bool:
        """Whether the loop dimensions `run` (consecutive) can be one dimension for every leaf: none is
        a view, and each reads all of them, consecutively, or none (a broadcast along all of them)."""
        if self._uncovered_dims(leaves, shape):  # a reduced dimension no leaf reads: not inferable
            return False
        for v in leaves:
            if self._view(v):
                return False
            read = [d for d, _ in self._read_dims(v, shape)]
            present = [d in read for d in run]
            if any(present) and not all(present):
                return False
            if all(present):
                start = read.index(run[0])
                if read[start : start + len(run)] != run:
                    return False
        return True

    def _merged_space(self, space: TensorType, leaves: list[Value], run: list[int]) -> _Space:
        """The reduction's space with its reduced dimensions `run` (consecutive, the last ones
        reduced, `_mergeable`) as one: (N, C, H, W) reduced over (2, 3) with the per-channel
        broadcasts of batch norm's gradient is (N, C, H * W), a row reduction over the last axis
        (`schedule.reduction`). Each leaf's tensor is reshaped to match, broadcasts keeping their maps
        over the merged loop."""
        em, shape = self.em, space.shape
        first, last = run[0], run[-1]
        loop_shape = shape[:first] + (math.prod(shape[first : last + 1]),) + shape[last + 1 :]
        dims = [f"d{i}" for i in range(len(loop_shape))]

        def at(d: int) -> int:  # loop dimension d (not inside the run past its first) in the merged loop
            return d if d <= first else d - (last - first)

        inputs = []
        for v in leaves:
            tensor = self._input(v, shape)[0]
            read = self._read_dims(v, shape)
            kept, extents = [], []
            for d, extent in read:
                if first < d <= last:
                    extents[-1] *= extent
                    continue
                kept.append(at(d))
                extents.append(extent)
            old = TensorType(tuple(extent for _, extent in read), v.dtype)
            new = TensorType(tuple(extents), v.dtype)
            elem = memory_elem_type(v.dtype)
            tensor = reshape_tensor(em, tensor, old, new, elem=elem)
            input_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(f'd{d}' for d in kept)})")
            inputs.append((tensor, tensor_type(new, elem), input_map))
        return _Space(inputs, space.with_shape(loop_shape), [first], flat=False, normalized=False)

    def _read_through_map(self, v: Value) -> bool:
        """Whether leaf `v` is read through an indexing map other than the identity (a broadcast not
        stored yet, `_input`) or as a view: a generic reading one iterates its targets' n-d shape,
        and a reduction of it has no (A, R, B) form."""
        op = v.producer
        return self._view(v) or (op is not None and op.name == "broadcast" and v not in self.tensors)

    def _iota(self, v: Value) -> bool:
        """Whether leaf `v` is an iota not stored yet."""
        return v.producer is not None and v.producer.name == "iota" and v not in self.tensors

    def _iteration_space(
        self, targets: list[Value], leaves: list[Value], reduction: Op | None, positions: bool = False
    ) -> _Space:
        """How the generic iterates and reads its leaves: 1-D when nothing broadcasts (the
        elementwise schedule; collapsing is free), a reduction's (A, R, B) form when its axes are
        contiguous (the one-op lowering's view, so the same schedule), else the targets' shape."""
        em = self.em
        shape = targets[0].type.shape
        inputs = [self._input(v, shape) for v in leaves]
        if reduction is not None and leaves and self._uncovered_dims(leaves, shape):
            # A reduced dimension that only broadcasts read has no extent linalg can infer (the
            # maps are not invertible): read the first leaf stored, through the identity map.
            self.tensor(leaves[0])
            inputs[0] = self._input(leaves[0], shape)
        # A strided view cannot be collapsed without a copy: such a generic iterates n-d, like one
        # that broadcasts (rows split over cores, the last dimension vectorized: `copy_nd`).
        # So does one whose body reads loop positions (iotas).
        broadcasting = any(map(self._read_through_map, leaves)) or positions
        if reduction is not None:
            normal = None if broadcasting else self._normal_form(reduction, shape)
            if normal is None:
                axes = sorted(a % max(len(shape), 1) for a in reduction.attrs["axes"])
                return _Space(inputs, targets[0].type, axes, flat=False, normalized=False)
            loop, axes = normal
        elif len(shape) > 1 and not broadcasting:
            loop, axes = _flat(targets[0].type), []
        else:
            return _Space(inputs, targets[0].type, [], flat=False, normalized=False)
        reshaped = [
            (
                reshape_tensor(em, t, v.type, loop.with_dtype(v.dtype), elem=memory_elem_type(v.dtype)),
                tensor_type(loop.with_dtype(v.dtype), memory_elem_type(v.dtype)),
                em.identity_map(loop.rank),
            )
            for (t, _, _), v in zip(inputs, leaves)
        ]
        return _Space(reshaped, loop, axes, flat=reduction is None, normalized=reduction is not None)

    @staticmethod
    def _normal_form(op: Op, shape: tuple[int, ...]) -> tuple[TensorType, list[int]] | None:
        """The reduction's iteration space collapsed to (R), (A, R), (R, B) or (A, R, B) when its
        axes are one contiguous group (as `lower_reduction` does), with the reduced axis."""
        axes = sorted(a % max(len(shape), 1) for a in op.attrs["axes"])
        if not axes or axes != list(range(axes[0], axes[-1] + 1)):
            return None
        a, r, b = (
            math.prod(shape[: axes[0]]),
            math.prod(shape[axes[0] : axes[-1] + 1]),
            math.prod(shape[axes[-1] + 1 :]),
        )
        collapsed = tuple(d for d, keep in ((a, a > 1), (r, True), (b, b > 1)) if keep)
        return TensorType(collapsed, op.operands[0].dtype), [1 if a > 1 else 0]

    def _accumulator(self, op: Op, shape: tuple[int, ...], axes: list[int], acc: TensorType):
        """outs (init filled with the identity, type, map) and iterators of reduction `op` over an
        iteration space of `shape` reducing `axes` into `acc`."""
        em = self.em
        rank = len(shape)
        kind = op.name.removeprefix("reduce_")
        e = elem_type(acc.dtype)
        identity = em.op(f"arith.constant {scalar_literal(reduction_identity(kind, acc.dtype), acc.dtype)} : {e}")
        init = em.op(
            f"linalg.fill ins({identity} : {e}) outs({em.empty(acc)} : {tensor_type(acc)}) -> {tensor_type(acc)}"
        )
        dims = [f"d{i}" for i in range(rank)]
        out_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(d for i, d in enumerate(dims) if i not in axes)})")
        iterators = ["reduction" if i in axes else "parallel" for i in range(rank)]
        return [(init, tensor_type(acc), out_map)], iterators


@dataclass(frozen=True)
class _Space:
    """A generic's iteration space: its inputs (tensor, type, map), the loop's extents and dtype,
    the reduced dimensions, whether it is the 1-D view of n-d values (`flat`) or a reduction's
    (A, R, B) form (`normalized`)."""

    inputs: list
    loop: TensorType
    axes: list[int]
    flat: bool
    normalized: bool


def _flat(t: TensorType) -> TensorType:
    return TensorType((t.size,), t.dtype)


def _expand(em: KernelEmitter, tensor: str, t: TensorType) -> str:
    group = ", ".join(str(i) for i in range(t.rank))
    e = memory_elem_type(t.dtype)
    shape = ", ".join(str(d) for d in t.shape)
    into = f"{tensor_type(_flat(t), e)} into {tensor_type(t, e)}"
    result = em.op(f"tensor.expand_shape {tensor} [[{group}]] output_shape [{shape}] : {into}")
    em.store_through(result, tensor, (t.size,))
    return result


_STREAMED_CONTRACTIONS = {"conv2d": lower_conv.lower_conv2d, "dot_general": lower_dot.lower_dot_general}


# A product of the fusion that calls the matmul library puts its result in the scratch area.
SCRATCH["fusion"] = lower_dot.fusion_scratch


# A region that is exactly softmax, log-softmax, layer or RMS norm over rows (`row_library.match`)
# as a call of the row library on its operands' and result's buffers; compiled otherwise.
CALL_LOWERINGS["fusion"] = call_lowering(row_library.match)


@lowering("fusion")
def lower_fusion(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """The fused body on tensors (see the module docstring). A loop's accumulator among the
    operands (`KernelEmitter.accumulators`) is the output of a matmul's epilogue that reads it:
    `acc + x.T @ dz` adds the product into the carried sum in place."""
    fusion = _FusionLowering(em, op.regions[0], operands)
    if op in em.accumulators:
        fusion.accumulator = op.regions[0].params[em.accumulators[op]]
    results = fusion.run()
    if fusion.accumulated:
        em.accumulated.add(op)
    return results


__all__ = ["lower_fusion"]
