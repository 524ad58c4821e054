"""Ahead-of-time step of `make demo`: compile the demo's `predict` into a C library with
`flowjit compile`, call it from a C program built with the system C compiler (no Python in that
process), and compare its output with the jitted Python function.

    python examples/aot_demo.py [--out build/aot]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, EXAMPLES)

import demo  # noqa: E402  (the model: a two-layer MLP on 8x8 digits, 64 -> 32 -> 10)

ARGS = {"x": (8, 64), "w1": (64, 32), "b1": (32,), "w2": (32, 10), "b2": (10,)}

MAIN_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include "predict.h"

static void load(const char* dir, const char* name, float* data, size_t count) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.bin", dir, name);
  FILE* f = fopen(path, "rb");
  if (f == NULL || fread(data, sizeof *data, count, f) != count) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
  fclose(f);
}

int main(int argc, char** argv) {
  static float x[PREDICT_X_SIZE], w1[PREDICT_W1_SIZE], b1[PREDICT_B1_SIZE], w2[PREDICT_W2_SIZE], b2[PREDICT_B2_SIZE];
  static float logits[PREDICT_OUT_0_SIZE], probs[PREDICT_OUT_1_SIZE];
  load(argv[1], "x", x, PREDICT_X_SIZE); load(argv[1], "w1", w1, PREDICT_W1_SIZE);
  load(argv[1], "b1", b1, PREDICT_B1_SIZE); load(argv[1], "w2", w2, PREDICT_W2_SIZE);
  load(argv[1], "b2", b2, PREDICT_B2_SIZE);
  int status = predict(x, w1, b1, w2, b2, logits, probs);
  if (status != FLOWJIT_OK) { fprintf(stderr, "predict: %s\n", predict_status_string(status)); return 1; }
  for (int i = 0; i < PREDICT_OUT_1_SIZE; i++) printf("%.9g\n", probs[i]);
  return 0;
}
"""


def run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"aot demo: '{' '.join(argv)}' failed:\n{proc.stderr}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("build", "aot"), help="folder for the library and the C program")
    out = parser.parse_args().out
    if shutil.which("cc") is None:
        print("aot demo: skipped (no system C compiler 'cc')")
        return
    flowjit_cmd = os.path.join(os.path.dirname(sys.executable), "flowjit")
    specs = [arg for shape in ARGS.values() for arg in ("--arg", f"f32[{','.join(map(str, shape))}]")]
    t0 = time.perf_counter()
    run([flowjit_cmd, "compile", f"{EXAMPLES}/demo.py:predict", *specs, "--threads", "serial", "-o", out])
    print(f"flowjit compile demo.py:predict -> {out}/predict.so, predict.h, predict.json "
          f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip

    rng = np.random.default_rng(0)
    arrays = {name: (rng.standard_normal(shape) * 0.3).astype(np.float32) for name, shape in ARGS.items()}
    for name, array in arrays.items():
        array.tofile(os.path.join(out, f"{name}.bin"))
    with open(os.path.join(out, "main.c"), "w") as f:
        f.write(MAIN_C)
    binary = os.path.join(out, "main")
    run(["cc", "-O2", "-I", out, os.path.join(out, "main.c"), os.path.join(out, "predict.so"),
         f"-Wl,-rpath,{os.path.abspath(out)}", "-o", binary])  # fmt: skip
    print(f"cc main.c predict.so -> {binary}: a C program, no Python at run time")

    t0 = time.perf_counter()
    probs_c = np.array(run([binary, out]).split(), np.float32).reshape(8, 10)
    elapsed = time.perf_counter() - t0
    _, probs_py = demo.predict(*arrays.values())
    error = float(np.abs(probs_c - probs_py).max())
    print(f"C program ran in {elapsed * 1e3:.1f} ms (process start included); classes {probs_c.argmax(axis=1)}")
    print(f"max |C - Python| = {error:.2e}")
    if error > 1e-5:
        sys.exit("aot demo: the C library disagrees with the Python function")


if __name__ == "__main__":
    main()
