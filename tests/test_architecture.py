"""The import contracts of pyproject.toml ([tool.importlinter]): flowjit's layers only import down,
function-level imports included, with no cycles between its subpackages or inside backends/
(docs/architecture.md). A change that breaks one fails here with import-linter's report."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_are_kept():
    run = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert "BROKEN" not in report and report.count("KEPT") >= 5, report
