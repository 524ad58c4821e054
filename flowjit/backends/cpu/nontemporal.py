"""Non-temporal (streaming) stores into large outputs that a function only writes.

A kernel's ordinary store first reads the line it writes into the cache (a read for ownership) and
leaves it there, evicting what the program reads next. A non-temporal store (`vmovntps`) writes a
whole 64-byte line to memory without reading it and without caching it: an output written once
and never read back by the function costs its size in memory traffic instead of twice its size,
and the inputs stay cached. Small outputs lose: a layer norm called repeatedly on a 2-core AMD
EPYC Zen 4 VM (32 MiB of L3) runs about 0.8x the time of ordinary stores from 8 MiB outputs up,
but 1.3x with 1-4 MiB outputs, whose whole working set stays in the cache while a non-temporal
store evicts the line. Hence `NONTEMPORAL_MIN_BYTES`.
A function that writes much more than it reads loses too (broadcasting a row into a large output,
widening conversions): with ordinary stores their output stays in the cache from call to call and
is written there, while streaming stores send all of it to memory; the gains come when the reads
(from the cache, kept there by the streaming stores) and the writes (to memory) go on side by
side. Hence `MIN_READ_FRACTION`: the function's inputs hold at least 3/4 of the bytes its outputs
do (a pad qualifies, a float32 -> float64 conversion, reading half, does not).

How: the lowering marks the output arguments `wants_streaming` picks with `ARG_ATTR`
(`target.CpuTarget.output_attribute`, which the shared lowering asks; not late outputs, which may
share an input's buffer); after the MLIR pipelines (`toolchain.lower_to_llvm_ir`), `stream_stores`
finds, per LLVM-dialect function, the marked arguments that every use of (through address
arithmetic) is the address of a store: the function never reads them. Each whole-line vector store
into such an argument (64 bytes: `vector<16xf32>`, `vector<8xf64>`, ...; or several lines, as a
kernel computing four vectors a step stores `vector<64xf32>`) becomes

    if (address % 64 == 0) store, non-temporal, align 64   // vmovntps
    else                   the original store

There is no unaligned non-temporal vector store; LLVM splits one into eight 8-byte `movnti`
(Intel) or `movntsd` (AMD) stores, which are slower than ordinary stores. The executable
allocates the outputs a function's code streams
into (`Streamed`, kept in the compile cache's entry) on a 64-byte line, so their rows of a multiple
of 64 bytes take the first branch; a caller's buffer (donated, AOT) takes whichever its address
gives. Functions that read an output back (softmax stores exp(x - max) into its output and divides
it in place, slower with streaming stores) keep ordinary stores, as do partial-line stores (a
line written in pieces would leave the write-combining buffer in pieces too) and stores computed by
more than `MAX_ARITHMETIC` vector ops in their block: streaming stores make a polynomial of degree
4 1.3x slower on the same Zen 4 VM (not a compute-bound kernel: with ordinary stores it runs at
the speed of `x * 0.7 + 0.1`), and `exp` slower still, while cheap kernels gain
(docs/cpu-backend.md).

Non-temporal stores are weakly ordered: a store fence (`sfence`) closes every region that made them
(each iteration of a parallel loop's body, before the OpenMP barrier, or the function before it
returns), so the thread that reads the output next sees all of it.
"""

from __future__ import annotations

from typing import NamedTuple

NONTEMPORAL_MIN_BYTES = 8 << 20
# ... and only in a function reading at least this fraction of what it writes (module docstring).
MIN_READ_FRACTION = 0.75
ARG_ATTR = "fj.stream"
LINE_BYTES = 64
# Stores whose block computes with more vector ops than this keep ordinary stores (module docstring).
MAX_ARITHMETIC = 4
# Where the stores of a region are closed by a fence: the region's exits.
_REGION_EXITS = {"omp.loop_nest": "omp.yield", "omp.parallel": "omp.terminator", "llvm.func": "llvm.return"}
# Uses of a marked pointer that only compute another address into the same buffer.
_ADDRESS_OPS = frozenset({"llvm.getelementptr"})


def wants_streaming(output_bytes: int, read_bytes: int, written_bytes: int) -> bool:
    """Whether the lowering marks an output of `output_bytes` (`ARG_ATTR`) in a function whose inputs
    hold `read_bytes` and whose outputs `written_bytes`."""
    return output_bytes >= NONTEMPORAL_MIN_BYTES and read_bytes >= MIN_READ_FRACTION * written_bytes


class Streamed(NamedTuple):
    """An argument of a function whose stores `stream_stores` rewrote."""

    function: str
    argument: int
    stores: int

    def __str__(self) -> str:
        return f"@{self.function} argument {self.argument}: {self.stores} store{'s' if self.stores > 1 else ''}"


