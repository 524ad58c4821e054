"""The target-independent half of code generation: flowjit IR -> MLIR on tensors and linalg, and
the runner of MLIR pass pipelines. Backends (`backends/cpu`, later a GPU one) build on it; it
imports none of them (docs/mlir-layer.md).

    target.py         a target's lowering table, its kernel schedules and math library, and the
                      policies the driver asks it about
    lowering.py       the driver: `lower_graph(graph, target)` -> `MlirModule`
    workspace.py      workspace planning (liveness-based reuse of one buffer)
    sharing.py        one piece per op; identical kernels compiled once
    lower_control.py  cond / for / while on scf, registered by each target
    lower_elementwise.py, lower_reduction.py, lower_layout.py, lower_movement.py
                      elementwise ops, reductions, broadcast/reshape/transpose, slices (and the
                      movement helpers), scheduled by the target; registered by each target
    emitter.py        building MLIR text: one function's lines, `linalg.generic` bodies, types
    pipeline.py       running pass pipelines: context, pass managers, verifier, reproducers, translation
"""
