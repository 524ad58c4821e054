"""lit configuration: text IR in (`.fj`), FileCheck out. Run as `lit tests/lit` with the venv's lit;
`flowjit` and `filecheck` in RUN lines are the commands installed next to that Python."""

import os
import sys

import lit.formats

config.name = "flowjit"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".fj"]
config.test_source_root = os.path.dirname(os.path.abspath(__file__))
# Output/ directories go under build/ (ignored by git), not next to the tests.
repo_root = os.path.dirname(os.path.dirname(config.test_source_root))
config.test_exec_root = os.path.join(repo_root, "build", "lit")

bin_dir = os.path.dirname(sys.executable)
for tool in ("flowjit", "filecheck"):
    path = os.path.join(bin_dir, tool)
    if not os.path.exists(path):
        lit_config.fatal(f"'{tool}' is not installed next to {sys.executable}; run 'make test' to bootstrap .venv")
    # Only the command word: never part of a path (/x/flowjit/...) or a longer name (flowjit.cli).
    config.substitutions.append((rf"(?<![\w/.-]){tool}(?![\w/.-])", path))

# `REQUIRES: avx512`: tests of code that only 64-byte vectors make (non-temporal whole-line stores).
try:
    from flowjit.backends.cpu.host import vector_bits

    if vector_bits() == 512:
        config.available_features.add("avx512")
except Exception:  # no usable CPU backend here: such tests report UNSUPPORTED
    pass
# `REQUIRES: cores2`: tests of code for products split over two or more cores (the matmul library).
if (os.cpu_count() or 1) >= 2:
    config.available_features.add("cores2")
