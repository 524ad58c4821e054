"""The GPU device check: compile here, run there (issue #38, docs/gpu-backend.md).

    python benchmarks/gpu/device_check.py prepare [--out DIR] [--chip sm_90] [--tiny]
        on a machine with MLIR (this one): compiles every program below for the GPU into DIR/cache
        (the flowjit disk cache, cubins included where ptxas is found), with its inputs and the
        expected outputs (flowjit's CPU backend, or the op table's numpy reference) in DIR/data,
        and DIR/manifest.json. DIR defaults to benchmarks/gpu/prepared.
    python3 benchmarks/gpu/device_check.py run [--dir DIR] [--json FILE] [--repeat N]
        on the GPU machine (python3 with numpy and cuda-bindings, no MLIR, no network): gets every
        program's executable from DIR/cache without importing MLIR (it checks that `mlir` was
        never imported), runs it, compares with the expected outputs, times it (host arrays in and
        out, as flowjit's API takes them) and, where PyTorch sees the GPU, times PyTorch eager on
        the same inputs: end to end (host arrays in and out) and on device-resident tensors.
        Prints a table and writes FILE (default DIR/results.json). Exit status: 0 when every
        compiled program matched, 1 when one did not, 2 when no GPU could be used (the reason is
        printed: it is the runtime's GpuRuntimeError).

Programs the GPU cannot compile (`newton_sqrt`: a while loop, which stays on the CPU) are listed
as such, with the compile error, never silently dropped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DIR = os.path.join(ROOT, "benchmarks", "gpu", "prepared")
# Relative tolerance and absolute floor of a program's comparison with the CPU backend.
RTOL, ATOL = 1e-4, 1e-5


# --- the programs ------------------------------------------------------------------------------
# Each is a flowjit function, its inputs (full and tiny sizes), and its PyTorch eager twin.


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
    import flowjit as fj
    import flowjit.numpy as fnp

    def loss(w1, b1, w2):
        return fnp.mean((fnp.tanh(x @ w1 + b1) @ w2 - y) ** 2)

    g1, gb, g2 = fj.grad(loss, argnums=(0, 1, 2))(w1, b1, w2)
    return w1 - 0.01 * g1, b1 - 0.01 * gb, w2 - 0.01 * g2


def _torch_train_step(x, y, w1, b1, w2):
    import torch

    params = [t.detach().requires_grad_() for t in (w1, b1, w2)]
    loss = ((torch.tanh(x @ params[0] + params[1]) @ params[2] - y) ** 2).mean()
    grads = torch.autograd.grad(loss, params)
    return tuple((p - 0.01 * g).detach() for p, g in zip(params, grads))


def newton_sqrt(x):
    """A while loop: control flow stays on the CPU (the GPU's CPU_ONLY table), so this program is
    listed as not compiled, with the reason."""
    import flowjit as fj

    return fj.while_loop(lambda y: y[0, 0] * y[0, 0] > x[0, 0] + 1e-3, lambda y: 0.5 * (y + x / y), x + 1.0)


def _torch(name: str):
    import torch

    return {
        "chain": lambda x, y: torch.tanh(x * y + 1.0) * torch.exp(-x) + torch.log(y * y + 1.0),
        "softmax": lambda x: torch.softmax(x, dim=1),
        "layer_norm": lambda x, g: (
            (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * g
        ),
        "whole_sum": lambda x: x.sum(),
        "column_sum": lambda x: x.sum(0),
        "mlp_forward": lambda x, w1, b1, w2: torch.tanh(x @ w1 + b1) @ w2,
        "mlp_train_step": _torch_train_step,
    }[name]


@dataclass(frozen=True)
class Program:
    name: str
    fn: Callable
    shapes: tuple[tuple[int, ...], ...]
    tiny: tuple[tuple[int, ...], ...]


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
    Program("newton_sqrt", newton_sqrt, ((64, 64),), ((4, 4),)),
]
# Op-table rows (tests/op_table.py) the GPU lowers: numerics only (small, untimed).
OP_ROWS = ("exp", "tanh", "add", "broadcast", "transpose", "reduce_sum", "reduce_max")
TINY = {"chain", "whole_sum", "mlp_forward", "newton_sqrt"}


def _inputs(program: Program, tiny: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(len(program.name))
    return [rng.standard_normal(shape).astype(np.float32) for shape in (program.tiny if tiny else program.shapes)]


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
        entry = {"name": program.name, "kind": "program", "tiny": tiny}
        try:
            fj.jit(program.fn, target=target).lower(*inputs).compile()
        except fj.FlowjitError as error:
            entry["status"] = "not compiled"
            entry["error"] = str(error).splitlines()[0]
            entries.append(entry)
            continue
        os.environ["FLOWJIT_CACHE"] = "0"  # the CPU's code stays out of the folder that travels
        try:
            expected = fj.jit(program.fn, target="cpu")(*inputs)
        finally:
            del os.environ["FLOWJIT_CACHE"]
        entry["status"] = "compiled"
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


# --- run (there: no MLIR) ------------------------------------------------------------------------


def load_programs(folder: str) -> tuple[dict, list[dict]]:
    """The manifest and, for each compiled program, its executable from the cache (never compiled
    here: a program missing from the cache is reported as such)."""
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
    options = GpuOptions(chip=manifest["chip"])
    rows = {case_id: case for case_id, case in _op_rows()} if any(
        p["kind"] == "row" for p in manifest["programs"]
    ) else {}  # fmt: skip
    by_name = {p.name: p for p in PROGRAMS}
    loaded = []
    for entry in manifest["programs"]:
        item = dict(entry)
        loaded.append(item)
        if entry["status"] != "compiled":
            continue
        data = np.load(os.path.join(folder, entry["data"]))
        inputs = [data[f"in{i}"] for i in range(sum(k.startswith("in") for k in data.files))]
        item["expected"] = [data[f"out{i}"] for i in range(sum(k.startswith("out") for k in data.files))]
        item["inputs"] = inputs
        if entry["kind"] == "row":
            graph = rows[entry["name"]].graph
        else:
            graph = fj.jit(by_name[entry["name"]].fn).lower(*inputs).graph("optimized")
        cached = cache.load(cache.cache_key(print_graph(graph), options))
        if cached is None:
            item["status"] = "cache miss"
            item["error"] = "the program's IR differs from the prepared one (or the cache folder was refused)"
            continue
        item["executable"] = GpuExecutable(cached, 0, "disk cache")
    return manifest, loaded


def run(folder: str, json_path: str, repeat: int) -> int:
    manifest, programs = load_programs(folder)
    from flowjit.backends.gpu import driver
    from flowjit.backends.gpu.driver import GpuRuntimeError

    ready = [p for p in programs if "executable" in p]
    print(f"loaded {len(ready)} of {len(programs)} programs from {folder} (mlir imported: {'mlir' in sys.modules})")
    assert "mlir" not in sys.modules, "the run side imported MLIR"
    if not ready:
        print("nothing to run")
        return 1
    try:  # the real path: the runtime says what is missing
        ready[0]["executable"].run(ready[0]["inputs"])
    except GpuRuntimeError as error:
        print(f"GpuRuntimeError: {error}")
        return 2
    device = {"name": driver.device_name(0), "capability": ".".join(map(str, driver.compute_capability(0)))}
    torch_ok = _torch_cuda()
    failures = 0
    for p in programs:
        if "executable" not in p:
            continue
        try:
            _check_and_time(p, repeat, torch_ok)
        except GpuRuntimeError as error:
            p["status"], p["error"] = "error", str(error)
        failures += p["status"] != "ok"
    _print_table(device, programs)
    report = {
        "device": device,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "prepared": {k: manifest[k] for k in ("chip", "prepared", "commit", "ptxas")},
        "mlir_imported": "mlir" in sys.modules,
        "programs": [
            {k: v for k, v in p.items() if k not in ("executable", "inputs", "expected", "data")} for p in programs
        ],
    }
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {json_path}")
    return 1 if failures else 0


def _check_and_time(p: dict, repeat: int, torch_ok: bool) -> None:
    executable = p["executable"]
    outputs = executable.run(p["inputs"])
    errors = [
        float(np.max(np.abs(o.astype(np.float64) - e.astype(np.float64)), initial=0.0))
        for o, e in zip(outputs, p["expected"])
    ]
    close = all(
        np.allclose(o, e, rtol=p["rtol"], atol=p["atol"], equal_nan=True) for o, e in zip(outputs, p["expected"])
    )
    p["max_abs_error"] = max(errors, default=0.0)
    p["status"] = "ok" if close else "mismatch"
    p["loaded"] = sorted(set(executable.runner().loading_report().values()))
    p["flowjit_ms"] = _median_ms(lambda: executable.run(p["inputs"]), repeat)
    if torch_ok and p["kind"] == "program":
        p.update(_time_torch(p, repeat))


def _median_ms(call: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        call()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples) * 1e3)


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _time_torch(p: dict, repeat: int) -> dict:
    import torch

    fn = _torch(p["name"])
    on_device = [torch.from_numpy(a).cuda() for a in p["inputs"]]

    def end_to_end():
        args = [torch.from_numpy(a).cuda() for a in p["inputs"]]
        out = fn(*args)
        return [t.cpu() for t in out] if isinstance(out, tuple) else out.cpu()

    def device_only():
        fn(*on_device)
        torch.cuda.synchronize()

    return {
        "torch_end_to_end_ms": _median_ms(end_to_end, repeat),
        "torch_on_device_ms": _median_ms(device_only, repeat),
    }


def _cell(p: dict, key: str, fmt: str = "{:.3f}") -> str:
    return fmt.format(p[key]) if key in p else "-"


def _print_table(device: dict, programs: list[dict]) -> None:
    print(f"device: {device['name']} (compute capability {device['capability']})")
    header = f"{'program':34} {'status':12} {'max|err|':>10} {'flowjit ms':>11} {'torch e2e':>10} {'torch dev':>10}"
    print(header)
    print("-" * len(header))
    for p in programs:
        print(
            f"{p['name'][:34]:34} {p['status']:12} {_cell(p, 'max_abs_error', '{:.2e}'):>10} "
            f"{_cell(p, 'flowjit_ms'):>11} {_cell(p, 'torch_end_to_end_ms'):>10} {_cell(p, 'torch_on_device_ms'):>10}"
        )
        if p.get("error"):
            print(f"    {p['error'][:300]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    p = modes.add_parser("prepare", help="compile the programs into a cache folder (needs MLIR)")
    p.add_argument("--out", default=DEFAULT_DIR)
    p.add_argument("--chip", default="sm_90")
    p.add_argument("--tiny", action="store_true", help="tiny inputs and three programs (the test's set)")
    r = modes.add_parser("run", help="run the prepared programs on GPU 0 (no MLIR)")
    r.add_argument("--dir", default=DEFAULT_DIR)
    r.add_argument("--json", default=None)
    r.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    if args.mode == "prepare":
        manifest = prepare(os.path.abspath(args.out), args.chip, args.tiny)
        for entry in manifest["programs"]:
            print(f"{entry['name']:34} {entry['status']}" + (f": {entry['error']}" if "error" in entry else ""))
        return 0
    folder = os.path.abspath(args.dir)
    return run(folder, os.path.abspath(args.json or os.path.join(folder, "results.json")), args.repeat)


if __name__ == "__main__":
    sys.exit(main())
