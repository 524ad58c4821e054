"""The target-independent half of code generation: flowjit IR -> MLIR on tensors and linalg, and
the runner of MLIR pass pipelines. Backends (`backends/cpu`, later a GPU one) build on it; it
imports none of them.

    emitter.py    building MLIR text: one function's lines, `linalg.generic` bodies, types
    pipeline.py   running pass pipelines: context, pass managers, verifier, reproducers, translation
"""
