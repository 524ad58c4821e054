"""The dataflow IR: dtypes, tensor types, values/ops/graphs, the op registry, printer, parser,
verifier and reference interpreter."""

from flowjit.ir import ops  # noqa: F401
