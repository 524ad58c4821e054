"""CPU lowering of argmax and argmin: numpy's first index of the extreme (and of the first nan). Along
the last axis with vector lanes (`_ArgRows`: rows split over the cores, rows shorter than a vector
read as tiles of `lanes` rows); along another axis one generic carrying (best value, its index),
whose contiguous loops LLVM vectorizes.
"""

from __future__ import annotations

import numpy as np

from flowjit.backends.cpu import host, schedule
from flowjit.backends.cpu.contraction import PARALLEL_MIN_WORK, accumulator_elem, const, loop_dims
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.row_writers import over_cores, per_row
from flowjit.backends.cpu.target import lowering
from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder, elem_type, tensor_type
from flowjit.backends.mlir.lower_movement import fill, reshape
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op
from flowjit.ir.ops.reduction import reduction_identity
from flowjit.ir.types import TensorType


def _take_better(b, value: str, best: str, largest: bool, value_type: str, mask_type: str) -> str:
    """i1 (or a vector of them): `value` replaces `best` if strictly better, or if it is nan and
    the best is not (so the first nan wins, as in numpy)."""
    if value_type.rstrip(">").split("x")[-1].startswith("i"):
        return b.op(f"arith.cmpi {'sgt' if largest else 'slt'}, {value}, {best} : {value_type}")
    better = b.op(f"arith.cmpf {'ogt' if largest else 'olt'}, {value}, {best} : {value_type}")
    is_nan = b.op(f"arith.cmpf uno, {value}, {value} : {value_type}")
    best_ordered = b.op(f"arith.cmpf ord, {best}, {best} : {value_type}")
    new_nan = b.op(f"arith.andi {is_nan}, {best_ordered} : {mask_type}")
    return b.op(f"arith.ori {better}, {new_nan} : {mask_type}")


