"""Loading native code never aborts the process, wherever the loader places it.

MCJIT's RuntimeDyld maps an object's code, read-only data and writable data (and the GOT it makes
for external calls) with separate mmaps, each wherever the kernel finds room. In a process whose
address space other native libraries fragment (JAX's XLA: threads, arenas, reservations), the
precompiled matmul library's code can land more than 2 GiB from its data: its 32-bit pc-relative
references (small code model) overflow, and RuntimeDyld's assertion aborts the process. So object
code is linked by JITLink (`toolchain.load_objects`: one allocation per object, stubs inside
it, an error where a reference cannot reach), and MCJIT's own compiles use the large code model
(`toolchain.JIT_CODE_MODEL`).

The first test's child makes that placement certain instead of likely: after the foreign library
(JAX when importable, else a shared object built here with a large .bss), it fills every gap of the
mmap area and reserves 4 GiB with a 64 KiB hole above it. The kernel places a mapping in the highest
gap that fits, so a small mapping (a section of data) goes into the hole and a large one (a
library's code, hundreds of KiB) below the 4 GiB; the child checks that with two probe mappings.
Then fresh compiles, cached loads and the matmul and row libraries must load and run correctly. On
the RuntimeDyld loader both tests' children aborted (status -6).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from flowjit.backends import cache_folder
from flowjit.backends.cpu import host, matmul_library, row_library

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not host.host_cpu().triple.startswith("x86_64"),
    reason="the placement trap reads /proc/self/maps; the out-of-reach reference is x86-64 code",
)

_CHILD = textwrap.dedent(
    """
    import ctypes, json, mmap, sys
    import numpy as np

    foreign = sys.argv[1]
    if foreign == "jax":
        import jax, jax.numpy as jnp

        a = jnp.ones((512, 512), jnp.float32)
        jax.jit(lambda a: jnp.tanh(a @ a).sum())(a).block_until_ready()
    elif foreign != "none":
        ctypes.CDLL(foreign).flowjit_test_big(3)

    import flowjit as fj
    from flowjit.backends.cpu import matmul_library, row_library, toolchain

    # Everything that maps small regions once per process happens before the trap: the toolchain,
    # the MLIR context, the call trampoline of three arrays, the libraries' files read.
    fj.jit(lambda a, b: a + b)(np.ones(4, np.float32), np.ones(4, np.float32))
    for lib in (matmul_library.LIBRARY, row_library.LIBRARY):
        lib.object_code()

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    MAP_NORESERVE, MAP_FIXED_NOREPLACE = 0x4000, 0x100000
    HOLE, FAR = 64 << 10, 4 << 30


    def mappings():
        found = []
        for line in open("/proc/self/maps"):
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            found.append((lo, hi, fields[5] if len(fields) > 5 else ""))
        return sorted(found)


    def reserve(size, at=None):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED_NOREPLACE if at else 0)
        address = libc.mmap(at, size, 0, flags, -1, 0)  # PROT_NONE
        if address is None or address == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap")
        if at is not None and address != at:  # a kernel without MAP_FIXED_NOREPLACE took it as a hint
            libc.munmap(address, size)
            raise OSError("not placed")
        return address


    def fill_gaps():
        # Every gap of the mmap area (above the largest gap: the one between the heap and the
        # libraries), not the stack's guard gap just below [stack].
        maps = mappings()
        stack = next(i for i, m in enumerate(maps) if m[2] == "[stack]")
        gaps = [(maps[i][1], maps[i + 1][0]) for i in range(stack - 1) if maps[i + 1][0] > maps[i][1]]
        floor = max(gaps, key=lambda gap: gap[1] - gap[0])
        for lo, hi in gaps:
            if lo >= floor[1]:
                try:
                    reserve(hi - lo, lo)
                except OSError:
                    pass


    fill_gaps()
    reserved = reserve(FAR + HOLE)
    fill_gaps()  # the room the kernel's alignment of the large reservation left above it
    libc.munmap(reserved + FAR, HOLE)
    # What a loader mapping each section apart gets now: a page of data, and code of the matmul
    # library's size.
    data, code = reserve(4 << 10), reserve(320 << 10)
    apart = abs(data - code)
    libc.munmap(data, 4 << 10)
    libc.munmap(code, 320 << 10)

    entry_loads = []
    load_objects = toolchain.load_objects


    def spying(objects, name, resolve=None):
        if not name.endswith("_library"):
            entry_loads.append(name)
        return load_objects(objects, name, resolve)


    toolchain.load_objects = spying
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 784)).astype(np.float32)
    w = rng.standard_normal((784, 128)).astype(np.float32) * 0.05
    wrong = []
    for i in range(3):
        scale = np.float32(i + 1)
        logits = x.astype(np.float64) @ (w * scale)
        expected = np.exp(logits - logits.max(1, keepdims=True))
        expected /= expected.sum(1, keepdims=True)
        for copy in range(2):  # a fresh compile, then a fresh function loading its cache entry
            out = fj.jit(lambda x, w: fj.nn.softmax(x @ (w * scale)))(x, w)  # calls both libraries
            if not np.allclose(out, expected, rtol=1e-4, atol=1e-6):
                wrong.append((i, copy))
    loaded = [lib.name for lib in (matmul_library.LIBRARY, row_library.LIBRARY) if lib.loaded]
    print(json.dumps({"apart": apart, "loaded": loaded, "wrong": wrong, "entry_loads": len(entry_loads)}))
    """
)

_BIG_LIBRARY = """
char flowjit_test_big_data[1 << 30]; /* 1 GiB of .bss: address space, no memory */
int flowjit_test_big(int x) { return x + flowjit_test_big_data[x]; }
"""


def _foreign_library(folder) -> str:
    """JAX when importable (the process the abort was seen in), else a shared object with a large
    .bss built by the C compiler, else none: the trap alone makes the placement."""
    try:
        import jax  # noqa: F401

        return "jax"
    except ImportError:
        pass
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "none"
    source, shared = folder / "big.c", folder / "libbig.so"
    source.write_text(_BIG_LIBRARY)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(shared), str(source)], check=True, timeout=60)
    return str(shared)


def _cache_with_libraries(folder):
    """A cache folder of its own (no entry of another test's functions) holding the matmul and row
    libraries of this process (built once per test session), so that the child only loads them."""
    folder.mkdir(mode=0o700)
    (folder / "library").mkdir(mode=0o700)
    for lib in (matmul_library.LIBRARY, row_library.LIBRARY):
        path = folder / "library" / os.path.basename(lib.path())
        path.write_bytes(cache_folder.sealed(lib.object_code()))
        path.chmod(0o600)
    return folder


def test_far_apart_sections_load_and_run(tmp_path):
    """Fresh compiles, cached loads and the matmul and row libraries, loaded with each library's
    code more than 2 GiB from its data after a large foreign library: no abort, correct results."""
    folder = _cache_with_libraries(tmp_path / "cache")
    env = {
        **os.environ,
        "FLOWJIT_CACHE": "1",
        "FLOWJIT_CACHE_DIR": str(folder),
        "FLOWJIT_MATMUL_LIBRARY": "1",
        "FLOWJIT_ROW_LIBRARY": "1",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=16",  # XLA's threads as on a 16-core host
    }
    foreign = _foreign_library(tmp_path)
    run = subprocess.run([sys.executable, "-c", _CHILD, foreign], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (
        f"the child died (status {run.returncode}) after loading {foreign}:\n{run.stderr[-3000:]}"
    )
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["wrong"] == []
    assert report["loaded"] == ["matmul", "row"]
    assert report["apart"] > 2 << 30, f"the trap would not have placed sections far apart: {report}"
    assert report["entry_loads"] == 3  # each of the three functions loaded once from the compile cache


_FAR_REFERENCE = textwrap.dedent(
    """
    import ctypes
    from flowjit.backends.cpu import host, toolchain
    from flowjit.errors import CompileError

    binding = host.llvm()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    far = libc.malloc(64)  # in the heap after the executable, terabytes from the mmap area
    ctypes.c_int64.from_address(far).value = 42
    binding.add_symbol("flowjit_test_far_value", far)
    module = binding.parse_assembly(
        "@flowjit_test_far_value = external dso_local global i64\\n"
        "define i64 @read_far() {\\n  %v = load i64, ptr @flowjit_test_far_value\\n  ret i64 %v\\n}\\n"
    )
    module.triple = host.host_cpu().triple
    code = toolchain.target_machine(reloc="static").emit_object(module)  # small code model
    print("apart", abs(far - ctypes.cast(libc.malloc, ctypes.c_void_p).value))
    try:
        toolchain.load_objects((code,), "read_far")
        print("loaded")
    except CompileError as e:
        print("refused:", e)
    """
)


def test_a_reference_out_of_reach_is_an_error_not_an_abort():
    """An object whose 32-bit pc-relative reference to a process symbol cannot reach it (the small
    code model's direct reference to data terabytes away) is refused with an error; the process
    goes on (RuntimeDyld's assertion aborted it)."""
    run = subprocess.run(
        [sys.executable, "-c", _FAR_REFERENCE], env=os.environ, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, f"the child died (status {run.returncode}):\n{run.stderr[-3000:]}"
    apart, outcome = run.stdout.strip().splitlines()
    assert int(apart.split()[1]) > 2 << 30, apart
    assert outcome.startswith("refused: internal error: linking the object code of 'read_far' failed"), outcome
    assert "out of range" in run.stderr, run.stderr  # JITLink's reason
