"""`batching`: vmap's graph transformation.

`batch_into(graph, inputs, batched, size)` replays a graph traced on one example into the current
trace so that it computes a whole batch: every value is either *unbatched* (the same for every
example, the graph's own type) or *batched* (one slice per example, stacked along a new leading
axis of `size`). Each op is replayed by its rule in `BATCH_RULES`:

    rule(b: Batching, operands, batched) -> (results, batched flags of the results)

where `operands` are tracers (batched ones carry the batch axis at position 0) and `b` emits ops
with the location and device of the op being batched. An op none of whose operands is batched is
replayed unchanged. Rules never loop over the batch, with one exception listed in
`docs/transforms.md` (a conv whose filters are batched runs one conv per example in a `for` loop).

The batch axis is always leading inside the transformation; `vmap` moves it from and to the
user's `in_axes`/`out_axes` at the boundary. Every registered op has a rule or a clear error
(`tests/test_vmap.py` checks the registry), so a vmapped program is a single graph that fusion and
the backends treat as any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flowjit.errors import FlowjitTypeError, op_error
from flowjit.frontend.autodiff import emit_traced
from flowjit.frontend.trace import Trace, Tracer, current_trace
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph, Op
from flowjit.ir.location import UNKNOWN, Location
from flowjit.ir.ops import (
    COMMUNICATION,
    CONVERSION,
    CREATION,
    ELEMENTWISE_BINARY,
    ELEMENTWISE_TERNARY,
    ELEMENTWISE_UNARY,
    STATEFUL,
    get_opdef,
    ops_in,
)
from flowjit.ir.types import TensorType

BATCH_RULES: dict[str, Callable] = {}


def batched_type(t: TensorType, size: int) -> TensorType:
    return t.with_shape((size,) + tuple(t.shape))


class Batching:
    """Emits the batched replacement of one op: ops take the op's location and device."""

    def __init__(self, op: Op | None, size: int, loc: Location | None = None, device: str | None = None):
        self.op = op
        self.size = size
        self.loc = loc if loc is not None else (op.loc if op is not None else UNKNOWN)
        self.device = device if device is not None else (op.device if op is not None else None)

    @property
    def trace(self) -> Trace:
        return current_trace()

    def emit(self, name: str, operands: Sequence, attrs: dict | None = None, regions=()) -> list[Tracer]:
        return emit_traced(self.trace, name, operands, attrs or {}, self.loc, regions, self.device)

    def one(self, name: str, operands: Sequence, **attrs) -> Tracer:
        (out,) = self.emit(name, operands, attrs)
        return out

    def error(self, message: str) -> FlowjitTypeError:
        return op_error(FlowjitTypeError, self.loc, self.op.name, f"vmap: {message}")

    # --- helpers shared by the rules ------------------------------------------------------------------

    def scalar(self, value, dtype: dt.DType) -> Tracer:
        return self.one("constant", [], value=np.asarray(value, dtype.np_dtype))

    def full(self, value, shape, dtype: dt.DType) -> Tracer:
        scalar = self.scalar(value, dtype)
        return self.one("broadcast", [scalar], shape=tuple(shape), dims=()) if shape else scalar

    def batch(self, x: Tracer) -> Tracer:
        """An unbatched value broadcast to the batch: the same slice for every example."""
        shape = tuple(x.shape)
        return self.one("broadcast", [x], shape=(self.size,) + shape, dims=tuple(range(1, len(shape) + 1)))

    def batched(self, x: Tracer, is_batched: bool) -> Tracer:
        return x if is_batched else self.batch(x)

    def transpose(self, x: Tracer, perm: Sequence[int]) -> Tracer:
        perm = tuple(perm)
        if perm == tuple(range(len(perm))):
            return x
        return self.one("transpose", [x], perm=perm)

    def convert(self, x: Tracer, dtype: dt.DType) -> Tracer:
        return x if dt.dtype(x.dtype) == dtype else self.one("convert", [x], dtype=dtype)

    def reshape(self, x: Tracer, shape: Sequence[int]) -> Tracer:
        shape = tuple(shape)
        return x if shape == tuple(x.shape) else self.one("reshape", [x], shape=shape)

    def to_front(self, x: Tracer, axis: int) -> Tracer:
        """Move dimension `axis` of `x` to position 0."""
        rank = len(x.shape)
        return self.transpose(x, [axis] + [d for d in range(rank) if d != axis])

    def flat_offsets(self, indices: Tracer, dim: int) -> Tracer:
        """Batched `indices` (clamped into [0, dim-1]) plus `b * dim` for example b: positions in the
        batch's rows laid end to end, so one gather or scatter serves every example."""
        dtype = dt.dtype(indices.dtype)
        clamped = self.one("max", [indices, self.full(0, indices.shape, dtype)])
        clamped = self.one("min", [clamped, self.full(max(dim - 1, 0), indices.shape, dtype)])
        example = self.one("iota", [], shape=tuple(indices.shape), dtype=dtype, dimension=0)
        base = self.one("mul", [example, self.full(dim, indices.shape, dtype)])
        return self.one("add", [clamped, base])


