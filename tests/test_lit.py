"""Runs the lit suite (`tests/lit`: text IR in, FileCheck out) with the venv's lit; any failing lit
test fails this test with lit's report."""

from __future__ import annotations

import os
import subprocess
import sys

LIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lit")


def test_lit_suite():
    lit = os.path.join(os.path.dirname(sys.executable), "lit")
    assert os.path.exists(lit), f"lit is not installed next to {sys.executable}; run 'make test' to bootstrap .venv"
    proc = subprocess.run([lit, "-q", "-v", LIT_DIR], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"lit failed:\n{proc.stdout}\n{proc.stderr}"
    assert "Total Discovered Tests" in proc.stdout, f"lit found no tests:\n{proc.stdout}\n{proc.stderr}"
