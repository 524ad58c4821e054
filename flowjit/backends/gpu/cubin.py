"""Cubins from `ptxas`, made at compile time where it is installed, so that a GPU machine loads
machine code instead of JIT-compiling PTX (and needs no compiler at all).

Where ptxas is not found, the kernels keep only their PTX, which the driver JIT-compiles when they
are loaded; the launch-plan stage says which of the two a function got (`GpuExecutable`), never
silently.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile

from flowjit.backends.gpu.toolchain import find_ptxas  # noqa: F401 (the backend and tests call cubin.find_ptxas)
from flowjit.errors import CompileError

# Seconds one ptxas run may take.
PTXAS_TIMEOUT_S = 120


@functools.cache
def ptxas_version(ptxas: str) -> str:
    """The last line of `ptxas --version` (its release and build)."""
    done = subprocess.run([ptxas, "--version"], capture_output=True, text=True, timeout=PTXAS_TIMEOUT_S)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else "unknown"


def assemble(ptxas: str, ptx_texts: dict[str, str], chip: str, opt_level: int) -> dict[str, bytes]:
    """Each kernel's cubin for `chip` (kernel name -> PTX in, -> cubin out), all ptxas runs at
    once; a CompileError with ptxas's message when it rejects a kernel."""
    with tempfile.TemporaryDirectory(prefix="flowjit-ptxas-") as folder:
        running = {}
        for i, (name, ptx) in enumerate(ptx_texts.items()):
            source, target = os.path.join(folder, f"{i}.ptx"), os.path.join(folder, f"{i}.cubin")
            with open(source, "w") as f:
                f.write(ptx)
            command = [ptxas, f"-arch={chip}", f"-O{opt_level}", source, "-o", target]
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running[name] = (process, target, command)
        try:
            return {name: _cubin(name, *job, ptx_texts[name]) for name, job in running.items()}
        finally:
            for process, _, _ in running.values():
                if process.poll() is None:  # another kernel failed first: stop the rest
                    process.kill()
                    process.communicate()


def _cubin(name: str, process: subprocess.Popen, target: str, command: list[str], ptx: str) -> bytes:
    """The cubin of one ptxas run, once it has finished (at most `PTXAS_TIMEOUT_S`)."""
    try:
        _, errors = process.communicate(timeout=PTXAS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CompileError(
            f"ptxas did not finish kernel {name} within {PTXAS_TIMEOUT_S} s: {' '.join(command)}"
        ) from None
    if process.returncode != 0:
        raise CompileError(
            f"internal error: ptxas rejected kernel {name} (`{' '.join(command)}`):\n{errors}\nits PTX: {ptx[:2000]}"
        )
    with open(target, "rb") as f:
        return f.read()
