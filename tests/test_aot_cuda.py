"""`flowjit compile --target cuda`: C libraries that embed the kernels and replay the launch plan
through the CUDA driver, checked without a GPU.

- the libraries build with the system C compiler (`-Wall -Wextra -Werror`), their headers and
  manifests describe them, the PTX (and cubins, where ptxas is found) is in them;
- from C and from ctypes with no driver installed: the clear FLOWJIT_ERROR_NO_GPU status and message;
- against the fake driver (tests/fake_cuda, found through FLOWJIT_LIBCUDA): the driver calls a C
  program's calls make (module loads, one device block, copies, every launch with its grid, block
  and parameters, the bounded wait, the release); through ctypes, with the fake driver handing
  each launch to the CPU emulation of its kernel (tests/gpu_emulator.py), the real results against
  the CPU backend's; driver failures, a missing device and a timeout as status codes and messages.

Nothing here has met a real driver or GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flowjit.backends.gpu import cubin
from flowjit.backends.gpu.plan import LaunchPlan, MemrefArg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOWJIT = os.path.join(os.path.dirname(sys.executable), "flowjit")

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a system C compiler (cc)")

MODEL = """\
import numpy as np

import flowjit as fj
import flowjit.numpy as fnp


def chain(x, y):
    return fnp.tanh(x * y + 1.0) * fnp.exp(-x) + fnp.log(y * y + 1.0)


def whole_sum(x):
    return fnp.sum(x)


def softmax(x):
    m = fnp.max(x, axis=1, keepdims=True)
    e = fnp.exp(x - m)
    return e / fnp.sum(e, axis=1, keepdims=True)


def column_sum(x):
    return fnp.sum(x, axis=0)


def several(x, y):
    return x * y + 1.0, fnp.sum(y), x > y


def half(x):
    return fnp.exp(x) * x


def identity(x):
    return x


def twice(x):
    return x * 2.0


def product(x, w):
    return x @ w


def halvings(x):
    return fj.while_loop(lambda y: fnp.sum(y) > 1.0, lambda y: y * 0.5, x)


W = fj.Variable(np.ones((4, 3), np.float32), name="w")


def update(x):
    W.assign(W.value * 0.5 + x)
    return fnp.sum(W.value * x)
"""

# name -> (function, its --arg specs, the library's name); two column sums: a temporary with the
# loop unrolled (10 rows) and kept (300 rows: one loop step of 300 launches).
PROGRAMS = {
    "chain": ("chain", ["f32[33,100]", "f32[33,100]"]),
    "whole_sum": ("whole_sum", ["f32[4096]"]),
    "softmax": ("softmax", ["f32[33,100]"]),
    "sum_unrolled": ("column_sum", ["f32[10,5,7]"]),
    "sum_looped": ("column_sum", ["f32[300,5,7]"]),
    "several": ("several", ["f32[33,100]", "f32[33,100]"]),
    "half": ("half", ["f16[33,100]"]),
    "identity": ("identity", ["f32[5,3]"]),
    "update": ("update", ["f32[4,3]"]),  # a Variable: an extra input and output
}
WERROR = "cc -Wall -Wextra -Werror"


# "sum_looped" is compiled with the reductions lowered the simple way (`gpu_emulator.host_loops`):
# its 300 rows are a host loop of 300 launches, which the library writes as a C loop.
_HOST_LOOPS = (
    f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import gpu_emulator; "
    "loops = gpu_emulator.host_loops(); loops.__enter__(); from flowjit.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _compile(root, name, target="cuda", *extra, out=None):
    function, specs = PROGRAMS[name]
    command = [sys.executable, "-c", _HOST_LOOPS] if name == "sum_looped" else [FLOWJIT]
    argv = [*command, "compile", f"{root}/model.py:{function}", "--name", name, "--target", target, *extra]
    for spec in specs:
        argv += ["--arg", spec]
    argv += ["-o", str(out or root / "out")]
    env = {**os.environ, "CC": WERROR} | ({"FLOWJIT_CACHE": "0"} if name == "sum_looped" else {})  # not the cached plan
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every program's library, for sm_80 (the fake driver's device is sm_90: its PTX is loaded)."""
    root = tmp_path_factory.mktemp("aot_cuda")
    (root / "model.py").write_text(MODEL)
    for name in PROGRAMS:
        _compile(root, name)
    return root