# --- the transformation ------------------------------------------------------------------------------------


def batch_into(graph: Graph, inputs: Sequence, batched: Sequence[bool], size: int):
    """Emit `graph` into the current trace for a batch of `size`: `inputs` are its parameters (the
    batched ones with a leading axis of `size`). Returns the results and their batched flags."""
    env: dict = {}
    for p, x, flag in zip(graph.params, inputs, batched):
        env[p] = (x, bool(flag))
    for op in graph.ops:
        operands = [env[v][0] for v in op.operands]
        flags = [env[v][1] for v in op.operands]
        if not any(flags):  # regions see only their operands, so they are unbatched too
            outs = emit_traced(current_trace(), op.name, operands, op.attrs, op.loc, op.regions, op.device)
            out_flags = [False] * len(outs)
        else:
            rule = BATCH_RULES.get(op.name)
            if rule is None:
                raise op_error(FlowjitTypeError, op.loc, op.name, f"vmap: op '{op.name}' has no batching rule")
            outs, out_flags = rule(Batching(op, size), operands, flags)
        env.update(zip(op.results, zip(outs, out_flags)))
    return [env[r][0] for r in graph.results], [env[r][1] for r in graph.results]


# op name -> flags(op, operand flags) -> result flags, for ops whose results may be unbatched although
# an operand is batched (control flow); every other op's results are batched when an operand is.
FLAG_RULES: dict[str, Callable] = {}


def result_flags(region: Graph, batched: Sequence[bool]) -> list[bool]:
    """Which results of `region` its batched form computes batched, from the flags alone (without
    tracing): what the rules below produce, so regions can be forced to agree before they are built."""
    env = dict(zip(region.params, (bool(f) for f in batched)))
    for op in region.ops:
        flags = [env[v] for v in op.operands]
        if not any(flags):
            out = [False] * len(op.results)
        elif op.name in FLAG_RULES:
            out = FLAG_RULES[op.name](op, flags)
        else:
            out = [True] * len(op.results)
        env.update(zip(op.results, out))
    return [env[r] for r in region.results]


def batch_region(
    region: Graph, batched: Sequence[bool], size: int, force: Sequence[bool] | None = None
) -> tuple[Graph, list[bool]]:
    """`region` rewritten for a batch: parameters with `batched` get a leading axis. Results are
    batched where the computation makes them so, and also where `force` asks (an unbatched result
    is broadcast). Returns the new region and its results' flags."""
    with Trace(region.name) as trace:
        params = [
            trace.new_param(batched_type(p.type, size) if flag else p.type, p.name_hint)
            for p, flag in zip(region.params, batched)
        ]
        outs, flags = batch_into(region, params, batched, size)
        if force is not None:
            fill = Batching(None, size, region_loc(region))
            outs = [fill.batch(o) if want and not f else o for o, f, want in zip(outs, flags, force)]
            flags = [f or want for f, want in zip(flags, force)]
        trace.graph.results = [trace.lift(o) for o in outs]
    assert not trace.captures, "internal error: a batched region captured an outer value"
    return trace.graph, flags