class _ArgRows:
    """argmax/argmin along the last (contiguous) axis with vector lanes.

    Each lane of each accumulator keeps the first extreme of its own elements (strictly-better
    updates); the row's answer is then the smallest index among the lanes that hold the overall
    extreme (nan if any lane holds a nan): the first occurrence of the extreme is also the first
    in its own lane. The tail chunk reads +-inf (or the integer extreme) past the row's end, which
    can never be strictly better.
    """

    def __init__(self, em: KernelEmitter, x: str, tx: TensorType, result: TensorType, largest: bool):
        self.em, self.w, self.largest = em, LoopWriter(em), largest
        self.rows, self.length = tx.size // tx.shape[-1], tx.shape[-1]
        self.elem, self.index_elem = elem_type(tx.dtype), elem_type(result.dtype)
        self.compute = accumulator_elem(tx.dtype)
        lanes = self.lanes = host.vector_bits() // int(self.compute[1:])
        self.vec, self.ivec = f"vector<{lanes}x{self.compute}>", f"vector<{lanes}x{self.index_elem}>"
        self.mvec = f"vector<{lanes}xi1>"
        self.matrix = TensorType((self.rows, self.length), tx.dtype)
        self.x = reshape(em, x, tx, self.matrix.shape)
        pad_dtype = dt.float32 if self.compute == "f32" else tx.dtype
        pad = const(em, reduction_identity("max" if largest else "min", pad_dtype), self.compute)
        self.pad = pad if self.elem == self.compute else em.op(f"arith.truncf {pad} : {self.compute} to {self.elem}")
        self.start = em.op(f"vector.broadcast {pad} : {self.compute} to {self.vec}")
        self.zero_index = em.op(f"arith.constant dense<0> : {self.ivec}")
        self.iota = em.op(f"arith.constant dense<[{', '.join(map(str, range(lanes)))}]> : {self.ivec}")
        self.no_index = em.op(f"arith.constant dense<{np.iinfo(result.dtype.np_dtype).max}> : {self.ivec}")

    def step(self, row: str, column: str, in_bounds: str, best: str, best_index: str) -> list[str]:
        """(best, index) after the vector of the row starting at `column`."""
        em, vec, ivec, mvec = self.em, self.vec, self.ivec, self.mvec
        raw = em.op(
            f"vector.transfer_read {self.x}[{row}, {column}], {self.pad} {{in_bounds = [{in_bounds}]}} "
            f": {tensor_type(self.matrix)}, vector<{self.lanes}x{self.elem}>"
        )
        value = (
            raw if self.elem == self.compute else em.op(f"arith.extf {raw} : vector<{self.lanes}x{self.elem}> to {vec}")
        )
        take = _take_better(em, value, best, self.largest, vec, mvec)
        position = em.op(f"arith.index_cast {column} : index to {self.index_elem}")
        splat_position = em.op(f"vector.broadcast {position} : {self.index_elem} to {ivec}")
        positions = em.op(f"arith.addi {splat_position}, {self.iota} : {ivec}")
        return [
            em.op(f"arith.select {take}, {value}, {best} : {mvec}, {vec}"),
            em.op(f"arith.select {take}, {positions}, {best_index} : {mvec}, {ivec}"),
        ]

    def scan(self, row: str) -> list[tuple[str, str]]:
        """ARG_UNROLL independent (best, index) vector pairs over the row's whole vectors (one
        compare-select chain is latency-bound), the partial vector masked after them."""
        w, lanes = self.w, self.lanes
        full = self.length // lanes
        groups = full // ARG_UNROLL
        carried = [(self.start, self.vec), (self.zero_index, self.ivec)] * ARG_UNROLL
        loop, j, names = w.open_for(w.index(0), w.index(groups), w.index(1), carried)
        updated = []
        for u in range(ARG_UNROLL):
            column = w.mul(w.add(w.mul(j, w.index(ARG_UNROLL)), w.index(u)), w.index(lanes))
            updated += self.step(row, column, "true", names[2 * u], names[2 * u + 1])
        w.close_for(updated, [self.vec, self.ivec] * ARG_UNROLL)
        pairs = [(f"{loop}#{2 * u}", f"{loop}#{2 * u + 1}") for u in range(ARG_UNROLL)]
        best = list(pairs[0])
        for c in range(groups * ARG_UNROLL, full):
            best = self.step(row, w.index(c * lanes), "true", *best)
        if self.length % lanes:
            best = self.step(row, w.index(full * lanes), "false", *best)
        return [tuple(best), *pairs[1:]]

    def first_index(self, pairs: list[tuple[str, str]]) -> str:
        """The smallest index held by a lane whose value is the extreme of all lanes."""
        em, vec, ivec, mvec, compute = self.em, self.vec, self.ivec, self.mvec, self.compute
        if compute[0] == "f":
            kind = "maximumf" if self.largest else "minimumf"
        else:
            kind = "maxsi" if self.largest else "minsi"
        lane_extreme = pairs[0][0]
        for other, _ in pairs[1:]:
            lane_extreme = em.op(f"arith.{kind} {lane_extreme}, {other} : {vec}")
        extreme = em.op(f"vector.reduction <{kind}>, {lane_extreme} : {vec} into {compute}")
        splat = em.op(f"vector.broadcast {extreme} : {compute} to {vec}")
        candidates = None
        for best, best_index in pairs:
            if compute[0] == "f":  # lanes equal to the extreme, or nan lanes when the extreme is nan
                equal = em.op(f"arith.cmpf oeq, {best}, {splat} : {vec}")
                lane_nan = em.op(f"arith.cmpf uno, {best}, {best} : {vec}")
                extreme_nan = em.op(f"arith.cmpf uno, {splat}, {splat} : {vec}")
                both_nan = em.op(f"arith.andi {lane_nan}, {extreme_nan} : {mvec}")
                target = em.op(f"arith.ori {equal}, {both_nan} : {mvec}")
            else:
                target = em.op(f"arith.cmpi eq, {best}, {splat} : {vec}")
            these = em.op(f"arith.select {target}, {best_index}, {self.no_index} : {mvec}, {ivec}")
            candidates = these if candidates is None else em.op(f"arith.minsi {candidates}, {these} : {ivec}")
        return em.op(f"vector.reduction <minsi>, {candidates} : {ivec} into {self.index_elem}")

    def across_rows(self, base: str, in_bounds: str) -> str:
        """The answers of the `lanes` rows from row `base` on, one per lane, for rows shorter than a
        vector: the rows are read as one 2-d vector and transposed, so that column k of all of them
        is one vector, and compared column after column (no horizontal reduction: the column that
        first holds a row's extreme wins its lane). Rows past the end (`in_bounds` "false") read the
        padding and their answers are not stored."""
        em, lanes, length, compute = self.em, self.lanes, self.length, self.compute
        tile = em.op(
            f"vector.transfer_read {self.x}[{base}, {self.w.index(0)}], {self.pad} {{in_bounds = [{in_bounds}, true]}} "
            f": {tensor_type(self.matrix)}, vector<{lanes}x{length}x{self.elem}>"
        )
        if self.elem != compute:
            wide = f"vector<{lanes}x{length}x{compute}>"
            tile = em.op(f"arith.extf {tile} : vector<{lanes}x{length}x{self.elem}> to {wide}")
        # The transpose as one shuffle of the flat tile (the default lowering moves it element by
        # element, several times the machine code, as in `schedule._short_row_reduction`).
        flat = f"vector<{lanes * length}x{compute}>"
        tile = em.op(f"vector.shape_cast {tile} : vector<{lanes}x{length}x{compute}> to {flat}")
        order = ", ".join(str(row * length + k) for k in range(length) for row in range(lanes))
        tile = em.op(f"vector.shuffle {tile}, {tile} [{order}] : {flat}, {flat}")
        columns_type = f"vector<{length}x{lanes}x{compute}>"
        columns = em.op(f"vector.shape_cast {tile} : {flat} to {columns_type}")
        best = em.op(f"vector.extract {columns}[0] : {self.vec} from {columns_type}")
        best_index = self.zero_index
        for k in range(1, length):
            value = em.op(f"vector.extract {columns}[{k}] : {self.vec} from {columns_type}")
            take = _take_better(em, value, best, self.largest, self.vec, self.mvec)
            position = em.op(f"arith.constant dense<{k}> : {self.ivec}")
            best = em.op(f"arith.select {take}, {value}, {best} : {self.mvec}, {self.vec}")
            best_index = em.op(f"arith.select {take}, {position}, {best_index} : {self.mvec}, {self.ivec}")
        return best_index


