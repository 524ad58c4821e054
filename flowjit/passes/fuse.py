"""`fuse`: group ops into `fusion` ops, each of which a backend emits as one kernel.

Assumes a verified graph. Guarantees the same results for every input (ops are moved into regions
unchanged, nothing is recomputed but small constants) and keeps effectful ops in their order. A
backend may still sum a fused float reduction in another order than the unfused program's kernels
(a transposed input in its layout's order, see transposes below; the CPU backend's kernels over
broadcast values: `lower_fusion`).

What fuses (legality comes from op families):
- loop ops: elementwise unary/binary/ternary ops, `convert`, `broadcast`, `reshape`, `iota`;
- the reductions `reduce_sum/max/min/prod` with their elementwise producers and consumers, so a
  softmax, a layer norm or a cross-entropy becomes one group;
- a contraction (`dot_general`, `conv2d`) with its elementwise consumers (bias, activation): the
  epilogue. A contraction never takes fused producers (its operands stay materialized) and a group
  holds at most one.
- views (`VIEWS`) of a value read from outside the group (a parameter, the pad of a depthwise
  convolution, another group's result): a static `slice` (any start, limit, stride) with the
  elementwise ops that read it, which a kernel reads as a strided view of that input, so no slice
  is copied (a depthwise conv's 9 taps, `x[:, 1:] - x[:, :-1]`); a `transpose` with the reductions
  that read it, which reduce the input along the permuted axes (`x.T.sum(1)` sums x's columns, no
  transposed copy). A view never takes fused producers, and no merge may bring the producer of a
  member view's operand into its group (`_views_of_inputs`): that value would have to be stored
  first, or recomputed at shifted indices. A view the group also returns is copied once, as its
  result. (A transpose read by elementwise ops stays apart: read through a permuted map in
  blocks transposed in registers, an elementwise kernel is no faster than the transposed copy and
  the kernel after it, and slower with math functions.)
- a value a kernel would have to store between two members (a contraction's result, an
  elementwise value read by a reshape) stays inside a group only up to `max_internal_bytes`;
  larger ones are group boundaries (see `_streamable`). Except a float contraction's product read
  by its epilogue (`_streams_epilogue`): backends apply the epilogue to each chunk of the output
  as the conv computes it, or to each register tile of a matrix product, so a group of a
  contraction and pointwise ops returning one value of the product's shape keeps any size; a
  group of another form is split before the contraction (`_epilogue_groups`).

- pooling after a convolution's epilogue: a `reduce_window` with windows that tile the image
  (window = stride along H and W, 1 along N and C, no padding, at most `max_pool_taps` taps) whose
  operand is a streamed conv epilogue's one result, read by nothing else (conv + bias + relu +
  max pooling: one group whose result is the pooled tensor). Backends pool each chunk of the
  conv's output as they make it (`contraction.Epilogue.pool`), so the conv's output is never
  stored whole; nothing else joins such a group after the pool (`_merged_kind`: kind "pooled").

What never fuses: effectful ops (`read_variable`, `assign*`, `send`, `recv`), ops with regions,
other movement ops (dynamic_slice, pad, gather, ...), other pooling, argmax/argmin; ops with different
device constraints (so a group never crosses a device boundary); and a merge that would force an
effectful op or a region op to move past the group (an effect that reads a value of the group
before the group's last op), or that would make the grouped graph cyclic.

No work is duplicated: a value used outside its group becomes a result of the group (it is written
to memory once), so expensive ops (exp, reductions, contractions) are never recomputed. Only
constants are copied into each group that reads them: splats of any size (a backend reads them as
one scalar) and others of at most `CLONE_CONSTANT_ELEMENTS` elements, and broadcasts of those
(each reader gets its own copy first, so no group stores a broadcast constant for another).

Algorithm:
0. Give each reader of a broadcast constant its own copy of the broadcast, placed before it.
1. Walk the ops in order. Each fusible op starts a group; then each operand's group merges into it
   when the kinds allow it (`_merged_kind`), the devices agree and `_can_merge` finds no effect
   and no cycle in the way (a walk over the users of the two groups' frontiers, the members read
   outside their group, limited to ops before this one). The smaller group joins the larger.
2. Each group of two or more ops becomes a `fusion` op: operands = values read from outside,
   results = values used outside, body = the members in order, `kind` = loop, reduction or output.
3. The fusion op takes the place of its last member; ops that read a group result earlier move
   after it (a stable topological sort; effectful ops never move, by step 1).
Regions of control-flow ops are fused recursively, each on its own.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from flowjit.errors import CompileError
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import make_op
from flowjit.ir.devices import DeviceSpec
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.ops import (
    CONTRACTION,
    CONVERSION,
    ELEMENTWISE_BINARY,
    ELEMENTWISE_TERNARY,
    ELEMENTWISE_UNARY,
    get_opdef,
    ops_in,
)
from flowjit.ir.ops.contraction import dot_dims
from flowjit.passes.registry import register

REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
# Constants this small are copied into every group that reads them instead of being read from memory.
CLONE_CONSTANT_ELEMENTS = 64
_STREAMING = ("conv2d", "dot_general")  # the contractions whose epilogues can stream


@dataclass(frozen=True)
class FusionLimits:
    """What one kernel of a target can hold: properties of the backend that compiles the kernels,
    which each backend registers for its device types (`register_fusion_limits`).

    max_internal_bytes: a value a kernel cannot stream from producer to consumer (`_streamable`)
        stays inside a group only up to this size (a temporary of the kernel).
    conv_epilogue_min_depth: ... except a convolution's product summed over at least this many
        taps, read by pointwise ops (bias, activation), which the backend computes in the conv's
        own loops (`_streams_epilogue`) ...
    dot_epilogue_min_columns: ... and a matrix product (batch, .., M, K) x (batch, K, N) with at
        least this many columns, whose epilogue the backend applies to each tile it computes.
    max_pool_taps: pooling windows of at most this many taps join a conv's epilogue.
    """

    max_internal_bytes: int
    conv_epilogue_min_depth: int
    dot_epilogue_min_columns: int
    max_pool_taps: int

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"FusionLimits.{name} must be a non-negative int; found {value!r}")

    def tightest(self, other: FusionLimits) -> FusionLimits:
        """Limits both targets can take: each field's smaller value, the minimum depth and column
        count of a streamed epilogue the larger."""
        return FusionLimits(
            min(self.max_internal_bytes, other.max_internal_bytes),
            max(self.conv_epilogue_min_depth, other.conv_epilogue_min_depth),
            max(self.dot_epilogue_min_columns, other.dot_epilogue_min_columns),
            min(self.max_pool_taps, other.max_pool_taps),
        )


# device type -> the fusion limits of the backend that compiles for it
FUSION_LIMITS: dict[str, FusionLimits] = {}


def register_fusion_limits(device_type: str, limits: FusionLimits) -> None:
    """The limits of the kernels that devices of `device_type` run (called by their backend)."""
    FUSION_LIMITS[device_type] = limits


def fusion_limits(graph: Graph) -> FusionLimits:
    """The limits every device the graph may run on can take (`graph.devices`; when unset, every
    device type a backend registered limits for): kernels are formed before placement."""
    types = {DeviceSpec.parse(d).device_type for d in graph.devices} if graph.devices else set(FUSION_LIMITS)
    known = [FUSION_LIMITS[t] for t in sorted(types) if t in FUSION_LIMITS]
    if not known:
        raise CompileError(
            f"graph '{graph.name}': no backend registered fusion limits for its device types "
            f"({', '.join(sorted(types)) or 'none'}); registered: {', '.join(sorted(FUSION_LIMITS)) or 'none'}"
        )
    limits = known[0]
    for other in known[1:]:
        limits = limits.tightest(other)
    return limits


# Movement ops a kernel reads as views of a group input (a strided subview, a permuted indexing map).
VIEWS = frozenset({"slice", "transpose"})


def op_kind(op: Op, limits: FusionLimits) -> str | None:
    """'loop', 'reduction', 'output' or 'pool' for an op the pass may fuse; None for one it never fuses."""
    if op.regions or get_opdef(op.name).effectful:
        return None
    if op.name in _pointwise_ops() | {"broadcast", "reshape", "iota"} | VIEWS:
        return "loop"
    if op.name in REDUCTIONS:
        return "reduction"
    if op.name in ops_in(CONTRACTION):
        return "output"
    if _tiling_pool(op, limits):
        return "pool"
    return None


def _tiling_pool(op: Op, limits: FusionLimits) -> bool:
    """A float32/float64 pooling of NCHW images whose windows tile them (window = stride along H
    and W, 1 along N and C, no padding) with at most `max_pool_taps` taps: it may end a conv's
    epilogue group (each chunk of conv output rows pools on its own)."""
    if op.name != "reduce_window" or op.result.dtype not in (dt.float32, dt.float64) or op.result.type.size == 0:
        return False
    window, strides, padding = op.attrs["window"], op.attrs["strides"], op.attrs["padding"]
    return (
        len(window) == 4
        and tuple(window[:2]) == (1, 1)
        and tuple(strides) == tuple(window)
        and not any(lo or hi for lo, hi in padding)
        and window[2] * window[3] <= limits.max_pool_taps
    )


def _merged_kind(producer: str, consumer: str, consumer_op: Op) -> str | None:
    """The kind of the group made by merging a producer group into the group of `consumer_op`
    (which reads the producer's value); None when they must stay apart."""
    if "pooled" in (producer, consumer):
        return None  # a pool ends its group: nothing reads inside it past the pool
    if "pool" in (producer, consumer):
        # A contraction group's epilogue ending in the pool; `_epilogue_groups` checks its form.
        return "pooled" if (producer, consumer) == ("output", "pool") else None
    if consumer_op.name in ops_in(CONTRACTION):
        return None  # contractions read materialized operands (packing, tiling)
    if consumer_op.name in VIEWS:
        return None  # a view of a group input, never of a value the group computes
    kinds = {producer, consumer}
    if kinds <= {"loop", "reduction"}:
        return "reduction" if "reduction" in kinds else "loop"
    if kinds == {"loop", "output"}:
        return "output"
    return None  # two contractions, or a contraction with a reduction


def _streamable(producer: Op, consumer: Op, value: Value, limits: FusionLimits) -> bool:
    """Whether a kernel can pass `value` from `producer` to `consumer` without storing it: an
    elementwise value read by elementwise ops or reductions (computed in their loop), a broadcast
    or reshape read by elementwise ops (an indexing map, a view), an iota read by elementwise ops
    (an index: cross-entropy's one-hot compare stores no [batch, classes] int64 tensor), a slice
    read by elementwise ops (a strided view of a group input), a transpose read by a reduction
    (which reduces the input along the permuted axes) and by nothing else. Anything
    else (a contraction's result, an elementwise value read by a reshape) is a temporary inside the
    kernel, allowed up to `max_internal_bytes`: above that the value is better a group boundary,
    stored in the planned workspace, than a per-call allocation."""
    if producer.name == "transpose":
        return consumer.name in REDUCTIONS
    if consumer.name == "reduce_window":  # a pool reads its chunk of the conv's output in cache
        return producer.name in _pointwise_ops() or (producer.name == "conv2d" and _streams_epilogue(producer, limits))
    if value.type.size * value.type.dtype.itemsize <= limits.max_internal_bytes:
        return True
    pointwise = _pointwise_ops()
    if producer.name in _STREAMING:
        return consumer.name in pointwise and _streams_epilogue(producer, limits)
    if producer.name in pointwise:
        return consumer.name in pointwise or consumer.name in REDUCTIONS
    return producer.name in ("broadcast", "reshape", "iota", "slice") and consumer.name in pointwise


def _streams_epilogue(product: Op, limits: FusionLimits) -> bool:
    """Whether a backend computes the epilogue (the pointwise ops on its result) of contraction
    `product` piece by piece as it computes the product, so that the product is never stored
    whole: a float32/float64 convolution summing over at least `conv_epilogue_min_depth` taps (the
    CPU backend's im2col + matmul form, `lower_conv._conv_as_matmul`, applies the epilogue
    to each chunk's product in cache, in its copy to the output), or a float32/float64 matrix
    product (batch, M, K) x (batch, K, N) with at least `dot_epilogue_min_columns` columns, M
    the product of one or more free dimensions (the tiled kernel applies it to each register tile
    just stored, `lower_dot._dot_with_epilogue`).
    The group must then also keep the shape `_epilogue_groups` checks."""
    if product.result.dtype not in (dt.float32, dt.float64):
        return False
    if product.name == "dot_general":
        lhs, rhs = product.operands[0].type, product.operands[1].type
        contract, rhs_contract, batch, rhs_batch = dot_dims(product.attrs)
        plain = lhs.rank > len(contract) + len(batch) and rhs.rank - len(rhs_contract) - len(rhs_batch) == 1
        return plain and product.result.type.shape[-1] >= limits.dot_epilogue_min_columns
    weights = product.operands[1].type
    depth = weights.size // max(weights.shape[0], 1)
    return depth >= limits.conv_epilogue_min_depth


def _epilogue_groups(graph: Graph, members: list[Op], limits: FusionLimits) -> list[list[Op]]:
    """`members` as one group, or split in two ([the contraction], the rest) when the group holds a
    conv or dot product too large for a temporary (`max_internal_bytes`) but is not of the form
    whose product a backend streams (`_streams_epilogue`): the group returns exactly one value, of
    the product's shape, not a bool (and, for a matrix product, whose tiles are computed in place,
    of its dtype), made by a pointwise op, and holds no view. The split is always legal: the
    contraction reads no member's value (else it stays whole; the backend then stores the
    product). A pool ending the group (`_tiling_pool`) must follow a conv and be its one result,
    the value it pools then being of that form (or the product itself); else the pool is split
    off on its own first (it reads no member but through its operand, which is then a result)."""
    contractions = [op for op in members if op.name in _STREAMING]
    if not contractions:
        return [members]
    contraction = contractions[0]
    used = _used_outside(graph, members)
    outside = [v for op in members for v in op.results if v in used]
    pool = next((op for op in members if op.name == "reduce_window"), None)
    if pool is not None:
        if contraction.name != "conv2d" or outside != [pool.result] or any(op.name in VIEWS for op in members):
            rest = [op for op in members if op is not pool]  # the pool on its own, after the rest's group
            return [*_epilogue_groups(graph, rest, limits), [pool]]
        outside = list(pool.operands)  # the epilogue's result, which the pool reads chunk by chunk
    product = contraction.result
    if product.type.size * product.type.dtype.itemsize <= limits.max_internal_bytes:
        return [members]
    made_by = outside[0].producer.name if len(outside) == 1 else None
    streams = (
        len(outside) == 1
        and outside[0].type.shape == product.type.shape
        and not outside[0].type.dtype.is_bool
        and (contraction.name == "conv2d" or outside[0].type.dtype == product.type.dtype)
        and (made_by in _pointwise_ops() or (pool is not None and made_by == "conv2d"))
        and all(op.name not in VIEWS for op in members)
        and _streams_epilogue(contraction, limits)
    )
    if pool is not None and not streams:
        return [*_epilogue_groups(graph, [op for op in members if op is not pool], limits), [pool]]
    computed = {v for op in members for v in op.results}
    if streams or any(v in computed for v in contraction.operands):
        return [members]
    return [[contraction], [op for op in members if op is not contraction]]


def _pointwise_ops() -> frozenset[str]:
    return ops_in(ELEMENTWISE_UNARY, ELEMENTWISE_BINARY, ELEMENTWISE_TERNARY, CONVERSION)


def _is_barrier(op: Op) -> bool:
    """Ops a fusion must never move across: effects and region ops (which may hold effects)."""
    return bool(op.regions) or get_opdef(op.name).effectful


class _Grouping:
    """Union of ops into groups, in one walk over a graph's ops. Each check of a merge looks only at
    what crosses between the two groups and at their frontiers (members read outside their group),
    and the smaller group joins the larger, so a chain of n ops groups in about n steps, not n^2
    (an unrolled 200-step `x = x + 0.01 * tanh(x * 0.5 + 0.1)` is 1,600 ops)."""

    def __init__(self, graph: Graph, limits: FusionLimits):
        self.graph = graph
        self.limits = limits
        self.index = {op: i for i, op in enumerate(graph.ops)}
        self.users = graph.uses()
        self.group_of: dict[Op, int] = {}
        self.members: dict[int, list[Op]] = {}
        self.kind: dict[int, str] = {}
        self.frontier: dict[int, list[Op]] = {}  # members with a user outside their group
        self.views: dict[int, list[Op]] = {}  # members that are views (`VIEWS`)

    def run(self) -> list[list[Op]]:
        for op in self.graph.ops:
            kind = op_kind(op, self.limits)
            if kind is None:
                continue
            gid = self.index[op]
            self.group_of[op] = gid
            self.members[gid] = [op]
            self.kind[gid] = kind
            self.frontier[gid] = [op] if any(r in self.users for r in op.results) else []
            self.views[gid] = [op] if op.name in VIEWS else []
            for value in op.operands:
                producer = value.producer
                if producer is None or producer not in self.group_of:
                    continue
                self._try_merge(self.group_of[producer], self.group_of[op], op)
        return [sorted(m, key=self.index.__getitem__) for m in self.members.values()]

    def _try_merge(self, source: int, target: int, consumer: Op) -> None:
        if source == target or consumer.device != self.members[source][0].device:
            return
        kind = _merged_kind(self.kind[source], self.kind[target], consumer)
        if kind is None or not self._streams(source, target) or not self._views_of_inputs(source, target):
            return
        if not self._can_merge(source, target, consumer):
            return
        small, large = sorted((source, target), key=lambda g: len(self.members[g]))
        for op in self.members.pop(small):
            self.group_of[op] = large
            self.members[large].append(op)
        self.kind[large] = kind
        del self.kind[small]
        self.views[large] += self.views.pop(small)
        self.frontier[large] = [
            op
            for op in self.frontier[large] + self.frontier.pop(small)
            if any(self.group_of.get(u) != large for r in op.results for u in self.users.get(r, ()))
        ]

    def _streams(self, a: int, b: int) -> bool:
        """Every value passed between groups `a` and `b` (either way) can stay out of memory: the
        smaller group's members, their operands from the other group and their results read there."""
        small, large = sorted((a, b), key=lambda g: len(self.members[g]))
        for op in self.members[small]:
            for value in op.operands:
                producer = value.producer
                if self.group_of.get(producer) == large and not _streamable(producer, op, value, self.limits):
                    return False
            for value in op.results:
                for user in self.users.get(value, ()):
                    if self.group_of.get(user) == large and not _streamable(op, user, value, self.limits):
                        return False
        return True

    def _views_of_inputs(self, a: int, b: int) -> bool:
        """Whether every view (slice, transpose) of the merged group would read a value from outside
        it (a group input). A kernel reads such a view in place in its input buffer; a view of a
        value the group computes would have to be stored first, or recomputed per element at moved
        indices. Each group holds that on its own, so only views reading the other group can break it."""
        return not any(self.group_of.get(view.operands[0].producer) in (a, b) for view in self.views[a] + self.views[b])

    def _can_merge(self, a: int, b: int, last: Op) -> bool:
        """False if an op outside groups `a` and `b` placed before `last` depends on a member and
        either is a barrier (it would have to move after the group) or feeds a member (a cycle).
        Other groups count as one node each (they become one op): reaching one member reaches them
        all, so two groups can never depend on each other. Only members read outside their group
        (the frontiers) lead anywhere, so the walk starts from them, and enters another group at its
        frontier."""
        inside = (a, b)
        end = self.index[last]
        stack = self.frontier[a] + self.frontier[b]
        seen: set[Op] = set()
        reached_groups: set[int] = set()  # every member reached once: reaching it again adds nothing

        def reach(op: Op) -> bool:
            if self.group_of.get(op) in inside or op in seen or self.index[op] >= end:
                return True
            if _is_barrier(op) or any(
                self.group_of.get(u) in inside for r in op.results for u in self.users.get(r, ())
            ):
                return False
            seen.add(op)
            stack.append(op)
            return True

        while stack:
            op = stack.pop()
            for result in op.results:
                for user in self.users.get(result, ()):
                    targets = [user]
                    gid = self.group_of.get(user)
                    if gid is not None and gid not in inside:
                        if gid in reached_groups:
                            continue
                        reached_groups.add(gid)
                        targets = self.frontier[gid]
                    if not all(reach(o) for o in targets):
                        return False
        return True


def _fusion_kind(members: list[Op], limits: FusionLimits) -> str:
    kinds = {op_kind(op, limits) for op in members}
    return "output" if "output" in kinds else "reduction" if "reduction" in kinds else "loop"


def _clonable_constant(value: Value) -> bool:
    """Small constants, and splats of any size (a backend reads them as one scalar)."""
    op = value.producer
    if op is None or op.name != "constant":
        return False
    array = op.attrs["value"]
    if array.size <= CLONE_CONSTANT_ELEMENTS:
        return True
    first = array.reshape(-1)[0]
    if array.dtype.kind == "f" and np.isnan(first):
        return bool(np.all(np.isnan(array)))
    return bool(np.all(array == first))


def _build_fusion(members: list[Op], used_outside: set[Value], limits: FusionLimits) -> tuple[Op, list[Value]]:
    """The fusion op for `members` (in program order) and the outer values its results replace."""
    inside = set(members)
    body = Graph("fused")
    inner: dict[Value, Value] = {}
    operands: list[Value] = []
    for op in members:
        for v in op.operands:
            if v in inner or (v.producer in inside):
                continue
            if _clonable_constant(v):
                const = v.producer
                clone = body.append(Op("constant", [], [v.type], const.attrs, const.loc, const.device))
                inner[v] = clone.result
                continue
            operands.append(v)
            inner[v] = body.add_param(v.type, v.name_hint)
    # Parameters first, then the cloned constants and members: the body stays in topological order.
    for op in members:
        clone = Op(op.name, [inner[v] for v in op.operands], [r.type for r in op.results], op.attrs, op.loc, op.device)
        body.append(clone)
        inner.update(zip(op.results, clone.results))
    outputs = [r for op in members for r in op.results if r in used_outside]
    body.results = [inner[v] for v in outputs]
    last = members[-1]
    fusion = make_op("fusion", operands, {"kind": _fusion_kind(members, limits)}, last.loc, [body], last.device)
    return fusion, outputs


def _used_outside(graph: Graph, members: list[Op]) -> set[Value]:
    inside = set(members)
    used = {v for op in graph.ops if op not in inside for v in op.operands}
    used.update(graph.results)
    return {r for op in members for r in op.results if r in used}


def _stable_topological_order(ops: list[Op], position: dict[Op, int]) -> list[Op]:
    """`ops` ordered by dependencies, otherwise by `position` (Kahn's algorithm with a heap)."""
    producer_of = {r: op for op in ops for r in op.results}
    waiting = {op: 0 for op in ops}
    users: dict[Op, list[Op]] = {op: [] for op in ops}
    for op in ops:
        for v in set(op.operands):
            p = producer_of.get(v)
            if p is not None:
                waiting[op] += 1
                users[p].append(op)
    order_of = {op: i for i, op in enumerate(ops)}  # ties (equal positions) keep the list order
    ready = [(position[op], order_of[op], op) for op in ops if waiting[op] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, op = heapq.heappop(ready)
        order.append(op)
        for user in users[op]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (position[user], order_of[user], user))
    if len(order) != len(ops):  # never drop ops silently: a cycle means an illegal merge
        stuck = [op for op in ops if waiting[op] > 0]
        raise CompileError(
            f"internal error: fusion made a dependency cycle through {len(stuck)} ops, e.g. "
            f"'{stuck[0].name}' at {stuck[0].loc}"
        )
    return order


def _copy_broadcast_constants(graph: Graph, limits: FusionLimits) -> None:
    """A broadcast of a clonable constant read by several ops: every fusible reader after the first
    gets its own copy, placed right before it. Shared, the broadcast would join the first reader's group
    and become one of its results: in the MLP training step, relu's zeros would be a 1 MiB tensor
    written by the forward group and read back by the backward one."""
    users = graph.uses()
    ops: list[Op] = []
    copy_for: dict[Op, list[tuple[Value, Op]]] = {}
    for op in graph.ops:
        if op.name != "broadcast" or not _clonable_constant(op.operands[0]):
            continue
        for user in list(dict.fromkeys(users.get(op.result, ())))[1:]:
            if op_kind(user, limits) is None:
                continue  # a reader that never fuses keeps the shared value (one copy in memory)
            copy = Op(op.name, list(op.operands), [op.result.type], op.attrs, op.loc, op.device)
            copy_for.setdefault(user, []).append((op.result, copy))
    for op in graph.ops:
        for shared, copy in copy_for.get(op, ()):
            ops.append(copy)
            op.operands = [copy.result if v is shared else v for v in op.operands]
        ops.append(op)
    graph.ops = ops


def fuse_graph(graph: Graph, limits: FusionLimits) -> Graph:
    """Fuse `graph` in place (and the regions of its control-flow ops) within `limits`; returns it."""
    for op in graph.ops:
        if op.regions and op.name != "fusion":
            op.regions = [fuse_graph(region, limits) for region in op.regions]
    _copy_broadcast_constants(graph, limits)
    groups = [g for m in _Grouping(graph, limits).run() for g in _epilogue_groups(graph, m, limits) if len(g) >= 2]
    if not groups:
        return graph
    replace: dict[Value, Value] = {}
    fusion_at: dict[Op, Op] = {}  # last member -> its fusion op
    fused: set[Op] = set()
    for members in groups:
        fusion, outputs = _build_fusion(members, _used_outside(graph, members), limits)
        replace.update(zip(outputs, fusion.results))
        fusion_at[members[-1]] = fusion
        fused.update(members)
    ops, position = [], {}
    for i, op in enumerate(graph.ops):
        if op in fusion_at:
            op = fusion_at[op]
        elif op in fused:
            continue
        op.operands = [replace.get(v, v) for v in op.operands]
        ops.append(op)
        position[op] = i
    graph.results = [replace.get(v, v) for v in graph.results]
    live = {v for op in ops for v in op.operands} | set(graph.results)
    ops = [op for op in ops if op.name != "constant" or op.result in live]  # constants now cloned into groups
    graph.ops = _stable_topological_order(ops, position)
    return graph


@register("fuse")
def fuse(graph: Graph) -> Graph:
    """Group elementwise chains, reductions with their elementwise neighbours, and contraction
    epilogues into `fusion` ops (see the module docstring for the rules), within the fusion limits
    of the devices the graph may run on (`fusion_limits`)."""
    return fuse_graph(graph, fusion_limits(graph))


def kernel_count(graph: Graph) -> int:
    """Kernels a backend emits for `graph`'s top level: one per op but constants (a fusion op is one)."""
    return sum(1 for op in graph.ops if op.name != "constant")


def fusion_summary(graph: Graph) -> str:
    """`kernels: N (F fused regions holding M ops)`: the line stage headers and dumps show."""
    fusions = [op for op in graph.ops if op.name == "fusion"]
    held = sum(1 for op in fusions for inner in op.regions[0].ops if inner.name != "constant")
    return f"kernels: {kernel_count(graph)} ({len(fusions)} fused regions holding {held} ops)"
