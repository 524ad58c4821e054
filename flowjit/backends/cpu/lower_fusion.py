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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flowjit.backends.cpu import (
    contraction,
    lower_conv,
    lower_dot,
    lower_pooling,
    lower_rows,
    row_library,
    schedule,
)
from flowjit.backends.cpu.lower_elementwise import (
    _BINARY,
    _BOOL_PREDICATE,
    _FLOAT_PREDICATE,
    _FLOAT_UNARY,
    _INT_PREDICATE,
    _UNARY,
    compute_elem,
    convert_scalar,
    extend,
    iota_scalar,
    narrow,
    reshape_tensor,
)
from flowjit.backends.cpu.lower_reduction import _COMBINE
from flowjit.backends.cpu.mathlib import MATH, MATH_BINARY
from flowjit.backends.cpu.target import CALL_LOWERINGS, LOWERINGS, SCRATCH, lowering
from flowjit.backends.mlir.emitter import (
    KernelEmitter,
    ScalarBuilder,
    elem_type,
    memory_elem_type,
    scalar_literal,
    tensor_type,
)
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
# A 1-D fused kernel whose longest chain of dependent ops is deeper than this (`_depth`) computes
# two vectors per loop step (`_schedule`).
LONG_CHAIN_DEPTH = 12
_REDUCE_KINDS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")


def _pointwise(op: Op) -> bool:
    if op.name == "convert":
        return True
    if op.name in _UNARY or op.name in _FLOAT_UNARY or op.name in _BINARY or op.name == "select":
        return True
    return op.name in _FLOAT_PREDICATE


def _scalar(b: ScalarBuilder, op: Op, args: list[str]) -> str:
    """`op` on scalars in their compute types (see `compute_elem`; bool is i1); the result is in
    the compute type of `op`'s result, rounded to its dtype first, as the one-op kernels do."""
    out = op.result.type.dtype
    if op.name == "convert":
        src = op.operands[0].type.dtype
        return extend(b, convert_scalar(b, args[0], src, out), out)
    e = compute_elem(op.operands[-1].type.dtype)
    if op.name in _FLOAT_PREDICATE:
        x = op.operands[0].type.dtype
        if x.is_float:
            return b.op(f"arith.cmpf {_FLOAT_PREDICATE[op.name]}, {args[0]}, {args[1]} : {e}")
        predicate = (_BOOL_PREDICATE if x.is_bool else _INT_PREDICATE)[op.name]
        return b.op(f"arith.cmpi {predicate}, {args[0]}, {args[1]} : {e}")
    if op.name == "select":
        result = b.op(f"arith.select {args[0]}, {args[1]}, {args[2]} : {e}")
    elif op.name in _BINARY:
        result = _BINARY[op.name](b, args[0], args[1], e)
    else:
        result = (_UNARY.get(op.name) or _FLOAT_UNARY[op.name])(b, args[0], e)
    return extend(b, narrow(b, result, out), out)


def _storage(dtype: dt.DType) -> str:
    return memory_elem_type(dtype)


# `_weight` of a math function (exp, tanh, ...).
MATH_WEIGHT = 8


def _weight(op: Op) -> int:
    """Rough cost of one element of `op`, in simple arithmetic instructions."""
    if op.name in MATH or op.name in MATH_BINARY or op.name == "pow":
        return MATH_WEIGHT
    return 2 if op.name in ("div", "rem") else 1


