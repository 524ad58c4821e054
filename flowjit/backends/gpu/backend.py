"""The GPU backend as a `Backend`: graphs compiled to PTX, one kernel per fused region or op.

Compile-only for now: the executable holds the stage texts and each kernel's PTX; running needs
the GPU runtime (CUDA driver API through `cuda-bindings`), which is not built yet
(docs/gpu-backend.md). The compiler (`compiler.py`, which loads MLIR) is imported on the first
compile.

Targets: 'cuda' (sm_80; the backend of device type 'gpu') and 'cuda-<chip>' for every chip of
`pipeline.CHIPS` ('cuda-sm_90').
"""

from __future__ import annotations

from flowjit.backends.base import Backend, Executable
from flowjit.backends.gpu.pipeline import CHIPS, GpuOptions
from flowjit.errors import FlowjitError


class GpuRuntimeError(FlowjitError, RuntimeError):
    """Running GPU code needs what this build does not have (a CUDA device, the GPU runtime)."""


class GpuExecutable(Executable):
    """A compiled function's PTX, one text per kernel (`kernels`), and its stage texts ('mlir',
    'gpu-mlir', 'ptx'). It cannot run yet."""

    fresh_outputs = True

    def __init__(self, module, options: GpuOptions, name: str):
        self.backend = f"cuda (MLIR -> NVVM -> PTX, {options.chip}; compile-only: no GPU runtime yet)"
        self.options = options
        self.name = name
        self.kernels = module.kernels
        self.stages = {"mlir": module.mlir.text, "gpu-mlir": module.gpu_mlir, "ptx": module.ptx_text()}

    def run(self, args, variables=None, outputs=None):
        raise GpuRuntimeError(
            f"cannot run '{self.name}' on target 'cuda': running GPU code needs a CUDA device and the GPU "
            "runtime (cuda-bindings), which flowjit does not have yet; its PTX is in "
            "`.lower(...).as_text('ptx')`. Use target='cpu' to run it"
        )

    def run_trusted(self, args):
        return self.run(args)

    def run_step(self, args, variables, channel):
        return self.run(args)


class CudaBackend(Backend):
    """Compiles graphs to PTX for one chip (`options.chip`)."""

    def __init__(self, name: str, options: GpuOptions):
        self.name = name
        self.options = options

    def compile(self, graph, device=None, options=None, aliases=None) -> Executable:
        """PTX for `graph` (`device` only names the GPU: every one of a chip gets the same code).
        Donated buffers are not honoured (`aliases` stays empty)."""
        from flowjit.backends.gpu.compiler import lower_to_ptx

        options = options or self.options
        return GpuExecutable(lower_to_ptx(graph, options), options, graph.name)


# 'cuda' and one 'cuda-<chip>' per chip, each with its options.
BACKENDS = {"cuda": CudaBackend("cuda", GpuOptions())} | {
    f"cuda-{chip}": CudaBackend(f"cuda-{chip}", GpuOptions(chip=chip)) for chip in CHIPS
}