@pytest.fixture(scope="module")
def fake_driver(fake_libcuda):
    return fake_libcuda / "libcuda.so.1"


def _manifest(built, name):
    return json.loads((built / "out" / f"{name}.json").read_text())


def _inputs(manifest, seed=0):
    """Deterministic arguments of the library's input types (positive, so logs are defined)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for port in manifest["inputs"]:
        dtype = {"f32": np.float32, "f16": np.float16}[port["dtype"]]
        arrays.append((rng.standard_normal(port["shape"]) + 0.5).astype(dtype))
    return arrays


# --- the library: build, header, manifest, embedded kernels ---------------------------------------


def test_header_declares_the_c_interface(built):
    header = (built / "out" / "chain.h").read_text()
    assert "int chain(const float* x, const float* y, float* out);" in header
    for declaration in (
        "int chain_set_device(int ordinal);",
        "int chain_release(void);",
        "const char* chain_last_error(void);",
        "const char* chain_status_string(int status);",
        '#define CHAIN_CUDA_CHIP "sm_80"',
        "#define CHAIN_X_DIM1 100",
        "#define CHAIN_OUT_SIZE 3300",
        "FLOWJIT_ERROR_NO_GPU = 5",
        "FLOWJIT_ERROR_TIMEOUT = 7",
    ):
        assert declaration in header
    several = (built / "out" / "several.h").read_text()
    assert "int several(const float* x, const float* y, float* out_0, float* out_1, uint8_t* out_2);" in several
    assert "int half(const uint16_t* x, uint16_t* out);" in (built / "out" / "half.h").read_text()


def test_manifest_describes_the_kernels_and_the_plan(built):
    manifest = _manifest(built, "sum_looped")
    assert manifest["entry_points"] == [
        "sum_looped", "sum_looped_set_device", "sum_looped_release", "sum_looped_last_error",
        "sum_looped_status_string",
    ]  # fmt: skip
    assert manifest["target"]["kind"] == "cuda" and manifest["target"]["chip"] == "sm_80"
    assert manifest["target"]["cubin"] == ("sm_80" if cubin.find_ptxas() else None)
    plan = LaunchPlan.from_json(manifest["launch_plan"])
    assert manifest["launches"] == plan.launch_count() == 302
    assert [k["module"] for k in manifest["kernels"]] == plan.kernels()
    assert [b["kind"] for b in manifest["device_buffers"]][:3] == ["input", "output", "workspace"]
    offsets = [b["offset"] for b in manifest["device_buffers"]]
    assert all(o % 256 == 0 for o in offsets) and offsets == sorted(offsets)
    assert manifest["device_bytes"] >= offsets[-1] + manifest["device_buffers"][-1]["bytes"]
    assert manifest["runtime_libraries"] == ["libc", "libdl", "libpthread"]


def test_the_library_embeds_the_ptx_and_cubins_and_needs_no_cuda_library(built):
    import flowjit as fj

    sys.path.insert(0, str(built))
    try:
        import model
    finally:
        sys.path.remove(str(built))
    # a program of several kernels (softmax is one row kernel)
    x = np.ones((33, 100), np.float32)
    lowered = fj.jit(model.several, target="cuda").lower(x, x)
    lowered.compile()
    library = (built / "out" / "several.so").read_bytes()
    manifest = _manifest(built, "several")
    kernels = {k.name: k for k in lowered._executable.kernels}
    assert len(manifest["kernels"]) >= 2
    for described in manifest["kernels"]:
        kernel = kernels[described["module"]]
        assert kernel.ptx.encode() + b"\0" in library
        assert described["ptx_bytes"] == len(kernel.ptx.encode())
        if cubin.find_ptxas() is not None:
            assert kernel.cubin and kernel.cubin in library and described["cubin_bytes"] == len(kernel.cubin)
    if shutil.which("readelf") and shutil.which("nm"):
        path = str(built / "out" / "several.so")
        dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, timeout=60).stdout
        assert "libcuda" not in dynamic
        exported = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, timeout=60)
        names = {line.split()[-1] for line in exported.stdout.splitlines() if " T " in line}
        assert names == set(manifest["entry_points"])
        undefined = subprocess.run(["nm", "-u", "-D", path], capture_output=True, text=True, timeout=60).stdout
        called = {line.split()[-1].split("@")[0] for line in undefined.splitlines()}
        glibc_internal = {"__stack_chk_fail", "__cxa_finalize", "_ITM_deregisterTMCloneTable",
                          "_ITM_registerTMCloneTable", "__gmon_start__", "__tls_get_addr", "__memcpy_chk",
                          "__vsnprintf_chk", "__snprintf_chk"}  # fmt: skip
        assert called - glibc_internal <= set(manifest["external_symbols"]), called


# --- from C ---------------------------------------------------------------------------------------


def _c_program(manifest) -> str:
    """A C program calling the library twice on patterned inputs, printing each status and
    message, then releasing it; argv[1] = 'null' passes a NULL input, 'device N' picks device N."""
    name = manifest["name"]
    prefix = name.upper()
    declarations, arguments = [], []
    for role, ports in (("in", manifest["inputs"]), ("out", manifest["outputs"])):
        for port in ports:
            size = f"{prefix}_{port['name'].upper()}_SIZE"
            declarations.append(f"static {port['c_type']} {port['name']}[{size}];")
            arguments.append(port["name"])
            if role == "in":
                fill = f"({port['c_type']})(i % 7 + 1)" if port["c_type"] == "float" else "(uint16_t)(0x3c00)"
                declarations.append(f"static void fill_{port['name']}(void) {{")
                declarations.append(f"  for (int i = 0; i < {size}; i++) {port['name']}[i] = {fill};")
                declarations.append("}")
    fills = "\n  ".join(f"fill_{p['name']}();" for p in manifest["inputs"])
    first = manifest["inputs"][0]["name"]
    null_call = ", ".join("NULL" if a == first else a for a in arguments)
    return f"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "{name}.h"
{chr(10).join(declarations)}

int main(int argc, char** argv) {{
  {fills}
  if (argc > 1 && strcmp(argv[1], "null") == 0) {{
    int status = {name}({null_call});
    printf("status %d: %s\\n", status, {name}_last_error());
    return 0;
  }}
  if (argc > 2 && strcmp(argv[1], "device") == 0) {{
    int status = {name}_set_device(atoi(argv[2]));
    printf("set_device %d: %s\\n", status, {name}_last_error());
  }}
  for (int call = 0; call < 2; call++) {{
    int status = {name}({", ".join(arguments)});
    printf("status %d: %s\\n", status, {name}_last_error());
  }}
  printf("meaning: %s\\n", {name}_status_string(FLOWJIT_ERROR_NO_GPU));
  int released = {name}_release();
  printf("release %d: %s\\n", released, {name}_last_error());
  return 0;
}}
"""


