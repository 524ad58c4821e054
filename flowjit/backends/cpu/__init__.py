"""The CPU backend: flowjit IR -> MLIR -> LLVM -> native code for the host CPU (see compiler.py)."""
