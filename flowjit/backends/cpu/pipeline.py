"""The CPU backend's pipeline, one stage table read top to bottom.

    stage          what runs                                                       where
    mlir           flowjit IR -> MLIR on tensors + transform schedule              compiler.generate_mlir
    schedule       transform-interpreter; `lane_extremes`, `ldexp` rewrites        toolchain.lower_to_llvm_ir
    bufferize      `mlir_stages()["bufferize"]`                                    toolchain.lower_to_llvm_ir
    llvm-dialect   `mlir_stages()["llvm-dialect"]`; non-temporal stores            toolchain.lower_to_llvm_ir
    llvm           translation, single-lane stores; LLVM O`opt_level` or           toolchain.optimize
                   `LIGHT_PASSES` (`compiler.light_pipeline`)
    asm            code generation: MCJIT in process, or an object (AOT)          toolchain.jit_compile / emit_object

The MLIR stages are flat lists of passes, one comment each (the recipes and their pitfalls:
shared/TOOLCHAIN.md). `CompileOptions` select among them (ahead-of-time libraries without
OpenMP: `openmp=False`) and are hashed into the compile cache's key (`cache.cache_key`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowjit.backends.mlir.pipeline import module_pipeline

OPT_LEVEL = 3


@dataclass(frozen=True)
class CompileOptions:
    """Options that change the generated code (hashed into the cache key)."""

    opt_level: int = OPT_LEVEL
    # Outputs the caller may alias with an input (variables updated in place): written last.
    late_outputs: tuple[int, ...] = ()
    # (output, input) pairs among the late outputs: the input whose buffer the caller may pass for
    # that output. The lowering writes such an output in place where that is safe (`in_place.py`).
    aliased_inputs: tuple[tuple[int, int], ...] = ()
    # The schedules' parallel loops become OpenMP regions (`__kmpc_*` calls); False: serial loops.
    openmp: bool = True

    def __post_init__(self):
        if self.opt_level not in (0, 1, 2, 3):
            raise ValueError(f"opt_level must be 0..3; found {self.opt_level}")
        if not isinstance(self.openmp, bool):
            raise ValueError(f"openmp must be True or False; found {self.openmp!r}")
        outputs = [out for out, _ in self.aliased_inputs]
        if not set(outputs) <= set(self.late_outputs) or len(set(outputs)) != len(outputs):
            raise ValueError(
                f"aliased_inputs must name distinct late outputs; found {self.aliased_inputs} "
                f"with late_outputs {self.late_outputs}"
            )


def mlir_stages(options: CompileOptions) -> dict[str, tuple[str, ...]]:
    """The MLIR stages after the transform schedule, in order: stage name -> its passes."""
    return {
        # Tensors -> buffers. No `cse` before bufferization: it merges the `tensor.empty`s of
        # different kernels (two reductions' partial accumulators), and the shared buffer then costs
        # copies on every iteration. The schedule before this stage ends with a function-wide
        # canonicalization and hoists the vector accumulators of the loops it marked
        # (`emitter.HOIST_MARK`): `loop-invariant-subset-hoisting` over every loop cost a third of
        # the MLIR stages' time in a training step.
        "bufferize": (
            # Folds the i8 <-> i1 conversions of bool tensors into their neighbours: an i1 tensor left
            # between two kernels would be a memref<..xi1>, which MLIR 22's MemRefToLLVM rejects.
            "func.func(linalg-fuse-elementwise-ops)",
            "canonicalize",
            # Before bufferization, or destination-passing code allocates a temporary per kernel and
            # copies it into the output (TOOLCHAIN.md).
            "eliminate-empty-tensors",
            "one-shot-bufferize{bufferize-function-boundaries function-boundary-type-conversion=identity-layout-map}",
            "canonicalize",
            "cse",
            # An allocation of known size that no iteration hands to the next leaves its loop (not an
            # `scf.forall`: each thread keeps its own); otherwise a row reduction's accumulator is
            # malloc'ed and freed once per row, nearly doubling its time.
            "func.func(buffer-loop-hoisting)",
            # The passes of `buffer-deallocation-pipeline` that change our modules (it also runs
            # expand-realloc, two canonicalizations and a cse that find nothing here, a tenth of the
            # MLIR half's time).
            "ownership-based-buffer-deallocation",
            "buffer-deallocation-simplification",
            "bufferization-lower-deallocations",
            # Folds the self-copies `cse` leaves of in-place updates and the deallocations'
            # ownership conditions.
            "canonicalize",
            "convert-bufferization-to-memref",
        ),
        # Buffers, loops and vectors -> the LLVM and OpenMP dialects. `toolchain` reports any op
        # left over.
        "llvm-dialect": (
            "func.func(scf-forall-to-parallel)",  # the schedules' scf.forall -> scf.parallel
            # scf.parallel -> OpenMP regions; without it `convert-scf-to-cf` makes them serial loops.
            *(("convert-scf-to-openmp",) if options.openmp else ()),
            "convert-linalg-to-loops",  # kernels no schedule vectorized: plain loops
            "lower-affine",
            # Masked n-d transfers otherwise go through an `alloca` buffer per loop iteration (stack
            # overflow on a 45000-row sum + max).
            "convert-vector-to-scf{full-unroll=true}",
            "expand-strided-metadata",
            "lower-affine",  # the affine ops `expand-strided-metadata` makes
            # The index arithmetic of coalesced and tiled loops (`floordivsi`/`remsi` by a power of two)
            # becomes shifts and masks where its operands are provably non-negative; left signed,
            # only LLVM's O3 finds that, and softmax's exp loop runs slower under `LIGHT_PASSES`.
            "arith-unsigned-when-equivalent",
            # Before `convert-scf-to-cf`: scf-to-openmp wraps loop bodies in `memref.alloca_scope`,
            # which only accepts a single block.
            "finalize-memref-to-llvm",
            "convert-scf-to-cf",
            "convert-math-to-llvm",  # math -> LLVM intrinsics where LLVM has them
            # ... and libm calls otherwise (erf, atan2 in f64), before vector-to-llvm: it unrolls
            # vector operands with `vector.extract`/`insert`, which must still be lowered.
            "convert-math-to-libm",
            # `enable-x86vector`: the `x86vector.avx512.mask.scalef` ops of `ldexp.rewrite` (AVX-512
            # hosts); `reassociate-fp-reductions`: a float `vector.reduction` is a tree of adds, not
            # one dependent add per lane (softmax's sum: a third less machine code).
            "convert-vector-to-llvm{enable-x86vector=true reassociate-fp-reductions=true}",
            "convert-arith-to-llvm",  # ops the openmp conversion does not lower (`arith.floordivsi`)
            # Bare pointers for static memrefs (the entry's calling convention). Before
            # `convert-openmp-to-llvm`, which would otherwise convert the signature with descriptors.
            "convert-func-to-llvm{use-bare-ptr-memref-call-conv=1}",
            # Also carries the cf, memref and func conversions (for the ops inside OpenMP regions)
            # over the whole module: separate cf, memref and index conversions changed nothing.
            "convert-openmp-to-llvm",
            "convert-ub-to-llvm",  # the `ub.poison` vectorization leaves (TOOLCHAIN.md)
            "reconcile-unrealized-casts",
            # Fold the conversions' `llvm.insertvalue`/`extractvalue` chains in MLIR, where it is
            # cheap: left to LLVM, each InstCombine run pays for them again.
            "canonicalize",
            "cse",
        ),
    }


def stage_pipeline(*names: str, options: CompileOptions | None = None) -> str:
    """The 'builtin.module(...)' pipeline running the passes of the MLIR stages `names`, in order."""
    stages = mlir_stages(options or CompileOptions())
    return module_pipeline([p for name in names for p in stages[name]])


# The LLVM passes for a module whose every loop the lowering vectorized (`compiler.light_pipeline`):
# scalar replacement of the conversions' allocas, instruction combining and CFG cleanup, loop
# rotation and GVN. O3 adds about 100 passes (a third of its time InstCombine, run 8 times) that
# find little in such modules: the same run time on the benchmark workloads but the CNN (whose pad
# is a plain copy loop), while O3 takes
# 2.5-3.5x as long on a 2-core AMD EPYC Zen 4 VM (docs/cpu-compile-time.md, "LLVM's light
# pipeline"). O1 and O2 cost as much as O3. llvmlite's loop-unroll pass cannot be limited to the
# loops marked for full unrolling (it unrolls by its own cost model too, growing the MLP step's IR
# by half), so marked modules keep O3 (`compiler.light_pipeline`).
LIGHT_PASSES = ("sroa", "instruction_combine", "simplify_cfg", "loop_rotate", "new_gvn", "instruction_combine")