def batch_graph(graph: Graph, batched: Sequence[bool], size: int) -> Graph:
    """A standalone graph computing `graph` for a batch, every result batched (for tests and dumps)."""
    return batch_region(graph, batched, size, force=[True] * len(graph.results))[0]


def region_loc(region: Graph) -> Location | None:
    return region.ops[-1].loc if region.ops else None


def effectful_ops(region: Graph) -> list[Op]:
    return [op for op in region.walk() if get_opdef(op.name).effectful]


# --- rules: elementwise and creation -----------------------------------------------------------------------


def _elementwise(b: Batching, operands, batched):
    xs = [b.batched(x, f) for x, f in zip(operands, batched)]
    outs = b.emit(b.op.name, xs, b.op.attrs)
    return outs, [True] * len(outs)


for _name in ops_in(ELEMENTWISE_UNARY, ELEMENTWISE_BINARY, ELEMENTWISE_TERNARY, CONVERSION):
    BATCH_RULES[_name] = _elementwise


def _no_operands(b: Batching, operands, batched):  # never reached: no operand can be batched
    outs = b.emit(b.op.name, operands, b.op.attrs)
    return outs, [False] * len(outs)


for _name in ops_in(CREATION):
    BATCH_RULES[_name] = _no_operands


# --- rules: reductions and windows ---------------------------------------------------------------------------


def _shift(axis: int, rank: int) -> int:
    return axis % rank + 1


def _reduce(b: Batching, operands, batched):
    (x,) = operands
    rank = len(x.shape) - 1
    axes = tuple(_shift(a, rank) for a in b.op.attrs["axes"])
    return b.emit(b.op.name, [x], {**b.op.attrs, "axes": axes}), [True]


for _name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"):
    BATCH_RULES[_name] = _reduce


def _along_axis(b: Batching, operands, batched):
    """Ops with one `axis` attribute over operands of one shape (arg-reductions, scans, sort)."""
    xs = [b.batched(x, f) for x, f in zip(operands, batched)]
    rank = len(xs[0].shape) - 1
    outs = b.emit(b.op.name, xs, {**b.op.attrs, "axis": _shift(b.op.attrs["axis"], rank)})
    return outs, [True] * len(outs)


for _name in ("argmax", "argmin", "cumsum", "linear_recurrence", "sort"):
    BATCH_RULES[_name] = _along_axis


def _reduce_window(b: Batching, operands, batched):
    (x,) = operands
    attrs = b.op.attrs
    new = {
        **attrs,
        "window": (1,) + tuple(attrs["window"]),
        "strides": (1,) + tuple(attrs["strides"]),
        "padding": ((0, 0),) + tuple(tuple(p) for p in attrs["padding"]),
    }
    return b.emit("reduce_window", [x], new), [True]


BATCH_RULES["reduce_window"] = _reduce_window


# --- rules: movement -------------------------------------------------------------------------------------------


def _broadcast(b: Batching, operands, batched):
    (x,) = operands
    attrs = b.op.attrs
    shape = (b.size,) + tuple(attrs["shape"])
    dims = (0,) + tuple(d + 1 for d in attrs["dims"])
    return [b.one("broadcast", [x], shape=shape, dims=dims)], [True]


def _reshape(b: Batching, operands, batched):
    (x,) = operands
    return [b.reshape(x, (b.size,) + tuple(b.op.attrs["shape"]))], [True]


def _transpose(b: Batching, operands, batched):
    (x,) = operands
    return [b.transpose(x, (0,) + tuple(p + 1 for p in b.op.attrs["perm"]))], [True]


