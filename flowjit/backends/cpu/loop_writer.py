"""`LoopWriter`: the loop nests of the CPU's hand-written vector kernels (the matmul kernel, the
row writers, the movement copies, argmax rows, scans), written on tensors: `scf.for` loops carrying
tensors as iter_args, `scf.forall` chunks over the cores writing slices of one shared output, index
arithmetic, and kernel temporaries in the function's scratch area.
"""

from __future__ import annotations

from flowjit.backends.mlir.emitter import KernelEmitter


class LoopWriter:
    """Small helpers over KernelEmitter for loop nests with tensor iter_args; the matmul kernel's writer
    also carries the epilogue of its register tiles (`tile_epilogue`, `origin`)."""

    @classmethod
    def with_scratch(cls, em: KernelEmitter, needed: int, tile_epilogue=None) -> LoopWriter:
        """A writer whose temporaries (`needed` bytes) go in the function's scratch area when it is
        that large, else are allocated."""
        scratch = em.scratch if em.scratch and em.scratch[1] >= needed else None
        return cls(em, scratch, tile_epilogue)

    def __init__(self, em: KernelEmitter, scratch: tuple[str, int] | None = None, tile_epilogue=None):
        self.em = em
        self.scratch = scratch  # (memref<Nxi8>, N) holding this kernel's temporaries, or None: allocate them
        # tile_epilogue(window, (rows, columns), row, column) -> the window through the epilogue,
        # for each register tile once stored (see `emit_matmul`); `origin`: C's (row, column) of the
        # (0, 0) of the tile the row blocks being written store into.
        self.tile_epilogue = tile_epilogue
        self.origin: tuple[str, str] | None = None

    def temporary(self, shape: tuple[int, ...], elem: str, offset: str) -> str:
        """A tensor for a kernel temporary, at byte `offset` of the scratch area (or newly allocated)."""
        tensor = f"tensor<{'x'.join(map(str, shape))}x{elem}>"
        if self.scratch is None:
            return self.em.op(f"tensor.empty() : {tensor}")
        memref = f"memref<{'x'.join(map(str, shape))}x{elem}>"
        area, size = self.scratch
        view = self.em.op(f"memref.view {area}[{offset}][] : memref<{size}xi8> to {memref}")
        return self.em.op(f"bufferization.to_tensor {view} restrict writable : {memref} to {tensor}")

    def index(self, value: int) -> str:
        # Emitted at each use (canonicalize hoists and merges them): a cached one could sit inside
        # a loop body that does not dominate a later use.
        return self.em.op(f"arith.constant {value} : index")

    def add(self, a: str, b: str) -> str:
        return self.em.op(f"arith.addi {a}, {b} : index")

    def mul(self, a: str, b: str) -> str:
        return self.em.op(f"arith.muli {a}, {b} : index")

    def open_for(self, lo: str, hi: str, step: str, carried: list[tuple[str, str]]) -> tuple[str, str, list[str]]:
        """`scf.for` header; returns (result name, induction variable, iter_arg names)."""
        result, iv = self.em.fresh(), self.em.fresh("i")
        names = [self.em.fresh("c") for _ in carried]
        init = ", ".join(f"{n} = {v}" for n, (v, _) in zip(names, carried))
        types = ", ".join(t for _, t in carried)
        count = f":{len(carried)}" if len(carried) > 1 else ""
        self.em.line(f"{result}{count} = scf.for {iv} = {lo} to {hi} step {step} iter_args({init}) -> ({types}) {{")
        self.em.indent += "  "
        return result, iv, names

    def open_forall(self, count: int | str, init: str, tensor_type: str) -> tuple[str, str, str]:
        """`scf.forall` header over `count` chunks sharing one output (initially `init`); returns
        (result name, chunk index, shared output name)."""
        done, t, shared = self.em.fresh(), self.em.fresh("t"), self.em.fresh("c")
        self.em.line(f"{done} = scf.forall ({t}) in ({count}) shared_outs({shared} = {init}) -> ({tensor_type}) {{")
        self.em.indent += "  "
        return done, t, shared

    def close_forall(self, tile: str, shared: str, where: str, tile_type: str, tensor_type: str) -> None:
        """Close `open_forall`: the chunk's `tile` goes into `shared` at `where` ("[offsets] [sizes] [strides]")."""
        self.em.line("scf.forall.in_parallel {")
        self.em.line(f"  tensor.parallel_insert_slice {tile} into {shared}{where} : {tile_type} into {tensor_type}")
        self.em.line("}")
        self.em.indent = self.em.indent[:-2]
        self.em.line("}")

    def close_for(self, yielded: list[str], types: list[str], attributes: str = "") -> None:
        """Close the innermost `open_for`, yielding `yielded`; `attributes` (e.g. `NO_UNROLL`) go on the loop."""
        self.em.line(f"scf.yield {', '.join(yielded)} : {', '.join(types)}")
        self.em.indent = self.em.indent[:-2]
        self.em.line(f"}} {{{attributes}}}" if attributes else "}")