def stream_stores(module) -> list[Streamed]:
    """Rewrite the whole-line stores into marked, write-only output arguments of `module`'s LLVM-dialect
    functions as aligned-or-not non-temporal stores (module docstring); returns the arguments
    rewritten."""
    from mlir import ir

    done, regions = [], []  # regions: the ops whose exits fence the streaming stores, each once
    for func in module.body.operations:
        if func.operation.name != "llvm.func" or "arg_attrs" not in func.operation.attributes:
            continue
        arg_attrs = ir.ArrayAttr(func.operation.attributes["arg_attrs"])
        arguments = func.operation.regions[0].blocks[0].arguments if func.operation.regions[0].blocks else []
        for index, attrs in enumerate(arg_attrs):
            if ARG_ATTR not in ir.DictAttr(attrs):
                continue
            stores: list = []
            if _write_only(arguments[index], stores) and stores:
                for store in stores:
                    region = _closing_region_op(_stream(store))
                    if not any(region == r for r in regions):
                        regions.append(region)
                name = ir.StringAttr(func.operation.attributes["sym_name"]).value
                done.append(Streamed(name, index, len(stores)))
    for region in regions:
        _fence_exits(region)
    return done


def _write_only(pointer, stores: list) -> bool:
    """Whether every use of `pointer` (through address arithmetic) writes memory; collects in
    `stores` the whole-line vector stores among them."""
    for use in pointer.uses:
        op = use.owner
        name = op.name
        if name in _ADDRESS_OPS and use.operand_number == 0:
            if not _write_only(op.results[0], stores):
                return False
        elif name == "llvm.store" and use.operand_number == 1:
            if _line_store(op) and _vector_arithmetic(op.operation.block) <= MAX_ARITHMETIC:
                stores.append(op)
        elif name == "llvm.intr.masked.store" and use.operand_number == 1:
            pass  # a row's tail: an ordinary store
        else:
            return False
    return True


def _vector_arithmetic(block) -> int:
    """Ops computing a vector in `block` (the loop body computing what a store writes); loads,
    constants and lane shuffles (splats) aside."""
    from mlir import ir

    return sum(
        1
        for op in block.operations
        if op.name not in _MOVES and op.results and isinstance(op.results[0].type, ir.VectorType)
    )


_MOVES = frozenset(
    {
        "llvm.load",
        "llvm.intr.masked.load",
        "llvm.insertelement",
        "llvm.extractelement",
        "llvm.shufflevector",
        "llvm.bitcast",
        "llvm.mlir.constant",
        "llvm.mlir.poison",
        "llvm.mlir.undef",
        "llvm.mlir.zero",
    }
)


def _line_store(store) -> bool:
    """A store of a vector of whole 64-byte lines (one, or several from a kernel computing several
    vectors a step), not already non-temporal, atomic or volatile."""
    from mlir import ir

    attributes = store.attributes
    if "nontemporal" in attributes or "volatile_" in attributes:
        return False
    if "ordering" in attributes and ir.IntegerAttr(attributes["ordering"]).value != 0:  # 0: not atomic
        return False
    vector = store.operands[0].type
    if not isinstance(vector, ir.VectorType):
        return False
    width = getattr(vector.element_type, "width", 0)
    nbytes = vector.shape[0] * width // 8 if vector.rank == 1 and width % 8 == 0 else 0
    return nbytes > 0 and nbytes % LINE_BYTES == 0


def _stream(store):
    """`if (address % 64 == 0) <store, non-temporal, align 64> else <store>`; returns the op holding
    them (its region's exits get the fence)."""
    from mlir import ir
    from mlir.dialects import llvm

    store = store.operation
    value, address = store.operands
    location = store.location
    block = store.block
    i64 = ir.IntegerType.get_signless(64)
    with location, ir.InsertionPoint(store):
        offset = llvm.AndOp(llvm.PtrToIntOp(i64, address).result, _i64(LINE_BYTES - 1)).result
        aligned = llvm.ICmpOp(llvm.ICmpPredicate.eq, offset, _i64(0)).result
    # Split the block after the store: the rest of it moves to `rest`.
    ops = [op.operation for op in block.operations]
    rest = block.create_after()
    for op in ops[ops.index(store) + 1 :]:
        rest.append(op)
    plain = block.create_after()
    streaming = block.create_after()
    plain.append(store)
    with location:
        with ir.InsertionPoint(plain):
            llvm.BrOp([], rest)
        with ir.InsertionPoint(streaming):
            llvm.StoreOp(value, address, alignment=LINE_BYTES, nontemporal=True)
            llvm.BrOp([], rest)
        with ir.InsertionPoint(block):
            llvm.CondBrOp(aligned, [], [], streaming, plain)
    return block.owner


def _i64(value: int):
    from mlir import ir
    from mlir.dialects import llvm

    i64 = ir.IntegerType.get_signless(64)
    return llvm.ConstantOp(i64, ir.IntegerAttr.get(i64, value)).result


def _closing_region_op(op):
    """The nearest op around `op` (itself included) whose region exits close the stores in it."""
    while op.name not in _REGION_EXITS:
        op = op.parent
    return op.operation


def _fence_exits(owner) -> None:
    """An `sfence` before each exit of `owner`'s region."""
    from mlir import ir
    from mlir.dialects import llvm

    exit_name = _REGION_EXITS[owner.name]
    for block in owner.regions[0].blocks:
        ops = list(block.operations)
        if ops and ops[-1].name == exit_name:
            with ops[-1].location, ir.InsertionPoint(ops[-1]):
                llvm.CallIntrinsicOp(None, ir.StringAttr.get("llvm.x86.sse.sfence"), [], [], [])


__all__ = ["ARG_ATTR", "NONTEMPORAL_MIN_BYTES", "Streamed", "stream_stores", "wants_streaming"]
