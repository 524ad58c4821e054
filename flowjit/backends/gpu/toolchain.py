"""Where the GPU backend finds NVIDIA's tools: `ptxas`, the PTX assembler (PTX -> cubin).

Compiling to PTX needs no CUDA toolkit (MLIR writes it); `ptxas` checks that PTX in the tests
and makes cubins. `make test` installs it with the `test` extra's pinned wheel
`nvidia-cuda-nvcc-cu12`, which ships it as `nvidia/cuda_nvcc/bin/ptxas`. No MLIR import here.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

# The environment variable naming a ptxas binary, which wins over every other place.
PTXAS_ENV = "FLOWJIT_PTXAS"


def _wheel_ptxas() -> str | None:
    """`nvidia/cuda_nvcc/bin/ptxas` of the installed `nvidia` namespace package, if there is one."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "cuda_nvcc", "bin", "ptxas")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_ptxas() -> str | None:
    """The ptxas to run: `$FLOWJIT_PTXAS`, else the `nvidia-cuda-nvcc-cu12` wheel's binary, else
    `ptxas` on PATH; None if there is none. A `$FLOWJIT_PTXAS` that is not an executable file is
    an error, not a silent fall-back."""
    named = os.environ.get(PTXAS_ENV)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise FileNotFoundError(f"{PTXAS_ENV}={named!r} is not an executable file; unset it or point it at ptxas")
        return named
    return _wheel_ptxas() or shutil.which("ptxas")
