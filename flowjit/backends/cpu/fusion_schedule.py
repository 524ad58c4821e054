"""The schedules of the generics that the fusion lowering (`lower_fusion`) writes: the elementwise,
reduction and n-d (`copy_nd`) schedules of `schedule.py`, chosen by the generic's loop, where it
runs (a row tile, `lower_rows`, stays on one thread) and what its body computes (`chain_depth`).
"""

from __future__ import annotations

from collections.abc import Sequence

from flowjit.backends.cpu import schedule
from flowjit.backends.cpu.fusion_ops import MATH_WEIGHT, op_weight
from flowjit.backends.mlir.emitter import KernelEmitter
from flowjit.ir.graph import Op, Value
from flowjit.ir.types import TensorType

# A 1-D fused kernel whose longest chain of dependent ops is deeper than this (`chain_depth`) computes
# two vectors per loop step (`schedule_generic`).
LONG_CHAIN_DEPTH = 12


def chain_depth(ops: list[Op]) -> int:
    """The longest chain of dependent ops among `ops` (in program order), each counted by `op_weight`."""
    depth: dict[Value, int] = {}
    for op in ops:
        depth[op.result] = op_weight(op) + max((depth.get(v, 0) for v in op.operands), default=0)
    return max(depth.values(), default=0)


def schedule_generic(
    em: KernelEmitter,
    name: str,
    space: tuple[TensorType, list[int]],
    reduction: Op | None,
    elems: list[str],
    coalesce: bool,
    views: bool,
    ops: Sequence[Op] = (),
    tile: bool = False,
) -> None:
    """Attach the schedule of fused generic `name`, iterating `space` = (loop, reduced axes) (`tile`: in
    a row tile, `lower_rows`). Small n-d kernels with short rows (the CNN's bias + relu at small
    batch) get `copy_nd` on one thread for its unrolled row loop. Over strided views whose rows end
    in a part of a vector (pooling's gradient, 14-wide rows) that schedule is slower than LLVM's own
    vector loop, so those keep none; views of whole vectors per row (an LSTM's gate columns
    z[:, 64:128]) take it, since LLVM's light pipeline leaves a plain loop scalar. Longer rows take
    it too up to `PLAIN_LOOP_MAX_ELEMENTS`; above, a plain loop sends the function to O3, whose
    vector loop is as fast or faster. A 1-D kernel whose body's longest chain of dependent ops is
    deeper than `LONG_CHAIN_DEPTH` (`chain_depth`: a math function counts 8) computes two vectors
    per step, since one vector waiting on that chain's latency leaves the cores idle: on a 2-core
    AMD EPYC Zen 4 VM that makes tanh-approximated GELU (depth 16) 7-15% faster, while bodies of
    independent math functions side by side (the benchmark's `tanh(x * 0.7 + 0.1) * sigmoid(x) +
    0.5 * x`, depth 12) gain nothing. A large 1-D kernel with no math function (a memory-bound
    stream: an SGD step `p - lr * g`) computes `schedule.MAX_UNROLLED_STEPS` vectors per step:
    on that VM PyTorch's `sub_` took 0.90-0.97x the time of the donated SGD update over 10M floats
    with one vector a step, and 0.99-1.05x with four (four runs each of benchmarks/donation.py,
    alternated). A small reduction over short
    rows with no math function among `ops` (the kernel's body), outside loops, stays plain loops
    (`schedule.stays_plain`).
    With a math function, `copy_nd` keeps the row loop rolled: unrolled 4 vectors a row, an LSTM's
    gates (two sigmoids and a tanh over 64-column views of the gate matrix) run no faster and take
    twice the compile."""
    widest, depth = max(elem_bits(e) for e in elems), chain_depth(ops)
    math = max(map(op_weight, ops), default=0) >= MATH_WEIGHT
    unroll = 1 if math else schedule.MAX_UNROLLED_STEPS  # math bodies: no faster unrolled, 2x the code
    loop, axes = space
    masked_rows = loop.shape[-1] % schedule.lanes(widest) != 0 if loop.rank else False
    if reduction is not None:
        if loop.size >= 2 and len(axes) == 1:
            plain = not em.loops and not math
            em.schedule(name, schedule.reduction(loop.shape, axes[0], widest, may_stay_plain=plain))
    elif loop.rank == 1 and loop.size > 1:
        if depth > LONG_CHAIN_DEPTH:
            vectors = 2
        elif not math and loop.size >= schedule.PARALLEL_MIN_ELEMENTS:
            vectors = schedule.MAX_UNROLLED_STEPS  # a memory-bound stream (an SGD step)
        else:
            vectors = 1
        em.schedule(name, schedule.elementwise(loop.size, widest, vectors))
    elif loop.rank > 1 and tile and loop.size > 1:
        em.schedule(name, _vectorize_rows(loop.shape, widest, coalesce))
    elif loop.rank > 1 and loop.size >= schedule.PARALLEL_MIN_ELEMENTS:
        em.schedule(name, schedule.copy_nd(loop.shape, widest, unroll=unroll))
    elif loop.size > 1 and schedule.short_rows(loop.shape, widest) and not (views and masked_rows):
        em.schedule(name, schedule.copy_nd(loop.shape, widest, parallel=False, unroll=unroll))
    elif 1 < loop.size <= schedule.PLAIN_LOOP_MAX_ELEMENTS and not (views and masked_rows):
        em.schedule(name, schedule.copy_nd(loop.shape, widest, parallel=False, unroll=unroll))


