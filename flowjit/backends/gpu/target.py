"""The NVIDIA GPU as a target of the shared lowering (`backends/mlir`): its lowering table.

The shared lowerings write plain `linalg` kernels here (every schedule is None: the GPU stage
table maps loops to blocks and threads after bufferization, `pipeline.py`) and the shared,
call-free math (`mlir/mathlib.py`), so PTX never calls libdevice. On top of them:

- `fusion`: a region that is a row computation as a whole (softmax, layer norm, ...) is one row
  kernel (`lower_rows.py`: a block per row, warp shuffles); a tiled product or convolution with an
  elementwise epilogue (`x @ w + b`, then tanh; `conv2d(x, w, b)`, then relu) is one launch of the
  tiled kernel (`lower_epilogue.py`); any
  other, the fused body's ops one after another on tensors (`lower_control.lower_region`), whose
  elementwise chains and broadcasts the "bufferize" stage's `linalg-fuse-elementwise-ops` merges
  into one kernel.
- the GPU's own kernels (`lower_kernels.py`): reductions in two stages where few results would
  leave most threads idle, contractions, windows, scans, sort, gather/scatter,
  pad, concatenate, dynamic_slice, as one thread per result element or a parallel loop writing a
  buffer.
- rank-0 ops as kernels of one element of rank 1 (`scalars_as_vectors`, `Target.rank0_kernels`).
- `CPU_ONLY`: ops the GPU does not compile (control flow, send/recv), with the reason a
  placement report shows (`cpu_only_reason(op)`). `check_graph` refuses them, and ops without a lowering, with a
  `CompileError` naming the op, its line and the reason.
- state ops (`FUNCTIONALIZED`) never reach the lowering: `CudaBackend.compile` turns variables into
  the function's inputs and outputs first (`passes/state.py`).
"""

from __future__ import annotations

from flowjit.backends.gpu import lower_epilogue, lower_kernels, lower_rows
from flowjit.backends.mlir import (
    lower_control,
    lower_elementwise,
    lower_layout,
    lower_movement,
    lower_reduction,
    mathlib,
    mathlib_f64,
)
from flowjit.backends.mlir.emitter import KernelEmitter
from flowjit.backends.mlir.lower_elementwise import reshape_tensor
from flowjit.backends.mlir.lowering import splat_value
from flowjit.backends.mlir.target import MathLibrary, Target
from flowjit.errors import CompileError, op_error
from flowjit.ir.graph import Graph, Op, Value


class PlainLoops:
    """The GPU's `KernelSchedules`: no transform schedule (kernels stay plain `linalg`, mapped to
    blocks and threads by the stage table), one lane per thread."""

    PARALLEL_MIN_ELEMENTS = 1 << 62
    PLAIN_LOOP_MAX_ELEMENTS = 1 << 62

    def lanes(self, elem_bits: int) -> int:
        return 1

    def elementwise(self, n: int, elem_bits: int, vectors: int = 1):
        return None

    def reduction(self, shape, axis, acc_bits: int, may_stay_plain: bool = False):
        return None

    def copy_nd(self, shape, elem_bits: int, parallel: bool = True):
        return None

    def transpose_block(self, elem_bits: int) -> int:
        return 8

    def transpose_blocks(self, shape, source_last: int, elem_bits: int, parallel: bool = True):
        return None

    def transpose_short_rows(self, shape, elem_bits: int):
        return None


GPU = Target(
    "cuda",
    schedules=PlainLoops(),
    # float64 sin, cos, erf, atan2, pow without libm calls (`mathlib_f64`); the rest is `mathlib`'s
    math=MathLibrary(unary=mathlib_f64.MATH, binary=mathlib_f64.MATH_BINARY, truncate_to_bf16=mathlib.truncate_to_bf16),
)
GPU.rank0_kernels = False
GPU.store_through_views = False
lower_elementwise.register(GPU.lowerings, GPU.math)
lower_reduction.register(GPU.lowerings)
lower_layout.register(GPU.lowerings)
lower_movement.register(GPU.lowerings)
lower_kernels.register(GPU.lowerings)

GPU.lowerings.tensor["custom_vjp_call"] = lower_control.lower_custom_vjp_call


def lower_fusion_kernel(fl, op: Op) -> bool:
    """`LoweringTable.call` entry for "fusion": a region that is a row computation as one kernel (a
    block per row), or a tiled product or convolution with its elementwise epilogue as one launch
    of the tiled kernel; False for others, which fall back to `lower_fusion` below."""
    return lower_rows.lower_row_fusion(fl, op) or lower_epilogue.lower_epilogue_fusion(fl, op)


GPU.lowerings.call["fusion"] = lower_fusion_kernel