def _slice(b: Batching, operands, batched):
    (x,) = operands
    a = b.op.attrs
    new = {
        "start": (0,) + tuple(a["start"]),
        "limit": (b.size,) + tuple(a["limit"]),
        "stride": (1,) + tuple(a["stride"]),
    }
    return b.emit("slice", [x], new), [True]


def _dynamic_slice(b: Batching, operands, batched):
    x, *starts = operands
    x_batched, start_flags = batched[0], batched[1:]
    sizes = tuple(b.op.attrs["sizes"])
    shape = tuple(x.shape[1:]) if x_batched else tuple(x.shape)
    index_dtype = dt.dtype(starts[0].dtype) if starts else dt.int32
    # Dimensions with the same start for every example: one dynamic_slice (whole dimension where
    # the start differs per example, and the whole batch).
    plain, plain_sizes = ([b.scalar(0, index_dtype)], [b.size]) if x_batched else ([], [])
    for s, flag, n, d in zip(starts, start_flags, sizes, shape):
        plain.append(b.scalar(0, index_dtype) if flag else b.convert(s, index_dtype))
        plain_sizes.append(d if flag else n)
    out = x if tuple(plain_sizes) == tuple(x.shape) else b.one("dynamic_slice", [x, *plain], sizes=tuple(plain_sizes))
    # Dimensions whose start differs per example: a gather of each example's window positions.
    for axis, (s, flag, n, d) in enumerate(zip(starts, start_flags, sizes, shape)):
        if not flag:
            continue
        sdt = dt.dtype(s.dtype)
        start = b.one("max", [s, b.full(0, s.shape, sdt)])
        start = b.one("min", [start, b.full(d - n, s.shape, sdt)])
        window = b.one("broadcast", [start], shape=(b.size, n), dims=(0,))
        positions = b.one("add", [window, b.one("iota", [], shape=(b.size, n), dtype=sdt, dimension=1)])
        if x_batched:
            out = _gather_both(b, out, positions, axis)
        else:  # a gather from the one shared array puts the batch at `axis`
            out = b.to_front(b.one("gather", [out, positions], axis=axis), axis)
            x_batched = True
    return [out], [True]


def _pad(b: Batching, operands, batched):
    x, value = operands
    a = b.op.attrs
    low, high, interior = (0,) + tuple(a["low"]), (0,) + tuple(a["high"]), (0,) + tuple(a["interior"])
    x = b.batched(x, batched[0])
    if not batched[1]:
        return b.emit("pad", [x, value], {"low": low, "high": high, "interior": interior}), [True]
    # A padding value per example: pad with zero, then select the value where the mask says padding.
    dtype = dt.dtype(x.dtype)
    padded = b.one("pad", [x, b.scalar(0, dtype)], low=low, high=high, interior=interior)
    inside = b.full(True, x.shape, dt.bool_)
    mask = b.one("pad", [inside, b.scalar(False, dt.bool_)], low=low, high=high, interior=interior)
    fill = b.one("broadcast", [value], shape=tuple(padded.shape), dims=(0,))
    return [b.one("select", [mask, padded, fill])], [True]


def _concatenate(b: Batching, operands, batched):
    xs = [b.batched(x, f) for x, f in zip(operands, batched)]
    rank = len(xs[0].shape) - 1
    return b.emit("concatenate", xs, {"axis": _shift(b.op.attrs["axis"], rank)}), [True]


