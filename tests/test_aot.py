"""`flowjit compile`: libraries built by the CLI, called from C programs compiled with the system C
compiler and run as separate processes; their outputs against the Python (jit or numpy) results.

Each C program reads its inputs from raw little-endian files and writes its outputs the same way,
so the Python side generates the data and checks the results.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flowjit as fj
from flowjit.cli import main

FLOWJIT = os.path.join(os.path.dirname(sys.executable), "flowjit")

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a system C compiler (cc)")

MODEL = """\
import numpy as np

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp

W = fj.Variable(np.zeros((8, 3), np.float32), name="w")
STEPS = fj.Variable(np.zeros((), np.int32), name="steps")


def predict(x, w1, b1, w2):
    h = nn.relu(x @ w1 + b1)
    return {"logits": h @ w2, "mean": fnp.mean(h)}


def train_step(w, b, x, y):
    def loss(params):
        return nn.cross_entropy(x @ params["w"] + params["b"], y)

    params = {"w": w, "b": b}
    l, grads = fj.value_and_grad(loss)(params)
    new, _ = fj.optim.SGD(0.5).update(grads, (), params)
    return new["w"], new["b"], l


def train_var(x, y):
    def loss(w):
        return nn.cross_entropy(x @ w, y)

    l, g = fj.value_and_grad(loss)(W.value)
    W.assign_sub(0.5 * g)
    STEPS.assign_add(1)
    return l


def predict_var(x):
    return nn.softmax(x @ W.value)


def wide(x, w):
    return fnp.tanh(x @ w).sum(axis=1)


def shift_and_scale(a):
    return a + 1.0, a * 2.0


def mixed(flag, n, d, h, b):
    return fnp.where(flag, d, -d), n * 2, h * 2, fnp.logical_not(flag), b * 2


def broken(x):
    return x @ x


V2 = fj.Variable(np.full((16, 4), 0.1, np.float32), name="v2")


def two_device_step(x, w1):
    def loss(params):
        with fj.device("cpu:0"):
            h = fnp.tanh(x @ params[0])
        with fj.device("cpu:1"):
            return ((h @ params[1]) ** 2).mean()

    l, grads = fj.value_and_grad(loss)((w1, V2.value))
    V2.assign_sub(0.1 * grads[1])
    return w1 - 0.1 * grads[0], l


def two_devices(x, w1, b1, w2):
    with fj.device("cpu:0"):
        h = fnp.tanh(x @ w1 + b1)
    with fj.device("cpu:1"):
        logits = h @ w2
        top = fnp.max(logits, axis=1)
    with fj.device("cpu:0"):
        return {"logits": logits, "score": top + h.sum(axis=1), "x": x}
"""

# Shared by the C programs: read and write raw buffers, abort with a message on failure.
C_IO = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void load(const char* dir, const char* name, void* data, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.bin", dir, name);
  FILE* f = fopen(path, "rb");
  if (f == NULL || fread(data, 1, bytes, f) != bytes) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
  fclose(f);
}

static void save(const char* dir, const char* name, const void* data, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.bin", dir, name);
  FILE* f = fopen(path, "wb");
  if (f == NULL || fwrite(data, 1, bytes, f) != bytes) { fprintf(stderr, "cannot write %s\n", path); exit(2); }
  fclose(f);
}

#define CHECK(call) \
  do { int s_ = (call); if (s_ != FLOWJIT_OK) { fprintf(stderr, "%s: %d\n", #call, s_); exit(3); } } while (0)
"""

PREDICT_C = r"""
#include "predict.h"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  float x[PREDICT_X_SIZE], w1[PREDICT_W1_SIZE], b1[PREDICT_B1_SIZE], w2[PREDICT_W2_SIZE];
  float logits[PREDICT_OUT_LOGITS_SIZE], mean[PREDICT_OUT_MEAN_SIZE];
  load(dir, "x", x, sizeof x); load(dir, "w1", w1, sizeof w1);
  load(dir, "b1", b1, sizeof b1); load(dir, "w2", w2, sizeof w2);
  CHECK(predict(x, w1, b1, w2, logits, mean));
  save(dir, "logits", logits, sizeof logits); save(dir, "mean", mean, sizeof mean);

  /* The explicit-workspace entry gives the same result. */
  void* workspace = malloc(predict_workspace_size());
  float logits2[PREDICT_OUT_LOGITS_SIZE], mean2[1];
  CHECK(predict_with_workspace(x, w1, b1, w2, logits2, mean2, workspace));
  if (memcmp(logits, logits2, sizeof logits) != 0 || mean[0] != mean2[0]) { fprintf(stderr, "mismatch\n"); return 4; }
  free(workspace);

  /* Error codes. */
  if (predict(NULL, w1, b1, w2, logits, mean) != FLOWJIT_ERROR_NULL_ARGUMENT) return 5;
  if (predict_with_workspace(x, w1, b1, w2, logits, mean, NULL) != FLOWJIT_ERROR_NULL_ARGUMENT) return 6;
  printf("%s\n", predict_status_string(FLOWJIT_ERROR_NULL_ARGUMENT));
  return 0;
}
"""

