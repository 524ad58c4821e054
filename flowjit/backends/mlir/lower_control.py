"""Lowering of structured control flow, for any target: `cond` -> `scf.if`, `for` -> `scf.for`, `while` ->
`scf.while`, compiled as real branches and loops (never unrolled).

The op itself is one kernel of the function: its operands are read from their buffers and its
results written to their destinations like any op's. Inside, region bodies are lowered on tensors
with the target's own lowering table (`em.lowerings`; no per-op buffers: one-shot bufferization places the loop's
intermediates), scalars cross between tensors and the scf control values with
`tensor.extract`/`tensor.from_elements`, and region parameters beyond the carried values refer to the
enclosing tensors directly.

bool values never cross a region boundary as `i1` tensors: a carried or yielded bool travels as
bytes (`i8`, numpy's layout) and predicates are read as bytes, because bufferizing an `i1` tensor
into memory is rejected by MLIR 22's MemRefToLLVM (an assertion, which would abort the process).

A target adds these lowerings to its table with `register`.
"""

from __future__ import annotations

from collections.abc import Collection

from flowjit.backends.mlir.emitter import KernelEmitter, memory_elem_type, memref_type, tensor_type
from flowjit.backends.mlir.lower_elementwise import filled
from flowjit.backends.mlir.lowering import (
    INLINE_CONSTANT_ELEMENTS,
    bool_from_bytes,
    bool_to_bytes,
    dense_literal,
    splat_value,
)
from flowjit.backends.mlir.target import LoweringTable, no_lowering_error
from flowjit.errors import CompileError
from flowjit.ir.graph import Graph, Op, Value

CONTROL_OPS = ("cond", "for", "while")


def _carrier_type(value) -> str:
    """The tensor type a value has while crossing a region boundary (bools as bytes)."""
    return tensor_type(value.type, "i8" if value.type.dtype.is_bool else None)


def _types(values) -> str:
    return ", ".join(_carrier_type(v) for v in values)


def _to_carrier(em: KernelEmitter, tensor: str, value) -> str:
    return bool_to_bytes(em, tensor, value.type) if value.type.dtype.is_bool else tensor


def _from_carrier(em: KernelEmitter, tensor: str, value) -> str:
    return bool_from_bytes(em, tensor, value.type) if value.type.dtype.is_bool else tensor


def _predicate(em: KernelEmitter, tensor: str, value) -> str:
    """The i1 scalar of a bool scalar tensor, read through its byte form."""
    byte = em.op(f"tensor.extract {_to_carrier(em, tensor, value)}[] : tensor<i8>")
    zero = em.op("arith.constant 0 : i8")
    return em.op(f"arith.cmpi ne, {byte}, {zero} : i8")


def _results(em: KernelEmitter, count: int) -> tuple[str, list[str]]:
    """The result name to write (`%vN:2`) and the names to use (`%vN#0`, `%vN#1`)."""
    name = em.fresh()
    if count == 1:
        return name, [name]
    return f"{name}:{count}", [f"{name}#{i}" for i in range(count)]


def lower_region(em: KernelEmitter, region: Graph, args: list[str]) -> list[str]:
    """Emit `region`'s ops on tensors, with its parameters bound to `args`; returns its results.
    Its large constants come from `em.region_values` (read before the op)."""
    env = {**em.region_values, **dict(zip(region.params, args))}
    for op in region.ops:
        if op.name == "constant" and op.result in env:  # a large one, read before the op (`_large_constants`)
            continue
        if op.name == "constant":
            value = op.attrs["value"]
            env[op.result] = em.literal(dense_literal(value, op.result.type.dtype), tensor_type(op.result.type))
            continue
        if op.name in CONTROL_OPS:
            outs = _EMITTERS[op.name](em, op, [env[v] for v in op.operands])
        else:
            fn = em.lowerings.tensor.get(op.name)
            if fn is None:
                if op.name in em.lowerings.buffer:
                    raise CompileError(f"{op.loc}: op '{op.name}' cannot run inside a compiled loop or branch")
                raise no_lowering_error(op, em.lowerings.target)
            outs = fn(em, op, [env[v] for v in op.operands])
        env.update(zip(op.results, outs))
    return [env[v] for v in region.results]


def _scalar(em: KernelEmitter, tensor: str, elem: str) -> str:
    return em.op(f"tensor.extract {tensor}[] : tensor<{elem}>")


