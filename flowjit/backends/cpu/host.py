"""llvmlite initialized for this host, with the native libraries generated code calls loaded, and
the host CPU's description (what code is generated for): its features, vector width
(`vector_bits`), largest data cache (`last_level_cache_bytes`) and the cores generated code splits
work over (`cores`). The lowest module of the CPU backend that
touches llvmlite: the toolchain and the x86-specific rewrites build on it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from dataclasses import dataclass

from flowjit.errors import CompileError


def openmp_library() -> str:
    """Path of `libiomp5.so` shipped by the intel-openmp wheel in this environment."""
    for root in (sys.prefix, os.path.dirname(os.path.dirname(sys.executable))):
        path = os.path.join(root, "lib", "libiomp5.so")
        if os.path.exists(path):
            return path
    raise CompileError("libiomp5.so not found: the intel-openmp package is missing from this environment")


@functools.cache
def llvm():
    """llvmlite.binding, initialized once, with the OpenMP runtime loaded into the process."""
    import llvmlite.binding as binding

    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    # Idle OpenMP workers spin for KMP_BLOCKTIME before sleeping (default 200 ms). Kernels of one
    # call follow each other within microseconds, so 1 ms keeps the team hot inside a call, while
    # between calls the workers stop taking a core from the Python thread and other processes.
    os.environ.setdefault("KMP_BLOCKTIME", "1")
    binding.load_library_permanently(openmp_library())
    # libm: math without a vector implementation (erf, atan2 in f64) calls it. The soname first:
    # `find_library` runs a subprocess, a noticeable part of a warm start.
    try:
        binding.load_library_permanently("libm.so.6")
    except RuntimeError:
        binding.load_library_permanently(ctypes.util.find_library("m"))
    # libgcc_s: the helpers LLVM's code generation calls for conversions the CPU has no instruction
    # for (`__truncdfhf2`, double -> half, on a CPU without AVX512-FP16: a Zen 4). Without it such
    # code stops with `check_objects`'s error rather than crash on the call.
    try:
        binding.load_library_permanently("libgcc_s.so.1")
    except RuntimeError:
        found = ctypes.util.find_library("gcc_s")
        if found:
            binding.load_library_permanently(found)
    keep_kernel_temporaries()
    return binding


def keep_kernel_temporaries() -> None:
    """Let glibc's malloc keep blocks up to 32 MiB in its heap instead of mmap-ing them per call.

    Kernels allocate temporaries (packed matmul panels, im2col columns) with malloc. By default
    glibc maps big blocks fresh and unmaps them on free, so every call page-faults them in again,
    which can be most of a conv layer's time. Blocks stay in the process for reuse, as PyTorch's
    caching allocator keeps them.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its defaults stand
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 512 << 20)


@dataclass(frozen=True)
class HostCPU:
    """The CPU code is generated for; part of every cache key."""

    triple: str
    name: str
    features: str


@functools.cache
def host_cpu() -> HostCPU:
    """This machine's triple, CPU name and features (what code is generated for)."""
    binding = llvm()
    return HostCPU(binding.get_process_triple(), binding.get_host_cpu_name(), binding.get_host_cpu_features().flatten())


@functools.cache
def vector_bits() -> int:
    """Width of the host's vector registers (512 with AVX-512, 256 with AVX or AVX2, else 128)."""
    features = host_cpu().features
    if "+avx512f" in features:
        return 512
    return 256 if "+avx2" in features or "+avx" in features else 128


@functools.cache
def last_level_cache_bytes() -> int:
    """The host's largest data cache (sysfs), 32 MiB when it cannot be read."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        indices = [name for name in os.listdir(root) if name.startswith("index")]
    except OSError:
        indices = []
    for index in indices:
        try:
            with open(os.path.join(root, index, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


def cores() -> int:
    """Cores the generated code splits work over (one OpenMP thread each)."""
    return os.cpu_count() or 1
