"""Keeps benchmarks/run.py from rotting: tiny sizes, numpy and flowjit only, and the workloads that
compile fastest (cnn and layernorm take seconds of native compile even when tiny), so every part of
the runner runs (preflight, interleaved timing, report, memory probe) in a few seconds."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("elementwise", "matmul1024", "softmax", "sum", "call_overhead", "mlp_train_step")


def test_runner_on_tiny_sizes(tmp_path):
    out = tmp_path / "RESULTS.md"
    command = [sys.executable, "benchmarks/run.py", "--quick", "--sizes", "tiny", "--peers", "numpy,flowjit"]
    command += [
        "--only",
        ",".join(WORKLOADS),
        "--out",
        str(out),
        "--no-distributed",
        "--no-loop-grad",
        "--no-vmap",
        "--no-donation",
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    for name in WORKLOADS:
        assert f"### {name}:" in report
    rows = {peer: [] for peer in ("numpy", "flowjit")}
    for line in report.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)]  # pipes in messages are escaped
        if len(cells) == 12 and cells[1] in rows:  # a peer row of a workload table
            rows[cells[1]].append(cells)
    assert len(rows["numpy"]) == len(rows["flowjit"]) == len(WORKLOADS)
    # numpy always runs and matches its own float64 run; flowjit rows are either reported failures or
    # skips (flowjit's own tests own those) or agree with the reference (column 7: relative error).
    assert all(float(cells[7]) < 1e-6 for cells in rows["numpy"]), rows["numpy"]
    ran = [cells for cells in rows["flowjit"] if not cells[2].startswith(("failed: ", "skipped: "))]
    assert all(float(cells[7]) < 1e-5 for cells in ran), ran
    # column 4: the call after each settling pause, timed apart from the steady-state samples
    assert all(re.fullmatch(r"[\d.]+ [nµm]?s", cells[4]) for cells in rows["numpy"] + ran), ran
    assert "## Memory" in report and "flowjit first call" in report


def test_distributed_benchmark_runs():
    pytest.importorskip("ray", reason="the `distributed` extra (Ray) is not installed")
    proc = subprocess.run(
        [sys.executable, "benchmarks/distributed.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 8 and "4 MiB cross-task transfer" in proc.stdout  # the header and seven measures


def test_loop_grad_benchmark_lstm_gradients_agree_between_fori_loop_and_scan(monkeypatch):
    # benchmarks/loop_grad.py's LSTM written with fj.fori_loop and with fj.scan (JAX and PyTorch are
    # the bench extra's, not needed here): the same gradient, at a tiny size.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import loop_grad

    inputs = loop_grad.lstm_inputs(steps=3, batch=2, hidden=4)
    fori = loop_grad.flowjit_gradient(inputs)()
    scan = loop_grad.flowjit_gradient(inputs, "scan")()
    assert [g.shape for g in scan] == [(4, 16), (4, 16), (16,), (3, 2, 4)]
    for a, b in zip(fori, scan):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