def _yield(
    em: KernelEmitter,
    values: list[str],
    region: Graph,
    into: list[str] | None = None,
    copy: bool = False,
    in_place: Collection[int] = (),
) -> None:
    """`scf.yield` the region's results. In loops (`into` = the loop's carried block arguments), each
    value is first written into its carried buffer, so the loop updates its state in place: no
    allocation escapes an iteration, which keeps buffer deallocation static (its dynamic ownership
    flags are i1 memrefs, which MLIR 22 cannot lower). With `copy` (the body has tiled kernels), each
    value goes through a copy first: a tiled kernel writing its result into the carried buffer it
    is still reading is a read-after-write conflict that bufferization rejects. So does a value
    written piece by piece (`written_in_pieces`: a concatenate's or pad's slices) while its pieces
    read the carry: such a value is copied whatever `copy` says. The values at the
    positions `in_place` (`in_place_updates`) were written into their carried buffers already and
    are yielded as they are."""
    if not values:
        em.line("scf.yield")
        return
    carried = [_to_carrier(em, t, v) for t, v in zip(values, region.results)]
    if into is not None:
        types = [_carrier_type(v) for v in region.results]
        carried = [
            c if k in in_place else _into_carried(em, c, d, t, copy or written_in_pieces(region.results[k]))
            for k, (c, d, t) in enumerate(zip(carried, into, types))
        ]
    em.line(f"scf.yield {', '.join(carried)} : {_types(region.results)}")


# Ops whose tensor lowerings write their destination one piece at a time (slices inserted in turn).
_PIECEWISE = frozenset({"concatenate", "pad"})


def written_in_pieces(value: Value) -> bool:
    """Whether `value` (through reshapes) is the result of an op that writes its destination in pieces."""
    producer = value.producer
    while producer is not None and producer.name == "reshape":
        producer = producer.operands[0].producer
    return producer is not None and producer.name in _PIECEWISE


def _into_carried(em: KernelEmitter, value: str, carried: str, ttype: str, copy: bool) -> str:
    if copy:
        value = em.op(f"bufferization.alloc_tensor() copy({value}) : {ttype}")
    return em.op(f"bufferization.materialize_in_destination {value} in {carried} : ({ttype}, {ttype}) -> {ttype}")


def _filled_carry(value: Value, init: Value):
    """The splat a loop's carried `value` starts from when it is filled, not copied, else None."""
    splat = splat_value(init)
    elem = memory_elem_type(value.type.dtype)
    return (
        splat
        if splat is not None and value.type.shape and tensor_type(value.type, elem) == _carrier_type(value)
        else None
    )


def _writable_copies(
    em: KernelEmitter, tensors: list[str], values, inits: list[Value], destinations: dict[int, str] | None = None
) -> list[str]:
    """The loop's initial carried values in fresh buffers: the loop updates them in place, and an
    initial value may be a read-only function input (bufferization would refuse the write). A
    splat (the zeros a tape or a gradient sum starts from) is filled instead of copied, so nothing
    is read; into the loop result's own buffer when `destinations` has it (a top-level loop's
    workspace slot or output, which holds none of the loop's operands), so that the loop runs in
    it and the copy into it after the loop is a copy onto itself, which canonicalization folds."""
    out = []
    for k, (tensor, value, init) in enumerate(zip(tensors, values, inits)):
        splat = _filled_carry(value, init)
        elem = memory_elem_type(value.type.dtype)
        if splat is not None:
            into = None
            if k in (destinations or {}):
                memory = tensor_type(value.type, elem)
                buffer = f"{destinations[k]} restrict writable : {memref_type(value.type)}"
                into = em.op(f"bufferization.to_tensor {buffer} to {memory}")
            out.append(filled(em, splat, value.type, elem, into))
        else:
            out.append(em.op(f"bufferization.alloc_tensor() copy({tensor}) : {_carrier_type(value)}"))
    return out


def in_place_updates(body: Graph, num_carry: int) -> dict[int, list[Op]]:
    """The `for` body's carries updated in place, by carry index: carry k whose result is a chain of
    scatter_adds starting from its own parameter, each link read by nothing else (a tape row, or
    rows of a gradient accumulated into a (T, ...) buffer), or its own parameter unchanged (an empty
    chain: the cotangent of scan's stacked outputs, read one row per iteration of the reverse loop).
    Their scatter_adds write into the carried buffer itself, so an iteration costs O(rows), not a
    copy of the whole carry."""
    reads: dict[Value, int] = {}
    for value in [*(x for op in body.ops for x in op.operands), *body.results]:
        reads[value] = reads.get(value, 0) + 1
    chains = {}
    for k in range(num_carry):
        value, chain = body.results[k], []
        if value is body.params[1 + k] and not value.dtype.is_bool:  # yielded as it came: nothing written
            chains[k] = chain
            continue
        while value.producer is not None and value.producer.name == "scatter_add" and reads[value] == 1:
            chain.append(value.producer)
            value = value.producer.operands[0]
        if chain and value is body.params[1 + k] and reads.get(value) == 1 and not value.dtype.is_bool:
            chains[k] = chain
    return chains


