"""The GPU backend's pipeline, one stage table read top to bottom (Triton's shape: named stages,
each a flat list of passes; the recipes: shared/TOOLCHAIN.md section 4, route B).

    stage        what runs                                                        where
    mlir         flowjit IR -> MLIR on tensors (`target.GPU`'s lowerings)          compiler.generate_mlir
    bufferize    `mlir_stages()["bufferize"]`: elementwise fusion, tensors -> buffers compiler.lower_to_ptx
    gpu-mlir     `mlir_stages()["gpu-launches"]`: loops -> blocks and threads;     compiler.lower_to_ptx
                 `compiler.globals_into_launches`; `mlir_stages()["gpu-kernels"]`:
                 one `gpu.func` kernel per top-level loop nest
    nvvm         `mlir_stages()["nvvm"]`: kernels -> NVVM, `gpu.binary` with PTX    compiler.lower_to_ptx
    ptx          each kernel's PTX, read out of the `gpu.binary`                   compiler.extract_ptx

`GpuOptions` (frozen, validated in `__post_init__`) choose the chip and the threads per block.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowjit.backends.mlir.pipeline import module_pipeline

# The chips we generate PTX for, with the PTX ISA each needs at least (sm_90: PTX 7.8).
CHIPS = {"sm_80": "+ptx70", "sm_86": "+ptx71", "sm_89": "+ptx78", "sm_90": "+ptx80"}


@dataclass(frozen=True)
class GpuOptions:
    """Options that change the generated code."""

    chip: str = "sm_80"
    # Threads per block of every kernel (the tile size of the outermost parallel dimension).
    block_size: int = 256
    opt_level: int = 3

    def __post_init__(self):
        if self.chip not in CHIPS:
            raise ValueError(f"chip must be one of {', '.join(CHIPS)}; found {self.chip!r}")
        if not (isinstance(self.block_size, int) and 32 <= self.block_size <= 1024 and self.block_size % 32 == 0):
            raise ValueError(f"block_size must be a multiple of 32 in 32..1024; found {self.block_size!r}")
        if self.opt_level not in (0, 1, 2, 3):
            raise ValueError(f"opt_level must be 0..3; found {self.opt_level}")


def mlir_stages(options: GpuOptions) -> dict[str, tuple[str, ...]]:
    """The MLIR stages after the lowering, in order: stage name -> its passes."""
    return {
        "bufferize": (
            # Elementwise chains (a fused region's kernels, broadcasts included) become one generic.
            "func.func(linalg-fuse-elementwise-ops)",
            "canonicalize",
            "eliminate-empty-tensors",
            "one-shot-bufferize{bufferize-function-boundaries function-boundary-type-conversion=identity-layout-map}",
            "canonicalize",
            "cse",
            "convert-bufferization-to-memref",
        ),
        # Named ops (the copies `compiler.copies_as_kernels` writes, fills) as generics, so that
        # `compiler.contiguous_dimension_first` orders the loops of every kernel.
        "generalize": ("func.func(linalg-generalize-named-ops)",),
        "gpu-launches": (
            # The vectorized kernels' loops (`wide_accesses`: an scf.forall per kernel) as the others'.
            "func.func(scf-forall-to-parallel)",
            # Each linalg op -> an scf.parallel over its parallel dimensions (reductions inside: scf.for).
            "convert-linalg-to-parallel-loops",
            # No canonicalization before the mapping: it would fold a one-iteration scf.parallel (a
            # whole-array reduction's last stage) into the host code.
            # The outermost dimension in blocks of `block_size` threads, the others one per block; a
            # whole tile with a bounds check inside (`no-min-max-bounds`), so every launch has constant
            # block dimensions (with `affine.min` bounds convert-parallel-loops-to-gpu does nothing).
            f"func.func(scf-parallel-loop-tiling{{parallel-loop-tile-sizes={options.block_size} "
            "no-min-max-bounds=true})",
            # Tile loop -> blocks, inside it -> threads, deeper -> serial loops. Innermost dimension
            # first: the largest extents go to block x (up to 2^31 - 1; y and z stop at 65535).
            "func.func(gpu-map-parallel-loops{mapping-policy=innermost-first})",
            "func.func(convert-parallel-loops-to-gpu)",  # mapped loop nests -> gpu.launch
            "lower-affine",  # the tiles' affine.min bounds, on the host and in the launches
        ),
        # Between the two: `compiler.globals_into_launches` moves the reads of constant globals
        # into the launches, so that outlining copies the globals into the kernels' gpu.modules.
        "gpu-kernels": (
            # Constants into the kernels (canonicalization hoisted them to the function): passed as
            # kernel arguments otherwise, one per polynomial coefficient.
            "func.func(gpu-launch-sink-index-computations)",
            "gpu-kernel-outlining",  # each gpu.launch -> a gpu.func kernel in a gpu.module, and gpu.launch_func
            "canonicalize",
            "cse",
            "symbol-dce",  # the host's copies of globals the kernels now hold
        ),
        "nvvm": (
            f"nvvm-attach-target{{chip={options.chip} features={CHIPS[options.chip]} O={options.opt_level}}}",
            # The math library's fma, roundeven, abs and copysign as LLVM intrinsics, which NVPTX
            # selects as instructions; convert-gpu-to-nvvm would make them libdevice calls.
            # Views of constant globals inside the kernels (`globals_into_launches`) as pointer
            # arithmetic first: convert-gpu-to-nvvm lowers no `memref.expand_shape`.
            "gpu.module(expand-strided-metadata,lower-affine,convert-scf-to-cf,convert-gpu-to-nvvm,canonicalize,cse,"
            "reconcile-unrealized-casts)",
            "gpu-module-to-binary{format=isa}",
        ),
    }


def stage_pipeline(*names: str, options: GpuOptions) -> str:
    """The 'builtin.module(...)' pipeline running the passes of the MLIR stages `names`, in order."""
    stages = mlir_stages(options)
    return module_pipeline([p for name in names for p in stages[name]])