def _gather_both(b: Batching, x: Tracer, idx: Tracer, axis: int) -> Tracer:
    """numpy.take(x[k], idx[k], axis) for every example k, both operands batched: one gather over
    the batch's rows laid end to end, (B, *pre, *idx, *post) as the op's result layout says."""
    shape = tuple(x.shape[1:])
    dim = shape[axis]
    pre, post = shape[:axis], shape[axis + 1 :]
    rows = b.transpose(x, [0, axis + 1] + [d + 1 for d in range(len(shape)) if d != axis])
    rows = b.reshape(rows, (b.size * dim,) + pre + post)
    taken = b.one("gather", [rows, b.flat_offsets(idx, dim)], axis=0)  # (B, *idx, *pre, *post)
    n_idx = len(idx.shape) - 1
    perm = [0] + [1 + n_idx + d for d in range(len(pre))] + [1 + d for d in range(n_idx)]
    perm += [1 + n_idx + len(pre) + d for d in range(len(post))]
    return b.transpose(taken, perm)


def _gather(b: Batching, operands, batched):
    x, idx = operands
    x_batched, idx_batched = batched
    rank = len(x.shape) - (1 if x_batched else 0)
    axis = b.op.attrs["axis"] % rank
    if not idx_batched:
        return [b.one("gather", [x, idx], axis=axis + 1)], [True]
    if not x_batched:  # the result has the batch at `axis`: (pre, B, *idx, post)
        return [b.to_front(b.one("gather", [x, idx], axis=axis), axis)], [True]
    return [_gather_both(b, x, idx, axis)], [True]


def _scatter_add(b: Batching, operands, batched):
    x, idx, updates = operands
    x_batched, idx_batched, upd_batched = batched
    rank = len(x.shape) - (1 if x_batched else 0)
    axis = b.op.attrs["axis"] % rank
    x, updates = b.batched(x, x_batched), b.batched(updates, upd_batched)
    if not idx_batched:
        return [b.one("scatter_add", [x, idx, updates], axis=axis + 1)], [True]
    shape = tuple(x.shape[1:])
    dim, pre, post = shape[axis], shape[:axis], shape[axis + 1 :]
    n_idx = len(idx.shape) - 1
    to_rows = [0, axis + 1] + [d + 1 for d in range(len(shape)) if d != axis]
    rows = b.reshape(b.transpose(x, to_rows), (b.size * dim,) + pre + post)
    # updates (B, *pre, *idx, *post) -> (B, *idx, *pre, *post), the layout of a gather of `rows`
    perm = [0] + [1 + len(pre) + d for d in range(n_idx)] + [1 + d for d in range(len(pre))]
    perm += [1 + len(pre) + n_idx + d for d in range(len(post))]
    summed = b.one("scatter_add", [rows, b.flat_offsets(idx, dim), b.transpose(updates, perm)], axis=0)
    summed = b.reshape(summed, (b.size, dim) + pre + post)
    back = [0] * len(to_rows)
    for position, d in enumerate(to_rows):
        back[d] = position
    return [b.transpose(summed, back)], [True]


BATCH_RULES.update(
    broadcast=_broadcast,
    reshape=_reshape,
    transpose=_transpose,
    slice=_slice,
    dynamic_slice=_dynamic_slice,
    pad=_pad,
    concatenate=_concatenate,
    gather=_gather,
    scatter_add=_scatter_add,
)


# --- rules: contractions -------------------------------------------------------------------------------------


def _dot_general(b: Batching, operands, batched):
    lhs, rhs = operands
    lb_flag, rb_flag = batched
    a = b.op.attrs
    shift_l, shift_r = int(lb_flag), int(rb_flag)
    lc = tuple(d + shift_l for d in a["lhs_contract"])
    rc = tuple(d + shift_r for d in a["rhs_contract"])
    lbatch = tuple(d + shift_l for d in a["lhs_batch"])
    rbatch = tuple(d + shift_r for d in a["rhs_batch"])
    if lb_flag and rb_flag:
        attrs = {"lhs_contract": lc, "rhs_contract": rc, "lhs_batch": (0,) + lbatch, "rhs_batch": (0,) + rbatch}
        return [b.one("dot_general", [lhs, rhs], **attrs)], [True]
    attrs = {"lhs_contract": lc, "rhs_contract": rc, "lhs_batch": lbatch, "rhs_batch": rbatch}
    out = b.one("dot_general", [lhs, rhs], **attrs)
    nb = len(lbatch)
    if lb_flag:  # the batch is lhs's first free dimension
        return [b.to_front(out, nb)], [True]
    lhs_free = len(lhs.shape) - len(lc) - nb
    return [b.to_front(out, nb + lhs_free)], [True]  # rhs's first free dimension


