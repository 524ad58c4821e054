"""The peer libraries: flowjit and numpy always, JAX and PyTorch when they are importable.

Optional libraries are imported only when their peers are asked for (`prepare`), so a numpy + flowjit
run does not pay their import time; a library that is not installed leaves its peers out of the run
(the report says so). JAX and torch run on the CPU, like flowjit's default target.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import time

import numpy as np
from harness import Peer

import flowjit as fj


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def prepare(names) -> None:
    """Import and configure the optional libraries among peers `names` (before any of them runs)."""
    if "jax" in names:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator probing: this is a CPU comparison
        importlib.import_module("jax")
    if "torch" in names or "torch.compile" in names:
        importlib.import_module("torch")
        # First-call times must include the real compile, not a hit in inductor's on-disk caches.
        inductor = importlib.import_module("torch._inductor.config")
        inductor.fx_graph_cache = False
        functorch = importlib.import_module("torch._functorch.config")
        if hasattr(functorch, "enable_autograd_cache"):
            functorch.enable_autograd_cache = False


# Thread counts, and OpenMP spin-waiting: threads that spin after a parallel region steal the shared
# cores from whichever peer runs next in the round-robin, so the wait policies are recorded too.
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "XLA_FLAGS",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
)
PEER_NAMES = ("numpy", "flowjit", "jax", "torch", "torch.compile")


def available() -> list[str]:
    """The peers whose library is importable here, in report order."""
    have = {"numpy": True, "flowjit": True, "jax": _installed("jax"), "torch": _installed("torch")}
    have["torch.compile"] = have["torch"]
    return [name for name in PEER_NAMES if have[name]]


def versions() -> dict[str, str]:
    """Library versions for the machine block."""
    out = {"numpy": np.__version__, "flowjit": fj.__version__}
    for dist in ("jax", "jaxlib", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "(not installed)"
    return out


def thread_settings() -> dict[str, str]:
    """Thread counts each library will use, and the environment variables that set them."""
    out = {"os.cpu_count()": str(os.cpu_count()), "sched_getaffinity": str(len(os.sched_getaffinity(0)))}
    for var in THREAD_VARS:
        out[var] = os.environ.get(var, "(unset)")
    if "torch" in sys.modules:
        out["torch.get_num_threads()"] = str(sys.modules["torch"].get_num_threads())
    return out


def make_peer(name: str, workload) -> Peer:
    """The Peer for library `name` running `workload`."""
    if name == "numpy":
        return Peer("numpy", make=lambda: workload.numpy)
    if name == "flowjit":
        return Peer("flowjit", make=workload.flowjit)
    if name == "jax":
        import jax
        import jax.numpy as jnp

        return Peer("jax", make=workload.jax, to_native=jnp.asarray, block=jax.block_until_ready)
    if name in ("torch", "torch.compile"):
        import torch
    if name == "torch":
        return Peer("torch", make=workload.torch, to_native=torch.from_numpy, to_numpy=_torch_to_numpy)
    if name == "torch.compile":
        make = lambda: _fresh_torch_compile(workload)
        return Peer("torch.compile", make=make, to_native=torch.from_numpy, to_numpy=_torch_to_numpy)
    raise ValueError(f"unknown peer {name!r}; peers are {', '.join(PEER_NAMES)}")


def _fresh_torch_compile(workload):
    """torch.compile caches by code object, and workloads share code (matmul at two sizes): clear
    dynamo's caches so that the first call really compiles."""
    import torch

    torch._dynamo.reset()
    return workload.torch_compile()


def _torch_to_numpy(t) -> np.ndarray:
    return t.detach().numpy()


def warm_up(names) -> dict[str, float]:
    """Pay each library's one-time start-up (backend init, compiler imports) on a trivial function,
    so that no workload's first-call time includes it. Returns the seconds each took."""
    x = np.ones((4,), np.float32)
    jax, torch = sys.modules.get("jax"), sys.modules.get("torch")
    jobs = {
        "flowjit": lambda: fj.jit(lambda a: a * 2.0 + 1.0)(x),
        "jax": lambda: jax.block_until_ready(jax.jit(lambda a: a * 2.0 + 1.0)(jax.numpy.asarray(x))),
        "torch.compile": lambda: torch.compile(lambda a: a * 2.0 + 1.0)(torch.from_numpy(x)),
    }
    spent = {}
    for name in names:
        if name in jobs:
            start = time.perf_counter()
            jobs[name]()
            spent[name] = time.perf_counter() - start
    return spent
