"""CPU lowering of `cumsum`: running sums along one axis, element by element in order.

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

Before this op (session 18) `flowjit.numpy.cumsum` was matmuls with a triangular constant, under a
`cond` that took a log-step scan when a value was not finite: 3,300 lines of LLVM IR, a 1024x1024
cumsum's first call 335 ms (JAX 92).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flowjit.backends.cpu import schedule
from flowjit.backends.cpu.emitter import KernelEmitter, elem_type, tensor_type
from flowjit.backends.cpu.lower_elementwise import reshape_tensor
from flowjit.backends.cpu.lowering import lowering
from flowjit.backends.cpu.matmul_kernel import LoopWriter
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
    (x,) = operands
    t = op.operands[0].type
    axis = op.attrs["axis"] % t.rank
    n = t.shape[axis]
    if t.size == 0 or n == 1:
        return [x]
    outer, inner = math.prod(t.shape[:axis]), math.prod(t.shape[axis + 1 :])
    # (outer, n, inner), or (outer, n) when the axis is the last: a collapse of the result's shape
    # (leading unit dims aside), so the kernel writes straight into the result's buffer
    # (`store_through`); through a reshape of its own tensor it would fill a temporary, copied out.
    view = TensorType((outer, n) if inner == 1 else (outer, n, inner), t.dtype)
    source = reshape_tensor(em, x, t, view)
    kernel = _ScanKernel(em, view, bool(op.attrs["reverse"]))
    result = em.empty(view)
    row_spans, column_spans = _blocks(outer, inner, schedule.lanes(t.dtype.itemsize * 8))
    for rows in row_spans:
        for columns in column_spans:
            result = kernel.blocks(source, result, rows, columns)
    if view.shape == t.shape:
        return [result]
    shaped = reshape_tensor(em, result, view, t)
    em.store_through(shaped, result, view.shape)
    return [shaped]


class _ScanKernel:
    """Emits the loops of one cumsum over a (outer, n, inner) tensor (`LoopWriter`'s loops)."""

    def __init__(self, em: KernelEmitter, view: TensorType, reverse: bool):
        self.em = em
        self.w = LoopWriter(em)
        self.view = view
        self.columns = view.rank == 3  # else one column: the axis is the last
        self.reverse = reverse
        self.n = view.shape[1]
        self.elem = elem_type(view.dtype)
        self.is_float = view.dtype.is_float

    def blocks(self, source: str, result: str, rows: _Span, columns: _Span) -> str:
        """`result` with the blocks of `rows` x `columns` summed from `source`: one block per
        iteration of an `scf.forall` over the cores when there are enough elements, else of an
        `scf.for`."""
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
        source: str,
        row: str,
        column: str,
        dest: str,
        dest_type: str,
        dest_origin: str | None,
        g: int,
        width: int,
    ) -> str:
        """`dest` (of `dest_type`) with the running sums of the block of `g` rows and `width` columns
        of `source` at (`row`, `column`) written at the same place, or at (`dest_origin`,
        `dest_origin`) when `dest` is the block's own slice: an `scf.for` over the n positions
        carrying `dest` and the g accumulators."""
        em, w = self.em, self.w
        vec = f"vector<{width}x{self.elem}>"
        zero = "0.000000e+00" if self.is_float else "0"
        start = em.op(f"arith.constant dense<{zero}> : {vec}")
        pad = em.op(f"arith.constant {zero} : {self.elem}")
        src_type = tensor_type(self.view)
        rows = [row] + [w.add(row, w.index(q)) for q in range(1, g)]
        if dest_origin is None:
            dest_rows, dest_column = rows, column
        else:
            dest_rows, dest_column = [dest_origin] + [w.index(q) for q in range(1, g)], dest_origin
        loop, i, (current, *accs) = w.open_for(
            w.index(0), w.index(self.n), w.index(1), [(dest, dest_type)] + [(start, vec)] * g
        )
        at = em.op(f"arith.subi {w.index(self.n - 1)}, {i} : index") if self.reverse else i
        add = "arith.addf" if self.is_float else "arith.addi"
        sums = []
        for q in range(g):
            value = em.op(
                f"vector.transfer_read {source}{self._at(rows[q], at, column)}, {pad} {{in_bounds = [true]}} : "
                f"{src_type}, {vec}"
            )
            total = em.op(f"{add} {accs[q]}, {value} : {vec}")
            current = em.op(
                f"vector.transfer_write {total}, {current}{self._at(dest_rows[q], at, dest_column)} "
                f"{{in_bounds = [true]}} : {vec}, {dest_type}"
            )
            sums.append(total)
        w.close_for([current] + sums, [dest_type] + [vec] * g)
        return f"{loop}#0"
