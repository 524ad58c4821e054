"""The GPU device check: compile here, run there (issue #38, docs/gpu-backend.md).

    python benchmarks/gpu/device_check.py prepare [--out DIR] [--chip sm_90] [--tiny]
        on a machine with MLIR (this one): compiles every program below for the GPU into DIR/cache
        (the flowjit disk cache, cubins included where ptxas is found), with its inputs and the
        expected outputs (flowjit's CPU backend, or the op table's numpy reference) in DIR/data,
        and DIR/manifest.json. DIR defaults to benchmarks/gpu/prepared. The sampled programs
        (`Sampled`: the 4096^2 products, the conv layer) store nothing in DIR/data: their inputs
        are made on the GPU machine from the seed, and their result checked there on a sample.
    python3 benchmarks/gpu/device_check.py run [--dir DIR] [--json FILE] [--repeat N]
            [--timeout S] [--budget S] [--only NAME,...] [--peers torch,torch.compile,jax]
            [--peer-device cuda|cpu]
        on the GPU machine (python3 with numpy, ml_dtypes and cuda-bindings, no MLIR, no network):
        a first child process (`probe`) loads every program's executable from DIR/cache without
        importing MLIR and makes a first call on GPU 0; then each program runs in a child process
        of its own (`run-one NAME`, at most --timeout seconds, 60 by default; no child starts
        after --budget seconds, 270 by default), which checks flowjit's result against the
        expected outputs, times flowjit (host arrays in and out, and with inputs and results in
        device memory), then times and checks each peer: PyTorch eager (end to end and on
        device-resident tensors), torch.compile (on device, its first call timed apart) and
        jax.jit (end to end and on device). A peer that cannot run is recorded with its reason.
        Prints a table, writes FILE (default DIR/results.json) and gpu_check.md beside it (a
        section for benchmarks/RESULTS.md). Exit status: 0 when every loaded program matched,
        1 when one did not (or crashed, timed out, was skipped), 2 when no GPU could be used
        (the reason is printed: it is the runtime's GpuRuntimeError).

`cpu_gpu_split` is placed over cpu:0 and gpu:0 (`split_between`): its GPU partition comes from the
cache, its CPU partitions run on the reference interpreter (`split_target`), and its result is
compared with the same program on the CPU alone. Programs the GPU cannot compile (`newton_sqrt`: a
while loop, which stays on the CPU) are listed
as such, with the compile error, never silently dropped. --peer-device cpu runs the peers on the
CPU: the tests use it to go through the peers' code without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from peers import PEERS, compare, median_ms, run_peer  # noqa: E402 (beside this script)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DIR = os.path.join(ROOT, "benchmarks", "gpu", "prepared")
# Relative tolerance and absolute floor of a program's comparison with the CPU backend.
RTOL, ATOL = 1e-4, 1e-5


# --- the programs ------------------------------------------------------------------------------
# Each is a flowjit function and its inputs (full and tiny sizes); its peers' twins are in peers.py.


def chain(x, y):
    import flowjit.numpy as fnp

    return fnp.tanh(x * y + 1.0) * fnp.exp(-x) + fnp.log(y * y + 1.0)


def softmax(x):
    import flowjit.numpy as fnp

    m = fnp.max(x, axis=1, keepdims=True)
    e = fnp.exp(x - m)
    return e / fnp.sum(e, axis=1, keepdims=True)


def layer_norm(x, g):
    import flowjit.numpy as fnp

    mean = fnp.mean(x, axis=-1, keepdims=True)
    var = fnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / fnp.sqrt(var + 1e-5) * g


def whole_sum(x):
    import flowjit.numpy as fnp

    return fnp.sum(x)


def column_sum(x):
    import flowjit.numpy as fnp

    return fnp.sum(x, axis=0)


def mlp_forward(x, w1, b1, w2):
    import flowjit.numpy as fnp

    return fnp.tanh(x @ w1 + b1) @ w2


def mlp_train_step(x, y, w1, b1, w2):
    """One SGD step of a 784-256-10 tanh MLP on a squared error: the gradient and the update, all
    on the GPU; returns the new parameters."""
    import flowjit.numpy as fnp

    return _sgd_step(lambda out: fnp.mean((out - y) ** 2), x, w1, b1, w2)


def mlp_xent_step(x, labels, w1, b1, w2):
    """The same step on the cross-entropy of the logits against integer class labels
    (`flowjit.nn.cross_entropy`: its log-softmax and the label pick are row-stage kernels)."""
    import flowjit.nn as nn

    return _sgd_step(lambda logits: nn.cross_entropy(logits, labels), x, w1, b1, w2)


def _sgd_step(loss_of_output, x, w1, b1, w2):
    import flowjit as fj
    import flowjit.numpy as fnp

    def loss(w1, b1, w2):
        return loss_of_output(fnp.tanh(x @ w1 + b1) @ w2)

    g1, gb, g2 = fj.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)
    return w1 - 0.01 * g1, b1 - 0.01 * gb, w2 - 0.01 * g2


def matmul(a, b):
    return a @ b


def conv_layer(x, w, b):
    """benchmarks/workloads.py's ConvLayer: conv3x3 (padding 1) + per-channel bias + relu, one
    launch of the tiled kernel on the GPU."""
    import flowjit.nn as nn

    return nn.relu(nn.conv2d(x, w, b, padding=1))


def split_between(gpu: str):
    """The cpu:0+gpu:0 split: the inputs scaled on cpu:0, a tanh layer on `gpu`, its row sums back
    on cpu:0 (two transfers in, one out). `split_between("cpu:0")` is the same program on the CPU
    alone, whose result the split must give."""

    def cpu_gpu_split(x, w):
        import flowjit as fj
        import flowjit.numpy as fnp

        with fj.device("cpu:0"):
            s = x * 0.5 + 1.0
        with fj.device(gpu):
            h = fnp.tanh(s @ w)
        with fj.device("cpu:0"):
            return fnp.sum(h, axis=1)

    return cpu_gpu_split


def split_target(chip: str) -> dict[str, str]:
    """The split's backends: its GPU partition compiled for `chip` (from the cache, there), its
    CPU partitions on the reference interpreter, since the GPU machine has no CPU compiler (no
    MLIR, no llvmlite): what the check exercises is the GPU partition and the transfers."""
    return {"cpu": "interpreter", "gpu": f"cuda-{chip}"}


def newton_sqrt(x):
    """A while loop: control flow stays on the CPU (the GPU's CPU_ONLY table), so this program is
    listed as not compiled, with the reason."""
    import flowjit as fj

    return fj.while_loop(lambda y: y[0, 0] * y[0, 0] > x[0, 0] + 1e-3, lambda y: 0.5 * (y + x / y), x + 1.0)


Shapes = tuple[tuple[int, ...], ...]


def standard_normal(rng: np.random.Generator, shapes: Shapes) -> list[np.ndarray]:
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def standard_normal_bf16(rng: np.random.Generator, shapes: Shapes) -> list[np.ndarray]:
    import ml_dtypes

    return [a.astype(ml_dtypes.bfloat16) for a in standard_normal(rng, shapes)]


def data_and_labels(rng: np.random.Generator, shapes: Shapes) -> list[np.ndarray]:
    """x, int32 class labels (below the last weight's column count: the classes), then the weights."""
    x, w1, b1, w2 = standard_normal(rng, shapes[:1] + shapes[2:])
    return [x, rng.integers(0, shapes[-1][1], shapes[1]).astype(np.int32), w1, b1, w2]


def conv_inputs(rng: np.random.Generator, shapes: Shapes) -> list[np.ndarray]:
    """ConvLayer's inputs (weights scaled so that the outputs are of order 1) for input `shapes[0]`."""
    from workloads import ConvLayer  # benchmarks/ (on the path through peers)

    batch, channels, hw, _ = shapes[0]
    return list(ConvLayer().inputs(rng, batch=batch, channels=channels, hw=hw))


@dataclasses.dataclass(frozen=True)
class Sampled:
    """The check of a program whose inputs and outputs are too large to carry: its inputs are made
    on the GPU machine (the program's `make_inputs`, same seed), and `sample` of its outputs is
    compared with `reference` of its inputs, numpy in float64 on that machine's CPU, within `rtol`
    and `atol` (see `compare`)."""

    sample: Callable[[list], list[np.ndarray]]
    reference: Callable[[list[np.ndarray]], list[np.ndarray]]
    rtol: float
    atol: float


def _picked(n: int) -> np.ndarray:
    """64 of range(n) (all when fewer), sorted, the same on every machine: random rather than
    strided, so that they fall at every position within a kernel's tiles."""
    return np.sort(np.random.default_rng(0).choice(n, min(n, 64), replace=False))


def _product_sample(outputs) -> list[np.ndarray]:
    (c,) = outputs
    c = np.asarray(c)
    return [c[np.ix_(_picked(c.shape[0]), _picked(c.shape[1]))]]


def _product_reference(inputs) -> list[np.ndarray]:
    a, b = inputs
    return [a[_picked(a.shape[0])].astype(np.float64) @ b[:, _picked(b.shape[1])].astype(np.float64)]


def _conv_sample(outputs) -> list[np.ndarray]:
    (y,) = outputs
    return [np.asarray(y)[[0, -1]]]


def _conv_reference(inputs) -> list[np.ndarray]:
    from workloads import ConvLayer

    x, w, b = inputs
    return [ConvLayer().reference(x[[0, -1]], w, b)]


# A float32 product over K = 4096 in any summation order is within about 6e-4 of the float64 one
# (its elements reach about 250); TF32 products are off by about 0.07, which this tolerance refuses.
MATMUL_F32 = Sampled(_product_sample, _product_reference, rtol=2e-5, atol=5e-3)
# bfloat16 inputs are exact in float32, the products accumulate in float32, and the result rounds
# to bfloat16: up to half a unit of its last place (2**-8 of the value), one unit allowed.
MATMUL_BF16 = Sampled(_product_sample, _product_reference, rtol=8e-3, atol=1e-2)
# The first and the last image; 576 terms per output of order 1 (TF32 would be off by about 1e-3).
CONV = Sampled(_conv_sample, _conv_reference, rtol=1e-4, atol=1e-4)


def _product_flop(shapes: Shapes) -> int:
    (m, k), (_, n) = shapes
    return 2 * m * n * k


def _conv_flop(shapes: Shapes) -> int:
    (batch, channels, h, w), (out, _, kh, kw), _ = shapes
    return 2 * batch * out * channels * kh * kw * h * w


@dataclasses.dataclass(frozen=True)
class Program:
    """A program of the check: its inputs are `make_inputs(rng, shapes)` (or `tiny`). With
    `sampled`, they are made on the GPU machine and the result is checked there on a sample (see
    `Sampled`); otherwise `prepare` stores them with the CPU backend's outputs. `flop` counts its
    floating-point operations, for the report's TFLOP/s."""

    name: str
    fn: Callable
    shapes: Shapes
    tiny: Shapes
    kind: str = "program"  # "split": placed over cpu:0 and gpu:0, no peers
    make_inputs: Callable[[np.random.Generator, Shapes], list[np.ndarray]] = standard_normal
    sampled: Sampled | None = None
    flop: Callable[[Shapes], int] | None = None


SQUARE = ((4096, 4096), (4096, 4096))
PROGRAMS = [
    Program("chain", chain, ((1024, 512), (1024, 512)), ((8, 16), (8, 16))),
    Program("softmax", softmax, ((1024, 512),), ((8, 16),)),
    Program("layer_norm", layer_norm, ((1024, 512), (512,)), ((8, 16), (16,))),
    Program("whole_sum", whole_sum, ((1 << 19,),), ((64,),)),
    Program("column_sum", column_sum, ((300, 64, 32),), ((300, 5, 7),)),
    Program("mlp_forward", mlp_forward, ((256, 784), (784, 256), (256,), (256, 10)), ((4, 8), (8, 8), (8,), (8, 2))),
    Program(
        "mlp_train_step",
        mlp_train_step,
        ((256, 784), (256, 10), (784, 256), (256,), (256, 10)),
        ((4, 8), (4, 2), (8, 8), (8,), (8, 2)),
    ),
    Program(
        "mlp_xent_step",
        mlp_xent_step,
        ((256, 784), (256,), (784, 256), (256,), (256, 10)),
        ((4, 8), (4,), (8, 8), (8,), (8, 2)),
        make_inputs=data_and_labels,
    ),
    Program("matmul_f32", matmul, SQUARE, ((16, 24), (24, 8)), sampled=MATMUL_F32, flop=_product_flop),
    Program(
        "matmul_bf16",
        matmul,
        SQUARE,
        ((16, 24), (24, 8)),
        make_inputs=standard_normal_bf16,
        sampled=MATMUL_BF16,
        flop=_product_flop,
    ),
    Program(
        "conv_layer",
        conv_layer,
        ((8, 64, 56, 56), (64, 64, 3, 3), (64,)),  # ConvLayer's full and tiny sizes
        ((2, 4, 6, 6), (4, 4, 3, 3), (4,)),
        make_inputs=conv_inputs,
        sampled=CONV,
        flop=_conv_flop,
    ),
    Program("cpu_gpu_split", split_between("gpu:0"), ((1024, 512), (512, 256)), ((8, 16), (16, 8)), kind="split"),
    Program("newton_sqrt", newton_sqrt, ((64, 64),), ((4, 4),)),
]
# Op-table rows (tests/op_table.py) the GPU lowers: numerics only (small, untimed).
OP_ROWS = ("exp", "tanh", "add", "broadcast", "transpose", "reduce_sum", "reduce_max")
TINY = {
    "chain",
    "whole_sum",
    "mlp_forward",
    "mlp_xent_step",
    "matmul_bf16",
    "conv_layer",
    "cpu_gpu_split",
    "newton_sqrt",
}


def _inputs(program: Program, tiny: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(len(program.name))
    return program.make_inputs(rng, program.tiny if tiny else program.shapes)


def _op_rows():
    """(case id, OpCase) of the first float32 row of each op of OP_ROWS."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from op_table import ROWS, build_case

    from flowjit.ir import dtypes as dt

    seen = set()
    for row in ROWS:
        if row.op in OP_ROWS and row.op not in seen and dt.float32 in row.dtypes and "scalar" not in row.name:
            seen.add(row.op)
            yield f"row:{row.name}-float32".replace(" ", ""), build_case(row, dt.float32)


# --- prepare (here, with MLIR) -------------------------------------------------------------------


def prepare(out: str, chip: str, tiny: bool) -> dict:
    """Compile every program for `chip` into out/cache, with inputs and expected outputs."""
    os.environ["FLOWJIT_CACHE_DIR"] = os.path.join(out, "cache")
    os.environ.pop("FLOWJIT_CACHE", None)
    os.chdir(ROOT)  # source locations in the IR (part of the cache key) are relative to the repo root
    import flowjit as fj
    from flowjit.backends.gpu import cubin
    from flowjit.backends.registry import get_backend

    _clear(out)
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    target = f"cuda-{chip}"
    entries = []
    for program in PROGRAMS:
        if tiny and program.name not in TINY:
            continue
        inputs = _inputs(program, tiny)
        entry = {"name": program.name, "kind": program.kind, "tiny": tiny}
        try:
            if program.kind == "split":
                with _one_gpu_declared():  # placed as on a machine with one GPU, the GPU machine
                    fj.jit(program.fn, target=split_target(chip)).lower(*inputs).compile()
            else:
                fj.jit(program.fn, target=target).lower(*inputs).compile()
        except fj.FlowjitError as error:
            entry["status"] = "not compiled"
            entry["error"] = str(error).splitlines()[0]
            entries.append(entry)
            continue
        entry["status"] = "compiled"
        shapes = program.tiny if tiny else program.shapes
        if program.flop:
            entry["flop"] = program.flop(shapes)
        if program.sampled:  # too large to carry: made and checked there
            entry["check"] = "sampled"
            entry["rtol"], entry["atol"] = program.sampled.rtol, program.sampled.atol
            entries.append(entry)
            continue
        os.environ["FLOWJIT_CACHE"] = "0"  # the CPU's code stays out of the folder that travels
        try:
            on_the_cpu = split_between("cpu:0") if program.kind == "split" else program.fn
            expected = fj.jit(on_the_cpu, target="cpu")(*inputs)
        finally:
            del os.environ["FLOWJIT_CACHE"]
        outputs = expected if isinstance(expected, tuple) else (expected,)
        entry["data"] = _save(out, program.name, inputs, [np.asarray(o) for o in outputs])
        entry["rtol"], entry["atol"] = RTOL, ATOL
        entries.append(entry)
    for case_id, case in [] if tiny else _op_rows():
        get_backend(target).compile(case.graph)
        entry = {"name": case_id, "kind": "row", "status": "compiled"}
        entry["data"] = _save(out, case_id.replace(":", "_"), case.inputs, case.expected)
        entry["rtol"], entry["atol"] = case.tol.rtol, case.tol.atol
        entries.append(entry)
    ptxas = cubin.find_ptxas()
    manifest = {
        "chip": chip,
        "prepared": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "ptxas": cubin.ptxas_version(ptxas) if ptxas else None,
        "programs": entries,
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


@contextlib.contextmanager
def _one_gpu_declared():
    """This process has one GPU for placement while compiling (its driver is not asked): the
    split is placed as it will be on the GPU machine, so its GPU partition's stages are the ones
    that machine looks up in the cache."""
    from flowjit.runtime.devices import register_device_provider

    undo = register_device_provider("gpu", lambda: 1)
    try:
        yield
    finally:
        undo()


def _clear(out: str) -> None:
    """Empty a folder an earlier `prepare` wrote (its cache would keep entries of older code);
    refuse any other non-empty folder."""
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if not os.path.exists(os.path.join(out, "manifest.json")):
        raise SystemExit(f"{out} is not empty and holds no manifest.json: not a prepared folder; choose another --out")
    for sub in ("cache", "data"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    os.remove(os.path.join(out, "manifest.json"))


def _save(out: str, name: str, inputs, expected) -> str:
    path = os.path.join("data", f"{name}.npz")
    arrays = {f"in{i}": a for i, a in enumerate(inputs)} | {f"out{i}": np.asarray(e) for i, e in enumerate(expected)}
    np.savez(os.path.join(out, path), **arrays)
    return path


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return done.stdout.strip() or None


# --- run (there: no MLIR): the parent, one child process per program --------------------------

PEER_DEVICES = ("cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How `run` times: `repeat` calls per measurement, each child's `timeout_s`, the whole run's
    `budget_s`, which `peers` run and on which `peer_device`, and `only` these programs (all when
    empty)."""

    repeat: int = 20
    timeout_s: float = 60.0
    budget_s: float = 270.0
    peer_device: str = "cuda"
    peers: tuple[str, ...] = PEERS
    only: tuple[str, ...] = ()

    def __post_init__(self):
        if self.repeat < 1 or self.timeout_s <= 0 or self.budget_s <= 0:
            raise SystemExit(f"--repeat, --timeout and --budget must be positive, not {self}")
        if self.peer_device not in PEER_DEVICES:
            raise SystemExit(f"--peer-device must be one of {', '.join(PEER_DEVICES)}, not {self.peer_device!r}")
        unknown = sorted(set(self.peers) - set(PEERS))
        if unknown:
            raise SystemExit(f"unknown peer(s) {', '.join(unknown)} in --peers; choose among {', '.join(PEERS)}")

    def child_args(self) -> list[str]:
        return [
            *("--repeat", str(self.repeat), "--peer-device", self.peer_device),
            *("--peers", ",".join(self.peers), "--only", ",".join(self.only)),
        ]


def run(folder: str, json_path: str, options: RunOptions) -> int:
    """Probe the GPU in one child process, then check and time each program in a child of its own
    (bounded by `options.timeout_s` each and `options.budget_s` in all); print the table, write
    the JSON and the Markdown. Exit status 0, 1 or 2 (see the module docstring)."""
    started = time.monotonic()
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    # JAX would otherwise take 75% of the GPU's memory at its first call, from flowjit and PyTorch
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
    with tempfile.TemporaryDirectory(prefix="device_check.") as scratch:
        probe, failure, stderr = _run_child(
            ["probe", "--dir", folder, *options.child_args()],
            os.path.join(scratch, "probe.json"),
            min(options.timeout_s, options.budget_s),
            env,
        )
        if probe is None or "programs" not in probe:
            print(f"the probe (loading the programs, a first call on GPU 0) {failure}:\n{stderr[-3000:]}")
            return 2 if failure.startswith("timed out") else 1
        programs = probe["programs"]
        ready = [p for p in programs if p["status"] == "loaded"]
        print(
            f"loaded {len(ready)} of {len(programs)} programs from {folder} (mlir imported: {probe['mlir_imported']})"
        )
        if probe["mlir_imported"]:
            print("the run side imported MLIR")
            return 1
        if not ready:
            print("nothing to run")
            return 1
        if "gpu_error" in probe:
            print(f"GpuRuntimeError: {probe['gpu_error']}")
            return 2
        for p in ready:
            _run_program(p, folder, options, started, env, scratch)
            p["versus_fastest_peer"] = _versus_fastest_peer(p)
            if "flop" in p:
                p["tflop_per_s"] = _tflop_per_s(p)
    failures = sum(p["status"] != "ok" for p in ready)
    report = {
        "device": probe["device"],
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "prepared": {k: manifest[k] for k in ("chip", "prepared", "commit", "ptxas")},
        "options": dataclasses.asdict(options),
        "mlir_imported": any(p.get("mlir_imported", False) for p in programs),
        "wall_s": round(time.monotonic() - started, 1),
        "programs": programs,
    }
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    print(_table(report, markdown=False))
    markdown_path = os.path.join(os.path.dirname(json_path), "gpu_check.md")
    with open(markdown_path, "w") as f:
        f.write(_markdown(report))
    print(f"wrote {json_path} and {markdown_path}")
    return 1 if failures else 0


def _run_program(p: dict, folder: str, options: RunOptions, started: float, env: dict, scratch: str) -> None:
    """Check and time program `p` in a child process; fold its record (or what happened to it)
    into `p`."""
    left = options.budget_s - (time.monotonic() - started)
    if left <= 0:
        p["status"], p["error"] = "skipped", f"not started: the run's budget of {options.budget_s:g} s was spent"
        return
    timeout_s = min(options.timeout_s, left)
    record_path = os.path.join(scratch, f"{p['name'].replace(':', '_')}.json")
    clock = time.monotonic()
    record, failure, stderr = _run_child(
        ["run-one", p["name"], "--dir", folder, *options.child_args()], record_path, timeout_s, env
    )
    if failure and failure.startswith("timed out") and timeout_s < options.timeout_s:
        failure += f" (what was left of the run's budget of {options.budget_s:g} s)"
    p.update(record or {})
    p["wall_s"] = round(time.monotonic() - clock, 1)
    if failure is None:
        return
    stage = p.pop("stage", "loading")
    if not failure.startswith("timed out") and _last_line(stderr):
        failure += f": {_last_line(stderr)}"
    if stage in PEERS:  # flowjit's part is done: the peer in progress is what failed
        p.setdefault("peers", {})[stage] = {"error": failure}
        for peer in options.peers[options.peers.index(stage) + 1 :]:
            p["peers"][peer] = {"error": f"not run: the process ended during {stage}"}
        return
    p["status"] = "timeout" if failure.startswith("timed out") else "crashed"
    p["error"] = f"{stage}: {failure}"


def _run_child(args: list[str], record_path: str, timeout_s: float, env: dict) -> tuple[dict | None, str | None, str]:
    """Run `device_check.py ARGS --record RECORD_PATH` in a new session (killed with its own
    children after `timeout_s`): (the record it wrote last or None, what went wrong or None, its
    stderr)."""
    command = [sys.executable, os.path.abspath(__file__), *args, "--record", record_path]
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _, stderr = child.communicate(timeout=timeout_s)
        failure = None if child.returncode == 0 else _ended(child.returncode)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # its session: torch.compile's workers go with it
        except ProcessLookupError:
            pass  # it ended between the timeout and the kill
        failure = f"timed out: killed after {timeout_s:.0f} s"
        try:
            _, stderr = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stderr = "(its output could not be read within 30 s of the kill)"
    if not os.path.exists(record_path):
        return None, failure or "wrote no record", stderr
    with open(record_path) as f:
        return json.load(f), failure, stderr


def _ended(returncode: int) -> str:
    return f"killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


# --- the children: `probe` (every program loaded, a first call) and `run-one NAME` ----------------


def load_programs(folder: str, names: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """The manifest and each program of it (those of `names` when given), with, for each compiled
    one, its inputs, expected outputs and executable from the cache (never compiled here: a
    program missing from the cache is reported as such)."""
    os.environ["FLOWJIT_CACHE_DIR"] = os.path.join(folder, "cache")
    os.environ.pop("FLOWJIT_CACHE", None)
    os.chdir(ROOT)
    import flowjit as fj
    from flowjit.backends.gpu import cache
    from flowjit.backends.gpu.backend import GpuExecutable
    from flowjit.backends.gpu.pipeline import GpuOptions
    from flowjit.ir.printer import print_graph

    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    known = [p["name"] for p in manifest["programs"]]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"no program {', '.join(unknown)} in {folder}/manifest.json; it has {', '.join(known)}")
    entries = [p for p in manifest["programs"] if not names or p["name"] in names]
    options = GpuOptions(chip=manifest["chip"])
    rows = dict(_op_rows()) if any(p["kind"] == "row" for p in entries) else {}
    by_name = {p.name: p for p in PROGRAMS}
    loaded = []
    for entry in entries:
        item = dict(entry)
        loaded.append(item)
        if entry["status"] != "compiled":
            continue
        if entry.get("check") == "sampled":
            program = by_name[entry["name"]]
            inputs = _inputs(program, entry["tiny"])
            item["expected"] = program.sampled.reference(inputs)
            item["sample"] = program.sampled.sample
        else:
            data = np.load(os.path.join(folder, entry["data"]))
            inputs = [data[f"in{i}"] for i in range(sum(k.startswith("in") for k in data.files))]
            item["expected"] = [data[f"out{i}"] for i in range(sum(k.startswith("out") for k in data.files))]
        item["inputs"] = inputs
        if entry["kind"] == "split":
            _load_split(item, by_name[entry["name"]], manifest["chip"])
            continue
        if entry["kind"] == "row":
            graph = rows[entry["name"]].graph
        else:
            graph = fj.jit(by_name[entry["name"]].fn).lower(*inputs).graph("optimized")
        cached = cache.load(cache.cache_key(print_graph(graph), options))
        if cached is None:
            item["status"] = "cache miss"
            item["error"] = "the program's IR differs from the prepared one (or the cache folder was refused)"
            continue
        item["status"] = "loaded"
        item["executable"] = GpuExecutable(cached, 0, "disk cache")
    return manifest, loaded


def _load_split(item: dict, program: Program, chip: str) -> None:
    """The split's partitions: the GPU one from the cache (a miss would need MLIR: reported, not
    compiled), the CPU ones on the interpreter. Placement needs the GPU the driver shows."""
    import flowjit as fj
    from flowjit.backends.gpu.driver import GpuRuntimeError

    try:
        compiled = fj.jit(program.fn, target=split_target(chip)).lower(*item["inputs"]).compile()
    except (fj.FlowjitError, GpuRuntimeError, ImportError) as error:
        item["status"] = "cache miss" if isinstance(error, ImportError) else "not loaded"
        item["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return
    item["status"] = "loaded"
    item["executable"] = compiled.executable


def probe(folder: str, record_path: str, options: RunOptions) -> None:
    """Load every program and make a first call on GPU 0: the record holds each program's load
    status, whether MLIR was imported, and the device or the runtime's reason it cannot be used."""
    _, programs = load_programs(folder, options.only)
    from flowjit.backends.gpu import driver
    from flowjit.backends.gpu.driver import GpuRuntimeError

    record = {"mlir_imported": "mlir" in sys.modules, "programs": [_public(p) for p in programs]}
    ready = [p for p in programs if "executable" in p]
    try:  # the real path: the runtime says what is missing
        if ready:
            ready[0]["executable"].run(ready[0]["inputs"])
        version = driver.call("cuDriverGetVersion")
        record["device"] = {
            "name": driver.device_name(0),
            "capability": ".".join(map(str, driver.compute_capability(0))),
            "driver": f"{version // 1000}.{version % 1000 // 10}",
        }
    except GpuRuntimeError as error:
        record["gpu_error"] = str(error)
    _write_record(record_path, record)


def run_one(folder: str, name: str, record_path: str, options: RunOptions) -> None:
    """Check and time program `name` with flowjit, then each peer; the record is rewritten before
    each stage (its `stage` names the one in progress), so the parent knows where a child that
    hangs or dies stopped."""
    record = {"name": name, "stage": "loading", "pid": os.getpid()}
    _write_record(record_path, record)
    _, (p,) = load_programs(folder, (name,))
    from flowjit.backends.gpu.driver import GpuRuntimeError

    record.update(_public(p), stage="flowjit")
    _write_record(record_path, record)
    if "executable" in p:
        check = _check_and_time_split if p["kind"] == "split" else _check_and_time_flowjit
        try:
            record.update(check(p, options.repeat))
        except GpuRuntimeError as error:
            record["status"], record["error"] = "error", str(error)
    record["mlir_imported"] = "mlir" in sys.modules  # flowjit's part is done: the peers may import what they like
    _write_record(record_path, record)
    if record["mlir_imported"]:
        raise SystemExit("the run side imported MLIR")
    if record["status"] in ("ok", "mismatch") and p["kind"] == "program":
        record["peers"] = {}
        for peer in options.peers:
            record["stage"] = peer
            _write_record(record_path, record)
            record["peers"][peer] = run_peer(peer, p, options.repeat, options.peer_device)
    del record["stage"]
    _write_record(record_path, record)


def _public(p: dict) -> dict:
    return {k: v for k, v in p.items() if k not in ("executable", "inputs", "expected", "sample", "data")}


def _write_record(path: str, record: dict) -> None:
    with open(path + ".part", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".part", path)


def _check_and_time_flowjit(p: dict, repeat: int) -> dict:
    """flowjit end to end (host arrays in and out) and with inputs and results in device memory
    (`fj.device_put`, `keep_on_device`); both results are compared with the expected ones."""
    import flowjit as fj

    executable = p["executable"]
    on_device = [fj.device_put(a, "gpu:0") for a in p["inputs"]]
    outputs = executable.run(p["inputs"])
    kept, _ = executable.run_resident(on_device, keep_results=True)
    errors = [compare(outputs, p), compare([np.asarray(o) for o in kept], p)]
    return {
        "status": "ok" if all(e["matches"] for e in errors) else "mismatch",
        "max_abs_error": max(e["max_abs_error"] for e in errors),
        "loaded": sorted(set(executable.runner().loading_report().values())),
        "flowjit_ms": median_ms(lambda: executable.run(p["inputs"]), repeat),
        "flowjit_device_ms": median_ms(lambda: executable.run_resident(on_device, keep_results=True), repeat),
    }


def _check_and_time_split(p: dict, repeat: int) -> dict:
    """The split end to end (host arrays in and out; the GPU partition's inputs and results cross
    through the host<->GPU transfers), compared with the CPU-only result."""
    executable = p["executable"]
    error = compare(executable.run(p["inputs"]), p)
    return {
        "status": "ok" if error["matches"] else "mismatch",
        "max_abs_error": error["max_abs_error"],
        "backends": executable.backend,
        "flowjit_ms": median_ms(lambda: executable.run(p["inputs"]), repeat),
    }


# --- the report: a table for the terminal, the same as Markdown for benchmarks/RESULTS.md --------

# (header, peer or None for flowjit, the record's key)
COLUMNS = (
    ("flowjit", None, "flowjit_ms"),
    ("flowjit dev", None, "flowjit_device_ms"),
    ("torch e2e", "torch", "end_to_end_ms"),
    ("torch dev", "torch", "on_device_ms"),
    ("compile dev", "torch.compile", "on_device_ms"),
    ("jax e2e", "jax", "end_to_end_ms"),
    ("jax dev", "jax", "on_device_ms"),
)


# (the ratio's name, flowjit's time, the peers' time)
RATIOS = (("end_to_end", "flowjit_ms", "end_to_end_ms"), ("on_device", "flowjit_device_ms", "on_device_ms"))


def _versus_fastest_peer(p: dict) -> dict:
    """For each of RATIOS: the fastest peer (among those whose result matched) and flowjit's time
    over its time."""
    versus = {}
    for ratio, flowjit_key, peer_key in RATIOS:
        times = {peer: r[peer_key] for peer, r in p.get("peers", {}).items() if r.get("matches") and peer_key in r}
        if times and flowjit_key in p:
            fastest = min(times, key=times.get)
            versus[ratio] = {"fastest_peer": fastest, "ratio": p[flowjit_key] / times[fastest]}
    return versus


def _tflop_per_s(p: dict) -> dict:
    """The program's `flop` over each on-device time (flowjit's and each peer's whose result
    matched), in TFLOP/s."""
    times = {"flowjit": p.get("flowjit_device_ms")}
    times |= {peer: r.get("on_device_ms") for peer, r in p.get("peers", {}).items() if r.get("matches")}
    return {who: p["flop"] / (ms * 1e9) for who, ms in times.items() if ms}


def _cells(p: dict) -> list[str]:
    cells = [p["status"], f"{p['max_abs_error']:.2e}" if "max_abs_error" in p else "-"]
    for _, peer, key in COLUMNS:
        record = p if peer is None else p.get("peers", {}).get(peer, {})
        mark = "" if peer is None or record.get("matches", True) else "!"  # a peer whose result is wrong
        cells.append(f"{record[key]:.3f}{mark}" if key in record else "-")
    for ratio, _, _ in RATIOS:
        versus = p.get("versus_fastest_peer", {}).get(ratio)
        cells.append(f"{versus['ratio']:.2f}" if versus else "-")
    return cells


def _notes(p: dict) -> list[str]:
    notes = [p["error"][:300]] if p.get("error") else []
    for peer, record in p.get("peers", {}).items():
        if "error" in record:
            notes.append(f"{peer}: {record['error']}")
        elif not record["matches"]:
            notes.append(
                f"{peer}: its result is off (max |err| {record['max_abs_error']:.2e} > rtol x max |expected| + atol)"
            )
    compiling = [f"{peer} {r['compile_ms']:.0f} ms" for peer, r in p.get("peers", {}).items() if "compile_ms" in r]
    notes += [f"first call (compiling): {', '.join(compiling)}"] if compiling else []
    rates = [f"{who} {rate:.3g}" for who, rate in p.get("tflop_per_s", {}).items()]
    return notes + ([f"TFLOP/s on device: {', '.join(rates)}"] if rates else [])


HEADERS = ("program", "status", "max|err|", *(c[0] for c in COLUMNS), "e2e ratio", "dev ratio")


def _table(report: dict, markdown: bool) -> str:
    """The results as a terminal table (notes indented under each program) or a Markdown one (notes
    in a list after it)."""
    rows = [[p["name"], *_cells(p)] for p in report["programs"]] if "programs" in report else []
    if markdown:
        lines = ["| " + " | ".join(h.replace("|", "\\|") for h in HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        notes = [f"- {p['name']}: {note}" for p in report["programs"] for note in _notes(p)]
        return "\n".join(lines + ([""] + notes if notes else []))
    device = report["device"]
    lines = [f"device: {device['name']} (compute capability {device['capability']}, driver {device['driver']})"]
    widths = (34, 12, 9, *([11] * (len(HEADERS) - 3)))
    lines.append(" ".join(f"{h:>{w}}" if i > 1 else f"{h:{w}}" for i, (h, w) in enumerate(zip(HEADERS, widths))))
    lines.append("-" * len(lines[-1]))
    for p, row in zip(report["programs"], rows):
        lines.append(" ".join(f"{c:>{w}}" if i > 1 else f"{c[:w]:{w}}" for i, (c, w) in enumerate(zip(row, widths))))
        lines += [f"    {note}" for note in _notes(p)]
    lines.append(
        "times: medians in ms; dev = inputs and results in device memory; ratio = flowjit / the fastest peer"
        " whose result matched; '!' = a peer whose result did not match"
    )
    return "\n".join(lines)


def _markdown(report: dict) -> str:
    """A section for benchmarks/RESULTS.md: device, driver, command, date, the table."""
    device, prepared, options = report["device"], report["prepared"], report["options"]
    return "\n".join(
        [
            f"### GPU device check: {device['name']}, {report['date'][:10]}",
            "",
            f"{device['name']} (compute capability {device['capability']}), driver {device['driver']}; programs"
            f" prepared for {prepared['chip']} at commit {prepared['commit']} (ptxas {prepared['ptxas']});"
            f" peers on {options['peer_device']}. Run on {report['date']} with:",
            "",
            "```",
            report["command"],
            "```",
            "",
            f"Medians of {options['repeat']} calls, in ms, each program in a process of its own. e2e: host"
            " arrays in and out; dev: inputs and results in device memory. Ratios: flowjit over the fastest"
            " peer whose result matched ('!' marks a peer whose result did not).",
            "",
            _table(report, markdown=True),
            "",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    p = modes.add_parser("prepare", help="compile the programs into a cache folder (needs MLIR)")
    p.add_argument("--out", default=DEFAULT_DIR)
    p.add_argument("--chip", default="sm_90")
    p.add_argument("--tiny", action="store_true", help="tiny inputs and the programs of TINY (the tests' set)")
    r = modes.add_parser("run", help="check and time the prepared programs on GPU 0, a process each (no MLIR)")
    r.add_argument("--json", default=None, help="the report (default DIR/results.json; gpu_check.md beside it)")
    r.add_argument("--timeout", type=float, default=60.0, help="seconds each program's process may take")
    r.add_argument("--budget", type=float, default=270.0, help="seconds for the whole run; later programs are skipped")
    probe_mode = modes.add_parser("probe", help="(a child of run) load the programs, make a first call on GPU 0")
    one = modes.add_parser("run-one", help="(a child of run) check and time one program")
    one.add_argument("name")
    for mode in (r, probe_mode, one):
        mode.add_argument("--dir", default=DEFAULT_DIR)
        mode.add_argument("--repeat", type=int, default=20)
        mode.add_argument("--peer-device", default="cuda", help="where the peers run: cuda, or cpu (for tests)")
        mode.add_argument("--peers", default=",".join(PEERS), help="comma-separated, among " + ", ".join(PEERS))
        mode.add_argument("--only", default="", help="comma-separated program names (default: every program)")
    for mode in (probe_mode, one):
        mode.add_argument("--record", required=True, help="the JSON record this child writes")
    args = parser.parse_args(argv)
    if args.mode == "prepare":
        manifest = prepare(os.path.abspath(args.out), args.chip, args.tiny)
        for entry in manifest["programs"]:
            print(f"{entry['name']:34} {entry['status']}" + (f": {entry['error']}" if "error" in entry else ""))
        return 0
    bounds = {"timeout_s": args.timeout, "budget_s": args.budget} if args.mode == "run" else {}
    options = RunOptions(
        repeat=args.repeat,
        peer_device=args.peer_device,
        peers=tuple(name for name in args.peers.split(",") if name),
        only=tuple(name for name in args.only.split(",") if name),
        **bounds,
    )
    folder = os.path.abspath(args.dir)
    if args.mode == "probe":
        probe(folder, args.record, options)
        return 0
    if args.mode == "run-one":
        run_one(folder, args.name, args.record, options)
        return 0
    return run(folder, os.path.abspath(args.json or os.path.join(folder, "results.json")), options)


if __name__ == "__main__":
    sys.exit(main())
