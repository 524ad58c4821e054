"""CPU lowering of `fusion` ops (made by the `fuse` pass): the whole group between one set of reads
and one set of writes, with its elementwise work in as few loop nests as possible.

The body's ops split into
- **pointwise clusters**: elementwise ops and converts of one shape that are connected without a
  reduction or contraction in between. Each cluster becomes ONE multi-result `linalg.generic` whose
  body chains the ops' scalar code (the same scalar code as the one-op lowerings, so results are
  bit-identical); values only used inside the cluster never leave registers. Broadcasts feeding
  a cluster become indexing maps, splat constants become scalars. The generic gets the
  elementwise schedule (vectors, one chunk per core) when it is 1-D after collapsing, or the n-d
  one (rows over cores, last dimension in vectors) when it reads broadcasts.
- **other members** (reductions, contractions, reshapes, iota, broadcasts whose value is needed as
  a tensor): their one-op lowerings, on tensors, with their own schedules.

A cluster may not contain two ops with a reduction or contraction between them, which `_levels`
ensures: a value's level counts the non-pointwise ops on its longest path from the body's
parameters, and clusters are connected components of same-level, same-shape pointwise ops.
"""

from __future__ import annotations

import heapq

from flowjit.backends.cpu import schedule
from flowjit.backends.cpu.emitter import KernelEmitter, ScalarBuilder, memory_elem_type, tensor_type
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
    narrow,
)
from flowjit.backends.cpu.lowering import (
    LOWERINGS,
    bool_from_bytes,
    bool_to_bytes,
    dense_literal,
    lowering,
    no_lowering_error,
    splat_value,
)
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.types import TensorType


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


def _levels(body: Graph) -> dict[Value, int]:
    level: dict[Value, int] = {p: 0 for p in body.params}
    for op in body.ops:
        inputs = max((level[v] for v in op.operands), default=0)
        step = 0 if _pointwise(op) or op.name in ("broadcast", "constant") else 1
        for r in op.results:
            level[r] = inputs + step
    return level


def _clusters(body: Graph) -> dict[Op, int]:
    """Each pointwise op's cluster id (the position of its cluster's first op)."""
    level = _levels(body)
    cluster: dict[Op, int] = {}
    members: dict[int, list[Op]] = {}
    for i, op in enumerate(body.ops):
        if not _pointwise(op) or op.result.type.size == 0:
            continue
        cid = i
        cluster[op] = cid
        members[cid] = [op]
        for v in op.operands:
            p = v.producer
            if (
                p in cluster
                and cluster[p] != cid
                and level[v] == level[op.result]
                and v.type.shape == op.result.type.shape
            ):
                old = cluster[p]
                for m in members.pop(old):
                    cluster[m] = cid
                    members[cid].append(m)
    return cluster