def _arg_extreme_short_rows(em: KernelEmitter, kernel: _ArgRows, parallel: bool) -> str:
    """argmax/argmin of rows shorter than a vector (`_ArgRows.across_rows`): a tensor<rows> of
    answers, `lanes` rows per step, whole tiles split over the cores when `parallel`, then the
    partial last tile. For short rows such as ten class scores, one vector per row and its
    horizontal reductions would cost more than the row's data."""
    w, lanes, rows = kernel.w, kernel.lanes, kernel.rows
    elem, ivec = kernel.index_elem, kernel.ivec
    whole = rows // lanes

    def tiles(first_row: str | None, count: str, out: str, out_type: str) -> str:
        loop, t, (acc,) = w.open_for(w.index(0), count, w.index(1), [(out, out_type)])
        local = w.mul(t, w.index(lanes))
        answer = kernel.across_rows(local if first_row is None else w.add(first_row, local), "true")
        written = em.op(f"vector.transfer_write {answer}, {acc}[{local}] {{in_bounds = [true]}} : {ivec}, {out_type}")
        w.close_for([written], [out_type])
        return loop

    done = over_cores(em, rows, elem, whole, lanes, tiles, parallel)
    if rows % lanes:
        base = w.index(whole * lanes)
        answer = kernel.across_rows(base, "false")
        flat_type = f"tensor<{rows}x{elem}>"
        done = em.op(f"vector.transfer_write {answer}, {done}[{base}] {{in_bounds = [false]}} : {ivec}, {flat_type}")
    return done