def accumulations(body: Graph, num_carry: int, updated: dict[int, list[Op]]) -> dict[Op, int]:
    """The `for` body's accumulators: carry k (not one of `updated`, `in_place_updates`) whose
    result is computed by one fusion that reads carry k's parameter, which nothing else reads,
    and which only the yield reads (a weight gradient summed over the steps: `acc + x.T @ dz`).
    Maps that fusion to the index of the parameter among its operands: its lowering may write the
    result into the parameter's buffer (the CPU's matmul epilogue does), which is then carried
    on without a copy (`KernelEmitter.accumulated`)."""
    reads: dict[Value, int] = {}
    for value in [*(x for op in body.ops for x in op.operands), *body.results]:
        reads[value] = reads.get(value, 0) + 1
    found = {}
    for k in range(num_carry):
        param, result = body.params[1 + k], body.results[k]
        producer = result.producer
        if (
            k in updated
            or producer is None
            or producer.name != "fusion"
            or reads.get(param) != 1
            or reads.get(result) != 1
            or param not in producer.operands
            or param.type != result.type
            or param.dtype.is_bool
        ):
            continue
        found[producer] = producer.operands.index(param)
    return found


def _unpack(em: KernelEmitter, names: list[str], values) -> list[str]:
    return [_from_carrier(em, n, v) for n, v in zip(names, values)]


