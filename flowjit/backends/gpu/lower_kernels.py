"""The GPU's own lowerings of the ops the shared layer leaves to each target: contractions,
windows, scans, sort, indexing and padding.

Two kernel shapes, both mapped to blocks and threads by the stage table (`pipeline.py`):

- `per_element`: a `linalg.generic` over the result, all dimensions parallel, whose body computes
  one element from its indices (`linalg.index`): it reads operands with `tensor.extract` at
  computed indices and may run a serial `scf.for` (dot_general's k loop, a window, an argmax
  row). One thread per result element.
- `parallel_writes`: an `scf.parallel` over an index space writing a buffer at computed positions
  (`memref.store`, `memref.atomic_rmw`), for ops whose writes a generic cannot express: a scan
  walks its row in one thread, a sort stores each element at its rank (or, for long rows, a
  serial loop on the host runs one such kernel per pass of a bitonic network), scatter_add adds
  atomically.

Bounds: every index an operand is read or written at is clamped into its dimension (a pad's or a
convolution's padding reads a clamped element and selects the padding value instead), and every
loop runs inside its operand's extent, so no kernel reads or writes outside its buffers whatever
the data (out-of-range gather/scatter indices and dynamic_slice starts are clamped, as the
reference implementation does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from flowjit.backends.gpu import lower_matmul
from flowjit.backends.mlir import lower_reduction
from flowjit.backends.mlir.emitter import (
    KernelEmitter,
    ScalarBuilder,
    elem_type,
    memory_elem_type,
    memref_type,
    scalar_literal,
    tensor_type,
)
from flowjit.backends.mlir.lower_elementwise import compute_elem, extend, map_elementwise, narrow, reshape_tensor
from flowjit.backends.mlir.lower_movement import moved_type, on_bytes
from flowjit.backends.mlir.target import LoweringTable
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op, Value
from flowjit.ir.ops.reduction import reduction_identity
from flowjit.ir.types import TensorType

# --- kernel shapes ----------------------------------------------------------------------------


def per_element(em: KernelEmitter, result: TensorType, body: Callable[[ScalarBuilder, list[str]], str]) -> str:
    """A tensor of type `result` (bools as bytes) whose element at indices `idx` is `body(b, idx)`,
    a scalar of the result's memory element type. Rank 0 runs as one element of rank 1 (a kernel
    with no parallel dimension would stay on the host)."""
    elem = memory_elem_type(result.dtype)
    if result.size == 0:
        return em.empty(result, elem)
    kernel = result if result.rank else result.with_shape((1,))
    ident = em.identity_map(kernel.rank)

    loops = []

    def generic_body(b: ScalarBuilder, args: list[str]) -> str:
        idx = [b.op(f"linalg.index {d} : index") for d in range(result.rank)]
        value = body(b, idx)
        loops.append(any("scf.for" in line for line in b.lines))
        return value

    out = em.generic(
        [],
        (em.empty(kernel, elem), tensor_type(kernel, elem)),
        [ident],
        ["parallel"] * kernel.rank,
        generic_body,
        [],
        elem,
    )
    if result.rank == 0:
        out = em.op(f"tensor.collapse_shape {out} [] : {tensor_type(kernel, elem)} into {tensor_type(result, elem)}")
    if any(loops):
        em.loop_kernels.add(out)
    return out


def kept_apart(em: KernelEmitter, x: str, t: TensorType) -> str:
    """`x` (of type `t`) copied by a kernel that elementwise fusion leaves alone: a generic with a
    reduction dimension of one trip (over a constant of one byte), which is not elementwise, so no
    producer is fused into it and it is fused into no consumer."""
    elem = memory_elem_type(t.dtype)
    shape = t if t.rank else t.with_shape((1,))
    if not t.rank:
        x = em.op(
            f"tensor.expand_shape {x} [] output_shape [1] : {tensor_type(t, elem)} into {tensor_type(shape, elem)}"
        )
    one = em.op("arith.constant dense<0> : tensor<1xi8>")
    dims = [f"d{i}" for i in range(shape.rank + 1)]
    out = em.generic(
        [(x, tensor_type(shape, elem)), (one, "tensor<1xi8>")],
        (em.empty(shape, elem), tensor_type(shape, elem)),
        [
            em.affine_map(f"({', '.join(dims)}) -> ({', '.join(dims[:-1])})"),
            em.affine_map(f"({', '.join(dims)}) -> ({dims[-1]})"),
            em.affine_map(f"({', '.join(dims)}) -> ({', '.join(dims[:-1])})"),
        ],
        ["parallel"] * shape.rank + ["reduction"],
        lambda b, args: args[0],
        [elem, "i8"],
        elem,
    )
    if not t.rank:
        out = em.op(f"tensor.collapse_shape {out} [] : {tensor_type(shape, elem)} into {tensor_type(t, elem)}")
    return out


def broadcast_apart(lower_broadcast):
    """The broadcast lowering, but a loop kernel's result (`em.loop_kernels`: a product, a
    convolution, an argmax...) is first copied by a kernel of its own (`kept_apart`): fused into the
    broadcast, its loop would run again for every element of the larger result (a (64, 32) product
    broadcast to (64, 16, 32) would compute each dot product 16 times)."""

    def lower(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
        (x,) = op.operands
        if operands[0] in em.loop_kernels and op.result.type.size > x.type.size:
            operands = [kept_apart(em, operands[0], x.type)]
        return lower_broadcast(em, op, operands)

    return lower


def parallel_writes(
    em: KernelEmitter,
    dest: str,
    dest_type: TensorType,
    space: Sequence[int],
    body: Callable[[ScalarBuilder, str, list[str]], None],
) -> str:
    """`dest` (a fresh tensor of `dest_type`, bools as bytes) after `body(b, buffer, idx)` ran for
    every index `idx` of the iteration space `space` in parallel, writing `buffer` (dest's memref)
    itself. An empty space leaves `dest` as it is."""
    if math.prod(space) == 0:
        return dest
    ttype = tensor_type(dest_type, memory_elem_type(dest_type.dtype))
    mtype = "memref<" + ttype.removeprefix("tensor<")
    buffer = em.op(f"bufferization.to_buffer {dest} : {ttype} to {mtype}")
    parallel_loop(em, space, lambda b, idx: body(b, buffer, idx))
    return em.op(f"bufferization.to_tensor {buffer} restrict writable : {mtype} to {ttype}")


def parallel_loop(em: KernelEmitter, space: Sequence[int], body: Callable[[ScalarBuilder, list[str]], None]) -> None:
    """An `scf.parallel` over the (non-empty) index space `space`, at the emitter's current place:
    `body(b, idx)` writes the iteration for indices `idx` (one kernel, one thread per index)."""
    # One iteration runs as two, the second doing nothing: canonicalization inlines a loop of one
    # iteration into the host code.
    single = math.prod(space) == 1
    bounds = (2,) if single else tuple(space)
    zero = em.op("arith.constant 0 : index")
    one = em.op("arith.constant 1 : index")
    uppers = [em.op(f"arith.constant {n} : index") for n in bounds]
    idx = [em.fresh("p") for _ in bounds]
    em.line(
        f"scf.parallel ({', '.join(idx)}) = ({', '.join([zero] * len(bounds))}) to ({', '.join(uppers)}) "
        f"step ({', '.join([one] * len(bounds))}) {{"
    )
    b = ScalarBuilder(em, em.indent + "  ")
    if single:
        first = b.op(f"arith.cmpi eq, {idx[0]}, {zero} : index")
        b.line(f"scf.if {first} {{")
        inner = ScalarBuilder(em, b.indent + "  ")
        body(inner, [zero] * len(space))
        b.lines.extend(inner.lines)
        b.line("}")
    else:
        body(b, idx)
    em.body.extend(b.lines)
    em.line("  scf.reduce")
    em.line("}")


def serial_for(
    b: ScalarBuilder,
    lo: str,
    hi: str,
    carried: Sequence[tuple[str, str]],
    body: Callable[[ScalarBuilder, str, list[str]], Sequence[str]],
) -> list[str]:
    """An `scf.for %i = lo to hi` (index SSA names) carrying `carried` [(initial value, type)];
    `body(b, i, values)` returns the next values. Returns the final values."""
    em = b.emitter
    one = b.const(1, "index")
    iv = em.fresh("i")
    args = [em.fresh("c") for _ in carried]
    result = em.fresh("r")
    types = ", ".join(t for _, t in carried)
    iters = ", ".join(f"{a} = {init}" for a, (init, _) in zip(args, carried))
    name = result if len(carried) == 1 else f"{result}:{len(carried)}"
    b.line(f"{name} = scf.for {iv} = {lo} to {hi} step {one} iter_args({iters}) -> ({types}) {{")
    inner = ScalarBuilder(em, b.indent + "  ")
    yielded = body(inner, iv, args)
    b.lines.extend(inner.lines)
    b.line(f"  scf.yield {', '.join(yielded)} : {types}")
    b.line("}")
    return [result] if len(carried) == 1 else [f"{result}#{k}" for k in range(len(carried))]


def serial_nest(
    b: ScalarBuilder,
    extents: Sequence[int],
    carried: Sequence[tuple[str, str]],
    body: Callable[[ScalarBuilder, list[str], list[str]], Sequence[str]],
) -> list[str]:
    """Nested `serial_for`s over `extents` (outermost first); `body(b, indices, values)`."""

    def level(b: ScalarBuilder, depth: int, outer: list[str], values: list[str]) -> list[str]:
        if depth == len(extents):
            return list(body(b, outer, values))
        lo, hi = b.const(0, "index"), b.const(extents[depth], "index")
        return serial_for(
            b,
            lo,
            hi,
            [(v, t) for v, (_, t) in zip(values, carried)],
            lambda ib, i, vs: level(ib, depth + 1, [*outer, i], vs),
        )

    return level(b, 0, [], [v for v, _ in carried])


def extract(b: ScalarBuilder, tensor: str, ttype: str, idx: Sequence[str]) -> str:
    return b.op(f"tensor.extract {tensor}[{', '.join(idx)}] : {ttype}")


def clamp(b: ScalarBuilder, index: str, high: int) -> str:
    """An `index` value clamped into [0, high]."""
    above = b.op(f"arith.maxsi {index}, {b.const(0, 'index')} : index")
    return b.op(f"arith.minsi {above}, {b.const(high, 'index')} : index")


def index_of(b: ScalarBuilder, value: str, int_elem: str) -> str:
    """An integer scalar of MLIR type `int_elem` as an `index`."""
    return b.op(f"arith.index_cast {value} : {int_elem} to index")


def offset(b: ScalarBuilder, index: str, scale: int, add: int) -> str:
    """index * scale + add, on `index` values (add may be negative)."""
    scaled = index if scale == 1 else b.op(f"arith.muli {index}, {b.const(scale, 'index')} : index")
    return scaled if add == 0 else b.op(f"arith.addi {scaled}, {b.const(add, 'index')} : index")


def in_range(b: ScalarBuilder, index: str, size: int) -> str:
    """0 <= index < size, as i1."""
    low = b.op(f"arith.cmpi sge, {index}, {b.const(0, 'index')} : index")
    high = b.op(f"arith.cmpi slt, {index}, {b.const(size, 'index')} : index")
    return b.op(f"arith.andi {low}, {high} : i1")


def both(b: ScalarBuilder, conditions: Sequence[str]) -> str | None:
    result = None
    for c in conditions:
        result = c if result is None else b.op(f"arith.andi {result}, {c} : i1")
    return result


def add(b: ScalarBuilder, x: str, y: str, elem: str) -> str:
    return b.op(f"arith.{'addi' if elem.startswith('i') else 'addf'} {x}, {y} : {elem}")


def mul(b: ScalarBuilder, x: str, y: str, elem: str) -> str:
    return b.op(f"arith.{'muli' if elem.startswith('i') else 'mulf'} {x}, {y} : {elem}")


def select(b: ScalarBuilder, cond: str, x: str, y: str, elem: str) -> str:
    return b.op(f"arith.select {cond}, {x}, {y} : {elem}")


def zero_of(b: ScalarBuilder, elem: str) -> str:
    return b.const(0, elem)


# --- contractions -----------------------------------------------------------------------------


def lower_dot_general(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """One thread per result element, a serial loop nest over the contracted dimensions
    (accumulating half types in f32, as the reference does): the products `lower_matmul` does not
    tile (`lower_matmul.uses_tiles`). A product it tiles inside a fused region (the call lowering
    takes the others) is the tiled kernel writing a temporary (`lower_matmul.tiled_tensor`)."""
    tiled = lower_matmul.tiled_tensor(em, op, operands)
    if tiled is not None:
        return [tiled]
    a, b = op.operands
    lc, rc = op.attrs["lhs_contract"], op.attrs["rhs_contract"]
    lb, rb = op.attrs["lhs_batch"], op.attrs["rhs_batch"]
    lf = [d for d in range(a.type.rank) if d not in lc and d not in lb]
    rf = [d for d in range(b.type.rank) if d not in rc and d not in rb]
    result = op.result.type
    acc = compute_elem(result.dtype)
    at, bt = tensor_type(a.type), tensor_type(b.type)
    contracted = [a.type.shape[d] for d in lc]

    def body(bd: ScalarBuilder, idx: list[str]) -> str:
        nb = len(lb)
        a_at: dict[int, str] = {d: idx[k] for k, d in enumerate(lb)}
        b_at: dict[int, str] = {d: idx[k] for k, d in enumerate(rb)}
        a_at |= {d: idx[nb + k] for k, d in enumerate(lf)}
        b_at |= {d: idx[nb + len(lf) + k] for k, d in enumerate(rf)}

        def step(ib: ScalarBuilder, ks: list[str], values: list[str]) -> list[str]:
            ai = a_at | dict(zip(lc, ks))
            bi = b_at | dict(zip(rc, ks))
            x = extend(ib, extract(ib, operands[0], at, [ai[d] for d in range(a.type.rank)]), a.type.dtype)
            y = extend(ib, extract(ib, operands[1], bt, [bi[d] for d in range(b.type.rank)]), b.type.dtype)
            return [add(ib, values[0], mul(ib, x, y, acc), acc)]

        (total,) = serial_nest(bd, contracted, [(zero_of(bd, acc), acc)], step)
        return narrow(bd, total, result.dtype)

    return [per_element(em, result, body)]


def lower_conv2d(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Direct convolution (NCHW input, OIHW weights): one thread per output element, a serial
    loop over input channels and the kernel window; padding reads a clamped element and adds 0.
    For the convolutions `lower_matmul` does not tile; one it tiles inside a fused region is the
    tiled kernel writing a temporary (`lower_matmul.tiled_tensor`)."""
    tiled = lower_matmul.tiled_tensor(em, op, operands)
    if tiled is not None:
        return [tiled]
    x, w = op.operands
    stride, dilation = op.attrs["stride"], op.attrs["dilation"]
    padding = op.attrs["padding"]
    result = op.result.type
    acc = compute_elem(result.dtype)
    xt, wt = tensor_type(x.type), tensor_type(w.type)
    _, channels, height, width = x.type.shape
    _, _, kh, kw = w.type.shape

    def body(bd: ScalarBuilder, idx: list[str]) -> str:
        n, o, y, xx = idx

        def step(ib: ScalarBuilder, ks: list[str], values: list[str]) -> list[str]:
            c, i, j = ks
            row = ib.op(
                f"arith.addi {offset(ib, y, stride[0], -padding[0][0])}, {offset(ib, i, dilation[0], 0)} : index"
            )
            col = ib.op(
                f"arith.addi {offset(ib, xx, stride[1], -padding[1][0])}, {offset(ib, j, dilation[1], 0)} : index"
            )
            valid = both(ib, [in_range(ib, row, height), in_range(ib, col, width)])
            pixel = extract(ib, operands[0], xt, [n, c, clamp(ib, row, height - 1), clamp(ib, col, width - 1)])
            weight = extract(ib, operands[1], wt, [o, c, i, j])
            term = mul(ib, extend(ib, pixel, x.type.dtype), extend(ib, weight, w.type.dtype), acc)
            return [select(ib, valid, add(ib, values[0], term, acc), values[0], acc)]

        if min(height, width, channels) == 0:
            return narrow(bd, zero_of(bd, acc), result.dtype)
        (total,) = serial_nest(bd, (channels, kh, kw), [(zero_of(bd, acc), acc)], step)
        return narrow(bd, total, result.dtype)

    return [per_element(em, result, body)]


def lower_reduce_window(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """max/sum/avg over each window: one thread per output element, a serial loop nest over the
    window; padded positions are skipped (they hold the reduction's identity, or 0 for avg)."""
    (x,) = op.operands
    kind, window, strides, padding = (op.attrs[k] for k in ("kind", "window", "strides", "padding"))
    result = op.result.type
    acc = compute_elem(result.dtype)
    xt = tensor_type(x.type)
    is_float = result.dtype.is_float
    identity = reduction_identity("max", result.dtype) if kind == "max" else 0
    combine = ("maximumf" if is_float else "maxsi") if kind == "max" else ("addf" if is_float else "addi")
    acc_dtype = dt.float32 if acc == "f32" else result.dtype

    def body(bd: ScalarBuilder, idx: list[str]) -> str:
        init = bd.op(f"arith.constant {scalar_literal(identity, acc_dtype)} : {acc}")
        if x.type.size == 0:
            return narrow(bd, init, result.dtype)

        def step(ib: ScalarBuilder, ks: list[str], values: list[str]) -> list[str]:
            at, valid = [], []
            for d, (o, k) in enumerate(zip(idx, ks)):
                p = ib.op(f"arith.addi {offset(ib, o, strides[d], -padding[d][0])}, {k} : index")
                valid.append(in_range(ib, p, x.type.shape[d]))
                at.append(clamp(ib, p, x.type.shape[d] - 1))
            v = extend(ib, extract(ib, operands[0], xt, at), x.type.dtype)
            combined = ib.op(f"arith.{combine} {values[0]}, {v} : {acc}")
            return [select(ib, both(ib, valid), combined, values[0], acc)]

        (total,) = serial_nest(bd, window, [(init, acc)], step)
        if kind == "avg":
            total = bd.op(f"arith.divf {total}, {bd.const(math.prod(window), acc)} : {acc}")
        return narrow(bd, total, result.dtype)

    return [per_element(em, result, body)]


# --- reductions to an index, scans, sort ---------------------------------------------------------


def _arg_extreme(kind: str):
    def lower(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
        """The index of the first extreme along `axis` (a nan is the extreme: the first nan wins),
        one thread per result element walking its row."""
        (x,) = op.operands
        axis = op.attrs["axis"]
        result = op.result.type
        out_elem = elem_type(result.dtype)
        xt = tensor_type(x.type)
        e = compute_elem(x.dtype)
        is_float = x.dtype.is_float
        cmp = ("cmpf ogt" if is_float else "cmpi sgt") if kind == "max" else ("cmpf olt" if is_float else "cmpi slt")

        def body(bd: ScalarBuilder, idx: list[str]) -> str:
            def at(b: ScalarBuilder, k: str) -> str:
                return extend(b, extract(b, operands[0], xt, [*idx[:axis], k, *idx[axis:]]), x.dtype)

            first = at(bd, bd.const(0, "index"))

            def step(ib: ScalarBuilder, k: str, values: list[str]) -> list[str]:
                best, where = values
                v = at(ib, k)
                better = ib.op(f"arith.{cmp}, {v}, {best} : {e}")
                if is_float:
                    v_nan = ib.op(f"arith.cmpf uno, {v}, {v} : {e}")
                    best_num = ib.op(f"arith.cmpf ord, {best}, {best} : {e}")
                    better = ib.op(f"arith.ori {better}, {ib.op(f'arith.andi {v_nan}, {best_num} : i1')} : i1")
                return [select(ib, better, v, best, e), select(ib, better, k, where, "index")]

            lo, hi = bd.const(1, "index"), bd.const(x.type.shape[axis], "index")
            _, where = serial_for(bd, lo, hi, [(first, e), (bd.const(0, "index"), "index")], step)
            return bd.op(f"arith.index_cast {where} : index to {out_elem}")

        return [per_element(em, result, body)]

    return lower


def _rows_of(t: TensorType, axis: int) -> tuple[int, ...]:
    return t.shape[:axis] + t.shape[axis + 1 :]


def _position(b: ScalarBuilder, k: str, n: int, reverse: bool) -> str:
    """Step k of a walk along an axis of n elements: k, or n - 1 - k when walking from the end."""
    if not reverse:
        return k
    return b.op(f"arith.subi {b.const(n - 1, 'index')}, {k} : index")


def _scan(recurrence: bool):
    def lower(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
        """One thread per row walks it in order (the reference's order, so sums round alike),
        storing each running value: cumsum's sums, or linear_recurrence's h = a * h + b."""
        x = op.operands[-1]
        axis, reverse = op.attrs["axis"], bool(op.attrs["reverse"])
        t = x.type
        e = elem_type(t.dtype)
        n = t.shape[axis]
        ttype = tensor_type(t)
        out = em.empty(t)

        def body(b: ScalarBuilder, buffer: str, row: list[str]) -> None:
            mtype = "memref<" + ttype.removeprefix("tensor<")

            def step(ib: ScalarBuilder, k: str, values: list[str]) -> list[str]:
                at = [*row[:axis], _position(ib, k, n, reverse), *row[axis:]]
                v = extract(ib, operands[-1], ttype, at)
                if recurrence:
                    first = ib.op(f"arith.cmpi eq, {k}, {ib.const(0, 'index')} : index")
                    a = extract(ib, operands[0], ttype, at)
                    h = select(ib, first, v, add(ib, mul(ib, a, values[0], e), v, e), e)
                else:
                    h = add(ib, values[0], v, e)
                ib.line(f"memref.store {h}, {buffer}[{', '.join(at)}] : {mtype}")
                return [h]

            serial_for(b, b.const(0, "index"), b.const(n, "index"), [(zero_of(b, e), e)], step)

        return [parallel_writes(em, out, t, _rows_of(t, axis), body) if n else out]

    return lower


def _key_less(b: ScalarBuilder, x: str, y: str, dtype: dt.DType) -> str:
    """x < y in the sort's order: floats with nans last (no nan is less than anything)."""
    if not dtype.is_float:
        return b.op(f"arith.cmpi slt, {x}, {y} : {elem_type(dtype)}")
    e = compute_elem(dtype)
    less = b.op(f"arith.cmpf olt, {x}, {y} : {e}")
    x_num = b.op(f"arith.cmpf ord, {x}, {x} : {e}")
    y_nan = b.op(f"arith.cmpf uno, {y}, {y} : {e}")
    return b.op(f"arith.ori {less}, {b.op(f'arith.andi {x_num}, {y_nan} : i1')} : i1")


# Rows up to this long sort by rank (one launch; each thread walks its row: O(n) per element);
# longer ones by a bitonic network (O(log^2 n) launches, O(n log^2 n) work per row). An estimate,
# not a measurement (nothing has run on a GPU): at 4096 a rank sort's thread makes 4096 steps over
# a row its block holds in cache, a bitonic sort 78 launches of a few microseconds each.
RANK_SORT_MAX = 4096


@on_bytes
def lower_sort(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A stable sort, by rank (rows of at most `RANK_SORT_MAX`) or by a bitonic network
    (`_bitonic_order`, longer rows). By rank: one thread per element counts the elements of its row
    that sort before it (smaller keys, and equal keys at smaller positions) and stores the element
    and its payloads at that rank, O(n) per element."""
    keys = op.operands[0]
    axis = op.attrs["axis"]
    t = keys.type
    n = t.shape[axis]
    outs = [em.empty(v.type, memory_elem_type(v.type.dtype)) for v in op.operands]
    if t.size == 0:
        return outs
    if n > RANK_SORT_MAX:
        order, order_type = _bitonic_order(em, operands[0], t, axis)
        return [
            per_element(em, value.type, _gathered(tensor, moved_type(value.type), order, order_type, axis, n))
            for tensor, value in zip(operands, op.operands)
        ]

    key_dtype = _key_dtype(t)

    def key_at(b: ScalarBuilder, at: list[str]) -> str:
        return _sort_key(b, operands[0], t, at)

    def rank_of(b: ScalarBuilder, idx: list[str]) -> str:
        me = key_at(b, idx)
        i = idx[axis]

        def step(ib: ScalarBuilder, k: str, values: list[str]) -> list[str]:
            other = key_at(ib, [*idx[:axis], k, *idx[axis + 1 :]])
            before = _key_less(ib, other, me, key_dtype)
            not_after = ib.op(f"arith.xori {_key_less(ib, me, other, key_dtype)}, {ib.const(1, 'i1')} : i1")
            earlier = ib.op(f"arith.cmpi slt, {k}, {i} : index")
            tie_before = ib.op(f"arith.andi {not_after}, {earlier} : i1")
            counts = ib.op(f"arith.ori {before}, {tie_before} : i1")
            return [
                select(ib, counts, ib.op(f"arith.addi {values[0]}, {ib.const(1, 'index')} : index"), values[0], "index")
            ]

        (rank,) = serial_for(b, b.const(0, "index"), b.const(n, "index"), [(b.const(0, "index"), "index")], step)
        return clamp(b, rank, n - 1)

    # The ranks once, as a tensor of indices; then each result stored at them.
    ranks = per_element(
        em, TensorType(t.shape, dt.int64), lambda b, idx: b.op(f"arith.index_cast {rank_of(b, idx)} : index to i64")
    )
    rank_type = tensor_type(TensorType(t.shape, dt.int64))
    results = []
    for tensor, value, out in zip(operands, op.operands, outs):
        vt = moved_type(value.type)
        mtype = "memref<" + vt.removeprefix("tensor<")

        def body(b: ScalarBuilder, buffer: str, idx: list[str], tensor=tensor, vt=vt, mtype=mtype) -> None:
            rank = index_of(b, extract(b, ranks, rank_type, idx), "i64")
            at = [*idx[:axis], clamp(b, rank, n - 1), *idx[axis + 1 :]]
            b.line(f"memref.store {extract(b, tensor, vt, idx)}, {buffer}[{', '.join(at)}] : {mtype}")

        results.append(parallel_writes(em, out, value.type, t.shape, body))
    return results


def _key_dtype(t: TensorType) -> dt.DType:
    """The dtype sort keys of type `t` are compared in (bools as int32)."""
    return dt.int32 if t.dtype.is_bool else t.dtype


def _sort_key(b: ScalarBuilder, keys: str, t: TensorType, at: list[str]) -> str:
    """The key at indices `at` of `keys` (type `t`, bools as bytes), in `_key_dtype`."""
    v = extract(b, keys, moved_type(t), at)
    if t.dtype.is_bool:
        return b.op(f"arith.extui {v} : i8 to i32")
    return extend(b, v, t.dtype)


def _bitonic_order(em: KernelEmitter, keys: str, t: TensorType, axis: int) -> tuple[str, str]:
    """For each row of `keys` (type `t`) along `axis`, the positions of its elements in sorted
    order (stable: equal keys keep their order; nans last), as a tensor of i32 whose `axis` is
    padded to m, the next power of two of the row's length n (positions n.. at the end).

    A bitonic sorting network on (key, position) pairs, which order totally (ties broken by
    position, so the network's instability does not show; a padded position sorts after every
    element): an `order` buffer starts as 0, 1, ..., m - 1 along `axis`, then for each of the
    log2(m) * (log2(m) + 1) / 2 passes (a serial loop on the host around one launch) every thread
    compares and maybe swaps one pair: for pass (k, j) (k = 2, 4, ..., m; j = k/2, ..., 1), thread q
    takes i = 2j * (q // j) + q % j and i + j, ascending where i & k is 0. A pass's (log k, log j)
    comes from a constant table indexed by the loop variable. Every index is in its row: i + j < m,
    and a key is read at a clamped position, its value unused for a padded one."""
    n = t.shape[axis]
    m = 1 << (n - 1).bit_length()
    levels = m.bit_length() - 1
    passes = [(s, s - 1 - u) for s in range(1, levels + 1) for u in range(s)]
    order_type = TensorType(t.shape[:axis] + (m,) + t.shape[axis + 1 :], dt.int32)
    ott, mtype = tensor_type(order_type), memref_type(order_type)
    buffer = em.op(f"bufferization.to_buffer {em.empty(order_type, 'i32')} : {ott} to {mtype}")

    def start(b: ScalarBuilder, idx: list[str]) -> None:
        position = b.op(f"arith.index_cast {idx[axis]} : index to i32")
        b.line(f"memref.store {position}, {buffer}[{', '.join(idx)}] : {mtype}")

    parallel_loop(em, order_type.shape, start)
    table = ", ".join(str(s * 32 + u) for s, u in passes)
    steps = em.op(f"arith.constant dense<[{table}]> : tensor<{len(passes)}xi32>")
    zero, count, one = (em.op(f"arith.constant {v} : index") for v in (0, len(passes), 1))
    step = em.fresh("pass")
    em.line(f"scf.for {step} = {zero} to {count} step {one} {{")
    em.indent += "  "
    pairs = order_type.shape[:axis] + (m // 2,) + order_type.shape[axis + 1 :]

    def compare_exchange(b: ScalarBuilder, idx: list[str]) -> None:
        packed = b.op(f"arith.index_cast {extract(b, steps, f'tensor<{len(passes)}xi32>', [step])} : i32 to index")
        one, five, low_bits = b.const(1, "index"), b.const(5, "index"), b.const(31, "index")
        k = b.op(f"arith.shli {one}, {b.op(f'arith.shrui {packed}, {five} : index')} : index")
        j = b.op(f"arith.shli {one}, {b.op(f'arith.andi {packed}, {low_bits} : index')} : index")
        q = idx[axis]
        block = b.op(
            f"arith.muli {b.op(f'arith.divui {q}, {j} : index')}, {b.op(f'arith.addi {j}, {j} : index')} : index"
        )
        i = b.op(f"arith.addi {block}, {b.op(f'arith.remui {q}, {j} : index')} : index")
        partner = b.op(f"arith.addi {i}, {j} : index")
        at_i, at_p = [*idx[:axis], i, *idx[axis + 1 :]], [*idx[:axis], partner, *idx[axis + 1 :]]
        first = b.op(f"memref.load {buffer}[{', '.join(at_i)}] : {mtype}")
        second = b.op(f"memref.load {buffer}[{', '.join(at_p)}] : {mtype}")
        ascending = b.op(f"arith.cmpi eq, {b.op(f'arith.andi {i}, {k} : index')}, {b.const(0, 'index')} : index")
        out_of_order = b.op(
            f"arith.select {ascending}, {_sorts_before(b, second, first, keys, t, idx, axis)}, "
            f"{_sorts_before(b, first, second, keys, t, idx, axis)} : i1"
        )
        b.line(f"scf.if {out_of_order} {{")
        b.line(f"  memref.store {second}, {buffer}[{', '.join(at_i)}] : {mtype}")
        b.line(f"  memref.store {first}, {buffer}[{', '.join(at_p)}] : {mtype}")
        b.line("}")

    parallel_loop(em, pairs, compare_exchange)
    em.indent = em.indent[:-2]
    em.line("}")
    return em.op(f"bufferization.to_tensor {buffer} restrict writable : {mtype} to {ott}"), ott


def _sorts_before(b: ScalarBuilder, x: str, y: str, keys: str, t: TensorType, idx: list[str], axis: int) -> str:
    """Whether the element at position `x` of its row sorts before the one at `y` (i32 positions;
    the row's length n and above are padding, after every element): by key, then by position."""
    n = t.shape[axis]
    limit = b.const(n, "i32")
    x_pad = b.op(f"arith.cmpi sge, {x}, {limit} : i32")
    y_pad = b.op(f"arith.cmpi sge, {y}, {limit} : i32")
    key_dtype = _key_dtype(t)

    def key(position: str) -> str:
        return _sort_key(b, keys, t, [*idx[:axis], clamp(b, index_of(b, position, "i32"), n - 1), *idx[axis + 1 :]])

    kx, ky = key(x), key(y)
    less = _key_less(b, kx, ky, key_dtype)
    tie = b.op(f"arith.xori {_key_less(b, ky, kx, key_dtype)}, {b.const(1, 'i1')} : i1")
    earlier = b.op(f"arith.cmpi slt, {x}, {y} : i32")
    by_key = b.op(f"arith.ori {less}, {b.op(f'arith.andi {tie}, {earlier} : i1')} : i1")
    # both padding: by position; only y padding: x first; only x padding: y first
    neither = b.op(f"arith.ori {x_pad}, {y_pad} : i1")
    padded = b.op(f"arith.select {x_pad}, {b.op(f'arith.andi {y_pad}, {earlier} : i1')}, {b.const(1, 'i1')} : i1")
    return b.op(f"arith.select {neither}, {padded}, {by_key} : i1")


def _gathered(tensor: str, vt: str, order: str, order_type: str, axis: int, n: int):
    """The body of a per-element kernel: the element of `tensor` (type `vt`) at the position the
    sorted order gives (clamped: positions are below n for the first n slots of a row)."""

    def body(b: ScalarBuilder, idx: list[str]) -> str:
        position = clamp(b, index_of(b, extract(b, order, order_type, idx), "i32"), n - 1)
        return extract(b, tensor, vt, [*idx[:axis], position, *idx[axis + 1 :]])

    return body


# --- indexing and padding ----------------------------------------------------------------------


@on_bytes
def lower_pad(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Each output element is x's element it lands on, or the padding value (read in the kernel)."""
    x, value = op.operands
    low, interior = op.attrs["low"], op.attrs["interior"]
    result = op.result.type
    xt, vt = moved_type(x.type), moved_type(value.type)
    if x.type.rank == 0:
        return [operands[0]]

    def body(b: ScalarBuilder, idx: list[str]) -> str:
        pad_value = extract(b, operands[1], vt, [])
        if x.type.size == 0:
            return pad_value
        at, valid = [], []
        for d, o in enumerate(idx):
            step = interior[d] + 1
            rel = offset(b, o, 1, -low[d])
            source = b.op(f"arith.divsi {rel}, {b.const(step, 'index')} : index") if step > 1 else rel
            valid.append(in_range(b, source, x.type.shape[d]))
            if step > 1:
                rem = b.op(f"arith.remsi {rel}, {b.const(step, 'index')} : index")
                valid.append(b.op(f"arith.cmpi eq, {rem}, {b.const(0, 'index')} : index"))
            at.append(clamp(b, source, x.type.shape[d] - 1))
        return select(b, both(b, valid), extract(b, operands[0], xt, at), pad_value, memory_elem_type(x.type.dtype))

    return [per_element(em, result, body)]


@on_bytes
def lower_concatenate(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Each output element from the operand whose range along `axis` holds it. An operand that is
    a slice no kernel computed (`em.operand_slices`: it cuts `axis` only) is read from its source."""
    axis = op.attrs["axis"]
    result = op.result.type
    elem = memory_elem_type(result.dtype)
    parts, start = [], 0
    for i, (x, v) in enumerate(zip(operands, op.operands)):
        extent = v.type.shape[axis]
        view = em.operand_slices.get(i)
        source, skip = (view.source.type, view.start[axis]) if view is not None else (v.type, 0)
        if extent:
            parts.append((x, source, start, extent, skip))
        start += extent

    def body(b: ScalarBuilder, idx: list[str]) -> str:
        picked = None
        for x, source, first, extent, skip in parts:
            local = offset(b, clamp(b, offset(b, idx[axis], 1, -first), extent - 1), 1, skip)
            v = extract(b, x, moved_type(source), [*idx[:axis], local, *idx[axis + 1 :]])
            if picked is None:
                picked = v
                continue
            inside = b.op(f"arith.cmpi sge, {idx[axis]}, {b.const(first, 'index')} : index")
            picked = select(b, inside, v, picked, elem)
        return picked

    return [per_element(em, result, body)]


@on_bytes
def lower_gather(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """out[pre, i..., post] = x[pre, clamp(idx[i...]), post], the index read in the kernel."""
    x, indices = op.operands
    axis = op.attrs["axis"]
    result = op.result.type
    xt, it = moved_type(x.type), tensor_type(indices.type)
    k = indices.type.rank

    def body(b: ScalarBuilder, idx: list[str]) -> str:
        i = index_of(b, extract(b, operands[1], it, idx[axis : axis + k]), elem_type(indices.type.dtype))
        at = [*idx[:axis], clamp(b, i, x.type.shape[axis] - 1), *idx[axis + k :]]
        return extract(b, operands[0], xt, at)

    return [per_element(em, result, body)]


def lower_scatter_add(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A copy of x, then one thread per update adding it at its clamped index with an atomic add
    (duplicate indices accumulate; their order, and so a float sum's rounding, is not fixed)."""
    x, indices, updates = op.operands
    axis = op.attrs["axis"]
    t = x.type
    e = elem_type(t.dtype)
    xt, it, ut = tensor_type(t), tensor_type(indices.type), tensor_type(updates.type)
    k = indices.type.rank
    copy = per_element(em, t, lambda b, idx: extract(b, operands[0], xt, idx))
    if t.size == 0 or updates.type.size == 0:
        return [copy]
    mtype = "memref<" + xt.removeprefix("tensor<")
    kind = "addi" if t.dtype.is_int else "addf"

    def body(b: ScalarBuilder, buffer: str, idx: list[str]) -> None:
        i = index_of(b, extract(b, operands[1], it, idx[axis : axis + k]), elem_type(indices.type.dtype))
        at = [*idx[:axis], clamp(b, i, t.shape[axis] - 1), *idx[axis + k :]]
        update = extract(b, operands[2], ut, idx)
        b.op(f"memref.atomic_rmw {kind} {update}, {buffer}[{', '.join(at)}] : ({e}, {mtype}) -> {e}")

    return [parallel_writes(em, copy, t, updates.type.shape, body)]


@on_bytes
def lower_dynamic_slice(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """A window at starts read in the kernel, each clamped into [0, dim - size]."""
    x, *starts = op.operands
    sizes = op.attrs["sizes"]
    if x.type.rank == 0:
        return [operands[0]]
    xt = moved_type(x.type)

    def body(b: ScalarBuilder, idx: list[str]) -> str:
        at = []
        for d, (o, s) in enumerate(zip(idx, starts)):
            elem = memory_elem_type(s.type.dtype)
            first = clamp(
                b, index_of(b, extract(b, operands[1 + d], f"tensor<{elem}>", []), elem), x.type.shape[d] - sizes[d]
            )
            at.append(b.op(f"arith.addi {first}, {o} : index"))
        return extract(b, operands[0], xt, at)

    return [per_element(em, op.result.type, body)]


# --- reductions -----------------------------------------------------------------------------------

# Threads a reduction's first stage aims for (a GPU runs tens of thousands at once), the most
# partials per result, and the fewest elements each partial combines.
REDUCTION_THREADS = 65536
PARTIALS_MAX = 1024
PER_PARTIAL_MIN = 8


def partials_per_result(results: int, extent: int) -> int:
    """How many partials each of `results` reductions over `extent` elements is split into (a power
    of two), or 1 to reduce each in one thread: enough partials for `REDUCTION_THREADS` threads in
    all, at most `PARTIALS_MAX`, each combining at least `PER_PARTIAL_MIN` elements."""
    wanted = 1 << max(0, (-(-REDUCTION_THREADS // results) - 1).bit_length())
    most = extent // PER_PARTIAL_MIN
    fits = 1 << (most.bit_length() - 1) if most else 1
    parts = min(wanted, PARTIALS_MAX, fits)
    return parts if parts >= 4 else 1


def _identity(b: ScalarBuilder, kind: str, acc_dtype) -> str:
    e = compute_elem(acc_dtype)
    return b.op(f"arith.constant {scalar_literal(reduction_identity(kind, acc_dtype), acc_dtype)} : {e}")


def _reduced_from_first(em: KernelEmitter, x: str, t: TensorType, axis: int, kind: str, acc_dtype) -> str:
    """`x` (of type `t`) combined by `kind` over `axis`, in `acc_dtype`: a reduction generic whose
    first element along `axis` starts each result (no fill of the identity, a kernel of its own).
    Being a reduction, elementwise fusion never copies it into a consumer that reads each result
    many times (a row max broadcast over its row would combine the row again for every element);
    reading x through an indexing map, it takes the elementwise kernels computing x into itself."""
    e = compute_elem(acc_dtype)
    combine = lower_reduction.COMBINE[kind][0 if acc_dtype.is_float else 1]
    dims = [f"d{i}" for i in range(t.rank)]
    out = TensorType(tuple(d for i, d in enumerate(t.shape) if i != axis), acc_dtype)

    def body(b: ScalarBuilder, args: list[str]) -> str:
        v = extend(b, args[0], t.dtype)
        first = b.op(f"arith.cmpi eq, {b.op(f'linalg.index {axis} : index')}, {b.const(0, 'index')} : index")
        return select(b, first, v, b.op(f"arith.{combine} {args[1]}, {v} : {e}"), e)

    return em.generic(
        [(x, tensor_type(t))],
        (em.empty(out), tensor_type(out)),
        [
            em.affine_map(f"({', '.join(dims)}) -> ({', '.join(dims)})"),
            em.affine_map(f"({', '.join(dims)}) -> ({', '.join(d for i, d in enumerate(dims) if i != axis)})"),
        ],
        ["reduction" if i == axis else "parallel" for i in range(t.rank)],
        body,
        [elem_type(t.dtype)],
        e,
    )


def _strided_partials(em: KernelEmitter, x: str, source: TensorType, form, parts: int, kind: str, acc_dtype) -> str:
    """Partials (pre..., c, post...) combining x[pre..., k C + c, post...] for every k (C = `parts`
    need not divide R: the last round reads only the elements that exist), one thread each."""
    pre, r, post = form
    grid = source.with_shape((*pre, r, *post))
    x_grid = reshape_tensor(em, x, source, grid)
    xt = tensor_type(grid)
    e = compute_elem(acc_dtype)
    combine = lower_reduction.COMBINE[kind][0 if acc_dtype.is_float else 1]
    at_c = len(pre)

    def partial(bd: ScalarBuilder, idx: list[str]) -> str:
        start = _identity(bd, kind, acc_dtype)

        def step(ib: ScalarBuilder, k: str, values: list[str]) -> list[str]:
            j = ib.op(f"arith.addi {offset(ib, k, parts, 0)}, {idx[at_c]} : index")
            inside = ib.op(f"arith.cmpi slt, {j}, {ib.const(r, 'index')} : index")
            where = [*idx[:at_c], clamp(ib, j, max(r - 1, 0)), *idx[at_c + 1 :]]
            v = extend(ib, extract(ib, x_grid, xt, where), source.dtype)
            return [ib.op(f"arith.{combine} {values[0]}, {select(ib, inside, v, start, e)} : {e}")]

        trips = bd.const(-(-r // parts), "index")
        (total,) = serial_for(bd, bd.const(0, "index"), trips, [(start, e)], step)
        return total

    return per_element(em, TensorType((*pre, parts, *post), acc_dtype), partial)


def lower_reduce(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """reduce_sum/max/min/prod over one contiguous group of axes, in two stages when its results
    would leave most threads idle: with x as (pre..., R, post...) (the group collapsed to R),
    partial (pre..., c, post...) combines x[pre..., k C + c, post...] for every k, so consecutive
    threads (c, or the last of post) read consecutive elements; then each result combines its C
    partials, in the result's own shape (so it is written straight into the result's buffer). A
    reduction to one element always takes two stages, through a (1, C) partial and a (1,) total:
    a kernel needs a parallel dimension, or it would stay a loop on the host. Anything else is the
    shared lowering (one thread per result)."""
    (x,) = op.operands
    source, result = x.type, op.result.type
    axes = sorted(a % max(source.rank, 1) for a in op.attrs["axes"])
    if result.size == 1 and axes:  # every element into one (kept dimensions, if any, of extent 1)
        pre, r, post = (1,), source.size, ()
    elif source.size and axes and len(lower_reduction.contiguous_groups(axes)) == 1:
        pre, r, post = (
            source.shape[: axes[0]],
            math.prod(source.shape[axes[0] : axes[-1] + 1]),
            source.shape[axes[-1] + 1 :],
        )
    else:
        return lower_reduction.lower_reduce(em, op, operands)
    parts = partials_per_result(result.size, r)
    if parts == 1 and result.size > 1:
        return lower_reduction.lower_reduce(em, op, operands)
    kind = op.name.removeprefix("reduce_")
    acc_dtype = lower_reduction.accumulator_dtype(source.dtype)
    divisor = next((c for c in range(parts, max(parts // 2, 3), -1) if r % c == 0), None)
    last = source.shape[-1] if source.rank >= 2 else 0
    if result.size == 1 and 4 <= last <= PARTIALS_MAX and r // last >= PER_PARTIAL_MIN:
        divisor = last  # a partial per column: x's own rows are the blocks (no reshape across them)
    if divisor is not None:  # x as blocks (pre..., R / C, C, post...), reduced over the blocks
        parts = divisor
        blocks = source.with_shape((*pre, r // parts, parts, *post))
        x_blocks = reshape_tensor(em, operands[0], source, blocks)
        partials = _reduced_from_first(em, x_blocks, blocks, len(pre), kind, acc_dtype)
    else:
        partials = _strided_partials(em, operands[0], source, (pre, r, post), parts, kind, acc_dtype)
    # Second stage: each result combines its partials, in the result's own shape.
    partial_type = TensorType((*pre, parts, *post), acc_dtype)
    total = _reduced_from_first(em, partials, partial_type, len(pre), kind, acc_dtype)
    kept = TensorType((*pre, *post), acc_dtype)
    if acc_dtype != result.dtype:
        total = map_elementwise(em, kept.with_dtype(result.dtype), [(total, Value(kept))], lambda b, v: v[0])
    return [reshape_tensor(em, total, kept.with_dtype(result.dtype), result)]


# The ops these lowerings handle on operands and results of rank 0 themselves.
OWN_SCALARS = ("pad", "dynamic_slice")


# The GPU's own lowerings. Their kernels read operands with `tensor.extract` (nothing is fused
# into them) and say themselves whether they loop (`KernelEmitter.loop_kernels`).
LOWERINGS = {
    **dict.fromkeys(lower_reduction.REDUCE_OPS, lower_reduce),
    "dot_general": lower_dot_general,
    "conv2d": lower_conv2d,
    "reduce_window": lower_reduce_window,
    "argmax": _arg_extreme("max"),
    "argmin": _arg_extreme("min"),
    "cumsum": _scan(recurrence=False),
    "linear_recurrence": _scan(recurrence=True),
    "sort": lower_sort,
    "pad": lower_pad,
    "concatenate": lower_concatenate,
    "gather": lower_gather,
    "scatter_add": lower_scatter_add,
    "dynamic_slice": lower_dynamic_slice,
}


def register(table: LoweringTable) -> None:
    """Add the GPU's own lowerings to `table` (the GPU's)."""
    table.tensor.update(LOWERINGS)
    # Matmul-shaped products and convolutions as a tiled kernel through shared memory; the others
    # (and those whose buffers the lowering does not see) fall back to their tensor lowerings.
    table.call["dot_general"] = table.call["conv2d"] = lower_matmul.lower_tiled
