"""A fused region holding one tiled product and its elementwise epilogue (a dense layer's
`tanh(x @ w + b)`, a residual `x @ w * 2.0 + r`) as ONE launch of the tiled kernel: each thread
applies the epilogue to its micro-tile's sums in registers, right before the masked store, instead
of the product writing a temporary that a second kernel reads.

Which regions (`plan`): one dot_general that `lower_matmul.tiled_product` tiles, its operands the
region's inputs; every other op of the body a splat constant, a broadcast of an input or splat to
the product's shape (a bias row or column, a scalar), or a pointwise op (`mlir/pointwise.py`) of
the product's shape whose operands are the product, epilogue values, splats or inputs of the
product's shape (read at the output element); the body's results are distinct epilogue values (or
the product). Any other region (a reduction after the product, an epilogue reading the product at
another index, several products, a conv2d) keeps the whole-tensor lowering (`target.lower_fusion`:
the product writes a temporary, `lower_matmul.tiled_tensor`, and the epilogue is a kernel of its
own).

The epilogue's scalar code is the one-op lowerings' (`pointwise.scalar_code`), and the product's
sum is rounded to its dtype before the epilogue reads it, as the temporary would round it, so the
results equal the two-launch ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowjit.backends.gpu import lower_matmul
from flowjit.backends.gpu.launch import load_element, store_element
from flowjit.backends.mlir.lower_elementwise import compute_elem, extend, narrow
from flowjit.backends.mlir.lowering import call_buffers, splat_value
from flowjit.backends.mlir.pointwise import is_pointwise, scalar_code
from flowjit.backends.mlir.row_regions import is_splat
from flowjit.ir.graph import Op, Value


@dataclass(frozen=True)
class Epilogue:
    """A fused region as the tiled product `product` of its dot_general `dot`, then `ops` (its
    broadcasts and pointwise ops, in body order) applied to each element of the product."""

    dot: Op
    product: lower_matmul.TiledProduct
    ops: tuple[Op, ...]


def plan(op: Op) -> Epilogue | None:
    """The epilogue form of fusion `op`, or None when its region is not one (module docstring)."""
    if op.name != "fusion" or len(op.regions) != 1:
        return None
    body = op.regions[0]
    dots = [o for o in body.ops if o.name == "dot_general"]
    if len(dots) != 1 or any(x not in body.params for x in dots[0].operands):
        return None
    dot = dots[0]
    product = lower_matmul.tiled_product(dot)
    if product is None:
        return None
    shape = dot.result.type.shape
    params = set(body.params)
    full = {dot.result}  # values computed at each element of the product
    ops = []
    for o in body.ops:
        if o is dot or (o.name == "constant" and is_splat(o.result)):
            continue
        if o.result.type.shape != shape or len(o.results) != 1:
            return None
        if o.name == "broadcast" and (o.operands[0] in params or is_splat(o.operands[0])):
            pass
        elif not is_pointwise(o) or not all(
            x in full or is_splat(x) or (x in params and x.type.shape == shape) for x in o.operands
        ):
            return None
        full.add(o.result)
        ops.append(o)
    results = list(body.results)
    if len(set(results)) != len(results) or not all(v in full for v in results):
        return None
    return Epilogue(dot, product, tuple(ops))


def lower_epilogue_fusion(fl, op: Op) -> bool:
    """`LoweringTable.call` entry for "fusion": the region as the tiled kernel with its epilogue,
    on the region's buffers, or False (the region gets `target.lower_fusion`)."""
    epilogue = plan(op)
    buffers = call_buffers(fl, op) if epilogue is not None else None
    if buffers is None:
        return False
    body = op.regions[0]
    outer = dict(zip(body.params, buffers))
    outputs = [(v, *buffer) for v, buffer in zip(body.results, buffers[len(op.operands) :])]
    operands = [outer[x][0] for x in epilogue.dot.operands]
    store = _epilogue_store(epilogue, outer, outputs)
    lower_matmul.emit(fl.em, epilogue.product, epilogue.dot, operands, store)
    return True


def _epilogue_store(epilogue: Epilogue, inputs: dict[Value, tuple[str, str]], outputs):
    """`lower_matmul._KernelWriter.store` for the epilogue: the element's values from the sum,
    each output stored at (batch..., row, column). `inputs`: the region's parameters' buffers,
    `outputs`: (result value, buffer, memref type)."""
    dot = epilogue.dot
    batch_shape = dot.result.type.shape[:-2]

    def load(w, v: Value, indices: list[str]) -> str:
        return load_element(w.b, *inputs[v], indices, v.dtype)

    def store(w, total: str, row: str, column: str) -> None:
        b = w.b
        indices = [*_batch_indices(w, batch_shape), row, column]
        values = {dot.result: extend(b, narrow(b, total, dot.result.dtype), dot.result.dtype)}

        def value(x: Value) -> str:
            if x in values:
                return values[x]
            if is_splat(x):
                return b.const(splat_value(x), compute_elem(x.dtype))
            return load(w, x, indices)  # an input of the product's shape

        for o in epilogue.ops:
            if o.name == "broadcast":
                x = o.operands[0]
                if is_splat(x):
                    values[o.result] = value(x)
                    continue
                at = [indices[d] if x.type.shape[i] != 1 else w.index(0) for i, d in enumerate(o.attrs["dims"])]
                values[o.result] = load(w, x, at)
            else:
                values[o.result] = scalar_code(b, o, [value(x) for x in o.operands])
        for v, buffer, mtype in outputs:
            store_element(b, values[v], buffer, mtype, indices, v.dtype)

    return store


def _batch_indices(w, batch_shape: tuple[int, ...]) -> list[str]:
    """The block's flat batch index (`w.batch`) as one index per batch dimension."""
    if len(batch_shape) <= 1:
        return [w.batch] * len(batch_shape)
    indices, rest = [], w.batch
    for extent in reversed(batch_shape[1:]):
        indices.append(w.b.op(f"arith.remui {rest}, {w.index(extent)} : index"))
        rest = w.b.op(f"arith.divui {rest}, {w.index(extent)} : index")
    return [rest, *reversed(indices)]