# Several steps with the parameters updated in place: the outputs are the input buffers.
TRAIN_C = r"""
#include "train_step.h"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  int steps = atoi(argv[2]);
  float w[TRAIN_STEP_W_SIZE], b[TRAIN_STEP_B_SIZE], x[TRAIN_STEP_X_SIZE], loss[1];
  int32_t y[TRAIN_STEP_Y_SIZE];
  load(dir, "w", w, sizeof w); load(dir, "b", b, sizeof b);
  load(dir, "x", x, sizeof x); load(dir, "y", y, sizeof y);
  for (int i = 0; i < steps; i++) CHECK(train_step(w, b, x, y, w, b, loss));
  save(dir, "w_out", w, sizeof w); save(dir, "b_out", b, sizeof b); save(dir, "loss", loss, sizeof loss);
  return 0;
}
"""

TRAIN_VAR_C = r"""
#include "train_var.h"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  float x[TRAIN_VAR_X_SIZE], w[TRAIN_VAR_W_SIZE], loss[1];
  int32_t y[TRAIN_VAR_Y_SIZE], steps[1] = {0};
  load(dir, "x", x, sizeof x); load(dir, "y", y, sizeof y); load(dir, "w", w, sizeof w);
  /* The caller owns the variables: each call reads them and writes their new values in place. */
  for (int i = 0; i < 3; i++) CHECK(train_var(x, y, w, steps, loss, w, steps));
  save(dir, "w_out", w, sizeof w); save(dir, "steps", steps, sizeof steps); save(dir, "loss", loss, sizeof loss);
  return 0;
}
"""

FROZEN_C = r"""
#include "predict_var.h"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  float x[PREDICT_VAR_X_SIZE], out[PREDICT_VAR_OUT_SIZE];
  load(dir, "x", x, sizeof x);
  CHECK(predict_var(x, out));
  save(dir, "out", out, sizeof out);
  return 0;
}
"""

# An in-place call: without the library's copy, the second output would read the first one's values.
SHIFT_C = r"""
#include "shift_and_scale.h"
int main(int argc, char** argv) {
  float a[SHIFT_AND_SCALE_A_SIZE], scaled[SHIFT_AND_SCALE_OUT_1_SIZE];
  load(argv[1], "a", a, sizeof a);
  CHECK(shift_and_scale(a, a, scaled));
  save(argv[1], "shifted", a, sizeof a);
  save(argv[1], "scaled", scaled, sizeof scaled);
  return 0;
}
"""

# Every dtype's C type: bool as uint8_t, f16/bf16 as uint16_t bit patterns.
MIXED_C = r"""
#include "mixed.h"
int main(int argc, char** argv) {
  uint8_t flag[MIXED_FLAG_SIZE], not_flag[MIXED_OUT_3_SIZE];
  int64_t n[MIXED_N_SIZE], n2[MIXED_OUT_1_SIZE];
  double d[MIXED_D_SIZE], d2[MIXED_OUT_0_SIZE];
  uint16_t h[MIXED_H_SIZE], h2[MIXED_OUT_2_SIZE], b[MIXED_B_SIZE], b2[MIXED_OUT_4_SIZE];
  load(argv[1], "flag", flag, sizeof flag); load(argv[1], "n", n, sizeof n); load(argv[1], "d", d, sizeof d);
  load(argv[1], "h", h, sizeof h); load(argv[1], "b", b, sizeof b);
  CHECK(mixed(flag, n, d, h, b, d2, n2, h2, not_flag, b2));
  save(argv[1], "d2", d2, sizeof d2); save(argv[1], "n2", n2, sizeof n2); save(argv[1], "h2", h2, sizeof h2);
  save(argv[1], "not_flag", not_flag, sizeof not_flag); save(argv[1], "b2", b2, sizeof b2);
  return 0;
}
"""

# Threads calling the same entry point concurrently, each on its own data, against one sequential run.
THREADS_C = r"""
#include <pthread.h>
#include "wide.h"
#define THREADS 4
#define CALLS 20
static float x[THREADS][WIDE_X_SIZE], w[WIDE_W_SIZE], expected[THREADS][WIDE_OUT_SIZE];
static int failures;

static void* worker(void* arg) {
  long t = (long)arg;
  float out[WIDE_OUT_SIZE];
  for (int i = 0; i < CALLS; i++) {
    memset(out, 0, sizeof out);
    int status = wide(x[t], w, out);
    if (status != FLOWJIT_OK || memcmp(out, expected[t], sizeof out) != 0) __sync_fetch_and_add(&failures, 1);
  }
  return NULL;
}

int main(int argc, char** argv) {
  load(argv[1], "w", w, sizeof w);
  for (int t = 0; t < THREADS; t++) {
    load(argv[1], "x", x[t], sizeof x[t]);
    for (int i = 0; i < WIDE_X_SIZE; i++) x[t][i] *= (float)(t + 1) / THREADS;
    CHECK(wide(x[t], w, expected[t]));
  }
  pthread_t threads[THREADS];
  for (long t = 0; t < THREADS; t++) pthread_create(&threads[t], NULL, worker, (void*)t);
  for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
  save(argv[1], "out", expected[THREADS - 1], sizeof expected[THREADS - 1]);
  printf("failures %d\n", failures);
  return failures != 0;
}
"""


