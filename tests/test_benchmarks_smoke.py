"""Keeps benchmarks/run.py from rotting: the whole suite on tiny sizes, numpy and flowjit only."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("elementwise", "matmul1024", "matmul2048", "softmax", "layernorm", "cnn", "sum", "call_overhead")


def test_runner_on_tiny_sizes(tmp_path):
    out = tmp_path / "RESULTS.md"
    command = [sys.executable, "benchmarks/run.py", "--quick", "--sizes", "tiny", "--peers", "numpy,flowjit"]
    proc = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert "failed" not in report
    for name in (*WORKLOADS, "mlp_train_step"):
        assert f"### {name}:" in report
    # Every flowjit row that ran agrees with the float64 reference (column 6 is the relative error).
    flowjit_rows = [line.split("|") for line in report.splitlines() if line.startswith("| flowjit | ")]
    ran = [row for row in flowjit_rows if "skipped" not in row[2]]
    assert len(ran) >= len(WORKLOADS)
    assert all(float(row[6]) < 1e-5 for row in ran), ran
    assert "## Memory" in report and "flowjit first call" in report
