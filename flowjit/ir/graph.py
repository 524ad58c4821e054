"""The dataflow IR: SSA `Value`s, `Op`s with attributes, locations and regions, and `Graph`s.

A `Graph` is a function body: parameters, ops in a valid topological order, and results. Regions of
structured control-flow ops (`cond`, `while`) are nested `Graph`s whose parameters are the block
arguments and whose results are the yielded values. Every op names its definition in the op
registry (`flowjit.ir.ops`), which supplies its shape rule, reference implementation and family.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from flowjit.ir.location import UNKNOWN, Location
from flowjit.ir.types import TensorType


class Value:
    """An SSA value: the result of an op or a graph parameter. Identity is object identity."""

    __slots__ = ("type", "producer", "index", "name_hint")

    def __init__(self, type: TensorType, producer: Op | None = None, index: int = 0, name_hint=None):
        self.type = type
        self.producer = producer
        self.index = index
        self.name_hint = name_hint

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    def __repr__(self) -> str:
        origin = self.producer.name if self.producer is not None else "param"
        return f"<Value {self.name_hint or ''} {self.type} from {origin}>"


class Op:
    """One operation: registry name, operand values, result values, attributes, location, device.

    Attributes are immutable Python values: bool, int, float, str, `DType`, numpy arrays (constant
    payloads) and tuples of those.
    """

    __slots__ = ("name", "operands", "results", "attrs", "loc", "device", "regions")

    def __init__(
        self,
        name: str,
        operands: Sequence[Value],
        result_types: Sequence[TensorType],
        attrs: dict | None = None,
        loc: Location = UNKNOWN,
        device: str | None = None,
        regions: Sequence[Graph] = (),
    ):
        self.name = name
        self.operands = list(operands)
        self.results = [Value(t, self, i) for i, t in enumerate(result_types)]
        self.attrs = dict(attrs or {})
        self.loc = loc
        self.device = device
        self.regions = list(regions)

    @property
    def result(self) -> Value:
        """The single result of a one-result op."""
        return self.results[0]

    def __repr__(self) -> str:
        return f"<Op {self.name} at {self.loc}>"


class Graph:
    """A function body: `params`, `ops` in topological order, `results`. Also used for regions."""

    def __init__(self, name: str = "main", params: Sequence[Value] = (), ops=(), results=()):
        self.name = name
        self.params = list(params)
        self.ops: list[Op] = list(ops)
        self.results: list[Value] = list(results)
        # The devices placement may use (full names), supplied by whoever runs the `place` pass:
        # the local devices for a jitted function, a cluster's devices for a distributed one.
        self.devices: tuple[str, ...] | None = None
        # The device types placement may give ops without a constraint (None: any of `devices`).
        self.unconstrained_device_types: tuple[str, ...] | None = None
        # A partition's recv key -> the keys of its own sends that recv waits for (set by
        # `passes.partition.split_partitions`; None: not a partition of a multi-device function).
        self.awaited_sends: dict[str, frozenset[str]] | None = None

    def add_param(self, type: TensorType, name: str | None = None) -> Value:
        value = Value(type, None, len(self.params), name)
        self.params.append(value)
        return value

    def append(self, op: Op) -> Op:
        self.ops.append(op)
        return op

    @property
    def param_types(self) -> list[TensorType]:
        return [p.type for p in self.params]

    @property
    def result_types(self) -> list[TensorType]:
        return [r.type for r in self.results]

    def copy(self, mapping: dict[Value, Value] | None = None, skip: frozenset[int] = frozenset()) -> Graph:
        """A structural copy: new values and ops (passes rewrite graphs in place), the same
        attributes, locations and devices. `mapping` (old value -> new) is extended with this
        graph's values; regions are copied with it, so a region may read values of its parents.
        Ops whose `id` is in `skip` are left out, in regions too (their results' uses read what
        `mapping` already maps them to)."""
        mapping = {} if mapping is None else mapping
        graph = Graph(self.name)
        graph.devices = self.devices
        graph.unconstrained_device_types = self.unconstrained_device_types
        for p in self.params:
            mapping[p] = graph.add_param(p.type, p.name_hint)
        for op in self.ops:
            if id(op) in skip:
                continue
            regions = [region.copy(mapping, skip) for region in op.regions]
            operands = [mapping.get(v, v) for v in op.operands]
            new = Op(op.name, operands, [r.type for r in op.results], op.attrs, op.loc, op.device, regions)
            for old, value in zip(op.results, new.results):
                value.name_hint = old.name_hint
                mapping[old] = value
            graph.ops.append(new)
        graph.results = [mapping.get(v, v) for v in self.results]
        return graph

    def walk(self) -> Iterator[Op]:
        """Every op, including those nested in regions, in program order."""
        for op in self.ops:
            yield op
            for region in op.regions:
                yield from region.walk()

    def uses(self) -> dict[Value, list[Op]]:
        """Map each value to the ops of this graph (not nested regions) that read it."""
        users: dict[Value, list[Op]] = {}
        for op in self.ops:
            for operand in op.operands:
                users.setdefault(operand, []).append(op)
        return users

    def __repr__(self) -> str:
        return f"<Graph @{self.name}: {len(self.params)} params, {len(self.ops)} ops>"

    def __str__(self) -> str:
        from flowjit.ir.printer import print_graph

        return print_graph(self)
