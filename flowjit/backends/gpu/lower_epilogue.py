"""A fused region holding one tiled product or convolution and its elementwise epilogue (a dense
layer's `tanh(x @ w + b)`, a residual `x @ w * 2.0 + r`, a CNN layer's `relu(conv2d(x, w, b))`) as
ONE launch of the tiled kernel: each thread applies the epilogue to its micro-tile's sums in
registers, right before the masked store, instead of the product writing a temporary that a
second kernel reads.

Which regions (`plan`): one dot_general that `lower_matmul.tiled_product` tiles or one conv2d that
`lower_matmul.tiled_conv` tiles (the core), its operands the region's inputs; every other op of
the body a splat constant, a broadcast of an input, a splat or an input's unit view to the core's
shape (a bias row or column, a conv's per-channel bias along N, H and W, a scalar), a reshape of
an input that only inserts or drops dimensions of extent 1 (a unit view: a bias (O,) as
(1, O, 1, 1)) read by such broadcasts, or a pointwise op (`mlir/pointwise.py`) of the core's shape
whose operands are the core's result, epilogue values, splats or inputs of the core's shape (read
at the output element); the body's results are distinct epilogue values (or the core's result).
Any other region (a reduction after the product, an epilogue reading the product at another
index, several products) keeps the whole-tensor lowering (`target.lower_fusion`: the product
writes a temporary, `lower_matmul.tiled_tensor`, and the epilogue is a kernel of its own).

The epilogue's scalar code is the one-op lowerings' (`pointwise.scalar_code`), and the core's sum
is rounded to its dtype before the epilogue reads it, as the temporary would round it, so the
results equal the two-launch ones. Each thread computes the epilogue at the element of the core's
result it stores (`lower_matmul.result_indices`: (batch..., row, column) of a product, (n, o, oh,
ow) of a convolution).
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

TILED_CORES = ("dot_general", "conv2d")


@dataclass(frozen=True)
class Epilogue:
    """A fused region as the tiled product `product` of its dot_general or conv2d `core`, then
    `ops` (its broadcasts and pointwise ops, in body order) applied to each element of the core's
    result; `views` pairs each unit view (a reshape's result) with the input it views."""

    core: Op
    product: lower_matmul.TiledProduct
    ops: tuple[Op, ...]
    views: tuple[tuple[Value, Value], ...]


def plan(op: Op) -> Epilogue | None:
    """The epilogue form of fusion `op`, or None when its region is not one (module docstring)."""
    if op.name != "fusion" or len(op.regions) != 1:
        return None
    body = op.regions[0]
    cores = [o for o in body.ops if o.name in TILED_CORES]
    if len(cores) != 1 or any(x not in body.params for x in cores[0].operands):
        return None
    core = cores[0]
    product = lower_matmul.planned_product(core)
    if product is None:
        return None
    shape = core.result.type.shape
    params = set(body.params)
    full = {core.result}  # values computed at each element of the core's result
    views = {}  # unit view -> the input it views
    ops = []
    for o in body.ops:
        if o is core or (o.name == "constant" and is_splat(o.result)):
            continue
        if len(o.results) != 1:
            return None
        if o.name == "reshape" and o.operands[0] in params and _is_unit_view(o):
            views[o.result] = o.operands[0]
            continue
        if o.result.type.shape != shape:
            return None
        if o.name == "broadcast" and (o.operands[0] in params or o.operands[0] in views or is_splat(o.operands[0])):
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
    return Epilogue(core, product, tuple(ops), tuple(views.items()))


def _is_unit_view(reshape: Op) -> bool:
    """Whether `reshape` only inserts or drops dimensions of extent 1 (its elements' indices
    along the other dimensions are the operand's)."""
    source, result = reshape.operands[0].type.shape, reshape.result.type.shape
    return [e for e in source if e != 1] == [e for e in result if e != 1]


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
    operands = [outer[x][0] for x in epilogue.core.operands]
    store = _epilogue_store(epilogue, outer, outputs)
    lower_matmul.emit(fl.em, epilogue.product, epilogue.core, operands, store)
    return True


def _epilogue_store(epilogue: Epilogue, inputs: dict[Value, tuple[str, str]], outputs):
    """`lower_matmul._KernelWriter.store` for the epilogue: the element's values from the sum,
    each output stored at the core's result element (`lower_matmul.result_indices`). `inputs`:
    the region's parameters' buffers, `outputs`: (result value, buffer, memref type)."""
    core = epilogue.core
    views = dict(epilogue.views)

    def load(w, v: Value, indices: list[str]) -> str:
        return load_element(w.b, *inputs[v], indices, v.dtype)

    def store(w, total: str, row: str, column: str) -> None:
        b = w.b
        indices = lower_matmul.result_indices(w, core, row, column)
        values = {core.result: extend(b, narrow(b, total, core.result.dtype), core.result.dtype)}

        def value(x: Value) -> str:
            if x in values:
                return values[x]
            if is_splat(x):
                return b.const(splat_value(x), compute_elem(x.dtype))
            return load(w, x, indices)  # an input of the core's shape

        for o in epilogue.ops:
            if o.name == "broadcast":
                x = o.operands[0]
                if is_splat(x):
                    values[o.result] = value(x)
                    continue
                at = [indices[d] if x.type.shape[i] != 1 else w.index(0) for i, d in enumerate(o.attrs["dims"])]
                if x in views:
                    at, x = _viewed_indices(w, at, x, views[x]), views[x]
                values[o.result] = load(w, x, at)
            else:
                values[o.result] = scalar_code(b, o, [value(x) for x in o.operands])
        for v, buffer, mtype in outputs:
            store_element(b, values[v], buffer, mtype, indices, v.dtype)

    return store


def _viewed_indices(w, at: list[str], view: Value, source: Value) -> list[str]:
    """Indices `at` into unit view `view` as indices into the input `source` it views: the
    dimensions other than 1 in the same order, 0 along the source's dimensions of 1."""
    kept = iter([index for index, extent in zip(at, view.type.shape) if extent != 1])
    return [next(kept) if extent != 1 else w.index(0) for extent in source.type.shape]
