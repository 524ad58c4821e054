"""Transform-dialect schedules for the CPU kernels: how a `linalg.generic` is split over threads,
tiled and vectorized. Each function returns `steps(handle) -> [transform ops]` for
`KernelEmitter.schedule`. The choices and their measurements are in docs/cpu-backend.md.

- Elementwise kernels are 1-D (the lowering collapses operands): vectors of the host width, and
  above `PARALLEL_MIN_ELEMENTS` one `scf.forall` chunk per core (lowered to OpenMP).
- Reductions are normalized by the lowering to (A, R) rows or (A, R, B) with B contiguous:
  rows reduce with vector accumulators along R; columns vectorize along B and keep the
  accumulator in registers across R (`loop-invariant-subset-hoisting` after the schedule).
"""

from __future__ import annotations

import functools
import os

from flowjit.backends.cpu import toolchain

# Below this many elements a kernel stays on one thread: forking an OpenMP team costs a few
# microseconds, which is the time one core needs for ~64K simple elementwise operations.
PARALLEL_MIN_ELEMENTS = 1 << 16
ANY = "!transform.any_op"


@functools.cache
def vector_bits() -> int:
    """Width of the host's vector registers (512 with AVX-512, 256 with AVX2, else 128)."""
    features = toolchain.host_cpu().features
    if "+avx512f" in features:
        return 512
    if "+avx2" in features or "+avx" in features:
        return 256
    return 128


def threads() -> int:
    return os.cpu_count() or 1


def lanes(elem_bits: int) -> int:
    """Vector length in elements for the widest element type of a kernel."""
    return max(4, vector_bits() // max(elem_bits, 8))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def elementwise(n: int, elem_bits: int):
    """A 1-D elementwise kernel over `n` elements."""
    vl = lanes(elem_bits)

    def steps(h: str) -> list[str]:
        lines = []
        if n >= PARALLEL_MIN_ELEMENTS and threads() > 1:
            chunk = _round_up(-(-n // threads()), vl * 4)
            lines.append(
                f"%par{h[1:]}, %forall{h[1:]} = transform.structured.tile_using_forall {h} tile_sizes [{chunk}] "
                f": ({ANY}) -> ({ANY}, {ANY})"
            )
            h = f"%par{h[1:]}"
        lines += [
            f"%vec{h[1:]}, %loop{h[1:]} = transform.structured.tile_using_for {h} tile_sizes [{vl}] "
            f": ({ANY}) -> ({ANY}, {ANY})",
            f"transform.structured.vectorize %vec{h[1:]} vector_sizes [{vl}] : {ANY}",
        ]
        return lines

    return steps


def copy_nd(shape: tuple[int, ...], elem_bits: int):
    """An n-d kernel (e.g. a broadcast): rows split over cores, the last dimension vectorized."""
    vl = lanes(elem_bits)
    rank = len(shape)

    def steps(h: str) -> list[str]:
        lines = []
        if threads() > 1 and shape[0] > 1:
            chunk = -(-shape[0] // threads())
            sizes = ", ".join([str(chunk)] + ["0"] * (rank - 1))
            lines.append(
                f"%par{h[1:]}, %forall{h[1:]} = transform.structured.tile_using_forall {h} tile_sizes [{sizes}] "
                f": ({ANY}) -> ({ANY}, {ANY})"
            )
            h = f"%par{h[1:]}"
        tiles = ", ".join(["1"] * (rank - 1) + [str(vl)])
        loops = ", ".join([ANY] * rank)
        lines += [
            f"%vec{h[1:]}, {', '.join(f'%loop{i}{h[1:]}' for i in range(rank))} = "
            f"transform.structured.tile_using_for {h} tile_sizes [{tiles}] : ({ANY}) -> ({ANY}, {loops})",
            f"transform.structured.vectorize %vec{h[1:]} vector_sizes [{tiles}] : {ANY}",
        ]
        return lines

    return steps