def _conv2d(b: Batching, operands, batched):
    x, w = operands
    x_batched, w_batched = batched
    if not w_batched:  # the batch joins the images: (B*N, C, H, W)
        n = x.shape[1]
        images = b.reshape(x, (b.size * n,) + tuple(x.shape[2:]))
        out = b.one("conv2d", [images, w], **b.op.attrs)
        return [b.reshape(out, (b.size, n) + tuple(out.shape[1:]))], [True]
    return [_map_over_batch(b, operands, batched)], [True]


def _map_over_batch(b: Batching, operands, batched) -> Tracer:
    """The op applied to each example in turn by a `for` loop writing one row of the result per
    iteration (used only where no data-parallel form exists: a conv with per-example filters)."""
    op = b.op
    example_types = [
        TensorType(tuple(x.shape[1:]) if f else tuple(x.shape), dt.dtype(x.dtype)) for x, f in zip(operands, batched)
    ]
    (result_type,) = [r.type for r in op.results]
    out_type = batched_type(result_type, b.size)
    index = TensorType((), dt.int32)

    def body(i, acc, *xs):
        row = Batching(op, b.size, b.loc, b.device)
        ins = []
        for x, f, t in zip(xs, batched, example_types):
            if f:
                starts = [i] + [row.scalar(0, dt.int32)] * len(t.shape)
                x = row.reshape(row.one("dynamic_slice", [x, *starts], sizes=(1,) + tuple(t.shape)), t.shape)
            ins.append(x)
        (y,) = row.emit(op.name, ins, op.attrs)
        at = row.reshape(i, (1,))
        return [row.one("scatter_add", [acc, at, row.reshape(y, (1,) + tuple(result_type.shape))], axis=0)]

    region = _trace_region("map_body", [index, out_type, *(x.value.type for x in operands)], body)
    zeros = b.full(0, out_type.shape, out_type.dtype)
    lo, hi = b.scalar(0, dt.int32), b.scalar(b.size, dt.int32)
    (out,) = b.emit("for", [lo, hi, zeros, *operands], {"num_carry": 1}, [region])
    return out


def _trace_region(name: str, param_types: Sequence[TensorType], body: Callable) -> Graph:
    with Trace(name) as trace:
        params = [trace.new_param(t) for t in param_types]
        trace.graph.results = [trace.lift(x) for x in body(*params)]
    assert not trace.captures, "internal error: a batched region captured an outer value"
    return trace.graph


BATCH_RULES.update(dot_general=_dot_general, conv2d=_conv2d)


# --- rules: state and communication -----------------------------------------------------------------------------


def _state(b: Batching, operands, batched):
    raise b.error(
        f"variable '{b.op.attrs['var']}' would be updated with a value that differs per example (it "
        "depends on the mapped axis). A variable holds one value: reduce over the batch first (e.g. "
        ".mean(0)) and update it outside the vmapped function"
    )


def _communication(b: Batching, operands, batched):
    raise b.error(
        "a value that differs per example crosses devices inside vmap; apply vmap within one device's "
        "code, or move the device placement outside the vmapped function"
    )


for _name in ops_in(STATEFUL):
    BATCH_RULES[_name] = _state
for _name in ops_in(COMMUNICATION):
    BATCH_RULES[_name] = _communication


def _fusion(b: Batching, operands, batched):
    raise b.error("fusion ops exist only after optimization; vmap transforms traced programs")


BATCH_RULES["fusion"] = _fusion

# The rules for structured control flow (cond, while, for) and custom_vjp_call live next door.
from flowjit.frontend import batching_control  # noqa: E402,F401
