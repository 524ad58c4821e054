"""Workspace planning: where each intermediate value of a compiled function lives in its one
workspace buffer (liveness-based reuse, `ALIGNMENT`-byte aligned slots)."""

from __future__ import annotations

from collections.abc import Callable

from flowjit.ir.graph import Graph, Value

ALIGNMENT = 64


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def plan_workspace(
    graph: Graph, needs_slot: Callable[[Value], bool], aliases: dict[Value, Value] | None = None
) -> tuple[dict[Value, int], int]:
    """Offsets in the workspace for every value that `needs_slot`, and the workspace size.
    `aliases`: values that are views of another value's memory (reshapes), which lives as long as
    they do.

    Algorithm:
    1. A value lives from the op that defines it to the last op that reads it (or one of its aliases).
    2. Walk the ops in order; allocate each result first-fit among the live blocks (a result never
       shares memory with the operands of its own op, which are still live while it is written).
    3. After the op, release the blocks of values whose last reader it was.
    """
    last_use: dict[Value, int] = {}
    for i, op in enumerate(graph.ops):
        for v in op.operands:
            last_use[v] = i
    for v in graph.results:  # a result in a slot (a late output) is copied out after the last op
        last_use[v] = len(graph.ops)
    for alias, root in (aliases or {}).items():
        last_use[root] = max(last_use.get(root, -1), last_use.get(alias, -1))
    live: dict[Value, tuple[int, int]] = {}  # value -> (offset, size)
    offsets: dict[Value, int] = {}
    peak = 0
    for i, op in enumerate(graph.ops):
        for v in op.results:
            if not needs_slot(v):
                continue
            size = aligned(v.type.size * v.type.dtype.itemsize)
            offset = _first_fit(sorted(live.values()), size)
            offsets[v] = offset
            live[v] = (offset, size)
            peak = max(peak, offset + size)
        for v in [v for v in live if last_use.get(v, -1) <= i]:
            del live[v]
    return offsets, peak


def _first_fit(blocks: list[tuple[int, int]], size: int) -> int:
    cursor = 0
    for offset, block_size in blocks:
        if offset - cursor >= size:
            return cursor
        cursor = max(cursor, offset + block_size)
    return cursor