def _arg_extreme_rows(em: KernelEmitter, x: str, tx: TensorType, result: TensorType, largest: bool) -> str:
    """argmax/argmin along the last axis (see `_ArgRows`), rows split over the cores when many."""
    kernel = _ArgRows(em, x, tx, result, largest)
    parallel = host.cores() > 1 and kernel.rows > 1 and tx.size >= PARALLEL_MIN_WORK
    if kernel.length < kernel.lanes and kernel.length <= schedule.SHORT_ROW_MAX:
        flat = _arg_extreme_short_rows(em, kernel, parallel)
    else:
        flat = per_row(em, kernel.rows, kernel.index_elem, lambda row: kernel.first_index(kernel.scan(row)), parallel)
    return reshape(em, flat, TensorType((kernel.rows,), result.dtype), result.shape)


# Independent accumulator pairs in the argmax/argmin inner loop.
ARG_UNROLL = 4


def _lower_arg_extreme(em: KernelEmitter, op: Op, operands: list[str], largest: bool) -> list[str]:
    """argmax/argmin as a sequential reduction carrying (best value, its index): a later element
    replaces the best only if strictly better, or if it is nan and the best is not, which gives
    numpy's first index of the extreme, and of the first nan. Along the last axis, vector lanes
    (`_arg_extreme_rows`); along others the reduction loop is outside the contiguous loops,
    which LLVM vectorizes."""
    (x,) = operands
    tx, result = op.operands[0].type, op.result.type
    axis = op.attrs["axis"]
    if axis == tx.rank - 1 and tx.shape[-1] > 1 and tx.size > 0:
        return [_arg_extreme_rows(em, x, tx, result, largest)]
    elem, index_elem = elem_type(tx.dtype), elem_type(result.dtype)
    values_type = TensorType(result.shape, tx.dtype)
    start = reduction_identity("max" if largest else "min", tx.dtype)
    best = fill(em, const(em, start, tx.dtype), values_type)
    first = fill(em, em.op(f"arith.constant 0 : {index_elem}"), result)
    domain = ", ".join(loop_dims(tx.rank))
    kept = ", ".join(f"d{i}" for i in range(tx.rank) if i != axis)
    x_map = em.identity_map(tx.rank)
    out_map = em.affine_map(f"({domain}) -> ({kept})")
    iters = ", ".join('"reduction"' if i == axis else '"parallel"' for i in range(tx.rank))
    values_out = em.fresh()
    em.line(
        f"{values_out}:2 = linalg.generic {{indexing_maps = [{x_map}, {out_map}, {out_map}], "
        f"iterator_types = [{iters}]}} ins({x} : {tensor_type(tx)}) "
        f"outs({best}, {first} : {tensor_type(values_type)}, {tensor_type(result)}) {{"
    )
    value, best_value, best_index = em.fresh("a"), em.fresh("a"), em.fresh("a")
    em.line(f"^bb0({value}: {elem}, {best_value}: {elem}, {best_index}: {index_elem}):")
    b = ScalarBuilder(em, em.indent + "  ")
    take = _take_better(b, value, best_value, largest, elem, "i1")
    position = b.op(f"linalg.index {axis} : index")
    position = b.op(f"arith.index_cast {position} : index to {index_elem}")
    new_value = b.op(f"arith.select {take}, {value}, {best_value} : {elem}")
    new_index = b.op(f"arith.select {take}, {position}, {best_index} : {index_elem}")
    em.body.extend(b.lines)
    em.line(f"  linalg.yield {new_value}, {new_index} : {elem}, {index_elem}")
    em.line(f"}} -> ({tensor_type(values_type)}, {tensor_type(result)})")
    return [f"{values_out}#1"]


@lowering("argmax")
def lower_argmax(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Index of the first maximum along `axis` (the first nan if there is one)."""
    return _lower_arg_extreme(em, op, operands, largest=True)


@lowering("argmin")
def lower_argmin(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """Index of the first minimum along `axis` (the first nan if there is one)."""
    return _lower_arg_extreme(em, op, operands, largest=False)
