"""Composite functions: named compositions of ops (softmax, layer norm, ...) whose graphs a layer
above the backends registers, so that a backend can recognize a fused region that is exactly one of
them, op for op, and run a routine of its own instead (the CPU row library does).

The graphs are written with `flowjit.nn` and traced by the frontend, layers above the backends, so
those layers register a builder per name (`flowjit/nn/composites.py`); backends only ask for the
graph of a name and operand types.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from flowjit.ir.graph import Graph
from flowjit.ir.types import TensorType

# The eps the registered norms are traced with: a value no canonicalization folds away, exact in
# float32 and float64, whose constants mark where a matched region's own eps is.
EPS_MARKER = 2.0**-7 + 2.0**-20


@dataclass(frozen=True)
class Composite:
    """`build(types)`: the optimized graph of the composite for operands of `types`."""

    name: str
    arity: int
    build: Callable[[tuple[TensorType, ...]], Graph]


COMPOSITES: dict[str, Composite] = {}


def register_composite(name: str, arity: int, build: Callable[[tuple[TensorType, ...]], Graph]) -> None:
    """Register the composite `name` of `arity` operands, whose graph `build(types)` returns."""
    COMPOSITES[name] = Composite(name, arity, build)
    composite_graph.cache_clear()


@functools.lru_cache(maxsize=64)
def composite_graph(name: str, types: tuple[TensorType, ...]) -> Graph | None:
    """The optimized graph of composite `name` for operands of `types` (cached: tracing costs milliseconds);
    None when no composite of that name and arity is registered."""
    composite = COMPOSITES.get(name)
    if composite is None or composite.arity != len(types):
        return None
    return composite.build(types)
