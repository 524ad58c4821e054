"""Which late outputs are written in place: as their producer's destination, in the memory of the
input whose buffer the caller also passes for them (a donated argument, a variable updated in
place), instead of into a workspace slot copied out at the end of the call.

An output is late because its buffer may be an input's (`lower_graph`), so that input must be read
in full before the output is written. Written in place, the output costs no slot and no copy; that
is safe when each element of the input is read before the same element is written, and never after:

1. Its value is computed by a top-level op P that reads input k elementwise at the output's own
   index: an elementwise op, or a `loop` fusion in which every value computed from input k has the
   output's shape and is read only by elementwise ops (no broadcast, transpose, slice, reshape or
   reduction of it). The CPU's fusion lowering computes all the pointwise results of one shape in
   one loop nest and stores none of those values elsewhere first (`lower_fusion`), so each loop
   iteration (each thread's range of them, when the loop is parallel) reads element i of input k
   before it writes element i of the output.
2. P reads input k's memory only as input k: not through a top-level reshape or slice of it (a view
   of its buffer, `_reshape_aliases`, `_slice_views`).
3. No top-level op after P reads input k or a view of it (regions included), and no output is one
   (it is copied at the end). Top-level ops run in graph order: one after the other in a whole
   function, in a split function's parts (each calls the next) and in shared kernels alike.
4. The function has no communication op: a send may lend its operand's buffer until `send_done`.
"""

from __future__ import annotations

from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.ops import COMMUNICATION, ELEMENTWISE_FAMILIES, get_opdef

# Movement ops whose top-level result may be a view of its operand's buffer (`lowering.py`).
_VIEWS = frozenset({"reshape", "slice"})


def in_place_outputs(graph: Graph, aliased: dict[int, int]) -> dict[int, int]:
    """The outputs of `aliased` (output index -> index of the input whose buffer the caller may pass
    for it) that can be written in place, as the module docstring says."""
    if not aliased or any(get_opdef(op.name).family == COMMUNICATION for op in graph.walk()):
        return {}
    memory = _memory_of(graph)
    last_read = _last_reads(graph, memory)
    position = {op: i for i, op in enumerate(graph.ops)}
    chosen: dict[int, int] = {}
    for out, k in aliased.items():
        value, param = graph.results[out], graph.params[k]
        producer = value.producer
        if (
            producer is None
            or producer not in position
            or value.type != param.type
            or value.type.size == 0
            or graph.results.index(value) != out  # an earlier output holds it: this one is a copy
            or last_read.get(param, -1) > position[producer]
            or any(v is not param and memory.get(v) is param for v in producer.operands)
        ):
            continue
        if param not in producer.operands or _reads_elementwise(producer, producer.operands.index(param), value):
            chosen[out] = k
    return chosen


def _memory_of(graph: Graph) -> dict[Value, Value]:
    """Each parameter, and each top-level reshape or slice of one (transitively): the parameter
    whose memory it may be."""
    memory = {p: p for p in graph.params}
    for op in graph.ops:
        if op.name in _VIEWS and op.operands[0] in memory:
            memory[op.result] = memory[op.operands[0]]
    return memory


def _last_reads(graph: Graph, memory: dict[Value, Value]) -> dict[Value, int]:
    """Parameter -> the position of the last top-level op reading its memory (len(ops) when an output
    is copied from it at the end)."""
    last: dict[Value, int] = {}
    for i, op in enumerate(graph.ops):
        for v in _reads(op):
            if v in memory:
                last[memory[v]] = i
    for v in graph.results:
        if v in memory:
            last[memory[v]] = len(graph.ops)
    return last


def _reads(op: Op) -> list[Value]:
    """The values `op` reads: its operands and those of the ops in its regions (which may read
    values of the enclosing function)."""
    values = list(op.operands)
    for region in op.regions:
        values.extend(v for inner in region.walk() for v in inner.operands)
    return values


def _elementwise(op: Op) -> bool:
    # stop_gradient lowers to its operand itself: no kernel of its own.
    return get_opdef(op.name).family in ELEMENTWISE_FAMILIES and op.name != "stop_gradient"


def _reads_elementwise(op: Op, operand: int, value: Value) -> bool:
    """Whether `op` reads its operand `operand` only at the index of `value` it is computing
    (condition 1 of the module docstring)."""
    if _elementwise(op):
        return True
    if op.name != "fusion" or op.attrs.get("kind") != "loop":
        return False
    body = op.regions[0]
    derived = {body.params[operand]}
    for inner in body.ops:
        if not any(v in derived for v in inner.operands):
            continue
        if not _elementwise(inner) or any(r.type.shape != value.type.shape for r in inner.results):
            return False
        derived.update(inner.results)
    return True