def _build_c(built, name, static=False) -> str:
    """The C program of library `name` (in built/out, or built/static for the static library)."""
    out = built / ("static" if static else "out")
    source = built / f"main_{name}.c"
    source.write_text(_c_program(json.loads((out / f"{name}.json").read_text())))
    binary = str(built / f"main_{name}{'_static' if static else ''}")
    if static:
        library = [str(out / f"{name}.a"), "-ldl", "-pthread"]
    else:
        library = [str(out / f"{name}.so"), f"-Wl,-rpath,{out}"]
    argv = [*WERROR.split(), "-std=c11", "-I", str(out), str(source), *library, "-o", binary]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return binary


def _run_c(binary, *args, **env):
    environment = {k: v for k, v in os.environ.items() if k not in ("FLOWJIT_LIBCUDA", "FAKE_CUDA_LOG")}
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, env={**environment, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def _without_driver(tmp_path) -> tuple[str, dict]:
    """The driver the library will not find, and the environment for that: this machine's own
    libcuda.so.1 where it has none, else a missing file named by FLOWJIT_LIBCUDA."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "libcuda.so.1", {}
    missing = str(tmp_path / "libcuda.so.1")
    return missing, {"FLOWJIT_LIBCUDA": missing}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_from_c_without_a_driver_every_call_says_so(built, tmp_path, name):
    driver, env = _without_driver(tmp_path)
    lines = _run_c(_build_c(built, name), **env)
    message = (
        f"status 5: {name}: cannot load the CUDA driver {driver}: {driver}: cannot open shared object "
        "file: No such file or directory. The library runs where an NVIDIA driver is installed; "
        "FLOWJIT_LIBCUDA may name the driver library's path"
    )
    assert lines[:2] == [message, message]
    assert lines[2].startswith("meaning: the CUDA driver cannot be loaded or shows no usable device")
    assert lines[3] == "release 0: "  # nothing was loaded


def test_from_c_arguments_and_settings_are_checked_before_the_driver(built):
    binary = _build_c(built, "chain")
    assert _run_c(binary, "null") == ["status 1: chain: input x is NULL"]
    lines = _run_c(binary, "device", "-1")
    assert lines[0] == "set_device 8: chain: device -1: expected a device number >= 0"
    lines = _run_c(binary, FLOWJIT_GPU_TIMEOUT_S="soon")
    expected = "status 8: chain: FLOWJIT_GPU_TIMEOUT_S must be a positive number of seconds; found 'soon'"
    assert lines[:2] == [expected, expected]


def test_a_static_library_links_and_says_the_same(built, tmp_path):
    _compile(built, "whole_sum", "cuda", "--static-lib", out=built / "static")
    assert (built / "static" / "whole_sum.a").exists() and not (built / "static" / "whole_sum.so").exists()
    driver, env = _without_driver(tmp_path)
    lines = _run_c(_build_c(built, "whole_sum", static=True), **env)
    assert lines[0].startswith(f"status 5: whole_sum: cannot load the CUDA driver {driver}: ")


def _calls(log) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()]


def _expected_launches(manifest, arena: int) -> list[list[str]]:
    """Every launch of the manifest's plan as the fake driver logs it, for device block `arena`."""
    plan = LaunchPlan.from_json(manifest["launch_plan"])
    address = [arena + b["offset"] for b in manifest["device_buffers"]]
    expected = []
    for launch, loops in plan.launches():
        params = []
        for arg in launch.args:
            if isinstance(arg, MemrefArg):
                base = address[arg.buffer]
                params += [base, base, arg.offset.at(loops), *arg.sizes, *arg.strides]
            else:
                params.append(arg.value.at(loops))
        expected.append([launch.function, *map(str, (*launch.grid, *launch.block, launch.shared_bytes, *params))])
    return expected


@pytest.mark.parametrize("name", ["chain", "whole_sum", "softmax", "sum_unrolled", "sum_looped", "several"])
def test_from_c_on_the_fake_driver_the_calls_follow_the_plan(built, fake_driver, tmp_path, name):
    log = tmp_path / "driver.log"
    lines = _run_c(_build_c(built, name), FLOWJIT_LIBCUDA=str(fake_driver), FAKE_CUDA_LOG=str(log))
    assert lines[0] == lines[1] == "status 0: " and lines[3] == "release 0: "
    manifest = _manifest(built, name)
    calls = _calls(log)
    names = [c[0] for c in calls]
    n_modules = len(manifest["kernels"])

    # loaded once: the driver, the context, each module's PTX (the device is sm_90, the cubins sm_80)
    assert names[:3] == ["cuInit", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2"]
    loads = [c for c in calls if c[0] == "cuModuleLoadDataEx"]
    assert [c[1] for c in loads] == ["ptx"] * n_modules
    assert [c[1] for c in calls if c[0] == "cuModuleGetFunction"] == [k["function"] for k in manifest["kernels"]]
    (alloc,) = [c for c in calls if c[0] == "cuMemAlloc"]
    assert int(alloc[1]) == manifest["device_bytes"]
    arena = int(alloc[2])
    assert [c[1] for c in calls if c[0] == "cuMemHostAlloc"] == [str(manifest["pinned_bytes"])]

    # each call: every input to its buffer with its bytes, every launch, every output back, one wait
    address = {(b["kind"], b["index"]): arena + b["offset"] for b in manifest["device_buffers"]}
    copies_in = [c[1:3] for c in calls if c[0] == "cuMemcpyHtoDAsync"]
    one_call_in = [[str(address["input", i]), str(p["bytes"])] for i, p in enumerate(manifest["inputs"])]
    assert copies_in == one_call_in * 2
    launches = [c[1:] for c in calls if c[0] == "cuLaunchKernel"]
    assert launches == _expected_launches(manifest, arena) * 2
    copies_out = [c[1:] for c in calls if c[0] == "cuMemcpyDtoHAsync"]
    one_call_out = [[str(address["output", j]), str(p["bytes"])] for j, p in enumerate(manifest["outputs"])]
    assert copies_out == one_call_out * 2
    assert names.count("cuEventRecord") == 2 and names.count("cuInit") == 1

    # the work of a call happens with the library's context pushed, and the release gives all back
    first_launch, last_record = names.index("cuLaunchKernel"), len(names) - 1 - names[::-1].index("cuEventRecord")
    pushes = [i for i, n in enumerate(names) if n == "cuCtxPushCurrent_v2"]
    pops = [i for i, n in enumerate(names) if n == "cuCtxPopCurrent_v2"]
    assert len(pushes) == len(pops) == 4  # load, two calls, release
    assert pushes[1] < first_launch and pops[-2] > last_record
    assert names.count("cuModuleUnload") == n_modules
    assert [c[1] for c in calls if c[0] == "cuMemFree"] == [str(arena)]
    assert names.count("cuMemFreeHost") == 1 and names.count("cuStreamDestroy") == 1
    assert names[-1] == "cuDevicePrimaryCtxRelease"


THREADS_C = r"""
#include <pthread.h>
#include <stdio.h>
#include "whole_sum.h"
#define THREADS 4
#define CALLS 5
static int failures;

static void* worker(void* unused) {
  (void)unused;
  static float x[WHOLE_SUM_X_SIZE];
  float out[WHOLE_SUM_OUT_SIZE];
  for (int i = 0; i < CALLS; i++) {
    if (whole_sum(x, out) != FLOWJIT_OK) __sync_fetch_and_add(&failures, 1);
  }
  return NULL;
}

int main(void) {
  pthread_t threads[THREADS];
  for (int t = 0; t < THREADS; t++) pthread_create(&threads[t], NULL, worker, NULL);
  for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
  printf("failures %d\n", failures);
  return 0;
}
"""


def test_from_c_concurrent_calls_load_once_and_run_one_at_a_time(built, fake_driver, tmp_path):
    source = tmp_path / "threads.c"
    source.write_text(THREADS_C)
    out = built / "out"
    binary = str(tmp_path / "threads")
    argv = [*WERROR.split(), "-std=c11", "-pthread", "-I", str(out), str(source), str(out / "whole_sum.so"),
            f"-Wl,-rpath,{out}", "-o", binary]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    log = tmp_path / "driver.log"
    assert _run_c(binary, FLOWJIT_LIBCUDA=str(fake_driver), FAKE_CUDA_LOG=str(log)) == ["failures 0"]
    names = [c[0] for c in _calls(log)]
    kernels = len(_manifest(built, "whole_sum")["kernels"])
    assert names.count("cuInit") == 1 and names.count("cuModuleLoadDataEx") == kernels
    assert names.count("cuMemAlloc") == 1 and names.count("cuEventRecord") == 20
    # each call's copy in, launches, copy out and wait come together, never interleaved with another's
    launches = _manifest(built, "whole_sum")["launches"]
    per_call = ["cuCtxPushCurrent_v2", "cuMemcpyHtoDAsync", *["cuLaunchKernel"] * launches, "cuMemcpyDtoHAsync",
                "cuEventRecord", "cuCtxPopCurrent_v2"]  # fmt: skip
    calls = names[names.index("cuMemHostAlloc") + 2 :]  # after the load's own push and pop
    assert calls == per_call * 20


def test_from_c_a_device_the_driver_does_not_show(built, fake_driver, tmp_path):
    lines = _run_c(_build_c(built, "chain"), "device", "3", FLOWJIT_LIBCUDA=str(fake_driver))
    assert lines[0] == "set_device 0: "
    assert lines[1] == "status 5: chain: no CUDA device 3: the driver shows 1 device(s)"


@pytest.mark.skipif(cubin.find_ptxas() is None, reason="ptxas not found: no cubins are made")
def test_cubins_are_loaded_where_they_fit(built, fake_driver, tmp_path):
    _compile(built, "sum_unrolled", "cuda-sm_90", out=built / "sm_90")
    manifest = json.loads((built / "sm_90" / "sum_unrolled.json").read_text())
    assert manifest["target"] == {"kind": "cuda", "chip": "sm_90", "cubin": "sm_90",
                                  "ptxas": manifest["target"]["ptxas"]}  # fmt: skip
    log = tmp_path / "driver.log"
    code = f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({str(built / "sm_90" / "sum_unrolled.so")!r})
        lib.sum_unrolled.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.sum_unrolled_last_error.restype = ctypes.c_char_p
        x, out = np.ones((10, 5, 7), np.float32), np.zeros((5, 7), np.float32)
        print(lib.sum_unrolled(x.ctypes.data, out.ctypes.data), lib.sum_unrolled_last_error().decode())
    """
    done = _python(code, FLOWJIT_LIBCUDA=str(fake_driver), FAKE_CUDA_LOG=str(log))
    assert done.stdout.strip() == "0"
    loads = [c[1] for c in _calls(log) if c[0] == "cuModuleLoadDataEx"]
    assert loads == ["cubin"] * len(manifest["kernels"])


# --- through ctypes, with the fake driver running the launches on the CPU ---------------------------


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("FLOWJIT_LIBCUDA", "FAKE_CUDA_LOG")}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**environment, "PYTHONPATH": ROOT, **env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


_EMULATED = """
    import contextlib, ctypes, json, sys, numpy as np, flowjit as fj
    from flowjit import aot
    from flowjit.backends.gpu.backend import BACKENDS, compile_entry
    sys.path[:0] = ["tests", {root!r}]
    import gpu_emulator, model

    fake = ctypes.CDLL({driver!r})  # the same file the libraries dlopen: one copy, one hook
    programs = {programs!r}
    entries, cases = [], []
    for name, (function, manifest) in programs.items():
        rng = np.random.default_rng(len(cases))
        args = [(rng.standard_normal(p["shape"]) + 0.5).astype({{"f32": np.float32, "f16": np.float16}}[p["dtype"]])
                for p in manifest["inputs"]]
        # compiled as `flowjit compile` compiles it: the same PTX, by which the hook finds the kernel
        traced_args = args[:1] if name == "update" else args  # update's last input is its variable
        lowered = fj.jit(getattr(model, function), target="cuda").lower(*traced_args)
        # "sum_looped" compiled the simple way, as _HOST_LOOPS compiles its library
        with gpu_emulator.host_loops() if name == "sum_looped" else contextlib.nullcontext():
            entries.append(compile_entry(aot.functional_graph(lowered, None)[0], BACKENDS["cuda"].options))
        cases.append((name, function, manifest, args))
    hook = gpu_emulator.run_launches_of(fake, entries)

    report = []
    for name, function, manifest, args in cases:
        lib = ctypes.CDLL({out!r} + "/" + name + ".so")
        entry = getattr(lib, name)
        entry.argtypes = [ctypes.c_void_p] * (len(manifest["inputs"]) + len(manifest["outputs"]))
        getattr(lib, name + "_last_error").restype = ctypes.c_char_p
        if name == "update":  # the variable w is the last input and output
            x, w = args
            expected = (np.sum((w * 0.5 + x) * x), w * 0.5 + x)
        else:
            expected = fj.jit(getattr(model, function), target="cpu")(*args)
            expected = expected if isinstance(expected, tuple) else (expected,)
        for _ in range(2):
            outs = [np.full(p["shape"], 7, np.dtype(e.dtype)) for p, e in zip(manifest["outputs"], expected)]
            status = entry(*[a.ctypes.data for a in args], *[o.ctypes.data for o in outs])
            errors = [float(np.max(np.abs(o.astype(np.float64) - e), initial=0))
                      / (1.0 + float(np.max(np.abs(e.astype(np.float64)), initial=0))) for o, e in zip(outs, expected)]
            report.append([name, status, getattr(lib, name + "_last_error")().decode(), errors])
        if name == "chain":  # the output is the first input's buffer: the inputs are staged first
            x = args[0].copy()
            status = entry(x.ctypes.data, args[1].ctypes.data, x.ctypes.data)
            report.append(["chain in place", status, "", [float(np.max(np.abs(x - expected[0])))]])
        if name == "update":  # the caller owns the variable: updated in place, twice
            x, w = args[0], args[1].copy()
            loss = np.zeros((), np.float32)
            statuses = [entry(x.ctypes.data, w.ctypes.data, loss.ctypes.data, w.ctypes.data) for _ in range(2)]
            twice = (args[1] * 0.5 + x) * 0.5 + x
            report.append(["update in place", max(statuses), "", [float(np.max(np.abs(w - twice)))]])
    print(json.dumps(report))
"""


def test_through_ctypes_the_libraries_compute_the_programs(built, fake_driver, tmp_path):
    """The C library end to end: inputs staged and copied in, the plan's launches (run on the CPU
    by the fake driver's hook, tests/gpu_emulator.py), outputs copied back; twice (the second
    call reuses the loaded modules and device memory)."""
    programs = {name: (function, _manifest(built, name)) for name, (function, _) in PROGRAMS.items()}
    code = _EMULATED.format(root=str(built), driver=str(fake_driver), programs=programs, out=str(built / "out"))
    done = _python(code, FLOWJIT_LIBCUDA=str(fake_driver), FLOWJIT_CACHE_DIR=str(tmp_path / "cache"))
    report = json.loads(done.stdout.strip().splitlines()[-1])
    names = [r[0] for r in report]
    assert names == ["chain", "chain", "chain in place"] + [n for n in list(PROGRAMS)[1:] for _ in range(2)] + [
        "update in place"
    ]
    for name, status, message, errors in report:
        assert status == 0 and message == "", (name, message)
        tolerance = 2e-3 if name == "half" else 1e-4
        assert all(e <= tolerance for e in errors), (name, errors)


def test_a_call_that_does_not_finish_times_out_and_later_calls_are_refused(built, fake_driver, tmp_path):
    code = f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({str(built / "out" / "sum_looped.so")!r})
        lib.sum_looped.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.sum_looped_last_error.restype = ctypes.c_char_p
        x, out = np.ones((300, 5, 7), np.float32), np.zeros((5, 7), np.float32)
        for _ in range(2):
            print(lib.sum_looped(x.ctypes.data, out.ctypes.data), lib.sum_looped_last_error().decode())
        print(lib.sum_looped_release(), lib.sum_looped_last_error().decode())
    """
    log = tmp_path / "driver.log"
    done = _python(
        code,
        FLOWJIT_LIBCUDA=str(fake_driver),
        FAKE_CUDA_LOG=str(log),
        FAKE_CUDA_EVENT_NEVER_READY="1",
        FLOWJIT_GPU_TIMEOUT_S="0.3",
    )
    first, second, released = done.stdout.strip().splitlines()
    assert first == (
        "7 sum_looped: the GPU did not finish within 0.3 s (FLOWJIT_GPU_TIMEOUT_S sets the limit); its work may "
        "still be running, so the library refuses later calls"
    )
    refused = "7 sum_looped: an earlier call failed, so the library cannot run again: the GPU did not finish"
    assert second.startswith(refused) and released.startswith(refused)
    names = [c[0] for c in _calls(log)]
    assert names.count("cuLaunchKernel") == 302 and "cuMemFree" not in names  # the GPU may still use it


def test_driver_failures_are_status_codes_with_the_call_and_the_error(built, fake_driver, tmp_path):
    code = f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({str(built / "out" / "whole_sum.so")!r})
        lib.whole_sum.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.whole_sum_last_error.restype = ctypes.c_char_p
        x, out = np.ones(4096, np.float32), np.zeros((), np.float32)
        for _ in range(2):
            print(lib.whole_sum(x.ctypes.data, out.ctypes.data), lib.whole_sum_last_error().decode())
    """
    log = tmp_path / "driver.log"
    done = _python(code, FLOWJIT_LIBCUDA=str(fake_driver), FAKE_CUDA_LOG=str(log), FAKE_CUDA_FAIL_MODULE_LOAD="1")
    module = _manifest(built, "whole_sum")["kernels"][0]["module"]
    message = (
        f"6 whole_sum: cuModuleLoadDataEx failed for kernel {module} (PTX): CUDA_ERROR_FAKE: an error of the fake "
        "driver"
    )
    assert done.stdout.strip().splitlines() == [message, message]  # not broken: the second call tries again
    calls = _calls(log)
    names = [c[0] for c in calls]
    # what the failed load made is given back each time: no stream, no memory, the context released
    assert names.count("cuDevicePrimaryCtxRetain") == names.count("cuDevicePrimaryCtxRelease") == 2
    assert "cuMemAlloc" not in names and "cuLaunchKernel" not in names

    done = _python(code, FLOWJIT_LIBCUDA=str(fake_driver), FAKE_CUDA_NO_DEVICE="1")
    assert done.stdout.strip().splitlines() == ["5 whole_sum: no CUDA device: the driver reports 0 devices"] * 2


def test_a_function_of_empty_arrays_launches_nothing(built, fake_driver, tmp_path):
    argv = [FLOWJIT, "compile", f"{built}/model.py:twice", "--arg", "f32[0]", "--target", "cuda"]
    done = subprocess.run([*argv, "-o", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CC": WERROR})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "twice.json").read_text())["launches"] == 0
    code = f"""
        import ctypes
        lib = ctypes.CDLL({str(tmp_path / "twice.so")!r})
        lib.twice.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.twice_last_error.restype = ctypes.c_char_p
        print(lib.twice(None, None), lib.twice_last_error().decode())
    """
    log = tmp_path / "driver.log"
    done = _python(code, FLOWJIT_LIBCUDA=str(fake_driver), FAKE_CUDA_LOG=str(log))
    assert done.stdout.strip() == "0"
    names = [c[0] for c in _calls(log)]
    assert "cuModuleLoadDataEx" not in names and "cuLaunchKernel" not in names and "cuMemcpyHtoDAsync" not in names
    assert names.count("cuEventRecord") == 1


# --- on a real GPU (skipped without one) -------------------------------------------------------------


def _no_real_gpu() -> str | None:
    """Why the real driver cannot run the libraries here (asked of libcuda.so.1 directly, not of
    the library under test), or None."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        return f"no CUDA driver: {error}"
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "no CUDA device"
    return None


NO_REAL_GPU = _no_real_gpu()


@pytest.mark.skipif(NO_REAL_GPU is not None, reason=f"needs a GPU: {NO_REAL_GPU}")
def test_on_a_real_gpu_the_libraries_compute_the_programs(built):
    """The check this file cannot make without a GPU: the real driver loads the PTX, takes the
    packed launches and gives the CPU backend's results."""
    import ctypes

    import flowjit as fj

    sys.path.insert(0, str(built))
    try:
        import model
    finally:
        sys.path.remove(str(built))
    for name, (function, _) in PROGRAMS.items():
        manifest = _manifest(built, name)
        args = _inputs(manifest)
        if name == "update":
            x, w = args
            expected = (np.sum((w * 0.5 + x) * x), w * 0.5 + x)
        else:
            expected = fj.jit(getattr(model, function), target="cpu")(*args)
            expected = expected if isinstance(expected, tuple) else (expected,)
        lib = ctypes.CDLL(str(built / "out" / f"{name}.so"))
        entry = getattr(lib, name)
        entry.argtypes = [ctypes.c_void_p] * (len(args) + len(expected))
        getattr(lib, f"{name}_last_error").restype = ctypes.c_char_p
        for _ in range(2):
            outs = [np.full(np.shape(e), 7, np.asarray(e).dtype) for e in expected]
            status = entry(*[a.ctypes.data for a in args], *[o.ctypes.data for o in outs])
            assert status == 0, getattr(lib, f"{name}_last_error")().decode()
            for got, want in zip(outs, expected):
                tolerance = 2e-3 if name == "half" else 1e-4
                scale = 1.0 + float(np.max(np.abs(np.asarray(want, np.float64)), initial=0))
                assert float(np.max(np.abs(got.astype(np.float64) - want), initial=0)) <= tolerance * scale, name
        assert getattr(lib, f"{name}_release")() == 0


def test_unsupported_programs_are_compile_errors(built, tmp_path):
    argv = [FLOWJIT, "compile", f"{built}/model.py:halvings", "--arg", "f32[4,8]"]
    done = subprocess.run([*argv, "--target", "cuda", "-o", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.startswith("flowjit: error: ") and "target 'cuda'" in done.stderr and "while" in done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.glob("*.so"))