class _FusionLowering:
    """State of one fusion op's lowering: the tensor of each body value, emitted on demand."""

    def __init__(self, em: KernelEmitter, body: Graph, operands: list[str]):
        self.em = em
        self.body = body
        self.tensors: dict[Value, str] = dict(zip(body.params, operands))
        self.cluster = _clusters(body)
        self.users = body.uses()
        self.results = set(body.results)

    def tensor(self, value: Value) -> str:
        """The tensor holding `value` (lowering its producer now if it is a broadcast or constant
        that so far lived only as an indexing map or a scalar)."""
        if value not in self.tensors:
            op = value.producer
            if op.name == "constant":
                self.tensors[value] = self._constant(value)
            else:
                self._lower_member(op)
        return self.tensors[value]

    def _constant(self, value: Value) -> str:
        t = value.type
        literal = dense_literal(value.producer.attrs["value"], t.dtype)
        tensor = self.em.op(f"arith.constant {literal} : {tensor_type(t, memory_elem_type(t.dtype))}")
        return bool_from_bytes(self.em, tensor, t) if t.dtype.is_bool else tensor

    def _lower_member(self, op: Op) -> None:
        fn = LOWERINGS.get(op.name)
        if fn is None:
            raise no_lowering_error(op)
        results = fn(self.em, op, [self.tensor(v) for v in op.operands])
        self.tensors.update(zip(op.results, results))

    def run(self) -> list[str]:
        for unit in self._units_in_order():
            if isinstance(unit, list):
                self._emit_cluster(unit)
            elif unit.name not in ("constant", "broadcast"):  # those are lowered when a tensor is needed
                self._lower_member(unit)
        return [self.tensor(v) for v in self.body.results]

    def _units_in_order(self) -> list:
        """Clusters (lists of ops) and other ops, in an order that respects their dependencies
        (Kahn's algorithm; ties keep the body's order)."""
        index = {op: i for i, op in enumerate(self.body.ops)}
        units: dict[int, list[Op] | Op] = {}
        unit_of: dict[Op, int] = {}
        for op in self.body.ops:
            key = self.cluster.get(op, index[op])
            unit_of[op] = key
            if op in self.cluster:
                units.setdefault(key, []).append(op)
            else:
                units[key] = op
        deps: dict[int, set[int]] = {k: set() for k in units}
        for op in self.body.ops:
            for v in op.operands:
                if v.producer is not None and unit_of[v.producer] != unit_of[op]:
                    deps[unit_of[op]].add(unit_of[v.producer])
        users: dict[int, list[int]] = {k: [] for k in units}
        for k, ds in deps.items():
            for d in ds:
                users[d].append(k)
        waiting = {k: len(ds) for k, ds in deps.items()}
        ready = [k for k, n in waiting.items() if n == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            k = heapq.heappop(ready)
            order.append(units[k])
            for u in users[k]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    heapq.heappush(ready, u)
        return order

    def _emit_cluster(self, ops: list[Op]) -> None:
        em = self.em
        inside = set(ops)
        shape = ops[0].result.type.shape
        out_type = ops[0].result.type
        rank = len(shape)
        dims = [f"d{i}" for i in range(rank)]
        identity = em.identity_map(rank)
        inputs: list[tuple[str, str, str, Value]] = []  # (tensor, tensor type, map, value)
        slot: dict[Value, int | object] = {}
        scalars: dict[Value, object] = {}
        for op in ops:
            for v in op.operands:
                if (v.producer in inside) or v in slot or v in scalars:
                    continue
                splat = splat_value(v)
                if splat is not None:
                    scalars[v] = splat
                    continue
                source, input_map = v, identity
                if v.producer is not None and v.producer.name == "broadcast" and v not in self.tensors:
                    source = v.producer.operands[0]
                    source_dims = []
                    for i, d in enumerate(v.producer.attrs["dims"]):
                        keep = source.type.shape[i] != 1 or shape[d] == 1
                        source_dims.append(f"d{d}" if keep else "0")
                    input_map = em.affine_map(f"({', '.join(dims)}) -> ({', '.join(source_dims)})")
                tensor = self.tensor(source)
                if source.type.dtype.is_bool:
                    tensor = bool_to_bytes(em, tensor, source.type)
                slot[v] = len(inputs)
                storage = _storage(source.type.dtype)
                inputs.append((tensor, tensor_type(source.type, storage), input_map, v))
        outputs = [
            r
            for op in ops
            for r in op.results
            if r in self.results or any(u not in inside for u in self.users.get(r, ()))
        ]
        if not outputs:  # nothing reads the cluster (a body that was not cleaned up): no kernel
            return
        broadcasting = any(m != identity for _, _, m, _ in inputs)
        flat = rank > 1 and not broadcasting
        loop_type = TensorType((out_type.size,), out_type.dtype) if flat else out_type
        if flat:
            inputs = [
                (
                    self._collapse(t, v.type),
                    tensor_type(loop_type.with_dtype(v.dtype), _storage(v.dtype)),
                    em.identity_map(1),
                    v,
                )
                for t, _, _, v in inputs
            ]
            identity = em.identity_map(1)
        inits = [
            (
                em.empty(loop_type, _storage(r.type.dtype)),
                tensor_type(loop_type.with_dtype(r.type.dtype), _storage(r.type.dtype)),
            )
            for r in outputs
        ]
        result = em.fresh()
        name = result if len(outputs) == 1 else f"{result}:{len(outputs)}"
        maps = [m for _, _, m, _ in inputs] + [identity] * len(outputs)
        ins = (
            f"ins({', '.join(t for t, _, _, _ in inputs)} : {', '.join(tt for _, tt, _, _ in inputs)}) "
            if inputs
            else ""
        )
        iters = ", ".join(['"parallel"'] * loop_type.rank)
        em.line(
            f"{name} = linalg.generic {{indexing_maps = [{', '.join(maps)}], iterator_types = [{iters}]}} "
            f"{ins}outs({', '.join(i for i, _ in inits)} : {', '.join(t for _, t in inits)}) {{"
        )
        args = [em.fresh("a") for _ in range(len(inputs) + len(outputs))]
        elems = [_storage(v.dtype) for _, _, _, v in inputs] + [_storage(r.dtype) for r in outputs]
        em.line(f"^bb0({', '.join(f'{a}: {e}' for a, e in zip(args, elems))}):")
        b = ScalarBuilder(em, em.indent + "  ")
        value: dict[Value, str] = {}
        for v, i in slot.items():
            arg = args[i]
            if v.dtype.is_bool:
                arg = b.op(f"arith.cmpi ne, {arg}, {b.const(0, 'i8')} : i8")
            value[v] = extend(b, arg, v.dtype)
        for v, splat in scalars.items():
            value[v] = b.const(splat, compute_elem(v.dtype) if not v.dtype.is_bool else "i1")
        for op in ops:
            value[op.result] = _scalar(b, op, [value[v] for v in op.operands])
        yielded = []
        for r in outputs:
            x = value[r]
            if r.dtype.is_bool:
                x = b.op(f"arith.extui {x} : i1 to i8")
            else:
                x = narrow(b, x, r.dtype)
            yielded.append(x)
        em.body.extend(b.lines)
        em.line(f"  linalg.yield {', '.join(yielded)} : {', '.join(_storage(r.dtype) for r in outputs)}")
        result_types = ", ".join(t for _, t in inits)
        em.line(f"}} -> {result_types}" if len(inits) == 1 else f"}} -> ({result_types})")
        widest = max(_bits(e) for e in elems)
        if loop_type.rank == 1 and loop_type.size > 1:
            em.schedule(name, schedule.elementwise(loop_type.size, widest))
        elif loop_type.rank > 1 and loop_type.size >= schedule.PARALLEL_MIN_ELEMENTS:
            em.schedule(name, schedule.copy_nd(loop_type.shape, widest))
        for k, r in enumerate(outputs):
            tensor = result if len(outputs) == 1 else f"{result}#{k}"
            if flat:
                tensor = self._expand(tensor, r.type)
            self.tensors[r] = bool_from_bytes(em, tensor, r.type) if r.dtype.is_bool else tensor

    def _collapse(self, tensor: str, t: TensorType) -> str:
        group = ", ".join(str(i) for i in range(t.rank))
        flat = TensorType((t.size,), t.dtype)
        e = _storage(t.dtype)
        return self.em.op(
            f"tensor.collapse_shape {tensor} [[{group}]] : {tensor_type(t, e)} into {tensor_type(flat, e)}"
        )

    def _expand(self, tensor: str, t: TensorType) -> str:
        group = ", ".join(str(i) for i in range(t.rank))
        flat = TensorType((t.size,), t.dtype)
        e = _storage(t.dtype)
        shape = ", ".join(str(d) for d in t.shape)
        into = f"{tensor_type(flat, e)} into {tensor_type(t, e)}"
        return self.em.op(f"tensor.expand_shape {tensor} [[{group}]] output_shape [{shape}] : {into}")


def _bits(elem: str) -> int:
    return 1 if elem == "i1" else int(elem.lstrip("bfi"))


@lowering("fusion")
def lower_fusion(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """The fused body on tensors: one generic per pointwise cluster, other members as themselves."""
    return _FusionLowering(em, op.regions[0], operands).run()


__all__ = ["lower_fusion"]