def _depth(ops: list[Op]) -> int:
    """The longest chain of dependent ops among `ops` (in program order), each counted by `_weight`."""
    depth: dict[Value, int] = {}
    for op in ops:
        depth[op.result] = _weight(op) + max((depth.get(v, 0) for v in op.operands), default=0)
    return max(depth.values(), default=0)


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
            cost[op.result] = _weight(op) + sum(cost.get(v, 0) for v in op.operands if v not in self.materialized)
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
        return _pointwise(op) and op.result.type.size > 0

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
        epilogue = _Epilogue(self, product.result, target, (ops, leaves, splats), pool)
        lower = _STREAMED_CONTRACTIONS[product.name]
        return lower(self.em, product, [self.tensor(v) for v in product.operands], epilogue)

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
            return self._slice_view(v), tensor_type(v.type, _storage(v.dtype)), em.identity_map(len(shape))
        if op is None or op.name != "broadcast" or v in self.tensors:
            tensor = self.tensor(v)
            if v.dtype.is_bool:
                tensor = bool_to_bytes(em, tensor, v.type)
            return tensor, tensor_type(v.type, _storage(v.dtype)), em.identity_map(len(shape))
        source = op.operands[0]
        kept = self._read_dims(v, shape)
        squeezed = TensorType(tuple(extent for _, extent in kept), source.dtype)
        tensor = self.tensor(source)
        elem = _storage(source.dtype)
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
            f"[{', '.join(map(str, stride))}] : {tensor_type(source.type, _storage(source.dtype))} "
            f"to {tensor_type(v.type, _storage(v.dtype))}"
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
                    self._destination(v, loop) or em.empty(loop.with_dtype(v.dtype), _storage(v.dtype)),
                    tensor_type(loop.with_dtype(v.dtype), _storage(v.dtype)),
                    em.identity_map(loop.rank),
                )
                for v in targets
            ]
            iterators = ["parallel"] * loop.rank
            out_elems = [_storage(v.dtype) for v in targets]
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
                tile = reshape_tensor(em, self.tensors[stored], stored.type, loop, elem=_storage(stored.dtype))
                outputs[k] = (tile, *outputs[k][1:])
                overwritten[stored] = k
        inputs = [i for i, v in zip(space.inputs, leaves) if v not in overwritten]
        read = [v for v in leaves if v not in overwritten]
        in_elems = [_storage(v.dtype) for v in read]
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
        yielded = self._body(b, ops, leaf_args, splats + iotas, targets, reduction, args[-1])
        em.body.extend(b.lines)
        em.line(f"  linalg.yield {', '.join(yielded)} : {', '.join(out_elems)}")
        em.line(f"}} -> {result_types}" if len(outputs) == 1 else f"}} -> ({result_types})")
        stored = reduction is None and any(v in self.materialized or v in self.in_place for v in targets)
        views = any(map(self._view, read))
        self._schedule(name, space, reduction, in_elems + out_elems, coalesce=stored, views=views, ops=ops)
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
        one-op lowering; as one generic over all its axes it was plain scalar loops. When the axes
        end in a run of consecutive ones up to the last (NCHW's (2, 3)) that every leaf reads whole
        or not at all (`_mergeable`), the generic reduces that run as one dimension (`_merged_space`):
        batch norm over (16, 32, 56, 56) reduced rows of 3136, where it had reduced rows of 56 (8
        at a time, the last 8 columns peeled off) and then rows of 56 again in a third kernel:
        forward 0.81x the run time, gradient 0.67x, its first call 239 -> 119 ms (2826 -> 1304
        lines of LLVM IR)."""
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
        # a column reduction of few columns, on one core (1.4x slower than its last axis first).
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
            elem = _storage(v.dtype)
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
                reshape_tensor(em, t, v.type, loop.with_dtype(v.dtype), elem=_storage(v.dtype)),
                tensor_type(loop.with_dtype(v.dtype), _storage(v.dtype)),
                em.identity_map(loop.rank),
            )
            for (t, _, _), v in zip(inputs, leaves)
        ]
        return _Space(reshaped, loop, axes, flat=reduction is None, normalized=reduction is not None)

    @staticmethod
    def _body(b: ScalarBuilder, ops, leaf_args: dict, splats, targets, reduction: Op | None, acc: str) -> list[str]:
        """The scalar code of the generic: leaves in compute types, the ops, the yielded values."""
        value: dict[Value, str] = {}
        for v, arg in leaf_args.items():
            if v.dtype.is_bool:
                arg = b.op(f"arith.cmpi ne, {arg}, {b.const(0, 'i8')} : i8")
            value[v] = extend(b, arg, v.dtype)
        for v in splats:
            if v.producer is not None and v.producer.name == "iota":  # a position (`_emit_generic`)
                value[v] = extend(b, iota_scalar(b, v.producer.attrs["dimension"], v.dtype), v.dtype)
            else:
                value[v] = b.const(splat_value(v), compute_elem(v.dtype))
        for op in ops:
            value[op.result] = _scalar(b, op, [value[v] for v in op.operands])
        if reduction is None:
            return [
                b.op(f"arith.extui {value[v]} : i1 to i8") if v.dtype.is_bool else narrow(b, value[v], v.dtype)
                for v in targets
            ]
        combine = _COMBINE[reduction.name.removeprefix("reduce_")][0]
        e = elem_type(reduction.result.dtype)
        return [b.op(f"arith.{combine} {value[targets[0]]}, {acc} : {e}")]

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

    def _schedule(
        self,
        name: str,
        space: _Space,
        reduction: Op | None,
        elems: list[str],
        coalesce: bool,
        views: bool,
        ops: Sequence[Op] = (),
    ) -> None:
        """Attach the schedule of generic `name`. Small n-d kernels with short rows (the CNN's bias +
        relu at small batch) get `copy_nd` on one thread for its unrolled row loop: cnn forward at
        batch 8 ~9% faster. Over strided views whose rows end in a part of a vector (pooling's
        gradient, 14-wide rows) the same schedule was ~8% slower than LLVM's own vector loop, so
        those keep none; views of whole vectors per row (an LSTM's gate columns z[:, 64:128]) take
        it: LLVM's light pipeline leaves a plain loop scalar (that sigmoid 17 -> 3.4 us). Longer
        rows take it too up to `PLAIN_LOOP_MAX_ELEMENTS` (tanh(x + b) on (16, 200) 26.6 -> 6.5 us,
        JAX 6-9); above, a plain loop sends the function to O3, whose vector loop was as fast or
        faster (x + b on (64, 256) 3.7 against 4.2 us with the schedule). A 1-D kernel whose body's
        longest chain of dependent ops is deeper than `LONG_CHAIN_DEPTH` (`_depth`: a math
        function counts 8) computes two vectors per step: one vector waiting on that chain's
        latency left the cores idle (an unrolled `x = x + 0.01 * tanh(x * 0.5 + 0.1)` on 1024^2: 3
        steps 1.4-2.1 -> 1.06 ms, 200 steps 150-160 -> 84; tanh-approximated GELU on 4M, depth 16,
        0.85-0.93 of the time). Bodies of independent math functions side by side (the benchmark's
        `tanh(x * 0.7 + 0.1) * sigmoid(x) + 0.5 * x`, depth 12) gained nothing (1.03-1.04). A small
        reduction over short rows with no math function among `ops` (the kernel's body), outside
        loops, stays plain loops (`schedule.stays_plain`). With a math function, `copy_nd` keeps the
        row loop rolled: an LSTM's gates (two sigmoids and a tanh over 64-column views of the gate
        matrix) unrolled 4 vectors a row for the same run time (16, 512, 8192 rows: 3.3, 38, 292 us
        either way) and twice the compile (52-64 -> 27 ms of CPU at 16 rows)."""
        widest, depth = max(_bits(e) for e in elems), _depth(ops)
        math = max(map(_weight, ops), default=0) >= MATH_WEIGHT
        unroll = 1 if math else schedule.MAX_UNROLLED_STEPS  # math bodies: no faster unrolled, 2x the code
        loop, axes = space.loop, space.axes
        masked_rows = loop.shape[-1] % schedule.lanes(widest) != 0 if loop.rank else False
        if reduction is not None:
            if loop.size >= 2 and len(axes) == 1:
                plain = not self.em.loops and not math
                self.em.schedule(name, schedule.reduction(loop.shape, axes[0], widest, may_stay_plain=plain))
        elif loop.rank == 1 and loop.size > 1:
            vectors = 2 if depth > LONG_CHAIN_DEPTH else 1
            self.em.schedule(name, schedule.elementwise(loop.size, widest, vectors))
        elif loop.rank > 1 and self.tile and loop.size > 1:
            self.em.schedule(name, _vectorize_rows(loop.shape, widest, coalesce))
        elif loop.rank > 1 and loop.size >= schedule.PARALLEL_MIN_ELEMENTS:
            self.em.schedule(name, schedule.copy_nd(loop.shape, widest, unroll=unroll))
        elif loop.size > 1 and schedule.short_rows(loop.shape, widest) and not (views and masked_rows):
            self.em.schedule(name, schedule.copy_nd(loop.shape, widest, parallel=False, unroll=unroll))
        elif 1 < loop.size <= schedule.PLAIN_LOOP_MAX_ELEMENTS and not (views and masked_rows):
            self.em.schedule(name, schedule.copy_nd(loop.shape, widest, parallel=False, unroll=unroll))


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
    e = _storage(t.dtype)
    shape = ", ".join(str(d) for d in t.shape)
    into = f"{tensor_type(_flat(t), e)} into {tensor_type(t, e)}"
    result = em.op(f"tensor.expand_shape {tensor} [[{group}]] output_shape [{shape}] : {into}")
    em.store_through(result, tensor, (t.size,))
    return result


def _vectorize_rows(shape: tuple[int, ...], elem_bits: int, coalesce: bool):
    """An n-d kernel inside a row tile: one thread, vectors along the last dimension; with
    `coalesce` (the kernels that store a value in an output tile or overwrite it there) the loops
    coalesced into one. Measured while LLVM still unrolled loops on its own (it now unrolls only
    loops marked for it): it fully unrolled a short loop over the tile's rows around
    a small body (softmax's in-place division: 8 copies of the column loop, each unrolled again),
    one loop it only unrolled (softmax's optimized LLVM IR 820 -> 518 lines, compile CPU time -25%,
    same speed).
    Layer norm's last kernel was not unrolled so and runs 1-3% slower coalesced (the row and column
    indices recomputed from the one induction variable): not coalesced. Rows longer than one vector
    but not a whole number of them peel the partial vector off the column loop (softmax over 1000
    columns: every vector was masked), and stay uncoalesced."""
    tiles = [1] * (len(shape) - 1) + [schedule.lanes(elem_bits)]
    peel = shape[-1] % tiles[-1] != 0 and shape[-1] > tiles[-1]

    def steps(h: str) -> list[str]:
        n, any_ = h[1:], schedule.ANY
        loops = ", ".join(f"%loop{i}{n}" for i in range(len(shape)))
        types = ", ".join([any_] * (len(shape) + 1))
        lines = [
            f"%vec{n}, {loops} = transform.structured.tile_using_for {h} tile_sizes {tiles} : ({any_}) -> ({types})"
        ]
        if peel:
            # The partial last vector of each row peeled off the column loop: with it inside, every
            # vector was masked (softmax over 1000 columns). The two loops no longer coalesce.
            peeled, main, rest = schedule.peel_last(f"%loop{len(shape) - 1}{n}", f"%c{n}")
            vectorize = [f"transform.structured.vectorize {op} vector_sizes {tiles} : {any_}" for op in (main, rest)]
            return [*lines, *peeled, *vectorize]
        lines.append(f"transform.structured.vectorize %vec{n} vector_sizes {tiles} : {any_}")
        if coalesce:
            lines.append(f"%one{h[1:]} = transform.loop.coalesce %loop0{h[1:]} : ({schedule.ANY}) -> ({schedule.ANY})")
        return lines

    return steps


def _bits(elem: str) -> int:
    return 1 if elem == "i1" else int(elem.lstrip("bfi"))


class _Epilogue(contraction.Epilogue):
    """A fusion's pointwise ops on its contraction's result (`_FusionLowering.
    _contraction_with_epilogue`), as `contraction.Epilogue`: one n-d generic per window of the
    output, reading the window's product (in cache: a chunk of the im2col form's columns, a
    matmul's register tile just stored) and the window of each other leaf (bias and other
    broadcasts through their maps, full tensors sliced), writing the window of the result in
    place in the output. Its leaves are made before the contraction's loops."""

    def __init__(self, fusion: _FusionLowering, product: Value, target: Value, collected, pool: Op | None = None):
        self.fusion, self.product, self.target = fusion, product, target
        self.ops, leaves, self.splats = collected
        self.leaves = [v for v in leaves if v is not product]
        shape = product.type.shape
        self.inputs = [(fusion._input(v, shape), fusion._read_dims(v, shape)) for v in self.leaves]
        self.elem = _storage(target.dtype)
        self.pool = pool.attrs if pool is not None else None

    def apply(self, em, product, onhw, window, origin, into, serial) -> str:
        loop = ", ".join(f"d{i}" for i in range(window.rank))
        product_t = window.with_shape((window.shape[1], window.shape[0], *window.shape[2:])) if onhw else window
        product_map = em.affine_map(f"({loop}) -> ({'d1, d0' if onhw else 'd0, d1'}, {loop.split(', ', 2)[2]})")
        offsets = {0: origin[0], 2: origin[1]} if origin is not None else {}
        if self.pool is None:
            return self._generic(em, (product, product_t, product_map), window, offsets, into, serial)
        pooled = window.with_shape(self.out_shape(window.shape))
        if self.ops and self._commutes_with_max():  # pool first, then the ops on a quarter of the values
            out = lower_pooling.pool_window(em, (product, product_t), onhw, pooled, self.pool, into, serial)
            images = {0: offsets[0]} if 0 in offsets else {}  # its leaves read no rows
            return self._in_place(em, (out, pooled, em.identity_map(4)), pooled, images, serial)
        if self.ops:  # the pointwise ops in place on the product (in cache), then the pool reads it
            product = self._in_place(em, (product, product_t, product_map), window, offsets, serial)
        return lower_pooling.pool_window(em, (product, product_t), onhw, pooled, self.pool, into, serial)

    def _commutes_with_max(self) -> bool:
        """Whether a max pool may run before the pointwise ops: they are a non-decreasing function of
        the product, exactly, rounding included, whose other operands do not vary within a window
        (a bias, scalars), so the max of their results is their result on the max: additions,
        subtractions of constants, products and quotients by positive scalars, max and min, and
        relu's `select(x <= k, c, x)` with c <= k. (Math functions are left out: their polynomials
        need not be monotone to the last bit.) The CNN's bias + relu then run on a quarter of the
        conv's outputs."""
        if self.pool["kind"] != "max" or any(d >= 2 for _, dims in self.inputs for d, _ in dims):
            return False
        rising, predicates = {self.product}, set()

        def scalar(v: Value) -> float | None:
            value = splat_value(v)
            return None if value is None else float(value)

        for op in self.ops:
            args, name = op.operands, op.name
            up = [v in rising for v in args]
            if name == "select" and self._relu(op, rising, scalar):
                rising.add(op.result)
            elif any(v in predicates for v in args):
                return False  # a predicate on the product read other than by a relu's select
            elif not any(up):
                continue  # a value of the leaves alone: constant within a window
            elif name in ("add", "max", "min") or (name == "sub" and not up[1]):
                rising.add(op.result)
            elif name in ("mul", "div") and not up[1] and (scalar(args[1]) or 0) > 0:
                rising.add(op.result)
            elif name == "mul" and not up[0] and (scalar(args[0]) or 0) > 0:
                rising.add(op.result)
            elif name in ("le", "lt") and up == [True, False] and scalar(args[1]) is not None:
                predicates.add(op.result)  # a relu's, if only its select reads it
            else:
                return False
        return self.target in rising

    @staticmethod
    def _relu(op: Op, rising: set, scalar) -> bool:
        """`select(x <= k, c, x)` (or `<`) with x rising and c <= k: non-decreasing in x, NaN kept."""
        predicate, low, x = op.operands
        compare = predicate.producer
        if compare is None or compare.name not in ("le", "lt") or x not in rising or compare.operands[0] is not x:
            return False
        k, c = scalar(compare.operands[1]), scalar(low)
        return k is not None and c is not None and c <= k

    def _in_place(self, em, product, window: TensorType, offsets: dict, serial: bool) -> str:
        """The epilogue computed in place in the conv's product (before its pool), over its planes
        (H x W collapsed, one contiguous row each) when every leaf reads both H and W, as its last
        two dimensions, or neither (a bias): over rows of W, each row's last vector, masked when W is
        not a multiple of the vector, made the next row's first read wait for that store (a partial
        overlap, which store forwarding does not serve): the CNN's 28-wide rows ran 0.26 ms slower."""
        tensor, product_t, product_map = product
        if not all(all(d < 2 for d, _ in dims) or [d for d, _ in dims[-2:]] == [2, 3] for _, dims in self.inputs):
            return self._generic(em, product, window, offsets, tensor, serial)
        n, o, h, w = window.shape
        lead = product_t.shape[:2]
        flat_t = product_t.with_shape((*lead, h * w))
        acc = elem_type(self.product.dtype)
        collapse = f"[[0], [1], [2, 3]] : {tensor_type(product_t, acc)} into {tensor_type(flat_t, acc)}"
        flat = em.op(f"tensor.collapse_shape {tensor} {collapse}")
        flat_map = em.affine_map("(d0, d1, d2) -> (d1, d0, d2)" if lead != (n, o) else "(d0, d1, d2) -> (d0, d1, d2)")
        planes = window.with_shape((n, o, h * w))
        if 2 in offsets:
            offsets = {**offsets, 2: em.op(f"arith.muli {offsets[2]}, {em.op(f'arith.constant {w} : index')} : index")}
        done = self._generic(em, (flat, flat_t, flat_map), planes, offsets, flat, serial, planes=(h, w))
        expand = f"[[0], [1], [2, 3]] output_shape [{lead[0]}, {lead[1]}, {h}, {w}]"
        types = f"{tensor_type(flat_t, acc)} into {tensor_type(product_t, acc)}"
        return em.op(f"tensor.expand_shape {done} {expand} : {types}")

    def reads_along(self, d: int) -> bool:
        return any(dim == d and extent != 1 for _, dims in self.inputs for dim, extent in dims)

    def columns_only(self) -> bool:
        return all(self._columns(dims) for _, dims in self.inputs)

    def as_matrix(self) -> bool:
        full = list(range(self.product.type.rank))
        return all(self._columns(dims) or [d for d, _ in dims] == full for _, dims in self.inputs)

    def _columns(self, dims) -> bool:
        """Whether a leaf read through `dims` is at most a vector along the last dimension."""
        return len(dims) <= 1 and all(d == self.product.type.rank - 1 for d, _ in dims)

    def window(self, em, product, window, offsets, into, serial, flat_rows=False) -> str:
        whole = (product, window, em.identity_map(window.rank))
        return self._generic(em, whole, window, offsets, into, serial, flat_rows)

    def _generic(
        self, em, product, window: TensorType, offsets: dict, into, serial: bool, flat_rows=False, planes=None
    ) -> str:
        """The generic computing `window` of the result from `product` = (tensor, its shape as a
        TensorType, its indexing map) and the leaves' windows (`offsets`: `Epilogue.window`). When
        `into` is the product itself, the generic reads it as its output operand only (an input
        too would make the tiled loops read the tile's old value while they write it: a copy).
        `flat_rows`: `window` is (rows, columns) of the result viewed as a matrix (its leading
        dimensions flattened), which leaves reading columns at most allow (`columns_only`), and
        tensors of the result's whole shape when the window is all of it (`as_matrix`). `planes` =
        (H, W): `window` is (N, O, H x W), each leaf reading H and W read with them collapsed too
        (`_in_place`)."""
        rank = window.rank
        acc = elem_type(self.product.dtype)
        tensor, product_t, product_map = product
        in_place = into is tensor  # then written through the product's own map
        inputs = [] if in_place else [(tensor, tensor_type(product_t, acc), product_map)]
        for v, ((leaf, ttype, in_map), dims) in zip(self.leaves, self.inputs):
            if flat_rows and len(dims) > 1:  # a tensor of the result's shape, viewed as a matrix too
                leaf, ttype = self._as_matrix(em, leaf, v, window)
                dims, in_map = [(0, window.shape[0]), (1, window.shape[1])], em.identity_map(2)
            elif flat_rows:  # a bias along the columns, or a scalar
                dims = [(1, extent) for _, extent in dims]
                in_map = em.affine_map(f"(d0, d1) -> ({'d1' if dims else ''})")
            elif planes is not None:
                if dims and dims[-1][0] == 3:  # its last two dimensions are H and W: collapsed
                    leaf, ttype = self._planes(em, leaf, v, [e for _, e in dims])
                    dims = [*dims[:-2], (2, planes[0] * planes[1])]
                in_map = em.affine_map(f"(d0, d1, d2) -> ({', '.join(f'd{d}' for d, _ in dims)})")
            inputs.append((*self._window(em, leaf, ttype, v, dims, window, offsets), in_map))
        out_t = window.with_dtype(self.target.dtype)
        out_type = tensor_type(product_t, acc) if in_place else tensor_type(out_t, self.elem)
        into = into if into is not None else em.empty(out_t, self.elem)
        in_elems = ([] if in_place else [acc]) + [_storage(v.dtype) for v in self.leaves]

        def body(b: ScalarBuilder, args: list[str]) -> list[str]:
            product_arg = [args[-1]] if in_place else []
            leaf_args = dict(zip([self.product, *self.leaves], product_arg + args[: len(in_elems)]))
            return self.fusion._body(b, self.ops, leaf_args, self.splats, [self.target], None, args[-1])

        maps = [m for _, _, m in inputs] + [product_map if in_place else em.identity_map(rank)]
        inputs = [(t, tt) for t, tt, _ in inputs]
        name = em.generic(inputs, (into, out_type), maps, ["parallel"] * rank, body, in_elems, self.elem)
        widest = max(_bits(e) for e in in_elems + [acc, self.elem])
        em.schedule(name, schedule.copy_nd(window.shape, widest, parallel=not serial))
        return name

    @staticmethod
    def _planes(em, leaf: str, v: Value, shape: list[int]) -> tuple[str, str]:
        """Leaf `v` (as `leaf`, of `shape`) with its last two dimensions collapsed."""
        elem, rank = _storage(v.dtype), len(shape)
        flat = TensorType((*shape[:-2], shape[-2] * shape[-1]), v.dtype)
        groups = ", ".join([f"[{d}]" for d in range(rank - 2)] + [f"[{rank - 2}, {rank - 1}]"])
        flat_type = tensor_type(flat, elem)
        source = tensor_type(TensorType(tuple(shape), v.dtype), elem)
        return em.op(f"tensor.collapse_shape {leaf} [{groups}] : {source} into {flat_type}"), flat_type

    @staticmethod
    def _as_matrix(em, leaf: str, v: Value, matrix: TensorType) -> tuple[str, str]:
        """Leaf `v` (as `leaf`), of the result's shape, collapsed to the (rows, columns) `matrix`."""
        rank, elem = v.type.rank, _storage(v.dtype)
        rows = ", ".join(str(d) for d in range(rank - 1))
        matrix_type = tensor_type(matrix.with_dtype(v.dtype), elem)
        into = f"{tensor_type(v.type, elem)} into {matrix_type}"
        return em.op(f"tensor.collapse_shape {leaf} [[{rows}], [{rank - 1}]] : {into}"), matrix_type

    @staticmethod
    def _window(em, tensor: str, ttype: str, v: Value, dims, window: TensorType, offsets) -> tuple[str, str]:
        """(tensor, type) of the part of leaf `v` (read as `tensor` of type `ttype` through `dims`,
        `_FusionLowering._read_dims`) that `window` reads: along each loop dimension that the
        window cuts (images, output rows) and the leaf does not broadcast, the window's offset and
        extent; the rest whole."""
        starts, sizes = [], []
        for d, extent in dims:
            cut = extent != 1 and window.shape[d] != extent
            starts.append(offsets[d] if cut else "0")
            sizes.append(window.shape[d] if cut else extent)
        if [e for _, e in dims] == sizes:
            return tensor, ttype
        part = tensor_type(TensorType(tuple(sizes), v.dtype), _storage(v.dtype))
        where = f"[{', '.join(map(str, starts))}] [{', '.join(map(str, sizes))}] [{', '.join(['1'] * len(sizes))}]"
        return em.op(f"tensor.extract_slice {tensor}{where} : {ttype} to {part}"), part


_STREAMED_CONTRACTIONS = {"conv2d": lower_conv.lower_conv2d, "dot_general": lower_dot.lower_dot_general}


# A product of the fusion that calls the matmul library puts its result in the scratch area.
SCRATCH["fusion"] = lower_dot.fusion_scratch


# A region that is exactly softmax, log-softmax, layer or RMS norm over rows (`row_library.match`)
# as a call of the row library on its operands' and result's buffers; compiled otherwise.
CALL_LOWERINGS["fusion"] = call_lowering(row_library.match)


@lowering("fusion")
def lower_fusion(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """The fused body on tensors (see the module docstring)."""
    return _FusionLowering(em, op.regions[0], operands).run()


__all__ = ["lower_fusion"]