def _vectorize_rows(shape: tuple[int, ...], elem_bits: int, coalesce: bool):
    """An n-d kernel inside a row tile: one thread, vectors along the last dimension; with
    `coalesce` (the kernels that store a value in an output tile or overwrite it there) the loops
    coalesced into one: a short loop over the tile's rows around a small body (softmax's in-place
    division) then becomes one loop, which an unroller cannot copy once per row with the column
    loop inside each copy. Layer norm's last kernel has no such loop and runs slightly slower
    coalesced (the row and column indices recomputed from the one induction variable): not
    coalesced. Rows longer than one vector but not a whole number of them peel the partial vector
    off the column loop (otherwise every vector is masked: softmax over 1000 columns), and stay
    uncoalesced."""
    tiles = [1] * (len(shape) - 1) + [schedule.lanes(elem_bits)]
    peel = shape[-1] % tiles[-1] != 0 and shape[-1] > tiles[-1]

    def steps(h: str) -> list[str]:
        n, any_ = h[1:], schedule.ANY
        loops = ", ".join(f"%loop{i}{n}" for i in range(len(shape)))
        types = ", ".join([any_] * (len(shape) + 1))
        lines = [
            f"%vec{n}, {loops} = transform.structured.tile_using_for {h} tile_sizes {tiles} : ({any_}) -> ({types})"
        ]
        if peel:
            # The partial last vector of each row peeled off the column loop: with it inside, every
            # vector is masked (softmax over 1000 columns). The two loops then do not coalesce.
            peeled, main, rest = schedule.peel_last(f"%loop{len(shape) - 1}{n}", f"%c{n}")
            vectorize = [f"transform.structured.vectorize {op} vector_sizes {tiles} : {any_}" for op in (main, rest)]
            return [*lines, *peeled, *vectorize]
        lines.append(f"transform.structured.vectorize %vec{n} vector_sizes {tiles} : {any_}")
        if coalesce:
            lines.append(f"%one{h[1:]} = transform.loop.coalesce %loop0{h[1:]} : ({schedule.ANY}) -> ({schedule.ANY})")
        return lines

    return steps


def elem_bits(elem: str) -> int:
    """Bits of MLIR element type `elem` (i1 counts 1)."""
    return 1 if elem == "i1" else int(elem.lstrip("bfi"))
