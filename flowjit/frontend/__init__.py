"""Tracing Python functions into flowjit IR: tracers, pytrees, jit and its caches."""
