"""Kernels a GPU lowering writes as a `gpu.launch` itself, rather than as loops the stage table maps
to blocks and threads: those whose threads cooperate through workgroup memory, barriers and
shuffles (the row kernels, `lower_rows.py`; the tiled products, `lower_matmul.py`).

    workgroup_launch(em, op, blocks, threads, workgroup, write)

writes the launch at the emitter's place: its grid (`blocks`) and block (`threads`) sizes, three
SSA index values each, its workgroup buffers (`name : memref<..., #gpu.address_space<workgroup>>`),
and the body `write(b, block_ids, thread_ids)` fills, located at `op`'s line. Such a body reads
and writes its buffers an element at a time: `load_element` / `store_element` (bools as bytes,
values in their compute types).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder
from flowjit.backends.mlir.lower_elementwise import extend, narrow
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op


def mlir_location(op: Op) -> str:
    """`op`'s source line as an MLIR location (`loc("file":line:0)`), or "" without one."""
    file = op.loc.file.replace("\\", "\\\\").replace('"', '\\"')
    return f'loc("{file}":{op.loc.line}:0)' if op.loc.file else ""


def load_element(b: ScalarBuilder, view: str, mtype: str, indices: list[str], dtype: dt.DType) -> str:
    """The element at `indices` of buffer `view` (memref type `mtype`) holding `dtype` values, in
    its compute type (a bool from its byte)."""
    loaded = b.op(f"memref.load {view}[{', '.join(indices)}] : {mtype}")
    if dtype.is_bool:
        return b.op(f"arith.cmpi ne, {loaded}, {b.const(0, 'i8')} : i8")
    return extend(b, loaded, dtype)


def store_element(b: ScalarBuilder, value: str, view: str, mtype: str, indices: list[str], dtype: dt.DType) -> None:
    """Store `value` (in `dtype`'s compute type) at `indices` of buffer `view`, rounded to `dtype`
    (a bool as its byte)."""
    stored = b.op(f"arith.extui {value} : i1 to i8") if dtype.is_bool else narrow(b, value, dtype)
    b.line(f"memref.store {stored}, {view}[{', '.join(indices)}] : {mtype}")


def workgroup_launch(
    em: KernelEmitter,
    op: Op,
    blocks: Sequence[str],
    threads: Sequence[str],
    workgroup: Sequence[str],
    write: Callable[[ScalarBuilder, list[str], list[str]], None],
) -> None:
    """A `gpu.launch` of `blocks` x `threads` (index SSA values, x y z) with `workgroup` buffers,
    whose body `write(b, block ids, thread ids)` writes (see the module docstring)."""
    ids = [em.fresh(name) for name in ("bx", "by", "bz", "tx", "ty", "tz", "gx", "gy", "gz", "sx", "sy", "sz")]
    grid = ", ".join(f"{i} = {n}" for i, n in zip(ids[6:9], blocks))
    block = ", ".join(f"{i} = {n}" for i, n in zip(ids[9:12], threads))
    buffers = f" workgroup({', '.join(workgroup)})" if workgroup else ""
    em.line(
        f"gpu.launch blocks({', '.join(ids[0:3])}) in ({grid}) threads({', '.join(ids[3:6])}) in ({block}){buffers} {{"
    )
    b = ScalarBuilder(em, em.indent + "  ")
    write(b, ids[0:3], ids[3:6])
    em.body.extend(b.lines)
    location = mlir_location(op)
    location = f" {location}" if location else ""
    em.line(f"  gpu.terminator{location}")
    em.line(f"}}{location}")