# Ops the GPU does not compile, with the reason: placement puts them on the CPU and its report
# shows the reason; compiling one for the GPU is a CompileError quoting it.
CPU_ONLY = {
    **dict.fromkeys(
        ("cond", "for", "while"),
        "control flow: its predicate or trip count would be read on the host, from device memory",
    ),
    **dict.fromkeys(
        ("send", "recv", "send_done"),
        "communication: a kernel cannot call the host runtime's rendezvous (a GPU partition's send/recv "
        "run on the host around its GPU calls, staging.py)",
    ),
}

# State ops: `CudaBackend.compile` functionalizes them before lowering (each variable an input, each
# updated one an output, bound to the variable's copy in device memory at run time).
FUNCTIONALIZED = frozenset(("read_variable", "assign", "assign_add", "assign_sub"))


def cpu_only_reason(op: Op) -> str | None:
    """Why `op` must run on the CPU (what a placement report shows), or None if the GPU compiles it."""
    return CPU_ONLY.get(op.name)


def check_graph(graph: Graph) -> None:
    """Fail before lowering on the first op (fused bodies included) the GPU does not compile,
    naming it, its line and the reason."""
    for op in graph.walk():
        if op.name in ("constant", "fusion"):
            continue
        if op.name in FUNCTIONALIZED:
            raise op_error(
                CompileError, op.loc, op.name, "internal error: state ops reach the GPU lowering only through "
                "`passes.state.functionalize_state`, as CudaBackend.compile runs it",
            )  # fmt: skip
        reason = cpu_only_reason(op)
        if reason is not None:
            raise op_error(
                CompileError, op.loc, op.name, f"is CPU-only on target 'cuda': {reason}; use target='cpu' for it"
            )
        if not GPU.lowerings.has(op.name):
            raise op_error(
                CompileError,
                op.loc,
                op.name,
                "has no lowering for target 'cuda' (docs/gpu-backend.md lists what lowers); "
                "use target='cpu' for this function",
            )


@GPU.lowerings.lowering("fusion")
def lower_fusion(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
    """The fused body op by op on tensors; `linalg-fuse-elementwise-ops` ("bufferize" stage)
    merges its elementwise kernels."""
    return lower_control.lower_region(em, op.regions[0], operands)


# The attributes naming dimensions of the ops that have them, for operands and results of rank 1.
_RANK1_ATTRS = {
    "broadcast": {"shape": (1,), "dims": (0,)},
    "reshape": {"shape": (1,)},
    "transpose": {"perm": (0,)},
}


def scalars_as_vectors(fn):
    """A tensor lowering that computes an op of rank-0 operands and results on tensors of one
    element: a kernel of rank 0 has no parallel loop to map to a thread, and would run on the host."""

    def lower(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
        if op.regions or not op.results or any(v.type.rank for v in (*op.operands, *op.results)):
            return fn(em, op, operands)
        vectors, tensors = [], []
        for v, x in zip(op.operands, operands):
            if splat_value(v) is not None:  # a constant the lowering writes into the kernel's body
                vectors.append(v)
                tensors.append(x)
                continue
            vectors.append(Value(v.type.with_shape((1,))))
            tensors.append(reshape_tensor(em, x, v.type, vectors[-1].type))
        results = [r.type.with_shape((1,)) for r in op.results]
        promoted = Op(op.name, vectors, results, op.attrs | _RANK1_ATTRS.get(op.name, {}), op.loc, op.device)
        outs = fn(em, promoted, tensors)
        return [reshape_tensor(em, x, t, r.type) for x, t, r in zip(outs, results, op.results)]

    return lower


for _name, _fn in list(GPU.lowerings.tensor.items()):
    if _name not in ("fusion", "slice", *lower_kernels.OWN_SCALARS):  # these take rank 0 as it is
        GPU.lowerings.tensor[_name] = scalars_as_vectors(_fn)


def loop_kernels_followed(fn):
    """A lowering whose kernels elementwise fusion may merge with their operands' (elementwise
    ops, reshapes, transposes, slices): where an operand is a loop kernel's result
    (`KernelEmitter.loop_kernels`), so are its results, since fused they run that loop too."""

    def lower(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]:
        results = fn(em, op, operands)
        if em.loop_kernels.intersection(operands):
            em.loop_kernels.update(results)
        return results

    return lower


# Loop kernels are followed through every lowering but the GPU's own kernels (which read their
# operands with `tensor.extract`, so nothing is fused into them) and reductions; a broadcast of one
# copies it apart first (`lower_kernels.broadcast_apart`).
for _name, _fn in list(GPU.lowerings.tensor.items()):
    if _name == "broadcast":
        GPU.lowerings.tensor[_name] = lower_kernels.broadcast_apart(_fn)
    elif _name != "fusion" and _name not in lower_kernels.LOWERINGS:
        GPU.lowerings.tensor[_name] = loop_kernels_followed(_fn)