def _flowjit_compile(model_dir, out, target, *args):
    proc = subprocess.run(
        [FLOWJIT, "compile", f"{model_dir}/model.py:{target}", *args, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The libraries every test uses, each built once by the CLI."""
    root = tmp_path_factory.mktemp("aot")
    (root / "model.py").write_text(MODEL)
    rng = np.random.default_rng(0)
    fj.save_checkpoint(root / "ckpt", {"w": rng.standard_normal((8, 3)).astype(np.float32)})
    serial = ["--threads", "serial"]
    out = root / "out"
    _flowjit_compile(root, out, "predict", "--arg", "f32[4,8]", "--arg", "f32[8,16]", "--arg", "f32[16]", "--arg",
                     "f32[16,3]", *serial)  # fmt: skip
    _flowjit_compile(root, out, "train_step", "--arg", "f32[8,3]", "--arg", "f32[3]", "--arg", "f32[16,8]", "--arg",
                     "i32[16]", *serial)  # fmt: skip
    _flowjit_compile(root, out, "train_var", "--arg", "f32[16,8]", "--arg", "i32[16]")
    _flowjit_compile(root, out, "predict_var", "--arg", "f32[4,8]", "--freeze-variables", "--checkpoint", root / "ckpt")
    _flowjit_compile(root, out, "shift_and_scale", "--arg", "f32[16,16]", *serial)
    _flowjit_compile(root, out, "mixed", "--arg", "bool[6]", "--arg", "i64[6]", "--arg", "f64[6]", "--arg", "f16[6]",
                     "--arg", "bf16[6]", *serial)  # fmt: skip
    _flowjit_compile(root, out, "wide", "--arg", "f32[256,784]", "--arg", "f32[784,64]")
    _flowjit_compile(root, root / "serial", "wide", "--arg", "f32[256,784]", "--arg", "f32[784,64]", *serial)
    return root


def _build_c(root, out, name: str, source: str, static: bool = False, extra=()) -> str:
    """Compile a C program against out/NAME.h and link it with the library; returns the binary."""
    c_file = root / f"main_{name}.c"
    c_file.write_text(C_IO + source)
    binary = str(root / f"main_{name}{'_static' if static else ''}")
    library = [str(out / f"{name}.a"), "-lm"] if static else [str(out / f"{name}.so"), f"-Wl,-rpath,{out}"]
    argv = ["cc", "-O1", "-Wall", "-Werror", "-I", str(out), str(c_file), *library, *extra, "-o", binary]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return binary


def _run(binary, *args):
    proc = subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stdout} {proc.stderr}"
    return proc.stdout


def _write(folder, **arrays):
    folder.mkdir(exist_ok=True)
    for name, a in arrays.items():
        np.ascontiguousarray(a).tofile(folder / f"{name}.bin")


def _read(folder, name, dtype, shape):
    return np.fromfile(folder / f"{name}.bin", dtype).reshape(shape)


def _model(root):
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_test_model", root / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_predict_from_c_matches_python(built):
    rng = np.random.default_rng(1)
    args = {
        "x": rng.standard_normal((4, 8)),
        "w1": rng.standard_normal((8, 16)),
        "b1": rng.standard_normal(16),
        "w2": rng.standard_normal((16, 3)),
    }
    args = {k: v.astype(np.float32) for k, v in args.items()}
    data = built / "predict_data"
    _write(data, **args)
    stdout = _run(_build_c(built, built / "out", "predict", PREDICT_C), data)
    assert "NULL" in stdout  # the status string of FLOWJIT_ERROR_NULL_ARGUMENT
    expected = fj.jit(_model(built).predict)(*args.values())
    np.testing.assert_allclose(_read(data, "logits", np.float32, (4, 3)), expected["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_read(data, "mean", np.float32, ()), expected["mean"], rtol=1e-5)


def test_manifest_and_header_describe_the_signature(built):
    manifest = json.loads((built / "out" / "predict.json").read_text())
    assert [p["name"] for p in manifest["inputs"]] == ["x", "w1", "b1", "w2"]
    assert [(p["name"], p["path"], p["shape"]) for p in manifest["outputs"]] == [
        ("out_logits", "out['logits']", [4, 3]),
        ("out_mean", "out['mean']", []),
    ]
    assert manifest["inputs"][0] | {"bytes": 0} == {
        "name": "x", "path": "x", "shape": [4, 8], "dtype": "f32", "c_type": "float", "layout": "C-contiguous",
        "bytes": 0,
    }  # fmt: skip
    assert manifest["threads"] == "serial" and manifest["runtime_libraries"] == ["libc", "libm"]
    assert manifest["target"]["cpu"] and manifest["workspace_bytes"] >= 64
    assert manifest["source"].endswith("model.py:predict") and manifest["flowjit_version"] == fj.__version__
    header = (built / "out" / "predict.h").read_text()
    assert "int predict(const float* x, const float* w1, const float* b1, const float* w2, float* out_logits" in header
    assert f"#define PREDICT_WORKSPACE_SIZE {manifest['workspace_bytes']}" in header
    train = (built / "out" / "train_step.h").read_text()
    assert "const int32_t* y" in train


def _numpy_train_step(w, b, x, y, steps, learn_bias=True):
    for _ in range(steps):
        logits = x @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(len(y)), y]))
        p[np.arange(len(y)), y] -= 1
        gw, gb = x.T @ p / len(y), p.sum(axis=0) / len(y)
        w, b = w - 0.5 * gw, (b - 0.5 * gb if learn_bias else b)
    return w, b, loss


def test_training_step_in_place_from_c_matches_python(built):
    rng = np.random.default_rng(2)
    w, b = rng.standard_normal((8, 3)).astype(np.float32), np.zeros(3, np.float32)
    x, y = rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32)
    data = built / "train_data"
    _write(data, w=w, b=b, x=x, y=y)
    _run(_build_c(built, built / "out", "train_step", TRAIN_C), data, 4)
    step = fj.jit(_model(built).train_step)
    w_py, b_py = w, b
    for _ in range(4):
        w_py, b_py, loss_py = step(w_py, b_py, x, y)
    w_c, b_c = _read(data, "w_out", np.float32, (8, 3)), _read(data, "b_out", np.float32, (3,))
    np.testing.assert_allclose(w_c, w_py, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b_c, b_py, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_read(data, "loss", np.float32, ()), loss_py, rtol=1e-5)
    assert not np.allclose(w_c, w)  # the parameters moved
    w_np, b_np, _ = _numpy_train_step(w.astype(np.float64), b.astype(np.float64), x, y, 4)
    np.testing.assert_allclose(w_c, w_np, rtol=1e-4, atol=1e-4)


def test_variables_are_arguments_updated_in_place(built):
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    data = built / "train_var_data"
    _write(data, x=x, y=y, w=w)
    _run(_build_c(built, built / "out", "train_var", TRAIN_VAR_C), data)
    manifest = json.loads((built / "out" / "train_var.json").read_text())
    assert manifest["variables"] == ["steps", "w"]
    assert [p["name"] for p in manifest["outputs"]] == ["out", "w_out", "steps_out"]
    w_np, _, loss_np = _numpy_train_step(w.astype(np.float64), np.zeros(3), x, y, 3, learn_bias=False)
    np.testing.assert_allclose(_read(data, "w_out", np.float32, (8, 3)), w_np, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_read(data, "loss", np.float32, ()), loss_np, rtol=1e-4)
    assert _read(data, "steps", np.int32, ()) == 3


def test_output_may_alias_an_input(built):
    a = np.random.default_rng(7).standard_normal((16, 16)).astype(np.float32)
    data = built / "shift_data"
    _write(data, a=a)
    _run(_build_c(built, built / "out", "shift_and_scale", SHIFT_C), data)
    np.testing.assert_array_equal(_read(data, "shifted", np.float32, (16, 16)), a + np.float32(1))
    np.testing.assert_array_equal(_read(data, "scaled", np.float32, (16, 16)), a * np.float32(2))


def test_every_dtype_crosses_the_c_interface(built):
    import ml_dtypes

    rng = np.random.default_rng(8)
    args = {
        "flag": np.array([True, False, True, True, False, False]),
        "n": rng.integers(-1000, 1000, 6),
        "d": rng.standard_normal(6),
        "h": rng.standard_normal(6).astype(np.float16),
        "b": rng.standard_normal(6).astype(ml_dtypes.bfloat16),
    }
    data = built / "mixed_data"
    _write(data, **args)
    _run(_build_c(built, built / "out", "mixed", MIXED_C), data)
    np.testing.assert_array_equal(_read(data, "d2", np.float64, (6,)), np.where(args["flag"], args["d"], -args["d"]))
    np.testing.assert_array_equal(_read(data, "n2", np.int64, (6,)), args["n"] * 2)
    np.testing.assert_array_equal(_read(data, "h2", np.float16, (6,)), args["h"] * 2)
    np.testing.assert_array_equal(_read(data, "not_flag", np.bool_, (6,)), ~args["flag"])
    np.testing.assert_array_equal(_read(data, "b2", ml_dtypes.bfloat16, (6,)), args["b"] * 2)
    header = (built / "out" / "mixed.h").read_text()
    assert (
        "int mixed(const uint8_t* flag, const int64_t* n, const double* d, const uint16_t* h, const uint16_t* b, "
        "double* out_0, int64_t* out_1, uint16_t* out_2, uint8_t* out_3, uint16_t* out_4);" in header
    )


def test_frozen_variables_are_constants(built):
    x = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32)
    data = built / "frozen_data"
    _write(data, x=x)
    _run(_build_c(built, built / "out", "predict_var", FROZEN_C), data)
    w = fj.load_checkpoint(built / "ckpt")["w"]
    logits = x @ w
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(_read(data, "out", np.float32, (4, 3)), expected, rtol=1e-5, atol=1e-6)
    assert [p["name"] for p in json.loads((built / "out" / "predict_var.json").read_text())["inputs"]] == ["x"]


def test_concurrent_calls_from_threads_with_openmp(built):
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((256, 784)).astype(np.float32), rng.standard_normal((784, 64)).astype(np.float32)
    data = built / "wide_data"
    _write(data, x=x, w=(w * 0.05).astype(np.float32))
    stdout = _run(_build_c(built, built / "out", "wide", THREADS_C, extra=["-pthread"]), data)
    assert "failures 0" in stdout
    expected = np.tanh(x.astype(np.float64) @ (w * 0.05).astype(np.float64)).sum(axis=1)
    np.testing.assert_allclose(_read(data, "out", np.float32, (256,)), expected, rtol=1e-4, atol=1e-3)
    manifest = json.loads((built / "out" / "wide.json").read_text())
    assert manifest["runtime_libraries"] == ["libc", "libm", "libiomp5"]


def _needed(library) -> list[str]:
    proc = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, timeout=60, check=True)
    return sorted(line.split("[")[1].rstrip("]") for line in proc.stdout.splitlines() if "(NEEDED)" in line)


def _undefined(library) -> list[str]:
    proc = subprocess.run(["nm", "-u", "-D", str(library)], capture_output=True, text=True, timeout=60, check=True)
    return [line.split()[-1].split("@")[0] for line in proc.stdout.splitlines() if line.split()[0] == "U"]


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None, reason="needs binutils")
def test_libraries_depend_on_libc_libm_and_only_openmp_when_threaded(built):
    import ctypes

    libc, libm = ctypes.CDLL("libc.so.6"), ctypes.CDLL("libm.so.6")
    libraries = [built / "out" / f"{name}.so" for name in ("predict", "train_step", "predict_var")]
    for library in [*libraries, built / "serial" / "wide.so"]:  # wide.so is threaded without --threads serial
        assert set(_needed(library)) <= {"libc.so.6", "libm.so.6"}
        for symbol in _undefined(library):
            assert hasattr(libc, symbol) or hasattr(libm, symbol), symbol
    wide = built / "out" / "wide.so"
    assert set(_needed(wide)) <= {"libc.so.6", "libm.so.6", "libiomp5.so"} and "libiomp5.so" in _needed(wide)
    assert any(s.startswith("__kmpc_") for s in _undefined(wide))
    # Only the documented entry points are exported; the kernel is hidden.
    proc = subprocess.run(["nm", "-D", "--defined-only", str(built / "out" / "predict.so")], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    exported = sorted(line.split()[-1] for line in proc.stdout.splitlines() if " T " in line)
    assert exported == ["predict", "predict_status_string", "predict_with_workspace", "predict_workspace_size"]


def test_static_library(built, tmp_path):
    out = tmp_path / "static"
    _flowjit_compile(built, out, "predict", "--arg", "f32[4,8]", "--arg", "f32[8,16]", "--arg", "f32[16]", "--arg",
                     "f32[16,3]", "--threads", "serial", "--static-lib")  # fmt: skip
    assert (out / "predict.a").exists() and not (out / "predict.so").exists()
    rng = np.random.default_rng(6)
    args = {"x": (4, 8), "w1": (8, 16), "b1": (16,), "w2": (16, 3)}
    args = {k: rng.standard_normal(s).astype(np.float32) for k, s in args.items()}
    data = tmp_path / "data"
    _write(data, **args)
    _run(_build_c(tmp_path, out, "predict", PREDICT_C, static=True), data)
    expected = fj.jit(_model(built).predict)(*args.values())
    np.testing.assert_allclose(_read(data, "logits", np.float32, (4, 3)), expected["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["predict", "--arg", "f32[4,8"], ["--arg 'f32[4,8'", "expected DTYPE[D0,D1,...]"]),
        (["nope", "--arg", "f32[4,8]"], ["has no function 'nope'", "predict"]),
        (["broken", "--arg", "f32[4,8]"], ["model.py:", "failed", "matmul"]),
        (["predict", "--target", "tpu"], ["--target tpu", "expected one of cpu, cuda, cuda-sm_80"]),
        (["predict", "--target", "cuda", "--threads", "serial"], ["--threads and --cpu-devices", "cpu target only"]),
        (["predict", "--freeze-variables"], ["--freeze-variables and --checkpoint"]),
        (
            ["train_var", "--arg", "f32[16,8]", "--arg", "i32[16]", "--freeze-variables", "--checkpoint", "CKPT"],
            ["updates variable(s)", "steps", "w"],
        ),  # fmt: skip
        (["predict", "--name", "1bad"], ["--name '1bad'", "C identifier"]),
        (["predict", "--cpu-devices", "0"], ["--cpu-devices 0", "positive"]),
        (
            ["two_devices", "--arg", "f32[4,2]", "--arg", "f32[2,3]", "--arg", "f32[3]", "--arg", "f32[3,5]"],
            ["model.py:", "no device matches", "cpu:1", "FLOWJIT_CPU_DEVICES"],
        ),  # one device: cpu:1 does not exist
    ],
)
def test_errors(built, tmp_path, capsys, monkeypatch, argv, fragments):
    monkeypatch.delenv("FLOWJIT_CPU_DEVICES", raising=False)
    argv = [f"{built}/model.py:{argv[0]}", *[str(built / "ckpt") if a == "CKPT" else a for a in argv[1:]]]
    assert main(["compile", *argv, "-o", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flowjit: error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def test_output_folder_that_cannot_be_created(built, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["compile", f"{built}/model.py:predict", "--arg", "f32[1]", "-o", str(blocker / "sub")]) == 1
    assert "cannot create the output folder" in capsys.readouterr().err


def test_frozen_checkpoint_must_hold_every_variable(built, tmp_path, capsys):
    fj.save_checkpoint(tmp_path / "other", {"v": np.zeros(2, np.float32)})
    argv = ["--freeze-variables", "--checkpoint", str(tmp_path / "other"), "-o", str(tmp_path / "o")]
    assert main(["compile", f"{built}/model.py:predict_var", "--arg", "f32[4,8]", *argv]) == 1
    # In this process the model's variable may be named w_N: the test imported the model before.
    assert re.search(r"has no value for variable 'w(_\d+)?'; it holds: v", capsys.readouterr().err)


# --- functions partitioned over several CPU devices ----------------------------------------------------

# The two-device model (layers pinned to cpu:0 and cpu:1, values crossing both ways, an argument
# returned as is), called through both entry points.
TWO_DEVICES_C = r"""
#include "two_devices.h"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  static float x[TWO_DEVICES_X_SIZE], w1[TWO_DEVICES_W1_SIZE], b1[TWO_DEVICES_B1_SIZE], w2[TWO_DEVICES_W2_SIZE];
  static float logits[TWO_DEVICES_OUT_LOGITS_SIZE], score[TWO_DEVICES_OUT_SCORE_SIZE], xo[TWO_DEVICES_OUT_X_SIZE];
  static float logits2[TWO_DEVICES_OUT_LOGITS_SIZE], score2[TWO_DEVICES_OUT_SCORE_SIZE], xo2[TWO_DEVICES_OUT_X_SIZE];
  load(dir, "x", x, sizeof x); load(dir, "w1", w1, sizeof w1);
  load(dir, "b1", b1, sizeof b1); load(dir, "w2", w2, sizeof w2);
  CHECK(two_devices(x, w1, b1, w2, logits, score, xo));
  save(dir, "logits", logits, sizeof logits); save(dir, "score", score, sizeof score); save(dir, "xo", xo, sizeof xo);
  if (two_devices_workspace_size() != TWO_DEVICES_WORKSPACE_SIZE) return 4;
  char* workspace = malloc(two_devices_workspace_size() + 1);
  CHECK(two_devices_with_workspace(x, w1, b1, w2, logits2, score2, xo2, workspace + 1)); /* any alignment */
  free(workspace);
  if (memcmp(logits, logits2, sizeof logits) || memcmp(score, score2, sizeof score) || memcmp(xo, xo2, sizeof xo))
    return 5;
  return 0;
}
"""

# Threads calling the partitioned entry point at once: each call has its own rendezvous.
TWO_DEVICES_THREADS_C = r"""
#include <pthread.h>
#include "two_devices.h"
#define THREADS 6
#define CALLS 40
static float x[THREADS][TWO_DEVICES_X_SIZE], w1[TWO_DEVICES_W1_SIZE], b1[TWO_DEVICES_B1_SIZE];
static float w2[TWO_DEVICES_W2_SIZE], logits[THREADS][TWO_DEVICES_OUT_LOGITS_SIZE];
static float score[THREADS][TWO_DEVICES_OUT_SCORE_SIZE];
static int failures;

static void* worker(void* arg) {
  long t = (long)arg;
  float l[TWO_DEVICES_OUT_LOGITS_SIZE], s[TWO_DEVICES_OUT_SCORE_SIZE], xo[TWO_DEVICES_OUT_X_SIZE];
  for (int i = 0; i < CALLS; i++) {
    memset(l, 0, sizeof l);
    memset(s, 0, sizeof s);
    int status = two_devices(x[t], w1, b1, w2, l, s, xo);
    if (status != FLOWJIT_OK || memcmp(l, logits[t], sizeof l) || memcmp(s, score[t], sizeof s))
      __sync_fetch_and_add(&failures, 1);
  }
  return NULL;
}

int main(int argc, char** argv) {
  const char* dir = argv[1];
  load(dir, "w1", w1, sizeof w1); load(dir, "b1", b1, sizeof b1); load(dir, "w2", w2, sizeof w2);
  for (int t = 0; t < THREADS; t++) {
    load(dir, "x", x[t], sizeof x[t]);
    for (int i = 0; i < TWO_DEVICES_X_SIZE; i++) x[t][i] *= (float)(t + 1) / THREADS;
    float xo[TWO_DEVICES_OUT_X_SIZE];
    CHECK(two_devices(x[t], w1, b1, w2, logits[t], score[t], xo));
  }
  pthread_t threads[THREADS];
  for (long t = 0; t < THREADS; t++) pthread_create(&threads[t], NULL, worker, (void*)t);
  for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
  save(dir, "score", score[THREADS - 1], sizeof score[THREADS - 1]);
  printf("failures %d\n", failures);
  return failures != 0;
}
"""

# h is 512x512: big enough for parallel loops (OpenMP) without --threads serial.
TWO_DEVICES_ARGS = ("--arg", "f32[512,64]", "--arg", "f32[64,512]", "--arg", "f32[512]", "--arg", "f32[512,10]")


@pytest.fixture(scope="module")
def partitioned(built):
    """The two-device model compiled by the CLI with --cpu-devices 2: serial and with OpenMP."""
    _flowjit_compile(built, built / "parts_serial", "two_devices", *TWO_DEVICES_ARGS, "--cpu-devices", "2",
                     "--threads", "serial")  # fmt: skip
    _flowjit_compile(built, built / "parts_openmp", "two_devices", *TWO_DEVICES_ARGS, "--cpu-devices", "2")
    rng = np.random.default_rng(7)
    shapes = {"x": (512, 64), "w1": (64, 512), "b1": (512,), "w2": (512, 10)}
    args = {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in shapes.items()}
    data = built / "two_devices_data"
    _write(data, **args)
    return built, args, data


def _two_devices_expected(built, args, monkeypatch):
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "2")
    lowered = fj.jit(_model(built).two_devices).lower(*args.values())
    assert lowered.as_text("placement").startswith("// stage: placement")
    return fj.jit(_model(built).two_devices)(*args.values())


def test_partitioned_function_from_c_matches_jit(partitioned, monkeypatch):
    built, args, data = partitioned
    manifest = json.loads((built / "parts_serial" / "two_devices.json").read_text())
    assert [p["device"] for p in manifest["partitions"]] == ["cpu:0", "cpu:1"]
    assert manifest["runtime_libraries"] == ["libc", "libm", "libpthread"]
    assert manifest["entry_points"][0] == "two_devices" and len(manifest["outputs"]) == 3
    _run(_build_c(built, built / "parts_serial", "two_devices", TWO_DEVICES_C), data)
    expected = _two_devices_expected(built, args, monkeypatch)
    np.testing.assert_allclose(_read(data, "logits", np.float32, (512, 10)), expected["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_read(data, "score", np.float32, (512,)), expected["score"], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(_read(data, "xo", np.float32, (512, 64)), args["x"])


def test_partitioned_function_in_a_static_library(partitioned, tmp_path, monkeypatch):
    built, args, data = partitioned
    out = tmp_path / "static"
    _flowjit_compile(built, out, "two_devices", *TWO_DEVICES_ARGS, "--cpu-devices", "2", "--threads", "serial",
                     "--static-lib")  # fmt: skip
    _run(_build_c(tmp_path, out, "two_devices", TWO_DEVICES_C, static=True, extra=["-pthread"]), data)
    expected = _two_devices_expected(built, args, monkeypatch)
    np.testing.assert_allclose(_read(data, "logits", np.float32, (512, 10)), expected["logits"], rtol=1e-5, atol=1e-5)


def test_cpu_devices_option_is_restored_after_an_in_process_compile(built, tmp_path, monkeypatch):
    monkeypatch.delenv("FLOWJIT_CPU_DEVICES", raising=False)
    argv = ["--arg", "f32[4,2]", "--arg", "f32[2,3]", "--arg", "f32[3]", "--arg", "f32[3,5]", "--threads", "serial"]
    assert main(["compile", f"{built}/model.py:two_devices", *argv, "--cpu-devices", "2", "-o", str(tmp_path)]) == 0
    assert "FLOWJIT_CPU_DEVICES" not in os.environ
    assert len(json.loads((tmp_path / "two_devices.json").read_text())["partitions"]) == 2


def test_partitioned_function_called_from_threads(partitioned):
    built, args, data = partitioned
    stdout = _run(_build_c(built, built / "parts_openmp", "two_devices", TWO_DEVICES_THREADS_C, extra=["-pthread"]),
                  data)  # fmt: skip
    assert "failures 0" in stdout
    x = args["x"].astype(np.float64)  # the last thread's input: x scaled by 6/6
    h = np.tanh(x @ args["w1"] + args["b1"])
    expected = (h @ args["w2"]).max(axis=1) + h.sum(axis=1)
    np.testing.assert_allclose(_read(data, "score", np.float32, (512,)), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None, reason="needs binutils")
def test_partitioned_library_depends_on_libc_libm_libpthread_only(partitioned):
    import ctypes

    built, _, _ = partitioned
    library = built / "parts_serial" / "two_devices.so"
    assert set(_needed(library)) <= {"libc.so.6", "libm.so.6", "libpthread.so.0"}
    runtime = [ctypes.CDLL("libc.so.6"), ctypes.CDLL("libm.so.6"), ctypes.CDLL("libpthread.so.0")]
    undefined = _undefined(library)
    assert "pthread_create" in undefined
    for symbol in undefined:
        assert any(hasattr(lib, symbol) for lib in runtime), symbol
    manifest = json.loads((built / "parts_serial" / "two_devices.json").read_text())
    assert set(undefined) <= set(manifest["external_symbols"])
    # The rendezvous and the kernels are hidden: only the documented entry points are exported.
    proc = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    exported = sorted(line.split()[-1] for line in proc.stdout.splitlines() if " T " in line)
    assert exported == [f"two_devices{s}" for s in ("", "_status_string", "_with_workspace", "_workspace_size")]
    openmp = built / "parts_openmp" / "two_devices.so"
    assert "libiomp5.so" in _needed(openmp) and any(s.startswith("__kmpc_") for s in _undefined(openmp))


# A training step over two devices, its parameter and its variable updated in place.
TWO_DEVICE_STEP_C = r"""
#include "two_device_step.h"
int main(int argc, char** argv) {
  const char* dir = argv[1];
  float x[TWO_DEVICE_STEP_X_SIZE], w1[TWO_DEVICE_STEP_W1_SIZE], v2[TWO_DEVICE_STEP_V2_SIZE], loss[1];
  load(dir, "x", x, sizeof x); load(dir, "w1", w1, sizeof w1); load(dir, "v2", v2, sizeof v2);
  for (int i = 0; i < 3; i++) CHECK(two_device_step(x, w1, v2, w1, loss, v2));
  save(dir, "w1_out", w1, sizeof w1); save(dir, "v2_out", v2, sizeof v2); save(dir, "loss", loss, sizeof loss);
  return 0;
}
"""


def test_partitioned_training_step_updates_in_place(partitioned, monkeypatch):
    built, _, _ = partitioned
    out = built / "parts_step"
    _flowjit_compile(built, out, "two_device_step", "--arg", "f32[8,12]", "--arg", "f32[12,16]", "--cpu-devices", "2",
                     "--threads", "serial")  # fmt: skip
    assert len(json.loads((out / "two_device_step.json").read_text())["partitions"]) == 2
    rng = np.random.default_rng(8)
    x, w1 = rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((12, 16)).astype(np.float32)
    data = built / "two_device_step_data"
    _write(data, x=x, w1=w1, v2=np.full((16, 4), 0.1, np.float32))
    _run(_build_c(built, out, "two_device_step", TWO_DEVICE_STEP_C), data)
    monkeypatch.setenv("FLOWJIT_CPU_DEVICES", "2")
    model = _model(built)
    step = fj.jit(model.two_device_step)
    for _ in range(3):
        w1, loss = step(x, w1)
    np.testing.assert_allclose(_read(data, "w1_out", np.float32, (12, 16)), w1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_read(data, "v2_out", np.float32, (16, 4)), model.V2.value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_read(data, "loss", np.float32, ()), loss, rtol=1e-5)


# Stand-ins for two partition kernels driving the rendezvous runtime directly: the recv waits first
# (mode 0), the send lends its buffer first (mode 1), or each waits for a value never sent (mode 2).
RENDEZVOUS_C = r"""
#include <stdio.h>
#include <string.h>
#include <time.h>
#include "t.h"
void t_flowjit_send(int64_t key, int64_t data, int64_t nbytes);
int32_t t_flowjit_recv(int64_t key, int64_t dest, int64_t nbytes);
void t_flowjit_send_done(void);
static int mode;
static int32_t received = -1;

static void sleep_ms(int ms) { struct timespec t = {0, ms * 1000000L}; nanosleep(&t, NULL); }

void t_kernel0(const void* a, void* b, void* workspace) {
  (void)a; (void)workspace;
  if (mode == 1) sleep_ms(50); /* the sender has lent its buffer by now */
  received = t_flowjit_recv((int64_t)(intptr_t)"k1", (int64_t)(intptr_t)b, 4 * sizeof(float));
}

void t_kernel1(const void* a, void* workspace) {
  float* buffer = workspace;
  if (mode == 2) {
    t_flowjit_recv((int64_t)(intptr_t)"k0", (int64_t)(intptr_t)buffer, 4 * sizeof(float));
    return;
  }
  if (mode == 0) sleep_ms(50); /* the receiver waits by now */
  for (int i = 0; i < 4; i++) buffer[i] = ((const float*)a)[i] + 1.0f;
  t_flowjit_send((int64_t)(intptr_t)"k1", (int64_t)(intptr_t)buffer, 4 * sizeof(float));
  t_flowjit_send_done();
  for (int i = 0; i < 4; i++) buffer[i] = -99.0f; /* after send_done the loan is the sender's again */
}

int main(void) {
  float a[4] = {1, 2, 3, 4}, b[4];
  for (mode = 0; mode < 3; mode++) {
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    memset(b, 0x7f, sizeof b);
    int status = t(a, b);
    clock_gettime(CLOCK_MONOTONIC, &end);
    double seconds = (double)(end.tv_sec - start.tv_sec) + (double)(end.tv_nsec - start.tv_nsec) * 1e-9;
    printf("mode %d status %d received %d b %g %g %g %g seconds %.2f\n", mode, status, received, b[0], b[1], b[2],
           b[3], seconds);
  }
  return 0;
}
"""


def test_rendezvous_runtime_delivers_lends_and_times_out(tmp_path):
    from flowjit.backends.cpu import aot_c
    from flowjit.ir import dtypes

    a, b = aot_c.Port("a", "a", (4,), dtypes.float32), aot_c.Port("b", "out", (4,), dtypes.float32)
    kernels = [aot_c.PartitionKernel("t_kernel0", (0,), (0,), 0), aot_c.PartitionKernel("t_kernel1", (0,), (), 16)]
    manifest = {"flowjit_version": "test", "source": "test", "runtime_libraries": ["libc"], "threads": "serial",
                "workspace_bytes": 128, "target": {"cpu": "any", "triple": "any"}}  # fmt: skip
    (tmp_path / "t.h").write_text(aot_c.header("t", [a], [b], manifest))
    (tmp_path / "t.c").write_text(aot_c.partitioned_wrapper("t", kernels, ["k0", "k1"], [], [a], [b]))
    (tmp_path / "main.c").write_text(RENDEZVOUS_C)
    binary = str(tmp_path / "main")
    argv = ["cc", "-O1", "-Wall", "-Werror", "-pthread", "-I", str(tmp_path), str(tmp_path / "t.c"),
            str(tmp_path / "main.c"), "-o", binary]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([binary], capture_output=True, text=True, timeout=60, env={**os.environ,
                          "FLOWJIT_RECV_TIMEOUT": "0.3"})  # fmt: skip
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 3, proc.stdout + proc.stderr
    assert lines[0].startswith("mode 0 status 0 received 0 b 2 3 4 5 ")  # copied into the waiting destination
    assert lines[1].startswith("mode 1 status 0 received 0 b 2 3 4 5 ")  # copied out of the loan before send_done
    # Nothing arrives: one timeout fails the call (FLOWJIT_ERROR_TRANSFER), cancels the other
    # partition's wait, and zero-fills the destination.
    assert lines[2].startswith("mode 2 status 3 received 1 b 0 0 0 0 ")
    assert 0.25 < float(lines[2].split()[-1]) < 0.55
