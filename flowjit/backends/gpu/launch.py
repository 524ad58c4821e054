"""Kernels a GPU lowering writes as a `gpu.launch` itself, rather than as loops the stage table maps
to blocks and threads: those whose threads cooperate through workgroup memory, barriers and
shuffles (the row kernels, `lower_rows.py`; the tiled products, `lower_matmul.py`).

    workgroup_launch(em, op, blocks, threads, workgroup, write)

writes the launch at the emitter's place: its grid (`blocks`) and block (`threads`) sizes, three
SSA index values each, its workgroup buffers (`name : memref<..., #gpu.address_space<workgroup>>`),
and the body `write(b, block_ids, thread_ids)` fills, located at `op`'s line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder
from flowjit.ir.graph import Op


def mlir_location(op: Op) -> str:
    """`op`'s source line as an MLIR location (`loc("file":line:0)`), or "" without one."""
    file = op.loc.file.replace("\\", "\\\\").replace('"', '\\"')
    return f'loc("{file}":{op.loc.line}:0)' if op.loc.file else ""


def memref_type(shape: Sequence[int], elem: str) -> str:
    return f"memref<{''.join(f'{d}x' for d in shape)}{elem}>"


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