def emit_cond(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    pred = _predicate(em, operands[0], op.operands[0])
    # Both branches write their results into destinations created before the `scf.if`, so no
    # buffer allocated in a branch escapes it (that would need dynamic ownership: i1 memrefs).
    destinations = [em.op(f"bufferization.alloc_tensor() : {_carrier_type(r)}") for r in op.results]
    head, names = _results(em, len(op.results))
    arrow = f" -> ({_types(op.results)})" if op.results else ""
    em.line(f"{head + ' = ' if op.results else ''}scf.if {pred}{arrow} {{")
    for i, region in enumerate(op.regions):
        if i:
            em.line("} else {")
        _yield(em, lower_region(em, region, operands[1:]), region, into=destinations)
    em.line("}")
    return _unpack(em, names, op.results) if op.results else []


def _index(em: KernelEmitter, tensor: str, elem: str) -> str:
    return em.op(f"arith.index_cast {_scalar(em, tensor, elem)} : {elem} to index")


def emit_for(em: KernelEmitter, op: Op, operands: list[str], destinations: dict[int, str] | None = None) -> list[str]:
    """`op` as an `scf.for`; `destinations` (carry index -> memref) are the buffers a top-level
    loop's results go to (`_writable_copies`)."""
    num_carry = op.attrs["num_carry"]
    (body,) = op.regions
    elem = {"i32": "i32", "i64": "i64"}[op.operands[0].type.dtype.name]
    lo, hi = _index(em, operands[0], elem), _index(em, operands[1], elem)
    step = em.op("arith.constant 1 : index")
    carry, invariants = operands[2 : 2 + num_carry], operands[2 + num_carry :]
    iv = em.fresh("i")
    carried = [em.fresh("c") for _ in carry]
    head, names = _results(em, num_carry)
    iter_args = ""
    if carry:
        initial = _writable_copies(
            em,
            [_to_carrier(em, x, v) for x, v in zip(carry, op.results)],
            op.results,
            op.operands[2 : 2 + num_carry],
            destinations,
        )
        pairs = ", ".join(f"{c} = {x}" for c, x in zip(carried, initial))
        iter_args = f" iter_args({pairs}) -> ({_types(op.results)})"
    em.line(f"{head + ' = ' if carry else ''}scf.for {iv} = {lo} to {hi} step {step}{iter_args} {{")
    index_scalar = em.op(f"arith.index_cast {iv} : index to {elem}")
    index_tensor = em.op(f"tensor.from_elements {index_scalar} : tensor<{elem}>")
    scheduled = len(em.schedules)
    in_place = in_place_updates(body, num_carry)
    em.updated_in_place.update(x for chain in in_place.values() for x in chain)
    accumulators = accumulations(body, num_carry, in_place)
    em.accumulators.update(accumulators)
    em.loops += 1
    outs = lower_region(em, body, [index_tensor, *_unpack(em, carried, op.results), *invariants])
    em.loops -= 1
    written = {
        k for k, v in enumerate(body.results[:num_carry]) if v.producer in em.accumulated.intersection(accumulators)
    }
    if carry:
        _yield(em, outs, body, into=carried, copy=len(em.schedules) > scheduled, in_place=set(in_place) | written)
    em.line("}")
    return _unpack(em, names, op.results) if carry else []


def emit_while(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    num_carry = op.attrs["num_carry"]
    cond_region, body_region = op.regions
    carry, invariants = operands[:num_carry], operands[num_carry:]
    before = [em.fresh("b") for _ in carry]
    after = [em.fresh("d") for _ in carry]
    types = _types(op.results)
    head, names = _results(em, num_carry)
    initial = _writable_copies(
        em, [_to_carrier(em, x, v) for x, v in zip(carry, op.results)], op.results, op.operands[:num_carry]
    )
    inits = ", ".join(f"{b} = {x}" for b, x in zip(before, initial))
    em.line(f"{head} = scf.while ({inits}) : ({types}) -> ({types}) {{")
    em.loops += 1
    (flag,) = lower_region(em, cond_region, [*_unpack(em, before, op.results), *invariants])
    em.line(f"scf.condition({_predicate(em, flag, cond_region.results[0])}) {', '.join(before)} : {types}")
    em.line("} do {")
    em.line(f"^bb0({', '.join(f'{d}: {_carrier_type(v)}' for d, v in zip(after, op.results))}):")
    scheduled = len(em.schedules)
    outs = lower_region(em, body_region, [*_unpack(em, after, op.results), *invariants])
    em.loops -= 1
    _yield(em, outs, body_region, after, copy=len(em.schedules) > scheduled)
    em.line("}")
    return _unpack(em, names, op.results)


_EMITTERS = {"cond": emit_cond, "for": emit_for, "while": emit_while}


def _check_nested(table: LoweringTable, op: Op) -> None:
    for region in op.regions:
        for inner in region.walk():
            if inner.name not in ("constant", *CONTROL_OPS) and inner.name not in table.tensor:
                raise no_lowering_error(inner, table.target)


def _large_constants(op: Op) -> list:
    """The constants of more than `INLINE_CONSTANT_ELEMENTS` in `op`'s control-flow regions (nested
    ones included, not fusion bodies), to be read once before the op. As literals inside a loop
    body, a (1024, 1024) f32 goes through MLIR's translation element by element, seconds of
    compile."""
    found = []

    def visit(region: Graph) -> None:
        for inner in region.ops:
            if inner.name == "constant" and inner.attrs["value"].size > INLINE_CONSTANT_ELEMENTS:
                found.append(inner.result)
            if inner.name in CONTROL_OPS:
                for nested in inner.regions:
                    visit(nested)

    for region in op.regions:
        visit(region)
    return found


def _lower_control(fl, op: Op) -> None:
    if op.name == "while" and op.attrs["num_carry"] == 0:
        raise CompileError(f"{op.loc}: a while_loop needs at least one carried value")
    _check_nested(fl.lowerings, op)
    operands = [fl.read(v) for v in op.operands]
    fl.em.region_values = {v: fl.read(v) for v in _large_constants(op)}
    try:
        if op.name == "for":
            # The buffers of results filled before the loop (workspace slots never hold an operand
            # of the op writing them: `plan_workspace`; nor do outputs written in place: `in_place`).
            num_carry = op.attrs["num_carry"]
            inits = op.operands[2 : 2 + num_carry]
            destinations = {
                k: fl.buffers[v]
                for k, (v, init) in enumerate(zip(op.results, inits))
                if v in fl.buffers and _filled_carry(v, init) is not None
            }
            results = emit_for(fl.em, op, operands, destinations)
        else:
            results = _EMITTERS[op.name](fl.em, op, operands)
    finally:
        fl.em.region_values = {}
    for value, tensor in zip(op.results, results):
        fl.write(tensor, value, fl.buffers.get(value))  # zero-size values have no buffer


def lower_custom_vjp_call(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """An identity on its last operands (its backward rule matters only to the autodiff pass)."""
    return operands[op.attrs["num_inputs"] + op.attrs["num_residuals"] :]


def register(table: LoweringTable) -> None:
    """Add the control-flow lowerings (`cond`, `for`, `while`, `custom_vjp_call`) to `table`."""
    table.buffer.update({name: _lower_control for name in CONTROL_OPS})
    table.tensor["custom_vjp_call"] = lower_custom_vjp_call
