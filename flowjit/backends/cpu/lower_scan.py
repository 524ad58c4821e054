"""CPU lowering of `cumsum` and `linear_recurrence`: running sums (h[i] = h[i-1] + x[i]) or
products and recurrences (h[i] = a[i] * h[i-1] + b[i]; cumprod) along one axis, element by element
in order, the first position's values as they are.

The operand is viewed as (outer, n, inner), the summed axis in the middle. A *block* is `g` rows of
`outer` by `w` contiguous columns of `inner`; its sums walk the n positions in order (from the end
when `reverse`) with g accumulators of a w-wide vector carried in registers: at each position a
load, an add and a store per row. Each lane adds its own column in numpy's order, so the result
is numpy's sequential sum bit for bit (an inf or nan changes the sums from its position on only).

Blocks (`_blocks`), chosen so that the adds of one position are independent:
- a summed last axis (inner = 1, the common `cumsum(x, axis=-1)`): 8 rows at a time, one element
  each: eight add chains, not one (a float add's latency would bound a lone row);
- inner narrower than a vector (RGB, 10 class scores): 4 rows of one `inner`-wide vector;
- else one row, columns in blocks of up to 4 vectors (4 chains), the last block narrower.
Rows that do not fill a group and columns that do not fill a block form their own, narrower
blocks: every access is in bounds, no masks. The blocks of one shape are spread over the cores
(`scf.forall`, OpenMP) when there are enough elements, one block per iteration.

As one op, a running sum compiles to a few small loops; as matmuls with a triangular constant
(under a `cond` that takes a log-step scan when a value is not finite) it would be thousands of
lines of LLVM IR and several times the first call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flowjit.backends.cpu import schedule
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.target import lowering
from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, tensor_type
from flowjit.backends.mlir.lower_elementwise import reshape_tensor
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType

# Rows summed together when the summed axis is the last (one element per row and position).
LAST_AXIS_ROWS = 8
# Rows summed together when a row's columns are narrower than one vector.
NARROW_ROWS = 4
# Most vectors per block of columns.
BLOCK_VECTORS = 4
# Fewer elements than this stay on one core (a thread team costs microseconds).
PARALLEL_MIN_ELEMENTS = 1 << 16


class _Span(NamedTuple):
    """`count` consecutive pieces of `size` along one dimension, from `start`."""

    start: int
    size: int
    count: int


def _spans(extent: int, size: int) -> list[_Span]:
    """`extent` cut into pieces of `size`, the remainder as one narrower piece."""
    full = extent // size
    spans = [_Span(0, size, full)] if full else []
    if extent % size:
        spans.append(_Span(full * size, extent % size, 1))
    return spans


def _blocks(outer: int, inner: int, lanes: int) -> tuple[list[_Span], list[_Span]]:
    """(row spans, column spans) of the blocks (see the module docstring)."""
    if inner == 1:
        rows, width = LAST_AXIS_ROWS, 1
    elif inner < lanes:
        rows, width = NARROW_ROWS, inner
    else:
        rows, width = 1, lanes * min(BLOCK_VECTORS, inner // lanes)
    return _spans(outer, rows), _spans(inner, width)


@lowering("cumsum")
def lower_cumsum(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """cumsum along `axis` (see the module docstring)."""
    return [_scan(em, op, operands)]


@lowering("linear_recurrence")
def lower_linear_recurrence(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """h[i] = a[i] * h[i-1] + b[i] along `axis`, h[0] = b[0]: the running sums' loops with a
    multiply and an add per element (cumprod: the module docstring)."""
    return [_scan(em, op, operands)]


def _scan(em: KernelEmitter, op: Op, operands: list[str]) -> str:
    """The running sums (one operand) or the linear recurrence (a, b) of `op` along its axis."""
    t = op.operands[-1].type
    axis = op.attrs["axis"] % t.rank
    n = t.shape[axis]
    if t.size == 0 or n == 1:
        return operands[-1]
    outer, inner = math.prod(t.shape[:axis]), math.prod(t.shape[axis + 1 :])
    # (outer, n, inner), or (outer, n) when the axis is the last: a collapse of the result's shape
    # (leading unit dims aside), so the kernel writes straight into the result's buffer
    # (`store_through`); through a reshape of its own tensor it would fill a temporary, copied out.
    view = TensorType((outer, n) if inner == 1 else (outer, n, inner), t.dtype)
    sources = [reshape_tensor(em, x, t, view) for x in operands]
    kernel = _ScanKernel(em, view, bool(op.attrs["reverse"]))
    result = em.empty(view)
    row_spans, column_spans = _blocks(outer, inner, schedule.lanes(t.dtype.itemsize * 8))
    for rows in row_spans:
        for columns in column_spans:
            result = kernel.blocks(sources, result, rows, columns)
    if view.shape == t.shape:
        return result
    shaped = reshape_tensor(em, result, view, t)
    em.store_through(shaped, result, view.shape)
    return shaped


class _ScanKernel:
    """Emits the loops of one cumsum or linear recurrence over a (outer, n, inner) tensor
    (`LoopWriter`'s loops)."""

    def __init__(self, em: KernelEmitter, view: TensorType, reverse: bool):
        self.em = em
        self.w = LoopWriter(em)
        self.view = view
        self.columns = view.rank == 3  # else one column: the axis is the last
        self.reverse = reverse
        self.n = view.shape[1]
        self.elem = elem_type(view.dtype)
        self.is_float = view.dtype.is_float

    def blocks(self, source: list[str], result: str, rows: _Span, columns: _Span) -> str:
        """`result` with the blocks of `rows` x `columns` computed from `source` ([x] of a running
        sum, or [a, b] of a linear recurrence): one block per iteration of an `scf.forall` over the
        cores when there are enough elements, else of an `scf.for`."""
        w = self.w
        units = rows.count * columns.count
        full = tensor_type(self.view)
        elements = units * rows.size * self.n * columns.size
        if schedule.threads() > 1 and units > 1 and elements >= PARALLEL_MIN_ELEMENTS:
            block = tensor_type(self.view.with_shape((rows.size, self.n, columns.size)[: self.view.rank]))
            done, k, shared = w.open_forall(units, result, full)
            row, column = self._origin(k, rows, columns)
            where = self._slice(row, column, rows.size, columns.size)
            part = self.em.op(f"tensor.extract_slice {shared}{where} : {full} to {block}")
            summed = self._block(source, row, column, part, block, w.index(0), rows.size, columns.size)
            w.close_forall(summed, shared, where, block, full)
            return done
        done, k, (carried,) = w.open_for(w.index(0), w.index(units), w.index(1), [(result, full)])
        row, column = self._origin(k, rows, columns)
        w.close_for([self._block(source, row, column, carried, full, None, rows.size, columns.size)], [full])
        return done

    def _slice(self, row: str, column: str, rows: int, columns: int) -> str:
        """Offsets, sizes and strides of a block at (`row`, `column`)."""
        if not self.columns:
            return f"[{row}, 0] [{rows}, {self.n}] [1, 1]"
        return f"[{row}, 0, {column}] [{rows}, {self.n}, {columns}] [1, 1, 1]"

    def _at(self, row: str, position: str, column: str) -> str:
        return f"[{row}, {position}, {column}]" if self.columns else f"[{row}, {position}]"

    def _origin(self, k: str, rows: _Span, columns: _Span) -> tuple[str, str]:
        """The first row and column of block `k` of the span pair."""
        em, w = self.em, self.w
        a = em.op(f"arith.divui {k}, {w.index(columns.count)} : index")
        b = em.op(f"arith.remui {k}, {w.index(columns.count)} : index")
        return (
            w.add(w.index(rows.start), w.mul(a, w.index(rows.size))),
            w.add(w.index(columns.start), w.mul(b, w.index(columns.size))),
        )

    def _block(
        self,
        source: list[str],
        row: str,
        column: str,
        dest: str,
        dest_type: str,
        dest_origin: str | None,
        g: int,
        width: int,
    ) -> str:
        """`dest` (of `dest_type`) with the running sums (or recurrence) of the block of `g` rows
        and `width` columns of `source` at (`row`, `column`) written at the same place, or at
        (`dest_origin`, `dest_origin`) when `dest` is the block's own slice: the first position's
        values as they are (numpy's first sum is its first element, -0.0 included), then an
        `scf.for` over the other n - 1 positions carrying `dest` and the g accumulators."""
        em, w = self.em, self.w
        vec = f"vector<{width}x{self.elem}>"
        pad = em.op(f"arith.constant {'0.000000e+00' if self.is_float else '0'} : {self.elem}")
        src_type = tensor_type(self.view)
        rows = [row] + [w.add(row, w.index(q)) for q in range(1, g)]
        if dest_origin is None:
            dest_rows, dest_column = rows, column
        else:
            dest_rows, dest_column = [dest_origin] + [w.index(q) for q in range(1, g)], dest_origin

        def read(tensor: str, q: int, at: str) -> str:
            return em.op(
                f"vector.transfer_read {tensor}{self._at(rows[q], at, column)}, {pad} {{in_bounds = [true]}} : "
                f"{src_type}, {vec}"
            )

        def write(value: str, q: int, at: str, into: str) -> str:
            return em.op(
                f"vector.transfer_write {value}, {into}{self._at(dest_rows[q], at, dest_column)} "
                f"{{in_bounds = [true]}} : {vec}, {dest_type}"
            )

        first = w.index(self.n - 1 if self.reverse else 0)
        starts = [read(source[-1], q, first) for q in range(g)]
        for q in range(g):
            dest = write(starts[q], q, first, dest)
        loop, i, (current, *accs) = w.open_for(
            w.index(1), w.index(self.n), w.index(1), [(dest, dest_type)] + [(start, vec) for start in starts]
        )
        at = em.op(f"arith.subi {w.index(self.n - 1)}, {i} : index") if self.reverse else i
        add, mul = ("arith.addf", "arith.mulf") if self.is_float else ("arith.addi", "arith.muli")
        sums = []
        for q in range(g):
            carried = accs[q]
            if len(source) == 2:  # a[i] * h[i-1], then + b[i]: two roundings, as numpy's
                carried = em.op(f"{mul} {read(source[0], q, at)}, {carried} : {vec}")
            total = em.op(f"{add} {carried}, {read(source[-1], q, at)} : {vec}")
            current = write(total, q, at, current)
            sums.append(total)
        w.close_for([current] + sums, [dest_type] + [vec] * g)
        return f"{loop}#0"
